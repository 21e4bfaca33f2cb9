"""Stall detection: heartbeats through the workers' store, so that a rank stuck waiting in a collective can say
which ranks have not arrived and what each was last doing, and a collective timeout becomes one error that
names them instead of a silent wait.

Every rank runs a daemon thread that, every `interval` seconds, writes its heartbeat (step, phase, since
when, now) under `dtrain/stall/<attempt>/<rank>` and reads the others'. A rank that has stayed in one place
for `warn_after` seconds logs the ranks behind it (an earlier step, or an earlier phase of the same step)
and those whose heartbeat stopped. On a timeout the Trainer asks `timeout_error()` for the one-line error
and the monitor posts an abort notice that the other ranks' monitors see (an injected hang stops on it).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from dtrain.errors import StallError, TorchCompatibilityError

log = logging.getLogger(__name__)

Position = tuple[int, int]  # (step, index of the phase within the step)


@dataclass(frozen=True)
class Heartbeat:
    """What a rank last said it was doing, and when it said so (time.time() on its machine)."""

    rank: int
    step: int
    phase: str
    position: Position
    since: float
    sent: float

    def describe(self, now: float) -> str:
        stale = now - self.sent
        text = f"rank {self.rank} is in {self.phase} of step {self.step} for {now - self.since:.1f} s"
        return text + (f" (no heartbeat for {stale:.0f} s: the process may be frozen or dead)"
                       if stale > 5.0 else "")


# The torch releases tests/unit/test_torch_private_api.py passed on, and where (docs/gpu.md); the messages that
# ask for a tested release name the first. Torch 2.11 (the GPU machine's image) is allowed by pyproject.toml but
# waits for `make gpu-check` to run there.
TESTED_TORCHES = {"2.13.0": "CI here, CPU build", "2.14.1": "here in a throwaway venv, CUDA build run on the CPU"}
TESTED_TORCH = next(iter(TESTED_TORCHES))


def default_store() -> dist.Store | None:
    """The default process group's store (the rendezvous/worker store), or None without one. Torch has no
    public accessor for it: without the private one the heartbeats have no channel, so that is an error."""
    if not dist.is_initialized():
        return None
    getter = getattr(distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise TorchCompatibilityError(
            f"torch {torch.__version__} has no torch.distributed.distributed_c10d._get_default_store, which dtrain's "
            f"stall detection reads the workers' store with; install torch=={TESTED_TORCH}, the release dtrain is "
            "tested with")
    store: dist.Store = getter()
    return store


def store_attempt(restart_count: int, environ: Mapping[str, str] | None = None) -> int:
    """The attempt number that separates the heartbeat keys of one attempt from another's.

    torch's agent store (TORCHELASTIC_USE_AGENT_STORE=True, under plain torchrun) outlives restarts and keeps the
    keys of earlier attempts, so they carry the agent's restart count. A store the workers host themselves (what
    `dtrain run` starts) is new in every round, and on several nodes the agents count restarts differently (a node
    whose own workers did not fail restarts them without counting), so there every rank uses 0."""
    env = os.environ if environ is None else environ
    return restart_count if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def set_collective_timeout(seconds: float) -> None:
    """Make the default group's collectives fail after `seconds` (for groups created with another timeout)."""
    if not dist.is_initialized():
        return
    # torch 2.14 made it public (dist.set_timeout) and deprecated the private one (a FutureWarning)
    setter = getattr(dist, "set_timeout", None) or getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        _say_timeout_not_set(seconds)
    else:
        setter(timedelta(seconds=seconds))


@functools.cache
def _say_timeout_not_set(seconds: float) -> None:
    """Once per process: without torch's private setter the groups dtrain creates keep the timeout they were
    created with (the same value), but a group created elsewhere keeps its own."""
    log.warning("torch %s has neither torch.distributed.set_timeout nor distributed_c10d._set_pg_timeout: "
                "distributed.timeout_seconds (%g s) holds only where dtrain created the process group, a group "
                "created with another timeout keeps that one; install torch==%s, the release dtrain is tested with",
                torch.__version__, seconds, TESTED_TORCH)


class StallMonitor:
    """Heartbeats and stall reports for this rank; `activity()` returns (step, phase, position, since)."""

    def __init__(self, *, store: dist.Store, rank: int, world_size: int,
                 activity: Callable[[], tuple[int, str, Position, float]], warn_after: float,
                 attempt: int = 0, interval: float | None = None) -> None:
        self.store = dist.PrefixStore(f"dtrain/stall/{attempt}/", store)
        self.rank = rank
        self.world_size = world_size
        self.activity = activity
        self.warn_after = warn_after
        self.interval = interval if interval is not None else min(2.0, max(warn_after / 4, 0.05))
        self.abort = threading.Event()  # set when another rank gave up on a timeout
        self.abort_message = ""
        self._stop = threading.Event()
        self._warned: Position | None = None
        self._thread = threading.Thread(target=self._run, name="dtrain-heartbeat", daemon=True)

    def start(self) -> StallMonitor:
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

    # ------------------------------------------------------------------------------------------ thread

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                self._check_abort()
                self._check_stall()
            except Exception as exc:  # the store went away (the run is ending); heartbeats are best effort
                log.debug("heartbeat thread stops: %s", exc)
                return

    def _beat(self) -> None:
        step, phase, position, since = self.activity()
        self.store.set(str(self.rank), json.dumps({"step": step, "phase": phase, "position": list(position),
                                                   "since": since, "sent": time.time()}))

    def _check_abort(self) -> None:
        if not self.abort.is_set() and self.store.check(["abort"]):
            self.abort_message = self.store.get("abort").decode()
            self.abort.set()

    def _check_stall(self) -> None:
        step, phase, position, since = self.activity()
        waited = time.time() - since
        if waited < self.warn_after or self._warned == position:
            return
        behind = self.not_arrived(position)
        if not behind:
            return
        self._warned = position
        now = time.time()
        log.warning("rank %d has waited %.0f s in %s of step %d for rank(s) %s: %s", self.rank, waited, phase, step,
                    ", ".join(str(h.rank) for h in behind), "; ".join(h.describe(now) for h in behind))

    # ------------------------------------------------------------------------------------------ queries

    def heartbeats(self) -> list[Heartbeat]:
        """The other ranks' latest heartbeats (ranks that never sent one are left out)."""
        beats = []
        for rank in range(self.world_size):
            if rank == self.rank or not self.store.check([str(rank)]):
                continue
            raw: dict[str, Any] = json.loads(self.store.get(str(rank)))
            beats.append(Heartbeat(rank=rank, step=int(raw["step"]), phase=str(raw["phase"]),
                                   position=(int(raw["position"][0]), int(raw["position"][1])),
                                   since=float(raw["since"]), sent=float(raw["sent"])))
        return beats

    def not_arrived(self, position: Position) -> list[Heartbeat]:
        """Ranks behind `position` (an earlier step, or an earlier phase of it) or whose heartbeat stopped."""
        now = time.time()
        stale_after = max(3 * self.interval, 5.0)
        return [h for h in self.heartbeats() if h.position < position or now - h.sent > stale_after]

    def timeout_error(self, cause: BaseException, timeout_seconds: float) -> StallError:
        """The error for a collective that timed out here: which ranks did not arrive and what they were doing.
        Also posts an abort notice so that the other ranks' monitors stop an injected hang."""
        step, phase, position, _ = self.activity()
        now = time.time()
        behind = self.not_arrived(position)
        if behind:
            who = "rank(s) " + ", ".join(str(h.rank) for h in behind)
            detail = "; ".join(h.describe(now) for h in behind)
            fix = f"see logs/rank-{behind[0].rank}.log"
        else:
            who, detail = "the other ranks", f"no heartbeat shows a rank behind ({str(cause).strip().splitlines()[0]})"
            fix = "see the ranks' logs in logs/"
        message = (f"rank {self.rank} waited {timeout_seconds:g} s (distributed.timeout_seconds) in {phase} of step "
                   f"{step} for {who} that did not arrive: {detail}; {fix}, or raise distributed.timeout_seconds "
                   "if such waits are expected")
        try:
            self.store.set("abort", f"rank {self.rank} gave up waiting at step {step}")
        except Exception:  # noqa: BLE001 - the error itself matters more than the notice
            pass
        return StallError(message)
