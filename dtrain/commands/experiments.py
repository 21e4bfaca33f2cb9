"""`dtrain experiments list|show`: read the run store (runs/metrics.db) that every run registers in."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from dtrain.errors import ExitCode, LaunchError
from dtrain.runs.store import RunStore


def register(subcommands: Any) -> argparse.ArgumentParser:
    """Add `dtrain experiments` and its two actions."""
    experiments = subcommands.add_parser("experiments", help="list or show runs recorded in the store",
                                         description="Read the run store (runs/metrics.db, or "
                                                     "$DTRAIN_RUNS_ROOT/metrics.db).")
    which = experiments.add_subparsers(dest="action", metavar="ACTION")
    listing = which.add_parser("list", help="one line per experiment")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(handler=list_experiments)
    show = which.add_parser("show", help="config, status, summary and metrics of one experiment")
    show.add_argument("id", type=int, help="experiment id (first column of `dtrain experiments list`)")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(handler=show_experiment)
    return experiments


def _open_store() -> RunStore:
    from dtrain.runs.rundir import store_path  # imported here: it loads the config schema, which --help needs not

    path = store_path()
    if not path.is_file():
        raise LaunchError(f"no run store at {path}; run an experiment first, or set DTRAIN_RUNS_ROOT to the "
                          "directory that holds metrics.db")
    return RunStore(path)


def list_experiments(args: argparse.Namespace) -> int:
    """One line per experiment: id, name, when, how its latest trial stands, its last validation."""
    store = _open_store()
    rows = store.experiments()
    store.close()
    records: list[dict[str, Any]] = []
    for experiment, trial in rows:
        summary = (trial.summary if trial else None) or {}
        records.append({"id": experiment.id, "name": experiment.name,
                        "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(experiment.created_at)),
                        "status": trial.status if trial else "-", "workers": trial.world_size if trial else None,
                        "batches": summary.get("steps_completed"), "validation": summary.get("validation") or {},
                        "run_dir": trial.run_dir if trial else None})
    if args.json:
        print(json.dumps(records, indent=2))
        return ExitCode.OK
    if not records:
        print("no experiments yet")
        return ExitCode.OK
    print(f"{'id':>4}  {'name':<28} {'created':<16}  {'status':<9} {'workers':>7} {'batches':>8}  validation")
    for r in records:
        metrics = " ".join(f"{k}={v:.4f}" for k, v in sorted(r["validation"].items()))
        print(f"{r['id']:>4}  {r['name'][:28]:<28} {r['created']:<16}  {r['status']:<9} {r['workers'] or '-':>7} "
              f"{r['batches'] if r['batches'] is not None else '-':>8}  {metrics}")
    return ExitCode.OK


def show_experiment(args: argparse.Namespace) -> int:
    """One experiment in full: its trials, their summaries and validation series, and the config."""
    store = _open_store()
    experiment = store.experiment(args.id)
    if experiment is None:
        store.close()
        raise LaunchError(f"experiment {args.id} is not in the store; `dtrain experiments list` shows the ids")
    trials = store.trials(args.id)
    detail: list[dict[str, Any]] = []
    for trial in trials:
        detail.append({"trial_id": trial.id, "status": trial.status, "run_dir": trial.run_dir,
                       "world_size": trial.world_size, "summary": trial.summary,
                       "validation": store.metric_series(trial.id, "validation"),
                       "training": {k: v[-1] for k, v in store.metric_series(trial.id, "training").items()}})
    store.close()
    if args.json:
        print(json.dumps({"id": experiment.id, "name": experiment.name, "config": experiment.config,
                          "trials": detail}, indent=2))
        return ExitCode.OK
    print(f"experiment {experiment.id}: {experiment.name}"
          + (f" - {experiment.description}" if experiment.description else ""))
    print(f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(experiment.created_at))}")
    for shown in detail:
        print(f"\ntrial {shown['trial_id']}: {shown['status']}, {shown['world_size']} worker(s), run dir "
              f"{shown['run_dir']}")
        summary = shown["summary"] or {}
        if summary:
            print(f"  {summary.get('steps_completed')} batches, {summary.get('wall_seconds', 0):.0f} s, "
                  f"{summary.get('samples_per_second', 0):,.0f} samples/s, checkpoint {summary.get('checkpoint')}")
        if shown["validation"]:
            names = sorted(shown["validation"])
            steps = sorted({step for series in shown["validation"].values() for step, _ in series})
            print("  validation:")
            print("    " + f"{'batch':>8}  " + "  ".join(f"{n:>12}" for n in names))
            lookup = {n: dict(shown["validation"][n]) for n in names}
            for step in steps:
                print("    " + f"{step:>8}  " + "  ".join(
                    f"{lookup[n][step]:>12.4f}" if step in lookup[n] else f"{'':>12}" for n in names))
        if shown["training"]:
            last = ", ".join(f"{k} {v[1]:.4g}" for k, v in sorted(shown["training"].items()))
            print(f"  last training report: {last}")
    print("\nconfig:\n" + "\n".join("  " + line for line in experiment.config.splitlines()))
    return ExitCode.OK

