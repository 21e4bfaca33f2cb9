"""Each strategy's config section and its cross-field rules, side by side: `distributed.<strategy>` is a section
whose class says what the strategy takes from the rest of the file (which ops, compression, fp16, uneven
batches) and checks the rest in `check()`. The config checks ask the section of the strategy named instead of
testing names, and the sections are found by the strategy's name (`StrategySections.section_of`).

Config sits below `sync/` (docs/architecture.md), so the rules live here, low enough for the loader; a
strategy's code registers its builder, summary line and server processes in `dtrain/sync/` (`StrategySpec`).
Tests tie the two: every name of `StrategyName` has a section here and a spec there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from dtrain.config.base import Section
from dtrain.config.names import DEFAULT_STRATEGY, ParameterServerMode, PipelineScheduleName, ReduceOp, StrategyName

ALL_OPS: tuple[ReduceOp, ...] = ("average", "sum", "adasum")


@dataclass(frozen=True)
class RunShape:
    """What a strategy's rules read from the rest of the experiment file, taken out of it by value so that the
    sections below need not know the whole file (which holds them)."""

    world_size: int  # resources.slots_per_trial
    global_batch_size: object  # hyperparameters.global_batch_size as written (an int when it is one)
    aggregation_frequency: int  # optimizations.aggregation_frequency
    batch_size_schedule: bool  # large_batch.batch_size_schedule is set
    passes: bool = False  # optimizations.max_per_slot_batch is set: a slot's batch may take several passes


class StrategySection(Section):
    """A strategy's settings (`distributed.<name>`) and what it accepts from the rest of the file. The class
    variables are read by value by the config checks and by diagnose; `check()` holds the strategy's own rules."""

    ops: ClassVar[tuple[ReduceOp, ...]] = ("average",)  # distributed.op values it combines gradients with
    compresses: ClassVar[bool] = False  # takes distributed.compression
    fp16: ClassVar[bool] = True  # all ranks share the fp16 loss scaler's verdict at every step
    uneven_batches: ClassVar[bool] = True  # takes distributed.heterogeneous (per-rank batch shares)

    def model_parallel_size(self) -> int:
        """Ranks that share one data replica's batches (a pipeline's stages); 1 for data parallelism."""
        return 1

    def accumulating_overrides(self) -> tuple[str, ...]:
        """`--set` overrides under which the strategy accepts optimizations.aggregation_frequency > 1 (diagnose's
        no-communication trial); none when it always does."""
        return ()

    def single_slot_overrides(self) -> tuple[str, ...]:
        """`--set` overrides that make the strategy run on one slot (diagnose's one-slot trial), where the one
        process trains one data replica's batch; none when the strategy runs on one slot as configured."""
        return ()

    def check(self, shape: RunShape) -> None:
        """Raise ValueError (one line: value, rule, fix) for a setting elsewhere in the file this strategy cannot
        run with; the shared rules (ops, compression, fp16, uneven batches) are checked before, from the class
        variables."""


class AllReduce(StrategySection):
    """Strategy `allreduce` (torch DDP, with dtrain's comm hook for op `sum`, `adasum` and compression): no
    settings of its own; `distributed.compression` and `optimizations` configure it."""

    ops: ClassVar[tuple[ReduceOp, ...]] = ALL_OPS
    compresses: ClassVar[bool] = True


class Hierarchical(StrategySection):
    """Strategy `hierarchical` (all-reduce inside each node, then between nodes): no settings of its own."""


class Zero1(StrategySection):
    """Strategy `zero1` (DDP with the optimizer state sharded over the ranks): no settings of its own."""



class ParameterServer(StrategySection):
    """Server processes beside the workers, and how they apply gradients (strategy `parameter_server`)."""

    fp16: ClassVar[bool] = False
    uneven_batches: ClassVar[bool] = False

    servers: int = Field(default=1, ge=1, description="server processes started beside the workers (the last "
                                                      "ranks); parameters are sharded over them by bytes")
    mode: ParameterServerMode = Field(
        default="sync", description="`sync` (wait for all, apply the mean), `async` (apply each gradient when it "
        "arrives), `ssp` (async within a staleness bound)")
    staleness: int = Field(default=4, ge=0, description="ssp: a worker may be at most this many steps ahead of the "
                                                        "slowest")
    backup_workers: int = Field(default=0, ge=0, description="sync: each update uses the first W-b gradients; late "
                                                             "ones are dropped and counted")
    staleness_lr: bool = Field(default=False, description="apply a gradient of staleness t > 1 with the rate "
                                                          "divided by t")

    @model_validator(mode="after")
    def _backup_for_sync(self) -> ParameterServer:
        if self.backup_workers and self.mode != "sync":
            raise ValueError(f"distributed.parameter_server.backup_workers ({self.backup_workers}) applies to mode "
                             f"`sync` only (mode `{self.mode}` never waits for all workers); remove it or set "
                             "`mode: sync`")
        return self

    def accumulating_overrides(self) -> tuple[str, ...]:
        """Only sync mode without backup workers accepts k > 1; with almost no updates the mode makes no
        difference."""
        if self.mode == "sync" and not self.backup_workers:
            return ()
        return ("distributed.parameter_server.mode=sync", "distributed.parameter_server.backup_workers=0")

    def check(self, shape: RunShape) -> None:
        world = shape.world_size
        if self.backup_workers >= world:
            raise ValueError(f"distributed.parameter_server.backup_workers ({self.backup_workers}) must be below "
                             f"resources.slots_per_trial ({world}): each update needs at least one gradient; use "
                             f"0..{world - 1}")
        if (self.mode != "sync" or self.backup_workers) and (shape.aggregation_frequency > 1 or shape.passes
                                                             or shape.batch_size_schedule):
            how = f"mode `{self.mode}`" if self.mode != "sync" else "backup_workers"
            raise ValueError(f"distributed.parameter_server {how} lets workers run different numbers of batches, so "
                             "optimizations.aggregation_frequency, max_per_slot_batch and "
                             "large_batch.batch_size_schedule do not apply; remove them or use `mode: sync` without "
                             "backup workers")


class LocalSGD(StrategySection):
    """Settings of strategy `local_sgd`: each rank steps on its own gradients and the replicas are averaged every
    `period` updates (local SGD), after `warmup_steps` synchronous ones (post-local SGD), optionally with the
    gradients averaged inside each node every update (hierarchical periods), or through an outer optimizer on
    the averaged pseudo-gradient (DiLoCo)."""

    compresses: ClassVar[bool] = True

    period: int = Field(default=8, ge=1, description="H: average the replicas every H local updates")
    warmup_steps: int = Field(default=0, ge=0, description="post-local SGD: the first updates are synchronous "
                              "(gradients all-reduced every update) and local SGD starts after this many")
    node_sync: bool = Field(default=False, description="hierarchical periods: during local SGD, average gradients "
                            "inside each node every update and across nodes only every `period`")
    average_buffers: bool = Field(default=True, description="average floating buffers (batch-norm statistics) at "
                                  "each averaging round too")
    outer_optimizer: Literal["none", "sgd", "nesterov"] = Field(
        default="none", description="`none`: plain averaging; `sgd`/`nesterov`: DiLoCo, an outer SGD step on the "
        "averaged pseudo-gradient (parameters at the last round - local parameters)")
    outer_lr: float = Field(default=0.7, gt=0, description="DiLoCo's outer learning rate")
    outer_momentum: float = Field(default=0.9, ge=0, lt=1, description="DiLoCo's outer momentum")


class Pipeline(StrategySection):
    """Pipeline parallelism (strategy `pipeline`): the model cut into stages, each batch into microbatches."""

    uneven_batches: ClassVar[bool] = False

    stages: int = Field(default=2, ge=2, description="p: pipeline stages, one rank each; slots_per_trial / p "
                                                     "replicas of the pipeline train data-parallel")
    microbatches: int = Field(default=4, ge=1, description="m: microbatches each replica's batch is split into "
                                                           "(bubble (p-1)/(m+p-1))")
    schedule: PipelineScheduleName = Field(default="gpipe", description="`gpipe` (all forwards, then all "
                                           "backwards) or `1f1b` (one forward, one backward)")
    split_points: list[str] = Field(
        default_factory=list, description="names of the model's top-level children where stages 2..p begin (p-1 "
        "names); empty: the model's own `pipeline_stages(p)` method when it has one, else equal numbers of children")
    receives: Literal["on_demand", "ahead"] = Field(
        default="on_demand", description="`on_demand`: torch's schedules, each receive posted just before it is "
        "waited for; `ahead`: each stage posts all its receives of a step when the step starts, so a hand-off is "
        "written as soon as it is sent (gloo)")

    def model_parallel_size(self) -> int:
        return self.stages

    def single_slot_overrides(self) -> tuple[str, ...]:
        """One slot holds the whole model: the default strategy trains one pipeline replica's batch."""
        return (f"distributed.strategy={default_strategy()}",)

    def check(self, shape: RunShape) -> None:
        slots, gbs = shape.world_size, shape.global_batch_size
        if slots % self.stages:
            raise ValueError(f"distributed.pipeline.stages ({self.stages}) must divide resources.slots_per_trial "
                             f"({slots}): each pipeline replica needs {self.stages} slots; use slots_per_trial "
                             f"{max(self.stages, slots - slots % self.stages)} or stages that divide {slots}")
        replicas = slots // self.stages
        if isinstance(gbs, int) and gbs % (replicas * self.microbatches):
            raise ValueError(f"hyperparameters.global_batch_size ({gbs}) must split into {replicas} pipeline "
                             f"replica(s) x {self.microbatches} microbatches of equal size; use a multiple of "
                             f"{replicas * self.microbatches}")
        if self.split_points and len(self.split_points) != self.stages - 1:
            raise ValueError(f"distributed.pipeline.split_points names {len(self.split_points)} cut(s) "
                             f"({', '.join(self.split_points)}) for {self.stages} stages; name stages - 1 = "
                             f"{self.stages - 1}")
        if shape.passes:
            raise ValueError("optimizations.max_per_slot_batch with strategy pipeline: raise "
                             "distributed.pipeline.microbatches instead (a replica's batch already runs in "
                             "microbatches)")
        if shape.aggregation_frequency != 1:
            raise ValueError("optimizations.aggregation_frequency > 1 with strategy pipeline: raise "
                             "distributed.pipeline.microbatches instead (microbatches already accumulate gradients)")


class Fsdp(StrategySection):
    """Fully sharded data parallelism (strategy `fsdp`, torch's FSDP2 `fully_shard`)."""


    reshard_after_forward: bool = Field(default=True, description="free the gathered parameters after forward "
                                        "and gather them again in backward (less memory, one more all-gather)")


class Hsdp(StrategySection):
    """Hybrid sharding (strategy `hsdp`, FSDP2 over a 2-D mesh): each group of `shard_size` ranks holds one
    replica sharded as `fsdp` shards over all ranks, and the groups are replicas of each other, so all-gathers
    stay inside a group (a node) and only gradient shards are all-reduced between groups."""

    shard_size: int | None = Field(default=None, ge=1, description="ranks one replica is sharded over (a group "
                                   "of consecutive ranks); unset: the ranks of one node")
    reshard_after_forward: bool = Field(default=True, description="free the gathered parameters after forward "
                                        "and gather them again in backward (less memory, one more all-gather)")

    def single_slot_overrides(self) -> tuple[str, ...]:
        """One slot is one group of one rank."""
        return ("distributed.hsdp.shard_size=null",) if self.shard_size else ()

    def check(self, shape: RunShape) -> None:
        world = shape.world_size
        if self.shard_size is not None and world % self.shard_size:
            raise ValueError(f"distributed.hsdp.shard_size ({self.shard_size}) must divide "
                             f"resources.slots_per_trial ({world}) into equal shard groups; use a divisor of {world}, "
                             "or leave it unset to shard over the ranks of one node")


class StrategySections(Section):
    """The strategy named and one section per strategy, each under the strategy's name (the base of the
    `distributed` section)."""

    strategy: StrategyName = Field(default=DEFAULT_STRATEGY, description="how replicas stay consistent: `allreduce` "
                                   "(torch DDP; dtrain's comm hook for op `sum`, `adasum` and compression), "
                                   "`parameter_server` (server processes hold the parameters), `local_sgd` "
                                   "(periodic averaging, post-local SGD, DiLoCo), `hierarchical` (all-reduce "
                                   "inside each node, then between nodes), `zero1` (DDP with the optimizer state "
                                   "sharded), `fsdp` (parameters, gradients and optimizer state sharded), "
                                   "`pipeline` (stages x data replicas) or `hsdp` (sharded as fsdp inside each "
                                   "node, replicated across nodes)")
    allreduce: AllReduce = Field(default_factory=AllReduce, description="settings of strategy `allreduce` (none)")
    parameter_server: ParameterServer = Field(default_factory=ParameterServer,
                                              description="settings of strategy `parameter_server`")
    local_sgd: LocalSGD = Field(default_factory=LocalSGD, description="settings of strategy `local_sgd`")
    hierarchical: Hierarchical = Field(default_factory=Hierarchical,
                                       description="settings of strategy `hierarchical` (none)")
    zero1: Zero1 = Field(default_factory=Zero1, description="settings of strategy `zero1` (none)")
    fsdp: Fsdp = Field(default_factory=Fsdp, description="settings of strategy `fsdp`")
    pipeline: Pipeline = Field(default_factory=Pipeline, description="settings of strategy `pipeline`")
    hsdp: Hsdp = Field(default_factory=Hsdp, description="settings of strategy `hsdp`")

    @property
    def chosen(self) -> StrategySection:
        """The section of the strategy named: its settings and its rules."""
        return self.section_of(self.strategy)

    def section_of(self, name: str) -> StrategySection:
        section = getattr(self, name)
        assert isinstance(section, StrategySection), name
        return section


def strategy_names() -> tuple[str, ...]:
    """Every strategy that has a section, in the order of the sections."""
    return tuple(name for name, field in StrategySections.model_fields.items()
                 if isinstance(field.annotation, type) and issubclass(field.annotation, StrategySection))


def strategies_where(test: Callable[[type[StrategySection]], bool]) -> list[str]:
    """The strategies whose section class passes `test` (for messages that say which strategies take a setting)."""
    return [name for name in strategy_names() if test(_section_class(name))]


def _section_class(name: str) -> type[StrategySection]:
    annotation = StrategySections.model_fields[name].annotation
    assert isinstance(annotation, type) and issubclass(annotation, StrategySection), name
    return annotation


def default_strategy() -> str:
    """The strategy a file that names none runs (and the one a single slot runs a pipeline's batch with)."""
    return DEFAULT_STRATEGY

