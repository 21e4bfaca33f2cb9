"""Experiment files in the style of Determined's public examples (tutorials and features: classic and 0.38
PyTorchTrial files, Trainer API and Core API files, searches) load the way `dtrain run` loads them; what dtrain does
not have (DeepSpeed launch, TensorFlow/Keras) is one line that names it. The files are in
tests/determined_trials/examples/."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from dtrain.config import ExperimentConfig, load_config
from dtrain.determined import install_import_path
from dtrain.determined.entrypoint import load_trial
from dtrain.determined.experiment import single_searcher_draw
from dtrain.errors import ConfigError, TrialError
from dtrain.search.preview import preview
from dtrain.search.runner import is_search, raw_config
from dtrain.search.space import Space
from dtrain.search.spec import is_command_experiment, parse_searcher

EXAMPLES = Path(__file__).resolve().parents[1] / "determined_trials" / "examples"


def load_as_dtrain_run(path: Path) -> ExperimentConfig:
    """The config `dtrain run` trains for `path`: for a search, the first trial's (a drawn point, the searcher's
    length); for searcher single over ranges, one drawn point."""
    raw = raw_config(path, [])
    if is_search(raw):
        spec = parse_searcher(raw["searcher"], command=is_command_experiment(raw))
        import random

        trial = copy.deepcopy(raw)
        trial["hyperparameters"] = Space.parse(raw.get("hyperparameters") or {}).sample(random.Random(0))
        trial["searcher"] = {"name": "single", "metric": spec.metric, "smaller_is_better": spec.smaller_is_better}
        if spec.max_length:  # 0: the command sets its own length
            trial["searcher"]["max_length"] = {spec.unit: spec.max_length}
        return load_config(None, raw=trial).config
    return load_config(path, single_searcher_draw(raw)).config


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml") if p.stem != "deepspeed"))
def test_determined_style_files_load(name: str) -> None:
    config = load_as_dtrain_run(EXAMPLES / name)
    assert config.entry.kind in ("class", "command")
    if config.is_command:
        assert config.entry.argv[0] in ("python3", "./distributed.py")
    else:
        assert config.entry.target.endswith("Trial") and config.training_length.value > 0


def test_cluster_keys_are_dropped_with_a_warning_each() -> None:
    loaded = load_config(EXAMPLES / "classic_distributed.yaml")
    dropped = " ".join(loaded.warnings)
    assert "`environment`" in dropped and "`bind_mounts`" in dropped
    assert loaded.config.debug is False and loaded.config.checkpoint_storage.save_trial_best == 2


def test_single_searcher_over_a_range_draws_one_value_from_the_seed() -> None:
    raw = raw_config(EXAMPLES / "core_single_range.yaml", [])
    drawn = single_searcher_draw(raw)
    assert len(drawn) == 1 and drawn == single_searcher_draw(raw)  # the same on every resume
    value = int(drawn[0].split("=")[1])
    assert 1 <= value <= 8
    assert single_searcher_draw(raw_config(EXAMPLES / "classic_const.yaml", [])) == []


def test_deepspeed_launch_is_one_line() -> None:
    with pytest.raises(ConfigError, match="DeepSpeed launch is not available") as caught:
        load_as_dtrain_run(EXAMPLES / "deepspeed.yaml")
    assert "\n" not in str(caught.value)


def test_a_keras_trial_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_import_path()
    (tmp_path / "keras_def.py").write_text("from determined.keras import TFKerasTrial\n\n\n"
                                           "class MyTrial(TFKerasTrial):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    raw: dict[str, Any] = {"entrypoint": "keras_def:MyTrial", "hyperparameters": {"global_batch_size": 8},
                           "searcher": {"metric": "x", "max_length": {"batches": 1}}}
    with pytest.raises(TrialError, match="dtrain trains PyTorch models only") as caught:
        load_trial(load_config(None, raw=raw).config, tmp_path)
    assert "\n" not in str(caught.value)


def test_a_search_whose_command_sets_its_own_length_needs_no_max_length() -> None:
    raw = raw_config(EXAMPLES / "command_own_length.yaml", [])
    spec = parse_searcher(raw["searcher"], command=is_command_experiment(raw))
    assert spec.max_length == 0 and spec.name == "grid"
    plan = preview(raw)
    assert "2 grid points, each trained for the length the command sets itself" in plan
    random_search = {**raw, "searcher": {**raw["searcher"], "name": "random", "max_trials": 3}}
    assert "3 trials of the length the command sets itself" in preview(random_search)
    trial_class = {**raw, "entrypoint": "model_def:MyTrial"}  # a Trial class still needs the searcher's length
    with pytest.raises(ConfigError, match="searcher `grid` needs max_length"):
        preview(trial_class)
    asha_search = {**raw, "searcher": {"name": "adaptive_asha", "metric": "validation_loss", "max_trials": 4}}
    with pytest.raises(ConfigError, match="needs max_time"):  # ASHA's rungs need a length, as in Determined
        preview(asha_search)


def test_a_stray_determined_folder_on_the_path_is_not_a_real_determined(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `determined/` folder without __init__.py on sys.path (benchmarks/determined, once a test puts benchmarks/
    there) is a namespace package, not Determined: the shim must still be installed and imported."""
    import sys

    from dtrain.determined import real_determined_installed

    (tmp_path / "determined").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "determined", raising=False)
    assert not real_determined_installed()
