"""Sections on how the workers keep their replicas consistent: Determined's `optimizations` (accumulation,
fusion buckets) and dtrain's `distributed` (strategy, reduction op, compression, parameter servers)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtrain.config.base import DETERMINED_ONLY, Section, picked_by
from dtrain.config.compression import Compression, NoCompressionConfig
from dtrain.config.names import (
    ParameterServerMode,
    PipelineScheduleName,
    PrecisionName,
    ReduceOp,
    StrategyName,
)

DEFAULT_MALLOC_TRIM_THRESHOLD_MB = 256  # glibc keeps this much freed memory in each worker (dtrain run, horovodrun)


class Optimizations(Section):
    """Gradient accumulation and fusion (Determined's `optimizations`), the memory layout of batches, and how
    workers keep freed host memory."""

    aggregation_frequency: int = Field(
        default=1, ge=1, description="k: accumulate k batches locally (DDP `no_sync`) and communicate on the k-th; "
        "the update equals one batch k times as big")
    average_aggregated_gradients: bool = Field(
        default=True, description="divide the accumulated gradient by k (false: their sum, as Horovod's "
        "`backward_passes_per_step`)")
    average_training_metrics: bool = Field(default=True, description=DETERMINED_ONLY)
    gradient_compression: bool = Field(
        default=False, description="true means `distributed.compression.name: fp16` (Determined's flag); with "
        "another compressor named it is an error")
    mixed_precision: Literal["O0", "O1", "O2", "O3"] = Field(
        default="O0", description="mixed-precision level (Determined's, after Apex); O0 is full precision, O1 and O2 "
        "run as `precision: fp16`")
    precision: PrecisionName = Field(
        default="fp32", description="`bf16` or `fp16`: forward under torch.autocast (fp16 with a loss scaler whose "
        "overflow verdict all ranks share); weights, gradients and their reduction stay fp32")
    activation_checkpointing: list[str] = Field(
        default_factory=list, description="class names of the model's blocks whose activations are recomputed in "
        "backward instead of kept (torch.utils.checkpoint), e.g. `[TransformerBlock]`")
    tensor_fusion_threshold: float = Field(default=25.0, gt=0, description="gradient bucket size in MB (DDP's "
                                                                           "`bucket_cap_mb`)")
    first_bucket_mb: float = Field(
        default=1.0, gt=0, description="cap of the first bucket (the last layers' gradients), as DDP's default: its "
        "all-reduce starts while backward goes on (passed to DDP as `bucket_cap_mb_list=[first, size]`)")
    auto_tune_tensor_fusion: bool = Field(default=False, description="try bucket sizes during the first steps, "
                                                                     "keep the fastest")
    memory_format: Literal["contiguous", "channels_last"] = Field(
        default="contiguous", description="layout of 4-D floating input batches and of the model: `channels_last` "
        "(NHWC) gives faster convolutions on CPUs (oneDNN) and on tensor cores")
    malloc_trim_threshold_mb: int | None = Field(
        default=DEFAULT_MALLOC_TRIM_THRESHOLD_MB, ge=0, description="host memory each worker keeps when it frees "
        "it, for the next step to reuse, instead of giving it back to the OS and page-faulting it in again (glibc's "
        "M_TRIM_THRESHOLD; blocks under 32 MB then come from the heap, M_MMAP_THRESHOLD); null keeps glibc's "
        "adaptive defaults, and so do workers started with MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ or "
        "GLIBC_TUNABLES set")


class ParameterServer(Section):
    """Server processes beside the workers, and how they apply gradients (strategy `parameter_server`)."""

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


class LocalSGD(Section):
    """Settings of strategy `local_sgd`: each rank steps on its own gradients and the replicas are averaged every
    `period` updates (local SGD), after `warmup_steps` synchronous ones (post-local SGD), optionally with the
    gradients averaged inside each node every update (hierarchical periods), or through an outer optimizer on
    the averaged pseudo-gradient (DiLoCo)."""

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


class Heterogeneous(Section):
    """Per-rank batch sizes for workers of different speed: the global batch stays fixed and each rank's
    gradient is weighted by its share (the loss-scaling contract), so the update is the full-batch gradient."""

    split: Literal["auto"] | list[float] = Field(
        default="auto", description="`auto`: shares proportional to each rank's measured records/s, calibrated in "
        "the first `calibrate_steps` and re-balanced every `rebalance_every`; or one positive share per rank "
        "(e.g. [3, 1]), scaled to the global batch")
    calibrate_steps: int = Field(default=10, ge=2, description="auto: updates measured (even split) before the "
                                 "first re-balance")
    rebalance_every: int = Field(default=100, ge=1, description="auto: updates between later re-balances")
    tolerance: float = Field(default=0.1, ge=0, description="auto: re-balance only when some rank's batch would "
                             "change by more than this fraction")

    @model_validator(mode="after")
    def _positive_shares(self) -> Heterogeneous:
        if isinstance(self.split, list) and (not self.split or any(share <= 0 for share in self.split)):
            raise ValueError(f"distributed.heterogeneous.split {self.split} must be `auto` or one positive share "
                             "per rank, e.g. [3, 1]")
        return self


class Pipeline(Section):
    """Pipeline parallelism (strategy `pipeline`): the model cut into stages, each batch into microbatches."""

    stages: int = Field(default=2, ge=2, description="p: pipeline stages, one rank each; slots_per_trial / p "
                                                     "replicas of the pipeline train data-parallel")
    microbatches: int = Field(default=4, ge=1, description="m: microbatches each replica's batch is split into "
                                                           "(bubble (p-1)/(m+p-1))")
    schedule: PipelineScheduleName = Field(default="gpipe", description="`gpipe` (all forwards, then all "
                                           "backwards) or `1f1b` (one forward, one backward)")
    split_points: list[str] = Field(
        default_factory=list, description="names of the model's top-level children where stages 2..p begin (p-1 "
        "names); empty: the Trial's `pipeline_stages(model)` hook, else equal numbers of children")
    receives: Literal["on_demand", "ahead"] = Field(
        default="on_demand", description="`on_demand`: torch's schedules, each receive posted just before it is "
        "waited for; `ahead`: each stage posts all its receives of a step when the step starts, so a hand-off is "
        "written as soon as it is sent (gloo)")


class Fsdp(Section):
    """Fully sharded data parallelism (strategy `fsdp`, torch's FSDP2 `fully_shard`)."""

    reshard_after_forward: bool = Field(default=True, description="free the gathered parameters after forward "
                                        "and gather them again in backward (less memory, one more all-gather)")


class Distributed(Section):
    """How replicas stay consistent: the strategy, how gradients are combined, compression, timeouts."""

    strategy: StrategyName = Field(default="allreduce", description="how replicas stay consistent: `allreduce` "
                                   "(torch DDP; dtrain's comm hook for op `sum`, `adasum` and compression), "
                                   "`parameter_server` (server processes hold the parameters), `local_sgd` "
                                   "(periodic averaging, post-local SGD, DiLoCo), `hierarchical` (all-reduce "
                                   "inside each node, then between nodes), `zero1` (DDP with the optimizer state "
                                   "sharded), `fsdp` (parameters, gradients and optimizer state sharded) or "
                                   "`pipeline` (stages x data replicas)")
    parameter_server: ParameterServer = Field(default_factory=ParameterServer,
                                              description="settings of strategy `parameter_server`")
    pipeline: Pipeline = Field(default_factory=Pipeline, description="settings of strategy `pipeline`")
    fsdp: Fsdp = Field(default_factory=Fsdp, description="settings of strategy `fsdp`")
    op: ReduceOp = Field(default="average", description="how gradients are combined: `average` (the full-batch "
                         "gradient), `sum`, `adasum` (Adasum; takes no compression)")
    compression: Compression = Field(
        default_factory=NoCompressionConfig, description="gradient compression (strategy `allreduce`): a "
        "compressor between each gradient bucket and the wire, picked by `name`, with its own options (a bare name, "
        "`compression: fp16`, is short for `{name: fp16}`)")
    backend: Literal["auto", "gloo", "nccl"] = Field(default="auto", description="`auto`: gloo on CPU, nccl when "
                                                                                 "CUDA is present")
    timeout_seconds: float = Field(
        default=600.0, gt=0, description="collective timeout: a collective that waits longer fails with one error "
        "naming the ranks that did not arrive, the step and what each was doing")
    stall_warning_seconds: float = Field(
        default=60.0, gt=0, description="a rank that has waited this long logs which ranks have not arrived and "
        "what each was last doing (heartbeats through the rendezvous store)")
    find_unused_parameters: bool = Field(
        default=False, description="set true for models whose forward pass skips parameters in some steps or on "
        "some ranks; without it such a step stops at once with one line naming them")
    local_sgd: LocalSGD = Field(default_factory=LocalSGD, description="settings of strategy `local_sgd`")
    heterogeneous: Heterogeneous | None = Field(
        default=None, description="per-rank batch sizes for workers of different speed (unset: an even split)")
    network_interface: str | None = Field(
        default=None, description="the network interface gloo uses between nodes (GLOO_SOCKET_IFNAME); unset: the "
        "one that routes to the master address (`lo` on one machine)")

    @field_validator("compression", mode="before")
    @classmethod
    def _compressor_by_name(cls, value: Any) -> Any:
        return picked_by(value, "name", "none")
