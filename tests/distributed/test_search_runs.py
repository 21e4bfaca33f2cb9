"""Searches run by `dtrain run`, trials as ordinary runs of 1 slot on digits:

- a 4-trial random search, 2 trials at once: a trial's worker is killed mid-way and the trial goes on from its
  checkpoint; Ctrl-C stops the search and the same command resumes it without rerunning finished trials; the study
  reads back through Optuna's own API; `dtrain experiments show` lists the trials; the results files are written;
- adaptive ASHA, two trials at once: the trials it stopped are exactly those Determined's rule stops, replayed from
  the rung values in the study in the order they were recorded; a trial that raises InvalidHP ends with exit
  code 4 and another is drawn;
- two `dtrain run --storage sqlite:///...` processes share one grid study and run disjoint trials that cover it;
- 4 trials on 2 slots: the compute threads of all workers running at once (read from each one's environment) never
  add up to more than the cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.search import asha
from tests.conftest import FIXTURES, subprocess_env

pytestmark = pytest.mark.slow  # each test runs a search: several trials, each a `dtrain run`

DTRAIN = [sys.executable, "-m", "dtrain.cli"]
SEARCH = FIXTURES / "digits_search.yaml"


def _workers_of(run_dir: Path) -> list[int]:
    """The pids of the worker processes training in `run_dir`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dtrain.worker" in command and str(run_dir).encode() in command:
            found.append(int(entry.name))
    return found


def _wait_for(condition: object, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def test_random_search_survives_a_killed_trial_and_ctrl_c_and_reads_back_in_optuna(tmp_path: Path) -> None:
    import optuna

    search_dir = tmp_path / "search"
    out = tmp_path / "first.out"
    command = [*DTRAIN, "run", str(SEARCH), "--slots", "2", "--search-dir", str(search_dir), "--set",
               "searcher.max_trials=4", "--set", "searcher.max_length={batches: 150}"]
    with out.open("w") as sink:
        first = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
        # kill trial 0's worker once it has a checkpoint: its run's elastic agent restarts it from there
        _wait_for(lambda: (search_dir / "trial-0" / "checkpoints" / "latest").is_file())
        killed = _workers_of(search_dir / "trial-0")
        assert killed, "trial 0's worker was not found"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        # Ctrl-C once two trials have completed
        _wait_for(lambda: out.read_text().count(" completed after ") >= 2)
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=240) == 130, out.read_text()[-3000:]
    text = out.read_text()
    assert "interrupted; run the same command again to resume the search" in text
    finished = {int(line.split()[3]) for line in text.splitlines() if " completed after " in line}
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=400, env=subprocess_env())
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "4 of 4 trials completed" in resumed.stdout
    for number in finished:  # finished trials are not run again
        assert f"trial {number} started" not in resumed.stdout and f"trial {number} resumed" not in resumed.stdout
    trial_0 = (search_dir / "logs" / "trial-0.log").read_text()
    assert "resuming at batch" in trial_0  # the killed worker's restart went on from its checkpoint

    study = optuna.load_study(study_name="digits_search", storage=f"sqlite:///{search_dir / 'study.db'}")
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    results = json.loads((search_dir / "results.json").read_text())
    for t in trials:
        assert 10 ** -2 <= t.params["learning_rate"] <= 10 ** -0.5 and t.params["hidden"] in (16, 32)
        summary = json.loads((search_dir / f"trial-{t.number}" / "summary.json").read_text())
        assert summary["steps_completed"] == 150 and t.value == summary["validation"]["accuracy"]
        # every validation (every 20 batches and the last) is an intermediate value at its batch
        assert sorted(t.intermediate_values) == [20, 40, 60, 80, 100, 120, 140, 150]
        assert t.intermediate_values[150] == t.value
    assert results["batches_trained"] == 4 * 150 and len(results["trials"]) == 4
    assert (search_dir / "search.png").stat().st_size > 10_000
    assert list((search_dir / "tensorboard").glob("trial-*/events.out.tfevents.*"))
    experiment = json.loads((search_dir / "search.json").read_text())["experiment_id"]
    shown = subprocess.run([*DTRAIN, "experiments", "show", str(experiment)], capture_output=True, text=True,
                           env=subprocess_env())
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("\ntrial ") >= 4 and "completed" in shown.stdout


def test_adaptive_asha_stops_trials_by_determined_s_rule_and_invalid_trials_are_replaced(tmp_path: Path) -> None:
    import optuna

    search_dir = tmp_path / "asha"
    # seed 0 draws learning rates 0.0666, 0.0422, 0.0451, 0.0670, 0.282, 0.0215, ...: the fifth is rejected
    done = subprocess.run([*DTRAIN, "run", str(SEARCH), "--slots", "2", "--search-dir", str(search_dir),
                          "--set", "searcher={name: adaptive_asha, metric: accuracy, smaller_is_better: false, "
                          "max_trials: 5, max_time: 64, time_metric: batches, divisor: 2, mode: aggressive, "
                          "max_concurrent_trials: 2}", "--set", "min_validation_period={batches: 8}",
                          "--set", "hyperparameters.invalid_lr_above=0.1"],
                         capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    study = optuna.load_study(study_name="digits_search", storage=f"sqlite:///{search_dir / 'study.db'}")
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    invalid = [t for t in trials if t.user_attrs.get("invalid_hp")]
    valid = [t for t in trials if not t.user_attrs.get("invalid_hp")]
    assert len(invalid) == 1 and invalid[0].params["learning_rate"] > 0.1 and len(valid) == 5
    assert invalid[0].state == optuna.trial.TrialState.FAIL and "rejects it" in invalid[0].user_attrs["invalid_hp"]
    assert f"trial {invalid[0].number} invalid" in done.stdout
    log = (search_dir / "logs" / f"trial-{invalid[0].number}.log").read_text()
    assert "rejects it" in log and "Traceback" not in log
    # the plan: 5 trials, divisor 2, aggressive: rungs min(5, 1 + 6, 1 + 2) = 3 at 64/4, 64/2, 64 batches
    assert asha.plan(5, 64, 2, 5, "aggressive")[0].units == (16, 32, 64)
    # replay Determined's rule over the rung records in the order they were taken (one at a time, under the lock)
    records = sorted((t.user_attrs[f"rung_{i}_at"], i, t.number, t.user_attrs[f"rung_{i}"])
                     for t in valid for i in range(2) if f"rung_{i}" in t.user_attrs)
    rungs, expected = [asha.Rung(), asha.Rung()], {t.number: "completed" for t in valid}
    for _, index, number, value in records:
        assert expected[number] == "completed", "a stopped trial recorded at a later rung"
        if not rungs[index].continue_training(value, 2, smaller_is_better=False):
            expected[number] = "stopped"
    for t in valid:
        summary = json.loads((search_dir / f"trial-{t.number}" / "summary.json").read_text())
        if expected[t.number] == "stopped":
            assert t.state == optuna.trial.TrialState.PRUNED, t.number
            assert summary["status"] == "stopped" and summary["steps_completed"] in (16, 32)
            step = summary["steps_completed"]
            assert (search_dir / f"trial-{t.number}" / "checkpoints" / f"step-{step}").is_dir()  # kept
        else:
            assert t.state == optuna.trial.TrialState.COMPLETE and summary["steps_completed"] == 64, t.number
    assert any(t.state == optuna.trial.TrialState.PRUNED for t in valid)
    assert "stopped early" in done.stdout and "best: trial" in done.stdout


def test_two_processes_share_one_study_and_run_disjoint_trials(tmp_path: Path) -> None:
    import optuna

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    command = [*DTRAIN, "run", str(SEARCH), "--slots", "1", "--storage", storage, "--set", "searcher.name=grid",
               "--set", "hyperparameters.learning_rate={type: log, minval: -2, maxval: -1, count: 2}"]
    processes = [subprocess.Popen([*command, "--search-dir", str(tmp_path / f"machine-{i}")], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=subprocess_env()) for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in processes]
    for process, (out, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, out[-2000:] + err[-2000:]
    ran = [{int(line.split()[3]) for line in out.splitlines() if line.startswith("dtrain search: trial ")
            and " started" in line} for out, _ in outputs]
    assert ran[0] and ran[1] and not ran[0] & ran[1]  # both worked, never on the same trial
    study = optuna.load_study(study_name="digits_search", storage=storage)
    trials = study.get_trials()
    assert ran[0] | ran[1] == {t.number for t in trials}
    points = {(round(t.params["learning_rate"], 6), t.params["hidden"]) for t in trials}
    assert points == {(0.01, 16), (0.01, 32), (0.1, 16), (0.1, 32)}  # 2 learning rates x 2 widths, each once
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    wrong = subprocess.run([*DTRAIN, "run", str(FIXTURES / "digits.yaml"), "--storage", storage], capture_output=True,
                           text=True, env=subprocess_env())
    assert wrong.returncode == 2 and "searcher is single: drop them" in wrong.stderr and "Traceback" not in wrong.stderr


def _omp_threads(pid: int) -> int | None:
    """OMP_NUM_THREADS in process `pid`'s environment (None when it has gone or does not say)."""
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in entries:
        if entry.startswith(b"OMP_NUM_THREADS="):
            return int(entry.split(b"=", 1)[1])
    return None


def test_concurrent_trials_never_take_more_compute_threads_than_the_cores(tmp_path: Path) -> None:
    from dtrain.runs.processes import host_cores

    cores = host_cores()
    search_dir = tmp_path / "threads"
    env = subprocess_env()
    env.pop("OMP_NUM_THREADS", None)
    search = subprocess.Popen([*DTRAIN, "run", str(SEARCH), "--slots", "2", "--search-dir", str(search_dir),
                               "--set", "searcher.max_trials=4", "--set", "searcher.max_length={batches: 60}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    most_workers, most_threads = 0, 0
    while search.poll() is None:  # every worker of every trial, read from its environment as it runs
        workers = [_workers_of(search_dir / f"trial-{n}") for n in range(4)]
        threads = [t for t in (_omp_threads(pid) for pids in workers for pid in pids) if t is not None]
        most_workers, most_threads = max(most_workers, len(threads)), max(most_threads, sum(threads))
        time.sleep(0.05)
    output = search.stdout.read() if search.stdout else ""
    assert search.returncode == 0, output[-3000:]
    assert most_workers == 2, f"expected 2 trials' workers at once, saw at most {most_workers}"
    assert most_threads <= max(cores, most_workers), (most_threads, cores)
