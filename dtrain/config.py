"""Experiment YAML -> typed, validated config: Determined's classic keys plus dtrain's own sections.

Every rule violation becomes one `ConfigError` line that names the key, the value, the rule and the fix.
Determined keys that configure its cluster (containers, pools, ...) are accepted with a warning, so a
classic experiment file runs unchanged; any other unknown key is rejected with the closest valid key.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dtrain.errors import ConfigError

# ---------------------------------------------------------------------------------------------- sections


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, numbers given for strings become strings."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_assignment=True)


class Length(_Section):
    """A training length or period: exactly one of batches, records or epochs (Determined's length)."""

    batches: int | None = Field(default=None, ge=0)
    records: int | None = Field(default=None, ge=0)
    epochs: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _exactly_one_unit(self) -> Length:
        given = [unit for unit in ("batches", "records", "epochs") if getattr(self, unit) is not None]
        if len(given) != 1:
            raise ValueError(f"a length needs exactly one of batches, records or epochs (got {given or 'none'}); "
                             "write e.g. `{epochs: 5}` or `{batches: 1000}`")
        return self

    @property
    def unit(self) -> str:
        return next(u for u in ("batches", "records", "epochs") if getattr(self, u) is not None)

    @property
    def value(self) -> int:
        return int(getattr(self, self.unit))

    def to_batches(self, global_batch_size: int, records_per_epoch: int) -> int:
        """Convert to batches (one batch = one global batch of records); epochs need `records_per_epoch`."""
        if self.unit == "batches":
            return self.value
        if self.unit == "records":
            return math.ceil(self.value / global_batch_size)
        if records_per_epoch <= 0:
            raise ConfigError(f"a length of {{epochs: {self.value}}} needs the epoch size; set "
                              "`records_per_epoch` or let the Trial's training data define it")
        return math.ceil(self.value * records_per_epoch / global_batch_size)


class Resources(_Section):
    slots_per_trial: int = Field(default=1, ge=0, description="worker processes (one per slot) for the trial")

    @property
    def world_size(self) -> int:
        """Processes to start; Determined's 0 (a CPU-only trial) means one process."""
        return max(self.slots_per_trial, 1)


class Searcher(_Section):
    name: Literal["single", "random", "grid", "adaptive_asha", "async_halving"] = "single"
    metric: str = "validation_loss"
    smaller_is_better: bool = True
    max_length: Length
    source_trial_id: int | None = None
    source_checkpoint_uuid: str | None = None


class CheckpointStorage(_Section):
    type: Literal["shared_fs", "directory"] = "directory"
    host_path: str | None = None
    storage_path: str | None = None
    container_path: str | None = None
    propagation: str | None = None
    save_experiment_best: int = Field(default=0, ge=0)
    save_trial_best: int = Field(default=1, ge=0)
    save_trial_latest: int = Field(default=1, ge=1)


class Optimizations(_Section):
    aggregation_frequency: int = Field(default=1, ge=1)
    average_aggregated_gradients: bool = True
    average_training_metrics: bool = True
    gradient_compression: bool = False
    mixed_precision: Literal["O0", "O1", "O2", "O3"] = "O0"
    tensor_fusion_threshold: float = Field(default=25.0, gt=0, description="bucket size in MB")
    first_bucket_mb: float = Field(default=1.0, gt=0, description="cap of the bucket backward fills first "
                                   "(DDP's default 1 MB: the last layers' all-reduce starts early)")
    auto_tune_tensor_fusion: bool = False
    memory_format: Literal["contiguous", "channels_last"] = "contiguous"


# Options of `distributed.compression` and the compressors they apply to (None = that compressor's default).
COMPRESSION_OPTIONS: dict[str, tuple[str, ...]] = {
    "ratio": ("topk",),
    "error_feedback": ("topk", "powersgd", "sign", "qsgd", "bounded_loss"),
    "warmup_steps": ("topk",),
    "warmup_start_ratio": ("topk",),
    "levels": ("qsgd",),
    "norm": ("qsgd",),
    "chunk_size": ("qsgd", "bounded_loss"),
    "rank": ("powersgd",),
    "start_iter": ("powersgd",),
    "warm_start": ("powersgd",),
    "min_compression_rate": ("powersgd",),
    "epsilon": ("bounded_loss",),
    "layer_priority": ("bounded_loss",),
    "seed": ("qsgd", "topk", "powersgd"),
}


class Compression(_Section):
    """Gradient compression for the allreduce strategy; see the README's compression table."""

    name: Literal["none", "fp16", "bf16", "qsgd", "topk", "powersgd", "sign", "bounded_loss"] = "none"
    ratio: float | None = Field(default=None, gt=0, le=1, description="topk: density, the fraction of entries sent")
    error_feedback: bool | None = None
    warmup_steps: int | None = Field(default=None, ge=0, description="topk: steps of DGC's sparsity warm-up")
    warmup_start_ratio: float | None = Field(default=None, gt=0, le=1, description="topk: density at step 0")
    levels: int | None = Field(default=None, ge=1, le=127, description="qsgd: s, quantization levels")
    norm: Literal["l2", "max"] | None = None
    chunk_size: int | None = Field(default=None, ge=1, description="qsgd: elements per norm; bounded_loss: per chunk")
    rank: int | None = Field(default=None, ge=1, description="powersgd: rank of the approximation")
    start_iter: int | None = Field(default=None, ge=2, description="powersgd: uncompressed steps first")
    warm_start: bool | None = None
    min_compression_rate: float | None = Field(default=None, ge=1)
    epsilon: float | None = Field(default=None, ge=0, lt=1, description="bounded_loss: fraction of chunks dropped")
    layer_priority: float | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _options_apply(self) -> Compression:
        for key, compressors in COMPRESSION_OPTIONS.items():
            if getattr(self, key) is not None and self.name not in compressors:
                raise ValueError(f"distributed.compression.{key} applies to {' or '.join(compressors)}, not to "
                                 f"`{self.name}`; remove it or change distributed.compression.name")
        return self

    def options(self) -> dict[str, Any]:
        """The options set, as keyword arguments of the compressor's class."""
        return {key: getattr(self, key) for key in COMPRESSION_OPTIONS if getattr(self, key) is not None}


class ParameterServer(_Section):
    """`distributed.parameter_server`: server processes beside the workers, and how they apply gradients."""

    servers: int = Field(default=1, ge=1, description="server processes; parameters are sharded over them by bytes")
    mode: Literal["sync", "async", "ssp"] = "sync"
    staleness: int = Field(default=4, ge=0, description="ssp: how many steps a worker may run ahead of the slowest")
    backup_workers: int = Field(default=0, ge=0, description="sync: each update uses the first W-b gradients")
    staleness_lr: bool = Field(default=False, description="divide the rate by each gradient's observed staleness")

    @model_validator(mode="after")
    def _backup_for_sync(self) -> ParameterServer:
        if self.backup_workers and self.mode != "sync":
            raise ValueError(f"distributed.parameter_server.backup_workers ({self.backup_workers}) applies to mode "
                             f"`sync` only (mode `{self.mode}` never waits for all workers); remove it or set "
                             "`mode: sync`")
        return self


class Distributed(_Section):
    strategy: Literal["allreduce", "parameter_server", "local_sgd", "hierarchical"] = "allreduce"
    parameter_server: ParameterServer = Field(default_factory=ParameterServer)
    op: Literal["average", "sum", "adasum"] = "average"
    compression: Compression = Field(default_factory=Compression)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_seconds: float = Field(default=600.0, gt=0, description="collective timeout: a collective that waits "
                                   "this long becomes an error naming the ranks that did not arrive")
    stall_warning_seconds: float = Field(default=60.0, gt=0, description="log which ranks have not arrived "
                                         "(and what each is doing) when a rank waits this long")
    find_unused_parameters: bool = False


class Decay(_Section):
    """How the rate falls after warm-up: `step` (x gamma at each milestone epoch), `cosine` or `poly`."""

    name: Literal["none", "step", "cosine", "poly"] = "none"
    milestones: list[float] = Field(default_factory=list, description="epochs where `step` multiplies by gamma")
    gamma: float = Field(default=0.1, gt=0, le=1)
    final_fraction: float = Field(default=0.0, ge=0, le=1, description="cosine/poly: end rate as a share of the peak")
    power: float = Field(default=2.0, gt=0, description="poly: exponent of (1 - progress)")

    @model_validator(mode="after")
    def _milestones_for_step_only(self) -> Decay:
        if self.name == "step":
            if not self.milestones:
                raise ValueError("decay `step` needs milestones (epochs where the rate is multiplied by gamma); "
                                 "write e.g. `decay: {name: step, milestones: [6, 8]}`")
            if any(b <= a for a, b in zip(self.milestones, self.milestones[1:], strict=False)):
                raise ValueError(f"decay.milestones {self.milestones} must increase strictly; sort them")
        elif self.milestones:
            raise ValueError(f"decay.milestones are for decay `step`, not `{self.name}`; remove them or use "
                             "`name: step`")
        return self


class BatchSizeSchedule(_Section):
    """Multiply the global batch at given epochs instead of decaying the rate (Smith et al. 2017)."""

    epochs: list[float] = Field(min_length=1, description="epochs at which the global batch is multiplied")
    factor: int | list[int] = Field(default=2, description="the multiplier, or one per milestone")
    grow: Literal["per_slot_batch", "aggregation_frequency"] = "per_slot_batch"
    max_per_slot_batch: int | None = Field(default=None, ge=1, description="above it, grow aggregation instead")

    @model_validator(mode="after")
    def _consistent(self) -> BatchSizeSchedule:
        if any(e <= 0 for e in self.epochs) or any(b <= a for a, b in zip(self.epochs, self.epochs[1:], strict=False)):
            raise ValueError(f"batch_size_schedule.epochs {self.epochs} must be positive and increase strictly; "
                             "write e.g. `epochs: [4, 8]`")
        factors = self.factors
        if len(factors) != len(self.epochs):
            raise ValueError(f"batch_size_schedule.factor lists {len(factors)} factors for {len(self.epochs)} "
                             "epochs; give one per epoch or a single number")
        if any(f < 2 for f in factors):
            raise ValueError(f"batch_size_schedule.factor {self.factor} must be whole numbers >= 2 (the global "
                             "batch is multiplied); write e.g. `factor: 2`")
        if self.max_per_slot_batch is not None and self.grow != "per_slot_batch":
            raise ValueError("batch_size_schedule.max_per_slot_batch applies to `grow: per_slot_batch` only; "
                             "remove it")
        return self

    @property
    def factors(self) -> list[int]:
        return list(self.factor) if isinstance(self.factor, list) else [self.factor] * len(self.epochs)


# Optimizer options of `large_batch` and the optimizers they apply to (None = that optimizer's default).
OPTIMIZER_OPTIONS: dict[str, tuple[str, ...]] = {
    "base_lr": ("sgd", "lars", "lamb", "radam", "adam", "adamw"),
    "weight_decay": ("sgd", "lars", "lamb", "radam", "adam", "adamw"),
    "momentum": ("sgd", "lars"),
    "nesterov": ("sgd",),
    "trust_coefficient": ("lars",),
    "exclude_bias_and_norm": ("lars", "lamb"),
    "betas": ("lamb", "radam", "adam", "adamw"),
    "eps": ("lamb", "radam", "adam", "adamw"),
    "bias_correction": ("lamb",),
    "max_grad_norm": ("lamb",),
    "max_trust_ratio": ("lamb",),
}


class LargeBatch(_Section):
    """Large-batch recipes: an optimizer built from config, LR scaling, warm-up, decay, batch-size schedule."""

    optimizer: Literal["trial", "sgd", "lars", "lamb", "radam", "adam", "adamw"] = "trial"
    base_lr: float | None = Field(default=None, gt=0, description="rate at base_batch_size; default "
                                                                  "hyperparameters.learning_rate")
    weight_decay: float | None = Field(default=None, ge=0, description="default hyperparameters.weight_decay, else 0")
    momentum: float | None = Field(default=None, ge=0, lt=1)
    nesterov: bool | None = None
    trust_coefficient: float | None = Field(default=None, gt=0)
    exclude_bias_and_norm: bool | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = Field(default=None, gt=0)
    bias_correction: bool | None = None
    max_grad_norm: float | None = Field(default=None, gt=0)
    max_trust_ratio: float | None = Field(default=None, gt=0)
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch_size: int | None = Field(default=None, ge=1)
    warmup_epochs: float = Field(default=0.0, ge=0)
    decay: Decay = Field(default_factory=Decay)
    batch_size_schedule: BatchSizeSchedule | None = None

    @field_validator("decay", mode="before")
    @classmethod
    def _decay_by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not all(0 <= b < 1 for b in value):
            raise ValueError(f"betas {list(value)} must both be in [0, 1); write e.g. `betas: [0.9, 0.999]`")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> LargeBatch:
        for key, optimizers in OPTIMIZER_OPTIONS.items():
            if getattr(self, key) is not None and self.optimizer not in optimizers:
                owner = ("an optimizer named in large_batch.optimizer (the Trial's optimizer sets its own)"
                         if self.optimizer == "trial" else f"optimizer {' or '.join(optimizers)}")
                raise ValueError(f"large_batch.{key} applies to {owner}, not to `{self.optimizer}`; remove it or "
                                 "change large_batch.optimizer")
        if self.lr_scaling != "none" and self.base_batch_size is None:
            raise ValueError(f"large_batch.lr_scaling `{self.lr_scaling}` needs large_batch.base_batch_size (the "
                             "global batch the base rate was tuned at); add e.g. `base_batch_size: 128`")
        if self.warmup_epochs > 0 and self.lr_scaling == "none":
            raise ValueError(f"large_batch.warmup_epochs ({self.warmup_epochs:g}) ramps from the base rate to the "
                             "scaled rate, which lr_scaling `none` makes equal; set lr_scaling to linear or sqrt, "
                             "or remove warmup_epochs")
        if self.decay.milestones and self.decay.milestones[0] < self.warmup_epochs:
            raise ValueError(f"large_batch.decay.milestones start at epoch {self.decay.milestones[0]:g}, inside the "
                             f"warm-up ({self.warmup_epochs:g} epochs); decay starts after warm-up, so move them later")
        return self

    @property
    def schedules_lr(self) -> bool:
        """Whether the config sets the learning rate over time (scaling, warm-up or decay)."""
        return self.lr_scaling != "none" or self.warmup_epochs > 0 or self.decay.name != "none"


class Reproducibility(_Section):
    experiment_seed: int = Field(default=0, ge=0)


class DataLoaderConfig(_Section):
    num_workers: int = Field(default=0, ge=0, description="loader processes per worker")
    validation_batch_size: int | None = Field(default=None, ge=1)


class Profiling(_Section):
    """Step-phase timers are always on (`phase_timers`); `enabled` also writes a Chrome-trace timeline per rank
    for the batches from `begin_on_batch` to `end_after_batch`."""

    enabled: bool = False
    begin_on_batch: int = Field(default=0, ge=0)
    end_after_batch: int | None = Field(default=None, ge=0)
    sync_timings: bool = True
    phase_timers: bool = Field(default=True, description="time the phases of every step (data, forward, "
                               "backward, communication wait, optimizer, checkpoint) on every rank")

    @model_validator(mode="after")
    def _window(self) -> Profiling:
        if self.end_after_batch is not None and self.end_after_batch < self.begin_on_batch:
            raise ValueError(f"profiling.end_after_batch ({self.end_after_batch}) must be >= begin_on_batch "
                             f"({self.begin_on_batch}); raise it or leave it out to profile to the end")
        return self


class Kill(_Section):
    """One injected crash: SIGKILL `rank` at the start of `batch` (`during: step`), or in the middle of the first
    checkpoint write at or after `batch` (`during: checkpoint`; rank 0, the writer). Each fires once per run dir."""

    rank: int = Field(ge=0)
    batch: int = Field(ge=1)
    during: Literal["step", "checkpoint"] = "step"

    @model_validator(mode="after")
    def _writer_only(self) -> Kill:
        if self.during == "checkpoint" and self.rank != 0:
            raise ValueError(f"a kill `during: checkpoint` hits the checkpoint writer, rank 0, not rank {self.rank}; "
                             "set `rank: 0` or use `during: step`")
        return self


class Debug(_Section):
    stop_after_batch: int | None = Field(default=None, ge=1,
                                         description="checkpoint and stop after this batch, as a preemption would")
    slow_rank: int | None = Field(default=None, ge=0,
                                  description="make this rank a straggler (see slow_factor)")
    slow_factor: float = Field(default=1.0, ge=1.0,
                               description="the straggler's forward + backward take this many times as long")
    kills: list[Kill] = Field(default_factory=list, description="crashes to inject (SIGKILL), each once per run dir")
    nan_rank: int | None = Field(default=None, ge=0, description="the rank whose gradient gets a NaN (nan_batches)")
    nan_batches: list[int] = Field(default_factory=list,
                                   description="batches after whose backward pass nan_rank's gradient gets a NaN")
    hang_rank: int | None = Field(default=None, ge=0, description="make this rank hang (see hang_at_step)")
    hang_at_step: int = Field(default=1, ge=1, description="the batch before whose forward pass hang_rank hangs")
    synthetic_data: bool = Field(default=False, description="train on random data of the Trial's shapes "
                                 "(what `dtrain diagnose` uses to measure the input pipeline)")

    @model_validator(mode="after")
    def _nan_pair(self) -> Debug:
        if (self.nan_rank is None) != (not self.nan_batches):
            raise ValueError("debug.nan_rank and debug.nan_batches go together (which rank, which batches); "
                             "give both, e.g. `nan_rank: 1` and `nan_batches: [7]`, or neither")
        if any(batch < 1 for batch in self.nan_batches):
            raise ValueError(f"debug.nan_batches {self.nan_batches} must be batch numbers >= 1")
        return self

    def ranks(self) -> dict[str, int]:
        """Every rank this section names, by the key that names it."""
        named = {"debug.slow_rank": self.slow_rank, "debug.nan_rank": self.nan_rank,
                 "debug.hang_rank": self.hang_rank}
        named.update({f"debug.kills[{i}].rank": kill.rank for i, kill in enumerate(self.kills)})
        return {key: rank for key, rank in named.items() if rank is not None}


class ExperimentConfig(_Section):
    """The whole experiment file."""

    name: str = "experiment"
    description: str = ""
    labels: list[str] = Field(default_factory=list)
    entrypoint: str
    hyperparameters: dict[str, Any]
    resources: Resources = Field(default_factory=Resources)
    searcher: Searcher
    records_per_epoch: int = Field(default=0, ge=0)
    min_validation_period: Length = Field(default_factory=lambda: Length(batches=0))
    min_checkpoint_period: Length = Field(default_factory=lambda: Length(batches=0))
    checkpoint_policy: Literal["best", "all", "none"] = "best"
    checkpoint_storage: CheckpointStorage = Field(default_factory=CheckpointStorage)
    max_restarts: int = Field(default=5, ge=0)
    nan_policy: Literal["abort", "skip"] = Field(
        default="abort", description="a non-finite gradient on any rank: stop with an error, or skip that update "
                                     "on every rank")
    max_consecutive_nan_skips: int = Field(default=5, ge=1, description="with nan_policy skip: stop after this many "
                                                                         "skipped updates in a row")
    scheduling_unit: int = Field(default=100, ge=1)
    perform_initial_validation: bool = False
    optimizations: Optimizations = Field(default_factory=Optimizations)
    reproducibility: Reproducibility = Field(default_factory=Reproducibility)
    data: dict[str, Any] = Field(default_factory=dict)
    data_loader: DataLoaderConfig = Field(default_factory=DataLoaderConfig)
    profiling: Profiling = Field(default_factory=Profiling)
    distributed: Distributed = Field(default_factory=Distributed)
    large_batch: LargeBatch = Field(default_factory=LargeBatch)
    debug: Debug = Field(default_factory=Debug)

    @field_validator("hyperparameters")
    @classmethod
    def _constant_hyperparameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        return {name: _constant_hparam(name, spec) for name, spec in value.items()}

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str) -> str:
        module, sep, qualname = value.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"entrypoint {value!r} must name a Trial class as `module:Class` or `file.py:Class`; "
                             "write e.g. `entrypoint: model_def:MyTrial`")
        return value

    @model_validator(mode="after")
    def _global_batch_size(self) -> ExperimentConfig:
        gbs = self.hyperparameters.get("global_batch_size")
        if gbs is None:
            raise ValueError("hyperparameters.global_batch_size is required (records per training step over all "
                             "workers); add e.g. `global_batch_size: 128` under hyperparameters")
        if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
            raise ValueError(f"hyperparameters.global_batch_size ({gbs!r}) must be a positive integer; "
                             "write e.g. `global_batch_size: 128`")
        world = self.resources.world_size
        if gbs < world:
            raise ValueError(f"hyperparameters.global_batch_size ({gbs}) must be >= resources.slots_per_trial "
                             f"({world}); raise it to {world} or use fewer slots")
        return self

    @model_validator(mode="after")
    def _debug_ranks(self) -> ExperimentConfig:
        world = self.resources.world_size
        for key, rank in self.debug.ranks().items():
            if rank >= world:
                raise ValueError(f"{key} ({rank}) must name a worker rank below resources.slots_per_trial "
                                 f"({world}); use 0..{world - 1}")
        return self

    @model_validator(mode="after")
    def _one_compression(self) -> ExperimentConfig:
        name = self.distributed.compression.name
        if self.optimizations.gradient_compression and name not in ("none", "fp16"):
            raise ValueError(f"optimizations.gradient_compression (true, which means fp16) and "
                             f"distributed.compression.name `{name}` name two compressions; remove "
                             "optimizations.gradient_compression")
        if self.distributed.op == "adasum" and self.compression.name != "none":
            raise ValueError(f"distributed.op `adasum` combines full-precision gradients and cannot use compression "
                             f"`{self.compression.name}`; use op average or sum, or remove the compression")
        return self

    @property
    def compression(self) -> Compression:
        """The compression to use: `distributed.compression`, or fp16 for Determined's
        `optimizations.gradient_compression: true`."""
        if self.optimizations.gradient_compression and self.distributed.compression.name == "none":
            return Compression(name="fp16")
        return self.distributed.compression

    @model_validator(mode="after")
    def _parameter_server_fits(self) -> ExperimentConfig:
        if self.distributed.strategy != "parameter_server":
            return self
        if self.compression.name != "none" or self.distributed.op != "average":
            raise ValueError(f"distributed.strategy parameter_server pushes full gradients and averages them; it "
                             f"cannot use compression `{self.compression.name}` or op `{self.distributed.op}`; "
                             "remove them or use distributed.strategy allreduce")
        ps, world = self.distributed.parameter_server, self.resources.world_size
        if ps.backup_workers >= world:
            raise ValueError(f"distributed.parameter_server.backup_workers ({ps.backup_workers}) must be below "
                             f"resources.slots_per_trial ({world}): each update needs at least one gradient; use "
                             f"0..{world - 1}")
        if (ps.mode != "sync" or ps.backup_workers) and (self.optimizations.aggregation_frequency > 1
                                                         or self.large_batch.batch_size_schedule is not None):
            how = f"mode `{ps.mode}`" if ps.mode != "sync" else "backup_workers"
            raise ValueError(f"distributed.parameter_server {how} lets workers run different numbers of batches, so "
                             "optimizations.aggregation_frequency and large_batch.batch_size_schedule do not apply; "
                             "remove them or use `mode: sync` without backup workers")
        return self

    @model_validator(mode="after")
    def _large_batch_rate(self) -> ExperimentConfig:
        lb = self.large_batch
        if lb.optimizer == "trial" or lb.base_lr is not None:
            return self
        rate = self.hyperparameters.get("learning_rate")
        if rate is None:
            raise ValueError(f"large_batch.optimizer `{lb.optimizer}` needs a base learning rate; set "
                             "large_batch.base_lr (or hyperparameters.learning_rate), e.g. `base_lr: 0.1`")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
            raise ValueError(f"hyperparameters.learning_rate ({rate!r}) is the base rate of large_batch.optimizer "
                             f"`{lb.optimizer}` and must be a positive number; fix it or set large_batch.base_lr")
        return self

    @property
    def global_batch_size(self) -> int:
        return int(self.hyperparameters["global_batch_size"])


def _constant_hparam(name: str, spec: Any) -> Any:
    """Return the constant a hyperparameter stands for; search spaces need a searcher that does not exist yet."""
    if isinstance(spec, Mapping) and "type" in spec:
        kind = spec["type"]
        if kind == "const":
            if "val" not in spec:
                raise ValueError(f"hyperparameters.{name} has `type: const` without `val`; add e.g. `val: 0.1`")
            return spec["val"]
        raise ValueError(f"hyperparameters.{name} has `type: {kind}`, a search space, but searcher `single` trains "
                         f"one trial; give a constant (e.g. `{name.split('.')[-1]}: 0.1`) - hyperparameter search "
                         "is not built yet")
    if isinstance(spec, Mapping):
        return {key: _constant_hparam(f"{name}.{key}", value) for key, value in spec.items()}
    return spec


# --------------------------------------------------------------------------- Determined keys we accept

# Keys that configure Determined's cluster rather than training; a classic file with them still runs.
IGNORED_KEYS: dict[str, str] = {
    "environment": "dtrain runs in the current Python environment, not in containers",
    "bind_mounts": "dtrain runs on the host filesystem, not in containers",
    "workspace": "dtrain has no workspaces; runs are grouped by name under runs/",
    "project": "dtrain has no projects; runs are grouped by name under runs/",
    "log_policies": "dtrain does not match log lines",
    "retention_policy": "dtrain keeps logs in the run dir",
    "preemption_timeout": "dtrain has no scheduler that preempts",
    "tensorboard_storage": "dtrain writes TensorBoard events into the run dir",
    "slurm": "start dtrain under Slurm with srun instead (see README)",
    "pbs": "dtrain does not submit PBS jobs",
    "resources.resource_pool": "dtrain has no resource pools",
    "resources.priority": "dtrain has no scheduler",
    "resources.weight": "dtrain has no scheduler",
    "resources.shm_size": "dtrain runs on the host, not in containers",
    "resources.max_slots": "one experiment runs one trial",
    "resources.is_single_node": "nodes are given on the command line (--nnodes)",
    "resources.devices": "dtrain runs on the host, not in containers",
    "resources.native_parallel": "a legacy Determined flag",
    "optimizations.tensor_fusion_cycle_time": "fusion follows DDP's buckets, not Horovod's cycle",
    "optimizations.grad_updates_size_file": "it had no effect in Determined either",
    "searcher.max_trials": "searcher `single` trains one trial",
    "searcher.max_concurrent_trials": "searcher `single` trains one trial",
}


# ------------------------------------------------------------------------------------------- loading


@dataclass
class LoadedConfig:
    """A validated config with the warnings met while loading it (printed once by the caller)."""

    config: ExperimentConfig
    source: Path | None
    warnings: list[str] = field(default_factory=list)

    @property
    def base_dir(self) -> Path:
        """Directory of the YAML file: relative entrypoints and data paths start here."""
        return self.source.parent.resolve() if self.source else Path.cwd()


def parse_override(text: str) -> tuple[str, Any]:
    """Split `dotted.key=value`; the value is read as YAML so that 4, true, 0.1 and [1, 2] get their types."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r} must look like dotted.key=value; write e.g. "
                          "`--set resources.slots_per_trial=4`")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
        if _has_unspaced_colon(value):  # `{batches:60}` is YAML for {"batches:60": null}; mean {batches: 60}
            value = yaml.safe_load(re.sub(r":(?=\S)", ": ", raw))
    except yaml.YAMLError:
        value = raw
    return key, value


def _has_unspaced_colon(value: Any) -> bool:
    return isinstance(value, dict) and any(isinstance(k, str) and ":" in k and v is None for k, v in value.items())


def apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` (dotted) in a raw config dict, creating the sections on the way."""
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"--set {key}=...: `{where}` is {child!r}, not a section, so it has no key "
                              f"`{parts[depth + 1]}`; set `{where}` itself")
        node = child
    node[parts[-1]] = value


def read_yaml(path: Path) -> dict[str, Any]:
    """Read an experiment file with yaml.safe_load; the top level must be a mapping."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; give the path of an experiment YAML file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.__class__.__name__}); "
                          "give the path of a readable YAML text file") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}; fix the syntax there") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} holds a {type(raw).__name__}, not a mapping of keys; "
                          "it must start with keys such as `name:` and `entrypoint:`")
    return raw


def load_config(path: str | Path | None, overrides: Iterable[str] = (), raw: dict[str, Any] | None = None
                ) -> LoadedConfig:
    """Read, override and validate an experiment config; raise `ConfigError` with one line on any problem."""
    source = Path(path) if path is not None else None
    data = copy.deepcopy(raw) if raw is not None else read_yaml(source)  # type: ignore[arg-type]
    override_keys = []
    for text in overrides:
        key, value = parse_override(text)
        apply_override(data, key, value)
        override_keys.append(key)
    warnings = _drop_ignored_keys(data)
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, data, override_keys)) from None
    return LoadedConfig(config=config, source=source, warnings=warnings + _remainder_warnings(config))


def dump_config(config: ExperimentConfig) -> str:
    """The fully resolved config as YAML, loadable again by `load_config`."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _drop_ignored_keys(data: dict[str, Any]) -> list[str]:
    warnings = []
    for dotted, reason in IGNORED_KEYS.items():
        section, _, key = dotted.rpartition(".")
        node = data.get(section) if section else data
        if isinstance(node, dict) and key in node:
            node.pop(key)
            warnings.append(f"config key `{dotted}` has no effect in dtrain ({reason}); ignored")
    return warnings


def _remainder_warnings(config: ExperimentConfig) -> list[str]:
    gbs, world = config.global_batch_size, config.resources.world_size
    if gbs % world:
        used = gbs // world * world
        return [f"global_batch_size {gbs} is not divisible by {world} slots: each slot trains on {gbs // world} "
                f"records per batch and {gbs - used} are dropped (effective global batch {used})"]
    return []


# ------------------------------------------------------------------------------------ error messages


def _explain(exc: ValidationError, data: dict[str, Any], override_keys: list[str]) -> str:
    errors = exc.errors()
    first = _explain_one(errors[0], data, override_keys)
    if len(errors) > 1:
        first += f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} after this one)"
    return first


def _explain_one(error: Any, data: dict[str, Any], override_keys: list[str]) -> str:
    loc = [str(part) for part in error["loc"] if not str(part).startswith("function-")]
    dotted = ".".join(loc)
    origin = " (from --set)" if any(dotted == k or dotted.startswith(k + ".") for k in override_keys) else ""
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return _unknown_key(loc, value) + origin
    if kind == "missing":
        return f"`{dotted}` is required{origin}; add it, e.g. {_example(loc)}"
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        self_named = message.startswith(("hyperparameters", "entrypoint", "large_batch", "debug"))
        return f"`{dotted}`{origin}: {message}" if dotted and not self_named else message + origin
    shown = f"{value!r}"
    if kind in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        sign = ">=" if kind == "greater_than_equal" else ">"
        return f"`{dotted}` = {shown}{origin} must be {sign} {bound}; set it to at least {bound}"
    if kind == "literal_error":
        choices = [c.strip(" '") for c in str(ctx.get("expected", "")).replace(" or ", ",").split(",")]
        choices = [c for c in choices if c]
        near = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"did you mean `{near[0]}`?" if near else f"use one of: {', '.join(choices)}"
        return f"`{dotted}` = {shown}{origin} must be one of {', '.join(choices)}; {hint}"
    if kind.startswith(("int_", "float_", "bool_", "string_", "dict_", "list_", "model_")):
        family = kind.split("_")[0]
        wanted = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
                  "dict": "a mapping of keys", "list": "a list", "model": "a section of keys"}[family]
        if family == "model" and loc and loc[-1] not in _EXAMPLES:
            return (f"`{dotted}` = {shown}{origin} must be a section of keys; write its keys indented under "
                    f"`{loc[-1]}:` (valid: {', '.join(_fields_at(loc))})")
        example = f"`{loc[-1]}: true`" if family == "bool" and loc else _example(loc)
        return f"`{dotted}` = {shown}{origin} must be {wanted}; write e.g. {example}"
    return f"`{dotted}` = {shown}{origin} is invalid: {error['msg']}; check its documented type in the README"


def _unknown_key(loc: list[str], value: Any) -> str:
    parent, key = loc[:-1], loc[-1]
    valid = sorted(_fields_at(parent))
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    where = f"section `{'.'.join(parent)}`" if parent else "the top level"
    hint = f"did you mean `{'.'.join(parent + [near[0]])}`?" if near else f"valid keys here: {', '.join(valid)}"
    return f"unknown config key `{'.'.join(loc)}` (value {value!r}) in {where}; {hint}"


def _fields_at(path: list[str]) -> list[str]:
    model: Any = ExperimentConfig
    for part in path:
        info = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if info is None:
            return []
        model = _model_of(info.annotation)
    return list(getattr(model, "model_fields", {}).keys())


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


_EXAMPLES = {
    "entrypoint": "`entrypoint: model_def:MyTrial`",
    "hyperparameters": "`hyperparameters: {global_batch_size: 128}`",
    "searcher": "`searcher: {name: single, metric: validation_loss, max_length: {epochs: 1}}`",
    "max_length": "`max_length: {epochs: 1}`",
    "slots_per_trial": "`slots_per_trial: 2`",
    "records_per_epoch": "`records_per_epoch: 60000`",
    "max_restarts": "`max_restarts: 5`",
}


def _example(loc: list[str]) -> str:
    key = loc[-1] if loc else ""
    if key in _EXAMPLES:
        return _EXAMPLES[key]
    if key in ("batches", "records", "epochs"):
        return f"`{key}: 10`"
    return f"`{key}: <value>` as the README's config reference shows"


# ------------------------------------------------------------------------------- features not built

# (dotted key, the value that works today) for settings whose other values belong to later work.
_NOT_BUILT_YET: list[tuple[str, Any, str]] = [
    ("distributed.strategy", ("allreduce", "parameter_server"),
     "only the allreduce and parameter_server strategies are built so far"),
    ("optimizations.mixed_precision", "O0", "mixed precision is not built yet"),
    ("searcher.name", "single", "hyperparameter search is not built yet; one trial runs per experiment"),
]


def check_buildable(config: ExperimentConfig) -> None:
    """Refuse settings that are valid by the contract but whose feature is not built yet (see README)."""
    for dotted, working, reason in _NOT_BUILT_YET:
        value: Any = config
        for part in dotted.split("."):
            value = getattr(value, part)
        allowed = working if isinstance(working, tuple) else (working,)
        if value not in allowed:
            shown = " or ".join(repr(v) for v in allowed)
            raise ConfigError(f"`{dotted}` = {value!r}: {reason} (README, feature table); "
                              f"remove it or set it to {shown}")


def is_built(dotted: str, value: Any) -> bool:
    """False when `check_buildable` would refuse `value` for the key `dotted` (its feature is not built yet)."""
    for key, working, _ in _NOT_BUILT_YET:
        allowed = working if isinstance(working, tuple) else (working,)
        if key == dotted and value not in allowed:
            return False
    return True
