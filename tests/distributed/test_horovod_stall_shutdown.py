"""Horovod's stall shutdown in dtrain.horovod, at 2 and 3 gloo ranks: when one rank leaves a sequence of
collectives early (an assertion failed on it alone) and posts the next ones while the others still wait for their
own, every rank's pending operation raises HorovodInternalError once HOROVOD_STALL_SHUTDOWN_TIME_SECONDS has
passed, naming the operation and the ranks that never posted it, instead of waiting for ever; later collectives
raise that Horovod has been shut down, and after `hvd.shutdown()` and `hvd.init()` the next collective works on
every rank. Both the cached fast path (names every rank has run before) and the full exchange (new names)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed.conftest import run_spawned


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type and message are the result
        return f"{type(error).__name__}: {error}"
    return "returned"


def _diverge(hvd: Any, size: int, rank: int, cached: bool) -> dict[str, str]:
    """The last rank goes on to the 'next test' while the others post one more operation of the current one."""
    if cached:  # both names run once on every rank first, so both are in the response cache
        for name in ("current.second", "next.first"):
            hvd.allreduce(torch.ones(2), name=name, op=hvd.Sum)
    if rank == size - 1:
        waited = _outcome(lambda: hvd.allreduce(torch.ones(2), name="next.first", op=hvd.Sum))
    elif cached:
        waited = _outcome(lambda: hvd.allreduce(torch.ones(2), name="current.second", op=hvd.Sum))
    else:
        waited = _outcome(lambda: hvd.allgather(torch.ones(2, 2), name="current.second"))
    later = _outcome(lambda: hvd.allreduce(torch.ones(1), name="later", op=hvd.Sum))
    hvd.shutdown()
    hvd.init()
    again = hvd.allreduce(torch.full((3,), float(rank + 1)), name="again", op=hvd.Sum)
    return {"waited": waited, "later": later, "again": str(again.tolist())}


def _stalled(topology: Any) -> dict[str, Any]:
    import dtrain.horovod.torch as hvd

    os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "1"
    os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "3"
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    results = {"cached": _diverge(hvd, size, rank, cached=True), "full": _diverge(hvd, size, rank, cached=False)}
    hvd.shutdown()
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_a_stall_past_the_shutdown_time_raises_on_every_rank(size: int) -> None:
    results = run_spawned(_stalled, size, timeout=240)
    total = str([float(sum(range(1, size + 1)))] * 3)
    for rank, result in enumerate(results):
        for path in ("cached", "full"):
            seen = result[path]
            assert seen["waited"].startswith("HorovodInternalError: stall shutdown"), (rank, path, seen)
            # every rank names the operation it posted and the ranks that never posted it
            mine = (f"allreduce.next.first (posted by rank(s) [{size - 1}], not by {list(range(size - 1))})"
                    if rank == size - 1 else f"{'allreduce' if path == 'cached' else 'allgather'}.current.second "
                    f"(posted by rank(s) {list(range(size - 1))}, not by [{size - 1}])")
            assert mine in seen["waited"], (rank, path, seen)
            assert seen["later"].startswith("HorovodInternalError: Horovod has been shut down"), (rank, path, seen)
            assert seen["again"] == total, (rank, path, seen)
