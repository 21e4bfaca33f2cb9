"""Hierarchical all-reduce (`distributed.strategy: hierarchical`), as a DDP comm hook so that DDP's buckets and
their overlap with backward stay: each bucket is reduced inside its node to the node's leader (local rank 0),
all-reduced between the leaders (one process per node: the only traffic on the links between nodes), and
broadcast back inside the node (Horovod's hierarchical all-reduce, Goyal et al. 2017 §4.1).

On the slow link this moves 2(n-1)/n of a bucket per node and direction, against 2(p-1)/p for a flat ring over all
p ranks (1.5x the bytes for 2 nodes of 2). The sharded form (reduce-scatter inside the node, one cross-node
all-reduce per local rank on its shard, all-gather) would spread the leader's work, but gloo's reduce_scatter is
one all-reduce per rank (pytorch/pytorch#149869), so the leader form is the one built. Sums, then divides by the
world size (gloo's AVG is not trusted, pytorch/pytorch#162338). The node groups come from `dtrain.comm.topology`.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at registration as real objects.
from contextlib import suppress
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm import Topology
from dtrain.comm.topology import NodeGroups, node_groups
from dtrain.compress import WireStats, wire_bytes
from dtrain.config import ExperimentConfig
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.spec import StrategySpec


@dataclass
class HierarchicalState:
    """The node groups, the world size the sum is divided by, the wire meter, and the bucket still in flight (its
    later collectives run in a callback; the next bucket waits for it so every rank issues them in one order)."""

    groups: NodeGroups
    world_size: int
    wire: WireStats = field(default_factory=WireStats)
    unfinished: torch.futures.Future[torch.Tensor] | None = None


def hierarchical_allreduce_(buffer: torch.Tensor, groups: NodeGroups, world_size: int
                            ) -> torch.futures.Future[torch.Tensor]:
    """Average `buffer` over all ranks in place through the node leaders; the future's value is `buffer`."""

    def across_and_back(_: torch.futures.Future[object]) -> torch.Tensor:
        if groups.is_leader and groups.nodes > 1:
            work = dist.all_reduce(buffer, group=groups.cross)
            if work is not None:
                work.wait()
        if groups.local_size > 1:
            work = dist.broadcast(buffer, src=groups.leader, group=groups.local)
            if work is not None:
                work.wait()
        return buffer.div_(world_size)

    if groups.local_size > 1:
        work = dist.reduce(buffer, dst=groups.leader, group=groups.local, async_op=True)
        assert work is not None
        return work.get_future().then(across_and_back)
    started: torch.futures.Future[object] = torch.futures.Future()
    started.set_result(None)
    return started.then(across_and_back)


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook: one bucket through the two levels (after the previous bucket's are done)."""
    unfinished, state.unfinished = state.unfinished, None
    if unfinished is not None:
        with suppress(Exception):  # its own future carries a failure to backward()
            unfinished.wait()
    buffer = bucket.buffer()
    size = buffer.numel() * buffer.element_size()
    state.wire.record_bucket(size, state.world_size)
    state.wire.payload_bytes += size
    groups = state.groups
    sent = 2 * size * (groups.local_size - 1) / groups.local_size if groups.local_size > 1 else 0.0
    if groups.is_leader and groups.nodes > 1:
        sent += wire_bytes("all_reduce", size, groups.nodes)
    state.wire.wire_bytes += sent
    state.wire.rounds += 1
    state.unfinished = hierarchical_allreduce_(buffer, groups, state.world_size)
    return state.unfinished


class HierarchicalStrategy(AllReduceStrategy):
    """`allreduce` (DDP, bucket sizes, fusion tuning, replica checks) with the hierarchical comm hook."""

    name = "hierarchical"

    def _register_hook(self, ddp: DistributedDataParallel, model: nn.Module) -> bool:
        state = HierarchicalState(groups=node_groups(self.topology), world_size=self.topology.world_size,
                                  wire=self._wire)
        ddp.register_comm_hook(state, hierarchical_hook)
        return True

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info["nodes"] = self.topology.num_nodes
        info["ranks_per_node"] = self.topology.local_world_size
        return info


def build_hierarchical(config: ExperimentConfig, topology: Topology) -> HierarchicalStrategy:
    """The strategy from the config's `optimizations` (bucket sizes) and `distributed` sections."""
    return HierarchicalStrategy(topology, bucket_cap_mb=config.optimizations.tensor_fusion_threshold,
                                first_bucket_mb=config.optimizations.first_bucket_mb,
                                auto_tune_fusion=config.optimizations.auto_tune_tensor_fusion,
                                find_unused_parameters=config.distributed.find_unused_parameters)


SPEC = StrategySpec("hierarchical", build_hierarchical)
