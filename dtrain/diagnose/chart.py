"""The diagnosis chart: for every trial and rank, a stacked bar of the median seconds of each step phase."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dtrain.profile.timers import PHASE_LABELS

CHART_PHASES = ("data", "forward", "backward", "comm_wait", "all_gather", "reduce_scatter", "bubble", "optimizer")
COLORS = {"data": "#8c564b", "forward": "#1f77b4", "backward": "#2ca02c", "comm_wait": "#d62728",
          "all_gather": "#ff7f0e", "reduce_scatter": "#e377c2", "bubble": "#7f7f7f", "optimizer": "#9467bd"}
TRIAL_LABELS = {"configured": "as configured", "no_communication": "aggregation 1000",
                "synthetic_data": "synthetic data", "one_slot": "1 slot"}


def write_phase_chart(profiles: Mapping[str, Mapping[str, Any]], order: Sequence[str], path: Path, *,
                      title: str) -> Path:
    """Horizontal stacked bars (ms per step), one per (trial, rank), the configured trial on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[tuple[str, dict[str, float]]] = []
    for name in order:
        for rank in profiles[name]["ranks"]:
            if rank.get("steps"):
                rows.append((f"{TRIAL_LABELS.get(name, name)} · rank {rank['rank']}", rank["median_seconds"]))
    figure, axes = plt.subplots(figsize=(9, 1.2 + 0.45 * len(rows)))
    labels = [label for label, _ in rows][::-1]
    lefts = [0.0] * len(rows)
    for phase in CHART_PHASES:
        widths = [medians.get(phase, 0.0) * 1e3 for _, medians in rows][::-1]
        axes.barh(labels, widths, left=lefts, color=COLORS[phase], label=PHASE_LABELS[phase])
        lefts = [left + width for left, width in zip(lefts, widths, strict=True)]
    axes.set_xlabel("median milliseconds per step")
    axes.set_title(title)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / max(len(rows), 1) - 0.12), ncol=5, fontsize=8,
                frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
