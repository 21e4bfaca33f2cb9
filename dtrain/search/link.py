"""The link between a running trial and its search: how a trial learns what length to train to and whether the
searcher stops it early.

The search runner writes `search-trial.json` into a trial's run dir before it starts the trial. The trial's chief
process opens it (`SearchLink.from_run_dir`) and, after every validation, calls `report(units, metric)`: that
records the metric in the Optuna study (an intermediate value, and the trial's value at every ASHA rung it has
reached) and says whether the trial goes on. The decision is taken inside the trial, from the study every trial of
the search shares (on one machine or several), so a trial stops exactly at the validation that decides it:

- `asha`: Determined 0.38's stop-based adaptive ASHA (`asha_stopping.go`): at a validation that has reached rung i
  (units >= the rung's units) and not yet recorded there, the metric is recorded at the rung and the trial goes on
  only if it ranks in the top max(floor(n / divisor), 1) of the n trials of its bracket recorded at that rung so far
  (trials rejected as InvalidHP leave the tables).
- `optuna`: Optuna's own pruner (`trial.report` then `trial.should_prune()`).

Optuna's intermediate values are keyed by whole `time_metric` units (the steps Optuna's pruners and dashboard see).
- `none`: the metric is recorded, the trial is never stopped (random and grid searches).

A stopped trial checkpoints and ends with status `stopped` (exit code 3), like any stopped run: its checkpoint stays
in its run dir. The study remembers the stop (user attr `stopped_by_searcher`), which the runner reads.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtrain.runs.rundir import SEARCH_LINK_FILE as LINK_FILE
from dtrain.search.study import rdb_storage, storage_lock

STOPPED = "stopped_by_searcher"
INVALID = "invalid_hp"
BRACKET = "bracket"


def rung_attr(index: int) -> str:
    return f"rung_{index}"


@dataclass(frozen=True)
class LinkRecord:
    """The content of search-trial.json."""

    storage: str
    study_name: str
    trial_id: int
    trial_number: int
    metric: str
    smaller_is_better: bool
    time_metric: str  # batches, records or epochs: the unit of max_time and of the rungs
    max_time: int
    rule: dict[str, Any] = field(default_factory=lambda: {"kind": "none"})

    def write(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{LINK_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(run_dir / LINK_FILE)


def make_pruner(rule: Mapping[str, Any]) -> Any:
    """The Optuna pruner a rule of kind `optuna` names (NopPruner for the others), its resources in time_metric
    units: `min_time` (the first rung), `max_time`, `divisor` (the reduction factor)."""
    import optuna

    if rule.get("kind") != "optuna":
        return optuna.pruners.NopPruner()
    name = rule.get("pruner", "none")
    low, high, factor = int(rule["min_time"]), int(rule["max_time"]), max(int(rule["divisor"]), 2)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=low, max_resource=high, reduction_factor=factor)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=low, reduction_factor=factor)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=low)
    return optuna.pruners.NopPruner()


def rung_continues(own: float, others: list[float], divisor: float, smaller_is_better: bool) -> bool:
    """Determined's stop rule at one rung: `own` joins the `others` recorded there; it goes on when its rank
    (0 = best, ahead of equal values) is below max(floor(n / divisor), 1)."""
    from dtrain.search.asha import Rung

    sign = 1.0 if smaller_is_better else -1.0
    rung = Rung(sorted(sign * v for v in others))
    return rung.continue_training(own, divisor, smaller_is_better)


class SearchLink:
    """A trial's view of its search (chief process only: it opens the study's storage)."""

    def __init__(self, record: LinkRecord) -> None:
        self.record = record
        self.stopped = False
        self._study: Any = None
        self._storage: Any = None

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> SearchLink | None:
        """The link of the trial in `run_dir`, or None when the run is not a trial of a search."""
        path = Path(run_dir) / LINK_FILE
        if not path.is_file():
            return None
        return cls(LinkRecord(**json.loads(path.read_text())))

    @property
    def max_length(self) -> tuple[int, str]:
        """How long the trial trains at most: (value, unit), e.g. (4, "epochs")."""
        return self.record.max_time, self.record.time_metric

    def _open(self) -> tuple[Any, Any]:
        import optuna

        if self._study is None:
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            self._storage = rdb_storage(self.record.storage)
            self._study = optuna.load_study(study_name=self.record.study_name, storage=self._storage,
                                            pruner=make_pruner(self.record.rule))
        return self._study, self._storage

    def report(self, units: Mapping[str, float], metric: float) -> str | None:
        """Record a validation's searcher metric reached after `units` (batches, records, epochs); None to go on,
        or the reason the searcher stops the trial."""
        import optuna

        if self.stopped:
            return "stopped earlier by the searcher"
        if metric is None or not math.isfinite(metric):
            return None
        study, storage = self._open()
        trial = optuna.trial.Trial(study, self.record.trial_id)
        frozen = storage.get_trial(self.record.trial_id)
        step = int(float(units[self.record.time_metric]) + 1e-9)  # Optuna's steps: whole time_metric units
        if step not in frozen.intermediate_values:
            trial.report(float(metric), step)
        best = frozen.user_attrs.get("best_metric")
        better = best is None or (metric < best if self.record.smaller_is_better else metric > best)
        if better:
            trial.set_user_attr("best_metric", float(metric))
        trial.set_user_attr("trained", {k: float(v) for k, v in units.items()})
        reason = self._decide(study, trial, frozen, float(units[self.record.time_metric]), float(metric))
        if reason is not None:
            self.stopped = True
            trial.set_user_attr(STOPPED, reason)
        return reason

    def _decide(self, study: Any, trial: Any, frozen: Any, reached: float, metric: float) -> str | None:
        rule = self.record.rule
        if rule.get("kind") == "optuna":
            return f"pruned by Optuna's {rule.get('pruner')} pruner" if trial.should_prune() else None
        if rule.get("kind") != "asha":
            return None
        rungs: list[int] = list(rule["rungs"])
        divisor = float(rule["divisor"])
        bracket = frozen.user_attrs.get(BRACKET, rule.get("bracket", 0))
        if not any(reached >= needed and rung_attr(i) not in frozen.user_attrs for i, needed in enumerate(rungs)):
            return None
        with storage_lock(self.record.storage):  # one rung decision at a time, as Determined's master takes them
            peers = [t for t in study.get_trials(deepcopy=False) if t._trial_id != self.record.trial_id
                     and t.user_attrs.get(BRACKET, 0) == bracket and not t.user_attrs.get(INVALID)]
            for index, needed in enumerate(rungs):
                key = rung_attr(index)
                if reached < needed or key in frozen.user_attrs:
                    continue
                trial.set_user_attr(key, metric)
                trial.set_user_attr(f"{key}_at", time.time())  # the order of the rung's records
                if index == len(rungs) - 1:
                    break  # the top rung: the trial has trained to max_time and completes
                others = [float(t.user_attrs[key]) for t in peers if key in t.user_attrs]
                if not rung_continues(metric, others, divisor, self.record.smaller_is_better):
                    keep = max(int((len(others) + 1) / divisor), 1)
                    return (f"not in the top {keep} of {len(others) + 1} at rung {index + 1} ({needed} "
                            f"{self.record.time_metric}): {self.record.metric} {metric:.4f}")
        return None


class LinkAdvisor:
    """The Trainer's stop advisor for a trial of a search (see dtrain.train.advice)."""

    def __init__(self, link: SearchLink) -> None:
        self.link = link

    def after_validation(self, units: Mapping[str, float], metric: float | None) -> str | None:
        if metric is None:
            return None
        return self.link.report(units, metric)
