"""The training loop: one Trainer runs in every worker process and trains one trial in lockstep with the others.

It owns the loop so that a Trial only says what one batch means, and a strategy only how replicas stay
consistent (dtrain.sync). Every rank takes the same decisions at the same step (validate, report, checkpoint,
stop), so collectives always line up. A step reads as three stages: get the batch and run forward/backward;
apply the update (guard, rate, strategy step, wire bytes); at a meeting point report, validate, checkpoint, stop.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from contextlib import nullcontext
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import nn

from dtrain.comm import Topology, any_rank, broadcast_object
from dtrain.comm.shm import ShmAllGather, setup_allgather
from dtrain.config import ExperimentConfig, effective_precision, model_parallel_size
from dtrain.data.sharding import BatchSplit
from dtrain.data.synthetic import synthetic_replay
from dtrain.errors import TrialError
from dtrain.profile import Profiler
from dtrain.profile.device_clock import CudaClock
from dtrain.runs.membership import NODE_RANGE_ENV
from dtrain.runs.preemptions import describe_preemptions, read_preemptions
from dtrain.runs.rundir import SUMMARY_FILE, RunInfo, write_json_atomic
from dtrain.sync import (
    AsynchronousPacing,
    Consolidating,
    EvaluatesInStages,
    HoldsModelParts,
    RunsForwardBackward,
    ShardedConstruction,
    SyncStrategy,
    build_strategy,
    forward_is_collective,
)
from dtrain.train.advice import StopAdvisor
from dtrain.train.balance import build_balancing, initial_split
from dtrain.train.batches import (
    BatchSizes,
    SizedDataset,
    TrainingBatches,
    check_dataset,
    check_same_data_on_all_ranks,
    move_to_device,
)
from dtrain.train.callbacks import StepCallbacks
from dtrain.train.checkpointing import (
    Checkpoint,
    Checkpointer,
    CheckpointPolicy,
    agreed_store,
    checkpoint_state_of,
    read_checkpoint,
    resume,
    uploads_in_background,
)
from dtrain.train.compute import LocalForwardBackward, TimedCompute
from dtrain.train.evaluation import Evaluator, SearcherMetric
from dtrain.train.faults import FAULTS_FILE, FaultInjector
from dtrain.train.guard import GracefulStop, UpdateGuard
from dtrain.train.membership import note_membership
from dtrain.train.memory import apply_activation_checkpointing
from dtrain.train.metrics import MetricsWriter
from dtrain.train.optimization import build_optimization
from dtrain.train.precision import MixedPrecision
from dtrain.train.progress import Progress
from dtrain.train.reporting import Reporter, TrainingMetrics, WireMeter
from dtrain.train.resize import resumed_split
from dtrain.train.rng import seed_everything
from dtrain.train.schedule import Schedule, resolve_schedule
from dtrain.train.stalls import StallWatch
from dtrain.train.state import TrainerState, TrainingClock
from dtrain.train.summary import replicas_identical, run_profile, run_summary
from dtrain.train.tracking import start_tracking
from dtrain.train.trial import Trial, TrialContext

log = logging.getLogger(__name__)


class Lockstep:
    """The pacing of a strategy without the AsynchronousPacing extension: every rank takes every step together."""

    lockstep = True

    def steps_done(self, step: int) -> int:
        return step


def _replicas_never_differ(*, snapshot: bool = False) -> None:
    """The consolidation of a strategy without the Consolidating extension: nothing to do."""


class Update(NamedTuple):
    """What an optimizer update did, the same on every rank."""

    reached: int  # the batch number this rank has reached (ahead of the step only for asynchronous strategies)
    stop: bool  # a stop was requested and the ranks stop together here


class Trainer:
    """Builds the trial's data, model, strategy and optimizer (resuming from the latest checkpoint), then `fit()`
    trains it in this process, in lockstep with the other ranks."""

    def __init__(self, *, config: ExperimentConfig, trial_class: type[Trial], topology: Topology,
                 run_info: RunInfo, context_overrides: Mapping[str, Any] | None = None,
                 batch_split: BatchSplit | None = None, stop_advisor: StopAdvisor | None = None) -> None:
        """`batch_split` gives per-rank batch sizes (uneven ones too: each rank's gradient is weighted by its
        share); by default `distributed.heterogeneous` decides (dtrain.train.balance), or the global batch is cut
        evenly. `stop_advisor` (given on every rank, asked on the chief) may stop the run after a validation: a
        search's searcher."""
        self.config = config
        self.topology = topology
        self.run_info = run_info
        self.run_dir = run_info.run_dir
        # data replicas: every rank, except that the ranks of one pipeline share a replica's batches
        stages = model_parallel_size(config.distributed)
        replicas, replica = topology.world_size // stages, topology.rank // stages
        self.checkpoints = agreed_store(run_info.checkpoints, topology)
        checkpoint = read_checkpoint(self.checkpoints, topology)  # first: its global batch decides the split
        split = (batch_split or resumed_split(config, replicas, checkpoint.state if checkpoint else None)
                 or initial_split(config, replicas))
        if len(split.per_rank) != replicas:
            raise ValueError(f"batch_split has {len(split.per_rank)} ranks, the run {replicas} data replicas")
        self.seed = config.reproducibility.experiment_seed
        self.channels_last = config.optimizations.memory_format == "channels_last"
        self.faults = FaultInjector(config.faults, topology.rank, record_path=self.run_dir / "logs" / FAULTS_FILE,
                                    restart_count=topology.restart_count)
        self.callbacks = StepCallbacks([self.faults] if self.faults.armed else [])
        seed_everything(self.seed)  # identical initial weights on every rank
        self.context = TrialContext(
            hparams=config.hyperparameters, rank=topology.rank, world_size=topology.world_size,
            local_rank=topology.local_rank, batch_split=split, device=topology.device, seed=self.seed,
            data_config=config.data, run_dir=self.run_dir, config_dir=run_info.config_dir,
            aggregation_frequency=config.optimizations.aggregation_frequency, experiment_config=config,
            **(context_overrides or {}))
        self.trial = trial_class(self.context)
        self.status = "running"
        self.stop_advisor = stop_advisor
        self.stopped_by: str | None = None

        # data and schedule
        self.train_data, self.val_data = self._build_data()
        self.schedule = self._resolve_schedule(split)
        self.sizes = BatchSizes(split, rank=replica, world_size=replicas,
                                average_aggregated=config.optimizations.average_aggregated_gradients,
                                max_per_pass=config.optimizations.max_per_slot_batch)

        # model, strategy, optimizer: the strategy wraps the model before the optimizer sees its parameters
        self.strategy: SyncStrategy = build_strategy(config, topology)
        self.model = self._build_model()
        self.profiler = self._build_profiler()
        if checkpoint is not None:  # before wrapping: the strategy's state may decide how it wraps (bucket size)
            self.strategy.load_state_dict(checkpoint.strategy_state)
        self.wrapped = self.strategy.wrap_model(self.model)
        self.optimization = build_optimization(config, self.trial, self.model, self.schedule, self.strategy)
        self.checkpoint_state = checkpoint_state_of(self.strategy)
        self.resumed = checkpoint is not None
        self.state = self._resume(checkpoint) if checkpoint is not None else self._start()
        if checkpoint is not None:
            self.trial.load_state_dict(dict(checkpoint.state.get("trial") or {}))
        # every checkpoint records the split (a re-balance's too): a resume at any size keeps its global batch
        self.state.batch_split = list(self.sizes.base.per_rank)
        self.balancing, meter = build_balancing(config, topology, self.model, lambda: self.sizes.records)
        if meter is not None:
            self.callbacks.register(meter)

        # the strategy's extensions, or the Trainer's one default behaviour for each
        self.pacing: AsynchronousPacing = self.strategy if isinstance(self.strategy, AsynchronousPacing) else Lockstep()
        self.consolidate = (self.strategy.consolidate if isinstance(self.strategy, Consolidating)
                            else _replicas_never_differ)
        self.forward_backward: RunsForwardBackward = (
            self.strategy if isinstance(self.strategy, RunsForwardBackward) else LocalForwardBackward(self.strategy))
        precision = effective_precision(config.optimizations)
        if precision != "fp32":  # autocast (and fp16's loss scaler) around whichever stage runs
            self.forward_backward = MixedPrecision(self.forward_backward, precision, topology.device,
                                                   self.optimization.scaler, self.optimization.optimizer,
                                                   topology.is_distributed)

        # the stages' parts
        self.batches = TrainingBatches(self.train_data, self.schedule.plan, self.sizes, seed=self.seed,
                                       num_workers=config.data_loader.num_workers,
                                       pin_memory=topology.device.type == "cuda")
        self.batch_stream = self.batches.starting_at(self.state.steps_completed)
        self.compute = TimedCompute(self.profiler, self.callbacks)
        self.stop = GracefulStop()
        self.guard = UpdateGuard(config.nan_policy, config.max_consecutive_nan_skips, self.stop,
                                 skipped=self.state.nan_steps_skipped, collective=self.pacing.lockstep,
                                 rank=topology.rank, exchange=self._guard_exchange())
        self.wire = WireMeter(self.strategy)
        self.training_metrics = TrainingMetrics()
        self.update_began_after = self.state.steps_completed  # the batch after which the current update began
        self.clock = TrainingClock()
        chief = topology.is_chief
        tracker = (start_tracking(config.tracking, name=config.name, hyperparameters=config.hyperparameters,
                                  run_dir=self.run_dir) if chief else None)
        self.metrics = MetricsWriter(store_path=run_info.store if chief else None, trial_id=run_info.trial_id,
                                     tensorboard_dir=self.run_dir / "tensorboard" if chief else None, tracker=tracker)
        self.reporter = Reporter(self.metrics, self.profiler, topology, self.strategy, self.schedule, self.clock)
        self.progress = Progress(self.schedule.total_batches, self.state.steps_completed,
                                 split.global_batch_size, enabled=chief, report_every=config.scheduling_unit)
        self.searcher = SearcherMetric(config.searcher.metric, smaller_is_better=config.searcher.smaller_is_better)
        self.evaluator = Evaluator(self.val_data, self.trial, topology, channels_last=self.channels_last,
                                   lockstep=forward_is_collective(self.strategy),
                                   stages=self.strategy if isinstance(self.strategy, EvaluatesInStages) else None)
        self.checkpointer = Checkpointer(self.checkpoints, topology, self.checkpoint_state,
                                         CheckpointPolicy(config, self.schedule, self.searcher), self.callbacks,
                                         background=uploads_in_background(config.checkpoint_storage, self.checkpoints))
        self.stalls = StallWatch(topology, config.distributed, self.profiler.timer)
        self.faults.release = self.stalls.abort  # an injected hang ends when the run gives up on it

    def _build_data(self) -> tuple[SizedDataset, SizedDataset]:
        train = check_dataset(self.trial.build_training_data(), "build_training_data")
        if self.config.faults.synthetic_data:
            train = synthetic_replay(train)
        return train, check_dataset(self.trial.build_validation_data(), "build_validation_data")

    def _resolve_schedule(self, split: BatchSplit) -> Schedule:
        """The run's lengths in batches, which the Trial's context tells it too."""
        schedule = resolve_schedule(self.config, len(self.train_data), split)
        self.context.batches_per_epoch = schedule.data_batches_per_epoch
        self.context.total_batches = schedule.total_batches
        self.context.optimizer_steps_total = schedule.plan.optimizer_steps(schedule.total_batches)
        return schedule

    def _build_model(self) -> nn.Module:
        """The Trial's model on this rank's device; a strategy that shards the model may have it built on the meta
        device (no memory), and materializes its own shards when it wraps it."""
        construction = (self.strategy.model_construction() if isinstance(self.strategy, ShardedConstruction)
                        else nullcontext())
        with construction:
            model = self.trial.build_model()
        if not isinstance(model, nn.Module):
            raise TrialError(f"build_model() returned {type(model).__name__}; return a torch.nn.Module")
        if not any(tensor.is_meta for tensor in chain(model.parameters(), model.buffers())):
            model = model.to(self.topology.device)
            if self.channels_last:
                # torch's stub for Module.to lacks memory_format, which Module.to takes
                model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        apply_activation_checkpointing(model, self.config.optimizations.activation_checkpointing)
        return model

    def _build_profiler(self) -> Profiler:
        """Phase timers and the timeline; a strategy that can tells the timers when gradients are communicated."""
        device = self.topology.device
        profiler = Profiler(self.config.profiling, rank=self.topology.rank, run_dir=self.run_dir,
                            device_clock=CudaClock(device) if device.type == "cuda" else None)
        if profiler.enabled and self.topology.is_distributed:
            self.strategy.observe_buckets(profiler.timer.buckets, per_bucket=profiler.timeline is not None)
            self.strategy.observe_waits(profiler.timer.carve)
        return profiler

    def _guard_exchange(self) -> ShmAllGather | None:
        """The shared-memory all-gather that carries the update guard's flags when every rank is on this host with a
        core of its own (a collective: every rank builds its Trainer); None where the guard uses gloo."""
        if not (self.pacing.lockstep and self.topology.is_distributed):
            return None
        return setup_allgather(2, "auto", what="the update guard's exchange")

    def _resume(self, checkpoint: Checkpoint) -> TrainerState:
        return resume(checkpoint, self.checkpoints, self.checkpoint_state, self.optimization,
                      self.topology.rank)

    def _start(self) -> TrainerState:
        seed_everything(self.seed * 1000 + 17 + self.topology.rank)  # each rank its own random stream
        return TrainerState()

    # ---------------------------------------------------------------------------------------- the run

    def fit(self) -> dict[str, Any]:
        """Train to `searcher.max_length` (or a stop) and return the run's summary."""
        check_same_data_on_all_ranks(self.train_data, self.val_data, self.topology)
        self.metrics.status("running")
        self._announce()
        note_membership(self.run_dir, self.topology, self.state.steps_completed, self.metrics, self.progress)
        self.stalls.start()
        try:
            with self.stop:  # a signal during the last upload's wait does not cut it short
                try:
                    self._train()
                except BaseException:
                    self.checkpointer.finish_uploads(failed=True)
                    raise
                self.checkpointer.finish_uploads()
                self._announce_checkpoints()
        finally:
            self.progress.close()
            self.stalls.stop()
        return self._finish()

    def _train(self) -> None:
        """Batch after batch until the end of the schedule or a stop."""
        state = self.state
        self.clock.start(state)
        if self.config.perform_initial_validation and not self.resumed and state.steps_completed == 0:
            self._validate(0)
        while state.steps_completed < self.schedule.total_batches:
            try:
                stopped = self._step()
            except RuntimeError as exc:
                raise self.stalls.failure(exc) from None
            if stopped:
                break
        self.clock.save(state)
        if self.status == "running":
            self.status = "completed"

    def _step(self) -> bool:
        """Train one batch; at a meeting point also report, validate and checkpoint. True when training stops."""
        previous = self.state.steps_completed
        step = previous + 1
        started = time.perf_counter()
        self._enter_phase(step)
        boundary = self.schedule.plan.is_boundary(step) or step == self.schedule.total_batches
        with self.profiler.step(step, records=self.sizes.records):
            outputs = self._forward_backward(step, communicate=boundary)
            update = self._update(step, previous) if boundary else None
            reached = update.reached if update is not None else step
            self._advance(previous, reached, started)
            if update is not None:
                self._rebalance(reached)
            if reached == previous:
                return False  # the parameter servers have not completed another global batch yet
            self.progress.update(reached, self.schedule.epoch_of, outputs["loss"])
            return self._meet(reached, update)

    # ------------------------------------------------------------------------- stage 1: batch and compute

    def _enter_phase(self, step: int) -> None:
        """Train batch `step` with its batch-size phase's split and aggregation."""
        done = step - 1
        before = self.sizes.phase
        phase = self.schedule.plan.phase_at(done)
        if not self.sizes.enter(phase):
            return
        if before is not None:
            self.progress.note(f"batch-size schedule: from batch {done} (epoch {self.schedule.epoch_of(done):.2f}) "
                               f"global batch {phase.global_batch_size} x aggregation {phase.aggregation_frequency}")
        self.context.batch_split = self.sizes.split
        self.context.aggregation_frequency = phase.aggregation_frequency
        self.progress.change_global_batch(done, self.sizes.split.global_batch_size)

    def _forward_backward(self, step: int, *, communicate: bool) -> Mapping[str, Any]:
        """Load batch `step`, run forward and backward (the strategy's stage or the default one), add its metrics
        to the update's; return the Trial's outputs. A batch larger than `optimizations.max_per_slot_batch` runs
        as several passes whose gradients accumulate here (only the last communicates), each loss scaled by its
        share of the batch, so the update is the whole batch's (the last pass's outputs are returned)."""
        self.context.batches_trained = step - 1
        passes = self.sizes.pass_records
        outputs: Mapping[str, Any] = {}
        for index, records in enumerate(passes):
            with self.profiler.phase("data"):
                if index == 0:
                    self.callbacks.before_step(step)
                batch = move_to_device(next(self.batch_stream), self.topology.device, self.channels_last)
            scale = self.sizes.loss_scale if len(passes) == 1 else self.sizes.loss_scale * records / self.sizes.records
            outputs = self.forward_backward.forward_backward(
                self.wrapped, batch, self.trial.train_batch, loss_scale=scale,
                communicate=communicate and index == len(passes) - 1, phases=self.compute)
            self.training_metrics.add_batch(outputs, records)
        self.compute.finish()
        return outputs

    # -------------------------------------------------------------------------------- stage 2: update

    def _update(self, step: int, previous: int) -> Update:
        """Apply the update that batch `step` completes, or skip it for a non-finite gradient, on every rank alike."""
        with self.profiler.phase("optimizer"):
            self.callbacks.before_update(step, self.model)
            mixed = self.forward_backward if isinstance(self.forward_backward, MixedPrecision) else None
            verdict = self.guard.decide(step, self.model.parameters(), mixed.take_overflow() if mixed else None)
            if verdict.overflow and mixed is not None:
                mixed.skip_update()  # fp16 overflow: every rank drops this update's gradients
            lr = 0.0
            if verdict.apply:
                lr = self.optimization.rate_for_update(self.update_began_after)
                self.strategy.step(self.optimization.optimizer)
            else:
                self.state.nan_steps_skipped = self.guard.skipped
                self._note_skip(step, verdict.nonfinite_ranks)
            wire = self.wire.count(self.state)  # a skipped update's gradients crossed the wire before the verdict
            self.training_metrics.end_update(verdict.apply)
            self.optimization.optimizer.zero_grad(set_to_none=True)
            reached = self._reached(previous, step)
            self.optimization.after_batches(reached - previous)
        if verdict.apply and reached > previous:
            with self.profiler.phase("report"):
                self.reporter.update(reached, lr=lr, split=self.sizes.split,
                                     aggregation_frequency=self.sizes.aggregation_frequency, wire=wire)
        self.update_began_after = reached
        # ranks out of lockstep stop together only at a meeting point (they decide on their own)
        stop = verdict.stop and (self.guard.collective or reached == self.schedule.next_meeting(previous))
        return Update(reached=reached, stop=stop)

    def _rebalance(self, step: int) -> None:
        """Take a new per-rank split after batch `step` when the re-balancer (distributed.heterogeneous) chose one;
        the global batch and the place in the data stay the same, so the batches go on from `step`."""
        split = self.balancing.after_update(self.schedule.plan.optimizer_steps(step), self.sizes.base)
        if split is None:
            return
        self.sizes.rebase(split)
        self.context.batch_split = self.sizes.split
        self.state.batch_split = list(split.per_rank)
        self.batch_stream = self.batches.starting_at(step)
        speeds = ", ".join(f"{speed:.0f}" for speed in self.balancing.speeds)
        self.progress.note(f"heterogeneous: after batch {step} the ranks' records/s are {speeds}; per-rank batches "
                           f"{'/'.join(map(str, split.per_rank))} from now on")

    def _reached(self, previous: int, step: int) -> int:
        """The batch number this rank has reached after its update for batch `step`: `step` itself when ranks move
        in lockstep; otherwise the strategy's count of global batches trained, but never beyond the next meeting
        point, which every rank must visit in the same order."""
        return max(previous, min(self.pacing.steps_done(step), self.schedule.next_meeting(previous)))

    def _note_skip(self, step: int, ranks: tuple[int, ...]) -> None:
        if self.topology.is_chief:
            log.warning("batch %d: non-finite gradient on rank %s; the update was skipped on every rank (%d in a "
                        "row, %d in all; nan_policy skip allows %d in a row)", step, ", ".join(map(str, ranks)),
                        self.guard.in_a_row, self.guard.skipped, self.guard.max_consecutive)

    def _advance(self, previous: int, reached: int, started: float) -> None:
        self.state.steps_completed = reached
        self.state.samples_trained += self.sizes.split.global_batch_size * (reached - previous)
        self.clock.training_seconds += time.perf_counter() - started

    # ------------------------------------------------------------------------- stage 3: meeting point

    def _meet(self, step: int, update: Update | None) -> bool:
        """Report, validate and checkpoint where the schedule says so; True when training stops here."""
        if self.schedule.report_due(step):
            with self.profiler.phase("report"):
                self._report(step)
        aside = time.perf_counter()
        validated, metric = self.schedule.validation_due(step), None
        if validated:
            with self.profiler.phase("validation"):
                if not self.evaluator.staged:  # evaluated in stages, no rank needs the whole model
                    self.consolidate()
                metric = self._validate(step)
        stop = self._stop_reason(step, update)
        if validated and self.stop_advisor is not None:
            advice = self._advice(step, metric)
            if advice is not None and stop is None and step < self.schedule.total_batches:
                stop, self.stopped_by = "stopped", advice
        if stop is None and self.trial.may_request_stop and update is not None and step < self.schedule.total_batches \
                and (validated or self.schedule.report_due(step)) and any_rank(self.context.stop_requested):
            stop = "requested"
        due = update is not None and self.checkpointer.policy.due(
            step, validated=validated, metric=metric, validations=self.state.validation_history)
        if stop is not None or due:
            with self.profiler.phase("checkpoint"):
                self.consolidate(snapshot=True)
                self.clock.save(self.state)
                self.checkpointer.write(step, metric, state=self.state, optimization=self.optimization,
                                        strategy=self.strategy, epoch=self.schedule.epoch_of(step),
                                        trial_state=self.trial.state_dict())
                if not self.topology.is_chief:
                    self.trial.checkpoint_written(None)
        self._announce_checkpoints()
        self.progress.pause_clock(time.perf_counter() - aside)
        if stop is not None:
            self._stop(stop, step)
        return stop is not None

    def _announce_checkpoints(self) -> None:
        """Tell the Trial (rank 0) of each checkpoint that became complete: at once when written blocking, at the
        first meeting point after its background upload committed, or at the end."""
        for ref in self.checkpointer.take_committed():
            self.trial.checkpoint_written(ref.path)
            self.metrics.checkpoint(ref.step, str(ref.path))  # its location to the tracker, once complete

    def _report(self, step: int) -> None:
        training = self.clock.training_seconds
        self.reporter.training(step, self.training_metrics.take_report(),
                               samples_per_second=self.state.samples_trained / training if training > 0 else 0.0,
                               lr=float(self.optimization.optimizer.param_groups[0]["lr"]),
                               global_batch_size=self.sizes.split.global_batch_size,
                               extend=self.trial.training_metrics)

    def _validate(self, step: int) -> float | None:
        """Evaluate the model on all ranks, record the metrics; return the searcher metric."""
        started = time.perf_counter()
        batch_size = self.config.data_loader.validation_batch_size or max(self.sizes.records, 1)
        model = self.wrapped if self.evaluator.staged else self.strategy.unwrap_model()
        metrics = self.evaluator.evaluate(model, batch_size)
        wall, epoch = self.clock.wall(), self.schedule.epoch_of(step)
        self.state.validation_history.append({"step": step, "epoch": epoch, "wall_seconds": wall, "metrics": metrics})
        if self.topology.is_chief:
            self.metrics.validation(step, epoch, wall, metrics)
            shown = " ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items()))
            self.progress.note(f"validation at batch {step} (epoch {epoch:.2f}, {wall:.0f} s): {shown} "
                               f"[{time.perf_counter() - started:.1f} s]")
        return self.searcher.of(metrics)

    def _advice(self, step: int, metric: float | None) -> str | None:
        """The stop advisor's answer after the validation at `step`, the chief's on every rank."""
        advice: str | None = None
        if self.topology.is_chief and self.stop_advisor is not None:
            units = {"batches": float(step), "records": float(self.state.samples_trained),
                     "epochs": self.schedule.epoch_of(step)}
            try:
                advice = self.stop_advisor.after_validation(units, metric)
            except Exception as exc:  # the searcher's storage unreachable: train on rather than hang the ranks
                log.warning("the searcher could not be asked after batch %d (%s); training goes on", step, exc)
        return broadcast_object(advice)

    def _stop_reason(self, step: int, update: Update | None) -> str | None:
        """"interrupted" (a signal) or "stopped" (faults.stop_after_batch) when training stops after this update."""
        if update is None or step == self.schedule.total_batches:
            return None
        if update.stop:
            return "interrupted"
        return "stopped" if self.schedule.stop_requested(step) else None

    def _stop(self, status: str, step: int) -> None:
        self.status = "completed" if status == "requested" else status
        if status == "requested":
            self.progress.note(f"stopped after batch {step} as the trial asked (set_stop_requested); completed")
        elif status == "interrupted":
            received = self.stop.received
            elastic = os.environ.get(NODE_RANGE_ENV)
            self.progress.note(f"{received.name if received else 'a signal'}: stopped after batch {step} with a "
                               + (f"checkpoint (under --nnodes {elastic} the agents also stop the workers this way to "
                                  "take in a joining node; then they resume at once)" if elastic else
                                  "checkpoint; run the same command again to resume"))
        elif self.stopped_by is not None:
            self.progress.note(f"stopped after batch {step} by the searcher: {self.stopped_by}; the checkpoint "
                               "stays in the run dir")
        else:
            self.progress.note(f"stopped after batch {step} as faults.stop_after_batch asks; run the same "
                               "command again to resume")

    # ------------------------------------------------------------------------------- start and end

    def _announce(self) -> None:
        s, split = self.schedule, self.sizes.split
        how = f"resuming at batch {self.state.steps_completed}" if self.resumed else "starting"
        preemptions = read_preemptions(self.run_dir) if self.resumed else []
        if preemptions:
            how += f", preemptions survived: {describe_preemptions(preemptions)}"
        self.progress.note(
            f"{self.config.name}: {how}; {self.topology.world_size} worker(s) x {self._per_rank(split)} records = "
            f"global batch {split.global_batch_size}; {s.total_batches} batches "
            f"({s.epoch_of(s.total_batches):.2f} epochs of {s.batches_per_epoch:g} batches)")
        for line in self.optimization.describe(self.config.large_batch) + s.describe_phases():
            self.progress.note(line)

    @staticmethod
    def _per_rank(split: BatchSplit) -> str:
        sizes = set(split.per_rank)
        return str(split.per_rank[0]) if len(sizes) == 1 else "/".join(map(str, split.per_rank))

    def _finish(self) -> dict[str, Any]:
        """The summary (rank 0 writes summary.json), after checking that the replicas agree."""
        self.trial.training_ended(self.status)
        summary = run_summary(status=self.status, topology=self.topology, sizes=self.sizes, state=self.state,
                              schedule=self.schedule, checkpoint=self.checkpointer.newest(), run_dir=self.run_dir,
                              strategy=self.strategy.describe(), compression=self.config.compression.name)
        if self.stopped_by is not None:
            summary["stopped_by_searcher"] = self.stopped_by
        if self.status == "interrupted" and self.stop.received is not None:  # a Slurm requeue reads when it came
            summary["stop_signal"] = {"name": self.stop.received.name, "received_at": self.stop.received_at}
        preemptions = read_preemptions(self.run_dir)
        if preemptions:  # a Slurm job requeued after preemptions: what each cost
            summary["preemptions"] = preemptions
        summary["precision"] = (self.forward_backward.describe() if isinstance(self.forward_backward, MixedPrecision)
                                else {"name": "fp32", "autocast_dtype": None, "loss_scaling": False,
                                      "modules_in_fp32": None})
        held, part = (self.strategy.replica_part() if isinstance(self.strategy, HoldsModelParts)
                      else (self.strategy.unwrap_model(), 0))
        summary["replicas_identical"] = replicas_identical(held, part)
        summary["profile"] = run_profile(self.profiler, self.topology)
        if self.topology.is_chief:
            write_json_atomic(self.run_dir / SUMMARY_FILE, summary)
            self.metrics.status(self.status, summary)
        self.metrics.close()
        self.guard.close()
        self.strategy.close()
        return summary
