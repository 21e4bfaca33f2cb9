"""Real failures in 2-process gloo runs, and what `classify_failure` makes of them: a collective that waits past
the timeout dtrain set (through torch's private `_set_pg_timeout`), a store wait that times out, a collective
whose peer was killed, a store whose server was killed with it, and DDP's error for a parameter without a gradient.

Nothing here measures time: rank 1 simply never joins the collective, and the ranks meet through the store."""

from __future__ import annotations

import signal
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dtrain.comm import Topology
from dtrain.comm.failures import Failure, classify_failure, is_unfinished_reduction
from dtrain.comm.stall import default_store, set_collective_timeout


def _failure_of(operation: Any) -> tuple[str, str, str] | None:
    """(kind, exception type, first line) of what `operation()` raised, or None if it returned."""
    try:
        operation()
    except RuntimeError as exc:
        return classify_failure(exc).value, type(exc).__name__, str(exc).strip().splitlines()[0]
    return None


class _HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unfinished_reduction() -> tuple[bool, str] | None:
    ddp = nn.parallel.DistributedDataParallel(_HalfUsed())
    ddp(torch.ones(1, 2)).sum().backward()
    try:
        ddp._check_reducer_finalized()  # what sync/allreduce.py calls after each backward pass
    except RuntimeError as exc:
        return is_unfinished_reduction(exc), classify_failure(exc).value
    return None


def _timeouts(topology: Topology) -> dict[str, Any]:
    store = default_store()
    assert store is not None
    result: dict[str, Any] = {"unfinished": _unfinished_reduction()}
    result["store"] = _failure_of(lambda: store.wait([f"never set {topology.rank}"], timedelta(milliseconds=200)))
    if topology.rank == 0:
        set_collective_timeout(1.0)  # distributed.timeout_seconds, applied to the group the fixture made (120 s)
        result["collective"] = _failure_of(lambda: dist.all_reduce(torch.ones(4)))
        store.set("rank 0 gave up", "1")
    else:
        store.wait(["rank 0 gave up"])  # rank 1 never joins the all-reduce
    return result


def test_timeouts_are_classified_as_timeouts(spawn: Any) -> None:
    zero, one = spawn(_timeouts, 2)
    assert zero["collective"] is not None, "the all-reduce without rank 1 returned: the timeout was not set"
    kind, name, text = zero["collective"]
    assert (kind, name) == (Failure.TIMEOUT.value, "RuntimeError"), zero["collective"]  # gloo: no typed error
    assert "Timed out waiting 1000ms" in text, text
    for result in (zero, one):
        assert result["store"] is not None and result["store"][:2] == (Failure.TIMEOUT.value, "DistStoreError")
        assert result["unfinished"] == (True, Failure.OTHER.value)


def _doomed_peer(report_port: Any) -> None:
    """A process that hosts a store and joins a 2-member gloo group with rank 0, then waits to be killed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    report_port.send(store.port)
    group = dist.ProcessGroupGloo(dist.PrefixStore("doomed", store), 1, 2, timedelta(seconds=60))
    group.allreduce([torch.ones(2)]).wait()
    threading.Event().wait()  # until SIGKILL


def _lost_peers(topology: Topology) -> dict[str, Any]:
    """Rank 1 starts a process that rank 0 shares a gloo group and a store with, and kills it (SIGKILL)."""
    store = default_store()
    assert store is not None
    if topology.rank == 1:
        context = mp.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        peer = context.Process(target=_doomed_peer, args=(send,), daemon=True)
        peer.start()
        store.set("peer's store port", str(receive.recv()))
        store.wait(["rank 0 connected"])
        peer.kill()
        peer.join()
        store.set("peer killed", str(peer.exitcode))
        store.wait(["rank 0 done"])
        return {}
    client = dist.TCPStore("127.0.0.1", int(store.get("peer's store port")), is_master=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore("doomed", client), 0, 2, timedelta(seconds=60))
    group.allreduce([torch.ones(2)]).wait()
    client.set("key", "value")
    store.set("rank 0 connected", "1")
    result = {"exit": int(store.get("peer killed")),
              "collective": _failure_of(lambda: group.allreduce([torch.ones(2)]).wait()),
              "store": _failure_of(lambda: client.get("key"))}
    store.set("rank 0 done", "1")
    return result


def test_a_killed_peer_is_classified_as_a_lost_peer(spawn: Any) -> None:
    zero, _ = spawn(_lost_peers, 2)
    assert zero["exit"] == -signal.SIGKILL
    assert zero["collective"] is not None and zero["collective"][:2] == (Failure.LOST_PEER.value, "RuntimeError")
    # gloo says "Connection closed by peer" or "Read error ...: Connection reset by peer", as the socket learns it
    assert any(text in zero["collective"][2] for text in ("Connection closed by peer", "Connection reset by peer"))
    assert zero["store"] is not None and zero["store"][:2] == (Failure.LOST_PEER.value, "DistNetworkError")
