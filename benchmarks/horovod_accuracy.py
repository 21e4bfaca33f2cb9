"""Does a Horovod script train as well on dtrain? tests/horovod_scripts/fashion_mnist.py, unchanged, under
`dtrain horovodrun -np 2` against the same model, data, optimizer and batch as a Trial under `dtrain run`
(benchmarks/horovod/fashion_mnist.yaml), 2 workers, 3 epochs of Fashion-MNIST, alternated round by round with
the seed of each round given to both (the script's --seed seeds its weights and its DistributedSampler; dtrain's
reproducibility.experiment_seed its weights and shuffle).

The two sides of a round share the seed but no randomness (each draws its own initial weights and data order),
so a per-round difference is mostly seed-to-seed noise (about +-1.5 points after 3 epochs at the script's
Horovod-example defaults, lr 0.01 per worker with momentum 0.5, measured here). The headline is therefore the
difference of the means over the rounds' seeds, `accuracy_gap_points` = |mean under horovodrun - mean under
dtrain run| in points (target <= 0.5), with the signed per-round differences and each side's standard deviation
beside it. The default settings train closer to convergence (lr 0.05 per worker, momentum 0.9, both sides),
where seed noise is smaller.

    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_accuracy.py            # 4 rounds, ~30 min
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


def run_horovodrun(epochs: int, seed: int, data_dir: str, workdir: Path, lr: float, momentum: float
                   ) -> dict[str, Any]:
    out = workdir / f"horovodrun-{seed}.json"
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "horovodrun", "-np", "2", "python", str(SCRIPT),
                           "--epochs", str(epochs), "--seed", str(seed), "--data-dir", data_dir,
                           "--lr", str(lr), "--momentum", str(momentum),
                           "--results", str(out)], capture_output=True, text=True, env=env, cwd=workdir)
    if done.returncode != 0:
        raise RuntimeError(f"dtrain horovodrun failed: {done.stderr[-2000:]}")
    return {"accuracy": json.loads(out.read_text())["accuracy"], "seed": seed}


def run_dtrain(epochs: int, seed: int, workdir: Path, lr: float, momentum: float) -> dict[str, Any]:
    from common import dtrain_run

    summary = dtrain_run(CONFIG, workdir / f"dtrain-{seed}", [
        f"searcher.max_length={{epochs: {epochs}}}", f"min_validation_period={{epochs: {epochs}}}",
        f"reproducibility.experiment_seed={seed}", f"hyperparameters.learning_rate={lr}",
        f"hyperparameters.momentum={momentum}"], workdir)
    return {"accuracy": float(summary["validation"]["accuracy"]), "seed": seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 1 epoch (a check, not a result)")
    parser.add_argument("--rounds", type=int, default=4, help="alternated rounds, seeds 1, 2, ... (default 4)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate per worker, both sides (default 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, both sides (default 0.9)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    parser.add_argument("--results-name", help="results file name (default horovod_accuracy, or _quick with --quick)")
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
        rows = alternate([(labels[0], lambda r: run_horovodrun(args.epochs, r + 1, str(data_dir), workdir,
                                                               args.lr, args.momentum)),
                          (labels[1], lambda r: run_dtrain(args.epochs, r + 1, workdir, args.lr, args.momentum))],
                         args.rounds)
    by_round: dict[int, dict[str, float]] = {}
    for row in rows:
        by_round.setdefault(row["repeat"], {})[row["variant"]] = row["accuracy"]
    signed = [100 * (by_round[r][labels[0]] - by_round[r][labels[1]]) for r in sorted(by_round)]
    ours = [by_round[r][labels[0]] for r in sorted(by_round)]
    theirs = [by_round[r][labels[1]] for r in sorted(by_round)]
    headline = {"accuracy_gap_points": abs(100 * (statistics.fmean(ours) - statistics.fmean(theirs))),
                "accuracy_gap_points_per_round": signed,
                "median_abs_paired_gap_points": statistics.median(abs(g) for g in signed),
                "horovodrun_accuracy_mean": statistics.fmean(ours),
                "dtrain_run_accuracy_mean": statistics.fmean(theirs),
                "horovodrun_accuracy_std_points": 100 * statistics.stdev(ours) if len(ours) > 1 else None,
                "dtrain_run_accuracy_std_points": 100 * statistics.stdev(theirs) if len(theirs) > 1 else None,
                "lr_per_worker": args.lr, "momentum": args.momentum,
                "horovodrun_accuracy_per_round": [by_round[r][labels[0]] for r in sorted(by_round)],
                "dtrain_run_accuracy_per_round": [by_round[r][labels[1]] for r in sorted(by_round)],
                "target": "accuracy_gap_points <= 0.5", "epochs": args.epochs, "rounds": args.rounds,
                "seeds": sorted({row["seed"] for row in rows}), "workers": 2}
    name = args.results_name or ("horovod_accuracy_quick" if args.quick else "horovod_accuracy")
    settings = [] if args.quick else [("--rounds", args.rounds, 4), ("--epochs", args.epochs, 3)]  # quick sets both
    flags = (" --quick" if args.quick else "") + "".join(
        f" {flag} {value}" for flag, value, default in [*settings, ("--results-name", args.results_name, None)]
        if value != default)
    markdown = "\n\n".join([
        f"# {name}",
        f"tests/horovod_scripts/fashion_mnist.py under `dtrain horovodrun -np 2` against the same training as a "
        f"Trial under `dtrain run`, {args.epochs} epoch(s), {args.rounds} alternated round(s), seed = round + 1.",
        f"**accuracy gap: {headline['accuracy_gap_points']:.2f} points** (|difference of the means over the seeds|; "
        f"per round, horovodrun minus dtrain run: {', '.join(f'{g:+.2f}' for g in signed)}; target <= 0.5). "
        f"lr {args.lr:g} per worker, momentum {args.momentum:g} on both sides.",
        markdown_table(["variant", "round", "seed", "test accuracy"],
                       [[r["variant"], r["repeat"], r["seed"], r["accuracy"]] for r in rows]),
        f"Reproduce: `flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_accuracy.py{flags}`"])
    path = write_results(name, headline, rows, markdown, machine_info())
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
