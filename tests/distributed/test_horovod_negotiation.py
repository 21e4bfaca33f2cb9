"""Horovod's negotiation by name in dtrain.horovod, at 2 and 3 gloo ranks: operations posted in different orders
on different ranks complete with the right results; an operation stays pending across a barrier until the other
ranks post it; a name posted twice while pending raises ValueError on that rank only and the others go on;
mismatched shapes under one name raise RuntimeError on every rank and the next operation works; process sets
posted in different orders; the stall warning names the ranks that have not posted. The response cache: names
posted again with the same rows skip the full exchange, in any order; a new shape under a cached name is
negotiated again, a mismatched one raises on every rank and the next works; a joined rank contributes zeros to a
cached name."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest
import torch

from tests.distributed.conftest import run_spawned


def _orders(hvd: Any, size: int, rank: int) -> list[str]:
    failed: list[str] = []
    names = ["a", "b", "c", "d"]
    order = names[rank % len(names):] + names[:rank % len(names)]  # every rank starts elsewhere
    if rank % 2:
        order.reverse()
    handles = {n: hvd.allreduce_async(torch.full((3,), float(rank + 1 + i)), name=n, op=hvd.Sum)
               for n in order for i in [names.index(n)]}
    gathered = hvd.allgather_async(torch.full((rank + 1, 2), rank), name="gather")
    sent = hvd.broadcast_async(torch.full((2,), float(rank)), root_rank=size - 1, name="bcast")
    for n in reversed(order):
        expected = sum(r + 1 + names.index(n) for r in range(size))
        if hvd.synchronize(handles[n]).tolist() != [float(expected)] * 3:
            failed.append(f"allreduce {n}")
    if hvd.synchronize(sent).tolist() != [float(size - 1)] * 2:
        failed.append("broadcast")
    if hvd.synchronize(gathered).flatten().tolist() != [r for r in range(size) for _ in range(2 * (r + 1))]:
        failed.append("allgather")
    return failed


def _pending_across_barrier(hvd: Any, size: int, rank: int) -> dict[str, str]:
    """Rank 0 posts 'late' and a duplicate of it, then a barrier; the others post it after the barrier."""
    seen: dict[str, str] = {}
    tensor = torch.full((4,), float(rank + 1))
    handle = None
    if rank == 0:
        handle = hvd.allreduce_async(tensor, name="late", op=hvd.Sum)
        try:
            hvd.allreduce_async(tensor, name="late", op=hvd.Sum)
            seen["duplicate"] = "no error"
        except ValueError:
            seen["duplicate"] = "ValueError"
    hvd.barrier()
    if rank != 0:
        handle = hvd.allreduce_async(tensor, name="late", op=hvd.Sum)
    seen["late"] = str(hvd.synchronize(handle).tolist())
    hvd.barrier()
    try:
        hvd.allreduce(torch.ones(2 + (rank == size - 1)), name="shapes")
        seen["mismatch"] = "no error"
    except RuntimeError as error:
        seen["mismatch"] = "RuntimeError" if "Mismatched allreduce" in str(error) else str(error)
    seen["after"] = str(hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum).tolist())
    return seen


def _process_sets(hvd: Any, size: int, rank: int) -> list[float]:
    first = hvd.add_process_set([0, 1])
    everyone = hvd.global_process_set
    mine = [everyone] + ([first] if rank in (0, 1) else [])
    if rank == 1:
        mine.reverse()
    handles = [hvd.allreduce_async(torch.tensor([float(rank + 1)]), name="pair", op=hvd.Sum, process_set=s)
               for s in mine]
    results = [hvd.synchronize(h).item() for h in handles]
    hvd.barrier()
    hvd.remove_process_set(first)
    return sorted(results)


def _cached(hvd: Any, size: int, rank: int) -> dict[str, Any]:
    """Steps of the same names, in orders that differ by rank and step, then changed and mismatched shapes under
    a cached name, a cached broadcast and barrier, and a join while the others reduce a cached name."""
    from dtrain.horovod.negotiation import COORDINATOR

    coordinator = COORDINATOR[0]
    assert coordinator is not None
    seen: dict[str, Any] = {}
    names = ["grad.0", "grad.1", "grad.2"]
    before = coordinator.cycles_cached
    wrong = []
    for step in range(4):
        order = names if (rank + step) % 2 == 0 else list(reversed(names))
        handles = {n: hvd.allreduce_async(torch.full((5,), float(rank + step + names.index(n))), name=n, op=hvd.Sum)
                   for n in order}
        for n in names:
            expected = float(sum(r + step + names.index(n) for r in range(size)))
            if hvd.synchronize(handles[n]).tolist() != [expected] * 5:
                wrong.append(f"step {step} {n}")
        sent = hvd.broadcast(torch.full((2,), float(rank + step)), root_rank=size - 1, name="bcast")
        if sent.tolist() != [float(size - 1 + step)] * 2:
            wrong.append(f"step {step} broadcast")
        hvd.barrier()
    seen["wrong"] = wrong
    seen["cached_cycles"] = coordinator.cycles_cached - before
    seen["reshaped"] = hvd.allreduce(torch.ones(7), name="grad.0", op=hvd.Sum).tolist() == [float(size)] * 7
    try:
        hvd.allreduce(torch.ones(7 + (rank == size - 1)), name="grad.0", op=hvd.Sum)
        seen["mismatch"] = "no error"
    except RuntimeError as error:
        seen["mismatch"] = "RuntimeError" if "Mismatched allreduce" in str(error) else str(error)
    seen["after"] = hvd.allreduce(torch.ones(7), name="grad.0", op=hvd.Sum).tolist() == [float(size)] * 7
    if rank == size - 1:
        seen["last"] = hvd.join()
    else:
        seen["joined_sum"] = hvd.allreduce(torch.ones(5), name="grad.1", op=hvd.Sum).tolist()
        seen["last"] = hvd.join()
    return seen


def _cache(topology: Any, capacity: str) -> dict[str, Any]:
    import dtrain.horovod.torch as hvd

    os.environ["HOROVOD_CACHE_CAPACITY"] = capacity
    hvd.init()
    try:
        return _cached(hvd, hvd.size(), hvd.rank())
    finally:
        hvd.shutdown()


def _cache_on(topology: Any) -> dict[str, Any]:
    return _cache(topology, "1024")


def _cache_off(topology: Any) -> dict[str, Any]:
    return _cache(topology, "0")


def _stall(hvd: Any, size: int, rank: int) -> list[str]:
    hvd.allreduce(torch.ones(1), name="slow", op=hvd.Sum)  # cached: the stall below is seen from cache flags
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = hvd.allreduce(torch.ones(1), name="slow", op=hvd.Sum).item()
        messages = [str(w.message) for w in caught if "waiting for remainder of ranks" in str(w.message)]
        return [f"value {value}", *messages]
    time.sleep(6.0)  # longer than the 1-second stall check: rank 0 warns while it waits
    return [f"value {hvd.allreduce(torch.ones(1), name='slow', op=hvd.Sum).item()}"]


def _negotiation(topology: Any) -> dict[str, Any]:
    import dtrain.horovod.torch as hvd

    os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "1"
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    results = {"orders": _orders(hvd, size, rank), "barrier": _pending_across_barrier(hvd, size, rank),
               "sets": _process_sets(hvd, size, rank), "stall": _stall(hvd, size, rank)}
    hvd.shutdown()
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_operations_are_matched_by_name(size: int) -> None:
    results = run_spawned(_negotiation, size, timeout=300)
    for rank, result in enumerate(results):
        assert result["orders"] == [], f"rank {rank}"
        barrier = result["barrier"]
        assert barrier["late"] == str([float(sum(range(1, size + 1)))] * 4)
        assert barrier.get("duplicate", "ValueError") == "ValueError"
        assert ("duplicate" in barrier) == (rank == 0)  # raised on the rank that posted it, nowhere else
        assert barrier["mismatch"] == "RuntimeError" and barrier["after"] == str([float(size)] * 2)
        assert result["sets"] == sorted([3.0, sum(range(1, size + 1))] if rank in (0, 1)
                                        else [sum(range(1, size + 1))])
        assert result["stall"][0] == f"value {float(size)}"
    stall = results[0]["stall"][1:]
    assert stall, "rank 0 did not warn of the stall"
    assert all(f"{r}: [allreduce.slow]" in stall[0] for r in range(1, size))


@pytest.mark.parametrize("size", [2, 3])
def test_cached_responses_skip_the_full_exchange(size: int) -> None:
    results = run_spawned(_cache_on, size, timeout=300)
    for rank, seen in enumerate(results):
        assert seen["wrong"] == [], f"rank {rank}"
        assert seen["cached_cycles"] > 0, f"rank {rank}: no cycle used the response cache"
        assert seen["reshaped"] and seen["after"] and seen["mismatch"] == "RuntimeError", (rank, seen)
        if rank != size - 1:
            assert seen["joined_sum"] == [float(size - 1)] * 5  # the joined rank added zeros
    lasts = {seen["last"] for seen in results}
    assert len(lasts) == 1 and lasts.pop() in range(size - 1)


def test_cache_capacity_zero_always_negotiates_in_full() -> None:
    results = run_spawned(_cache_off, 2, timeout=300)
    for rank, seen in enumerate(results):
        assert seen["wrong"] == [] and seen["reshaped"] and seen["after"], (rank, seen)
        assert seen["cached_cycles"] == 0
