"""The synthetic benchmark's model and data as a dtrain Trial, for `dtrain run` beside `dtrain horovodrun`."""

from __future__ import annotations

import torch
from scripts import ClassifierTrial, load_script
from torch import nn


class SyntheticConvnetTrial(ClassifierTrial):
    def build_model(self) -> nn.Module:
        return load_script("synthetic_benchmark").convnet()  # type: ignore[no-any-return]

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=float(self.context.hparams["learning_rate"]))

    def build_training_data(self) -> torch.utils.data.Dataset:
        size, count = int(self.context.hparams["image_size"]), int(self.context.hparams["records"])
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(count, 3, size, size, generator=generator)
        return torch.utils.data.TensorDataset(images, torch.randint(0, 1000, (count,), generator=generator))

    def build_validation_data(self) -> torch.utils.data.Dataset:
        size = int(self.context.hparams["image_size"])
        return torch.utils.data.TensorDataset(torch.randn(64, 3, size, size), torch.randint(0, 1000, (64,)))
