"""A worker's side of Horovod Elastic under `dtrain horovodrun --min-np/--max-np`: which generation of the job it
belongs to, and joining a newer one at another size.

The elastic driver (`elastic_driver.py`) hosts a TCPStore and announces each membership as a generation: the key
`gen/<g>/ranks` maps worker ids to ranks, then `generation` is set to g. A worker joins the latest generation that
lists it by creating the gloo process group on that generation's key prefix, so two generations never share keys.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

STORE_VAR = "DTRAIN_HOROVOD_ELASTIC_STORE"  # host:port of the driver's store
WORKER_VAR = "DTRAIN_HOROVOD_WORKER_ID"  # this process's id in the generations' rank tables
TIMEOUT_VAR = "HOROVOD_ELASTIC_TIMEOUT"  # Horovod's name: seconds to wait for a new membership (default 600)
GENERATION_KEY = "generation"


class RemovedFromJob(Exception):  # noqa: N818 - a state, not a failure
    """The driver announced a membership without this worker (its slot was taken away): it leaves cleanly."""


@dataclass
class Membership:
    """One generation of the job as this worker sees it."""

    generation: int
    rank: int
    size: int


_STORE: list[dist.TCPStore] = []
CURRENT: list[Membership] = []


def active() -> bool:
    """Whether this process was started by the elastic driver."""
    return bool(os.environ.get(STORE_VAR))


def wait_seconds() -> float:
    return float(os.environ.get(TIMEOUT_VAR, "600"))


def _store() -> dist.TCPStore:
    if not _STORE:
        host, _, port = os.environ[STORE_VAR].rpartition(":")
        _STORE.append(dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=wait_seconds())))
    return _STORE[0]


def latest_generation() -> int:
    """The newest generation the driver has announced (-1 before the first)."""
    store = _store()
    return int(store.get(GENERATION_KEY)) if store.check([GENERATION_KEY]) else -1


def current_generation() -> int:
    return CURRENT[0].generation if CURRENT else -1


def join(after: int, collective_timeout: float) -> Membership:
    """Wait for a generation newer than `after`, then create the gloo process group of the newest one that lists
    this worker, once all its members have arrived (a generation superseded meanwhile, because a member died or
    the driver took in more, is given up for the newer one). Raises RemovedFromJob when the newest generation
    leaves this worker out, TimeoutError when none is complete within $HOROVOD_ELASTIC_TIMEOUT seconds."""
    store, me = _store(), os.environ[WORKER_VAR]
    deadline = time.monotonic() + wait_seconds()
    arrived_at = -1
    while time.monotonic() < deadline:
        generation = latest_generation()
        if generation <= after:
            time.sleep(0.05)
            continue
        ranks: dict[str, int] = json.loads(store.get(f"gen/{generation}/ranks"))
        if me not in ranks:
            raise RemovedFromJob(f"worker {me} is not in generation {generation}")
        if arrived_at != generation:
            store.add(f"gen/{generation}/arrived", 1)
            arrived_at = generation
        if store.add(f"gen/{generation}/arrived", 0) < len(ranks):
            time.sleep(0.05)
            continue
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"gen/{generation}/pg/", store),
                                    rank=ranks[me], world_size=len(ranks),
                                    timeout=timedelta(seconds=collective_timeout))
        except RuntimeError:  # a member died while connecting: wait for the driver's next generation
            if dist.is_initialized():
                dist.destroy_process_group()
            after = generation
            continue
        membership = Membership(generation, ranks[me], len(ranks))
        CURRENT[:] = [membership]
        store.set(f"joined/{me}", str(generation))
        os.environ.update({"HOROVOD_RANK": str(membership.rank), "HOROVOD_SIZE": str(membership.size),
                           "HOROVOD_LOCAL_RANK": str(membership.rank), "HOROVOD_LOCAL_SIZE": str(membership.size)})
        return membership
    raise TimeoutError(f"no complete membership of the elastic job within {wait_seconds():.0f} s (${TIMEOUT_VAR})")


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that broke because a peer went away (gloo's connection errors and
    timeouts), as opposed to a mistake in the script."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(mark in text for mark in (
        "gloo", "Connection closed", "Connection reset", "Connection refused", "Timed out", "Broken pipe"))
