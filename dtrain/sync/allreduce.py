"""Synchronous data parallelism by ring all-reduce: torch DDP's reducer buckets gradients and overlaps
their all-reduce with the rest of the backward pass; every replica applies the same averaged gradient."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm import Topology


class AllReduceStrategy:
    """DDP with buckets of `bucket_cap_mb`; with one process the model runs unwrapped (nothing to sync)."""

    name = "allreduce"

    def __init__(self, topology: Topology, *, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False
                 ) -> None:
        self.topology = topology
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self._model: nn.Module | None = None
        self._wrapped: nn.Module | None = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._model = model
        if not self.topology.is_distributed:
            self._wrapped = model
            return model
        device_ids = [self.topology.device.index] if self.topology.device.type == "cuda" else None
        self._wrapped = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb,
                                                find_unused_parameters=self.find_unused_parameters,
                                                gradient_as_bucket_view=True)
        return self._wrapped

    def unwrap_model(self) -> nn.Module:
        assert self._model is not None, "wrap_model() first"
        return self._model

    def no_sync(self) -> AbstractContextManager[Any]:
        if isinstance(self._wrapped, DistributedDataParallel):
            return self._wrapped.no_sync()
        return nullcontext()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def close(self) -> None:
        self._wrapped = None
