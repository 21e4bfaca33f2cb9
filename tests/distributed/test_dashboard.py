"""`dtrain dashboard` serves a search's Optuna study with optuna-dashboard: started as a process on loopback, its
API lists the study and its trials, its page is served, and it stops on SIGINT."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("optuna_dashboard") is None,
                                reason="needs optuna-dashboard (pip install -e '.[dev]')")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, deadline: float) -> bytes:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return bytes(response.read())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_dashboard_serves_a_search_dir_s_study(tmp_path: Path) -> None:
    import optuna

    search_dir = tmp_path / "search"
    search_dir.mkdir()
    study = optuna.create_study(study_name="digits_search", storage=f"sqlite:///{search_dir / 'study.db'}",
                                direction="maximize")
    rate = {"learning_rate": optuna.distributions.FloatDistribution(0.0, 1.0)}
    for value in (0.5, 0.75, 0.625):
        study.add_trial(optuna.trial.create_trial(params={"learning_rate": value / 10}, distributions=rate,
                                                  value=value))
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "dashboard", str(search_dir), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        deadline = time.monotonic() + 60
        studies = json.loads(_get(f"http://127.0.0.1:{port}/api/studies", deadline))["study_summaries"]
        assert [s["study_name"] for s in studies] == ["digits_search"]
        study_id = studies[0]["study_id"]
        detail = json.loads(_get(f"http://127.0.0.1:{port}/api/studies/{study_id}", deadline))
        assert sorted(t["values"][0] for t in detail["trials"]) == [0.5, 0.625, 0.75]
        assert b"<html" in _get(f"http://127.0.0.1:{port}/dashboard/", deadline).lower()
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert f"at http://127.0.0.1:{port}/dashboard/" in stderr
    assert "Traceback" not in stderr


def test_a_dir_without_a_study_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "dashboard", str(tmp_path)], capture_output=True,
                          text=True, env=subprocess_env(), timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"dtrain: error: {tmp_path} holds no study.db: give a search dir (`dtrain run SEARCH.yaml --search-dir DIR` "
        "makes one) or the study's storage URL"]
