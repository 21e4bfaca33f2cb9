"""What every benchmark shares: machine facts, result files (JSON + markdown) and A/B alternation."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info(network: str = "none (loopback, unshaped)") -> dict[str, Any]:
    """The facts a reader needs to judge the numbers: cores, torch version, network emulation."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "network_emulation": network,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_results(name: str, headline: dict[str, Any], rows: list[dict[str, Any]], markdown: str,
                  machine: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """Write benchmarks/results/<name>.json and <name>.md; return the JSON path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "headline": headline, "machine": machine, "rows": rows, **(extra or {})}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown.rstrip() + "\n")
    return path


def alternate(variants: Sequence[tuple[str, Callable[[int], dict[str, Any]]]], repeats: int,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run A, B, (C...), A, B, ... `repeats` times, so that drift in machine load hits every variant alike."""
    rows = []
    for repeat in range(repeats):
        order = variants if repeat % 2 == 0 else list(reversed(variants))
        for label, run in order:
            log(f"[{repeat + 1}/{repeats}] {label} ...")
            row = run(repeat)
            row.update(variant=label, repeat=repeat)
            rows.append(row)
            log(f"[{repeat + 1}/{repeats}] {label}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                if k not in ("variant", "repeat", "history")))
    return rows


def save_figure(figure: Any, path: Path) -> None:
    """Lay out, write (120 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def dtrain_run(config: Path, run_dir: Path, settings: Sequence[str], runs_root: Path) -> dict[str, Any]:
    """`dtrain run CONFIG --set ...` in a subprocess (its store under `runs_root`); the run's summary.json."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir),
                             *[arg for setting in settings for arg in ("--set", setting)]],
                            capture_output=True, text=True, env={**os.environ, "DTRAIN_RUNS_ROOT": str(runs_root)})
    if result.returncode != 0:
        raise RuntimeError(f"dtrain run failed ({' '.join(settings)}): {result.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def time_to(history: Sequence[dict[str, Any]], target: float) -> float | None:
    """Wall seconds of the first validation entry (`accuracy`, `wall_seconds`) at or above `target`."""
    return next((float(e["wall_seconds"]) for e in history if e["accuracy"] >= target), None)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
