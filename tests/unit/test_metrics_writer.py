"""Rank 0's metrics writer: rows queued on the training thread reach the store in order, status waits for them,
and a failed write is raised on the training thread."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dtrain.runs.store import RunStore
from dtrain.train.metrics import MetricsWriter


def new_trial(path: Path) -> int:
    store = RunStore(path)
    trial = store.create_trial(store.create_experiment("e", "", "{}"), path.parent, {}, 1)
    store.close()
    return trial


def test_rows_reach_the_store_in_order_and_status_waits_for_them(tmp_path: Path) -> None:
    path = tmp_path / "metrics.db"
    trial = new_trial(path)
    writer = MetricsWriter(store_path=path, trial_id=trial, tensorboard_dir=tmp_path / "tb")
    for step in range(1, 251):
        writer.training(step, step / 100, step * 0.1, {"lr": step * 0.5})
        if step % 100 == 0:
            writer.flush()
    writer.validation(200, 2.0, 20.0, {"accuracy": 0.75})
    writer.training(200, 2.0, 20.0, {"lr": -1.0})  # a step trained again keeps its newest value
    writer.flush()
    writer.status("running")  # returns once everything before it is written
    reader = RunStore(path)
    training = reader.metric_series(trial, "training")["lr"]
    assert [step for step, _ in training] == list(range(1, 251))
    assert dict(training)[200] == -1.0 and dict(training)[250] == 125.0
    assert reader.metric_series(trial, "validation") == {"accuracy": [(200, 0.75)]}
    assert reader.trials(1)[0].status == "running"
    writer.status("completed", {"steps": 250})
    writer.close()
    assert reader.trials(1)[0].summary == {"steps": 250}
    assert list((tmp_path / "tb").iterdir())  # TensorBoard events were written too


def test_a_failed_write_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    path = tmp_path / "metrics.db"
    trial = new_trial(path)
    writer = MetricsWriter(store_path=path, trial_id=trial, tensorboard_dir=None)
    assert writer._store is not None

    def disk_full(*args: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    writer._store.add_metrics = disk_full  # type: ignore[method-assign]
    writer.training(1, 0.0, 0.0, {"lr": 0.1})
    writer.flush()  # queued: the training thread does not wait for the write
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        writer.status("running")
    writer.close()


def test_a_run_that_never_closes_is_drained_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "metrics.db"
    trial = new_trial(path)
    writer = MetricsWriter(store_path=path, trial_id=trial, tensorboard_dir=None)
    writer.training(7, 0.0, 0.0, {"loss": 1.5})
    writer._drain_at_exit()  # what the interpreter's exit runs for a writer nobody closed
    assert RunStore(path).metric_series(trial, "training") == {"loss": [(7, 1.5)]}


def test_other_ranks_write_nothing_and_start_no_thread(tmp_path: Path) -> None:
    writer = MetricsWriter(store_path=None, trial_id=None, tensorboard_dir=None)
    writer.training(1, 0.0, 0.0, {"lr": 0.1})
    writer.flush()
    writer.status("running")
    writer.close()
    assert writer._thread is None
