"""A small CNN on Fashion-MNIST: two 3x3 conv layers and two dense layers, SGD with a one-cycle schedule.

No dropout and, by default, no batch norm, so that a distributed run can be compared exactly with a single process
(the large-batch benchmark turns batch norm on with `hyperparameters.batch_norm: true`, and validates on records held
out of the training set with `hyperparameters.validation_holdout: N`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.data import load_fashion_mnist
from dtrain.data.arrays import ArrayDataset


def build_cnn(conv1: int = 32, conv2: int = 64, hidden: int = 128, num_classes: int = 10,
              batch_norm: bool = False) -> nn.Sequential:
    """28x28x1 -> conv 3x3 -> pool -> conv 3x3 -> pool -> dense -> dense; with `batch_norm`, each conv is followed
    by batch normalisation (statistics per worker, as in Goyal et al.), which large learning rates need."""

    def norm(channels: int) -> list[nn.Module]:
        return [nn.BatchNorm2d(channels)] if batch_norm else []

    return nn.Sequential(
        nn.Conv2d(1, conv1, 3, padding=1), *norm(conv1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(conv1, conv2, 3, padding=1), *norm(conv2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(conv2 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
    )


class FashionMNISTTrial(dtrain.Trial):
    def build_model(self) -> nn.Module:
        hp = self.context.hparams
        return build_cnn(hp.get("conv1", 32), hp.get("conv2", 64), hp.get("hidden", 128),
                         batch_norm=hp.get("batch_norm", False))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        hp = self.context.hparams
        return torch.optim.SGD(model.parameters(), lr=hp["learning_rate"], momentum=hp.get("momentum", 0.9),
                               nesterov=True, weight_decay=hp.get("weight_decay", 5e-4))

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.context.hparams["learning_rate"],
                                                   total_steps=self.context.total_optimizer_steps,
                                                   pct_start=self.context.hparams.get("warmup_fraction", 0.25))

    def _data_dir(self) -> str | None:
        directory = self.context.data_config.get("directory")
        return str(self.context.resolve_path(directory)) if directory else None

    def _load(self, split: str) -> ArrayDataset:
        return load_fashion_mnist(split, self._data_dir(), self.context.data_config.get("download", False))

    def _holdout(self) -> tuple[ArrayDataset, ArrayDataset]:
        """`hyperparameters.validation_holdout: N` keeps N training records (a fixed seeded draw) apart as the
        validation data, so that recipes can be chosen without looking at the test set."""
        images, labels = self._load("train").tensors
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
        held_out = int(self.context.hparams["validation_holdout"])
        keep, held = order[:-held_out], order[-held_out:]
        return ArrayDataset(images[keep], labels[keep]), ArrayDataset(images[held], labels[held])

    def build_training_data(self) -> torch.utils.data.Dataset:
        return self._holdout()[0] if self.context.hparams.get("validation_holdout") else self._load("train")

    def build_validation_data(self) -> torch.utils.data.Dataset:
        return self._holdout()[1] if self.context.hparams.get("validation_holdout") else self._load("test")

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        images, labels = batch
        return {"loss": F.cross_entropy(model(images), labels)}

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        images, labels = batch
        logits = model(images)
        return {"loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean()}
