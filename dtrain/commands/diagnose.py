"""`dtrain diagnose CONFIG`: run the short trials, print the verdict, write diagnosis.json and a chart.

What the trials are and what their profiles say lives in dtrain.diagnose; this is the command around it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dtrain.errors import DiagnoseError, ExitCode

DESCRIPTION = """Find out where a distributed run's time goes. Runs short trials of the experiment by itself:
as configured; with aggregation_frequency 1000 (almost no communication); on synthetic data of the same shapes
(no input pipeline); on 1 slot with the same per-slot batch. Prints a verdict with numbers (communication
overhead %, input-pipeline overhead %, scaling efficiency %, the slowest rank and by how much) and what to do,
and writes diagnosis.json and diagnosis.png (the phases of a step on every rank) to the output dir. With --repeats N
the trials run N times in alternating order and every figure is the median of the repeats."""


def register(subcommands: Any) -> argparse.ArgumentParser:
    """Add `dtrain diagnose` and its options."""
    parser = subcommands.add_parser(
        "diagnose", help="find communication, input and scaling bottlenecks", description=DESCRIPTION,
        epilog="example: dtrain diagnose examples/fashion_mnist/distributed.yaml --steps 40")
    parser.add_argument("config", type=Path, help="experiment YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as in `dtrain run` (repeatable)")
    parser.add_argument("--steps", type=int, default=30,
                        help="batches per trial (default 30; the first 2 are warm-up and not counted)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the trials this many times, in alternating order (forward, then backward), and "
                             "report the median of each figure with every repeat's beside it; on a shared or noisy "
                             "machine a slow spell then falls on both sides of each comparison (default 1)")
    parser.add_argument("--out", type=Path, help="output dir (default: runs/<name>/diagnose-<time>/)")
    parser.add_argument("--json", action="store_true", help="print diagnosis.json instead of the verdict")
    parser.set_defaults(handler=run_diagnose)
    return parser


def run_diagnose(args: argparse.Namespace) -> int:
    """Run every trial (a progress bar, or one line per trial where stderr is no terminal), then analyse."""
    from tqdm import tqdm

    from dtrain.config import check_buildable, load_config
    from dtrain.diagnose.analysis import analyse, combine
    from dtrain.diagnose.chart import write_phase_chart
    from dtrain.diagnose.trials import run_trial, threads_per_slot, trial_dir, trial_plans, trial_runs
    from dtrain.runs.rundir import runs_root

    if args.steps < 5:
        raise DiagnoseError(f"--steps {args.steps} is too short to time (2 warm-up batches are left out); "
                            "use 5 or more")
    if args.repeats < 1:
        raise DiagnoseError(f"--repeats {args.repeats}: the trials run at least once; use 1 or more")
    loaded = load_config(args.config, args.overrides)
    config = loaded.config
    check_buildable(config)
    out = args.out or runs_root() / config.name / time.strftime("diagnose-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    plans = trial_plans(config, args.steps)
    runs = trial_runs(plans, args.repeats)
    profiles: list[dict[str, dict[str, Any]]] = [{} for _ in range(args.repeats)]
    bar = tqdm(runs, unit="trial", file=sys.stderr, dynamic_ncols=True, disable=None)
    for done, (repeat, plan) in enumerate(bar):
        label = plan.title if args.repeats == 1 else f"{plan.title}, repeat {repeat + 1}/{args.repeats}"
        bar.set_description(f"diagnose: {label}")
        if not sys.stderr.isatty():
            print(f"dtrain diagnose: trial {done + 1}/{len(runs)}: {label}", file=sys.stderr, flush=True)
        profiles[repeat][plan.name] = run_trial(args.config, [*args.overrides, *plan.overrides],
                                                out / trial_dir(plan.name, repeat, args.repeats),
                                                threads=threads_per_slot(config.resources.world_size))
    bar.close()
    diagnosis = combine(config, [analyse(config, found) for found in profiles])
    diagnosis["config"] = str(args.config)
    diagnosis["steps_per_trial"] = args.steps
    diagnosis["trials"] = {plan.name: {"title": plan.title, "overrides": list(plan.overrides),
                                       "run_dir": str(out / trial_dir(plan.name, 0, args.repeats)),
                                       "profile": profiles[0][plan.name]}
                           for plan in plans}
    title = f"{config.name}: median phase times per step, per rank"
    if args.repeats > 1:
        for plan in plans:
            diagnosis["trials"][plan.name]["repeats"] = [
                {"run_dir": str(out / trial_dir(plan.name, repeat, args.repeats)), "profile": found[plan.name]}
                for repeat, found in enumerate(profiles)]
        title += f" (repeat 1 of {args.repeats})"
    chart = write_phase_chart(profiles[0], [p.name for p in plans], out / "diagnosis.png", title=title)
    diagnosis["chart"] = str(chart)
    (out / "diagnosis.json").write_text(json.dumps(diagnosis, indent=2))
    if args.json:
        print(json.dumps(diagnosis, indent=2))
        return ExitCode.OK
    repeated = f", {args.repeats} repeats" if args.repeats > 1 else ""
    lines = [f"dtrain diagnose: {config.name} on {config.resources.world_size} slot(s), {args.steps} batches per "
             f"trial{repeated}",
             *(f"  {line}" for line in diagnosis["verdict"])]
    lines += [f"  advice: {advice}" for advice in diagnosis["advice"]]
    lines += [f"  written: {out / 'diagnosis.json'}, {chart}"]
    print("\n".join(lines))
    return ExitCode.OK
