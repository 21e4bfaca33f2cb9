"""A trial in Determined's legacy style: a PyTorchTrial named by `entrypoint: model_def:RegressionTrial`. It asks for
backward and the optimizer step itself, wraps a scheduler stepped every batch, and reads its hyperparameters from the
context; nothing in it knows about dtrain."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from data import network, regression
from determined import pytorch


class RegressionTrial(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(network())
        optimizer = torch.optim.SGD(self.model.parameters(), lr=context.get_hparam("learning_rate"), momentum=0.9)
        self.optimizer = context.wrap_optimizer(optimizer)
        self.scheduler = context.wrap_lr_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5),
                                                   step_mode=pytorch.LRScheduler.StepMode.STEP_EVERY_BATCH)

    def build_training_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(regression(256, seed=1), batch_size=self.context.get_per_slot_batch_size(),
                                  shuffle=True)

    def build_validation_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(regression(64, seed=2), batch_size=self.context.get_per_slot_batch_size())

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        loss = F.mse_loss(self.model(inputs), targets)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        return {"validation_loss": F.mse_loss(self.model(inputs), targets).item()}
