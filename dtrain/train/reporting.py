"""Rank 0's training figures: a row per optimizer update (rate, batch size, bytes sent) and, at each report, the
record-weighted means of the Trial's training metrics since the last one, every rank's phase profile and the
strategy's own scalars; plus the byte counts of the strategy's gradient communication."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dtrain.comm import Topology, all_gather_object, all_reduce_sums
from dtrain.compress import WireStats
from dtrain.data.sharding import BatchSplit
from dtrain.errors import TrainingDiverged
from dtrain.profile import Profiler, tensorboard_scalars
from dtrain.sync import SyncStrategy
from dtrain.train.batches import metric_term
from dtrain.train.guard import RECIPE_ADVICE
from dtrain.train.metrics import MetricsWriter
from dtrain.train.schedule import Schedule
from dtrain.train.state import TrainerState, TrainingClock


class WireMeter:
    """The bytes the strategy's gradient communication sent, per update and added to the run's totals (nothing is
    counted for a strategy whose `take_wire_stats` keeps StrategyBase's default)."""

    def __init__(self, strategy: SyncStrategy) -> None:
        self._take: Callable[[], WireStats | None] = strategy.take_wire_stats

    def count(self, state: TrainerState) -> WireStats | None:
        """The bytes the update that just ran sent (None if nothing was sent), added to `state`'s totals."""
        wire = self._take()
        if wire is None or not wire.buckets:
            return None
        state.communicating_steps += 1
        state.wire_bytes += wire.wire_bytes
        state.payload_bytes += wire.payload_bytes
        state.dense_wire_bytes += wire.dense_wire_bytes
        return wire


class TrainingMetrics:
    """Record-weighted sums of the Trial's training metrics: those of the batches of the update in progress, and
    those of the applied updates since the last report (a skipped update's batches are left out). Tensor metrics
    are summed where they live (on a GPU, on the device) and read only by `take_report`, at a report."""

    def __init__(self) -> None:
        self.update: dict[str, torch.Tensor | float] = {}
        self.since_report: dict[str, torch.Tensor | float] = {}

    def add_batch(self, outputs: Mapping[str, Any], records: int) -> None:
        for name, value in outputs.items():
            self.update[name] = self.update.get(name, 0.0) + metric_term(name, value, "train_batch()") * records
        self.update["__records"] = self.update.get("__records", 0.0) + records

    def end_update(self, applied: bool) -> None:
        if applied:
            for name, total in self.update.items():
                self.since_report[name] = self.since_report.get(name, 0.0) + total
        self.update = {}

    def take_report(self) -> dict[str, float]:
        """The sums since the last report, read (on a GPU this waits for the device: a report boundary)."""
        sums, self.since_report = self.since_report, {}
        return {name: float(total) for name, total in sums.items()}


class Reporter:
    """Writes the training rows (rank 0), at the step's epoch and wall time, and checks at each report that
    training has not diverged."""

    def __init__(self, writer: MetricsWriter, profiler: Profiler, topology: Topology, strategy: SyncStrategy,
                 schedule: Schedule, clock: TrainingClock) -> None:
        self.writer = writer
        self.profiler = profiler
        self.topology = topology
        self.schedule = schedule
        self.clock = clock
        self.strategy_metrics: Callable[[], dict[str, float]] = strategy.metrics

    def update(self, step: int, *, lr: float, split: BatchSplit, aggregation_frequency: int,
               wire: WireStats | None) -> None:
        """The rate, batch size and bytes sent of the optimizer update after batch `step`."""
        if not self.topology.is_chief:
            return
        values = {"lr": lr, "global_batch_size": float(split.global_batch_size),
                  "effective_batch_size": float(split.global_batch_size * aggregation_frequency)}
        if wire is not None:
            values.update(bytes_per_step=wire.wire_bytes, payload_bytes_per_step=float(wire.payload_bytes),
                          compression_ratio=wire.compression_ratio)
        self.writer.training(step, self.schedule.epoch_of(step), self.clock.wall(), values)

    def training(self, step: int, sums: dict[str, float], *, samples_per_second: float, lr: float,
                 global_batch_size: int, extend: Callable[[dict[str, float]], dict[str, float]] | None = None
                 ) -> None:
        """The means of `sums` over all ranks (a collective); TrainingDiverged on every rank if one is not finite.
        `extend` (the Trial's training_metrics hook, every rank) may add metrics to the finite means."""
        reduced = all_reduce_sums(sums)
        records = reduced.pop("__records", 0.0)
        values = {name: value / records for name, value in reduced.items()} if records else {}
        broken = sorted(name for name, value in values.items() if not math.isfinite(value))
        if broken:  # every rank sees the same reduced sums, so all stop here together
            raise TrainingDiverged(
                f"training diverged: the mean training {' and '.join(broken)} up to batch {step} is not finite "
                f"(learning rate {lr:.4g}, global batch {global_batch_size}); {RECIPE_ADVICE}")
        if extend is not None:
            values = extend(values)
        values["samples_per_second"] = samples_per_second
        window = self.profiler.window_profile() if self.profiler.enabled else {}
        profiles = all_gather_object(window) if self.profiler.enabled and self.topology.is_distributed else [window]
        if self.topology.is_chief:
            values.update(self.strategy_metrics())
            self.writer.training(step, self.schedule.epoch_of(step), self.clock.wall(), values)
            self.writer.scalars(step, tensorboard_scalars(profiles))
            self.writer.flush()
