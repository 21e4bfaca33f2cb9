"""Rank 0's MLflow run (config section `tracking.mlflow`, `pip install 'dtrain[mlflow]'`): the config, the
hyperparameters, the training and validation metrics at every report, and where the checkpoints are, logged to an
MLflow tracking server as Lightning's MLFlowLogger and the transformers MLflowCallback log them.

Nothing here runs on the training thread but putting items on a queue: one thread of its own imports mlflow,
opens the run and sends each report's rows in one `log_batch`, so a slow server never delays a step (nor the run
store's writer thread). A server that cannot be reached, or fails a request, costs one warning; after it the run
goes on without MLflow (nothing more is sent, nothing more is said). A run that resumes in the same run dir
continues its MLflow run (`mlflow-run.json` there names it), and a search's trial is a child run of the search's.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dtrain.config import MlflowTracking, Tracking
from dtrain.errors import ConfigError
from dtrain.runs.rundir import MLFLOW_RUN_FILE, write_json_atomic

log = logging.getLogger(__name__)

INSTALL = "pip install 'dtrain[mlflow]'"
# Where the environment does not set them: mlflow's own HTTP retries (7, with a doubling back-off: minutes)
# shortened, so that the first failed request takes seconds and its warning comes while the run is still going; and
# no "View run" lines printed by mlflow when a run ends (`dtrain run` prints the run's page).
ENVIRONMENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
                        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
CLOSE_WAIT_SECONDS = 30.0  # at the end of a run, how long what is queued may take to reach the server
# MLflow's end states of a run for dtrain's statuses (stopped: early by the searcher, or faults.stop_after_batch)
END_STATES = {"completed": "FINISHED", "failed": "FAILED", "stopped": "KILLED", "interrupted": "KILLED"}
PARENT_TAG = "mlflow.parentRunId"
UNREACHABLE = "the server cannot be reached"

Row = tuple[int, float | None, float | None, Mapping[str, float]]


def check_tracking(section: Tracking) -> None:
    """Before any worker starts: one line when `tracking.mlflow` is set without the mlflow package or a URI."""
    mlflow = section.mlflow
    if mlflow is None:
        return
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"tracking.mlflow needs the mlflow package, which is not installed; {INSTALL}, or remove "
                          "tracking.mlflow")
    if mlflow.uri() is None:
        raise ConfigError("tracking.mlflow has no tracking_uri and MLFLOW_TRACKING_URI is not set; set "
                          "tracking.mlflow.tracking_uri to the server (e.g. http://127.0.0.1:5000) or a local store "
                          "(e.g. sqlite:///mlflow.db)")


def metric_key(name: str) -> str:
    """`name` as MLflow accepts a metric or param key (letters, digits, `_ - . : /` and spaces)."""
    return re.sub(r"[^\w\-.:/ ]", "_", name)


def flat_params(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested hyperparameters as MLflow params: `optimizer.lr` -> "0.1"."""
    flat: dict[str, str] = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{key}."))
        else:
            plain = isinstance(value, (list, bool)) or value is None
            flat[metric_key(key)] = json.dumps(value) if plain else str(value)
    return flat


def quiet_http_loggers() -> None:
    """urllib3 warns at every retry and mlflow at every failed call: the one warning is this module's."""
    for name in ("urllib3.connectionpool", "mlflow"):
        logging.getLogger(name).setLevel(logging.ERROR)


def find_or_create_experiment(client: Any, name: str) -> str:
    """The id of MLflow experiment `name`, made when missing (another process may make it at the same moment)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except Exception:  # RESOURCE_ALREADY_EXISTS: a trial beside this one made it first
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


class RunTracker:
    """One run's MLflow run, fed from the training thread through a queue and sent from a thread of its own."""

    def __init__(self, section: MlflowTracking, *, uri: str, experiment: str, run_name: str, run_dir: Path,
                 params: Mapping[str, str], tags: Mapping[str, str]) -> None:
        self.uri = uri
        self.section = section
        self.run_id: str | None = None
        self._experiment, self._run_name, self._run_dir = experiment, run_name, run_dir
        self._params, self._tags = dict(params), dict(tags)
        self._client: Any = None
        self._failed = False
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = threading.Thread(target=self._work, name="dtrain-mlflow",
                                                                 daemon=True)
        self._thread.start()
        self._jobs.put(self._open)

    # ------------------------------------------------------------------------- the training thread's side

    def metrics(self, prefix: str, rows: Sequence[Row]) -> None:
        """Rows of metrics (`<prefix>/<name>` at each row's step), sent together."""
        if not rows or self._thread is None:
            return
        stamp = int(time.time() * 1000)
        points = [(metric_key(f"{prefix}/{name}"), float(value), stamp, step)
                  for step, _, _, values in rows for name, value in values.items()]
        self._jobs.put(lambda: self._log_metrics(points))

    def checkpoint(self, step: int, location: str) -> None:
        """Where the newest checkpoint is (tags `dtrain.checkpoint` and `dtrain.checkpoint_step`)."""
        if self._thread is not None:
            tags = {"dtrain.checkpoint": location, "dtrain.checkpoint_step": str(step)}
            self._jobs.put(lambda: self._log_tags(tags))

    def end(self, status: str) -> None:
        """The run's end state in MLflow for dtrain's `status` (completed, failed, stopped, interrupted)."""
        state = END_STATES.get(status)
        if state is not None and self._thread is not None:
            self._jobs.put(lambda: self._client.set_terminated(self.run_id, status=state))

    def close(self, wait: float = CLOSE_WAIT_SECONDS) -> None:
        """Send what is queued (for up to `wait` seconds) and end the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._jobs.put(None)
        thread.join(wait)
        if thread.is_alive() and not self._failed:
            self._failed = True
            log.warning("MLflow at %s did not take the run's last metrics within %.0f s; they may be missing there",
                        self.uri, wait)

    # ------------------------------------------------------------------------------ the thread's side

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._failed:
                continue  # after the one warning: quiet
            try:
                job()
            except Exception as exc:
                self._failed = True
                log.warning("MLflow at %s failed (%s); training goes on without MLflow logging", self.uri,
                            failure(exc))

    def _open(self) -> None:
        """Continue the run this run dir logged to before, or start one (with its params, tags and config)."""
        for name, value in ENVIRONMENT_DEFAULTS.items():
            os.environ.setdefault(name, value)
        quiet_http_loggers()
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        record = self._run_dir / MLFLOW_RUN_FILE
        known = json.loads(record.read_text()) if record.is_file() else {}
        if known.get("tracking_uri") == self.uri and known.get("run_id"):
            self.run_id = str(known["run_id"])
            self._client.update_run(self.run_id, status="RUNNING")
            return
        experiment_id = find_or_create_experiment(self._client, self._experiment)
        tags = {**self._tags, "dtrain.run_dir": str(self._run_dir)}
        if self.section.parent_run_id:
            tags[PARENT_TAG] = self.section.parent_run_id
        run = self._client.create_run(experiment_id, run_name=self._run_name, tags=tags)
        self.run_id = str(run.info.run_id)
        write_json_atomic(record, {"tracking_uri": self.uri, "experiment_id": experiment_id, "run_id": self.run_id})
        from mlflow.entities import Param

        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in self._params.items()])
        config = self._run_dir / "config.yaml"
        if config.is_file():
            try:
                self._client.log_text(self.run_id, config.read_text(), "config.yaml")
            except Exception as exc:  # an artifact store this machine cannot write: the metrics still go
                if failure(exc) == UNREACHABLE:
                    raise  # the server is gone: the one warning, then quiet
                log.warning("MLflow: config.yaml not logged as an artifact of run %s (%s)", self.run_id, failure(exc))

    def _log_metrics(self, points: list[tuple[str, float, int, int]]) -> None:
        from mlflow.entities import Metric

        self._client.log_batch(self.run_id, metrics=[Metric(key, value, stamp, step)
                                                     for key, value, stamp, step in points])

    def _log_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(key, value) for key, value in tags.items()])


def run_link(uri: str, experiment_id: str | None, run_id: str) -> str:
    """Where a person sees an MLflow run: its page on a server, else its id and store."""
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"run {run_id} in {uri} (mlflow ui --backend-store-uri {uri})"


def mlflow_run_link(run_dir: Path) -> str | None:
    """Where to see the MLflow run the run in `run_dir` logged to; None when it logged to none."""
    record = run_dir / MLFLOW_RUN_FILE
    if not record.is_file():
        return None
    known = json.loads(record.read_text())
    return run_link(str(known.get("tracking_uri")), known.get("experiment_id"), str(known.get("run_id")))


def failure(exc: BaseException) -> str:
    """An MLflow call's failure in a few words: a server that cannot be reached says so."""
    text = " ".join(str(exc).split())
    if any(sign in text for sign in ("Failed to establish a new connection", "Connection refused",
                                     "Max retries exceeded", "Read timed out")):
        return UNREACHABLE
    return f"{type(exc).__name__}: {text[:300]}"


def start_tracking(section: Tracking, *, name: str, hyperparameters: Mapping[str, Any],
                   run_dir: Path) -> RunTracker | None:
    """Rank 0's tracker for the run in `run_dir` (None without `tracking.mlflow`). Nothing is sent from the caller's
    thread."""
    mlflow = section.mlflow
    if mlflow is None:
        return None
    uri = mlflow.uri()
    if uri is None or importlib.util.find_spec("mlflow") is None:  # `dtrain run` said so before the launch
        log.warning("tracking.mlflow: %s; the run is not logged to MLflow",
                    "no tracking_uri" if uri is None else f"the mlflow package is missing ({INSTALL})")
        return None
    run_name = mlflow.run_name or f"{name} {run_dir.name}"
    return RunTracker(mlflow, uri=uri, experiment=mlflow.experiment(name), run_name=run_name, run_dir=run_dir,
                      params=flat_params(hyperparameters), tags={**mlflow.tags, "dtrain.experiment": name})
