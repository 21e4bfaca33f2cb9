"""Loading the user's Trial class from `module:Class` or `file.py:Class`."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.errors import TrialError
from dtrain.train.entrypoint import load_trial_class
from dtrain.train.trial import Trial

TRIAL_SOURCE = "import dtrain\nclass MyTrial(dtrain.Trial):\n    pass\nclass NotTrial:\n    pass\n"


def test_file_entrypoint_relative_to_config_dir(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "my_trial.py").write_text(TRIAL_SOURCE)
    cls = load_trial_class("code/my_trial.py:MyTrial", tmp_path)
    assert issubclass(cls, Trial) and cls.__name__ == "MyTrial"


def test_module_entrypoint(tmp_path: Path) -> None:
    (tmp_path / "unique_model_def_xyz.py").write_text(TRIAL_SOURCE)
    assert load_trial_class("unique_model_def_xyz:MyTrial", tmp_path).__name__ == "MyTrial"


@pytest.mark.parametrize(("entrypoint", "message"), [
    ("nowhere.py:MyTrial", "does not exist"),
    ("no_such_module_abc:MyTrial", "no module `no_such_module_abc`"),
    ("t.py:Missing", "no attribute `Missing`; Trial classes there: MyTrial"),
    ("t.py:NotTrial", "not a subclass of dtrain.Trial"),
    ("broken.py:X", "importing .*broken.py failed: ZeroDivisionError"),
])
def test_entrypoint_errors(tmp_path: Path, entrypoint: str, message: str) -> None:
    (tmp_path / "t.py").write_text(TRIAL_SOURCE)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    with pytest.raises(TrialError, match=message):
        load_trial_class(entrypoint, tmp_path)
