"""Batch-size schedules (Smith, Kindermans, Le 2017, "Don't Decay the Learning Rate, Increase the Batch Size",
arXiv:1711.00489) and the exact accounting of a run whose global batch changes.

A `BatchPlan` says which global batch and aggregation frequency train each batch of the run, where in the
shuffled data (pass, record offset) each batch starts, and how many records and epochs lie behind any step.
Everything is a pure function of the step, so a resumed run finds its place from the step alone. An epoch is
`records_per_epoch` records when that is set, otherwise one pass over the data (a pass drops the records that do
not fill a last global batch, as the sampler does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from dtrain.config import GrowBy
from dtrain.errors import ConfigError


@dataclass(frozen=True)
class BatchChange:
    """From the first optimizer step at or after `epoch`: per-rank batches are the configured ones times
    `batch_multiplier`, and `aggregation_frequency` batches make one update."""

    epoch: float
    batch_multiplier: int
    aggregation_frequency: int


def resolve_changes(epochs: Sequence[float], factors: Sequence[int], grow: GrowBy, max_per_slot_batch: int | None,
                    per_slot_batch: int, aggregation_frequency: int) -> list[BatchChange]:
    """Turn "multiply the global batch by f at epoch e" into per-slot batch and aggregation settings.

    `grow: per_slot_batch` multiplies the per-slot batch, except that a multiplication that would take it above
    `max_per_slot_batch` multiplies aggregation_frequency instead; `grow: aggregation_frequency` always does.
    """
    multiplier, k, changes = 1, aggregation_frequency, []
    for epoch, factor in zip(epochs, factors, strict=True):
        too_big = max_per_slot_batch is not None and per_slot_batch * multiplier * factor > max_per_slot_batch
        if grow == "aggregation_frequency" or too_big:
            k *= factor
        else:
            multiplier *= factor
        changes.append(BatchChange(epoch, multiplier, k))
    return changes


@dataclass(frozen=True)
class BatchPhase:
    """A stretch of batches with one global batch size and aggregation frequency."""

    start_step: int  # batches completed before the phase's first batch
    batch_multiplier: int
    global_batch_size: int  # records per batch over all ranks
    aggregation_frequency: int
    start_pass: int  # where its first batch starts in the data (before skipping a tail too short for it)
    start_offset: int
    start_samples: int

    @property
    def records_per_update(self) -> int:
        return self.global_batch_size * self.aggregation_frequency


class BatchPlan:
    """The phases of a run and the step <-> data position / records / epochs arithmetic over them."""

    def __init__(self, *, num_records: int, global_batch_size: int, aggregation_frequency: int,
                 records_per_epoch: int = 0, changes: Sequence[BatchChange] = ()) -> None:
        if num_records < global_batch_size:
            raise ConfigError(f"the training data has {num_records} records, fewer than one global batch "
                              f"({global_batch_size}); lower hyperparameters.global_batch_size")
        self.num_records = num_records
        self.records_per_epoch = records_per_epoch
        self.phases = [BatchPhase(0, 1, global_batch_size, aggregation_frequency, 0, 0, 0)]
        for change in changes:
            self._add_phase(change, global_batch_size * change.batch_multiplier)

    def _add_phase(self, change: BatchChange, global_batch: int) -> None:
        if global_batch > self.num_records:
            raise ConfigError(f"large_batch.batch_size_schedule grows the global batch to {global_batch} at epoch "
                              f"{change.epoch:g}, more than the {self.num_records} training records; use smaller "
                              "factors or fewer milestones")
        current = self.phases[-1]
        target = Fraction(change.epoch)
        windows = _first_true(lambda m: self._epoch_in(current, m * current.aggregation_frequency) >= target, 1)
        batches = windows * current.aggregation_frequency
        data_pass, offset = self._end_of(current, batches)
        self.phases.append(BatchPhase(
            start_step=current.start_step + batches, batch_multiplier=change.batch_multiplier,
            global_batch_size=global_batch, aggregation_frequency=change.aggregation_frequency,
            start_pass=data_pass, start_offset=offset,
            start_samples=current.start_samples + batches * current.global_batch_size))

    # --------------------------------------------------------------------------------- within one phase

    def _start_of(self, phase: BatchPhase) -> tuple[int, int]:
        """Where the phase's first batch really starts: a tail shorter than its batch is skipped."""
        if phase.start_offset + phase.global_batch_size > self.num_records:
            return phase.start_pass + 1, 0
        return phase.start_pass, phase.start_offset

    def _end_of(self, phase: BatchPhase, n: int) -> tuple[int, int]:
        """(pass, record offset) just after the phase's n-th batch (n >= 1)."""
        size = self.num_records
        batch = phase.global_batch_size
        data_pass, offset = self._start_of(phase)
        first = (size - offset) // batch
        if n <= first:
            return data_pass, offset + n * batch
        passes, index = divmod(n - first - 1, size // batch)
        return data_pass + 1 + passes, (index + 1) * batch

    def _epoch_in(self, phase: BatchPhase, n: int) -> Fraction:
        """Epochs completed after the phase's n-th batch (n >= 1)."""
        if self.records_per_epoch:
            return Fraction(phase.start_samples + n * phase.global_batch_size, self.records_per_epoch)
        data_pass, offset = self._end_of(phase, n)
        usable = self.num_records // phase.global_batch_size * phase.global_batch_size
        return data_pass + Fraction(offset, usable)

    # ------------------------------------------------------------------------------------ by step

    def phase_at(self, step: int) -> BatchPhase:
        """The phase that trains the batch after `step` completed batches."""
        return next(phase for phase in reversed(self.phases) if phase.start_step <= step)

    def _phase_of_batch(self, step: int) -> BatchPhase:
        """The phase that trained batch number `step` (>= 1)."""
        return next(phase for phase in reversed(self.phases) if phase.start_step < step)

    def phase_end(self, phase: BatchPhase) -> int | None:
        """The step after which the next phase starts; None for the last phase."""
        index = self.phases.index(phase)
        return self.phases[index + 1].start_step if index + 1 < len(self.phases) else None

    def position_at(self, step: int) -> tuple[int, int]:
        """(pass, record offset) where the batch after `step` completed batches starts."""
        phase = self.phase_at(step)
        if step == phase.start_step:
            return self._start_of(phase)
        data_pass, offset = self._end_of(phase, step - phase.start_step)
        if offset + phase.global_batch_size > self.num_records:
            return data_pass + 1, 0
        return data_pass, offset

    def epoch_of(self, step: int) -> Fraction:
        """Epochs completed after `step` batches."""
        if step <= 0:
            return Fraction(0)
        phase = self._phase_of_batch(step)
        return self._epoch_in(phase, step - phase.start_step)

    def samples_at(self, step: int) -> int:
        """Records trained on (over all ranks) in the first `step` batches."""
        if step <= 0:
            return 0
        phase = self._phase_of_batch(step)
        return phase.start_samples + (step - phase.start_step) * phase.global_batch_size

    def progress(self, step: int, unit: str) -> Fraction:
        if unit == "batches":
            return Fraction(step)
        return Fraction(self.samples_at(step)) if unit == "records" else self.epoch_of(step)

    def is_boundary(self, step: int) -> bool:
        """Whether batch number `step` ends an aggregation window (an optimizer step follows it)."""
        phase = self._phase_of_batch(step)
        return (step - phase.start_step) % phase.aggregation_frequency == 0

    def first_step_reaching(self, value: float | Fraction, unit: str) -> int:
        """The first step after which progress in `unit` is at least `value` (0 for value <= 0)."""
        target = Fraction(value)
        return _first_true(lambda step: self.progress(step, unit) >= target, 0)

    def optimizer_steps(self, total_batches: int) -> int:
        """Optimizer updates in a run of `total_batches` (a last incomplete window counts as one)."""
        updates = 0
        for phase in self.phases:
            end = self.phase_end(phase)
            stop = total_batches if end is None else min(end, total_batches)
            if stop > phase.start_step:
                updates += math.ceil((stop - phase.start_step) / phase.aggregation_frequency)
        return updates

    def crossed(self, step: int, period: Fraction, unit: str) -> bool:
        """Whether batch `step` is the first to reach a multiple of `period` (in `unit`)."""
        return (self.progress(step, unit) // period) > (self.progress(step - 1, unit) // period)


def _first_true(predicate: Callable[[int], bool], low: int) -> int:
    """The smallest n >= low with predicate(n), for a predicate that stays true once true (doubling, then bisection)."""
    if predicate(low):
        return low
    span = 1
    while not predicate(low + span):
        span *= 2
    lo, hi = low + span // 2, low + span  # predicate(lo) is false (or lo == low), predicate(hi) is true
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid
    return hi
