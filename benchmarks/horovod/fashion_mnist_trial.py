"""tests/horovod_scripts/fashion_mnist.py's model, data and optimizer as a dtrain Trial, so that
benchmarks/horovod_accuracy.py compares the same training under `dtrain run` and `dtrain horovodrun`."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from scripts import load_script
from torch import nn

import dtrain


def _data_dir() -> str:
    from dtrain.data.fashion_mnist import find_data_dir

    return str(os.environ.get("FASHION_MNIST_DIR") or find_data_dir())


class HorovodScriptTrial(dtrain.Trial):
    def build_model(self) -> nn.Module:
        return load_script("fashion_mnist").Net()  # type: ignore[no-any-return]

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        hp = self.context.hparams  # the script's lr is per worker, scaled by the number of workers
        return torch.optim.SGD(model.parameters(), lr=float(hp["learning_rate"]) * self.context.world_size,
                               momentum=float(hp["momentum"]))

    def build_training_data(self) -> torch.utils.data.Dataset:
        return load_script("fashion_mnist").dataset(_data_dir(), "train")  # type: ignore[no-any-return]

    def build_validation_data(self) -> torch.utils.data.Dataset:
        return load_script("fashion_mnist").dataset(_data_dir(), "t10k")  # type: ignore[no-any-return]

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        images, labels = batch
        return {"loss": F.cross_entropy(model(images), labels)}

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module
                       ) -> dict[str, torch.Tensor | float]:
        images, labels = batch
        logits = model(images)
        return {"loss": F.cross_entropy(logits, labels), "accuracy": (logits.argmax(1) == labels).float().mean()}
