"""The whole experiment file: the top-level keys, the sections, and the rules that span sections."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtrain.config.base import DETERMINED_ONLY, Length, Section, picked_by
from dtrain.config.compression import Compression, Fp16Config
from dtrain.config.distributed import Distributed, Optimizations
from dtrain.config.entrypoint import Entrypoint, parse_entrypoint
from dtrain.config.faults import Faults
from dtrain.config.optimizers import LargeBatchSection, TrialOptimizer
from dtrain.config.parallelism import check_layout
from dtrain.config.profiling import Profiling
from dtrain.config.storage import CheckpointStorage, DirectoryStorage, storage_by_type
from dtrain.config.strategies import RunShape
from dtrain.config.tracking import Tracking
from dtrain.config.training import DataLoaderConfig, Reproducibility, Resources, Searcher
from dtrain.errors import ConfigError


class ExperimentConfig(Section):
    """The whole experiment file: Determined's classic keys and dtrain's own sections beside them."""

    name: str = Field(default="experiment", description="names the run dir (`runs/<name>/<id>/`) and the store "
                                                        "entry")
    description: str = Field(default="", description="free text kept with the run in the store")
    labels: list[str] = Field(default_factory=list, description=DETERMINED_ONLY)
    entrypoint: str | list[str] = Field(
        description="the Trial class (`module:Class`, module next to the experiment file, or `path/file.py:Class`; "
        "dtrain's Trial or Determined's PyTorchTrial), or a command started on each slot in the experiment file's "
        "directory (`python3 train.py`, optionally behind `python3 -m determined.launch.torch_distributed`)")
    hyperparameters: dict[str, Any] = Field(
        default_factory=dict,
        description="constants (or `{type: const, val: x}`) given to the Trial; a Trial class needs "
        "`global_batch_size` (records per step over all workers); a command needs none")
    resources: Resources = Field(default_factory=Resources, description="worker processes")
    searcher: Searcher = Field(description="training length and the metric that picks the best checkpoint")
    records_per_epoch: int = Field(default=0, ge=0, description="records in an epoch for lengths in epochs; 0 means "
                                                                "one pass over the training data")
    min_validation_period: Length = Field(default_factory=lambda: Length(batches=0),
                                          description="validate every this long ({batches: 0}: only at the end)")
    min_checkpoint_period: Length = Field(default_factory=lambda: Length(batches=0),
                                          description="checkpoint every this long ({batches: 0}: only at the end)")
    checkpoint_policy: Literal["best", "all", "none"] = Field(
        default="best", description="also checkpoint after a validation: `best` (when the metric improves), `all`, "
        "`none`")
    checkpoint_storage: CheckpointStorage = Field(
        default_factory=DirectoryStorage, description="where checkpoints go (`type`: `directory`, the run dir's "
        "`checkpoints/` by default; `shared_fs`, `s3`, `gcs`, `azure`) and how many are kept")
    max_restarts: int = Field(default=5, ge=0, description="elastic-agent restarts of the workers after a failure; "
                                                           "each resumes from `checkpoints/latest`")
    nan_policy: Literal["abort", "skip"] = Field(
        default="abort", description="a NaN/infinite gradient on any rank: `abort` (stop with an error before the "
        "update) or `skip` (drop that update on every rank)")
    max_consecutive_nan_skips: int = Field(default=5, ge=1, description="with nan_policy skip: stop after this many "
                                                                        "skipped updates in a row")
    scheduling_unit: int = Field(default=100, ge=1, description="batches between training-metric reports (store, "
                                                                "TensorBoard, log lines)")
    perform_initial_validation: bool = Field(default=False, description="validate before the first batch")
    optimizations: Optimizations = Field(default_factory=Optimizations,
                                         description="gradient accumulation, fusion buckets, memory layout")
    reproducibility: Reproducibility = Field(default_factory=Reproducibility, description="the seed")
    data: dict[str, Any] = Field(default_factory=dict, description="free-form, given to the Trial as "
                                                                   "`context.data_config`")
    data_loader: DataLoaderConfig = Field(default_factory=DataLoaderConfig, description="loader processes and "
                                                                                       "evaluation batch size")
    profiling: Profiling = Field(default_factory=Profiling, description="phase timers and the timeline")
    distributed: Distributed = Field(default_factory=Distributed, description="strategy, reduction op, compression, "
                                                                              "timeouts")
    large_batch: LargeBatchSection = Field(default_factory=TrialOptimizer, description="optimizer, LR scaling, "
                                           "warm-up, decay, batch-size schedule")
    faults: Faults = Field(default_factory=Faults, description="faults to inject, early stop, synthetic data")
    tracking: Tracking = Field(default_factory=Tracking, description="an experiment tracker the run also logs to "
                               "(MLflow), beside the run store and TensorBoard")
    debug: bool = Field(default=False, description="Determined's debug flag: dtrain's workers log at DEBUG level")

    @field_validator("hyperparameters")
    @classmethod
    def _constant_hyperparameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        return {name: _constant_hparam(name, spec) for name, spec in value.items()}

    @field_validator("checkpoint_storage", mode="before")
    @classmethod
    def _storage_by_type(cls, value: Any) -> Any:
        return storage_by_type(value)

    @field_validator("large_batch", mode="before")
    @classmethod
    def _optimizer_by_name(cls, value: Any) -> Any:
        return value if isinstance(value, str) else picked_by(value, "optimizer", "trial")

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str | list[str]) -> str | list[str]:
        parse_entrypoint(value)
        return value

    @property
    def entry(self) -> Entrypoint:
        """What `entrypoint` names: a Trial class, or a command (Determined's launch layer taken off)."""
        return parse_entrypoint(self.entrypoint)

    @property
    def is_command(self) -> bool:
        """True when `entrypoint` is a command that dtrain starts on each slot rather than a Trial class."""
        return self.entry.is_command

    @property
    def training_length(self) -> Length:
        """`searcher.max_length`, which a Trial class needs (checked when the file is loaded)."""
        if self.searcher.max_length is None:
            raise ConfigError("searcher.max_length is required for a Trial class entrypoint; add e.g. "
                              "`max_length: {epochs: 1}` under searcher")
        return self.searcher.max_length

    @model_validator(mode="after")
    def _class_needs_length(self) -> ExperimentConfig:
        if not self.is_command and self.searcher.max_length is None:
            raise ValueError("searcher.max_length is required for a Trial class entrypoint (a command sets its own "
                             "length); add e.g. `max_length: {epochs: 1}` under searcher")
        return self

    @model_validator(mode="after")
    def _global_batch_size(self) -> ExperimentConfig:
        if self.is_command:  # the script batches its own data; a global_batch_size is only its hyperparameter
            return self
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
    def _fault_ranks(self) -> ExperimentConfig:
        world = self.resources.world_size
        for key, rank in self.faults.ranks().items():
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

    @model_validator(mode="after")
    def _parallel_layout(self) -> ExperimentConfig:
        check_layout(self.optimizations, self.distributed, self.compression, self.run_shape())
        return self

    def run_shape(self, world_size: int | None = None) -> RunShape:
        """What the strategies' rules read from this file, at `world_size` workers (default: slots_per_trial)."""
        return RunShape(world_size=world_size or self.resources.world_size,
                        global_batch_size=self.hyperparameters.get("global_batch_size"),
                        aggregation_frequency=self.optimizations.aggregation_frequency,
                        batch_size_schedule=self.large_batch.batch_size_schedule is not None,
                        passes=self.optimizations.max_per_slot_batch is not None)

    @property
    def compression(self) -> Compression:
        """The compression to use: `distributed.compression`, or fp16 for Determined's
        `optimizations.gradient_compression: true`."""
        if self.optimizations.gradient_compression and self.distributed.compression.name == "none":
            return Fp16Config()
        return self.distributed.compression

    @model_validator(mode="after")
    def _uneven_clusters(self) -> ExperimentConfig:
        d, world = self.distributed, self.resources.world_size
        het = d.heterogeneous
        if het is not None:
            if isinstance(het.split, list) and len(het.split) != world:
                raise ValueError(f"distributed.heterogeneous.split has {len(het.split)} shares for "
                                 f"resources.slots_per_trial {world} workers; give one share per rank or `auto`")
            if self.global_batch_size < 2 * world:
                raise ValueError(f"distributed.heterogeneous needs hyperparameters.global_batch_size "
                                 f"({self.global_batch_size}) of at least 2 records per rank ({2 * world})")
        return self

    @model_validator(mode="after")
    def _large_batch_rate(self) -> ExperimentConfig:
        lb = self.large_batch
        if lb.optimizer == "trial":
            return self
        decay = self.hyperparameters.get("weight_decay", 0.0)
        if lb.weight_decay is None and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or decay < 0):
            raise ValueError(f"hyperparameters.weight_decay ({decay!r}) is the weight decay of large_batch.optimizer "
                             f"`{lb.optimizer}` and must be a number >= 0; fix it or set large_batch.weight_decay")
        if lb.base_lr is not None:
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
    """Return the constant a hyperparameter stands for; a search space needs a search (dtrain.search runs it)."""
    if isinstance(spec, Mapping) and "type" in spec:
        kind = spec["type"]
        if kind == "const":
            if "val" not in spec:
                raise ValueError(f"hyperparameters.{name} has `type: const` without `val`; add e.g. `val: 0.1`")
            return spec["val"]
        raise ValueError(f"hyperparameters.{name} has `type: {kind}`, a search space, but searcher `single` trains "
                         "one trial: set searcher.name to random, grid, adaptive_asha or optuna to search it "
                         f"(`dtrain preview` shows the plan), or give a constant, e.g. `{name.split('.')[-1]}: 0.1`")
    if isinstance(spec, Mapping):
        return {key: _constant_hparam(f"{name}.{key}", value) for key, value in spec.items()}
    return spec
