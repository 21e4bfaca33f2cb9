"""The training loop: sharded data, forward/backward through a sync strategy, validation, checkpoints.

One Trainer runs in every worker process. It owns the loop so that a Trial only says what one batch
means; every rank takes the same decisions at the same step (validate, report, checkpoint, stop), so
collectives always line up.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from dtrain.comm import Topology, all_gather_object, all_reduce_sums, broadcast_object
from dtrain.comm.stall import StallMonitor, default_store, set_collective_timeout
from dtrain.compress import WireStats
from dtrain.config import ExperimentConfig, Length
from dtrain.data.arrays import keep_batch
from dtrain.data.sharding import BatchSplit, ShardedBatchSampler, split_global_batch, validation_shard
from dtrain.data.synthetic import synthetic_replay
from dtrain.errors import CheckpointError, ConfigError, StallError, SyncError, TrainingDiverged, TrialError
from dtrain.optim.batch_schedule import BatchPhase, BatchPlan, resolve_changes
from dtrain.optim.build import build_lr_schedule
from dtrain.optim.build import build_optimizer as build_config_optimizer
from dtrain.optim.lr_schedule import ScheduledLR
from dtrain.profile import Profiler, tensorboard_scalars
from dtrain.runs.rundir import SUMMARY_FILE, RunInfo, write_json_atomic
from dtrain.sync import SyncStrategy, build_strategy
from dtrain.train import checkpoint as ckpt
from dtrain.train.faults import FAULTS_FILE, FaultInjector
from dtrain.train.guard import RECIPE_ADVICE, GracefulStop, UpdateGuard, model_digest
from dtrain.train.metrics import MetricsWriter
from dtrain.train.progress import Progress
from dtrain.train.rng import capture_rng_state, restore_rng_state, seed_everything
from dtrain.train.trial import Trial, TrialContext

log = logging.getLogger(__name__)


class SizedDataset(Protocol):
    """A map-style dataset: what the Trainer needs from the Trial's data."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclass
class TrainerState:
    """Counters and history that a checkpoint carries so that a resumed run continues the same curve."""

    steps_completed: int = 0
    samples_trained: int = 0
    wall_seconds: float = 0.0  # training time up to the last checkpoint, across restarts
    training_seconds: float = 0.0  # the part of it spent in training steps (no validation or checkpoints)
    validation_history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_metrics: dict[int, float] = field(default_factory=dict)  # step -> searcher metric
    resumes: int = 0  # times training continued from a checkpoint (after a crash or a stop)
    communicating_steps: int = 0  # optimizer updates whose gradients crossed the wire
    wire_bytes: float = 0.0  # bytes this rank sent for them (chief's count)
    payload_bytes: float = 0.0  # bytes it handed to collectives (compressed payloads)
    dense_wire_bytes: float = 0.0  # what dense fp32 all-reduces would have sent
    nan_steps_skipped: int = 0  # updates skipped for a non-finite gradient (nan_policy skip)

    def to_dict(self) -> dict[str, Any]:
        return {"steps_completed": self.steps_completed, "samples_trained": self.samples_trained,
                "wall_seconds": self.wall_seconds, "training_seconds": self.training_seconds,
                "validation_history": self.validation_history,
                "checkpoint_metrics": {str(k): v for k, v in self.checkpoint_metrics.items()},
                "resumes": self.resumes, "communicating_steps": self.communicating_steps,
                "wire_bytes": self.wire_bytes, "payload_bytes": self.payload_bytes,
                "dense_wire_bytes": self.dense_wire_bytes, "nan_steps_skipped": self.nan_steps_skipped}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrainerState:
        return cls(steps_completed=int(raw["steps_completed"]), samples_trained=int(raw["samples_trained"]),
                   wall_seconds=float(raw["wall_seconds"]), training_seconds=float(raw["training_seconds"]),
                   validation_history=list(raw["validation_history"]),
                   checkpoint_metrics={int(k): float(v) for k, v in raw["checkpoint_metrics"].items()},
                   resumes=int(raw.get("resumes", 0)), communicating_steps=int(raw.get("communicating_steps", 0)),
                   wire_bytes=float(raw.get("wire_bytes", 0.0)), payload_bytes=float(raw.get("payload_bytes", 0.0)),
                   dense_wire_bytes=float(raw.get("dense_wire_bytes", 0.0)),
                   nan_steps_skipped=int(raw.get("nan_steps_skipped", 0)))


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

    def epoch_of(self, step: int) -> float:
        return float(self.plan.epoch_of(step))

    @property
    def batch_size_changes(self) -> bool:
        return any(0 < phase.start_step < self.total_batches for phase in self.plan.phases)

    def validation_due(self, step: int) -> bool:
        return self._due(step, self.validation_period, self.validation_every)

    def checkpoint_due(self, step: int) -> bool:
        return self._due(step, self.checkpoint_period, self.checkpoint_every)

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

    return Schedule(total_batches=batches(config.searcher.max_length), batches_per_epoch=per_epoch,
                    data_batches_per_epoch=data_batches, validation_every=batches(config.min_validation_period),
                    checkpoint_every=batches(config.min_checkpoint_period), plan=plan,
                    validation_period=config.min_validation_period, checkpoint_period=config.min_checkpoint_period)


def move_to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Tensors anywhere inside tuples, lists and dicts, moved to `device` (a no-op on the CPU); with
    `channels_last`, 4-D floating tensors (image batches) are laid out NHWC for faster convolutions."""
    if device.type == "cpu" and not channels_last:
        return batch
    if isinstance(batch, torch.Tensor):
        moved = batch if device.type == "cpu" else batch.to(device, non_blocking=True)
        if channels_last and moved.dim() == 4 and moved.is_floating_point():
            moved = moved.contiguous(memory_format=torch.channels_last)
        return moved
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device, channels_last) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device, channels_last) for key, value in batch.items()}
    return batch


def batch_length(batch: Any) -> int:
    """Records in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_length(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_length(next(iter(batch.values())))
    raise TrialError(f"cannot tell how many records a batch of type {type(batch).__name__} holds; "
                     "return tensors, or tuples/dicts of tensors, from the dataset")


def _scalar(name: str, value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TrialError(f"{where} returned `{name}` with shape {tuple(value.shape)}; return a scalar (a mean "
                             "over the batch)")
        return float(value.detach())
    if isinstance(value, (int, float)):
        return float(value)
    raise TrialError(f"{where} returned `{name}` of type {type(value).__name__}; return tensors or floats")


class Trainer:
    """Runs one trial in this process, in lockstep with the other ranks."""

    def __init__(self, *, config: ExperimentConfig, trial_class: type[Trial], topology: Topology,
                 run_info: RunInfo, context_overrides: Mapping[str, Any] | None = None,
                 batch_split: BatchSplit | None = None) -> None:
        """`batch_split` gives per-rank batch sizes (uneven ones too: each rank's gradient is weighted by its
        share); by default the global batch is cut evenly."""
        self.config = config
        self.topology = topology
        self.run_info = run_info
        self.run_dir = run_info.run_dir
        self.split = batch_split or split_global_batch(config.global_batch_size, topology.world_size)
        if len(self.split.per_rank) != topology.world_size:
            raise ValueError(f"batch_split has {len(self.split.per_rank)} ranks, the run {topology.world_size}")
        self.base_split = self.split  # the configured split; a batch-size schedule multiplies it
        self.seed = config.reproducibility.experiment_seed
        self.faults = FaultInjector(config.debug, topology.rank, record_path=self.run_dir / "logs" / FAULTS_FILE,
                                    restart_count=topology.restart_count)
        seed_everything(self.seed)  # identical initial weights on every rank
        self.context = TrialContext(
            hparams=config.hyperparameters, rank=topology.rank, world_size=topology.world_size,
            local_rank=topology.local_rank, batch_split=self.split, device=topology.device, seed=self.seed,
            data_config=config.data, run_dir=self.run_dir, config_dir=run_info.config_dir,
            aggregation_frequency=config.optimizations.aggregation_frequency, **(context_overrides or {}))
        self.trial = trial_class(self.context)
        self.state = TrainerState()
        self.status = "running"

    # ------------------------------------------------------------------------------------------ set-up

    def _build(self) -> None:
        self.train_data = self._dataset(self.trial.build_training_data(), "build_training_data")
        if self.config.debug.synthetic_data:
            self.train_data = synthetic_replay(self.train_data)
        self.val_data = self._dataset(self.trial.build_validation_data(), "build_validation_data")
        self._check_same_data_on_all_ranks()
        self.schedule = resolve_schedule(self.config, len(self.train_data), self.split)
        self.context.batches_per_epoch = self.schedule.data_batches_per_epoch
        self.context.total_batches = self.schedule.total_batches
        self.context.optimizer_steps_total = self.schedule.plan.optimizer_steps(self.schedule.total_batches)
        self._phase: BatchPhase | None = None
        model = self.trial.build_model()
        if not isinstance(model, nn.Module):
            raise TrialError(f"build_model() returned {type(model).__name__}; return a torch.nn.Module")
        self.channels_last = self.config.optimizations.memory_format == "channels_last"
        self.model = model.to(self.topology.device)
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self._build_optimizer()
        self.strategy: SyncStrategy = build_strategy(self.config, self.topology)
        device = self.topology.device
        self.profiler = Profiler(self.config.profiling, rank=self.topology.rank, run_dir=self.run_dir,
                                 synchronize=torch.cuda.synchronize if device.type == "cuda" else None)
        observe = getattr(self.strategy, "observe_buckets", None)  # optional in the SyncStrategy protocol
        if self.profiler.enabled and observe is not None and self.topology.is_distributed:
            observe(self.profiler.timer.buckets, per_bucket=self.profiler.timeline is not None)

    def _build_optimizer(self) -> None:
        """The Trial's optimizer and scheduler (`large_batch.optimizer: trial`), or the config's optimizer; either
        way the config's LR scaling, warm-up and decay, when set, drive the rate (`self.lr_schedule`)."""
        lb = self.config.large_batch
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if lb.optimizer == "trial":
            self.optimizer = self.trial.build_optimizer(self.model)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TrialError(f"build_optimizer() returned {type(self.optimizer).__name__}; "
                                 "return a torch.optim.Optimizer")
            self.scheduler = self.trial.build_lr_scheduler(self.optimizer)
            if self.scheduler is not None and lb.schedules_lr:
                raise ConfigError(
                    f"large_batch sets the learning rate over time (lr_scaling {lb.lr_scaling}, warmup_epochs "
                    f"{lb.warmup_epochs:g}, decay {lb.decay.name}) and the Trial's build_lr_scheduler() returned "
                    f"{type(self.scheduler).__name__}; both would set the same rate: remove those large_batch keys "
                    "or return None from build_lr_scheduler()")
        else:  # the config owns the optimizer and its schedule; the Trial's builders are not called
            self.optimizer = build_config_optimizer(lb, self.model, self.config.hyperparameters)
        self.lr_schedule: ScheduledLR | None = None
        if lb.optimizer != "trial" or lb.schedules_lr:
            first = self.schedule.plan.phases[0]
            curve = build_lr_schedule(lb, first.records_per_update, self.schedule.epoch_of(self.schedule.total_batches))
            self.lr_schedule = ScheduledLR(self.optimizer, curve)

    @staticmethod
    def _dataset(data: Any, where: str) -> SizedDataset:
        if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
            raise TrialError(f"{where}() returned {type(data).__name__}; return a map-style torch Dataset "
                             "(with __len__ and __getitem__)")
        if len(data) == 0:
            raise TrialError(f"{where}() returned an empty dataset")
        return data

    def _check_same_data_on_all_ranks(self) -> None:
        """Ranks must agree on the data's size, or one would run out of batches first and the others would
        wait for it forever; say so at once instead."""
        if not self.topology.is_distributed:
            return
        sizes = all_gather_object((len(self.train_data), len(self.val_data)))
        if len(set(sizes)) > 1:
            shown = ", ".join(f"rank {rank}: {train} training / {val} validation records"
                              for rank, (train, val) in enumerate(sizes))
            raise SyncError(f"the ranks built datasets of different sizes ({shown}); every rank must build the "
                            "same (whole) dataset - dtrain shards it - so that all ranks run the same steps")

    def _restore(self) -> bool:
        """Load the latest complete checkpoint (read by rank 0, broadcast to the others); False if none."""
        root = self.run_dir / "checkpoints"
        payload = None
        if self.topology.is_chief:
            ckpt.remove_stale_partials(root)
            ref = ckpt.find_resume_checkpoint(root)
            if ref is not None:
                model_state, state = ckpt.load_checkpoint(ref)
                payload = (ref.step, model_state, state)
        if self.topology.is_distributed:
            step = broadcast_object(payload[0] if payload else None)
            if step is None:
                return False
            payload = broadcast_object(payload)
        if payload is None:
            return False
        step, model_state, state = payload
        try:
            self.model.load_state_dict(model_state)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint step-{step} in {root} does not fit this Trial's model ("
                                  f"{' '.join(str(exc).split())[:300]}); resume with the model it was written "
                                  "for, or give a new --run-dir") from None
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.lr_schedule is not None and state.get("lr_schedule") is not None:
            self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.strategy.load_state_dict(state.get("strategy", {}))
        self.state = TrainerState.from_dict(state["trainer"])
        self.state.resumes += 1
        rng = state["rng"]
        restore_rng_state(rng[self.topology.rank] if self.topology.rank < len(rng) else rng[0])
        log.info("resumed from checkpoint step-%d", step)
        return True

    # ---------------------------------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any]:
        """Train to `searcher.max_length` (or the debug stop) and return the summary."""
        self._build()
        resumed = self._restore()
        if not resumed:
            seed_everything(self.seed * 1000 + 17 + self.topology.rank)  # each rank its own random stream
        self.wrapped = self.strategy.wrap_model(self.model)
        chief = self.topology.is_chief
        self.metrics = MetricsWriter(store_path=self.run_info.store if chief else None,
                                     trial_id=self.run_info.trial_id,
                                     tensorboard_dir=self.run_dir / "tensorboard" if chief else None)
        self.progress = Progress(self.schedule.total_batches, self.state.steps_completed,
                                 self.split.global_batch_size, enabled=chief,
                                 report_every=self.config.scheduling_unit)
        self.metrics.status("running")
        self._announce(resumed)
        self.monitor = self._start_stall_monitor()
        try:
            with GracefulStop() as stop:
                self.guard = UpdateGuard(self.config.nan_policy, self.config.max_consecutive_nan_skips, stop,
                                         skipped=self.state.nan_steps_skipped,
                                         collective=self.strategy.lockstep, rank=self.topology.rank)
                self._loop(resumed)
        finally:
            self.progress.close()
            if self.monitor is not None:
                self.monitor.stop()
        summary = self._summary()
        summary["replicas_identical"] = self._check_replicas()
        summary["profile"] = self._run_profile()
        if chief:
            write_json_atomic(self.run_dir / SUMMARY_FILE, summary)
            self.metrics.status(self.status, summary)
        self.metrics.close()
        self.strategy.close()
        return summary

    def _announce(self, resumed: bool) -> None:
        s = self.schedule
        how = f"resuming at batch {self.state.steps_completed}" if resumed else "starting"
        self.progress.note(
            f"{self.config.name}: {how}; {self.topology.world_size} worker(s) x {self.split.per_rank[0]} records = "
            f"global batch {self.split.global_batch_size}; {s.total_batches} batches "
            f"({s.epoch_of(s.total_batches):.2f} epochs of {s.batches_per_epoch:g} batches)")
        lb = self.config.large_batch
        if lb.optimizer != "trial":
            self.progress.note(f"large_batch: optimizer {lb.optimizer} at base rate "
                               f"{self.lr_schedule.base_lrs[0] if self.lr_schedule else 0:g} from the config (the "
                               "Trial's build_optimizer() and build_lr_scheduler() are not used)")
        if self.lr_schedule is not None and not self.lr_schedule.schedule.is_constant:
            curve = self.lr_schedule.schedule
            self.progress.note(f"large_batch: lr_scaling {lb.lr_scaling} x{curve.peak:.4g}, warm-up "
                               f"{curve.warmup_epochs:g} epochs, decay {curve.decay}")
        for phase in s.plan.phases[1:]:
            if phase.start_step < s.total_batches:
                self.progress.note(f"large_batch: from batch {phase.start_step} (epoch "
                                   f"{s.epoch_of(phase.start_step):.2f}) global batch {phase.global_batch_size} "
                                   f"x aggregation {phase.aggregation_frequency}")

    def _loop(self, resumed: bool) -> None:
        s, state = self.schedule, self.state
        stop_after = self.config.debug.stop_after_batch
        timeline_start = time.perf_counter() - state.wall_seconds
        train_time = state.training_seconds
        sums: dict[str, float] = {}
        if self.config.perform_initial_validation and not resumed and state.steps_completed == 0:
            self._validate(0, timeline_start)
        batches = self._training_batches(state.steps_completed)
        window_start = state.steps_completed  # the batch after which the current optimizer update began
        window: dict[str, float] = {}  # training metrics of the batches of the current update
        while state.steps_completed < s.total_batches:
            step_start = time.perf_counter()
            previous = state.steps_completed
            step = previous + 1
            size = self.split.per_rank[self.topology.rank]
            try:
                with self.profiler.step(step, records=size):
                    with self.profiler.phase("data"):
                        self.faults.before_step(step)
                        loss_scale = self._enter_phase(s.plan.phase_at(step - 1), step - 1)
                        boundary = s.plan.is_boundary(step) or step == s.total_batches
                        batch = move_to_device(next(batches), self.topology.device, self.channels_last)
                    self.wrapped.train()
                    # A forward pass under no_sync leaves the backward pass unsynchronized too.
                    with nullcontext() if boundary else self.strategy.no_sync():
                        with self.profiler.phase("forward"):
                            self.faults.before_compute()  # a straggler's slower device: its delay is compute
                            compute_start = time.perf_counter()
                            outputs = self.trial.train_batch(batch, self.wrapped)
                            loss = self._loss(outputs)
                        with self.profiler.phase("backward"):
                            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
                    # the straggler's own compute, without the communication it waited for
                    waited = self.profiler.exposed_comm_seconds()
                    self.faults.after_compute(time.perf_counter() - compute_start - waited)
                    for name, value in outputs.items():
                        window[name] = window.get(name, 0.0) + _scalar(name, value, "train_batch()") * size
                    window["__records"] = window.get("__records", 0.0) + size
                    interrupted = False
                    if boundary:
                        with self.profiler.phase("optimizer"):
                            self.faults.corrupt_gradients(step, self.model)
                            verdict = self.guard.decide(step, self.model.parameters())
                            wire = None
                            if verdict.apply:
                                lr = self._set_learning_rate(window_start)
                                self.strategy.step(self.optimizer)
                                wire = self._count_wire()
                                for name, total in window.items():
                                    sums[name] = sums.get(name, 0.0) + total
                            else:
                                state.nan_steps_skipped = self.guard.skipped
                                self._count_wire()  # the gradients crossed the wire before the verdict
                                self._note_skip(step, verdict.nonfinite_ranks)
                            window = {}
                            self.optimizer.zero_grad(set_to_none=True)
                            step = self._reached(previous, step)
                            if self.scheduler is not None:
                                for _ in range(step - previous):  # one step per global batch trained
                                    self.scheduler.step()
                        if verdict.apply and step > previous:
                            with self.profiler.phase("report"):
                                self._log_update(step, lr, timeline_start, wire)
                        window_start = step
                        # ranks out of lockstep stop together only at a meeting point (they decide on their own)
                        interrupted = verdict.stop and (self.guard.collective or step == self._next_meeting(previous))
                    state.steps_completed = step
                    state.samples_trained += self.split.global_batch_size * (step - previous)
                    train_time += time.perf_counter() - step_start
                    if step == previous:
                        continue  # the parameter servers have not completed another global batch yet
                    self.progress.update(step, s.epoch_of(step), float(loss.detach()))
                    last = step == s.total_batches
                    if step % self.config.scheduling_unit == 0 or last:
                        with self.profiler.phase("report"):
                            self._report_training(step, sums, timeline_start, train_time)
                        sums = {}
                    aside = time.perf_counter()
                    validated = False
                    if s.validation_due(step) or last:
                        with self.profiler.phase("validation"):
                            self.strategy.consolidate()
                            metric = self._validate(step, timeline_start)
                        validated = True
                    asked_to_stop = stop_after is not None and step >= stop_after
                    stopping = boundary and not last and (interrupted or asked_to_stop)
                    if boundary and (self._checkpoint_due(step, validated, last) or stopping):
                        with self.profiler.phase("checkpoint"):
                            self.strategy.consolidate(snapshot=True)
                            state.wall_seconds = time.perf_counter() - timeline_start
                            state.training_seconds = train_time
                            self._checkpoint(step, metric if validated else None)
                    self.progress.pause_clock(time.perf_counter() - aside)
            except RuntimeError as exc:
                raise self._collective_failure(exc) from None
            if stopping and interrupted:
                self.status = "interrupted"
                received = self.guard.stop.received
                self.progress.note(f"{received.name if received else 'a signal'}: stopped after batch {step} with a "
                                   "checkpoint; run the same command again to resume")
                break
            if stopping:
                self.status = "stopped"
                self.progress.note(f"stopped after batch {step} as debug.stop_after_batch asks; run the same "
                                   "command again to resume")
                break
        state.wall_seconds = time.perf_counter() - timeline_start
        state.training_seconds = train_time
        if self.status == "running":
            self.status = "completed"

    def _reached(self, previous: int, step: int) -> int:
        """The batch number this rank has reached after its update for batch `step`: `step` itself when ranks move
        in lockstep; otherwise the strategy's count of global batches trained, but never beyond the next meeting
        point (report, validation, checkpoint, stop, end), which every rank must visit in the same order."""
        return max(previous, min(self.strategy.steps_done(step), self._next_meeting(previous)))

    def _next_meeting(self, previous: int) -> int:
        s = self.schedule
        meetings = [s.total_batches]
        for every in (self.config.scheduling_unit, s.validation_every, s.checkpoint_every):
            if every:
                meetings.append((previous // every + 1) * every)
        stop = self.config.debug.stop_after_batch
        if stop is not None and stop > previous:
            meetings.append(stop)
        return min(meetings)

    # ------------------------------------------------------------------------- profile and stalls

    def _start_stall_monitor(self) -> StallMonitor | None:
        """Heartbeats through the workers' store (distributed runs only); an injected hang ends on its abort.
        Collectives time out after `distributed.timeout_seconds`, however the process group was created."""
        store = default_store() if self.topology.is_distributed else None
        if store is None:
            return None
        set_collective_timeout(self.config.distributed.timeout_seconds)
        timer = self.profiler.timer

        def activity() -> tuple[int, str, tuple[int, int], float]:
            now = timer.activity
            return now.step, now.phase, now.position, now.since

        monitor = StallMonitor(store=store, rank=self.topology.rank, world_size=self.topology.world_size,
                               activity=activity, warn_after=self.config.distributed.stall_warning_seconds,
                               attempt=self.topology.restart_count)
        self.faults.release = monitor.abort
        return monitor.start()

    def _collective_failure(self, exc: RuntimeError) -> Exception:
        """A collective that timed out as one StallError naming the ranks that did not arrive and what they were
        doing; other errors (a peer that died is the worker's to report) pass through unchanged."""
        timed_out = any(sign in str(exc) for sign in ("Timed out", "timed out", "Application timeout"))
        if not timed_out or self.monitor is None or isinstance(exc, StallError):
            return exc
        return self.monitor.timeout_error(exc, self.config.distributed.timeout_seconds)

    def _run_profile(self) -> dict[str, Any]:
        """Every rank's phase profile (gathered to all ranks) and the timeline files, for summary.json."""
        mine = self.profiler.run_profile()
        files = self.profiler.close()
        ranks = all_gather_object(mine) if self.topology.is_distributed else [mine]
        timelines = all_gather_object(files) if self.topology.is_distributed else [files]
        return {"ranks": ranks, "timelines": [path for paths in timelines for path in paths],
                "phase_timers": self.profiler.enabled}

    # ------------------------------------------------------------------ batch-size phases and the rate

    def _split_of(self, phase: BatchPhase) -> BatchSplit:
        """The configured per-rank batches multiplied by the phase's multiplier."""
        base, times = self.base_split, phase.batch_multiplier
        return BatchSplit(per_rank=tuple(size * times for size in base.per_rank),
                          requested_global=base.requested_global * times)

    def _enter_phase(self, phase: BatchPhase, done: int) -> float:
        """Train the next batch with `phase`'s split and aggregation; return the loss scale for its backward
        (world * this rank's share of the global batch, / k when aggregated gradients are averaged)."""
        if phase is not self._phase:
            if self._phase is not None:
                self.progress.note(f"batch-size schedule: from batch {done} (epoch "
                                   f"{self.schedule.epoch_of(done):.2f}) global batch {phase.global_batch_size} "
                                   f"x aggregation {phase.aggregation_frequency}")
            self._phase = phase
            self.split = self._split_of(phase)
            self.context.batch_split = self.split
            self.context.aggregation_frequency = phase.aggregation_frequency
            self.progress.change_global_batch(done, self.split.global_batch_size)
            self._loss_scale = self.topology.world_size * self.split.weight(self.topology.rank)
            if self.config.optimizations.average_aggregated_gradients:
                self._loss_scale /= phase.aggregation_frequency
        return self._loss_scale

    def _set_learning_rate(self, window_start: int) -> float:
        """Apply the config's schedule for the update that began after batch `window_start`; return the rate
        this update uses (the first param group's)."""
        if self.lr_schedule is not None:
            return self.lr_schedule.apply(self.schedule.epoch_of(window_start))
        return float(self.optimizer.param_groups[0]["lr"])

    def _count_wire(self) -> WireStats | None:
        """The bytes the update that just ran sent (None if nothing was sent), added to the run's totals."""
        wire = self.strategy.take_wire_stats()
        if wire is None or not wire.buckets:
            return None
        self.state.communicating_steps += 1
        self.state.wire_bytes += wire.wire_bytes
        self.state.payload_bytes += wire.payload_bytes
        self.state.dense_wire_bytes += wire.dense_wire_bytes
        return wire

    def _log_update(self, step: int, lr: float, timeline_start: float, wire: WireStats | None) -> None:
        """The rate, batch size and bytes sent of every optimizer update, to the store and TensorBoard (rank 0)."""
        if self.topology.is_chief:
            phase = self._phase
            assert phase is not None
            values = {"lr": lr, "global_batch_size": float(self.split.global_batch_size),
                      "effective_batch_size": float(self.split.global_batch_size * phase.aggregation_frequency)}
            if wire is not None:
                values.update(bytes_per_step=wire.wire_bytes, payload_bytes_per_step=float(wire.payload_bytes),
                              compression_ratio=wire.compression_ratio)
            self.metrics.training(step, self.schedule.epoch_of(step), time.perf_counter() - timeline_start, values)

    def _communication_summary(self) -> dict[str, Any]:
        """Bytes per communicating update (this rank's, by the ring model) and the ratio to dense fp32."""
        state, steps = self.state, self.state.communicating_steps
        return {"compression": self.config.compression.name, "communicating_steps": steps,
                "bytes_per_step": state.wire_bytes / steps if steps else 0.0,
                "payload_bytes_per_step": state.payload_bytes / steps if steps else 0.0,
                "dense_bytes_per_step": state.dense_wire_bytes / steps if steps else 0.0,
                "compression_ratio": state.dense_wire_bytes / state.wire_bytes if state.wire_bytes else None,
                "total_bytes": state.wire_bytes}

    # ------------------------------------------------------------------------------------------- data

    def _training_batches(self, start_step: int) -> Iterator[Any]:
        """This rank's batches from `start_step` on: each batch-size phase from its place in the data."""
        plan, step = self.schedule.plan, start_step
        while True:
            phase = plan.phase_at(step)
            end = plan.phase_end(phase)
            batches = self._phase_batches(self._split_of(phase), *plan.position_at(step))
            if end is None:
                yield from batches
                return
            yield from itertools.islice(batches, end - step)
            step = end

    def _phase_batches(self, split: BatchSplit, data_pass: int, offset: int) -> Iterator[Any]:
        """Batches of one split from (pass, record offset) on, crossing epoch boundaries with a fresh shuffle each."""
        sampler = ShardedBatchSampler(len(self.train_data), split, self.topology.rank, self.seed, data_pass,
                                      start_record=offset)
        workers = self.config.data_loader.num_workers
        collate = keep_batch if getattr(self.train_data, "returns_batches", False) else None
        loader: DataLoader[Any] = DataLoader(
            self.train_data, batch_sampler=sampler, num_workers=workers, collate_fn=collate,  # type: ignore[arg-type]
            persistent_workers=workers > 0, pin_memory=self.topology.device.type == "cuda",
            generator=torch.Generator().manual_seed(self.seed))
        while True:
            yield from loader
            sampler.epoch += 1
            sampler.start_record = 0

    @staticmethod
    def _loss(outputs: Any) -> torch.Tensor:
        if not isinstance(outputs, Mapping) or "loss" not in outputs:
            what = "a dict without `loss`" if isinstance(outputs, Mapping) else type(outputs).__name__
            raise TrialError(f"train_batch() returned {what}; return a dict with a scalar tensor `loss`")
        loss = outputs["loss"]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise TrialError("train_batch()'s `loss` must be a scalar tensor that requires grad (the mean loss of "
                             "the batch, computed from the model's output)")
        return loss

    # --------------------------------------------------------------------------- metrics and validation

    def _check_replicas(self) -> bool:
        """Every rank must end with the same weights (a skipped update, a restart or a bug that broke that
        would otherwise go unnoticed); one digest per rank, compared on all."""
        digests = all_gather_object(model_digest(self.strategy.unwrap_model()))
        if len(set(digests)) > 1:
            groups = ", ".join(f"rank {rank}: {digest[:12]}" for rank, digest in enumerate(digests))
            raise SyncError(f"the model replicas differ at the end of training ({groups}); a rank applied an update "
                            "the others did not - please report this with the run's logs")
        return True

    def _note_skip(self, step: int, ranks: tuple[int, ...]) -> None:
        if self.topology.is_chief:
            log.warning("batch %d: non-finite gradient on rank %s; the update was skipped on every rank (%d in a "
                        "row, %d in all; nan_policy skip allows %d in a row)", step, ", ".join(map(str, ranks)),
                        self.guard.in_a_row, self.guard.skipped, self.guard.max_consecutive)

    def _report_training(self, step: int, sums: dict[str, float], timeline_start: float, train_time: float) -> None:
        reduced = all_reduce_sums(sums)
        records = reduced.pop("__records", 0.0)
        values = {name: value / records for name, value in reduced.items()} if records else {}
        broken = sorted(name for name, value in values.items() if not math.isfinite(value))
        if broken:  # every rank sees the same reduced sums, so all stop here together
            raise TrainingDiverged(
                f"training diverged: the mean training {' and '.join(broken)} up to batch {step} is not finite "
                f"(learning rate {self.optimizer.param_groups[0]['lr']:.4g}, global batch "
                f"{self.split.global_batch_size}); {RECIPE_ADVICE}")
        values["samples_per_second"] = self.state.samples_trained / train_time if train_time > 0 else 0.0
        window = self.profiler.window_profile() if self.profiler.enabled else {}
        profiles = all_gather_object(window) if self.profiler.enabled and self.topology.is_distributed else [window]
        if self.topology.is_chief:
            values.update(self.strategy.metrics())
            self.metrics.training(step, self.schedule.epoch_of(step), time.perf_counter() - timeline_start, values)
            self.metrics.scalars(step, tensorboard_scalars(profiles))
            self.metrics.flush()

    def _validate(self, step: int, timeline_start: float) -> float | None:
        """Evaluate this rank's shard, average over all ranks weighted by records; return the searcher metric."""
        started = time.perf_counter()
        model = self.strategy.unwrap_model() if hasattr(self, "wrapped") else self.model
        model.eval()
        shard = validation_shard(len(self.val_data), self.topology.rank, self.topology.world_size)
        batch_size = self.config.data_loader.validation_batch_size or max(self.split.per_rank[self.topology.rank], 1)
        batched = getattr(self.val_data, "returns_batches", False)
        sums: dict[str, float] = {"__records": 0.0}
        with torch.no_grad():
            for first in range(shard.start, shard.stop, batch_size):
                indices = list(range(first, min(first + batch_size, shard.stop)))
                if batched:
                    batch = self.val_data.__getitems__(indices)  # type: ignore[attr-defined]
                else:
                    batch = torch.utils.data.default_collate([self.val_data[i] for i in indices])
                batch = move_to_device(batch, self.topology.device, self.channels_last)
                outputs = self.trial.evaluate_batch(batch, model)
                if not isinstance(outputs, Mapping) or not outputs:
                    raise TrialError("evaluate_batch() must return a non-empty dict {metric name: batch mean}")
                size = batch_length(batch)
                for name, value in outputs.items():
                    sums[name] = sums.get(name, 0.0) + _scalar(name, value, "evaluate_batch()") * size
                sums["__records"] += size
        names = all_gather_object(sorted(sums)) if self.topology.is_distributed else [sorted(sums)]
        for name in set().union(*names):
            sums.setdefault(name, 0.0)
        reduced = all_reduce_sums(sums)
        records = reduced.pop("__records")
        metrics = {name: value / records for name, value in reduced.items()}
        wall = time.perf_counter() - timeline_start
        epoch = self.schedule.epoch_of(step)
        self.state.validation_history.append({"step": step, "epoch": epoch, "wall_seconds": wall, "metrics": metrics})
        if self.topology.is_chief:
            self.metrics.validation(step, epoch, wall, metrics)
            shown = " ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items()))
            self.progress.note(f"validation at batch {step} (epoch {epoch:.2f}, {wall:.0f} s): {shown} "
                               f"[{time.perf_counter() - started:.1f} s]")
        return self._searcher_metric(metrics)

    def _searcher_metric(self, metrics: Mapping[str, float]) -> float | None:
        name = self.config.searcher.metric
        for candidate in (name, name.removeprefix("validation_")):
            if candidate in metrics:
                return metrics[candidate]
        if not getattr(self, "_metric_warned", False):
            self._metric_warned = True
            log.warning("searcher.metric %r is not among the validation metrics %s; best-checkpoint selection "
                        "keeps the latest ones", name, sorted(metrics))
        return None

    # ---------------------------------------------------------------------------------------- checkpoints

    def _checkpoint_due(self, step: int, validated: bool, last: bool) -> bool:
        if last or self.schedule.checkpoint_due(step):
            return True
        if not validated:
            return False
        policy = self.config.checkpoint_policy
        if policy == "all":
            return True
        if policy == "best":
            metric = self._searcher_metric(self.state.validation_history[-1]["metrics"])
            return metric is not None and self._is_best(metric)
        return False

    def _is_best(self, metric: float) -> bool:
        previous = [v["metrics"] for v in self.state.validation_history[:-1]]
        earlier = [m for m in (self._searcher_metric(p) for p in previous) if m is not None]
        if not earlier:
            return True
        better = min if self.config.searcher.smaller_is_better else max
        return better(earlier + [metric]) == metric and metric not in earlier

    def _checkpoint(self, step: int, metric: float | None) -> None:
        rng_states = all_gather_object(capture_rng_state())
        if metric is not None:
            self.state.checkpoint_metrics[step] = metric
        if not self.topology.is_chief:
            return
        started = time.perf_counter()
        state = {"optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "lr_schedule": self.lr_schedule.state_dict() if self.lr_schedule is not None else None,
                 "strategy": self.strategy.state_dict(), "trainer": self.state.to_dict(), "rng": rng_states}
        root = self.run_dir / "checkpoints"
        ref = ckpt.write_checkpoint(root, step, self.strategy.unwrap_model().state_dict(), state,
                                    extra_meta={"world_size": self.topology.world_size,
                                                "epoch": self.schedule.epoch_of(step)},
                                    after_model_file=lambda: self.faults.during_checkpoint(step))
        self._latest_checkpoint = ref
        ckpt.prune_checkpoints(root, self.config.checkpoint_storage.save_trial_latest, self._best_steps())
        log.info("checkpoint %s written in %.2f s", ref.path, time.perf_counter() - started)

    def _best_steps(self) -> set[int]:
        keep = self.config.checkpoint_storage.save_trial_best
        if not keep or not self.state.checkpoint_metrics:
            return set()
        ordered = sorted(self.state.checkpoint_metrics.items(), key=lambda item: item[1],
                         reverse=not self.config.searcher.smaller_is_better)
        return {step for step, _ in ordered[:keep]}

    # ---------------------------------------------------------------------------------------------- end

    def _summary(self) -> dict[str, Any]:
        state = self.state
        history = state.validation_history
        ref = getattr(self, "_latest_checkpoint", None)
        if ref is None and self.topology.is_chief:
            ref = ckpt.find_resume_checkpoint(self.run_dir / "checkpoints")
        return {
            "status": self.status,
            "world_size": self.topology.world_size,
            "global_batch_size": self.split.global_batch_size,
            "per_slot_batch_size": self.split.per_rank[0],
            "per_rank_batch_sizes": list(self.split.per_rank),
            "steps_completed": state.steps_completed,
            "epochs_completed": self.schedule.epoch_of(state.steps_completed),
            "samples_per_second": state.samples_trained / state.training_seconds if state.training_seconds else 0.0,
            "wall_seconds": state.wall_seconds,
            "validation": history[-1]["metrics"] if history else {},
            "validation_history": history,
            "checkpoint": str(ref.model_path) if ref is not None else None,
            "restarts": self.topology.restart_count,
            "resumes": state.resumes,
            "nan_steps_skipped": state.nan_steps_skipped,
            "tensorboard": str(self.run_dir / "tensorboard"),
            "strategy": self.strategy.describe(),
            "communication": self._communication_summary(),
            **({"batch_size_phases": [
                {"start_step": p.start_step, "global_batch_size": p.global_batch_size,
                 "per_slot_batch_size": self._split_of(p).per_rank[0], "aggregation_frequency": p.aggregation_frequency}
                for p in self.schedule.plan.phases if p.start_step < self.schedule.total_batches]}
               if self.schedule.batch_size_changes else {}),
        }
