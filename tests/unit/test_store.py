"""The SQLite run store and the run-dir rules around it."""

from __future__ import annotations

import math
import sqlite3
import threading
from pathlib import Path

import pytest

from dtrain.config import load_config
from dtrain.errors import LaunchError
from dtrain.runs.rundir import prepare_run_dir, store_path
from dtrain.runs.store import RunStore

RAW = {"name": "s", "entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
       "searcher": {"max_length": {"batches": 3}}}


def test_a_new_store_waits_for_another_process_s_write_instead_of_failing(tmp_path: Path) -> None:
    """A new file in rollback mode with a write open on another connection: SQLite refuses the switch to WAL at
    once ("database is locked", no busy wait); RunStore waits for the write to end (two searches started side by
    side create one store together). The other connection stands for the other process."""
    path = tmp_path / "metrics.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("CREATE TABLE other_process (i INTEGER)")
    with pytest.raises(sqlite3.OperationalError, match="locked"):  # what SQLite itself does: the case is real
        sqlite3.connect(path, timeout=5.0, isolation_level=None).execute("PRAGMA journal_mode=WAL")
    committed = threading.Timer(0.3, lambda: writer.execute("COMMIT"))
    committed.start()
    store = RunStore(path)
    committed.join()
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.create_experiment("e", "", "name: e\n") == 1
    writer.close()


def test_experiments_trials_and_metrics(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "m.db")
    exp = store.create_experiment("e", "", "name: e\n")
    trial = store.create_trial(exp, tmp_path, {"lr": 0.1}, 2)
    store.add_metrics(trial, "training", [(1, 0.1, 1.0, {"loss": 2.0}), (2, 0.2, 2.0, {"loss": 1.5})])
    store.add_metrics(trial, "training", [(2, 0.2, 2.5, {"loss": 1.4})])  # step 2 again after a restart
    store.add_metrics(trial, "validation", [(2, 0.2, 2.0, {"accuracy": 0.5, "loss": 1.0})])
    store.set_status(trial, "completed", {"steps_completed": 2})
    assert store.metric_series(trial, "training") == {"loss": [(1, 2.0), (2, 1.4)]}
    assert store.metric_series(trial, "validation")["accuracy"] == [(2, 0.5)]
    [(experiment, last)] = store.experiments()
    assert experiment.name == "e" and last is not None and last.status == "completed"
    assert last.summary == {"steps_completed": 2} and last.ended_at is not None
    store.close()
    assert RunStore(tmp_path / "m.db").experiment(exp) is not None


def test_a_batch_of_rows_is_one_transaction(tmp_path: Path) -> None:
    """add_metrics writes all of its rows or none (one transaction, so one fsync per report instead of one per
    row): a row SQLite refuses (a step of None, which `step NOT NULL` rejects) leaves none behind."""
    store = RunStore(tmp_path / "m.db")
    trial = store.create_trial(store.create_experiment("e", "", "name: e\n"), tmp_path, {}, 2)
    with pytest.raises(sqlite3.IntegrityError):
        store.add_metrics(trial, "training", [(1, 0.1, 1.0, {"loss": 2.0, "lr": 0.1}),
                                              (None, 0.2, 2.0, {"loss": 1.5, "lr": 0.1})])  # type: ignore[list-item]
    assert store.metric_series(trial, "training") == {}
    store.add_metrics(trial, "training", [(3, 0.3, 3.0, {"loss": 1.0})])
    assert store.metric_series(trial, "training") == {"loss": [(3, 1.0)]}
    store.close()


def test_non_finite_values_are_stored(tmp_path: Path) -> None:
    """A diverged loss (NaN, +-inf) is a metric like any other: stored, read back, and the rows beside it kept.
    SQLite binds a NaN as NULL, which the schema refuses; before the fix this report failed and the run with it."""
    store = RunStore(tmp_path / "m.db")
    trial = store.create_trial(store.create_experiment("e", "", "name: e\n"), tmp_path, {}, 2)
    store.add_metrics(trial, "training", [(1, 0.1, 1.0, {"loss": float("nan"), "lr": 0.1}),
                                          (2, 0.2, 2.0, {"loss": float("inf"), "lr": 0.1}),
                                          (3, 0.3, 3.0, {"loss": float("-inf"), "lr": 0.1})])
    series = store.metric_series(trial, "training")
    store.close()
    [(_, nan), (_, inf), (_, minus_inf)] = series["loss"]
    assert math.isnan(nan) and inf == math.inf and minus_inf == -math.inf
    assert series["lr"] == [(1, 0.1), (2, 0.1), (3, 0.1)]
    with sqlite3.connect(tmp_path / "m.db") as db:
        assert db.execute("SELECT COUNT(*) FROM metrics WHERE value IS NULL").fetchone() == (0,)


def test_new_run_dir_is_registered(runs_root: Path) -> None:
    config = load_config(None, raw=RAW).config
    info = prepare_run_dir(config, None, Path.cwd())
    assert info.run_dir == (runs_root / "s" / str(info.experiment_id)).resolve()
    assert (info.run_dir / "config.yaml").is_file() and (info.run_dir / "run.json").is_file()
    store = RunStore(store_path())
    assert store.trials(info.experiment_id)[0].run_dir == str(info.run_dir)


def test_reopening_requires_the_same_config(tmp_path: Path) -> None:
    config = load_config(None, raw=RAW).config
    prepare_run_dir(config, tmp_path / "run", Path.cwd())
    same = prepare_run_dir(load_config(None, ["faults.stop_after_batch=1"], raw=RAW).config, tmp_path / "run",
                           Path.cwd())
    assert same.resumed
    with pytest.raises(LaunchError, match=r"different config \(hyperparameters.global_batch_size: 8 -> 16\)"):
        prepare_run_dir(load_config(None, ["hyperparameters.global_batch_size=16"], raw=RAW).config,
                        tmp_path / "run", Path.cwd())


def test_reopening_at_another_world_size_is_allowed_and_every_other_key_still_refused(tmp_path: Path) -> None:
    """A resume keeps its global batch and cuts it over the new slots (dtrain.train.resize), so the world size may
    change; a change of it together with another key is still refused, naming the other key."""
    prepare_run_dir(load_config(None, ["resources.slots_per_trial=2"], raw=RAW).config, tmp_path / "run", Path.cwd())
    resized = prepare_run_dir(load_config(None, ["resources.slots_per_trial=1"], raw=RAW).config, tmp_path / "run",
                              Path.cwd())
    assert resized.resumed and "slots_per_trial: 1" in (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(LaunchError, match=r"different config \(hyperparameters.learning_rate: None -> 0.5\)"):
        prepare_run_dir(load_config(None, ["resources.slots_per_trial=3", "hyperparameters.learning_rate=0.5"],
                                    raw=RAW).config, tmp_path / "run", Path.cwd())


def test_reopening_hsdp_at_another_size_may_change_its_shard_groups(tmp_path: Path) -> None:
    """hsdp's shard groups must divide the world size, so a 2 x 2 mesh resumed on 3 slots sets shard_size anew
    (distributed checkpoint reshards on load); its other settings are still refused."""
    hsdp = {**RAW, "distributed": {"strategy": "hsdp"}}
    prepare_run_dir(load_config(None, ["resources.slots_per_trial=4", "distributed.hsdp.shard_size=2"],
                                raw=hsdp).config, tmp_path / "run", Path.cwd())
    assert prepare_run_dir(load_config(None, ["resources.slots_per_trial=3"], raw=hsdp).config, tmp_path / "run",
                           Path.cwd()).resumed
    with pytest.raises(LaunchError, match=r"different config \(distributed.hsdp.reshard_after_forward: True -> "):
        prepare_run_dir(load_config(None, ["distributed.hsdp.reshard_after_forward=false"], raw=hsdp).config,
                        tmp_path / "run", Path.cwd())


def test_completed_or_foreign_dirs_are_refused(tmp_path: Path) -> None:
    config = load_config(None, raw=RAW).config
    info = prepare_run_dir(config, tmp_path / "run", Path.cwd())
    (info.run_dir / "summary.json").write_text('{"status": "completed"}')
    with pytest.raises(LaunchError, match="holds a completed run"):
        prepare_run_dir(config, tmp_path / "run", Path.cwd())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep")
    with pytest.raises(LaunchError, match="not empty"):
        prepare_run_dir(config, tmp_path / "other", Path.cwd())
    assert (tmp_path / "other" / "precious.txt").read_text() == "keep"
