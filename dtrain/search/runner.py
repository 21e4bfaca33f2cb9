"""Running a `random` or `grid` search: every trial is an ordinary `dtrain run` of the experiment file (its own
run dir, checkpoints, restarts, store entry, TensorBoard), given its hyperparameters and a `single` searcher by
`--set`; up to `max_concurrent_trials` run at once, as many as the slots allow. Optuna keeps the study (each
trial's parameters, state and result) in SQLite in the search dir, so a stopped search resumes: finished
trials are not run again, and a trial that was running goes on from its checkpoint in its run dir.

Optuna's `RandomSampler` draws the random search (log hyperparameters log-uniformly, which is Determined's
`base ** uniform(minval, maxval)` for any base); a grid search queues Determined's grid points in the study.
"""

from __future__ import annotations

import copy
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, ExitCode
from dtrain.search.space import Space
from dtrain.search.spec import SearchSpec, parse_searcher

STUDY_FILE = "study.db"


@dataclass
class Running:
    number: int
    trial: Any  # optuna.trial.Trial
    process: subprocess.Popen[str]
    run_dir: Path


def suggest(space: Space, trial: Any) -> dict[str, Any]:
    """A trial's values for the searchable hyperparameters (dotted names), through Optuna's suggest API."""
    values: dict[str, Any] = {}
    for p in space.searchable:
        if p.kind == "int":
            values[p.name] = trial.suggest_int(p.name, int(p.minval), int(p.maxval))
        elif p.kind == "double":
            values[p.name] = trial.suggest_float(p.name, p.minval, p.maxval)
        elif p.kind == "log":
            values[p.name] = trial.suggest_float(p.name, p.base ** p.minval, p.base ** p.maxval, log=True)
        else:
            values[p.name] = trial.suggest_categorical(p.name, list(p.vals))
    return values


def grid_points(space: Space) -> list[dict[str, Any]]:
    """Every point of Determined's grid over the searchable hyperparameters (dotted names), first varying slowest.
    They are queued in the study (Optuna's GridSampler stops the study from inside `tell`, which the ask-and-tell
    loop of a search cannot use)."""
    searchable = [p for p in space.searchable]
    return [dict(zip((p.name for p in searchable), values, strict=True))
            for values in itertools.product(*(p.grid() for p in searchable))]


def trial_settings(space: Space, params: Mapping[str, Any], spec: SearchSpec) -> list[str]:
    """The `--set` overrides that make the experiment file one trial: constants and a `single` searcher."""
    settings = [f"hyperparameters.{name}={json.dumps(value)}" for name, value in params.items()]
    searcher = {"name": "single", "metric": spec.metric, "smaller_is_better": spec.smaller_is_better,
                "max_length": {spec.unit: spec.max_length}}
    settings.append(f"searcher={json.dumps(searcher)}")
    return settings


def metric_of(summary: Mapping[str, Any], metric: str) -> float | None:
    validation = summary.get("validation") or {}
    for name in (metric, metric.removeprefix("validation_")):
        if name in validation:
            return float(validation[name])
    return None


class SearchRunner:
    """One process's share of a search: draws trials from the study and runs them until it is done."""

    def __init__(self, config: Path, overrides: list[str], raw: Mapping[str, Any], search_dir: Path, slots: int,
                 seed: int = 0) -> None:
        self.config, self.overrides, self.search_dir = config, overrides, search_dir
        self.spec = parse_searcher(raw["searcher"])
        if self.spec.name not in ("random", "grid"):
            raise ConfigError(f"searcher `{self.spec.name}`: running it is not built yet (random and grid are); "
                              "`dtrain preview` shows its plan")
        self.space = Space.parse(raw.get("hyperparameters") or {})
        per_trial = int((raw.get("resources") or {}).get("slots_per_trial", 1))
        if per_trial > slots:
            raise ConfigError(f"a trial needs {per_trial} slots (resources.slots_per_trial) but --slots is {slots}")
        self.parallel = max(1, min(slots // per_trial, self.spec.max_concurrent_trials or slots))
        self.total = len(self.space.grid()) if self.spec.name == "grid" else self.spec.max_trials
        self.seed = seed

    def _study(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.search_dir.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(storage=f"sqlite:///{self.search_dir / STUDY_FILE}", study_name="search",
                                    sampler=optuna.samplers.RandomSampler(seed=self.seed), load_if_exists=True,
                                    direction="minimize" if self.spec.smaller_is_better else "maximize")
        if self.spec.name == "grid" and not study.get_trials(deepcopy=False):
            for point in grid_points(self.space):  # queued once, in the study: a resumed search takes the rest
                study.enqueue_trial(point)
        return study

    def _start(self, study: Any, trial: Any) -> Running:
        params = suggest(self.space, trial)
        run_dir = Path(trial.user_attrs.get("run_dir") or self.search_dir / f"trial-{trial.number}")
        trial.set_user_attr("run_dir", str(run_dir))
        command = [sys.executable, "-m", "dtrain.cli", "run", str(self.config), "--run-dir", str(run_dir)]
        for setting in [*self.overrides, *trial_settings(self.space, params, self.spec)]:
            command += ["--set", setting]
        logs = self.search_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"trial-{trial.number}.log", "a")  # noqa: SIM115 - the child holds it; closed at exit
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        print(f"dtrain search: trial {trial.number} started ({shown})", flush=True)
        # a session of its own: a terminal's Ctrl-C reaches the search alone, which passes it on once
        return Running(trial.number, trial, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                              text=True, start_new_session=True), run_dir)

    def _finish(self, study: Any, running: Running) -> dict[str, Any]:
        import optuna

        code = running.process.returncode
        summary_file = running.run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        value = metric_of(summary, self.spec.metric) if code == 0 else None
        state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL
        study.tell(running.trial, value if value is not None else None, state=state)
        how = f"{self.spec.metric} {value:.4f}" if value is not None else f"failed (exit code {code}; log: " \
            f"{self.search_dir / 'logs' / f'trial-{running.number}.log'})"
        print(f"dtrain search: trial {running.number} ended: {how}", flush=True)
        return {"trial": running.number, "value": value, "exit_code": code}

    def run(self) -> int:
        import optuna

        study = self._study()
        running: list[Running] = []
        interrupted = False

        def stop(signum: int, frame: Any) -> None:
            nonlocal interrupted
            interrupted = True

        previous = signal.signal(signal.SIGINT, stop)
        try:
            for left in [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]:
                # a trial a stopped search left running: run it again in its run dir, from its checkpoint
                optuna.trial.Trial(study, left._trial_id).set_user_attr("superseded", True)
                study.tell(left.number, state=optuna.trial.TrialState.FAIL)
                study.enqueue_trial(left.params, user_attrs={"run_dir": left.user_attrs.get("run_dir")})
            while True:
                done = [t for t in study.get_trials(deepcopy=False)
                        if t.state.is_finished() and not t.user_attrs.get("superseded")]
                started = len(done) + len(running)
                while not interrupted and len(running) < self.parallel and started < self.total:
                    running.append(self._start(study, study.ask()))
                    started += 1
                if not running:
                    break
                time.sleep(0.5)
                for item in [r for r in running if r.process.poll() is not None]:
                    running.remove(item)
                    self._finish(study, item)
                if interrupted:
                    for item in running:
                        item.process.send_signal(signal.SIGINT)  # each checkpoints after its batch
                    for item in running:
                        item.process.wait()
                    print("dtrain search: interrupted; run the same command again to resume the search",
                          file=sys.stderr)
                    return ExitCode.INTERRUPTED
        finally:
            signal.signal(signal.SIGINT, previous)
        return self._report(study)

    def _report(self, study: Any) -> int:
        import optuna

        trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("superseded")]
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        print(f"dtrain search: {len(complete)} of {len(trials)} trials completed; study in "
              f"{self.search_dir / STUDY_FILE}")
        for t in sorted(trials, key=lambda t: t.number):
            value = f"{t.value:.4f}" if t.value is not None else "-"
            print(f"  trial {t.number:>3}  {t.state.name.lower():<9} {self.spec.metric} {value:>8}  {t.params}")
        if complete:
            best = study.best_trial
            print(f"  best: trial {best.number} ({self.spec.metric} {best.value:.4f}), checkpoint in "
                  f"{self.search_dir / f'trial-{best.number}' / 'checkpoints'}")
        return ExitCode.OK if len(complete) == len(trials) else ExitCode.FAILED


def raw_config(config: Path, overrides: list[str]) -> dict[str, Any]:
    from dtrain.config.loading import apply_override, parse_override, read_yaml

    raw = read_yaml(config)
    for text in overrides:
        apply_override(raw, *parse_override(text))
    return copy.deepcopy(raw)


def is_search(raw: Mapping[str, Any]) -> bool:
    searcher = raw.get("searcher")
    return isinstance(searcher, Mapping) and searcher.get("name", "single") != "single"

