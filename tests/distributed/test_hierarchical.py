"""Two "nodes" of two ranks emulated on loopback (4 gloo processes, the node layout set on the Topology): the
hierarchical all-reduce equals the flat one (float64, against the mean computed here), DDP training with the
hierarchical comm hook equals training with DDP's own all-reduce, and local SGD with `node_sync` keeps the ranks of
a node identical between rounds and every rank identical after one. One spawn runs every case."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dtrain.comm import Topology
from dtrain.comm.topology import node_groups
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.hierarchical import HierarchicalStrategy, hierarchical_allreduce_
from dtrain.sync.local_sgd import LocalSGDStrategy

WORLD, LOCAL = 4, 2


def vector(rank: int) -> torch.Tensor:
    return torch.randn(1001, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + rank))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    return (model(x) ** 2).mean()


def _cases(topology: Topology) -> dict[str, Any]:
    two_nodes = dataclasses.replace(topology, local_world_size=LOCAL, local_rank=topology.rank % LOCAL,
                                    node_rank=topology.rank // LOCAL)
    groups = node_groups(two_nodes)
    out: dict[str, Any] = {"layout": (groups.nodes, groups.local_size, groups.leader)}
    out["reduced"] = hierarchical_allreduce_(vector(topology.rank), groups, WORLD).wait().clone()
    for name, strategy in {"flat": AllReduceStrategy(two_nodes, bucket_cap_mb=0.001),
                           "hierarchical": HierarchicalStrategy(two_nodes, bucket_cap_mb=0.001),
                           "node_sync": LocalSGDStrategy(two_nodes, period=3, node_sync=True)}.items():
        model = make_model()
        wrapped = strategy.wrap_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(1, 6):
            loss_of(wrapped, step, topology.rank).backward()
            strategy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        out[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # after 5: 2 local updates
        out[f"{name}_wire"] = strategy.take_wire_stats()
        strategy.close()
    return out


def test_hierarchical_allreduce_equals_flat_on_two_emulated_nodes(spawn: Any) -> None:
    ranks = spawn(_cases, WORLD)
    assert [r["layout"] for r in ranks] == [(2, 2, 0), (2, 2, 0), (2, 2, 2), (2, 2, 2)]
    mean = sum(vector(rank) for rank in range(WORLD)) / WORLD
    for r in ranks:
        assert torch.equal(r["reduced"], ranks[0]["reduced"])  # bitwise the same on every rank
        assert float((r["reduced"] - mean).abs().max()) <= 1e-12 * float(mean.abs().max())
        assert torch.equal(r["hierarchical"], ranks[0]["hierarchical"])
        scale = float(r["flat"].abs().max())
        assert float((r["hierarchical"] - r["flat"]).abs().max()) <= 1e-12 * scale  # training: hierarchical == flat
    # only the leaders send between nodes
    assert ranks[1]["hierarchical_wire"].wire_bytes < ranks[0]["hierarchical_wire"].wire_bytes
    # node_sync: after 5 updates (a round after 3, then 2 local ones) a node's ranks agree, the nodes do not
    assert torch.equal(ranks[0]["node_sync"], ranks[1]["node_sync"])
    assert torch.equal(ranks[2]["node_sync"], ranks[3]["node_sync"])
    assert not torch.allclose(ranks[0]["node_sync"], ranks[2]["node_sync"])
