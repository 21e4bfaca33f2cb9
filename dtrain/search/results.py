"""A search's results, written into the search dir when it ends: `results.json` (every trial: hyperparameters,
state, best metric, length trained, reported values, run dir, checkpoint), `search.png` (the best metric against the
training spent, and every trial's curve with the rung cuts) and TensorBoard's hparams view (`tensorboard/`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dtrain.search.link import BRACKET, STOPPED
from dtrain.search.progress import best_checkpoint_of, best_metric, best_trial, state_of
from dtrain.search.spec import SearchSpec

RESULTS_FILE = "results.json"
PLOT_FILE = "search.png"


def trial_records(trials: Sequence[Any], search_dir: Path, metric: str = "validation_loss",
                  smaller_is_better: bool = True) -> list[dict[str, Any]]:
    """Every drawn trial as results.json lists it; `checkpoint` is the one of its best validation where it was
    kept, and `bracket` is numbered from 1, as the terminal numbers it."""
    records = []
    for t in sorted(trials, key=lambda t: t.number):
        if t.state.name == "WAITING":
            continue
        run_dir = search_dir / str(t.user_attrs.get("run_dir", f"trial-{t.number}"))
        checkpoint = best_checkpoint_of(run_dir, metric, smaller_is_better)
        records.append({
            "trial": t.number, "state": state_of(t), "hyperparameters": dict(t.params),
            "best_metric": best_metric(t), "final_metric": t.value,
            "batches_trained": t.user_attrs.get("batches_trained"),
            "epochs_trained": t.user_attrs.get("epochs_trained"),
            "reported": {str(step): value for step, value in sorted(t.intermediate_values.items())},
            "bracket": t.user_attrs[BRACKET] + 1 if t.user_attrs.get(BRACKET) is not None else None,
            "stopped_by_searcher": t.user_attrs.get(STOPPED),
            "invalid_hp": t.user_attrs.get("invalid_hp"), "error": t.user_attrs.get("error"),
            "run_dir": str(run_dir), "checkpoint": str(checkpoint) if checkpoint else None,
            "ended": t.datetime_complete.isoformat() if t.datetime_complete else None})
    return records


def spent_curve(records: Sequence[dict[str, Any]], smaller_is_better: bool) -> list[tuple[int, float]]:
    """(batches spent by all trials ended so far, best metric so far), in the order the trials ended."""
    ended = sorted((r for r in records if r["ended"] and r["best_metric"] is not None), key=lambda r: r["ended"])
    spent, best, points = 0, math.inf if smaller_is_better else -math.inf, []
    for r in ended:
        spent += int(r["batches_trained"] or 0)
        best = min(best, r["best_metric"]) if smaller_is_better else max(best, r["best_metric"])
        points.append((spent, best))
    return points


def plot(records: Sequence[dict[str, Any]], spec: SearchSpec, rungs: Sequence[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    curve = spent_curve(records, spec.smaller_is_better)
    if curve:
        left.step([x for x, _ in curve], [y for _, y in curve], where="post", marker="o")
    left.set_xlabel("training batches spent by the trials ended so far")
    left.set_ylabel(f"best {spec.metric}")
    left.set_title("best metric against training spent")
    for r in records:
        points = sorted((float(k), v) for k, v in r["reported"].items())
        if points:
            style = "-" if r["state"] == "completed" else ":"
            right.plot([x for x, _ in points], [y for _, y in points], style, marker=".", alpha=0.8,
                       label=f"trial {r['trial']}")
    for units in rungs:
        right.axvline(units, color="grey", linewidth=0.8, linestyle="--")
    right.set_xlabel(f"{spec.unit} trained (dashed: rung cuts)")
    right.set_ylabel(spec.metric)
    right.set_title("trials (dotted: stopped early)")
    if 0 < len(right.get_lines()) <= 16:
        right.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def tensorboard_hparams(records: Sequence[dict[str, Any]], spec: SearchSpec, logdir: Path) -> None:
    """One hparams entry per trial (its hyperparameters, best metric, length trained), for TensorBoard's HPARAMS
    tab; written by torch's SummaryWriter.add_hparams."""
    from torch.utils.tensorboard import SummaryWriter

    for r in records:
        if r["best_metric"] is None:
            continue
        params = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in r["hyperparameters"].items()}
        params["state"] = r["state"]
        writer = SummaryWriter(log_dir=str(logdir / f"trial-{r['trial']}"))
        writer.add_hparams(params, {f"hparam/best_{spec.metric}": r["best_metric"],
                                    "hparam/batches_trained": float(r["batches_trained"] or 0)}, run_name=".")
        writer.close()


def write_results(trials: Sequence[Any], spec: SearchSpec, search_dir: Path, study_name: str, storage: str,
                  rungs: Sequence[int] = ()) -> Iterator[str]:
    """Write results.json, search.png and the TensorBoard hparams; yield the lines that point at them."""
    records = trial_records(trials, search_dir, spec.metric, spec.smaller_is_better)
    best = best_trial([t for t in trials if t.state.name != "WAITING"], spec.smaller_is_better)
    payload = {"study_name": study_name, "storage": storage, "searcher": spec.name, "metric": spec.metric,
               "smaller_is_better": spec.smaller_is_better, "best_trial": best.number if best else None,
               "batches_trained": sum(int(r["batches_trained"] or 0) for r in records), "trials": records}
    (search_dir / RESULTS_FILE).write_text(json.dumps(payload, indent=2))
    plot(records, spec, rungs, search_dir / PLOT_FILE)
    tensorboard_hparams(records, spec, search_dir / "tensorboard")
    yield f"  results     {search_dir / RESULTS_FILE}; plot {search_dir / PLOT_FILE}"
    yield f"  TensorBoard tensorboard --logdir {search_dir / 'tensorboard'} (HPARAMS tab)"
    own = {f"sqlite:///{search_dir / 'study.db'}", f"sqlite:///{(search_dir / 'study.db').resolve()}"}
    shown = search_dir if storage in own else storage  # a search dir's own study: name the dir
    yield f"  dashboard   dtrain dashboard {shown}  (Optuna study {study_name!r} in the browser)"
