"""ZeRO stage 1: DDP all-reduces the gradients as strategy `allreduce` does, and torch's ZeroRedundancyOptimizer
keeps each parameter's optimizer state (Adam's two moments, momentum) on one rank only; after its step each
rank broadcasts the parameters it owns. Optimizer memory falls from K*Psi to K*Psi/N bytes per rank.

ZeRO partitions whole parameters between ranks (it never cuts a tensor), so an optimizer that needs a whole
tensor, such as LARS's and LAMB's trust ratio (a norm over the tensor), sees it whole: every optimizer dtrain
builds runs unchanged. Checkpoints gather the partitions on rank 0 (`consolidate_state_dict`), so `state.pt`
holds one plain optimizer state that a run with any number of ranks can load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from dtrain.comm import Topology
from dtrain.config import ExperimentConfig
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.spec import StrategySpec


class Zero1Strategy(AllReduceStrategy):
    """DDP (average, no compression) plus a sharded optimizer: `wrap_optimizer` and the OwnsCheckpointState
    extensions on top of the allreduce strategy's core."""

    name = "zero1"

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The same optimizer class, options and parameter groups, its state sharded over the ranks."""
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        groups = [dict(group) for group in optimizer.param_groups]
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **optimizer.defaults)

    def model_state_dict(self) -> dict[str, Any]:
        return self.unwrap_model().state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.unwrap_model().load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every rank sends its partition to rank 0, which returns the whole state (the others an empty dict)."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer.state_dict()
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.topology.is_chief else {}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Each rank keeps its own partition of the whole state rank 0 read."""
        optimizer.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "name": self.name, "optimizer_state": "sharded (ZeroRedundancyOptimizer)"}


def build_zero1(config: ExperimentConfig, topology: Topology) -> Zero1Strategy:
    """DDP with the config's buckets, and a sharded optimizer."""
    return Zero1Strategy(topology, op="average", bucket_cap_mb=config.optimizations.tensor_fusion_threshold,
                         first_bucket_mb=config.optimizations.first_bucket_mb,
                         auto_tune_fusion=config.optimizations.auto_tune_tensor_fusion,
                         find_unused_parameters=config.distributed.find_unused_parameters)


SPEC = StrategySpec("zero1", build_zero1)
