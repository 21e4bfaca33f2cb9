"""Recommendations from the model: how many parameter servers hide communication, which per-device batch
reaches a target efficiency, and whether gradient compression pays. Each answer is the model's prediction
searched over one knob; pure."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.plan.collectives import fewest_servers_to_carry
from dtrain.plan.spec import ComputeSpec, ModelSpec, StrategySpec, TopologySpec
from dtrain.plan.step import predict_step

# Communication counts as hidden when it adds at most this share of the compute time to a step.
HIDDEN_SHARE = 0.05
MAX_BATCH_PER_DEVICE = 1 << 20


@dataclass(frozen=True)
class Advice:
    """One recommendation: a short answer, the number behind it (or None) and the reasoning in a sentence."""

    topic: str
    answer: str
    value: float | None
    detail: str


def fewest_parameter_servers(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec,
                             strategy: StrategySpec, devices: int, per_device_batch: int,
                             max_servers: int = 1024) -> Advice:
    """The fewest dedicated servers whose predicted exposed communication is within HIDDEN_SHARE of compute,
    with Zou et al.'s closed form P >= 2*S*W / (B*T) beside it; None when the workers' own NICs are the limit."""
    ps = strategy.with_(algorithm="parameter_server")
    server_bw = ps.server_bandwidth_bytes_per_s or topology.inter_bandwidth_bytes_per_s
    window_s = compute.backward_seconds(per_device_batch) if ps.overlap else compute.batch_seconds(per_device_batch)
    sent_bytes = model.gradient_bytes * ps.compression_ratio
    lemma = fewest_servers_to_carry(sent_bytes, devices, server_bw, max(window_s, 1e-12))
    compute_s = compute.batch_seconds(per_device_batch)
    for servers in range(1, max_servers + 1):
        prediction = predict_step(model, compute, topology, ps.with_(servers=servers), devices, per_device_batch)
        if prediction.exposed_communication_s <= HIDDEN_SHARE * compute_s:
            return Advice("parameter servers", f"{servers} server(s) hide communication", servers,
                          f"predicted step {prediction.step_s * 1e3:.1f} ms with {servers}; Zou et al.'s bound "
                          f"2*S*W/(B*T) gives {lemma}")
        if prediction.bottleneck.endswith("worker NIC"):
            return Advice("parameter servers", "no number of servers hides communication", None,
                          f"each worker's own link moves 2 x {model.gradient_bytes * ps.compression_ratio / 1e6:.1f} "
                          f"MB per step ({prediction.exposed_communication_s * 1e3:.1f} ms exposed with {servers} "
                          "servers); only a faster worker NIC, compression or a larger batch helps")
    return Advice("parameter servers", f"more than {max_servers} servers needed", None,
                  f"Zou et al.'s bound gives {lemma}")


def batch_for_efficiency(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec, strategy: StrategySpec,
                         devices: int, target_efficiency: float) -> Advice:
    """The smallest per-device batch whose predicted scaling efficiency reaches `target_efficiency`."""
    if not 0 < target_efficiency < 1:
        raise ValueError(f"target_efficiency must be in (0, 1), got {target_efficiency}")

    def efficiency(batch: int) -> float:
        return predict_step(model, compute, topology, strategy, devices, batch).scaling_efficiency

    if efficiency(1) >= target_efficiency:
        return Advice("batch size", f"any batch reaches {target_efficiency:.0%}", 1.0,
                      f"even 1 sample per device gives {efficiency(1):.1%}")
    high = 1
    while efficiency(high) < target_efficiency:
        high *= 2
        if high > MAX_BATCH_PER_DEVICE:
            return Advice("batch size", f"no batch up to {MAX_BATCH_PER_DEVICE:,} per device reaches "
                          f"{target_efficiency:.0%}", None,
                          f"efficiency tends to {efficiency(MAX_BATCH_PER_DEVICE):.1%}")
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if efficiency(mid) < target_efficiency else (low, mid)
    return Advice("batch size", f"{high} per device (global {high * devices:,}) for {target_efficiency:.0%}",
                  float(high), f"predicted efficiency {efficiency(high):.1%} at {high} per device, "
                  f"{efficiency(low):.1%} at {low}; the global batch must still converge (large_batch: recipes)")


def compression_gain(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec, strategy: StrategySpec,
                     devices: int, per_device_batch: int, ratio: float = 0.5,
                     host_seconds_per_byte: float = 0.0) -> Advice:
    """Predicted step with gradients compressed to `ratio` of their bytes (fp16: 0.5) against without."""
    plain = predict_step(model, compute, topology, strategy.with_(compression_ratio=1.0,
                                                                  compression_host_seconds_per_byte=0.0),
                         devices, per_device_batch)
    compressed = strategy.with_(compression_ratio=ratio, compression_host_seconds_per_byte=host_seconds_per_byte)
    packed = predict_step(model, compute, topology, compressed, devices, per_device_batch)
    saving = 1 - packed.step_s / plain.step_s
    if saving < 0.02:
        answer = f"compression to {ratio:g} does not help ({saving:+.1%})"
        why = ("communication is already hidden behind backward" if plain.bottleneck == "compute"
               else f"the bottleneck is {plain.bottleneck.removeprefix('communication: ')}")
    else:
        answer = f"compression to {ratio:g} saves {saving:.0%} per step"
        why = f"step {plain.step_s * 1e3:.1f} -> {packed.step_s * 1e3:.1f} ms"
    return Advice("compression", answer, saving, why)


def advise(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec, strategy: StrategySpec, devices: int,
           per_device_batch: int, target_efficiency: float = 0.9, compression_ratio: float = 0.5) -> list[Advice]:
    """All recommendations for one configuration (none for a single device)."""
    if devices <= 1:
        return []
    return [fewest_parameter_servers(model, compute, topology, strategy, devices, per_device_batch),
            batch_for_efficiency(model, compute, topology, strategy, devices, target_efficiency),
            compression_gain(model, compute, topology, strategy, devices, per_device_batch, compression_ratio)]


__all__ = ["HIDDEN_SHARE", "Advice", "advise", "batch_for_efficiency", "compression_gain", "fewest_parameter_servers"]
