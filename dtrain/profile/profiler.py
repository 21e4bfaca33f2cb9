"""The Trainer's profiler: phase timers on every step, the timeline while profiling is on, per-rank profiles
for TensorBoard and the run's summary.

    profiler = Profiler(config.profiling, rank=0, run_dir=run_dir)
    with profiler.step(step, records=32):
        with profiler.phase("data"): ...
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from dtrain.config import Profiling
from dtrain.profile.device_clock import DeviceClock
from dtrain.profile.timeline import TIMELINE_TEMPLATE, Timeline
from dtrain.profile.timers import COMPUTE_PHASES, PHASES, StepRecord, StepTimer, phase_means

WARMUP_STEPS = 2  # left out of the run's profile: the first steps build buckets and warm caches
KEPT_STEPS = 20_000  # step records kept for the summary (the most recent ones)


class Profiler:
    """Owns this rank's StepTimer and, with `profiling.enabled`, its Timeline."""

    def __init__(self, settings: Profiling, *, rank: int, run_dir: Path,
                 device_clock: DeviceClock | None = None) -> None:
        """`device_clock`: the GPU's (`CudaClock`) when the rank trains on one; its phases are then timed by marks
        in the GPU's queue read later, or, with `profiling.sync_timings`, by waiting for the GPU at each phase's
        end."""
        self.settings = settings
        self.rank = rank
        synchronize = device_clock.synchronize if device_clock is not None and settings.sync_timings else None
        self.timer = StepTimer(enabled=settings.phase_timers or settings.enabled, synchronize=synchronize,
                               device_clock=device_clock if synchronize is None else None)
        self.timeline: Timeline | None = None
        if settings.enabled:
            self.timeline = Timeline(rank=rank, path=run_dir / TIMELINE_TEMPLATE.format(rank=rank),
                                     begin_on_batch=settings.begin_on_batch, end_after_batch=settings.end_after_batch)
            self.timer.set_span_sink(self.timeline.span)
        self.kept: deque[StepRecord] = deque(maxlen=KEPT_STEPS)
        self._window: list[StepRecord] = []  # steps since the last report
        self._steps_seen = 0

    @property
    def enabled(self) -> bool:
        return self.timer.enabled

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self.timer.phase(name)

    @contextmanager
    def step(self, step: int, records: int) -> Iterator[None]:
        """Time one training step; `records` is how many this rank trains in it."""
        self.timer.begin_step(step)
        yield
        spans = self.timer.split_backward()
        record = self.timer.end_step(records)
        if record is None:
            return
        self._steps_seen += 1
        self._window.append(record)
        if self._steps_seen > WARMUP_STEPS:
            self.kept.append(record)
        if self.timeline is not None:
            self.timeline.bucket_spans(step, spans)
            finished = [done for _, _, done in spans if done is not None]
            if finished and record.phases.get("comm_wait", 0.0) > 0:
                end = max(finished)
                self.timeline.span("comm_wait", end - record.phases["comm_wait"], end, step)
            self.timeline.step_span(step, record.start, record.start + record.seconds)
            if self.timeline.is_last(step):
                self.timeline.write()

    def exposed_comm_seconds(self) -> float:
        """The communication this step's backward pass has waited for after its last gradient was ready."""
        return self.timer.exposed_seconds()

    def window_profile(self) -> dict[str, float]:
        """Mean seconds per phase over the steps since the last call, plus records per step."""
        self.timer.settle(wait=True)
        window, self._window = self._window, []
        means = phase_means(window)
        if means:
            means["records"] = sum(r.records for r in window) / len(window)
        return means

    def run_profile(self) -> dict[str, Any]:
        """This rank's profile over the kept steps: mean and median seconds per phase, throughput overall (wall)
        and of its own compute (what it would do without waiting for the others)."""
        self.timer.settle(wait=True)
        records = list(self.kept) or list(self._window)
        if not records:
            return {"rank": self.rank, "steps": 0}
        means = phase_means(records)
        medians = {name: statistics.median(r.phases.get(name, 0.0) for r in records) for name in PHASES}
        medians["step"] = statistics.median(r.seconds for r in records)
        per_step = sum(r.records for r in records) / len(records)
        compute = sum(means[name] for name in COMPUTE_PHASES)
        covered = sum(means[name] for name in PHASES)
        return {"rank": self.rank, "steps": len(records), "records_per_step": per_step,
                "mean_seconds": means, "median_seconds": medians,
                "untimed_share": 1.0 - covered / means["step"] if means["step"] > 0 else 0.0,
                "samples_per_second": per_step / means["step"] if means["step"] > 0 else 0.0,
                "compute_samples_per_second": per_step / compute if compute > 0 else 0.0}

    def close(self) -> list[str]:
        """Write the timeline if profiling is on (the run ended inside its window); return the files written."""
        if self.timeline is not None and len(self.timeline.events) > 3:
            return [str(self.timeline.write())]
        return []


def tensorboard_scalars(profiles: list[dict[str, float]]) -> dict[str, float]:
    """TensorBoard tags for every rank's window profile: `profile/<phase>_ms/rank<r>` and throughput per rank."""
    scalars: dict[str, float] = {}
    for rank, means in enumerate(profiles):
        if not means:
            continue
        for name in (*PHASES, "step"):
            scalars[f"profile/{name}_ms/rank{rank}"] = means.get(name, 0.0) * 1e3
        if means.get("step"):
            scalars[f"throughput/samples_per_second/rank{rank}"] = means.get("records", 0.0) / means["step"]
    return scalars
