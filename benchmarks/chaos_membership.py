"""`benchmarks/chaos.py --mode membership`: nodes lost and joined at random instants while a `--nnodes 1:2` job
trains, from outside. Does the job survive every change, how long does each take, and does the final model equal
an uninterrupted run's?

Two "nodes" on this machine, each a `dtrain run --nnodes 1:2` on loopback with one worker (benchmarks/nodes.py);
node 0 hosts the rendezvous, so node 1 is the one that comes and goes: after the job has trained at its current
size for a random 2-8 s (seeded), every process of node 1 is SIGKILLed at once (a loss), or node 1 is started again
(a join), alternately, `--changes` times per run. The workload is tests/fixtures/digits.yaml (a small MLP on
scikit-learn's digits) for `--batches` batches with a checkpoint every 10, in float32 and in float64; the reference
is the same config trained uninterrupted on 2 slots of one `dtrain run`.

Before the chaos, what the default checkpoint period under a range (every `scheduling_unit` = 100 batches) costs is
measured on examples/synthetic_mlp (15 MB checkpoints, 2 workers): `default_checkpoint_cost_percent`.

Headline: `membership_changes_survived` (changes made in runs that completed), `final_model_max_rel_diff` (float32,
over the parameters: max |chaos - uninterrupted| / max |uninterrupted|, worst run), the same in float64 (goal
<= 1e-9), `recovery_seconds_max` (from the kill or the start of node 1 to the first batch at the new size, as
`membership.json` records it; goal <= 60 s here), with the per-seed values beside them.
"""

from __future__ import annotations

import json
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, markdown_table, write_results  # noqa: E402
from nodes import kill_node, membership, node_command, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "fixtures" / "digits.yaml"
DTYPES = ("float32", "float64")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _settings(batches: int, changes: int, dtype: str) -> list[str]:
    return [f"searcher.max_length.batches={batches}", "min_checkpoint_period.batches=10",
            f"min_validation_period.batches={batches}", f"max_restarts={2 * changes + 5}",
            "distributed.timeout_seconds=60", f"hyperparameters.float64={str(dtype == 'float64').lower()}"]


def _final_model(run_dir: Path) -> dict[str, Any] | None:
    import torch

    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if summary.get("status") != "completed":
        return None
    return dict(torch.load(summary["checkpoint"], weights_only=True))


def max_rel_diff(model: dict[str, Any], reference: dict[str, Any]) -> float:
    """max over parameters of max |model - reference| / max |reference| (0 when equal)."""
    worst = 0.0
    for key, expected in reference.items():
        scale = float(expected.abs().max()) or 1.0
        worst = max(worst, float((model[key].double() - expected.double()).abs().max()) / scale)
    return worst


def uninterrupted(work: Path, batches: int, dtype: str) -> tuple[dict[str, Any], float]:
    run_dir = work / f"uninterrupted-{dtype}"
    args = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--run-dir", str(run_dir)]
    for setting in _settings(batches, 0, dtype):
        args += ["--set", setting]
    started = time.perf_counter()
    result = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    model = _final_model(run_dir)
    if result.returncode != 0 or model is None:
        raise SystemExit(f"the uninterrupted {dtype} run failed (exit {result.returncode}): "
                         f"{result.stderr.strip().splitlines()[-1:]}")
    return model, time.perf_counter() - started


def default_checkpoint_cost(work: Path, batches: int = 300, every: int = 100) -> dict[str, Any]:
    """What the checkpoint `--nnodes MIN:MAX` writes by default (every `scheduling_unit` = 100 batches) costs on a
    bigger model: examples/synthetic_mlp (3.7 M parameters, 15 MB checkpoints) on 2 workers; the mean seconds of a
    checkpoint write (rank 0's log) over the seconds of the `every` steps between two checkpoints."""
    run_dir = work / "checkpoint-cost"
    config = REPO / "examples" / "synthetic_mlp" / "mlp.yaml"
    args = [sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir), "--set",
            f"searcher.max_length={{batches: {batches}}}", "--set", f"scheduling_unit={every}", "--set",
            f"min_checkpoint_period={{batches: {every}}}"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"the checkpoint-cost run failed: {result.stderr.strip().splitlines()[-1:]}")
    log = (run_dir / "logs" / "rank-0.log").read_text()
    writes = [float(m) for m in re.findall(r"checkpoint \S+ written in ([0-9.]+) s", log)]
    summary = json.loads((run_dir / "summary.json").read_text())
    step_seconds = summary["global_batch_size"] / summary["samples_per_second"]
    return {"checkpoint_write_seconds_mean": round(statistics.mean(writes), 3), "checkpoints": len(writes),
            "step_seconds": round(step_seconds, 4), "every_batches": every,
            "checkpoint_cost_percent": round(100 * statistics.mean(writes) / (every * step_seconds), 2),
            "lost_node_redone_seconds_max": round(every * step_seconds, 1)}


def chaos_run(work: Path, seed: int, dtype: str, batches: int, changes: int) -> dict[str, Any]:
    """One job with `changes` membership changes made from outside; what happened to it."""
    rng = random.Random(seed)
    port = _free_port()
    base = work / f"chaos-{dtype}-seed{seed}"
    base.mkdir()
    chief_dir, other_dir = base / "node0", base / "node1"
    settings = _settings(batches, changes, dtype)

    def start(rank: int, run_dir: Path, log: str) -> subprocess.Popen[str]:
        return subprocess.Popen(node_command(CONFIG, run_dir, rank, "1:2", "127.0.0.1", port, settings),
                                stdout=(base / log).open("w"), stderr=subprocess.STDOUT, text=True)

    started = time.perf_counter()
    chief = start(0, chief_dir, "node0.out")
    other: subprocess.Popen[str] | None = start(1, other_dir, "node1-0.out")
    events: list[dict[str, Any]] = []
    error = ended_early = None
    try:
        wait_for(lambda: bool(membership(chief_dir)) and membership(chief_dir)[-1]["world_size"] == 2, 600,
                 "both nodes training", chief)
        for change in range(changes):
            seen = len(membership(chief_dir))
            time.sleep(rng.uniform(2.0, 8.0))
            if chief.poll() is not None:
                break
            at = time.time()
            if other is not None:
                kill_node(other.pid)
                other.wait(timeout=60)
                other, kind = None, "loss"
            else:
                other, kind = start(1, other_dir, f"node1-{change + 1}.out"), "join"
            try:
                wait_for(lambda seen=seen: len(membership(chief_dir)) > seen, 600,  # type: ignore[misc]
                         f"change {change + 1} ({kind}) recorded", chief)
            except AssertionError:
                if chief.poll() != 0:
                    raise
                ended_early = f"training ended before change {change + 1} ({kind}) was taken in"
                break
            entry = membership(chief_dir)[-1]
            events.append({"seed": seed, "dtype": dtype, "change": change + 1, "kind": kind,
                           "reason": entry["reason"], "step": entry["step"], "world_size": entry["world_size"],
                           "recovery_seconds": round(float(entry["at"]) - at, 2),
                           "recorded_seconds": entry["seconds"]})
        code = chief.wait(timeout=1800)
        if other is not None and ended_early and "join" in ended_early:
            kill_node(other.pid)  # started after the job's last batch: it would wait in the rendezvous in vain
        elif other is not None:
            other.wait(timeout=600)
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        error, code = str(exc), None
    finally:
        for process in (chief, other):
            if process is not None and process.poll() is None:
                kill_node(process.pid)
    summary_path = chief_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {"seed": seed, "dtype": dtype, "exit_code": code, "status": summary.get("status"), "error": error,
            "ended_early": ended_early, "changes": len(events),
            "recorded": len(summary.get("membership", [])) - 1 if summary else None,
            "wall_seconds": round(time.perf_counter() - started, 1), "events": events, "run_dir": str(chief_dir)}


def main(args: Any) -> None:
    """Run the membership chaos with the options chaos.py parsed (`rounds`: seeds, `seed`: the first)."""
    work = Path(tempfile.mkdtemp(prefix="dtrain-chaos-membership-"))
    dtypes = [d for d in DTYPES if d in args.dtypes.split(",")]
    cost = default_checkpoint_cost(work)
    print(json.dumps(cost), flush=True)
    references = {dtype: uninterrupted(work, args.batches, dtype) for dtype in dtypes}
    rows: list[dict[str, Any]] = []
    for repeat in range(args.rounds):
        for dtype in dtypes:
            row = chaos_run(work, args.seed + repeat, dtype, args.batches, args.changes)
            model = _final_model(Path(row["run_dir"]))
            row["final_model_max_rel_diff"] = (max_rel_diff(model, references[dtype][0])
                                               if model is not None else None)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "events"}), flush=True)
    events = [event for row in rows for event in row.pop("events")]
    seeds = sorted({row["seed"] for row in rows})
    completed = [row for row in rows if row["status"] == "completed"]
    recoveries = [e["recovery_seconds"] for e in events]

    def diff(dtype: str, seed: int | None = None) -> float | None:
        found = [r["final_model_max_rel_diff"] for r in rows if r["dtype"] == dtype and seed in (None, r["seed"])]
        return None if not found or None in found else max(found)

    headline: dict[str, Any] = {
        "membership_changes_survived": sum(row["changes"] for row in completed),
        "membership_changes_made": sum(row["changes"] for row in rows),
        "runs_completed": f"{len(completed)} of {len(rows)}",
        "final_model_max_rel_diff": diff("float32") if "float32" in dtypes else None,
        "final_model_max_rel_diff_float64": diff("float64") if "float64" in dtypes else None,
        "recovery_seconds_max": max(recoveries) if recoveries else None,
        "recovery_seconds_median": statistics.median(recoveries) if recoveries else None,
        "recovery_seconds_max_loss": max((e["recovery_seconds"] for e in events if e["kind"] == "loss"), default=None),
        "recovery_seconds_max_join": max((e["recovery_seconds"] for e in events if e["kind"] == "join"), default=None),
        "membership_changes_survived_per_seed": [sum(r["changes"] for r in completed if r["seed"] == s)
                                                 for s in seeds],
        "final_model_max_rel_diff_per_seed": [diff("float32", s) for s in seeds] if "float32" in dtypes else None,
        "final_model_max_rel_diff_float64_per_seed": ([diff("float64", s) for s in seeds]
                                                      if "float64" in dtypes else None),
        "recovery_seconds_max_per_seed": [max((e["recovery_seconds"] for e in events if e["seed"] == s),
                                              default=None) for s in seeds],
        "seeds": seeds,
        "changes_per_run": args.changes,
        "batches_per_run": args.batches,
        "reduced": args.reduced,
        "uninterrupted_wall_seconds": {dtype: round(ref[1], 1) for dtype, ref in references.items()},
        "default_checkpoint_cost_percent": cost["checkpoint_cost_percent"],
        "default_checkpoint": cost,
    }
    name = args.results_name or ("chaos_membership_reduced" if args.reduced else "chaos_membership")
    command = (f"python benchmarks/chaos.py --mode membership --rounds {args.rounds} --changes {args.changes} "
               f"--batches {args.batches} --dtypes {','.join(dtypes)}")
    markdown = "\n\n".join([
        f"# Chaos, membership: {args.changes} node losses and joins at random instants, `--nnodes 1:2`"
        + (" (reduced)" if args.reduced else ""),
        f"`{command}` - tests/fixtures/digits.yaml, {args.batches} batches, a checkpoint every 10, seeds "
        f"{', '.join(map(str, seeds))}; node 1 (one worker) SIGKILLed whole or started again, alternately, 2-8 s "
        "after the job trains at its new size.",
        markdown_table(["figure", "value"], [[k, v] for k, v in headline.items()]),
        "## Runs", markdown_table(["seed", "dtype", "exit", "status", "changes", "recorded", "wall s",
                                   "max rel diff", "error"],
                                  [[r["seed"], r["dtype"], r["exit_code"], r["status"], r["changes"], r["recorded"],
                                    r["wall_seconds"], r["final_model_max_rel_diff"], r["error"] or ""]
                                   for r in rows]),
        "## Changes", markdown_table(["seed", "dtype", "change", "kind", "reason", "from batch", "workers",
                                      "recovery s (outside)", "recorded s (from the agents' restart)"],
                                     [[e["seed"], e["dtype"], e["change"], e["kind"], e["reason"], e["step"],
                                       e["world_size"], e["recovery_seconds"], e["recorded_seconds"]]
                                      for e in events]),
    ])
    path = write_results(name, headline, rows, markdown, machine_info(), extra={"changes": events})
    print(json.dumps(headline, indent=2))
    print(f"results: {path} and {path.with_suffix('.md')}")
