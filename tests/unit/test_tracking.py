"""`tracking.mlflow`: the one-line refusals before launch, and rank 0's tracker against a real MLflow store in
this process (a SQLite tracking URI: MLflow's own SQL store, no server): params, metrics at each report, the
checkpoint tags, the end state, a resumed run continuing its MLflow run, and a server that cannot be reached
costing one warning and no error. The server and browser checks are in tests/distributed/test_mlflow.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from dtrain.cli import main
from dtrain.config import Tracking
from dtrain.errors import ConfigError
from dtrain.runs.rundir import MLFLOW_RUN_FILE
from dtrain.train.tracking import RunTracker, check_tracking, flat_params, metric_key, start_tracking
from tests.conftest import FIXTURES, free_port

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="needs mlflow (pip install -e '.[mlflow]'; make setup installs it)")


def _without_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "mlflow" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_a_missing_package_is_one_line_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _without_mlflow(monkeypatch)
    launched: list[object] = []
    monkeypatch.setattr("dtrain.launch.launch_workers", lambda *args, **kwargs: launched.append(args))
    code = main(["run", str(FIXTURES / "digits.yaml"), "--set", "tracking.mlflow.tracking_uri=http://127.0.0.1:9"])
    assert code == 2 and not launched
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "dtrain: error: tracking.mlflow needs the mlflow package, which is not installed; pip install "
        "'dtrain[mlflow]', or remove tracking.mlflow")


def test_no_uri_anywhere_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    with pytest.raises(ConfigError, match=r"^tracking.mlflow has no tracking_uri and MLFLOW_TRACKING_URI is not set"):
        check_tracking(Tracking.model_validate({"mlflow": {}}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    check_tracking(Tracking.model_validate({"mlflow": {}}))  # the environment's URI serves
    assert Tracking.model_validate({"mlflow": {}}).mlflow.uri() == "http://mlflow.example:5000"  # type: ignore[union-attr]
    check_tracking(Tracking())  # no section: nothing to check


def test_params_and_keys_as_mlflow_takes_them() -> None:
    assert flat_params({"lr": 0.1, "net": {"hidden": 32, "act": "relu"}, "sizes": [1, 2], "aug": True,
                        "none": None}) == {"lr": "0.1", "net.hidden": "32", "net.act": "relu", "sizes": "[1, 2]",
                                           "aug": "true", "none": "null"}
    assert metric_key("train/top-1 acc (%)") == "train/top-1 acc ___"


def _tracker(tmp_path: Path, uri: str, run_dir: Path, **section: Any) -> Any:
    tracking = Tracking.model_validate({"mlflow": {"tracking_uri": uri, **section}})
    return start_tracking(tracking, name="digits", hyperparameters={"lr": 0.1, "net": {"hidden": 32}},
                          run_dir=run_dir)


@needs_mlflow
def test_a_run_s_params_metrics_checkpoints_and_end_reach_mlflow_and_a_resume_continues_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # a SQLite store keeps its artifacts in ./mlruns

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: digits\n")
    tracker = _tracker(tmp_path, uri, run_dir, tags={"team": "vision"})
    tracker.metrics("train", [(1, 0.1, 1.0, {"lr": 0.5}), (2, 0.2, 2.0, {"lr": 0.25, "loss": 1.5})])
    tracker.metrics("validation", [(2, 0.2, 2.0, {"accuracy": 0.75})])
    tracker.checkpoint(2, str(run_dir / "checkpoints" / "step-2"))
    tracker.end("interrupted")
    tracker.close()
    record = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(record["run_id"])
    assert run.info.status == "KILLED" and run.info.run_name == "digits run"
    assert run.data.params == {"lr": "0.1", "net.hidden": "32"}
    assert run.data.tags["team"] == "vision" and run.data.tags["dtrain.checkpoint_step"] == "2"
    assert run.data.tags["dtrain.checkpoint"] == str(run_dir / "checkpoints" / "step-2")
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/lr")] == [(1, 0.5), (2, 0.25)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "validation/accuracy")] == [
        (2, 0.75)]

    resumed = _tracker(tmp_path, uri, run_dir)  # the same run dir again: the same MLflow run goes on
    resumed.metrics("train", [(3, 0.3, 3.0, {"lr": 0.125})])
    resumed.end("completed")
    resumed.close()
    assert resumed.run_id == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/lr")] == [1, 2, 3]
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert (tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts" / "config.yaml").read_text() \
        == "name: digits\n"


@needs_mlflow
def test_a_server_that_cannot_be_reached_costs_one_warning_and_no_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    caplog.set_level(logging.WARNING, logger="dtrain")
    # the sender is held inside its first job (opening the run) until the training thread has queued its metrics:
    # had metrics() waited for the sender, the hold would only end at its safety limit, and the test fails on that
    held, release, held_to_the_limit = threading.Event(), threading.Event(), threading.Event()
    opening = RunTracker._open

    def open_when_released(self: RunTracker) -> None:
        held.set()
        if not release.wait(120):
            held_to_the_limit.set()
        opening(self)

    monkeypatch.setattr(RunTracker, "_open", open_when_released)
    tracker = _tracker(tmp_path, f"http://127.0.0.1:{free_port()}", run_dir)  # nothing listens there
    assert held.wait(120)
    for step in range(1, 6):
        tracker.metrics("train", [(step, 0.0, 0.0, {"loss": 1.0 / step})])  # queued: never waits for the server
    assert not held_to_the_limit.is_set()
    release.set()
    tracker.end("completed")
    tracker.close(wait=120)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "cannot be reached" in warnings[0] and "training goes on without MLflow logging" in warnings[0]
    assert not (run_dir / MLFLOW_RUN_FILE).exists()
