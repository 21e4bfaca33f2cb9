"""The workload of benchmarks/diagnose_check.py: a CNN on in-memory 28x28 images whose dense layer makes it
communication-heavy on a 1 Gbit/s link, and a data set that can be made slow (`load_delay_ms` per batch, as
a loader that decodes images would be)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.data import synthetic_classification
from dtrain.data.arrays import ArrayDataset


def build_model(hidden: int = 256) -> nn.Sequential:
    """conv 32 -> pool -> conv 64 -> pool -> dense `hidden` -> 10: 0.8M parameters at hidden 256."""
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class SlowDataset(ArrayDataset):
    """An ArrayDataset whose every batch takes `delay` seconds more to load."""

    def __init__(self, data: ArrayDataset, delay: float) -> None:
        super().__init__(*data.tensors)
        self.delay = delay

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        time.sleep(self.delay)
        return super().__getitems__(indices)


class DiagnoseCNNTrial(dtrain.Trial):
    def build_model(self) -> nn.Module:
        return build_model(int(self.context.hparams.get("hidden", 256)))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def build_training_data(self) -> torch.utils.data.Dataset:
        data = synthetic_classification(4096, (1, 28, 28), 10, seed=1)
        delay = float(self.context.hparams.get("load_delay_ms", 0)) / 1e3
        return SlowDataset(data, delay) if delay > 0 else data

    def build_validation_data(self) -> torch.utils.data.Dataset:
        return synthetic_classification(256, (1, 28, 28), 10, seed=2)

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        return {"loss": F.cross_entropy(model(inputs), labels)}

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module
                       ) -> dict[str, torch.Tensor | float]:
        inputs, labels = batch
        logits = model(inputs)
        return {"loss": F.cross_entropy(logits, labels), "accuracy": (logits.argmax(1) == labels).float().mean()}
