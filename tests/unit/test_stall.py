"""Stall detection in one process: two ranks' monitors share an in-process HashStore, their activities and the
wall clock are set by the test, and heartbeats are sent by calling `_beat()` directly (no thread, no sleeps)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from dtrain.comm import stall
from dtrain.comm.stall import Heartbeat, StallMonitor
from dtrain.config import Faults
from dtrain.errors import StallError, TorchCompatibilityError
from dtrain.profile.timers import PHASES, Activity
from dtrain.train.faults import FaultInjector

NOW = 1_000_000.0


class Clock:
    """time.time() as the stall module sees it."""

    def __init__(self) -> None:
        self.now = NOW

    def time(self) -> float:
        return self.now


class Rank:
    """A rank's current activity, as the Trainer's timer reports it to its monitor."""

    def __init__(self, step: int, phase: str, since: float) -> None:
        self.move(step, phase, since)

    def move(self, step: int, phase: str, since: float) -> None:
        self.now = Activity(step, phase, since)

    def __call__(self) -> tuple[int, str, tuple[int, int], float]:
        return self.now.step, self.now.phase, self.now.position, self.now.since


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(stall, "time", SimpleNamespace(time=fake.time))
    return fake


def monitors(store: dist.Store, *ranks: Rank, attempt: int = 0) -> list[StallMonitor]:
    return [StallMonitor(store=store, rank=r, world_size=len(ranks), activity=activity, warn_after=1.0,
                         attempt=attempt) for r, activity in enumerate(ranks)]


@pytest.mark.parametrize(("step", "phase", "behind"), [
    (4, "checkpoint", True),  # an earlier step, whatever the phase
    (5, "data", True),  # an earlier phase of the same step
    (5, "forward", True),
    (5, "backward", False),  # where rank 0 is
    (5, "optimizer", False),  # later in the step
    (5, "between steps", False),  # done with the step
    (6, "data", False),  # a later step
])
def test_ranks_at_an_earlier_step_or_phase_have_not_arrived(clock: Clock, step: int, phase: str,
                                                            behind: bool) -> None:
    waiting, other = Rank(5, "backward", NOW - 3), Rank(step, phase, NOW - 1)
    zero, one = monitors(dist.HashStore(), waiting, other)
    zero._beat()
    assert zero.not_arrived(waiting.now.position) == []  # rank 1 has not sent a heartbeat yet: nothing to say
    one._beat()
    found = zero.not_arrived(waiting.now.position)
    assert [h.rank for h in found] == ([1] if behind else [])
    [beat] = zero.heartbeats()  # its own heartbeat is not among the others'
    assert (beat.rank, beat.step, beat.phase, beat.position, beat.since, beat.sent) == (
        1, step, phase, other.now.position, NOW - 1, NOW)


def test_a_stale_heartbeat_counts_as_not_arrived(clock: Clock) -> None:
    waiting, ahead = Rank(5, "backward", NOW), Rank(6, "data", NOW)
    zero, one = monitors(dist.HashStore(), waiting, ahead)
    assert zero.interval == 0.25  # warn_after / 4: stale after max(3 x interval, 5 s) = 5 s
    one._beat()
    clock.now = NOW + 4.9
    assert zero.not_arrived(waiting.now.position) == []
    clock.now = NOW + 5.1  # rank 1's heartbeat thread stopped: its process may be frozen
    assert [h.rank for h in zero.not_arrived(waiting.now.position)] == [1]


def test_heartbeats_of_another_attempt_are_not_seen(clock: Clock) -> None:
    store = dist.HashStore()
    old_zero, old_one = monitors(store, Rank(9, "data", NOW), Rank(3, "data", NOW), attempt=0)
    old_one._beat()
    new_zero, _ = monitors(store, Rank(1, "data", NOW), Rank(1, "data", NOW), attempt=1)
    assert new_zero.heartbeats() == [] and [h.step for h in old_zero.heartbeats()] == [3]


def test_describe_says_where_a_rank_is_and_whether_it_still_beats() -> None:
    beat = Heartbeat(rank=1, step=7, phase="data", position=(7, 0), since=100.0, sent=110.0)
    assert beat.describe(112.5) == "rank 1 is in data of step 7 for 12.5 s"
    assert beat.describe(125.0) == ("rank 1 is in data of step 7 for 25.0 s (no heartbeat for 15 s: the process "
                                    "may be frozen or dead)")


def test_the_timeout_error_names_the_missing_rank_and_aborts_the_others(clock: Clock) -> None:
    waiting, hung = Rank(5, "backward", NOW - 30), Rank(5, "data", NOW - 31.5)
    zero, one = monitors(dist.HashStore(), waiting, hung)
    zero._beat()
    one._beat()
    one._check_abort()
    assert not one.abort.is_set()
    cause = RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete\nmore lines")
    error = zero.timeout_error(cause, 30.0)
    assert isinstance(error, StallError)
    message = str(error)
    assert "\n" not in message
    assert message.startswith("rank 0 waited 30 s (distributed.timeout_seconds) in backward of step 5 for rank(s) 1 "
                              "that did not arrive: rank 1 is in data of step 5 for 31.5 s; see logs/rank-1.log")
    assert message.endswith("or raise distributed.timeout_seconds if such waits are expected")
    one._check_abort()  # rank 1's monitor sees the notice (and an injected hang there ends on it)
    assert one.abort.is_set() and one.abort_message == "rank 0 gave up waiting at step 5"


def test_a_timeout_without_a_rank_behind_quotes_the_cause_in_one_line(clock: Clock) -> None:
    waiting = Rank(5, "backward", NOW - 30)
    zero, one = monitors(dist.HashStore(), waiting, Rank(5, "optimizer", NOW))
    one._beat()
    message = str(zero.timeout_error(RuntimeError("Connection closed by peer\n  at gloo/pair.cc:598\n"), 60))
    assert "\n" not in message
    assert ("for the other ranks that did not arrive: no heartbeat shows a rank behind (Connection closed by peer); "
            "see the ranks' logs in logs/") in message


def test_a_stall_is_logged_once_per_position(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    waiting, behind = Rank(5, "comm_wait", NOW - 0.5), Rank(4, "forward", NOW - 2)
    zero, one = monitors(dist.HashStore(), waiting, behind)
    one._beat()
    with caplog.at_level(logging.WARNING, logger=stall.log.name):
        zero._check_stall()  # waited 0.5 s of warn_after 1 s: nothing yet
        assert caplog.records == []
        clock.now = NOW + 1.5
        zero._check_stall()
        zero._check_stall()  # the same position again: no repeat
        [record] = caplog.records
        assert record.getMessage() == ("rank 0 has waited 2 s in comm_wait of step 5 for rank(s) 1: rank 1 is in "
                                       "forward of step 4 for 3.5 s")
        waiting.move(6, "comm_wait", NOW)  # stuck again at the next step
        one._beat()
        clock.now = NOW + 2.0
        zero._check_stall()
        assert len(caplog.records) == 2


def test_an_injected_hang_ends_when_another_rank_gives_up(clock: Clock) -> None:
    hung_activity = Rank(3, "data", NOW)
    zero, one = monitors(dist.HashStore(), Rank(3, "backward", NOW), hung_activity)
    injector = FaultInjector(Faults(hang_rank=1, hang_at_step=3), rank=1)
    injector.release = one.abort  # as the Trainer wires it
    raised: list[BaseException] = []

    def rank_one() -> None:
        try:
            injector.before_step(3)
        except StallError as exc:
            raised.append(exc)

    thread = threading.Thread(target=rank_one, daemon=True)
    thread.start()
    one._beat()
    thread.join(0.1)
    assert thread.is_alive()  # hung
    zero.timeout_error(RuntimeError("Timed out"), 1.0)
    one._check_abort()
    thread.join(2.0)
    assert not thread.is_alive()
    [error] = raised
    assert str(error).startswith("rank 1 hung before batch 3 (faults.hang_rank)")


def test_the_thread_beats_at_start_and_stops_promptly() -> None:
    store = dist.HashStore()
    zero = StallMonitor(store=store, rank=0, world_size=2, activity=Rank(2, "data", 0.0), warn_after=60.0,
                        interval=0.01)
    one = StallMonitor(store=store, rank=1, world_size=2, activity=Rank(2, "forward", 0.0), warn_after=60.0,
                       interval=0.01).start()
    try:
        [beat] = zero.heartbeats()  # start() sends the first heartbeat before the thread runs
        assert (beat.rank, beat.phase, beat.position) == (1, "forward", (2, PHASES.index("forward")))
    finally:
        one.stop()
    assert not one._thread.is_alive()


@pytest.fixture
def torch_without_private_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch release that renamed the private functions comm/stall.py uses, with a process group."""
    monkeypatch.setattr(stall.dist, "is_initialized", lambda: True)
    monkeypatch.delattr(stall.distributed_c10d, "_get_default_store")
    monkeypatch.delattr(stall.distributed_c10d, "_set_pg_timeout")
    stall._say_timeout_not_set.cache_clear()


@pytest.mark.usefixtures("torch_without_private_api")
def test_without_the_private_store_getter_stall_detection_stops_with_a_named_error() -> None:
    with pytest.raises(TorchCompatibilityError, match=r"has no torch\.distributed\.distributed_c10d\."
                                                      r"_get_default_store.*install torch==2\.13\.0"):
        stall.default_store()


@pytest.mark.usefixtures("torch_without_private_api")
def test_without_the_private_timeout_setter_the_lost_timeout_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=stall.log.name):
        stall.set_collective_timeout(30.0)
        stall.set_collective_timeout(30.0)
    [record] = caplog.records
    message = record.getMessage()
    assert "_set_pg_timeout: distributed.timeout_seconds (30 s) holds only where dtrain created the process" in message
    assert message.endswith("install torch==2.13.0, the release dtrain is tested with")
