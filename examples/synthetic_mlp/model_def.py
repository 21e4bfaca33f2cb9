"""A multilayer perceptron on synthetic data: a communication-heavy workload (many parameters, little compute
per parameter) for planning and network benchmarks. Its size comes from the hyperparameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.data import synthetic_classification


def build_mlp(inputs: int, width: int, depth: int, classes: int) -> nn.Sequential:
    """inputs -> `depth` hidden layers of `width` (ReLU) -> classes."""
    layers: list[nn.Module] = []
    size = inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, classes))
    return nn.Sequential(*layers)


class SyntheticMLPTrial(dtrain.Trial):
    def _hp(self, name: str, default: int) -> int:
        return int(self.context.hparams.get(name, default))

    def build_model(self) -> nn.Module:
        return build_mlp(self._hp("inputs", 256), self._hp("width", 1024), self._hp("depth", 4),
                         self._hp("classes", 10))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.context.hparams.get("learning_rate", 0.01), momentum=0.9)

    def build_training_data(self) -> torch.utils.data.Dataset:
        return synthetic_classification(self._hp("records", 8192), (self._hp("inputs", 256),),
                                        self._hp("classes", 10), seed=1)

    def build_validation_data(self) -> torch.utils.data.Dataset:
        return synthetic_classification(512, (self._hp("inputs", 256),), self._hp("classes", 10), seed=2)

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        return {"loss": F.cross_entropy(model(inputs), labels)}

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = model(inputs)
        return {"loss": F.cross_entropy(logits, labels), "accuracy": (logits.argmax(1) == labels).float().mean()}
