"""When things happen in a run, in batches: its length, the batch-size phases, and the meeting points (reports,
validation, checkpoints, a requested stop) at which every rank does the same thing at the same step."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from dtrain.config import ExperimentConfig, Length
from dtrain.data.sharding import BatchSplit
from dtrain.optim.batch_schedule import BatchPlan, resolve_changes


@dataclass(frozen=True)
class Schedule:
    """Lengths of the run in batches, resolved once the training data's size is known."""

    total_batches: int
    batches_per_epoch: float  # at the initial global batch
    data_batches_per_epoch: int
    validation_every: int
    checkpoint_every: int
    plan: BatchPlan  # the batch-size phases: global batch and aggregation frequency of every batch
    validation_period: Length
    checkpoint_period: Length
    report_every: int = 1  # scheduling_unit: batches between training reports
    stop_after: int | None = None  # faults.stop_after_batch

    def epoch_of(self, step: int) -> float:
        return float(self.plan.epoch_of(step))

    @property
    def batch_size_changes(self) -> bool:
        return any(0 < phase.start_step < self.total_batches for phase in self.plan.phases)

    def report_due(self, step: int) -> bool:
        return step % self.report_every == 0 or step == self.total_batches

    def validation_due(self, step: int) -> bool:
        return self._due(step, self.validation_period, self.validation_every) or step == self.total_batches

    def checkpoint_due(self, step: int) -> bool:
        return self._due(step, self.checkpoint_period, self.checkpoint_every) or step == self.total_batches

    def stop_requested(self, step: int) -> bool:
        """True once `faults.stop_after_batch` is reached."""
        return self.stop_after is not None and step >= self.stop_after

    def next_meeting(self, previous: int) -> int:
        """The first meeting point after batch `previous`: every rank visits each of them in the same order."""
        meetings = [self.total_batches]
        for every in (self.report_every, self.validation_every, self.checkpoint_every):
            if every:
                meetings.append((previous // every + 1) * every)
        if self.stop_after is not None and self.stop_after > previous:
            meetings.append(self.stop_after)
        return min(meetings)

    def describe_phases(self) -> list[str]:
        """Console lines on the batch-size phases after the first."""
        return [f"large_batch: from batch {phase.start_step} (epoch {self.epoch_of(phase.start_step):.2f}) global "
                f"batch {phase.global_batch_size} x aggregation {phase.aggregation_frequency}"
                for phase in self.plan.phases[1:] if phase.start_step < self.total_batches]

    def _due(self, step: int, period: Length, every: int) -> bool:
        """Every `every` batches; with a changing batch size, periods in records or epochs fire at the first
        batch that reaches each multiple of the period."""
        if not every:
            return False
        if period.unit == "batches" or not self.batch_size_changes:
            return step % every == 0
        return self.plan.crossed(step, Fraction(period.value), period.unit)


def resolve_schedule(config: ExperimentConfig, num_records: int, split: BatchSplit) -> Schedule:
    """Turn the config's lengths into batches; an epoch is records_per_epoch records, or one pass over the data."""
    data_batches = num_records // split.global_batch_size
    per_epoch = (config.records_per_epoch / split.global_batch_size if config.records_per_epoch
                 else float(data_batches))
    k = config.optimizations.aggregation_frequency
    growth = config.large_batch.batch_size_schedule
    changes = (resolve_changes(growth.epochs, growth.factors, growth.grow, growth.max_per_slot_batch,
                               max(split.per_rank), k) if growth is not None else [])
    plan = BatchPlan(num_records=num_records, global_batch_size=split.global_batch_size, aggregation_frequency=k,
                     records_per_epoch=config.records_per_epoch, changes=changes)

    def batches(length: Length) -> int:
        return length.value if length.unit == "batches" else plan.first_step_reaching(length.value, length.unit)

    return Schedule(total_batches=batches(config.training_length), batches_per_epoch=per_epoch,
                    data_batches_per_epoch=data_batches, validation_every=batches(config.min_validation_period),
                    checkpoint_every=batches(config.min_checkpoint_period), plan=plan,
                    validation_period=config.min_validation_period, checkpoint_period=config.min_checkpoint_period,
                    report_every=config.scheduling_unit, stop_after=config.faults.stop_after_batch)
