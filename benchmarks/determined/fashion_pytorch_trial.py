"""The Fashion-MNIST demo model of examples/fashion_mnist written as Determined users write it: a PyTorchTrial
that wraps its model and optimizer and calls context.backward / context.step_optimizer itself.
`fashion_native.py` is the same model, data and optimizer as a native dtrain Trial (the demo's, without its
one-cycle schedule, which a PyTorchTrial cannot size in __init__; neither side has a scheduler)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from determined import pytorch  # type: ignore[attr-defined]  # dtrain's shim (docs/determined.md)

from dtrain.data import load_fashion_mnist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist"))
from model_def import build_cnn  # type: ignore[attr-defined]  # noqa: E402  (examples/fashion_mnist's)


class FashionMNISTPyTorchTrial(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(build_cnn())
        self.optimizer = context.wrap_optimizer(torch.optim.SGD(
            self.model.parameters(), lr=context.get_hparam("learning_rate"), momentum=context.get_hparam("momentum"),
            nesterov=True, weight_decay=context.get_hparam("weight_decay")))

    def build_training_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(load_fashion_mnist("train"), batch_size=self.context.get_per_slot_batch_size(),
                                  shuffle=True)

    def build_validation_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(load_fashion_mnist("test"), batch_size=self.context.get_per_slot_batch_size())

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.context.backward(loss)
        self.context.step_optimizer(self.optimizer)
        return {"loss": loss}

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        images, labels = batch
        logits = self.model(images)
        return {"loss": F.cross_entropy(logits, labels), "accuracy": (logits.argmax(dim=1) == labels).float().mean()}
