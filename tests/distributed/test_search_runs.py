"""A random search run by `dtrain run`: trials are ordinary runs with their own run dirs, two at a time on two
slots; the study reads back through Optuna's own API; a search run again resumes without rerunning finished
trials; a grid search trains every point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import FIXTURES, subprocess_env

DTRAIN = [sys.executable, "-m", "dtrain.cli"]


def _search(search_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DTRAIN, "run", str(FIXTURES / "digits_search.yaml"), "--slots", "2", "--search-dir",
                           str(search_dir), *extra], capture_output=True, text=True, timeout=400,
                          env=subprocess_env())


def test_random_search_runs_resumes_and_reads_back_in_optuna(tmp_path: Path) -> None:
    import optuna

    search_dir = tmp_path / "search"
    first = _search(search_dir, "--set", "searcher.max_trials=3")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "3 of 3 trials completed" in first.stdout and "best: trial" in first.stdout
    study = optuna.load_study(study_name="digits_search", storage=f"sqlite:///{search_dir / 'study.db'}")
    trials = study.get_trials()
    assert len(trials) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for t in trials:
        assert 10 ** -2 <= t.params["learning_rate"] <= 10 ** -0.5 and t.params["hidden"] in (16, 32)
        assert 0.0 <= t.value <= 1.0
        assert (search_dir / f"trial-{t.number}" / "summary.json").is_file()
    again = _search(search_dir)  # max_trials 4: one more trial, the three finished ones are not rerun
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("started") == 1 and "4 of 4 trials completed" in again.stdout


def test_grid_search_trains_every_point_and_bad_flags_are_one_line(tmp_path: Path) -> None:
    grid = _search(tmp_path / "grid", "--set", "searcher.name=grid", "--set",
                   "hyperparameters.learning_rate={type: log, minval: -2, maxval: -1, count: 2}")
    assert grid.returncode == 0, grid.stdout[-2000:] + grid.stderr[-2000:]
    assert "4 of 4 trials completed" in grid.stdout  # 2 learning rates x 2 widths
    wrong = subprocess.run([*DTRAIN, "run", str(FIXTURES / "digits.yaml"), "--slots", "2"], capture_output=True,
                           text=True, env=subprocess_env())
    assert wrong.returncode == 2 and "searcher is single: drop them" in wrong.stderr and "Traceback" not in wrong.stderr


def test_ctrl_c_stops_a_search_and_the_same_command_resumes_it(tmp_path: Path) -> None:
    import signal
    import time

    search_dir = tmp_path / "search"
    command = [*DTRAIN, "run", str(FIXTURES / "digits_search.yaml"), "--slots", "2", "--search-dir", str(search_dir),
               "--set", "searcher.max_trials=2", "--set", "searcher.max_length={batches: 400}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(search_dir.glob("trial-*/checkpoints/latest")):
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, out[-1500:] + err[-1500:]
    assert "interrupted; run the same command again to resume the search" in err
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=400, env=subprocess_env())
    assert resumed.returncode == 0, resumed.stdout[-1500:] + resumed.stderr[-1500:]
    assert "2 of 2 trials completed" in resumed.stdout
    logs = "".join(path.read_text() for path in (search_dir / "logs").glob("trial-*.log"))
    assert "(resuming)" in logs  # the interrupted trials went on from their checkpoints
