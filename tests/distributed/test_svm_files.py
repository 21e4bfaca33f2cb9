"""`dtrain run` of an SVM on one's own arrays (a .npz for training, a CSV for validation; no SVMTrial subclass)
ends with scikit-learn's accuracy on the same arrays."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dtrain.svm.datasets import digits
from tests.conftest import subprocess_env

pytestmark = pytest.mark.slow  # a dtrain run


def test_an_svm_run_on_npz_and_csv_files_matches_scikit_learn(tmp_path: Path) -> None:
    from sklearn.svm import SVC

    (x_train, y_train), (x_test, y_test) = digits([3, 8])
    np.savez(tmp_path / "train.npz", X=x_train, y=y_train)
    np.savetxt(tmp_path / "test.csv", np.column_stack([x_test, y_test]), delimiter=",")
    config = {"name": "svm_files", "entrypoint": "dtrain.svm.trial:SVMTrial",
              "hyperparameters": {"global_batch_size": 100, "C": 10, "gamma": 0.05, "kernel": "rbf"},
              "data": {"dataset": "files", "train": "train.npz", "validation": "test.csv"},
              "searcher": {"name": "single", "metric": "accuracy", "smaller_is_better": False,
                           "max_length": {"batches": 100}}}
    (tmp_path / "svm.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(tmp_path / "svm.yaml"), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=400, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected = SVC(C=10, gamma=0.05, kernel="rbf").fit(x_train, y_train).score(x_test, y_test)
    assert abs(summary["validation"]["accuracy"] - expected) <= 0.002, (summary["validation"], expected)
