"""Does a Determined PyTorchTrial lose speed on dtrain? The Fashion-MNIST demo model written as a PyTorchTrial
(benchmarks/determined/fashion_pytorch_trial.py: wrap_model, wrap_optimizer, context.backward, context.step_optimizer)
against the same model, data and optimizer as a native dtrain Trial (fashion_native.py), both under `dtrain run` with
2 workers, the demo's global batch 256 and channels_last, alternated round by round (A B, B A, ...).

The figure per run is the training time per batch: the global batch over the run summary's samples/s (dtrain's
training clock: batches only, validation and checkpoints excluded).

Headline `time_ratio_vs_native`: PyTorchTrial / native, the median of the ratios paired within each round, with
`time_ratio_vs_native_per_round` beside it (target <= 1.03).

    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/determined_compat.py            # 5 rounds, ~5 min
    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/determined_compat.py --quick    # 2 short rounds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
CONFIG = REPO / "benchmarks" / "determined" / "pytorch_trial.yaml"
ENTRYPOINTS = {"PyTorchTrial": "fashion_pytorch_trial:FashionMNISTPyTorchTrial",
               "native Trial": "fashion_native:FashionMNISTNative"}


def run(label: str, batches: int, workdir: Path, repeat: int) -> dict[str, Any]:
    from common import dtrain_run

    name = label.split()[0].lower()
    summary = dtrain_run(CONFIG, workdir / f"{name}-{repeat}", [
        f"entrypoint={ENTRYPOINTS[label]}", f"searcher.max_length={{batches: {batches}}}"], workdir / "runs")
    rate = float(summary["samples_per_second"])  # records over dtrain's training clock (no validation, checkpoints)
    return {"seconds_per_batch": float(summary["global_batch_size"]) / rate, "samples_per_second": rate,
            "batches": int(summary["steps_completed"]), "accuracy": float(summary["validation"]["accuracy"])}


def _runner(label: str, batches: int, workdir: Path) -> Callable[[int], dict[str, Any]]:
    return lambda repeat: run(label, batches, workdir, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 30-batch runs (a check, not a result)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of the two variants (default 5)")
    parser.add_argument("--batches", type=int, default=120, help="batches per run (default 120, half an epoch)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batches = 2, 30
    from common import alternate, machine_info, markdown_table, ratio_headline, rounds_of, write_results

    labels = ("PyTorchTrial", "native Trial")
    with tempfile.TemporaryDirectory(prefix="determined_compat-") as tmp:
        workdir = Path(tmp)
        rows = alternate([(label, _runner(label, args.batches, workdir)) for label in labels], args.rounds)
    ours, native = rounds_of(rows, labels[0], "seconds_per_batch"), rounds_of(rows, labels[1], "seconds_per_batch")
    headline: dict[str, Any] = {
        **ratio_headline("time_ratio_vs_native", ours, native), "target": "time_ratio_vs_native <= 1.03",
        "workers": 2, "global_batch_size": 256, "batches_per_run": args.batches, "rounds": args.rounds,
        "quick": args.quick}
    per_round = ", ".join(f"{v:.3f}" for v in headline["time_ratio_vs_native_per_round"])
    table = markdown_table(["round", "variant", "s/batch", "samples/s", "accuracy"],
                           [[r["repeat"] + 1, r["variant"], f"{r['seconds_per_batch']:.4f}",
                             f"{r['samples_per_second']:.0f}", f"{r['accuracy']:.4f}"] for r in rows])
    verdict = "met" if headline["time_ratio_vs_native"] <= 1.03 else "missed"
    markdown = "\n\n".join([
        "# determined_compat",
        f"The Fashion-MNIST demo model as a Determined PyTorchTrial against the same model as a native dtrain Trial, "
        f"both under `dtrain run`, 2 workers, global batch 256, channels_last, {args.batches} batches per run, "
        f"{args.rounds} alternated rounds{' (--quick: a check, not a result)' if args.quick else ''}.",
        f"**training time per batch, PyTorchTrial / native: {headline['time_ratio_vs_native']:.3f}** (median of "
        f"paired ratios; per round {per_round}); target <= 1.03: {verdict}.",
        table,
        "Reproduce: `flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/determined_compat.py`."])
    path = write_results("determined_compat", headline, rows, markdown, machine_info())
    print(f"time_ratio_vs_native {headline['time_ratio_vs_native']:.3f} (per round {per_round}); wrote {path}")


if __name__ == "__main__":
    main()
