"""Specs for "this machine" from a calibration: its workers are its CPU cores, so the loopback all-reduce that
calibration timed is both the speed of the unshaped link and the CPU cost of communication (`HostCost`), which
competes with compute and never hides.

A network emulated with benchmarks/netem.py (a tbf qdisc on a namespace's loopback) is modelled as a shared
medium at the tbf rate with no added latency: the loopback has ONE queue, which both directions of every
worker's traffic cross, unlike full-duplex Ethernet that carries the rate each way; tbf delays packets only
when that queue is full. The host's CPU cost stays: the bytes are still copied and summed by the cores.
Pure: the calibration is read elsewhere (`Calibration.load`).
"""

from __future__ import annotations

from typing import Any

from dtrain.plan.spec import ComputeSpec, HostCost, StrategySpec, TopologySpec
from dtrain.plan.units import gbit_per_s_to_bytes_per_s


def compute_spec(measurement: Any) -> ComputeSpec:
    """One worker's compute from a `ComputeMeasurement`: forward + backward per sample, the measured backward
    share, and the optimizer step as the fixed per-step cost."""
    return ComputeSpec(seconds_per_sample=measurement.seconds_per_sample,
                       backward_fraction=measurement.backward_fraction, step_overhead_s=measurement.optimizer_s,
                       source=f"calibrated: {measurement.name} on {measurement.threads} thread(s)")


def compute_spec_from_flops(training_flops_per_sample: float, measurement: Any) -> ComputeSpec:
    """Another model's compute on this machine: its FLOPs at the FLOP rate the calibrated model achieved."""
    rate = measurement.achieved_flops_per_s
    if not rate:
        raise ValueError("the calibration has no FLOP rate; calibrate with a model whose FLOPs can be counted")
    return ComputeSpec(seconds_per_sample=training_flops_per_sample / rate,
                       backward_fraction=measurement.backward_fraction,
                       source=f"calibrated FLOP rate of {measurement.name} ({rate / 1e9:.1f} GFLOP/s)")


def host_cost(fit: Any) -> HostCost:
    """A loopback all-reduce fit (`AllReduceFit`) as the CPU cost of communication."""
    return HostCost(latency_s=fit.alpha_s, seconds_per_byte=fit.beta_s_per_byte)


def this_machine_topology(fit: Any, workers_per_node: int, *, link_gbit_per_s: float | None = None) -> TopologySpec:
    """This machine's workers on one node. Without `link_gbit_per_s` they talk over the plain loopback (speed
    and host cost both from `fit`); with it, over a loopback shaped by tbf to that rate (a shared medium with
    no added latency), still paying the host cost."""
    host = host_cost(fit)
    if link_gbit_per_s is None:
        return TopologySpec(devices_per_node=workers_per_node, intra_bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s,
                            intra_latency_s=fit.alpha_s, host=host, source="calibrated loopback")
    return TopologySpec(devices_per_node=workers_per_node,
                        intra_bandwidth_bytes_per_s=gbit_per_s_to_bytes_per_s(link_gbit_per_s), intra_latency_s=0.0,
                        shared_medium=True, host=host,
                        source=f"loopback shaped by tbf to {link_gbit_per_s:g} Gbit/s (one shared queue)")


def fp16_compression(strategy: StrategySpec | None = None) -> StrategySpec:
    """PyTorch's fp16_compress_hook: half the bytes. Its casts are part of the fp16 all-reduce calibration, so
    the topology's host cost must come from that fit (`this_machine_topology(calibration.allreduce["float16"])`)."""
    return (strategy or StrategySpec()).with_(compression_ratio=0.5)


__all__ = ["compute_spec", "compute_spec_from_flops", "fp16_compression", "host_cost", "this_machine_topology"]
