"""A random search whose command entrypoint sets its own length (tests/determined_trials/own_length_search.yaml: no
searcher.max_length, `python3 own_length.py --batches 6`) runs, as Determined runs it: each trial trains to the
length its script chose, and the searcher counts what the script reported (6 batches), not a length of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a search: two trials, each a `dtrain run`

TRIALS = Path(__file__).resolve().parents[1] / "determined_trials"


def test_a_search_over_a_command_that_sets_its_own_length_counts_what_it_reports(tmp_path: Path) -> None:
    import optuna

    env = {k: v for k, v in os.environ.items() if k not in ("DTRAIN_LAUNCHER", "DTRAIN_RUN_DIR")}
    env["DTRAIN_RUNS_ROOT"] = str(tmp_path / "runs")
    search_dir = tmp_path / "search"
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(TRIALS / "own_length_search.yaml"),
                           "--slots", "1", "--search-dir", str(search_dir)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    study = optuna.load_study(study_name="own_length_search", storage=f"sqlite:///{search_dir / 'study.db'}")
    trials = study.get_trials()
    assert len(trials) == 2
    for trial in trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE
        assert trial.user_attrs["trained"] == {"batches": 6.0}  # the steps the script reported
        assert max(trial.intermediate_values) == 6
        rate = trial.params["rate"]
        assert trial.value == pytest.approx(10.0 * (1.0 - rate) ** 6)  # the last validation the script reported
        summary = json.loads((search_dir / f"trial-{trial.number}" / "summary.json").read_text())
        assert summary["status"] == "completed"
