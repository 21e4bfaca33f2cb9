"""`tracking.mlflow` against a real MLflow tracking server (`mlflow server` on loopback, SQLite backend, stopped by
its process group), read back through MlflowClient:

- a 2-worker run logs its hyperparameters as params, its config as an artifact, the training and validation
  metrics of every report equal to the run store's series, the newest checkpoint's location, and ends FINISHED;
- a search of 2 trials has one run of its own and each trial as a child run of it, with the trial's
  hyperparameters and metric as the Optuna study holds them;
- a server killed in the middle of a run: training completes (exit code 0) with one warning about MLflow;
- in a real browser (Debian's Chromium through Playwright), the run's page shows its metrics and parameters and
  its "Model metrics" tab draws the loss curve through the logged points (screenshots under the test's tmp dir).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtrain.runs.rundir import MLFLOW_RUN_FILE
from dtrain.runs.store import RunStore
from tests.browserkit import CHROMIUM, LAUNCH_ARGS, browser_missing
from tests.conftest import FIXTURES, subprocess_env
from tests.mlflowkit import MlflowServer

pytestmark = [pytest.mark.slow,  # a tracking server (~25 s to start) and `dtrain run`s
              pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                 reason="needs mlflow (pip install -e '.[mlflow]'; make setup installs it)")]

DTRAIN = [sys.executable, "-m", "dtrain.cli"]
BATCHES = 800  # the run killed mid-way: long enough (~40 s) to outlast the worker's start of its MLflow run


# The points a chart of the "Model metrics" tab draws (Plotly's own data on its element), found by the legend entry
# "<run> (<metric>)" inside the chart's card; null until the chart is drawn.
CURVE_OF = """(key) => {
  const label = [...document.querySelectorAll('body *')].find(
      e => e.children.length === 0 && e.textContent.includes('(' + key + ')'));
  let card = label;
  while (card && !card.querySelector('.js-plotly-plot')) card = card.parentElement;
  const plot = card && card.querySelector('.js-plotly-plot');
  if (!plot || !plot.data || !plot.data.length) return null;
  return plot.data.map(t => ({x: Array.from(t.x || []), y: Array.from(t.y || [])}));
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as running:
        yield running


@pytest.fixture(scope="module")
def tracked_run(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-worker digits run logged to the server (shared by the checks through the API and the browser)."""
    root = tmp_path_factory.mktemp("tracked")
    run_dir = root / "run"
    done = subprocess.run(
        [*DTRAIN, "run", str(FIXTURES / "digits.yaml"), "--run-dir", str(run_dir), "--set", "scheduling_unit=10",
         "--set", f"tracking.mlflow.tracking_uri={server.uri}", "--set", "tracking.mlflow.tags={team: vision}"],
        capture_output=True, text=True, timeout=600, env=subprocess_env(DTRAIN_RUNS_ROOT=str(root / "runs")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"run_dir": run_dir, "store": root / "runs" / "metrics.db", "stdout": done.stdout, "stderr": done.stderr,
            "record": json.loads((run_dir / MLFLOW_RUN_FILE).read_text())}


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_a_two_worker_run_logs_params_config_metrics_and_checkpoint(server: MlflowServer,
                                                                     tracked_run: dict[str, Any],
                                                                     tmp_path: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    record, run_dir = tracked_run["record"], tracked_run["run_dir"]
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "digits_test run"
    assert run.data.params == {"global_batch_size": "64", "learning_rate": "0.1", "momentum": "0.9",
                               "one_cycle": "true"}
    assert run.data.tags["team"] == "vision" and run.data.tags["dtrain.run_dir"] == str(run_dir)
    assert run.data.tags["dtrain.checkpoint"] == str(run_dir / "checkpoints" / "step-40")
    assert (run_dir / "checkpoints" / "step-40").is_dir()

    # every report's metrics, as the run store holds them (the store is written by another thread, another sink)
    info = json.loads((run_dir / "run.json").read_text())
    store = RunStore(tracked_run["store"])
    training, validation = store.metric_series(info["trial_id"], "training"), store.metric_series(
        info["trial_id"], "validation")
    store.close()
    assert [step for step, _ in training["loss"]] == [10, 20, 30, 40]
    assert _history(client, run.info.run_id, "train/loss") == training["loss"]
    assert _history(client, run.info.run_id, "train/lr") == training["lr"]  # every optimizer update's rate
    assert len(training["lr"]) == 40
    assert _history(client, run.info.run_id, "validation/accuracy") == validation["accuracy"]

    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert config.read_text() == (run_dir / "config.yaml").read_text()
    page = f"{server.uri}/#/experiments/{record['experiment_id']}/runs/{record['run_id']}"
    assert f"  MLflow       {page}" in tracked_run["stdout"]
    assert "MLflow at" not in tracked_run["stdout"] + tracked_run["stderr"]  # no warning when all went well


def test_a_search_logs_each_trial_as_a_child_of_its_run(server: MlflowServer, tmp_path: Path) -> None:
    import optuna
    from mlflow import MlflowClient

    search_dir = tmp_path / "search"
    done = subprocess.run(
        [*DTRAIN, "run", str(FIXTURES / "digits_search.yaml"), "--search-dir", str(search_dir), "--slots", "2",
         "--set", "searcher.max_trials=2", "--set", "searcher.max_length.batches=10", "--set",
         "min_validation_period.batches=5", "--set", f"tracking.mlflow.tracking_uri={server.uri}", "--set",
         "tracking.mlflow.experiment_name=digits search"],
        capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    study = optuna.load_study(study_name="digits_search", storage=f"sqlite:///{search_dir / 'study.db'}")
    parent_id = study.user_attrs["mlflow_run_id"]
    client = MlflowClient(tracking_uri=server.uri)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.params["searcher"] == "random"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    by_name = {child.info.run_name: child for child in children}
    trials = study.get_trials()
    assert sorted(by_name) == [f"trial-{t.number}" for t in trials] == ["trial-0", "trial-1"]
    for trial in trials:
        child = by_name[f"trial-{trial.number}"]
        assert child.info.status == "FINISHED"
        assert child.data.params["learning_rate"] == str(trial.params["learning_rate"])
        assert child.data.params["hidden"] == str(trial.params["hidden"])
        assert _history(client, child.info.run_id, "validation/accuracy")[-1] == (10, trial.value)
    assert _history(client, parent_id, "trials/accuracy") == [(t.number, t.value) for t in trials]
    assert parent.data.metrics["best/accuracy"] == max(t.value for t in trials)
    assert f"/#/experiments/{parent.info.experiment_id}/runs/{parent_id} (the trials are its child runs)" in done.stdout


def test_a_server_killed_mid_run_costs_one_warning_and_training_completes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with MlflowServer(tmp_path / "server") as server:
        process = subprocess.Popen(
            [*DTRAIN, "run", str(FIXTURES / "digits.yaml"), "--run-dir", str(run_dir), "--set", "scheduling_unit=10",
             "--set", f"searcher.max_length.batches={BATCHES}", "--set", "min_checkpoint_period.batches=200",
             "--set", "min_validation_period.batches=200", "--set", f"tracking.mlflow.tracking_uri={server.uri}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
        try:
            deadline = time.monotonic() + 300
            while not (run_dir / MLFLOW_RUN_FILE).is_file():  # the worker made its MLflow run on the server
                assert process.poll() is None and time.monotonic() < deadline, "no MLflow run was made"
                time.sleep(0.2)
            assert not (run_dir / "summary.json").exists()  # still training when the server goes
            server.stop()
            output, _ = process.communicate(timeout=600)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == BATCHES
    warnings = [line for line in output.splitlines() if "MLflow" in line and "MLflow       " not in line]
    assert len(warnings) == 1, output[-3000:]
    assert "cannot be reached" in warnings[0] and "training goes on without MLflow logging" in warnings[0]
    assert "Traceback" not in output


def test_the_run_page_in_a_browser_shows_its_metrics_and_loss_curve(server: MlflowServer,
                                                                    tracked_run: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    record = tracked_run["record"]
    info = json.loads((tracked_run["run_dir"] / "run.json").read_text())
    store = RunStore(tracked_run["store"])
    loss = store.metric_series(info["trial_id"], "training")["loss"]
    store.close()
    page_url = f"{server.uri}/#/experiments/{record['experiment_id']}/runs/{record['run_id']}"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(page_url)
            page.get_by_text("validation/accuracy").first.wait_for(timeout=120_000)  # content, not network idle
            page.screenshot(path=str(tmp_path / "mlflow-run.png"), full_page=True)
            body = page.inner_text("body")
            for seen in ("digits_test run", "Finished", "train/loss", "validation/accuracy", "learning_rate",
                         "dtrain.checkpoint_step"):
                assert seen in body, seen

            page.get_by_text("Model metrics").first.click()
            page.wait_for_function(f"() => ({CURVE_OF})('train/loss') !== null", timeout=120_000)
            page.screenshot(path=str(tmp_path / "mlflow-metrics.png"), full_page=True)
            drawn = page.evaluate(CURVE_OF, "train/loss")
        finally:
            browser.close()
    for trace in drawn:  # the chart's line and its markers: both through the logged points
        assert list(zip(trace["x"], trace["y"], strict=True)) == [(step, pytest.approx(value)) for step, value in loss]
    assert (tmp_path / "mlflow-run.png").stat().st_size > 10_000
    assert (tmp_path / "mlflow-metrics.png").stat().st_size > 10_000
