"""Chaos: 20 random SIGKILLs over a longer run. Does training survive them all and end bitwise identical to an
uninterrupted run, and how much work do the crashes cost?

The workload is examples/synthetic_mlp (2 workers, a 3.7 M-parameter MLP, 15 MB checkpoints) for 600 batches
with a checkpoint every 30. Two ways to kill (`--mode`):

- `outside` (the default): a killer thread outside the run sends SIGKILL to a random worker process at random
  instants (seeded), spread over the clean run's duration, as the OOM killer or a lost machine would: the
  kill may land anywhere, in a step, a checkpoint write, a restart, an import.
- `injected`: `faults.kills` at distinct random batches on random ranks, a quarter of them in the middle of a
  checkpoint write (rank 0, the writer). These hit two fixed code points only, but say exactly where.

Either way the elastic agent restarts both workers, which resume from `checkpoints/latest`. The clean run
and the chaos run alternate (clean, chaos, chaos, clean, ...) over `--rounds` rounds (3 by default), each
chaos round with its own seed.

Headline: `kills` (fired, from the run's logs/faults.jsonl), `restarts_survived` (restarts in summary.json
of runs that completed), `final_model_identical` (every chaos run's final model.pt equals the clean one byte
for byte), `steps_recomputed` (batches trained again after a kill: the batches done before it minus the
checkpoint the restart resumed from, summed), plus the wall-time cost per kill.

    python benchmarks/chaos.py            # 3 rounds of 20 outside kills, 600 batches: about 20-30 minutes on 2 cores
    python benchmarks/chaos.py --quick    # 1 round, 4 kills, 150 batches
    python benchmarks/chaos.py --mode membership   # 3 seeds x 10 node losses and joins, float32 and float64
    python benchmarks/chaos.py --mode membership --quick   # 1 seed, one loss and one join (chaos_membership_quick)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, descendants, machine_info, markdown_table, process_parents, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "synthetic_mlp" / "mlp.yaml"
ANNOUNCE = re.compile(r": (starting|resuming at batch (\d+));")


def draw_kills(count: int, total_batches: int, seed: int, checkpoint_share: float = 0.25) -> list[dict[str, Any]]:
    """`count` kills at distinct random batches in [2, total], in batch order; a share of them inside
    checkpoint writes (rank 0), the others at the start of a batch on a random rank."""
    rng = random.Random(seed)
    batches = sorted(rng.sample(range(2, total_batches + 1), count))
    kills = []
    for batch in batches:
        if rng.random() < checkpoint_share:
            kills.append({"rank": 0, "batch": batch, "during": "checkpoint"})
        else:
            kills.append({"rank": rng.randrange(2), "batch": batch, "during": "step"})
    return kills


def run(run_dir: Path, overrides: list[str], timeout: float) -> tuple[int, float, str]:
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    env["DTRAIN_RUNS_ROOT"] = str(run_dir.parent / "store")
    args = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--run-dir", str(run_dir)]
    for override in overrides:
        args += ["--set", override]
    started = time.perf_counter()
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    return result.returncode, time.perf_counter() - started, result.stderr


def worker_pids(root: int) -> list[int]:
    """The live `dtrain.worker` processes under process `root` (the `dtrain run` it started)."""
    pids = []
    for pid in descendants(process_parents(), root):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if "dtrain.worker" in command:
            pids.append(pid)
    return pids


def run_killing_from_outside(run_dir: Path, overrides: list[str], timeout: float, kills: int, spread: float,
                             seed: int) -> tuple[int, float, str, list[dict[str, Any]]]:
    """Run while a thread SIGKILLs a random worker `kills` times, the gaps drawn uniformly from
    [0.5, 1.5] x `spread` seconds (seeded). Returns the exit code, wall seconds, stderr and the kills sent."""
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    env["DTRAIN_RUNS_ROOT"] = str(run_dir.parent / "store")
    args = [sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--run-dir", str(run_dir)]
    for override in overrides:
        args += ["--set", override]
    rng = random.Random(seed)
    sent: list[dict[str, Any]] = []
    done = threading.Event()
    started = time.perf_counter()
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)

    def killer() -> None:
        while len(sent) < kills and not done.wait(rng.uniform(0.5, 1.5) * spread):
            victims = sorted(worker_pids(process.pid))
            if not victims:
                continue  # between attempts: no worker to kill, draw the next instant
            victim = rng.choice(victims)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            sent.append({"kill": len(sent) + 1, "pid": victim, "at_seconds": round(time.perf_counter() - started, 2)})

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
    done.set()
    thread.join()
    return process.returncode, time.perf_counter() - started, stderr, sent


def final_model(run_dir: Path) -> bytes | None:
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    if summary.get("status") != "completed":
        return None
    return Path(summary["checkpoint"]).read_bytes()


def recomputed_steps(run_dir: Path) -> tuple[int, list[dict[str, Any]]]:
    """Batches trained again: for every kill, the batches done before it minus where the next attempt resumed."""
    fired = [json.loads(line) for line in (run_dir / "logs" / "faults.jsonl").read_text().splitlines()
             if line.strip()]
    log = (run_dir / "logs" / "rank-0.log").read_text()
    starts = [int(m.group(2)) if m.group(2) else 0 for m in ANNOUNCE.finditer(log)]
    rows, total = [], 0
    for i, kill in enumerate(fired):
        resumed = starts[i + 1] if i + 1 < len(starts) else None
        lost = kill["steps_done"] - resumed if resumed is not None else None
        total += lost or 0
        rows.append({**{k: kill[k] for k in ("rank", "batch", "during", "steps_done", "restart")},
                     "resumed_from": resumed, "steps_recomputed": lost})
    return total, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="kills per chaos run (default 20)")
    parser.add_argument("--batches", type=int, default=600, help="training length in batches (default 600)")
    parser.add_argument("--checkpoint-every", type=int, default=30, help="batches between checkpoints (default 30)")
    parser.add_argument("--rounds", type=int, default=3, help="clean/chaos rounds, alternating, each with its "
                        "own seed (default 3; 1 with --quick)")
    parser.add_argument("--mode", choices=("outside", "injected", "membership"), default="outside",
                        help="SIGKILL workers from outside at random instants (default), inject faults.kills at "
                             "random batches, or lose and join whole nodes of a --nnodes 1:2 job "
                             "(benchmarks/chaos_membership.py)")
    parser.add_argument("--changes", type=int, default=10, help="membership mode: losses and joins per run, "
                        "alternately (default 10)")
    parser.add_argument("--dtypes", default="float32,float64", help="membership mode: the runs' dtypes "
                        "(default float32,float64)")
    parser.add_argument("--reduced", action="store_true", help="membership mode: label the results reduced "
                        "(fewer seeds, changes or batches than the defaults), in chaos_membership_reduced.json")
    parser.add_argument("--results-name", help="membership mode: the results' file name (default "
                        "chaos_membership)")
    parser.add_argument("--seed", type=int, default=8, help="seed of the first round's kill schedule")
    parser.add_argument("--quick", action="store_true", help="4 kills over 150 batches, a checkpoint every 20; "
                        "membership mode: 1 seed, one loss and one join, in chaos_membership_quick.json")
    args = parser.parse_args()
    if args.mode == "membership":
        import chaos_membership

        if args.quick:  # a short check, not a result
            args.rounds, args.changes, args.reduced = 1, 2, True
            args.results_name = args.results_name or "chaos_membership_quick"
        if args.batches == 600:  # the outside mode's default; the membership runs' own: a join's new node starts
            args.batches = 1500  # for ~30 s on 2 busy cores while the job trains on, so 10 changes need ~1200
        chaos_membership.main(args)
        return
    if args.quick:
        args.kills, args.batches, args.checkpoint_every, args.rounds = 4, 150, 20, 1
    common = [f"searcher.max_length={{batches: {args.batches}}}",
              f"min_checkpoint_period={{batches: {args.checkpoint_every}}}",
              "checkpoint_policy=none", "scheduling_unit=50", f"max_restarts={args.kills + 5}"]
    timeout = 120 + 60 * args.kills + args.batches
    work = Path(tempfile.mkdtemp(prefix="dtrain-chaos-"))
    clean_models: list[bytes] = []
    chaos_models: dict[int, bytes | None] = {}
    kill_rows: list[dict[str, Any]] = []

    def clean(repeat: int) -> dict[str, Any]:
        run_dir = work / f"clean-{repeat}"
        code, seconds, stderr = run(run_dir, common, timeout)
        model = final_model(run_dir)
        if code != 0 or model is None:
            raise SystemExit(f"the clean run failed (exit {code}): {stderr.strip().splitlines()[-1:]}")
        clean_models.append(model)
        return {"wall_seconds": seconds, "exit_code": code}

    def chaos_outside(repeat: int) -> dict[str, Any]:
        run_dir = work / f"chaos-{repeat}"
        clean_wall = min(r["wall_seconds"] for r in clean_rows_so_far()) if clean_rows_so_far() else 30.0
        code, seconds, stderr, sent = run_killing_from_outside(run_dir, common, timeout, args.kills,
                                                               clean_wall / args.kills, args.seed + repeat)
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
        kill_rows.extend({"round": repeat, **row} for row in sent)
        chaos_models[repeat] = final_model(run_dir)
        return {"wall_seconds": seconds, "exit_code": code, "status": summary.get("status"), "seed": args.seed + repeat,
                "kills_planned": args.kills, "kills": len(sent), "restarts": summary.get("restarts"),
                "steps_recomputed": None,
                "error": stderr.strip().splitlines()[-1] if code != 0 and stderr.strip() else None}

    finished: list[dict[str, Any]] = []

    def clean_rows_so_far() -> list[dict[str, Any]]:
        return finished

    def clean_recorded(repeat: int) -> dict[str, Any]:
        row = clean(repeat)
        finished.append(row)
        return row

    def chaos(repeat: int) -> dict[str, Any]:
        run_dir = work / f"chaos-{repeat}"
        kills = draw_kills(args.kills, args.batches, args.seed + repeat)
        code, seconds, stderr = run(run_dir, common + [f"faults.kills={json.dumps(kills)}"], timeout)
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
        recomputed, rows = recomputed_steps(run_dir)
        kill_rows.extend({"round": repeat, **row} for row in rows)
        chaos_models[repeat] = final_model(run_dir)
        return {"wall_seconds": seconds, "exit_code": code, "status": summary.get("status"), "seed": args.seed + repeat,
                "kills_planned": len(kills), "kills": len(rows), "restarts": summary.get("restarts"),
                "steps_recomputed": recomputed,
                "error": stderr.strip().splitlines()[-1] if code != 0 and stderr.strip() else None}

    chaos_run = chaos_outside if args.mode == "outside" else chaos
    rows = alternate([("clean", clean_recorded), ("chaos", chaos_run)], args.rounds)
    chaos_rows = [r for r in rows if r["variant"] == "chaos"]
    clean_rows = [r for r in rows if r["variant"] == "clean"]
    for r in chaos_rows:
        r["final_model_identical"] = chaos_models[r["repeat"]] == clean_models[0]
    identical = all(r["final_model_identical"] for r in chaos_rows) and all(m == clean_models[0] for m in clean_models)
    kills = sum(r["kills"] for r in chaos_rows)
    clean_wall = sum(r["wall_seconds"] for r in clean_rows) / len(clean_rows)
    chaos_wall = sum(r["wall_seconds"] for r in chaos_rows) / len(chaos_rows)
    headline = {
        "kills": kills,
        "restarts_survived": sum(r["restarts"] or 0 for r in chaos_rows if r["status"] == "completed"),
        "final_model_identical": identical,
        "mode": args.mode,
        "rounds": args.rounds,
        "seeds": [r["seed"] for r in chaos_rows],
        "steps_recomputed": (sum(r["steps_recomputed"] for r in chaos_rows) if args.mode == "injected" else None),
        "batches_per_run": args.batches,
        "checkpoint_every": args.checkpoint_every,
        "seconds_per_kill": (chaos_wall - clean_wall) / max(kills / len(chaos_rows), 1),
        "clean_wall_seconds": clean_wall,
        "chaos_wall_seconds": chaos_wall,
    }
    name = "chaos_quick" if args.quick else "chaos"
    markdown = "\n\n".join([
        f"# Chaos: {args.kills} random kills over {args.batches} batches (examples/synthetic_mlp, 2 workers)",
        f"`python benchmarks/chaos.py{' --quick' if args.quick else ''} --mode {args.mode}` - checkpoint every "
        f"{args.checkpoint_every} batches, kills ({args.mode}) drawn with seed {args.seed} (+ round).",
        markdown_table(["figure", "value"], [[k, v] for k, v in headline.items()]),
        "## Runs", markdown_table(["variant", "round", "exit", "wall s", "kills", "restarts", "recomputed",
                                   "identical"],
                                  [[r["variant"], r["repeat"], r["exit_code"], r["wall_seconds"], r.get("kills", "-"),
                                    r.get("restarts", "-"), r.get("steps_recomputed", "-"),
                                    r.get("final_model_identical", "-")] for r in rows]),
        "## Kills", (markdown_table(["round", "rank", "batch", "during", "batches done", "resumed from",
                                     "recomputed"],
                                    [[k["round"], k["rank"], k["batch"], k["during"], k["steps_done"],
                                      k["resumed_from"], k["steps_recomputed"]] for k in kill_rows])
                     if args.mode == "injected" else
                     markdown_table(["round", "kill", "worker pid", "seconds into the run"],
                                    [[k["round"], k["kill"], k["pid"], k["at_seconds"]] for k in kill_rows])),
    ])
    path = write_results(name, headline, rows, markdown, machine_info(), extra={"kills": kill_rows})
    print(json.dumps(headline, indent=2))
    print(f"results: {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
