"""Restart of an SVM run: a rank is SIGKILLed in the middle of the SMO solve; the launcher restarts the workers,
they resume from the latest checkpoint (alpha, f, active set, elimination streaks) and the run ends with the
same alphas, bit for bit, as the same run without the kill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from faultkit import dtrain, fault_records, summary

pytestmark = pytest.mark.slow  # a killed SMO run and its restart

CONFIG = {
    "name": "svm_restart",
    "entrypoint": "dtrain.svm.trial:SVMTrial",
    # 20 SMO iterations per batch; elimination checks every 50 iterations, so samples are already eliminated
    # when the checkpoints before the kill are written
    "hyperparameters": {"global_batch_size": 20, "C": 10, "gamma": 0.05, "kernel": "rbf", "shrinking": "lazy",
                        "shrink_every": 50, "shrink_patience": 1},
    "data": {"dataset": "digits", "classes": [3, 8]},
    "resources": {"slots_per_trial": 2},
    "searcher": {"name": "single", "metric": "accuracy", "smaller_is_better": False,
                 "max_length": {"batches": 100}},
    "min_checkpoint_period": {"batches": 3},
    "max_restarts": 2,
}


def _final_coefficients(run_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    found = summary(run_dir)
    assert found["status"] == "completed", found
    tensors = torch.load(found["checkpoint"], weights_only=True)
    return tensors["p0.support"], tensors["p0.coef"]


def test_killed_rank_resumes_the_smo_and_ends_with_the_same_alphas(tmp_path: Path) -> None:
    config = tmp_path / "svm.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    clean = dtrain("run", config, "--run-dir", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    killed = dtrain("run", config, "--set", "faults.kills=[{rank: 1, batch: 8}]", "--run-dir", tmp_path / "killed")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "Traceback" not in killed.stderr
    assert [(r["rank"], r["batch"]) for r in fault_records(tmp_path / "killed")] == [(1, 8)]
    resumed = summary(tmp_path / "killed")
    assert resumed["restarts"] == 1 and resumed["resumes"] == 1
    assert "resumed from checkpoint step-6" in killed.stderr
    assert resumed["svm"]["eliminated"] > 0  # the checkpoint carried an active set smaller than the data
    support, coef = _final_coefficients(tmp_path / "killed")
    clean_support, clean_coef = _final_coefficients(tmp_path / "clean")
    assert torch.equal(support, clean_support) and torch.equal(coef, clean_coef)
    assert resumed["svm"]["iterations"] == summary(tmp_path / "clean")["svm"]["iterations"]
    assert resumed["svm"]["final_kkt_gap"] <= 1e-3
