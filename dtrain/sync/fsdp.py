"""Fully sharded data parallelism with torch's FSDP2 (`fully_shard`): each rank keeps 1/N of every parameter,
gradient and optimizer state (ZeRO stage 3). Forward and backward all-gather a block's parameters just before
it runs and free them after (`reshard_after_forward`); backward reduce-scatters each block's gradients, so
each rank receives the average of its shard only.

Averaging: FSDP2 divides the reduce-scattered sum by the world size itself. On gloo, which has no native
average, torch 2.8 summed instead (pytorch/pytorch#162338: gradients came out x world size);
tests/distributed/test_sharded.py checks the result against single-process training, so that trap fails a test.

Whole-tensor optimizers: parameters are DTensors, and LARS's and LAMB's `torch.linalg.vector_norm(param)` on a
sharded DTensor is a sum of the shards' partial norms all-reduced by DTensor: the trust ratio is the whole
tensor's, on every rank alike (checked by the LARS case of the equivalence test).

Validation and the replica check use a plain copy of the model (`unwrap_model`), filled by gathering the full
parameters when it is stale: every rank holds the whole model only then. Checkpoints are written by every rank,
its own shards of the parameters and optimizer state, through torch.distributed.checkpoint (WritesShardedCheckpoint):
no rank gathers the model for them. `dtrain export` turns such a checkpoint into a plain `model.pt`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

from dtrain.comm import Topology, device_mesh
from dtrain.config import ExperimentConfig

FULL = StateDictOptions(full_state_dict=True)
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded on their own (each gathered just before it runs): the root's children that hold
    parameters, and the items of the root's ModuleLists and Sequentials (a transformer's layers)."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units.extend(item for item in child.children() if any(True for _ in item.parameters()))
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers live on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device="meta"),
                                           requires_grad=parameter.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


class FsdpStrategy:
    """FSDP2 over all workers: the core protocol plus OwnsCheckpointState and Consolidating (the plain copy)."""

    name = "fsdp"

    def __init__(self, topology: Topology, *, reshard_after_forward: bool = True) -> None:
        self.topology = topology
        self.reshard_after_forward = reshard_after_forward
        self._sharded: nn.Module | None = None
        self._plain: nn.Module | None = None
        self._plain_stale = True
        self._plain_allocated = False

    # ------------------------------------------------------------------------------- core protocol

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Shard `model` in place: its parameters become DTensor shards, which the optimizer is built over."""
        self._plain = meta_copy(model)
        mesh = device_mesh(self.topology, (self.topology.world_size,), ("data",))
        for unit in sharding_units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        self._sharded = model
        self._plain_stale = True
        return model

    def unwrap_model(self) -> nn.Module:
        """The plain model, its parameters gathered from every rank when they changed since the last call
        (collective: every rank calls it together, as the Trainer does)."""
        assert self._plain is not None and self._sharded is not None, "wrap_model() first"
        if self._plain_stale:
            if not self._plain_allocated:
                self._plain.to_empty(device=self.topology.device)
                self._plain_allocated = True
            self._plain.load_state_dict(get_model_state_dict(self._sharded, options=FULL))
            self._plain_stale = False
        return self._plain

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the next communicating backward reduce-scatters their sum."""
        module = self._fsdp_root()
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self._plain_stale = True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "reshard_after_forward": self.reshard_after_forward,
                "shards": self.topology.world_size}

    def close(self) -> None:
        """Nothing to release: the plain copy stays readable after the run (the process group outlives it)."""

    # ---------------------------------------------------------------------------------- extensions

    def consolidate(self, *, snapshot: bool = False) -> None:
        """Before validation and checkpoints: refresh the plain copy (all ranks together)."""
        self.unwrap_model()

    def model_state_dict(self) -> dict[str, Any]:
        return self.unwrap_model().state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Each rank keeps its shard of the full state rank 0 read."""
        set_model_state_dict(self._root(), state, options=FULL)
        self._plain_stale = True

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter names, gathered on rank 0 (the others get an empty dict)."""
        return get_optimizer_state_dict(self._root(), optimizer, options=FULL_ON_RANK0)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self._root(), optimizer, state, options=FULL)

    def save_sharded(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        """Each rank writes its DTensor shards of the parameters and of the optimizer state (DCP)."""
        root = self._root()
        dcp.save({"model": get_model_state_dict(root), "optim": get_optimizer_state_dict(root, optimizer)},
                 checkpoint_id=str(directory))

    def load_sharded(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        """Each rank reads its own shards back (DCP re-shards when the number of ranks changed)."""
        root = self._root()
        model_state, optimizer_state = get_model_state_dict(root), get_optimizer_state_dict(root, optimizer)
        dcp.load({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(directory))  # in place
        set_model_state_dict(root, model_state)
        set_optimizer_state_dict(root, optimizer, optimizer_state)
        self._plain_stale = True

    # ------------------------------------------------------------------------------------- internals

    def _root(self) -> nn.Module:
        assert self._sharded is not None, "wrap_model() first"
        return self._sharded

    def _fsdp_root(self) -> FSDPModule:
        root = self._root()
        assert isinstance(root, FSDPModule)
        return root


def build_fsdp(config: ExperimentConfig, topology: Topology) -> FsdpStrategy:
    return FsdpStrategy(topology, reshard_after_forward=config.distributed.fsdp.reshard_after_forward)
