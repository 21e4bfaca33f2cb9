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


def test_two_experiments_with_a_module_of_the_same_name_each_get_their_own(tmp_path: Path) -> None:
    """One process loading two experiments whose model files share a name (`model_def`, as plan_validation does
    with the synthetic MLP and the demo CNN) gets each experiment's own Trial, whichever it loaded first."""
    import sys

    for name, trial in (("first", "FirstTrial"), ("second", "SecondTrial")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shared_name_model_def.py").write_text(
            f"import dtrain\nclass {trial}(dtrain.Trial):\n    pass\n")
    try:
        assert load_trial_class("shared_name_model_def:FirstTrial", tmp_path / "first").__name__ == "FirstTrial"
        assert load_trial_class("shared_name_model_def:SecondTrial", tmp_path / "second").__name__ == "SecondTrial"
        assert load_trial_class("shared_name_model_def:FirstTrial", tmp_path / "first").__name__ == "FirstTrial"
    finally:
        sys.modules.pop("shared_name_model_def", None)
        for name in ("first", "second"):
            if str(tmp_path / name) in sys.path:
                sys.path.remove(str(tmp_path / name))
