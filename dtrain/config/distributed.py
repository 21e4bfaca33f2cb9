"""Sections on how the workers keep their replicas consistent: Determined's `optimizations` (accumulation,
fusion buckets) and dtrain's `distributed` (reduction op, compression, uneven batches; each strategy's own
section is in `strategies.py`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtrain.config.base import DETERMINED_ONLY, Section, picked_by
from dtrain.config.compression import Compression, NoCompressionConfig
from dtrain.config.names import PrecisionName, ReduceOp
from dtrain.config.strategies import StrategySections

DEFAULT_MALLOC_TRIM_THRESHOLD_MB = 256  # glibc keeps this much freed memory in each worker (dtrain run, horovodrun)


class Optimizations(Section):
    """Gradient accumulation and fusion (Determined's `optimizations`), the memory layout of batches, and how
    workers keep freed host memory."""

    aggregation_frequency: int = Field(
        default=1, ge=1, description="k: accumulate k batches locally (DDP `no_sync`) and communicate on the k-th; "
        "the update equals one batch k times as big")
    max_per_slot_batch: int | None = Field(
        default=None, ge=1, description="the most records a slot trains in one forward/backward pass: a larger "
        "per-slot batch (a run resumed on fewer slots, an uneven split) is trained in as many near-equal passes as "
        "it needs, their gradients accumulated locally before the one update, which stays the whole batch's; may "
        "change when a run resumes; unset: one pass")
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
        "all-reduce starts while backward goes on (passed to DDP as `bucket_cap_mb_list=[first, size]` where torch "
        "takes it; an older torch keeps its fixed 1 MiB first bucket)")
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




class Heterogeneous(Section):
    """Per-rank batch sizes for workers of different speed: the global batch stays fixed and each rank's
    gradient is weighted by its share (the loss-scaling contract), so the update is the full-batch gradient."""

    split: Literal["auto"] | list[float] = Field(
        default="auto", description="`auto`: measured per rank, calibrated in the first `calibrate_steps` and "
        "re-balanced every `rebalance_every` toward the split where all ranks finish together (first in "
        "proportion to records/s, then from each rank's time per batch fitted as fixed + per-record cost); or one "
        "positive share per rank "
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


class Distributed(StrategySections):
    """How replicas stay consistent: the strategy, how gradients are combined, compression, timeouts."""

    op: ReduceOp = Field(default="average", description="how gradients are combined: `average` (the full-batch "
                         "gradient), `sum`, `adasum` (Adasum; takes no compression)")
    compression: Compression = Field(
        default_factory=NoCompressionConfig, description="gradient compression (strategy `allreduce`): a "
        "compressor between each gradient bucket and the wire, picked by `name`, with its own options (a bare name, "
        "`compression: fp16`, is short for `{name: fp16}`)")
    backend: Literal["auto", "gloo", "nccl"] = Field(default="auto", description="`auto`: gloo on CPU, nccl when "
                                                                                 "CUDA is present")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="where each worker trains: `auto`: a GPU with backend nccl, the CPU with gloo; "
        "`cuda`: GPU number local rank mod the GPUs visible, with nccl or gloo (gloo carries CUDA tensors too, and "
        "lets several workers share one GPU, which NCCL refuses); `cpu`. Checked before any worker starts")
    timeout_seconds: float = Field(
        default=600.0, gt=0, description="collective timeout: a collective that waits longer fails with one error "
        "naming the ranks that did not arrive, the step and what each was doing")
    stall_warning_seconds: float = Field(
        default=60.0, gt=0, description="a rank that has waited this long logs which ranks have not arrived and "
        "what each was last doing (heartbeats through the rendezvous store)")
    find_unused_parameters: bool = Field(
        default=False, description="set true for models whose forward pass skips parameters in some steps or on "
        "some ranks; without it such a step stops at once with one line naming them")
    heterogeneous: Heterogeneous | None = Field(
        default=None, description="per-rank batch sizes for workers of different speed (unset: an even split)")
    network_interface: str | None = Field(
        default=None, description="the network interface gloo uses between nodes (GLOO_SOCKET_IFNAME); unset: the "
        "one that routes to the master address (`lo` on one machine)")

    @field_validator("compression", mode="before")
    @classmethod
    def _compressor_by_name(cls, value: Any) -> Any:
        return picked_by(value, "name", "none")

    @model_validator(mode="after")
    def _device_fits_backend(self) -> Distributed:
        if self.device == "cpu" and self.backend == "nccl":
            raise ValueError("distributed.device 'cpu' with distributed.backend 'nccl': NCCL carries CUDA tensors "
                             "only; set backend gloo (or auto), or device cuda")
        return self
