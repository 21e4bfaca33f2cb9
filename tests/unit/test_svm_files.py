"""An SVM experiment on one's own arrays, without subclassing SVMTrial: `data: {dataset: files, train: ...,
validation: ...}` reads a .npz (arrays X and y) or a CSV (the label last, a header skipped), and a file that cannot
be read so is one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dtrain.errors import DataError, TrialError
from dtrain.svm.datasets import digits, from_file
from dtrain.svm.trial import SVMTrial


def _trial(data: dict[str, object], directory: Path) -> SVMTrial:
    trial = SVMTrial.__new__(SVMTrial)
    trial.context = SimpleNamespace(data_config=data, resolve_path=lambda p: directory / p)  # type: ignore[assignment]
    return trial


def test_npz_and_csv_files_give_the_arrays_they_hold(tmp_path: Path) -> None:
    (x_train, y_train), (x_test, y_test) = digits([3, 8])
    np.savez(tmp_path / "train.npz", X=x_train, y=y_train)
    header = ",".join([f"f{i}" for i in range(x_test.shape[1])] + ["label"])
    np.savetxt(tmp_path / "test.csv", np.column_stack([x_test, y_test]), delimiter=",", header=header, comments="")
    trial = _trial({"dataset": "files", "train": "train.npz", "validation": "test.csv"}, tmp_path)
    train, test = trial.build_training_data().tensors, trial.build_validation_data().tensors
    assert torch.equal(train[0], torch.from_numpy(x_train)) and torch.equal(train[1], torch.from_numpy(y_train))
    assert torch.allclose(test[0], torch.from_numpy(x_test), rtol=0, atol=1e-15)
    assert test[1].dtype == torch.int64 and torch.equal(test[1], torch.from_numpy(y_test))


def test_a_csv_without_a_header_keeps_its_first_line(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("0.5,1.0,1\n0.25,0.0,0\n")
    features, labels = from_file(tmp_path / "d.csv")
    assert features.tolist() == [[0.5, 1.0], [0.25, 0.0]] and labels.tolist() == [1, 0]


@pytest.mark.parametrize(("name", "content", "message"), [
    ("none.npz", None, "does not exist"),
    ("no_y.npz", {"X": np.zeros((3, 2))}, "needs X"),
    ("halves.npz", {"X": np.zeros((2, 2)), "y": np.array([0.5, 1.0])}, "whole numbers"),
    ("short.npz", {"X": np.zeros((3, 2)), "y": np.array([0, 1])}, "one label per sample"),
    ("d.txt", "", "use a .npz"),
])
def test_a_file_that_cannot_be_read_is_one_line(tmp_path: Path, name: str, content: object, message: str) -> None:
    path = tmp_path / name
    if isinstance(content, dict):
        np.savez(path, **content)
    elif isinstance(content, str):
        path.write_text(content)
    with pytest.raises(DataError, match=message) as caught:
        from_file(path)
    assert "\n" not in str(caught.value)


def test_files_need_both_splits(tmp_path: Path) -> None:
    with pytest.raises(TrialError, match="data.validation is missing"):
        _trial({"dataset": "files", "train": "a.npz"}, tmp_path).build_validation_data()
    with pytest.raises(TrialError, match="files"):
        _trial({"dataset": "mine"}, tmp_path).build_training_data()
