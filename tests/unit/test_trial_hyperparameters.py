"""A Trial's hyperparameter rules are checked by `dtrain run` before any worker starts
(`Trial.check_hyperparameters`); the SVM trial's names and estimator rules were checked in each worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dtrain.cli import main
from dtrain.errors import ExitCode
from dtrain.launch import LaunchResult
from dtrain.train.trial import Trial

SVM_DIGITS = Path(__file__).resolve().parents[2] / "examples" / "svm" / "digits.yaml"


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The launches `dtrain run` asks for (none is started)."""
    calls: list[Any] = []

    def launch(*args: Any) -> LaunchResult:
        calls.append(args)
        return LaunchResult(ExitCode.FAILED, "not started in this test")

    monkeypatch.setattr("dtrain.launch.launch_workers", launch)
    return calls


@pytest.mark.parametrize(("setting", "message"), [
    ("C=0", "C (0) must be > 0; use e.g. C: 1.0"),
    ("gama=0.1", "hyperparameter `gama` is not one the SVM trial takes; did you mean `gamma`?"),
    ("kernel=sigmoid", "kernel 'sigmoid' is not one of linear, rbf, poly"),
    ("gamma=-1", "gamma -1.0 must be > 0 for the rbf kernel"),
    ("gamma=wide", "gamma 'wide' must be a positive number, 'scale' or 'auto'"),
    ("working_set=3", "working_set (3) must be an even number >= 2"),
    ("shrinking=often", "shrinking 'often' is not one of"),
])
def test_a_bad_svm_hyperparameter_stops_dtrain_run_before_any_worker_starts(
        setting: str, message: str, launched: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["run", str(SVM_DIGITS), "--run-dir", str(tmp_path / "run"), "--set", f"hyperparameters.{setting}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USER_ERROR and not launched, err
    assert len(err) == 1 and err[0].startswith("dtrain: error: ") and message in err[0], err


def test_good_svm_hyperparameters_reach_the_launcher(launched: list[Any], tmp_path: Path) -> None:
    main(["run", str(SVM_DIGITS), "--run-dir", str(tmp_path / "run"), "--set", "hyperparameters.gamma=scale"])
    assert len(launched) == 1


def test_a_trial_accepts_any_hyperparameters_by_default() -> None:
    assert Trial.check_hyperparameters({"anything": object()}) is None
