"""tests/horovod_scripts/fashion_mnist.py's model, data and optimizer as a dtrain Trial, so that
benchmarks/horovod_accuracy.py compares the same training under `dtrain run` and `dtrain horovodrun`."""

from __future__ import annotations

import os

import torch
from scripts import ClassifierTrial, load_script
from torch import nn


def _data_dir() -> str:
    from dtrain.data.fashion_mnist import find_data_dir

    return str(os.environ.get("FASHION_MNIST_DIR") or find_data_dir())


class HorovodScriptTrial(ClassifierTrial):
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
