"""Running a search: every trial is an ordinary `dtrain run` of the experiment file (its own run dir, checkpoints,
restarts, store entry, TensorBoard), given its hyperparameters and a `single` searcher by `--set`; up to
`max_concurrent_trials` run at once, as many as this machine's slots allow.

Optuna keeps the study (each trial's parameters, state, reported values) in RDB storage: SQLite in the search dir
by default, or the `--storage` URL that several machines share, each running the trials it draws. Trials are
counted in the study, so the search runs `max_trials` trials in all, wherever they run. A stopped search resumes:
finished trials are not run again, and a trial whose runner is gone (Ctrl-C, a killed process, a lost machine: its
heartbeat in the study stops) is taken over and goes on from its checkpoint in its run dir.

Adaptive ASHA and Optuna's pruners stop trials from inside the trial (dtrain.search.link): the runner tells each
trial its rule in `search-trial.json` and reads the outcome back from the study. A trial that rejects its
hyperparameters (InvalidHP, exit code 4) is recorded as invalid and another one is drawn in its place.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, ExitCode
from dtrain.runs.processes import CONCURRENT_RUNS_ENV, process_alive
from dtrain.search import asha
from dtrain.search.link import BRACKET, INVALID, STOPPED, LinkRecord, make_pruner
from dtrain.search.progress import SearchProgress, has_checkpoint
from dtrain.search.space import Space
from dtrain.search.spec import SearchSpec, is_command_experiment, parse_searcher
from dtrain.search.study import ask, open_study, total_trials
from dtrain.search.tracking import SearchTracking, tracking_of

STUDY_FILE = "study.db"
SEARCH_FILE = "search.json"
OWNER, HEARTBEAT, RUN_DIR, SURPLUS = "owner", "heartbeat", "run_dir", "surplus"
HEARTBEAT_SECONDS = 10.0
GRACE_SECONDS = 60.0  # a trial whose runner has not beaten for this long (on another machine) is taken over


@dataclass
class Running:
    number: int
    trial_id: int
    process: subprocess.Popen[str]
    run_dir: Path
    started: float = field(default_factory=time.time)


def trial_settings(params: Mapping[str, Any], spec: SearchSpec) -> list[str]:
    """The `--set` overrides that make the experiment file one trial: its hyperparameters and a `single` searcher
    that trains to max_length (adaptive ASHA and Optuna: max_time in time_metric units)."""
    settings = [f"hyperparameters.{name}={json.dumps(value)}" for name, value in params.items()]
    searcher: dict[str, Any] = {"name": "single", "metric": spec.metric, "smaller_is_better": spec.smaller_is_better}
    if spec.max_length:  # 0: a command that sets its own length
        searcher["max_length"] = {spec.unit: spec.max_length}
    settings.append(f"searcher={json.dumps(searcher)}")
    return settings


def metric_of(summary: Mapping[str, Any], metric: str) -> float | None:
    validation = summary.get("validation") or {}
    for name in (metric, metric.removeprefix("validation_")):
        if name in validation:
            return float(validation[name])
    return None


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def orphaned(trial: Any, me: str, now: float) -> bool:
    """Whether a RUNNING trial has no live runner: its runner was on this machine and is gone, or its heartbeat is
    older than GRACE_SECONDS."""
    owner = str(trial.user_attrs.get(OWNER, ""))
    if owner == me:
        return False
    host, _, pid = owner.rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        return not process_alive(int(pid))
    beat = trial.user_attrs.get(HEARTBEAT)
    if beat is None:
        started = trial.datetime_start.timestamp() if trial.datetime_start else now
        return now - started > GRACE_SECONDS
    return now - float(beat) > GRACE_SECONDS


class SearchRunner:
    """One process's share of a search: draws trials from the study and runs them until the search is done."""

    def __init__(self, config: Path, overrides: list[str], raw: Mapping[str, Any], search_dir: Path, slots: int,
                 seed: int = 0, storage: str | None = None, study_name: str = "search") -> None:
        self.config, self.overrides, self.search_dir = config, overrides, search_dir.resolve()
        self.spec = parse_searcher(raw["searcher"], command=is_command_experiment(raw))
        self.space = Space.parse(raw.get("hyperparameters") or {})
        per_trial = int((raw.get("resources") or {}).get("slots_per_trial", 1))
        if per_trial > slots:
            raise ConfigError(f"a trial needs {per_trial} slots (resources.slots_per_trial) but --slots is {slots}")
        self.parallel = max(1, min(slots // per_trial, self.spec.max_concurrent_trials or slots))
        self.total = total_trials(self.spec, self.space)
        if self.total < 1:
            raise ConfigError("the search has no trials to run: give searcher.max_trials >= 1")
        self.seed = seed
        self.storage = storage or f"sqlite:///{self.search_dir / STUDY_FILE}"
        self.study_name = study_name
        self.brackets = (asha.plan(self.spec.max_trials, self.spec.max_length, self.spec.divisor, self.spec.max_rungs,
                                   self.spec.mode, self.spec.max_concurrent_trials,
                                   list(self.spec.bracket_rungs) or None)
                         if self.spec.name == "adaptive_asha" else [])
        self.me = owner_id()
        self.progress = SearchProgress(self.spec, self.total)
        self.tracking = SearchTracking(tracking_of(raw), name=str(raw.get("name") or config.stem))

    # ------------------------------------------------------------------------------------- rules

    def _pruning_rule(self) -> dict[str, Any]:
        if self.spec.name != "optuna" or self.spec.pruner == "none":
            return {"kind": "none"}
        rungs = asha.bracket_rungs("aggressive", self.spec.max_rungs, self.spec.max_length, self.spec.max_trials,
                                   self.spec.divisor)[0]
        first = asha.rung_units(self.spec.max_length, self.spec.divisor, rungs)[0]
        return {"kind": "optuna", "pruner": self.spec.pruner, "min_time": first, "max_time": self.spec.max_length,
                "divisor": self.spec.divisor}

    def _rule(self, bracket: int | None) -> dict[str, Any]:
        if self.spec.name == "adaptive_asha" and bracket is not None:
            return {"kind": "asha", "bracket": bracket, "divisor": self.spec.divisor,
                    "rungs": list(self.brackets[bracket].units)}
        return self._pruning_rule()

    def _next_bracket(self, trials: list[Any]) -> int | None:
        """Adaptive ASHA: the bracket a new trial joins, the first (most early stopping) that has trials left and
        room under its share of concurrency, else the first with trials left."""
        if not self.brackets:
            return None
        import optuna

        counted = [t for t in trials if not t.user_attrs.get(INVALID) and BRACKET in t.user_attrs]
        created = [sum(1 for t in counted if t.user_attrs[BRACKET] == i) for i in range(len(self.brackets))]
        live = [sum(1 for t in counted if t.user_attrs[BRACKET] == i and t.state == optuna.trial.TrialState.RUNNING)
                for i in range(len(self.brackets))]
        open_ = [i for i, b in enumerate(self.brackets) if created[i] < b.max_trials]
        for i in open_:
            if live[i] < self.brackets[i].max_concurrent_trials:
                return i
        return open_[0] if open_ else 0

    # ------------------------------------------------------------------------------------- trials

    def _experiment_id(self) -> int | None:
        """The search's experiment in this machine's run store (each trial a trial of it), made once."""
        from dtrain.runs.rundir import store_path
        from dtrain.runs.store import RunStore

        self.search_dir.mkdir(parents=True, exist_ok=True)
        path = self.search_dir / SEARCH_FILE
        known = json.loads(path.read_text()) if path.is_file() else {}
        if known.get("experiment_id") is not None:
            return int(known["experiment_id"])
        store = RunStore(store_path())
        config_text = self.config.read_text() if self.config.is_file() else ""
        name = f"{self.study_name} ({self.spec.name} search)"
        experiment_id = store.create_experiment(name, f"search dir {self.search_dir}", config_text)
        store.close()
        path.write_text(json.dumps({"experiment_id": experiment_id, "storage": self.storage,
                                    "study_name": self.study_name}))
        return experiment_id

    def _start(self, study: Any, trial: Any, params: Mapping[str, Any], experiment_id: int | None) -> Running:
        number = trial.number
        run_dir = self.search_dir / str(trial.user_attrs.get(RUN_DIR) or f"trial-{number}")
        trial.set_user_attr(RUN_DIR, run_dir.name)
        trial.set_user_attr(OWNER, self.me)
        trial.set_user_attr(HEARTBEAT, time.time())
        LinkRecord(storage=self.storage, study_name=self.study_name, trial_id=trial._trial_id, trial_number=number,
                   metric=self.spec.metric, smaller_is_better=self.spec.smaller_is_better, time_metric=self.spec.unit,
                   max_time=self.spec.max_length, rule=self._rule(trial.user_attrs.get(BRACKET))).write(run_dir)
        command = [sys.executable, "-m", "dtrain.cli", "run", str(self.config), "--run-dir", str(run_dir)]
        if experiment_id is not None:
            command += ["--experiment-id", str(experiment_id)]
        for setting in [*self.overrides, *trial_settings(params, self.spec), *self.tracking.trial_settings(number)]:
            command += ["--set", setting]
        logs = self.search_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"trial-{number}.log", "a")  # noqa: SIM115 - the child holds it; closed at exit
        self.progress.started(number, params, trial.user_attrs.get(BRACKET), resumed=has_checkpoint(run_dir))
        # a session of its own: a terminal's Ctrl-C reaches the search alone, which passes it on once
        # the trial's processes share the cores with those of the other trials running beside it
        environment = {**os.environ, CONCURRENT_RUNS_ENV: str(self.parallel)}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   env=environment)
        log.close()
        return Running(number, trial._trial_id, process, run_dir)

    def _new_trial(self, study: Any, trials: list[Any], experiment_id: int | None) -> Running | None:
        import optuna

        trial, params = ask(study, self.spec, self.space, self.seed)
        if self._surplus(trial.number, study.get_trials(deepcopy=False)):
            # another process drew the last trial at the same moment: the higher number gives way
            trial.set_user_attr(SURPLUS, True)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return None
        bracket = self._next_bracket(trials)
        if bracket is not None:
            trial.set_user_attr(BRACKET, bracket)
        return self._start(study, trial, params, experiment_id)

    def _adopt(self, study: Any, frozen: Any, experiment_id: int | None) -> Running:
        import optuna

        trial = optuna.trial.Trial(study, frozen._trial_id)
        return self._start(study, trial, dict(frozen.params), experiment_id)

    def _finish(self, study: Any, storage: Any, running: Running, interrupted: bool) -> None:
        """Record how a trial's process ended: completed, stopped early by the searcher, invalid, errored; an
        interrupted trial stays RUNNING, to be resumed."""
        import optuna

        from dtrain.runs.fatal import FATAL_FILE

        code = running.process.returncode
        frozen = storage.get_trial(running.trial_id)
        if frozen.state.is_finished():
            return
        trial = optuna.trial.Trial(study, running.trial_id)
        summary_file = running.run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        trial.set_user_attr("batches_trained", int(summary.get("steps_completed") or 0))
        trial.set_user_attr("epochs_trained", float(summary.get("epochs_completed") or 0.0))
        if interrupted and not (code == ExitCode.OK and summary.get("status") == "completed"):
            return  # stopped by our Ctrl-C (at whatever stage it was): it stays RUNNING, to be resumed
        stopped = frozen.user_attrs.get(STOPPED) or summary.get("stopped_by_searcher")
        if code == ExitCode.INVALID_HP:
            fatal_file = running.run_dir / FATAL_FILE
            message = json.loads(fatal_file.read_text()).get("message", "") if fatal_file.is_file() else ""
            trial.set_user_attr(INVALID, message or "InvalidHP")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            self.progress.ended(running.number, "invalid", message)
        elif stopped and code in (ExitCode.OK, ExitCode.STOPPED):
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            self.progress.ended(running.number, "stopped", str(stopped), summary.get("steps_completed"))
        elif code == ExitCode.OK and summary.get("status") == "completed":
            value = metric_of(summary, self.spec.metric)
            if value is None:
                trial.set_user_attr("error", f"no validation metric `{self.spec.metric}` in the summary")
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                self.progress.ended(running.number, "errored", f"no metric {self.spec.metric}")
            else:
                best = frozen.user_attrs.get("best_metric")
                better = best is None or (value < best if self.spec.smaller_is_better else value > best)
                if better:
                    trial.set_user_attr("best_metric", value)
                study.tell(trial, value)
                self.progress.ended(running.number, "completed", f"{self.spec.metric} {value:.4f}",
                                    summary.get("steps_completed"))
        else:
            log = self.search_dir / "logs" / f"trial-{running.number}.log"
            trial.set_user_attr("error", f"exit code {code}")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            self.progress.ended(running.number, "errored", f"exit code {code}; log: {log}")

    # ------------------------------------------------------------------------------------- the loop

    def run(self) -> int:
        import optuna

        experiment_id = self._experiment_id()
        study = open_study(self.storage, self.study_name, self.spec, self.space, self.seed,
                           make_pruner(self._pruning_rule()))
        storage = study._storage  # the storage object Optuna built the study on (get_trial by id)
        self.tracking.start(study, self.spec, self.config)
        running: list[Running] = []
        interrupted = False
        last_beat = 0.0

        def stop(signum: int, frame: Any) -> None:
            nonlocal interrupted
            interrupted = True

        previous = signal.signal(signal.SIGINT, stop)
        try:
            while True:
                trials = study.get_trials(deepcopy=False)
                mine = {r.trial_id for r in running}
                if not interrupted:
                    now = time.time()
                    for frozen in trials:
                        if len(running) >= self.parallel:
                            break
                        if (frozen.state == optuna.trial.TrialState.RUNNING and frozen._trial_id not in mine
                                and orphaned(frozen, self.me, now)):
                            running.append(self._adopt(study, frozen, experiment_id))
                    while len(running) < self.parallel and self._left(trials) > 0:
                        started = self._new_trial(study, trials, experiment_id)
                        if started is not None:
                            running.append(started)
                        trials = study.get_trials(deepcopy=False)
                if not running:
                    break
                time.sleep(0.5)
                if time.time() - last_beat > HEARTBEAT_SECONDS:
                    last_beat = time.time()
                    for item in running:
                        try:
                            optuna.trial.Trial(study, item.trial_id).set_user_attr(HEARTBEAT, last_beat)
                        except RuntimeError:  # finished meanwhile (another runner took it over): nothing to beat
                            pass
                for item in [r for r in running if r.process.poll() is not None]:
                    running.remove(item)
                    self._finish(study, storage, item, interrupted)
                    self.progress.table_line([t for t in study.get_trials(deepcopy=False)
                                              if not t.user_attrs.get(SURPLUS)], len(running))
                if interrupted and running:
                    for item in running:
                        item.process.send_signal(signal.SIGINT)  # each checkpoints after its batch
                    for item in running:
                        item.process.wait()
                        self._finish(study, storage, item, interrupted)
                    running = []
                if interrupted:
                    self.tracking.end("interrupted", [], self.spec)
                    print("dtrain search: interrupted; run the same command again to resume the search",
                          file=sys.stderr, flush=True)
                    return ExitCode.INTERRUPTED
        finally:
            signal.signal(signal.SIGINT, previous)
        return self._report(study)

    def _surplus(self, number: int, trials: list[Any]) -> bool:
        """Whether trial `number` came after the search had drawn all its trials (two processes asked at once)."""
        return self._left([t for t in trials if t.number < number]) <= 0

    def _left(self, trials: list[Any]) -> int:
        """Trials still to draw: the total, less those drawn anywhere (invalid ones are replaced, up to the total
        again, except in a grid, whose points are fixed)."""
        import optuna

        drawn = [t for t in trials if t.state != optuna.trial.TrialState.WAITING and not t.user_attrs.get(SURPLUS)]
        invalid = sum(1 for t in drawn if t.user_attrs.get(INVALID))
        gridded = self.spec.name == "grid" or self.spec.sampler == "grid" and self.spec.name == "optuna"
        if gridded:
            return self.total - len(drawn)
        if invalid >= self.total:  # every draw rejected: the space, not bad luck
            return 0
        return self.total - (len(drawn) - invalid)

    def _report(self, study: Any) -> int:
        """The table of all trials, the results files; OK unless a trial errored."""
        import optuna

        from dtrain.search.results import write_results

        trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(SURPLUS)]
        print(self.progress.final_table(trials, self.search_dir), flush=True)
        rungs = sorted({u for b in self.brackets for u in b.units})
        for line in write_results(trials, self.spec, self.search_dir, self.study_name, self.storage, rungs):
            print(line, flush=True)
        mlflow = self.tracking.link()
        if mlflow is not None:
            print(f"  MLflow      {mlflow} (the trials are its child runs)", flush=True)
        errored = [t for t in trials if t.state == optuna.trial.TrialState.FAIL and not t.user_attrs.get(INVALID)]
        completed = [(t.number, float(t.value)) for t in trials
                     if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
        self.tracking.end("failed" if errored else "completed", completed, self.spec)
        return ExitCode.FAILED if errored else ExitCode.OK


def raw_config(config: Path, overrides: list[str]) -> dict[str, Any]:
    from dtrain.config.loading import apply_override, parse_override, read_yaml

    raw = read_yaml(config)
    for text in overrides:
        apply_override(raw, *parse_override(text))
    return copy.deepcopy(raw)


def is_search(raw: Mapping[str, Any]) -> bool:
    searcher = raw.get("searcher")
    return isinstance(searcher, Mapping) and searcher.get("name", "single") != "single"
