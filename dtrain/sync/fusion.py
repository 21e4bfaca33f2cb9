"""Tensor-fusion auto-tuning: which gradient bucket size makes a training step fastest on this model,
this network and this machine.

After a few warm-up steps (the first steps of a run are slow for reasons that have nothing to do with
buckets: allocator, caches) the allreduce strategy trains with each candidate size in turn, in `rounds`
passes whose order alternates (A B C, C B A, A B C, ...) so that drift in machine load hits every
candidate alike. A visit's first step (the one that rebuilds the buckets) is not timed; the median of the
others, averaged over the ranks, is the visit's time. The candidate with the smallest median visit time
wins (a median, so that one visit disturbed by another process cannot decide).
The tuner only sees numbers: the strategy times the steps and all-reduces them, so every rank holds the
same numbers and takes the same decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

BYTES_PER_MB = 1024 * 1024


def candidate_bucket_sizes(model_mb: float, configured_mb: float, divisions: tuple[int, ...] = (1, 4, 16)
                           ) -> list[float]:
    """Sizes (MB) worth trying: the configured one, the whole model in one bucket, and the model cut into
    about 4 and 16 buckets. Sizes at or above the model's are all one bucket, so only one of them is kept;
    sizes below 0.25 MB (messages dominated by latency) are left out."""
    whole = max(model_mb, 1e-3) * 1.01  # a hair above the model, so rounding cannot split it in two
    sizes: list[float] = [min(configured_mb, whole)]
    for parts in divisions:
        size = whole if parts == 1 else model_mb / parts
        if size >= 0.25 and all(not math.isclose(size, s, rel_tol=0.05) for s in sizes):
            sizes.append(size)
    return [round(s, 4) for s in sizes]


@dataclass
class FusionTuner:
    """After `warmup_steps`, visits every candidate `rounds` times for `steps_per_visit` steps (the first
    untimed) and keeps the fastest. Feed it each step's time with `observe`; when `visit_complete()`, close
    the visit with `finish_visit` and train with `current`."""

    candidates: list[float]
    steps_per_visit: int = 6
    rounds: int = 3
    warmup_steps: int = 5
    visits: list[tuple[float, float]] = field(default_factory=list)  # (MB, median step seconds, rank mean)
    _visit_index: int = 0
    _samples: list[float] = field(default_factory=list)
    _seen_in_visit: int = 0
    _warmed_up: int = 0

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("fusion tuning needs at least one candidate bucket size")
        if self.steps_per_visit < 2:
            raise ValueError("each visit needs at least 2 steps: one to rebuild the buckets, one to time")
        order: list[float] = []
        for round_index in range(self.rounds):
            order += self.candidates if round_index % 2 == 0 else list(reversed(self.candidates))
        self._order = order

    @property
    def done(self) -> bool:
        return self._visit_index >= len(self._order)

    @property
    def current(self) -> float:
        """The bucket size to train with now (the best one once tuning is done)."""
        return self.best if self.done else self._order[self._visit_index]

    def visit_complete(self) -> bool:
        return self._seen_in_visit >= self.steps_per_visit

    def observe(self, seconds: float) -> None:
        """One step's local time at the current candidate; the first of a visit is not timed."""
        if self.done:
            return
        if self._warmed_up < self.warmup_steps:
            self._warmed_up += 1
            return
        if self._seen_in_visit > 0:
            self._samples.append(seconds)
        self._seen_in_visit += 1

    def local_median(self) -> float:
        return _median(self._samples)

    def finish_visit(self, reduced_seconds: float) -> None:
        """Close the current visit with its time as agreed by all ranks, and move on."""
        self.visits.append((self._order[self._visit_index], reduced_seconds))
        self._visit_index += 1
        self._samples, self._seen_in_visit = [], 0

    def visit_times(self) -> dict[float, float]:
        """Median visit time of every candidate visited so far."""
        totals: dict[float, list[float]] = {}
        for size, seconds in self.visits:
            totals.setdefault(size, []).append(seconds)
        return {size: _median(times) for size, times in totals.items()}

    @property
    def best(self) -> float:
        means = self.visit_times()
        if not means:
            return self.candidates[0]
        return min(means, key=lambda size: (means[size], size))

    def report(self) -> str:
        """One line for the log: the choice and every candidate's mean step time."""
        means = self.visit_times()
        shown = ", ".join(f"{size:g} MB {means[size] * 1e3:.2f} ms" for size in sorted(means))
        return (f"tensor fusion auto-tune: bucket size {self.best:g} MB chosen from {len(means)} candidates "
                f"(median step time over {self.rounds} visits: {shown})")

    def state_dict(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "visits": [list(v) for v in self.visits], "done": self.done}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
