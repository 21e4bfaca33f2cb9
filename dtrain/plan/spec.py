"""What the performance model is told: the model, one device's compute, the cluster's links and the
synchronization strategy. Plain frozen dataclasses in SI units with the unit in every name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from dtrain.plan.units import BYTES_PER_FP32, MIB

# Backward costs about twice the forward (one matmul for the input gradient, one for the weight gradient),
# so it is 2/3 of a training step's FLOPs: the "6N FLOPs per token" rule of Kaplan et al. 2020
# (arXiv:2001.08361) that nanoGPT's estimate_mfu uses.
BACKWARD_FRACTION_OF_COMPUTE = 2 / 3
TRAINING_FLOPS_PER_FORWARD_MAC = 6  # 2 FLOPs per multiply-accumulate, times 3 for forward + backward

FLAT_ALGORITHMS = ("ring", "tree", "halving_doubling")
ALGORITHMS = (*FLAT_ALGORITHMS, "hierarchical", "parameter_server")


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: how many bytes of gradient a step all-reduces, how much work a sample is."""

    name: str
    parameters: int
    training_flops_per_sample: float | None = None  # forward + backward
    bytes_per_parameter: int = BYTES_PER_FP32
    source: str = ""
    # sizes of the gradients in the order backward produces them (reverse of model.parameters()), when the
    # model was measured; they give DDP's real buckets instead of an even split
    parameter_bytes_in_backward_order: tuple[int, ...] | None = None

    @property
    def gradient_bytes(self) -> float:
        if self.parameter_bytes_in_backward_order:
            return float(sum(self.parameter_bytes_in_backward_order))
        return float(self.parameters * self.bytes_per_parameter)


@dataclass(frozen=True)
class ComputeSpec:
    """One device's speed: seconds of forward + backward per sample, plus a fixed cost per step (optimizer
    update, framework overhead) that does not shrink with the batch."""

    seconds_per_sample: float
    backward_fraction: float = BACKWARD_FRACTION_OF_COMPUTE
    step_overhead_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.seconds_per_sample > 0:
            raise ValueError(f"seconds_per_sample must be > 0, got {self.seconds_per_sample}")
        if not 0 <= self.backward_fraction <= 1:
            raise ValueError(f"backward_fraction must be in [0, 1], got {self.backward_fraction}")

    @classmethod
    def from_samples_per_second(cls, samples_per_s: float, **kwargs: Any) -> ComputeSpec:
        return cls(seconds_per_sample=1.0 / samples_per_s, **kwargs)

    @classmethod
    def from_flops(cls, model: ModelSpec, device_flops_per_s: float, utilization: float, **kwargs: Any
                   ) -> ComputeSpec:
        """Seconds per sample = training FLOPs / (peak FLOP/s * achieved fraction), as in nanoGPT's estimate_mfu."""
        if model.training_flops_per_sample is None:
            raise ValueError(f"model {model.name} has no FLOPs per sample; give samples per second instead")
        return cls(seconds_per_sample=model.training_flops_per_sample / (device_flops_per_s * utilization),
                   **kwargs)

    def batch_seconds(self, per_device_batch: int) -> float:
        """Forward + backward of one device's batch, and the fixed per-step cost."""
        return per_device_batch * self.seconds_per_sample + self.step_overhead_s

    def backward_seconds(self, per_device_batch: int) -> float:
        return per_device_batch * self.seconds_per_sample * self.backward_fraction


@dataclass(frozen=True)
class HostCost:
    """CPU time a collective costs each rank's host (copies, socket calls, reductions), in the ring's
    alpha-beta form. It matters when the workers ARE the host's cores: that time is taken from compute and
    cannot hide behind backward. Zero for accelerators whose NIC/DMA moves the data."""

    latency_s: float = 0.0
    seconds_per_byte: float = 0.0

    @property
    def is_zero(self) -> bool:
        return self.latency_s == 0 and self.seconds_per_byte == 0


@dataclass(frozen=True)
class TopologySpec:
    """Devices grouped in nodes; one link class inside a node, one between nodes.

    `shared_medium`: the links are one queue that every rank and both directions share (a hub, or the
    rate-limited loopback of benchmarks/netem.py) instead of full-duplex point-to-point links."""

    devices_per_node: int = 1
    intra_bandwidth_bytes_per_s: float = math.inf
    intra_latency_s: float = 0.0
    inter_bandwidth_bytes_per_s: float = math.inf
    inter_latency_s: float = 0.0
    shared_medium: bool = False
    host: HostCost = field(default_factory=HostCost)
    source: str = ""

    def __post_init__(self) -> None:
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")
        for name in ("intra_bandwidth_bytes_per_s", "inter_bandwidth_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def nodes(self, devices: int) -> int:
        return math.ceil(devices / self.devices_per_node)

    def devices_in_a_node(self, devices: int) -> int:
        return min(devices, self.devices_per_node)


@dataclass(frozen=True)
class StrategySpec:
    """How gradients are synchronized.

    `compression_ratio`: bytes sent / bytes of fp32 gradient (0.5 for fp16). `compression_host_seconds_per_byte`:
    CPU time to encode and decode, per byte of uncompressed gradient. `bucket_bytes`: DDP's gradient buckets
    (25 MiB; Horovod fuses up to 64 MB). `first_bucket_bytes`: the bucket backward fills first; torch DDP caps
    it at 1 MiB only when `bucket_cap_mb` is left unset (torch/nn/parallel/distributed.py,
    _BucketCapacityConfig.create); dtrain passes [first_bucket_mb, bucket size] (default 1 MiB) as DDP's
    per-bucket caps. None here means a full first bucket."""

    algorithm: str = "ring"
    inter_node_algorithm: str = "ring"  # between the nodes of a hierarchical all-reduce
    servers: int = 1
    server_bandwidth_bytes_per_s: float | None = None  # parameter servers' NICs; default: the inter-node link
    compression_ratio: float = 1.0
    compression_host_seconds_per_byte: float = 0.0
    overlap: bool = True
    aggregation_frequency: int = 1
    bucket_bytes: float = 25 * MIB
    first_bucket_bytes: float | None = None  # None: the same as bucket_bytes

    @property
    def first_bucket_cap_bytes(self) -> float:
        return self.first_bucket_bytes if self.first_bucket_bytes is not None else self.bucket_bytes

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.inter_node_algorithm not in FLAT_ALGORITHMS:
            raise ValueError(f"inter_node_algorithm must be one of {', '.join(FLAT_ALGORITHMS)}, "
                             f"got {self.inter_node_algorithm!r}")
        if not 0 < self.compression_ratio <= 1:
            raise ValueError(f"compression_ratio must be in (0, 1], got {self.compression_ratio}")
        if self.aggregation_frequency < 1:
            raise ValueError(f"aggregation_frequency must be >= 1, got {self.aggregation_frequency}")
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")
        if self.bucket_bytes <= 0 or (self.first_bucket_bytes is not None and self.first_bucket_bytes <= 0):
            raise ValueError("bucket sizes must be > 0")

    def with_(self, **changes: Any) -> StrategySpec:
        return replace(self, **changes)


__all__ = ["ALGORITHMS", "BACKWARD_FRACTION_OF_COMPUTE", "FLAT_ALGORITHMS", "TRAINING_FLOPS_PER_FORWARD_MAC",
           "ComputeSpec", "HostCost", "ModelSpec", "StrategySpec", "TopologySpec"]
