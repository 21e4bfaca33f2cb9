"""Determined's experiment-file forms load: command entrypoints (with or without its torch_distributed launcher),
no hyperparameters, no searcher.max_length for a command, lengths as bare numbers, `debug: false`; what dtrain does
not have (DeepSpeed launch, TensorFlow) is one line that names it."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.config import load_config
from dtrain.config.entrypoint import parse_entrypoint
from dtrain.errors import ConfigError


@pytest.mark.parametrize(("value", "kind", "target", "argv"), [
    ("model_def:MNistTrial", "class", "model_def:MNistTrial", ()),
    ("model_def.py:Trial", "class", "model_def.py:Trial", ()),
    ("python3 train.py --epochs 1", "command", "", ("python3", "train.py", "--epochs", "1")),
    ("python3 -m determined.launch.torch_distributed python3 train.py", "command", "", ("python3", "train.py")),
    ("python3 -m determined.launch.torch_distributed -- python3 train.py -x", "command", "", ("python3", "train.py",
                                                                                              "-x")),
    ("python3 -m determined.launch.torch_distributed --trial model_def:T", "class", "model_def:T", ()),
    ("./4_distributed.py launcher", "command", "", ("./4_distributed.py", "launcher")),
    (["python3", "train.py"], "command", "", ("python3", "train.py")),
])
def test_entrypoint_forms(value: Any, kind: str, target: str, argv: tuple[str, ...]) -> None:
    entry = parse_entrypoint(value)
    assert (entry.kind, entry.target, entry.argv) == (kind, target, argv)


@pytest.mark.parametrize(("value", "named"), [
    ("python3 -m determined.launch.deepspeed --trial model_def:T", "DeepSpeed launch is not available"),
    ("python3 -m determined.launch.tensorflow python3 t.py", "TensorFlow is not supported"),
    ("python3 -m determined.launch.torch_distributed", "launches nothing"),
    ("python3 'unclosed", "not a valid command line"),
])
def test_entrypoints_dtrain_cannot_run_are_one_line(value: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named) as caught:
        load_config(None, raw={"entrypoint": value, "searcher": {"metric": "x"}})
    assert "\n" not in str(caught.value) and "entrypoint" in str(caught.value)


def test_a_core_api_file_needs_neither_hyperparameters_nor_a_length() -> None:
    config = load_config(None, raw={"name": "core-api-stage-0", "entrypoint": "python3 0_start.py",
                                    "max_restarts": 0, "searcher": {"name": "single", "metric": "x"},
                                    "debug": False}).config
    assert config.is_command and config.entry.argv == ("python3", "0_start.py")
    assert config.hyperparameters == {} and config.searcher.max_length is None and config.debug is False


def test_a_bare_length_is_batches() -> None:
    config = load_config(None, raw={"entrypoint": "python3 t.py", "searcher": {"metric": "x", "max_length": 100}})
    assert (config.config.searcher.max_length.unit, config.config.searcher.max_length.value) == ("batches", 100)


def test_a_trial_class_still_needs_a_length_and_a_batch_size() -> None:
    with pytest.raises(ConfigError, match="searcher.max_length is required for a Trial class"):
        load_config(None, raw={"entrypoint": "model_def:T", "hyperparameters": {"global_batch_size": 8},
                               "searcher": {"metric": "x"}})
    with pytest.raises(ConfigError, match="global_batch_size is required"):
        load_config(None, raw={"entrypoint": "model_def:T", "searcher": {"metric": "x", "max_length": 5}})


def test_a_trainer_api_file_loads_as_determined_wrote_it() -> None:
    raw = {"name": "mnist_pytorch_const", "hyperparameters": {"global_batch_size": 32},
           "searcher": {"name": "single", "metric": "validation_loss", "max_length": {"batches": 937}},
           "max_restarts": 0, "resources": {"slots_per_trial": 8},
           "entrypoint": "python3 -m determined.launch.torch_distributed python3 train.py"}
    config = load_config(None, raw=raw).config
    assert config.entry.argv == ("python3", "train.py") and config.resources.world_size == 8
