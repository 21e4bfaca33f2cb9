"""`dtrain dashboard` serves a search's Optuna study with optuna-dashboard: started as a process on loopback, its
API lists the study and its trials, its page is served, and it stops on SIGINT; in a real browser (Debian's
Chromium through Playwright) a finished search's dashboard shows its trials and their metric."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.browserkit import CHROMIUM, LAUNCH_ARGS, PLOTLY_TRACES, browser_missing
from tests.conftest import FIXTURES, free_port, subprocess_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("optuna_dashboard") is None,
                                reason="needs optuna-dashboard (pip install -e '.[dev]')")


def _get(url: str, deadline: float) -> bytes:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return bytes(response.read())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _interrupt(process: subprocess.Popen[str]) -> str:
    """Ctrl-C to `dtrain dashboard`; its stderr. A dashboard still running a minute later is killed (no process is
    left behind) and the test fails."""
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate(timeout=30)
        raise AssertionError("dtrain dashboard did not stop within 60 s of SIGINT; killed") from None


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
    port = free_port()
    # started with SIGINT ignored, as a background job of a script is (CI's shell): Ctrl-C must still stop it
    process = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "dashboard", str(search_dir), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        studies = json.loads(_get(f"http://127.0.0.1:{port}/api/studies", deadline))["study_summaries"]
        assert [s["study_name"] for s in studies] == ["digits_search"]
        study_id = studies[0]["study_id"]
        detail = json.loads(_get(f"http://127.0.0.1:{port}/api/studies/{study_id}", deadline))
        assert sorted(t["values"][0] for t in detail["trials"]) == [0.5, 0.625, 0.75]
        assert b"<html" in _get(f"http://127.0.0.1:{port}/dashboard/", deadline).lower()
    finally:
        stderr = _interrupt(process)
    assert f"at http://127.0.0.1:{port}/dashboard/" in stderr
    assert "Traceback" not in stderr


def test_a_dir_without_a_study_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "dashboard", str(tmp_path)], capture_output=True,
                          text=True, env=subprocess_env(), timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"dtrain: error: {tmp_path} holds no study.db: give a search dir (`dtrain run SEARCH.yaml --search-dir DIR` "
        "makes one) or the study's storage URL"]


@pytest.mark.slow  # a search of two trials, then the dashboard in a browser
def test_a_finished_search_in_the_browser_shows_its_trials_and_their_metric(tmp_path: Path) -> None:
    """A person opening `dtrain dashboard` on a finished search sees its study, each trial complete with its
    metric, the history chart through the trials' values and each trial's intermediate values (screenshots under
    tmp_path)."""
    missing = browser_missing()
    if missing:
        pytest.skip(missing)
    import optuna
    from playwright.sync_api import sync_playwright

    search_dir = tmp_path / "search"
    done = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", str(FIXTURES / "digits_search.yaml"), "--search-dir",
         str(search_dir), "--slots", "2", "--set", "searcher.max_trials=2", "--set", "searcher.max_length.batches=10",
         "--set", "min_validation_period.batches=5"],
        capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"dtrain dashboard {search_dir}" in done.stdout  # the search says how to open it
    study = optuna.load_study(study_name="digits_search", storage=f"sqlite:///{search_dir / 'study.db'}")
    trials = study.get_trials()
    best = max(trials, key=lambda t: t.value)

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "dashboard", str(search_dir), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        _get(f"http://127.0.0.1:{port}/api/studies", time.monotonic() + 60)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/dashboard/")
                page.get_by_text("digits_search").first.click()  # the study list, as a person picks the study
                page.get_by_text(f"Best Trial (number={best.number})").first.wait_for(timeout=120_000)
                page.wait_for_function(f"() => ({PLOTLY_TRACES})().some(t => t.name.startsWith('Objective') "
                                       "&& t.x.length > 0)", timeout=120_000)
                page.screenshot(path=str(tmp_path / "dashboard-study.png"), full_page=True)
                traces = page.evaluate(PLOTLY_TRACES)
                study_page = page.inner_text("body")

                page.goto(f"{page.url.rstrip('/')}/trials")
                page.get_by_text("Intermediate Values").first.wait_for(timeout=120_000)
                page.screenshot(path=str(tmp_path / "dashboard-trials.png"), full_page=True)
                trials_page = page.inner_text("body")
            finally:
                browser.close()
    finally:
        _interrupt(process)

    assert str(best.value) in study_page  # the best trial's metric, written out
    history = next(t for t in traces if t["name"].startswith("Objective"))
    assert list(zip(history["x"], history["y"], strict=True)) == [(t.number, t.value) for t in trials]
    for trial in trials:  # each trial's intermediate values (one per validation), as the study holds them
        curve = next(t for t in traces if t["name"].strip() == f"trial #{trial.number}")
        assert list(zip(curve["x"], curve["y"], strict=True)) == sorted(trial.intermediate_values.items())
        assert f"Trial {trial.number}" in trials_page
    assert trials_page.count("Complete") >= len(trials)
    assert (tmp_path / "dashboard-study.png").stat().st_size > 10_000
    assert (tmp_path / "dashboard-trials.png").stat().st_size > 10_000
