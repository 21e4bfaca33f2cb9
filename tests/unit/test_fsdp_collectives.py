"""FSDP's timed collectives call torch's current functions: no FutureWarning for a deprecated collective at every
all-gather and reduce-scatter of every run (one gloo process, the collectives on a group of one)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from dtrain.sync.fsdp import TimedAllGather, TimedReduceScatter


@pytest.fixture
def group_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_timed_all_gather_and_reduce_scatter_warn_nothing_and_time_their_phase(group_of_one: None) -> None:
    phases: list[str] = []
    gather, scatter = TimedAllGather(lambda name, _: phases.append(name)), TimedReduceScatter(
        lambda name, _: phases.append(name))
    gathered, scattered = torch.zeros(3), torch.zeros(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gather(gathered, torch.arange(3.0), group=None)
        scatter(scattered, torch.arange(3.0), group=None, op=dist.ReduceOp.SUM)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert gathered.tolist() == [0.0, 1.0, 2.0] and scattered.tolist() == [0.0, 1.0, 2.0]
    assert phases == ["all_gather", "reduce_scatter"]
