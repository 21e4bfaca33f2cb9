"""Horovod's negotiation by name in dtrain.horovod, at 2 and 3 gloo ranks: operations posted in different orders
on different ranks complete with the right results; an operation stays pending across a barrier until the other
ranks post it; a name posted twice while pending raises ValueError on that rank only and the others go on;
mismatched shapes under one name raise RuntimeError on every rank and the next operation works; process sets
posted in different orders; the stall warning names the ranks that have not posted."""

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


def _stall(hvd: Any, size: int, rank: int) -> list[str]:
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
