"""The Trial class an experiment file names, whichever API it is written in: dtrain's `Trial`, or Determined's
`PyTorchTrial` (trained through the adapter). `determined` is made importable first, so that a model file
written for Determined imports unchanged."""

from __future__ import annotations

from pathlib import Path

from dtrain.config import ExperimentConfig
from dtrain.determined import install_import_path
from dtrain.train.entrypoint import load_trial_class
from dtrain.train.trial import Trial


def load_trial(config: ExperimentConfig, base_dir: Path) -> type[Trial]:
    """The dtrain Trial class to train for a class entrypoint (`module:Class`, or a launcher's `--trial`)."""
    install_import_path()
    return load_trial_class(config.entry.target, base_dir)
