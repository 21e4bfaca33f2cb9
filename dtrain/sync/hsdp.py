"""Hybrid sharded data parallelism (HSDP) with torch's FSDP2: the ranks form a 2-D device mesh (replicate,
shard); each row (by default the ranks of one node) holds one whole replica sharded over its ranks, as FSDP2
does over all ranks, and the rows are replicas of each other. A block's all-gather and its gradients'
reduce-scatter stay inside a row (the fast link inside a node); between rows only the reduce-scattered
gradient shards are all-reduced, 1/S of the model per rank for S ranks per row. Model state per rank is FSDP2's
over S ranks.

`fully_shard` makes this from the mesh alone (`mesh_dim_names=("replicate", "shard")`): everything else —
construction without a whole model per rank, validation as a collective, sharded checkpoints, timed waits —
is FsdpStrategy's. The gradient comes out averaged over every rank of both dimensions; the 2 x 2 case of
tests/distributed/test_sharded.py checks it against single-process training in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from dtrain.comm import Topology, device_mesh
from dtrain.config import ExperimentConfig
from dtrain.errors import ConfigError
from dtrain.sync.fsdp import FsdpStrategy
from dtrain.sync.spec import StrategySpec


class HsdpStrategy(FsdpStrategy):
    """FSDP2 sharded over `shard_size` ranks and replicated over world_size / shard_size groups of them."""

    name = "hsdp"

    def __init__(self, topology: Topology, *, shard_size: int, reshard_after_forward: bool = True) -> None:
        if shard_size < 1 or topology.world_size % shard_size:
            raise ConfigError(f"distributed.hsdp.shard_size ({shard_size}) must divide the {topology.world_size} "
                              "workers into equal shard groups; set a divisor of the worker count, or leave it unset "
                              "to shard over the ranks of one node")
        super().__init__(topology, reshard_after_forward=reshard_after_forward)
        self.shard_size = shard_size

    @property
    def replicas(self) -> int:
        return self.topology.world_size // self.shard_size

    def shard_mesh(self) -> DeviceMesh:
        """Rows of `shard_size` consecutive ranks (one node's, as launchers number them) shard one replica."""
        return device_mesh(self.topology, (self.replicas, self.shard_size), ("replicate", "shard"))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "reshard_after_forward": self.reshard_after_forward, "shards": self.shard_size,
                "replicas": self.replicas}


def build_hsdp(config: ExperimentConfig, topology: Topology) -> HsdpStrategy:
    settings = config.distributed.hsdp
    return HsdpStrategy(topology, shard_size=settings.shard_size or topology.local_world_size,
                        reshard_after_forward=settings.reshard_after_forward)


def hsdp_summary(described: Mapping[str, Any]) -> str:
    return (f"hsdp, {described.get('shards')} shards x {described.get('replicas')} replica(s), "
            f"reshard_after_forward {described.get('reshard_after_forward')}")


SPEC = StrategySpec("hsdp", build_hsdp, summary=hsdp_summary)
