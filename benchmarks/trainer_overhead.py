"""Does a change to the Trainer cost time per step? This tree's Trainer against another revision's, side by side.

Both train the same tiny MLP on synthetic data (examples/synthetic_mlp, 32 inputs, 2 hidden layers of 64) in one
process with one thread, so that the Trainer's own work per step (stages, timers, metric windows, the update
guard) is a visible share of the step. Two long-lived worker processes, one importing dtrain from each source
tree, take turns (A B, B A, ...): each turn is a whole short run (a fresh Trainer and run dir), so that drift in
machine load hits both alike. The headline figure is each run's median step time (from the run's phase profile:
robust to the steps a loaded machine stretches); beside it the mean training time per step (the run's
`samples_per_second` turned back into seconds per batch; validation and checkpoints are not in it) and the CPU
time of the whole run. Each is given as the per-round ratio this / baseline and the median over rounds.

    python benchmarks/trainer_overhead.py                 # 30 rounds of 400 steps against `git archive main`
    python benchmarks/trainer_overhead.py --quick         # 10 rounds of 300 steps
    python benchmarks/trainer_overhead.py --baseline-rev b73d514
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import alternate, machine_info, markdown_table, median, write_results  # noqa: E402

GLOBAL_BATCH = 32

# A worker: imports whichever dtrain PYTHONPATH puts first (the same API in both trees), then trains one short run
# per line it reads ("<steps> <run dir>") and answers each with one JSON line.
WORKER = """
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from dtrain.comm import init_distributed
from dtrain.config import load_config
try:  # the run-dir conventions move to dtrain.runs (issue 15): either tree may predate that
    from dtrain.runs.rundir import prepare_run_dir
except ImportError:
    from dtrain.train.rundir import prepare_run_dir
from dtrain.train.trainer import Trainer
from model_def import SyntheticMLPTrial

trial_dir = Path(sys.argv[1])
topology = init_distributed(backend="gloo")
for line in sys.stdin:
    steps, run_dir = line.split()
    raw = {"name": "trainer_overhead", "entrypoint": "model_def:SyntheticMLPTrial",
           "hyperparameters": {"global_batch_size": GLOBAL_BATCH, "learning_rate": 0.01, "inputs": 32, "width": 64,
                               "depth": 2, "classes": 10, "records": 4096},
           "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": int(steps)}},
           "min_validation_period": {"batches": 0}, "min_checkpoint_period": {"batches": 0},
           "checkpoint_policy": "none", "scheduling_unit": 100}
    config = load_config(None, raw=raw).config
    run_info = prepare_run_dir(config, Path(run_dir), trial_dir, register=False)
    cpu = time.process_time()
    summary = Trainer(config=config, trial_class=SyntheticMLPTrial, topology=topology, run_info=run_info).fit()
    print(json.dumps({"steps": summary["steps_completed"], "samples_per_second": summary["samples_per_second"],
                      "median_step_seconds": summary["profile"]["ranks"][0]["median_seconds"]["step"],
                      "cpu_seconds": time.process_time() - cpu}), flush=True)
""".replace("GLOBAL_BATCH", str(GLOBAL_BATCH))


def extract_revision(revision: str, into: Path) -> Path:
    """`git archive` of `revision` unpacked under `into`; the tree's root."""
    root = into / "baseline"
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


class Worker:
    """A process that trains short runs with one source tree's dtrain, on request."""

    def __init__(self, tree: Path, scratch: Path, label: str) -> None:
        trial_dir = REPO / "examples" / "synthetic_mlp"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(trial_dir)]), "OMP_NUM_THREADS": "1",
               "DTRAIN_RUNS_ROOT": str(scratch / "runs")}
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
            env.pop(name, None)
        self.label, self.scratch = label, scratch
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, str(trial_dir)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                        cwd=scratch)

    def run(self, steps: int, repeat: int) -> dict[str, Any]:
        """One run of `steps` batches; its training seconds per step."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{steps} {self.scratch / f'{self.label}-{repeat}'}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the {self.label} worker died (exit code {self.process.wait()})")
        figures = json.loads(answer)
        return {"steps": figures["steps"], "median_step_us": figures["median_step_seconds"] * 1e6,
                "step_us": GLOBAL_BATCH / figures["samples_per_second"] * 1e6,
                "cpu_us": figures["cpu_seconds"] / figures["steps"] * 1e6}

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def row_of(rows: list[dict[str, Any]], repeat: int, variant: str) -> dict[str, Any]:
    return next(row for row in rows if row["repeat"] == repeat and row["variant"] == variant)


def paired_ratios(rows: list[dict[str, Any]], rounds: int, key: str) -> list[float]:
    """this / baseline of `key` within each round."""
    return [row_of(rows, r, "this")[key] / row_of(rows, r, "baseline")[key] for r in range(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 rounds of 300 steps")
    parser.add_argument("--rounds", type=int, help="A/B rounds (default 30, 10 with --quick)")
    parser.add_argument("--steps", type=int, help="steps per run (default 400, 300 with --quick)")
    parser.add_argument("--baseline-rev", default="main", help="git revision to compare against (default main)")
    parser.add_argument("--baseline", type=Path, help="a source tree to compare against instead of a revision")
    args = parser.parse_args()
    rounds = args.rounds or (10 if args.quick else 30)
    steps = args.steps or (300 if args.quick else 400)
    with tempfile.TemporaryDirectory(prefix="trainer-overhead-") as tmp:
        scratch = Path(tmp)
        baseline_tree = args.baseline.resolve() if args.baseline else extract_revision(args.baseline_rev, scratch)
        label = str(args.baseline) if args.baseline else args.baseline_rev
        workers = {"baseline": Worker(baseline_tree, scratch, "baseline"), "this": Worker(REPO, scratch, "this")}
        try:
            for worker in workers.values():  # untimed warm-up: imports, first allocations
                worker.run(50, -1)
            rows = alternate([(name, partial(worker.run, steps)) for name, worker in workers.items()], rounds)
        finally:
            for worker in workers.values():
                worker.close()
    per_round = paired_ratios(rows, rounds, "median_step_us")
    mean_per_round = paired_ratios(rows, rounds, "step_us")
    cpu_per_round = paired_ratios(rows, rounds, "cpu_us")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "dtrain"],
                                capture_output=True, text=True).stdout.strip())
    headline = {"step_time_ratio": median(per_round), "step_time_ratio_per_round": per_round,
                "mean_step_time_ratio": median(mean_per_round), "mean_step_time_ratio_per_round": mean_per_round,
                "cpu_time_ratio": median(cpu_per_round), "cpu_time_ratio_per_round": cpu_per_round,
                "this_median_step_us": median([r["median_step_us"] for r in rows if r["variant"] == "this"]),
                "baseline_median_step_us": median([r["median_step_us"] for r in rows if r["variant"] == "baseline"]),
                "this": commit + (" (uncommitted changes in dtrain/)" if dirty else ""), "baseline": label}
    table = markdown_table(
        ["round", "baseline median us/step", "this median us/step", "this / baseline", "mean: this / baseline",
         "CPU: this / baseline"],
        [[r + 1, row_of(rows, r, "baseline")["median_step_us"], row_of(rows, r, "this")["median_step_us"],
          per_round[r], mean_per_round[r], cpu_per_round[r]] for r in range(rounds)])
    markdown = (f"# Trainer overhead: {headline['this']} against {label}\n\n{rounds} rounds of {steps} steps, "
                f"1 process, 1 thread, tiny MLP, global batch {GLOBAL_BATCH}.\n\n"
                f"Median over rounds of this / baseline: **{headline['step_time_ratio']:.4f}** (each run's "
                f"median step time); {headline['mean_step_time_ratio']:.4f} (mean training time per step); "
                f"{headline['cpu_time_ratio']:.4f} (CPU time per run, set-up and the final validation "
                f"included)\n\n{table}\n")
    write_results("trainer_overhead", headline, rows, markdown, machine_info())
    print(markdown)


if __name__ == "__main__":
    main()
