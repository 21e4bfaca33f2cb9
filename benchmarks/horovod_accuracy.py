"""Does a Horovod script train as well on dtrain? tests/horovod_scripts/fashion_mnist.py, unchanged, under
`dtrain horovodrun -np 2` against the same model, data, optimizer and batch as a Trial under `dtrain run`
(benchmarks/horovod/fashion_mnist.yaml), 2 workers, 3 epochs of Fashion-MNIST, alternated round by round with
the seed of each round given to both (the script's --seed seeds its weights and its DistributedSampler; dtrain's
reproducibility.experiment_seed its weights and shuffle).

Headline `accuracy_gap_points`: the median over rounds of |test accuracy under horovodrun - under dtrain run|,
in points, with `accuracy_gap_points_per_round` (signed, horovodrun minus dtrain run) beside it (target <= 0.5).

    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_accuracy.py            # 3 rounds, ~30 min
    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_accuracy.py --quick    # 1 round, 1 epoch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
SCRIPT = REPO / "tests" / "horovod_scripts" / "fashion_mnist.py"
CONFIG = REPO / "benchmarks" / "horovod" / "fashion_mnist.yaml"


def run_horovodrun(epochs: int, seed: int, data_dir: str, workdir: Path) -> dict[str, Any]:
    out = workdir / f"horovodrun-{seed}.json"
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "horovodrun", "-np", "2", "python", str(SCRIPT),
                           "--epochs", str(epochs), "--seed", str(seed), "--data-dir", data_dir,
                           "--results", str(out)], capture_output=True, text=True, env=env, cwd=workdir)
    if done.returncode != 0:
        raise RuntimeError(f"dtrain horovodrun failed: {done.stderr[-2000:]}")
    return {"accuracy": json.loads(out.read_text())["accuracy"], "seed": seed}


def run_dtrain(epochs: int, seed: int, workdir: Path) -> dict[str, Any]:
    from common import dtrain_run

    summary = dtrain_run(CONFIG, workdir / f"dtrain-{seed}", [
        f"searcher.max_length={{epochs: {epochs}}}", f"min_validation_period={{epochs: {epochs}}}",
        f"reproducibility.experiment_seed={seed}"], workdir)
    return {"accuracy": float(summary["validation"]["accuracy"]), "seed": seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 1 epoch (a check, not a result)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds, seeds 1, 2, ... (default 3)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.epochs = 1, 1
    from common import alternate, machine_info, markdown_table, write_results

    from dtrain.data.fashion_mnist import find_data_dir

    data_dir = find_data_dir()
    if data_dir is None:
        sys.exit("Fashion-MNIST is not installed: make setup installs it (apt-get install dataset-fashion-mnist)")
    labels = ("dtrain horovodrun (Horovod script)", "dtrain run (Trial)")
    with tempfile.TemporaryDirectory(prefix="horovod_accuracy-") as tmp:
        workdir = Path(tmp)
        rows = alternate([(labels[0], lambda r: run_horovodrun(args.epochs, r + 1, str(data_dir), workdir)),
                          (labels[1], lambda r: run_dtrain(args.epochs, r + 1, workdir))], args.rounds)
    by_round: dict[int, dict[str, float]] = {}
    for row in rows:
        by_round.setdefault(row["repeat"], {})[row["variant"]] = row["accuracy"]
    signed = [100 * (by_round[r][labels[0]] - by_round[r][labels[1]]) for r in sorted(by_round)]
    headline = {"accuracy_gap_points": statistics.median(abs(g) for g in signed),
                "accuracy_gap_points_per_round": signed, "accuracy_gap_points_max": max(abs(g) for g in signed),
                "horovodrun_accuracy_per_round": [by_round[r][labels[0]] for r in sorted(by_round)],
                "dtrain_run_accuracy_per_round": [by_round[r][labels[1]] for r in sorted(by_round)],
                "target": "accuracy_gap_points <= 0.5", "epochs": args.epochs, "rounds": args.rounds,
                "seeds": sorted({row["seed"] for row in rows}), "workers": 2}
    markdown = "\n\n".join([
        "# horovod_accuracy",
        f"tests/horovod_scripts/fashion_mnist.py under `dtrain horovodrun -np 2` against the same training as a "
        f"Trial under `dtrain run`, {args.epochs} epoch(s), {args.rounds} alternated round(s), seed = round + 1.",
        f"**accuracy gap: {headline['accuracy_gap_points']:.2f} points** (median of |per-round gap|; per round, "
        f"horovodrun minus dtrain run: {', '.join(f'{g:+.2f}' for g in signed)}; target <= 0.5)",
        markdown_table(["variant", "round", "seed", "test accuracy"],
                       [[r["variant"], r["repeat"], r["seed"], r["accuracy"]] for r in rows]),
        f"Reproduce: `flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_accuracy.py"
        f"{' --quick' if args.quick else ''}`"])
    path = write_results("horovod_accuracy_quick" if args.quick else "horovod_accuracy", headline, rows, markdown,
                         machine_info())
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
