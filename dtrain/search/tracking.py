"""A search's MLflow run (`tracking.mlflow` in the search's experiment file): the parent of its trials' runs.

The search's runner makes it once per study (its id is kept in the study's user attrs, so a resumed search and
every machine sharing the study use the same one), with the searcher's settings as params and the experiment file
as an artifact, and hands its id to every trial (`tracking.mlflow.parent_run_id`), whose own run is then a child
of it. When the search ends the parent gets each completed trial's metric (at step = the trial's number) and the
best one. These calls are few and made by the runner, not by a training process; a server that fails one costs one
warning and the search goes on without MLflow (its trials still try on their own).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dtrain.config import Tracking
from dtrain.config.messages import explain
from dtrain.errors import ConfigError
from dtrain.search.spec import SearchSpec
from dtrain.train.tracking import (
    END_STATES,
    ENVIRONMENT_DEFAULTS,
    check_tracking,
    failure,
    find_or_create_experiment,
    metric_key,
    quiet_http_loggers,
    run_link,
)

RUN_ATTR = "mlflow_run_id"  # the study's user attr that names the search's MLflow run


def tracking_of(raw: Mapping[str, Any]) -> Tracking:
    """The experiment file's `tracking` section (a search reads the file raw: its hyperparameters are spaces)."""
    try:
        return Tracking.model_validate(raw.get("tracking") or {})
    except ValidationError as exc:
        raise ConfigError(f"tracking: {explain(exc, [])}") from None


class SearchTracking:
    """The search's MLflow run, or nothing without `tracking.mlflow` (then every method does nothing)."""

    def __init__(self, tracking: Tracking, *, name: str) -> None:
        check_tracking(tracking)  # one line for a missing package or URI, before any trial starts
        self.section = tracking.mlflow
        self.name = name
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client: Any = None
        self._failed = False

    def start(self, study: Any, spec: SearchSpec, config: Path) -> None:
        """The study's MLflow run: made the first time (params, tags, the experiment file), continued after."""
        if self.section is None:
            return
        known = study.user_attrs.get(RUN_ATTR)
        self._call(lambda: self._open(study, spec, config, known))

    def trial_settings(self, number: int) -> list[str]:
        """The `--set` overrides that make trial `number`'s MLflow run a child of the search's."""
        if self.section is None or self.run_id is None:
            return []
        settings = [f"tracking.mlflow.parent_run_id={json.dumps(self.run_id)}"]
        if self.section.run_name is None:
            settings.append(f"tracking.mlflow.run_name={json.dumps(f'trial-{number}')}")
        return settings

    def link(self) -> str | None:
        """The search's MLflow run as a person opens it (None without one)."""
        if self.section is None or self.run_id is None:
            return None
        return run_link(str(self.section.uri()), self.experiment_id, self.run_id)

    def end(self, status: str, values: Sequence[tuple[int, float]], spec: SearchSpec) -> None:
        """The completed trials' metric (step: the trial's number), the best, and the run's end state."""
        if self.run_id is None:
            return

        def finish() -> None:
            from mlflow.entities import Metric

            key = metric_key(spec.metric)
            metrics = [Metric(f"trials/{key}", value, 0, number) for number, value in values]
            if values:
                best = min(v for _, v in values) if spec.smaller_is_better else max(v for _, v in values)
                metrics.append(Metric(f"best/{key}", best, 0, 0))
            if metrics:
                self._client.log_batch(self.run_id, metrics=metrics)
            self._client.set_terminated(self.run_id, status=END_STATES[status])

        self._call(finish)

    def _open(self, study: Any, spec: SearchSpec, config: Path, known: str | None) -> None:
        assert self.section is not None
        for variable, value in ENVIRONMENT_DEFAULTS.items():
            os.environ.setdefault(variable, value)
        quiet_http_loggers()
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = self.section.uri()
        self._client = MlflowClient(tracking_uri=uri)
        if known:
            self._client.update_run(known, status="RUNNING")
            self.run_id, self.experiment_id = known, str(self._client.get_run(known).info.experiment_id)
            return
        experiment_id = find_or_create_experiment(self._client, self.section.experiment(self.name))
        self.experiment_id = experiment_id
        tags = {**self.section.tags, "dtrain.search": study.study_name}
        run = self._client.create_run(experiment_id, run_name=f"{self.name} search", tags=tags)
        self.run_id = str(run.info.run_id)
        study.set_user_attr(RUN_ATTR, self.run_id)
        params = {"searcher": spec.name, "metric": spec.metric, "smaller_is_better": str(spec.smaller_is_better),
                  "max_trials": str(spec.max_trials), "max_length": f"{spec.max_length} {spec.unit}"}
        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        if config.is_file():
            self._client.log_text(self.run_id, config.read_text(), "search.yaml")

    def _call(self, job: Any) -> None:
        if self._failed:
            return
        try:
            job()
        except Exception as exc:
            self._failed = True
            assert self.section is not None
            print(f"dtrain search: warning: MLflow at {self.section.uri()} failed ({failure(exc)}); the search goes on "
                  "without its MLflow run", file=sys.stderr, flush=True)
