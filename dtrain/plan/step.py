"""Predict one training step of synchronous data parallelism: compute, the communication that does not
hide behind backward, throughput, scaling efficiency against one device, and the bottleneck.

    step = forward + backward + overhead + exposed communication / aggregation_frequency

Efficiency is weak scaling, as Goyal et al. and Horovod report it: throughput of n devices over n times
the throughput of one device running the same per-device batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dtrain.plan import collectives as cc
from dtrain.plan.overlap import (
    BucketCost,
    bucket_sizes_bytes,
    ddp_bucket_sizes_bytes,
    exposed_after_backward_s,
    uniform_ready_times_s,
)
from dtrain.plan.spec import ComputeSpec, ModelSpec, StrategySpec, TopologySpec

# Communication that adds less than this share to a step leaves compute as the bottleneck.
COMPUTE_BOUND_SHARE = 0.10


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one configuration (times in seconds, per batch)."""

    devices: int
    nodes: int
    per_device_batch: int
    global_batch: int
    compute_s: float
    communication_s: float  # all collectives of a communicating step, end to end, as if nothing overlapped
    exposed_communication_s: float  # per batch, after overlap and aggregation
    step_s: float
    samples_per_s: float
    scaling_efficiency: float
    bottleneck: str
    communication_parts_s: dict[str, float] = field(default_factory=dict)  # per communicating step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _link(topology: TopologySpec, devices: int) -> tuple[str, float, float]:
    """The link a flat collective is bound by: between nodes once there are several, else inside the node."""
    if topology.nodes(devices) > 1:
        return ("inter-node", min(topology.inter_bandwidth_bytes_per_s, topology.intra_bandwidth_bytes_per_s),
                max(topology.inter_latency_s, topology.intra_latency_s))
    return "intra-node", topology.intra_bandwidth_bytes_per_s, topology.intra_latency_s


def collective_parts_s(message_bytes: float, devices: int, topology: TopologySpec, strategy: StrategySpec
                       ) -> dict[str, float]:
    """The link time of one collective on `message_bytes`, split into named parts (bandwidth and latency of
    each link class), so that the total is their sum and the largest names the bottleneck."""
    if devices <= 1 or message_bytes <= 0:
        return {}
    algorithm = strategy.algorithm
    if algorithm == "parameter_server":
        label, bandwidth, latency = _link(topology, devices)
        server_bw = strategy.server_bandwidth_bytes_per_s or topology.inter_bandwidth_bytes_per_s
        server_s = cc.parameter_server_bytes_per_server(message_bytes, devices, strategy.servers) / server_bw
        worker_s = 2 * message_bytes / bandwidth
        if server_s >= worker_s:
            return {"parameter-server NICs": server_s, f"{label} latency": 2 * latency}
        return {"worker NIC": worker_s, f"{label} latency": 2 * latency}
    if algorithm == "hierarchical" and topology.nodes(devices) > 1:
        local, nodes = topology.devices_in_a_node(devices), topology.nodes(devices)
        parts = {
            "intra-node bandwidth": cc.hierarchical_allreduce_seconds(
                message_bytes, 1, local, topology.intra_bandwidth_bytes_per_s, 0.0, math.inf, 0.0),
            "intra-node latency": cc.hierarchical_allreduce_seconds(
                0.0, 1, local, topology.intra_bandwidth_bytes_per_s, topology.intra_latency_s, math.inf, 0.0),
            "inter-node bandwidth": cc.allreduce_seconds(
                strategy.inter_node_algorithm, message_bytes, nodes, topology.inter_bandwidth_bytes_per_s, 0.0),
            "inter-node latency": (cc.allreduce_latency_steps(strategy.inter_node_algorithm, nodes)
                                   * topology.inter_latency_s),
        }
        return {name: seconds for name, seconds in parts.items() if seconds > 0}
    flat = "ring" if algorithm == "hierarchical" else algorithm
    label, bandwidth, latency = _link(topology, devices)
    if topology.shared_medium:
        bandwidth_s = cc.shared_medium_allreduce_seconds(message_bytes, devices, bandwidth, 0.0, flat)
    else:
        bandwidth_s = cc.allreduce_seconds(flat, message_bytes, devices, bandwidth, 0.0)
    latency_s = cc.allreduce_latency_steps(flat, devices) * latency
    return {f"{label} bandwidth": bandwidth_s, f"{label} latency": latency_s}


def host_seconds(message_bytes: float, devices: int, topology: TopologySpec) -> float:
    """CPU time one rank's host spends on a collective of `message_bytes`, in the ring's form."""
    host = topology.host
    if host.is_zero or devices <= 1:
        return 0.0
    bandwidth = 1.0 / host.seconds_per_byte if host.seconds_per_byte > 0 else math.inf
    return cc.ring_allreduce_seconds(message_bytes, devices, bandwidth, host.latency_s)


def bucket_costs(model: ModelSpec, devices: int, topology: TopologySpec, strategy: StrategySpec
                 ) -> tuple[list[float], list[BucketCost], dict[str, float]]:
    """Bucket sizes (bytes of uncompressed gradient), each bucket's link and host cost, and the summed parts."""
    if model.parameter_bytes_in_backward_order:
        sizes = ddp_bucket_sizes_bytes(model.parameter_bytes_in_backward_order, strategy.bucket_bytes,
                                       strategy.first_bucket_cap_bytes)
    else:
        sizes = bucket_sizes_bytes(model.gradient_bytes, strategy.bucket_bytes, strategy.first_bucket_cap_bytes)
    costs: list[BucketCost] = []
    parts: dict[str, float] = {}
    for size in sizes:
        sent = size * strategy.compression_ratio
        link = collective_parts_s(sent, devices, topology, strategy)
        for name, seconds in link.items():
            parts[name] = parts.get(name, 0.0) + seconds
        host = host_seconds(sent, devices, topology)
        if devices > 1:
            host += size * strategy.compression_host_seconds_per_byte
        if host:
            parts["host CPU (copies, reductions, encoding)"] = parts.get(
                "host CPU (copies, reductions, encoding)", 0.0) + host
        costs.append(BucketCost(link_s=sum(link.values()), host_s=host))
    return sizes, costs, parts


def _bottleneck(compute_s: float, exposed_s: float, step_s: float, parts: dict[str, float]) -> str:
    if exposed_s <= COMPUTE_BOUND_SHARE * step_s or not parts:
        return "compute"
    name = max(parts, key=lambda key: parts[key])
    return f"communication: {name}"


def predict_step(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec, strategy: StrategySpec,
                 devices: int, per_device_batch: int) -> Prediction:
    """The model for one configuration; pure."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if per_device_batch < 1:
        raise ValueError(f"per_device_batch must be >= 1, got {per_device_batch}")
    # the per-step overhead (optimizer update) runs once per synchronization, i.e. every k batches
    compute_s = (per_device_batch * compute.seconds_per_sample
                 + compute.step_overhead_s / strategy.aggregation_frequency)
    backward_s = compute.backward_seconds(per_device_batch)
    sizes, costs, parts = bucket_costs(model, devices, topology, strategy)
    ready = uniform_ready_times_s(sizes, backward_s)
    exposed_per_sync = exposed_after_backward_s(costs, ready, backward_s, strategy.overlap)
    exposed = exposed_per_sync / strategy.aggregation_frequency
    step_s = compute_s + exposed
    global_batch = devices * per_device_batch
    one_device_s = compute_s
    return Prediction(
        devices=devices, nodes=topology.nodes(devices), per_device_batch=per_device_batch,
        global_batch=global_batch, compute_s=compute_s,
        communication_s=sum(cost.duration_s for cost in costs), exposed_communication_s=exposed, step_s=step_s,
        samples_per_s=global_batch / step_s, scaling_efficiency=one_device_s / step_s,
        bottleneck=_bottleneck(compute_s, exposed, step_s, parts), communication_parts_s=parts)


def per_device_batch_for(devices: int, *, per_device_batch: int | None = None, global_batch: int | None = None
                         ) -> int:
    """The batch each device trains on: given, or the global batch split evenly (remainder dropped, as dtrain
    does); at least 1."""
    if per_device_batch is not None:
        return per_device_batch
    if global_batch is None:
        raise ValueError("give per_device_batch or global_batch")
    return max(global_batch // devices, 1)


def sweep_devices(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec, strategy: StrategySpec,
                  device_counts: Sequence[int], *, per_device_batch: int | None = None,
                  global_batch: int | None = None) -> list[Prediction]:
    """Predictions for several device counts: weak scaling with a per-device batch, strong with a global one."""
    return [predict_step(model, compute, topology, strategy, n,
                         per_device_batch_for(n, per_device_batch=per_device_batch, global_batch=global_batch))
            for n in device_counts]


__all__ = ["COMPUTE_BOUND_SHARE", "Prediction", "bucket_costs", "collective_parts_s", "host_seconds",
           "per_device_batch_for", "predict_step", "sweep_devices"]
