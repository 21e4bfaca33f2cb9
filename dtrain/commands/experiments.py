"""`dtrain experiments list|show`: read the run store (runs/metrics.db) that every run registers in."""

from __future__ import annotations

import argparse
import json
import math
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
        print(json.dumps(_strict_json(records), indent=2))
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


def _searcher_metric(config_text: str) -> tuple[str, bool]:
    """The searcher metric of an experiment's config and whether smaller is better (validation_loss, True)."""
    import yaml

    try:
        searcher = (yaml.safe_load(config_text) or {}).get("searcher") or {}
    except yaml.YAMLError:
        searcher = {}
    return str(searcher.get("metric", "validation_loss")), bool(searcher.get("smaller_is_better", True))


def _state(status: str, summary: dict[str, Any] | None) -> str:
    """A trial's status as a search reads it: a run the searcher stopped is `stopped early`."""
    if status == "stopped" and (summary or {}).get("stopped_by_searcher"):
        return "stopped early"
    return {"failed": "errored"}.get(status, status)


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def show_experiment(args: argparse.Namespace) -> int:
    """One experiment in full: its trials, their summaries and validation series, and the config."""
    store = _open_store()
    experiment = store.experiment(args.id)
    if experiment is None:
        store.close()
        raise LaunchError(f"experiment {args.id} is not in the store; `dtrain experiments list` shows the ids")
    trials = store.trials(args.id)
    metric, smaller = _searcher_metric(experiment.config)
    detail: list[dict[str, Any]] = []
    for trial in trials:
        validation = store.metric_series(trial.id, "validation")
        values = [v for _, v in validation.get(metric, validation.get(metric.removeprefix("validation_"), []))
                  if not math.isnan(v)]  # a diverged trial's NaN is no one's best
        best = (min(values) if smaller else max(values)) if values else None
        detail.append({"trial_id": trial.id, "status": _state(trial.status, trial.summary),
                       "run_dir": trial.run_dir, "hyperparameters": trial.hparams, "best_metric": best,
                       "batches": (trial.summary or {}).get("steps_completed"),
                       "world_size": trial.world_size, "summary": trial.summary,
                       "validation": store.metric_series(trial.id, "validation"),
                       "training": {k: v[-1] for k, v in store.metric_series(trial.id, "training").items()}})
    store.close()
    if args.json:
        print(json.dumps(_strict_json({"id": experiment.id, "name": experiment.name, "config": experiment.config,
                                       "trials": detail}), indent=2))
        return ExitCode.OK
    print(f"experiment {experiment.id}: {experiment.name}"
          + (f" - {experiment.description}" if experiment.description else ""))
    print(f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(experiment.created_at))}")
    if len(detail) > 1:  # a search: one line per trial first
        print(f"\n{'trial':>6}  {'state':<14} {'batches':>8} {'best ' + metric:>18}  hyperparameters")
        for shown in detail:
            best_text = f"{shown['best_metric']:.4f}" if shown["best_metric"] is not None else "-"
            searched = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in _flat(shown["hyperparameters"]).items())
            batches = shown["batches"] if shown["batches"] is not None else "-"
            print(f"{shown['trial_id']:>6}  {shown['status']:<14} {batches:>8} {best_text:>18}  {searched}")
        ranked = [s for s in detail if s["best_metric"] is not None]
        if ranked:
            top = (min if smaller else max)(ranked, key=lambda s: float(s["best_metric"]))
            checkpoint = (top["summary"] or {}).get("checkpoint")
            print(f"best: trial {top['trial_id']} ({metric} {top['best_metric']:.4f}), checkpoint {checkpoint}")
    for shown in detail:
        print(f"\ntrial {shown['trial_id']}: {shown['status']}, {shown['world_size']} worker(s), run dir "
              f"{shown['run_dir']}")
        if (shown["summary"] or {}).get("stopped_by_searcher"):
            print(f"  stopped by the searcher: {shown['summary']['stopped_by_searcher']}")
        summary = shown["summary"] or {}
        if summary:
            rate = summary.get("samples_per_second", 0)  # None for an SVM: an SMO solve has no samples per second
            print(f"  {summary.get('steps_completed')} batches, {summary.get('wall_seconds', 0):.0f} s, "
                  + (f"{rate:,.0f} samples/s, " if rate is not None else "")
                  + f"checkpoint {summary.get('checkpoint')}")
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


def _strict_json(value: Any) -> Any:
    """`value` with its non-finite floats as the strings "NaN", "Infinity" and "-Infinity": json.dumps would write
    the bare tokens, which are not JSON (jq and most parsers refuse them), and a diverged trial's loss is one."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value
