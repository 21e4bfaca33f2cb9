"""Step-phase timers: where each step's time goes on this rank (data wait, forward, backward, exposed
communication wait, optimizer, checkpoint, ...), cheap enough to stay on in every run.

Waits a strategy measures inside forward or backward (FSDP's all-gathers and reduce-scatters, a pipeline stage's
time waiting for the other stages: its bubble) are carved out of the phase they happened in (`carve`) and shown
as phases of their own.

Each phase is timed as its own interval inside the step, so time no phase covers shows up as a gap between the
phases' sum and the step's wall time. The communication a DDP backward pass overlaps
with computation is not a phase; only the part the rank waits for after its last gradient is ready
("comm_wait") is, which `split_backward` cuts from the backward interval using the bucket clock. The clock
learns when gradients are ready in one of two ways: from a hook on every parameter's gradient accumulation
(cheap: DDP's own C++ all-reduce keeps running, no Python in the communication), or, when the timeline
wants a span per bucket, from dtrain's comm hook, which also tells when each bucket's collective finished.

On a GPU the host clock only sees how long the CPU took to queue a phase's work. Given a device clock
(`dtrain.profile.device_clock`), the timer also marks each phase's start and end in the device's work queue and,
once the device has passed a step's marks (checked without waiting at the next step's start, waited for only
when a report reads the figures), replaces that step's phase times with the device's: the same figures as on the
CPU, and no phase makes the CPU wait for the device.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtrain.profile.device_clock import DeviceClock

# In step order; a rank's position in a step (for stall reports) is the index of the phase it is in.
PHASES = ("data", "forward", "backward", "comm_wait", "all_gather", "reduce_scatter", "bubble", "optimizer", "report",
          "validation", "checkpoint")
COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")  # what a rank does without waiting for others
PHASE_LABELS = {"data": "data wait", "forward": "forward", "backward": "backward",
                "comm_wait": "exposed communication wait", "all_gather": "FSDP all-gather",
                "reduce_scatter": "FSDP reduce-scatter", "bubble": "pipeline bubble", "optimizer": "optimizer step",
                "report": "metrics report", "validation": "validation", "checkpoint": "checkpoint"}


@dataclass
class StepRecord:
    """One step on one rank: when it started (seconds on the timer's clock), its wall time and its phases."""

    step: int
    start: float
    seconds: float
    phases: dict[str, float]
    records: int


@dataclass
class Activity:
    """What the rank is doing now, for heartbeats: the step, the phase and since when (time.time())."""

    step: int
    phase: str
    since: float

    @property
    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else len(PHASES)


@dataclass
class BucketClock:
    """When the current backward pass's gradients were ready for communication, and, with dtrain's comm hook,
    each bucket's index, ready time and the time its collective finished. Written by the sync strategy's hooks
    (`gradient_ready` per parameter, or `bucket_ready`/`bucket_done` per bucket), read by the timer."""

    clock: Callable[[], float] = time.perf_counter
    spans: list[list[Any]] = field(default_factory=list)  # [index, ready, done or None]
    last_gradient: float | None = None  # when the latest gradient of a communicating backward pass was ready

    def gradient_ready(self) -> None:
        self.last_gradient = self.clock()

    def bucket_ready(self, index: int) -> int:
        self.spans.append([index, self.clock(), None])
        return len(self.spans) - 1

    def bucket_done(self, slot: int) -> None:
        self.spans[slot][2] = self.clock()

    def exposed_seconds(self, backward_end: float | None = None) -> float:
        """How long the rank waited for communication after its last gradient was ready: with bucket spans,
        until the last collective finished (0 before any finished); with gradient times only, until the
        backward pass ended at `backward_end` (0 without it)."""
        finished = [done for _, _, done in self.spans if done is not None]
        if finished:
            return max(0.0, max(finished) - max(ready for _, ready, _ in self.spans))
        if self.spans or self.last_gradient is None or backward_end is None:
            return 0.0
        return max(0.0, backward_end - self.last_gradient)

    def take(self) -> list[tuple[int, float, float | None]]:
        spans, self.spans, self.last_gradient = self.spans, [], None
        return [(int(i), float(ready), done) for i, ready, done in spans]


def _move(phases: dict[str, float], within: str, name: str, seconds: float) -> None:
    """Move up to `seconds` of phase `within` into phase `name` (never more than `within` holds)."""
    moved = min(seconds, phases.get(within, 0.0))
    if moved > 0:
        phases[within] -= moved
        phases[name] = phases.get(name, 0.0) + moved


@dataclass
class _Pending:
    """A step whose phase times wait for the device's marks: (phase, start mark, end mark) per timed phase, and the
    moves between phases (carved waits, exposed communication) to apply again to the device's times."""

    record: StepRecord
    marks: list[tuple[str, Any, Any]]
    moves: list[tuple[str, str, float]]


RECENT_STEPS = 20_000  # step records a StepTimer keeps (the most recent): a long run must not grow without bound


class StepTimer:
    """Times the phases of each step on this rank; keeps the most recent `max_records` steps' records (for tests
    and benchmarks that read them back; the Profiler keeps its own for the summary)."""

    def __init__(self, *, enabled: bool = True, clock: Callable[[], float] = time.perf_counter,
                 on_span: Callable[[str, float, float, int], None] | None = None,
                 synchronize: Callable[[], None] | None = None, device_clock: DeviceClock | None = None,
                 max_records: int = RECENT_STEPS, max_pending: int = 64) -> None:
        """`synchronize`: wait for the device at each phase's end (the phase's host time is then the device's too);
        `device_clock` (a `dtrain.profile.device_clock.DeviceClock`): time phases by marks in the device's queue,
        read later, never waiting in the step; at most `max_pending` steps wait for theirs (then the oldest is
        waited for: a device far behind the CPU)."""
        self.enabled = enabled
        self.clock = clock
        self.buckets = BucketClock(clock)
        self.records: deque[StepRecord] = deque(maxlen=max_records)
        self.activity = Activity(step=0, phase="setup", since=time.time())
        self._on_span = on_span  # the timeline's recorder while profiling is on
        self._synchronize = synchronize
        self._device = device_clock
        self._marks: list[tuple[str, Any, Any]] = []
        self._moves: list[tuple[str, str, float]] = []
        self._pending: deque[_Pending] = deque()
        self._max_pending = max_pending
        self._step = 0
        self._start = 0.0
        self._phases: dict[str, float] = {}
        self._backward_end: float | None = None
        self._carved: list[tuple[str, str, float]] = []

    def set_span_sink(self, sink: Callable[[str, float, float, int], None] | None) -> None:
        self._on_span = sink

    def begin_step(self, step: int) -> None:
        self.settle(wait=False)  # earlier steps' device times, where the device is past them
        self._step = step
        self._phases = {}
        self._backward_end = None
        self._carved = []
        self._marks, self._moves = [], []
        self._start = self.clock()

    def carve(self, name: str, seconds: float) -> None:
        """Record a wait of `seconds` inside the phase running now, to be shown as phase `name` instead (moved at
        the end of the step, never more than the phase's own time)."""
        if self.enabled:
            self._carved.append((self.activity.phase, name, seconds))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` of the current step (phases may repeat; their times add up)."""
        self.activity = Activity(self._step, name, time.time())
        if not self.enabled:
            yield
            return
        start = self.clock()
        first = self._device.mark() if self._device is not None else None
        try:
            yield
        finally:
            if self._synchronize is not None:
                self._synchronize()
            if self._device is not None:
                self._marks.append((name, first, self._device.mark()))
            end = self.clock()
            self._phases[name] = self._phases.get(name, 0.0) + (end - start)
            if name == "backward":
                self._backward_end = end
            if self._on_span is not None:
                self._on_span(name, start, end, self._step)

    def exposed_seconds(self) -> float:
        """The communication this step's backward pass has waited for after its last gradient was ready."""
        return self.buckets.exposed_seconds(self._backward_end)

    def split_backward(self) -> list[tuple[int, float, float | None]]:
        """Move the part of this step's backward time after the last gradient was ready into `comm_wait`: the
        communication the backward pass could not hide. Return the buckets' spans (for the timeline)."""
        exposed = self.exposed_seconds()
        spans = self.buckets.take()
        if not self.enabled or "backward" not in self._phases:
            return spans
        if exposed > 0:
            _move(self._phases, "backward", "comm_wait", exposed)
            self._moves.append(("backward", "comm_wait", exposed))
        return spans

    def end_step(self, records: int) -> StepRecord | None:
        """Close the step; `records` is how many records this rank trained in it."""
        self.activity = Activity(self._step, "between steps", time.time())
        if not self.enabled:
            return None
        for within, name, seconds in self._carved:
            _move(self._phases, within, name, seconds)
        self._moves.extend(self._carved)
        self._carved = []
        record = StepRecord(self._step, self._start, self.clock() - self._start, self._phases, records)
        self.records.append(record)
        if self._marks:  # its host times stand until the device's are read
            self._pending.append(_Pending(record, self._marks, self._moves))
            while len(self._pending) > self._max_pending:
                self._resolve(self._pending.popleft())
        self._marks, self._moves = [], []
        return record

    def settle(self, *, wait: bool) -> None:
        """Put the device's phase times into the steps that wait for them: those the device has passed, or, with
        `wait` (a report about to read the figures), all of them."""
        while self._pending and self._device is not None and (
                wait or self._device.done(self._pending[0].marks[-1][2])):
            self._resolve(self._pending.popleft())

    def _resolve(self, pending: _Pending) -> None:
        assert self._device is not None
        phases: dict[str, float] = {}
        for name, first, last in pending.marks:
            phases[name] = phases.get(name, 0.0) + self._device.seconds(first, last)
            self._device.release(first)
            self._device.release(last)
        for within, name, seconds in pending.moves:
            _move(phases, within, name, seconds)
        pending.record.phases.clear()
        pending.record.phases.update(phases)


def phase_means(records: list[StepRecord]) -> dict[str, float]:
    """Mean seconds per step of every phase (0 for phases that never ran), plus `step` (the mean wall time)."""
    if not records:
        return {}
    means = {name: sum(r.phases.get(name, 0.0) for r in records) / len(records) for name in PHASES}
    means["step"] = sum(r.seconds for r in records) / len(records)
    return means


def rank_profile(records: list[StepRecord], skip_first: int = 0) -> dict[str, Any]:
    """This rank's phase means and throughput over its steps (the first `skip_first` left out as warm-up):
    `samples_per_second` over wall time and `compute_samples_per_second` over its own compute phases (what it
    would do without waiting for the others)."""
    kept = records[skip_first:] if len(records) > skip_first else records
    means = phase_means(kept)
    if not means:
        return {"steps": 0}
    records_per_step = sum(r.records for r in kept) / len(kept)
    compute = sum(means[name] for name in COMPUTE_PHASES)
    return {"steps": len(kept), "phase_seconds": means,
            "samples_per_second": records_per_step / means["step"] if means["step"] > 0 else 0.0,
            "compute_samples_per_second": records_per_step / compute if compute > 0 else 0.0}
