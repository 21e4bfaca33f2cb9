"""Fail fast: how long does `dtrain run` take to end on an error that only a running worker finds, next to a good
run that stops after its first batch (`faults.stop_after_batch: 1`)?

The errors are the bad-input corpus's worker cases (tests/faults/corpus/worker_error_trial.py, on the digits
fixture, 2 workers, `max_restarts: 5`, dtrain's default): a renamed hyperparameter, dict batches under strategy
`pipeline`, an exception in the Trial's code at batch 3 on every attempt, and a data file missing on rank 1.
Each should end with exit code 2 after one start of the workers (two for the exception: the second identical
failure stops it). The good run and the four cases alternate (good, cases..., cases reversed, good, ...) over
`--rounds` rounds; each case's time is divided by the good run's of the same round.

Headline: `worst_ratio`, the largest over the cases of the median over rounds of (time to the error / time of
the good run) (target <= 1.5, issue 39), and per case that median, its per-round values, and the worker starts
and exit codes seen.

    python benchmarks/fail_fast.py            # 3 rounds: about 5 minutes on 2 cores
    python benchmarks/fail_fast.py --quick    # 1 round
"""

from __future__ import annotations

import argparse
import gzip
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, machine_info, markdown_table, ratio_headline, rounds_of, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "fixtures" / "digits.yaml"
TRIALS = REPO / "tests" / "faults" / "corpus" / "worker_error_trial.py"
GOOD = "good, stop after batch 1"
CASES = {  # name: (Trial class, --set settings with {data} filled in)
    "renamed hyperparameter": ("RenamedHyperparameter", []),
    "dict batches under pipeline": ("DictBatches", ["distributed.strategy=pipeline"]),
    "exception at batch 3": ("FailsAtBatch3", []),
    "data missing on rank 1": ("DataOnEachNode", ["data.directory={data}/node-{{rank}}"]),
}


def fashion_files(directory: Path, images: int = 200) -> None:
    """Fashion-MNIST's four IDX files, blank, for rank 0's node-local copy (rank 1 has none)."""
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "t10k"):
        pixels = struct.pack(">IIII", 0x803, images, 28, 28) + bytes(images * 28 * 28)
        labels = struct.pack(">II", 0x801, images) + bytes(images)
        (directory / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(pixels))
        (directory / f"{split}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(labels))


def timed_run(run_dir: Path, settings: list[str], runs_root: Path) -> dict[str, Any]:
    """One `dtrain run` of the digits fixture: its wall time, exit code, worker starts and stderr lines."""
    command = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--run-dir", str(run_dir), "--set",
               "max_restarts=5", *[arg for setting in settings for arg in ("--set", setting)]]
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env={**env, "DTRAIN_RUNS_ROOT": str(runs_root)})
    seconds = time.perf_counter() - started
    starts = len(list((run_dir / "logs" / "agent").glob("*/attempt_*")))
    return {"seconds": seconds, "exit_code": result.returncode, "worker_starts": starts,
            "stderr_lines": len(result.stderr.splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round (a check, not a result)")
    parser.add_argument("--results-name", default="fail_fast")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    work = Path(tempfile.mkdtemp(prefix="fail_fast-"))
    fashion_files(work / "data" / "node-0")

    def variant(label: str, settings: list[str]) -> tuple[str, Any]:
        def run(repeat: int) -> dict[str, Any]:
            return timed_run(work / f"{label.replace(' ', '-')}-{repeat}", settings, work / "runs")
        return label, run

    variants = [variant(GOOD, ["faults.stop_after_batch=1"])]
    for name, (trial, settings) in CASES.items():
        filled = [s.format(data=work / "data") for s in settings]
        variants.append(variant(name, [f"entrypoint={TRIALS}:{trial}", *filled]))
    rows = alternate(variants, rounds)
    good = rounds_of(rows, GOOD, "seconds")
    headline: dict[str, Any] = {"good_run_seconds": good}
    table = []
    for name in CASES:
        key = name.replace(" ", "_")
        headline.update(ratio_headline(f"{key}_ratio", rounds_of(rows, name, "seconds"), good))
        mine = [r for r in rows if r["variant"] == name]
        headline[f"{key}_worker_starts"] = sorted({r["worker_starts"] for r in mine})
        headline[f"{key}_exit_codes"] = sorted({r["exit_code"] for r in mine})
        table.append([name, f"{headline[f'{key}_ratio']:.2f}",
                      " / ".join(f"{v:.2f}" for v in headline[f"{key}_ratio_per_round"]),
                      " / ".join(f"{r['seconds']:.1f}" for r in mine), headline[f"{key}_worker_starts"],
                      headline[f"{key}_exit_codes"]])
    per_case = [headline[f"{name.replace(' ', '_')}_ratio_per_round"] for name in CASES]
    headline["worst_ratio_per_round"] = [max(values) for values in zip(*per_case, strict=True)]
    headline["worst_ratio"] = max(headline[f"{name.replace(' ', '_')}_ratio"] for name in CASES)
    markdown = (f"# Fail fast ({rounds} round(s))\n\nGood run (stop after batch 1): "
                + " / ".join(f"{s:.1f} s" for s in good) + "\n\n"
                + markdown_table(["case", "time / good run (median)", "per round", "seconds", "worker starts",
                                  "exit codes"], table))
    path = write_results(args.results_name, headline, rows, markdown, machine_info())
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
