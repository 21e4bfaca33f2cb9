"""The Trial that benchmarks/search.py searches: an MLP on Fashion-MNIST (one hidden layer of `width` units), plain SGD
with momentum and weight decay at a constant learning rate, so that an early validation says something about the
end of training (what adaptive ASHA's rungs rely on)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.data import load_fashion_mnist


class FashionMLPTrial(dtrain.Trial):
    def build_model(self) -> nn.Module:
        width = int(self.context.hparams.get("width", 256))
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU(), nn.Linear(width, 10))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        hp = self.context.hparams
        return torch.optim.SGD(model.parameters(), lr=hp["learning_rate"], momentum=hp.get("momentum", 0.9),
                               weight_decay=hp.get("weight_decay", 0.0))

    def build_training_data(self) -> torch.utils.data.Dataset:
        return load_fashion_mnist("train")

    def build_validation_data(self) -> torch.utils.data.Dataset:
        return load_fashion_mnist("test")

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        images, labels = batch
        return {"loss": F.cross_entropy(model(images), labels)}

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module
                       ) -> dict[str, torch.Tensor | float]:
        images, labels = batch
        logits = model(images)
        return {"loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean()}
