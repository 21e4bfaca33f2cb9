"""Load a Horovod-style script of tests/horovod_scripts as a module (with dtrain's `horovod` shim importable), so
that a benchmark's other variants use exactly the script's model and data code; and the Trial base both
benchmark Trials share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

import dtrain

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "dtrain" / "horovod" / "shim"


def load_script(name: str) -> ModuleType:
    """tests/horovod_scripts/<name>.py, imported under the name `horovod_script_<name>` (its main() not run)."""
    if str(SHIM) not in sys.path:
        sys.path.append(str(SHIM))  # after site-packages: a real Horovod, if installed, still wins
    path = REPO / "tests" / "horovod_scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"horovod_script_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ClassifierTrial(dtrain.Trial):
    """What both benchmark Trials share: cross-entropy on (images, labels) batches, accuracy when evaluating."""

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        images, labels = batch
        return {"loss": F.cross_entropy(model(images), labels)}

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module
                       ) -> dict[str, torch.Tensor | float]:
        images, labels = batch
        logits = model(images)
        return {"loss": F.cross_entropy(logits, labels), "accuracy": (logits.argmax(1) == labels).float().mean()}
