"""A trial in Determined's legacy style: a PyTorchTrial named by `entrypoint: model_def:RegressionTrial`. It asks for
backward and the optimizer step itself, wraps a scheduler stepped every batch, reads its hyperparameters from the
context, reports a median over all slots' records through a reducer function (`context.wrap_reducer`), and counts
its validations in a callback whose state checkpoints keep; nothing in it knows about dtrain."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from data import network, regression
from determined import pytorch


def median(errors: list[torch.Tensor]) -> float:
    return float(torch.cat(errors).median())


class ValidationCounter(pytorch.PyTorchCallback):
    def __init__(self) -> None:
        self.count = 0

    def on_validation_start(self) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict["count"]


class RegressionTrial(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(network())
        optimizer = torch.optim.SGD(self.model.parameters(), lr=context.get_hparam("learning_rate"), momentum=0.9)
        self.optimizer = context.wrap_optimizer(optimizer)
        self.scheduler = context.wrap_lr_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5),
                                                   step_mode=pytorch.LRScheduler.StepMode.STEP_EVERY_BATCH)
        self.median_error = context.wrap_reducer(median, name="median_abs_error", for_training=False)

    def build_callbacks(self) -> dict[str, pytorch.PyTorchCallback]:
        return {"validations": ValidationCounter()}

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
        outputs = self.model(inputs)
        self.median_error.update((outputs - targets).abs())
        return {"validation_loss": F.mse_loss(outputs, targets).item()}
