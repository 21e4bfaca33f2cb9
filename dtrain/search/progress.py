"""What a search prints while it runs: one line per trial start and end, a one-line tally after each end, and the
table of all trials at the end (with the best trial's checkpoint)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.search.link import BRACKET, INVALID
from dtrain.search.spec import SearchSpec

if TYPE_CHECKING:
    from dtrain.runs.storage import CheckpointStore


def shown(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def state_of(trial: Any) -> str:
    """completed, stopped early (by the searcher), invalid (InvalidHP), errored, running or waiting."""
    name = trial.state.name
    if name == "COMPLETE":
        return "completed"
    if name == "PRUNED":
        return "stopped early"
    if name == "FAIL":
        return "invalid" if trial.user_attrs.get(INVALID) else "errored"
    return name.lower()


def best_metric(trial: Any) -> float | None:
    value = trial.user_attrs.get("best_metric")
    return float(value) if value is not None else (float(trial.value) if trial.value is not None else None)


def best_trial(trials: Sequence[Any], smaller_is_better: bool) -> Any | None:
    """The trial with the best validation metric seen, stopped-early trials included (as Determined ranks them)."""
    ranked = [t for t in trials if state_of(t) in ("completed", "stopped early") and best_metric(t) is not None]
    if not ranked:
        return None
    return (min if smaller_is_better else max)(ranked, key=lambda t: float(best_metric(t) or 0.0))


class SearchProgress:
    def __init__(self, spec: SearchSpec, total: int) -> None:
        self.spec, self.total = spec, total

    def started(self, number: int, params: Mapping[str, Any], bracket: int | None, resumed: bool) -> None:
        where = f" in bracket {bracket + 1}" if bracket is not None else ""
        how = "resumed from its checkpoint" if resumed else "started"
        print(f"dtrain search: trial {number} {how}{where} ({shown(params)})", flush=True)

    def ended(self, number: int, how: str, detail: str, batches: int | None = None) -> None:
        trained = f" after {batches} batches" if batches is not None else ""
        print(f"dtrain search: trial {number} {how}{trained}: {detail}", flush=True)

    def table_line(self, trials: Sequence[Any], running: int) -> None:
        """The compact tally printed after each trial ends."""
        counts: dict[str, int] = {}
        for t in trials:
            counts[state_of(t)] = counts.get(state_of(t), 0) + 1
        done = sum(counts.get(k, 0) for k in ("completed", "stopped early", "errored"))
        best = best_trial(trials, self.spec.smaller_is_better)
        top = (f"; best trial {best.number} {self.spec.metric} {best_metric(best):.4f}" if best is not None else "")
        parts = ", ".join(f"{counts[k]} {k}" for k in ("completed", "stopped early", "errored", "invalid")
                          if counts.get(k))
        print(f"dtrain search: {done} of {self.total} trials done ({parts or 'none yet'}), {running} running here"
              f"{top}", flush=True)

    def final_table(self, trials: Sequence[Any], search_dir: Path) -> str:
        drawn = [t for t in trials if t.state.name != "WAITING"]
        completed = sum(1 for t in drawn if state_of(t) == "completed")
        lines = [f"dtrain search: {completed} of {len(drawn)} trials completed; study in {search_dir}"]
        lines.append(f"  {'trial':>5}  {'state':<13} {'best ' + self.spec.metric:>16} {'batches':>8}  "
                     "hyperparameters")
        for t in sorted(drawn, key=lambda t: t.number):
            value = best_metric(t)
            bracket = f" [bracket {t.user_attrs[BRACKET] + 1}]" if BRACKET in t.user_attrs else ""
            lines.append(f"  {t.number:>5}  {state_of(t):<13} {(f'{value:.4f}' if value is not None else '-'):>16} "
                         f"{t.user_attrs.get('batches_trained', '-'):>8}  {shown(t.params)}{bracket}")
        best = best_trial(drawn, self.spec.smaller_is_better)
        if best is not None:
            run_dir = search_dir / str(best.user_attrs.get("run_dir", f"trial-{best.number}"))
            lines.append(f"  best: trial {best.number} ({self.spec.metric} {best_metric(best):.4f}), checkpoint "
                         f"{best_checkpoint_of(run_dir, self.spec.metric, self.spec.smaller_is_better)}")
        return "\n".join(lines)


def checkpoint_of(run_dir: Path) -> Path | str | None:
    """The checkpoint a trial's run dir names as its latest (summary.json's model file, else what `latest` names in
    its checkpoint storage): a local path or a URL."""
    import json

    from dtrain.runs.rundir import load_run_info
    from dtrain.runs.storage import with_secrets
    from dtrain.train.checkpoint import read_latest_name

    summary = run_dir / "summary.json"
    if summary.is_file():
        named = json.loads(summary.read_text()).get("checkpoint")
        if named:
            return Path(named) if "://" not in str(named) else str(named)
    store = with_secrets(load_run_info(run_dir).checkpoints)
    try:
        latest = read_latest_name(store)
    except OSError:
        return None
    return _located(store, latest) if latest else None


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a trial's run will resume from a checkpoint: its checkpoint storage (the run dir's `checkpoints/`, a
    folder elsewhere or object storage, as run.json records it) names a `latest` one."""
    from dtrain.runs.rundir import load_run_info
    from dtrain.runs.storage import with_secrets
    from dtrain.train.checkpoint import read_latest_name

    if not run_dir.is_dir():
        return False
    try:
        return read_latest_name(with_secrets(load_run_info(run_dir).checkpoints)) is not None
    except OSError:  # the storage cannot be reached now: the trial's own run says what it finds there
        return False


def _located(store: CheckpointStore, name: str) -> Path | str:
    """A name in a checkpoint store as a local Path, or a URL."""
    return store.local_path(name) if store.is_local else store.describe(name)


def best_checkpoint_of(run_dir: Path, metric: str, smaller_is_better: bool) -> Path | str | None:
    """The checkpoint of the trial's best validation of `metric` (the first one to reach the best value), when
    it was kept (`checkpoint_storage.save_trial_best`); else the latest checkpoint (`checkpoint_of`)."""
    import json

    from dtrain.runs.rundir import load_run_info
    from dtrain.runs.storage import with_secrets
    from dtrain.train.checkpoint import META_FILE, MODEL_FILE, checkpoint_name

    summary = run_dir / "summary.json"
    history = json.loads(summary.read_text()).get("validation_history", []) if summary.is_file() else []
    scored = []
    for entry in history:
        metrics = entry.get("metrics", {})
        name = next((n for n in (metric, metric.removeprefix("validation_")) if n in metrics), None)
        if name is not None:
            scored.append((float(metrics[name]), int(entry["step"])))
    if scored:
        best_value = (min if smaller_is_better else max)(value for value, _ in scored)
        step = next(step for value, step in scored if value == best_value)
        store = with_secrets(load_run_info(run_dir).checkpoints)
        kept = checkpoint_name(step)
        try:
            if store.exists(f"{kept}/{META_FILE}"):
                return _located(store, f"{kept}/{MODEL_FILE}")
        except OSError:  # the storage cannot be reached now: name the latest one
            pass
    return checkpoint_of(run_dir)
