"""The same model, data, optimizer and schedule as model_def.RegressionTrial, written as a native dtrain Trial: the
reference the PyTorchTrial must match."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from data import network, regression

import dtrain


class NativeRegression(dtrain.Trial):
    def build_model(self) -> torch.nn.Module:
        return network()

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.context.get_hparam("learning_rate"), momentum=0.9)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)

    def build_training_data(self) -> Any:
        return regression(256, seed=1)

    def build_validation_data(self) -> Any:
        return regression(64, seed=2)

    def train_batch(self, batch: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"loss": F.mse_loss(model(inputs), targets)}

    def evaluate_batch(self, batch: Any, model: torch.nn.Module) -> dict[str, Any]:
        inputs, targets = batch
        return {"validation_loss": F.mse_loss(model(inputs), targets).item()}
