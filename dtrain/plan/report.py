"""Show predictions to a person: a text report for one configuration, a table and a PNG for a sweep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dtrain.plan.advise import Advice
from dtrain.plan.spec import ComputeSpec, ModelSpec, StrategySpec, TopologySpec
from dtrain.plan.step import Prediction


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def describe_setup(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec, strategy: StrategySpec) -> str:
    """Two lines: what is planned, and with which assumptions."""
    algorithm = {"parameter_server": f"parameter servers ({strategy.servers})",
                 "halving_doubling": "halving/doubling all-reduce",
                 "hierarchical": f"hierarchical all-reduce ({strategy.inter_node_algorithm} between nodes)"
                 }.get(strategy.algorithm, f"{strategy.algorithm} all-reduce")
    compression = ("no compression" if strategy.compression_ratio == 1
                   else f"compressed to {strategy.compression_ratio:g} of the bytes")
    link = "shared-medium " if topology.shared_medium else ""
    return (f"{model.name}: {model.parameters / 1e6:,.1f} M parameters, {model.gradient_bytes / 1e6:,.1f} MB of "
            f"gradient per step; {compute.seconds_per_sample * 1e3:.3g} ms per sample per device\n"
            f"{algorithm}, overlap {'on' if strategy.overlap else 'off'}, aggregation "
            f"{strategy.aggregation_frequency}, {compression}; {topology.devices_per_node} device(s) per node, "
            f"{link}links {topology.intra_bandwidth_bytes_per_s * 8 / 1e9:,.3g} Gbit/s inside and "
            f"{topology.inter_bandwidth_bytes_per_s * 8 / 1e9:,.3g} Gbit/s between nodes")


def format_prediction(prediction: Prediction, advice: Sequence[Advice] = ()) -> str:
    p = prediction
    parts = ", ".join(f"{name} {_ms(seconds)}" for name, seconds in
                      sorted(p.communication_parts_s.items(), key=lambda item: -item[1]))
    lines = [
        f"  devices         {p.devices} ({p.nodes} node(s)); {p.per_device_batch} per device, global batch "
        f"{p.global_batch:,}",
        f"  step            {_ms(p.step_s)} = compute {_ms(p.compute_s)} + exposed communication "
        f"{_ms(p.exposed_communication_s)}",
        f"  communication   {_ms(p.communication_s)} per synchronization" + (f" ({parts})" if parts else ""),
        f"  throughput      {p.samples_per_s:,.0f} samples/s",
        f"  efficiency      {p.scaling_efficiency:.1%} of {p.devices} x one device",
        f"  bottleneck      {p.bottleneck}",
    ]
    if advice:
        lines.append("recommendations")
        lines += [f"  {a.topic:<18} {a.answer}: {a.detail}" for a in advice]
    return "\n".join(lines)


SWEEP_HEADER = ("devices", "nodes", "batch/dev", "global", "step ms", "compute ms", "exposed ms", "samples/s",
                "efficiency", "bottleneck")


def format_sweep(predictions: Sequence[Prediction]) -> str:
    rows = [SWEEP_HEADER] + [
        (str(p.devices), str(p.nodes), str(p.per_device_batch), f"{p.global_batch:,}", f"{p.step_s * 1e3:,.1f}",
         f"{p.compute_s * 1e3:,.1f}", f"{p.exposed_communication_s * 1e3:,.1f}", f"{p.samples_per_s:,.0f}",
         f"{p.scaling_efficiency:.1%}", p.bottleneck) for p in predictions]
    widths = [max(len(row[i]) for row in rows) for i in range(len(SWEEP_HEADER))]
    return "\n".join("  " + "  ".join(cell.rjust(w) if i < len(widths) - 1 else cell
                                      for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     for row in rows)


def plot_sweep(predictions: Sequence[Prediction], path: Path, title: str) -> Path:
    """Throughput against devices (with the ideal line) and scaling efficiency, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = [p.devices for p in predictions]
    throughput = [p.samples_per_s for p in predictions]
    one = predictions[0].samples_per_s / predictions[0].devices / predictions[0].scaling_efficiency
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(devices, [one * d for d in devices], "--", color="grey", label="ideal (n x one device)")
    left.plot(devices, throughput, "o-", label="predicted")
    left.set(xscale="log", yscale="log", xlabel="devices", ylabel="samples / s", title="throughput")
    left.legend()
    right.plot(devices, [100 * p.scaling_efficiency for p in predictions], "o-")
    right.set(xscale="log", ylim=(0, 105), xlabel="devices", ylabel="% of ideal", title="scaling efficiency")
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


__all__ = ["describe_setup", "format_prediction", "format_sweep", "plot_sweep"]
