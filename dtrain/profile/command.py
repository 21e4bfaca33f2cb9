"""`dtrain diagnose CONFIG`: run the short trials, print the verdict, write diagnosis.json and a chart."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError

DESCRIPTION = """Find out where a distributed run's time goes. Runs short trials of the experiment by itself:
as configured; with aggregation_frequency 1000 (almost no communication); on synthetic data of the same shapes
(no input pipeline); on 1 slot with the same per-slot batch. Prints a verdict with numbers (communication
overhead %, input-pipeline overhead %, scaling efficiency %, the slowest rank and by how much) and what to do,
and writes diagnosis.json and diagnosis.png (the phases of a step on every rank) to the output dir."""


class DiagnoseError(DtrainError):
    """A diagnosis trial failed."""


def add_diagnose_parser(commands: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser("diagnose", help="find communication, input and scaling bottlenecks",
                                 description=DESCRIPTION,
                                 epilog="example: dtrain diagnose examples/fashion_mnist/distributed.yaml --steps 40")
    parser.add_argument("config", type=Path, help="experiment YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as in `dtrain run` (repeatable)")
    parser.add_argument("--steps", type=int, default=30,
                        help="batches per trial (default 30; the first 2 are warm-up and not counted)")
    parser.add_argument("--out", type=Path, help="output dir (default: runs/<name>/diagnose-<time>/)")
    parser.add_argument("--json", action="store_true", help="print diagnosis.json instead of the verdict")
    parser.set_defaults(handler=run_diagnose)
    return parser


def run_diagnose(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dtrain.config import check_buildable, load_config
    from dtrain.profile.chart import write_phase_chart
    from dtrain.profile.diagnose import analyse, trial_plans
    from dtrain.train.rundir import runs_root

    if args.steps < 5:
        raise DiagnoseError(f"--steps {args.steps} is too short to time (2 warm-up batches are left out); "
                            "use 5 or more")
    loaded = load_config(args.config, args.overrides)
    config = loaded.config
    check_buildable(config)
    out = args.out or runs_root() / config.name / time.strftime("diagnose-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    plans = trial_plans(config, args.steps)
    profiles: dict[str, dict[str, Any]] = {}
    bar = tqdm(plans, unit="trial", file=sys.stderr, dynamic_ncols=True, disable=None)
    for plan in bar:
        bar.set_description(f"diagnose: {plan.title}")
        if not sys.stderr.isatty():
            print(f"dtrain diagnose: trial {len(profiles) + 1}/{len(plans)}: {plan.title}", file=sys.stderr, flush=True)
        profiles[plan.name] = _run_trial(args.config, [*args.overrides, *plan.overrides], out / plan.name,
                                         threads=_threads_per_slot(config.resources.world_size))
    bar.close()
    diagnosis = analyse(config, profiles)
    diagnosis["config"] = str(args.config)
    diagnosis["steps_per_trial"] = args.steps
    diagnosis["trials"] = {plan.name: {"title": plan.title, "overrides": list(plan.overrides),
                                       "run_dir": str(out / plan.name), "profile": profiles[plan.name]}
                           for plan in plans}
    chart = write_phase_chart(profiles, [p.name for p in plans], out / "diagnosis.png",
                              title=f"{config.name}: median phase times per step, per rank")
    diagnosis["chart"] = str(chart)
    (out / "diagnosis.json").write_text(json.dumps(diagnosis, indent=2))
    if args.json:
        print(json.dumps(diagnosis, indent=2))
        return 0
    lines = [f"dtrain diagnose: {config.name} on {config.resources.world_size} slot(s), {args.steps} batches per trial",
             *(f"  {line}" for line in diagnosis["verdict"])]
    lines += [f"  advice: {advice}" for advice in diagnosis["advice"]]
    lines += [f"  written: {out / 'diagnosis.json'}, {chart}"]
    print("\n".join(lines))
    return 0


def _threads_per_slot(world_size: int) -> int:
    """CPU threads of one slot of the configured run; the 1-slot trial gets no more (one slot's compute)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores // world_size, 1)


def _run_trial(config: Path, overrides: list[str], run_dir: Path, threads: int) -> dict[str, Any]:
    """One `dtrain run` in a subprocess (its own store under the diagnosis dir); its summary's profile."""
    command = [sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    env = {**os.environ, "DTRAIN_RUNS_ROOT": str(run_dir.parent / "runs"), "OMP_NUM_THREADS": str(threads)}
    env.pop("DTRAIN_LAUNCHER", None)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if done.returncode != 0 or summary.get("status") != "completed" or "profile" not in summary:
        errors = [line for line in done.stderr.splitlines() if line.startswith("dtrain: error")]
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        detail = errors[-1].removeprefix("dtrain: error: ") if errors else last
        raise DiagnoseError(f"the diagnosis trial in {run_dir} failed: {detail}")
    profile: dict[str, Any] = summary["profile"]
    return profile
