"""Compute threads per process: the host's cores shared by every process dtrain starts on it (a run's workers
and parameter servers, and in a search every trial running beside it), unless the user set OMP_NUM_THREADS."""

from __future__ import annotations

import os

import pytest

from dtrain import launch
from dtrain.runs.processes import CONCURRENT_RUNS_ENV, concurrent_runs, threads_per_process


def test_one_run_shares_the_cores_among_its_processes() -> None:
    assert threads_per_process(1, {}, cores=8) == 8
    assert threads_per_process(3, {}, cores=8) == 2  # e.g. 2 workers and 1 parameter server


def test_concurrent_trials_of_a_search_share_the_cores_too() -> None:
    environ = {CONCURRENT_RUNS_ENV: "2"}
    assert concurrent_runs(environ) == 2
    assert threads_per_process(1, environ, cores=2) == 1  # 2 trials of 1 worker on 2 cores: 1 thread each
    assert threads_per_process(2, {CONCURRENT_RUNS_ENV: "4"}, cores=16) == 2
    assert threads_per_process(4, {CONCURRENT_RUNS_ENV: "4"}, cores=2) == 1  # never below one thread


def test_a_malformed_count_is_one_run() -> None:
    assert concurrent_runs({CONCURRENT_RUNS_ENV: "x"}) == 1 and concurrent_runs({CONCURRENT_RUNS_ENV: "0"}) == 1


def test_the_launcher_sets_the_share_and_leaves_the_users_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(CONCURRENT_RUNS_ENV, "2")
    monkeypatch.setattr("dtrain.runs.processes.host_cores", lambda: 4)
    launch._worker_environment(2)
    assert os.environ["OMP_NUM_THREADS"] == "1"  # 2 trials x 2 processes on 4 cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    launch._worker_environment(2)
    assert os.environ["OMP_NUM_THREADS"] == "3"
