"""A wide MLP of residual blocks on synthetic data: about 106 M parameters with width 2560 and 8 blocks (the
configs and benchmarks/model_scale.py), so that with Adam its model state (16 bytes per parameter, 1.69 GB) is
what a worker holds.
The blocks are its top-level children (an nn.Sequential), so FSDP shards them one by one, a pipeline cuts
between them, and `activation_checkpointing: [Block]` recomputes them. benchmarks/model_scale.py trains it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.data import synthetic_classification


class Block(nn.Module):
    """x + W2 relu(W1 x): a residual block of two width x width layers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


def build_wide_mlp(inputs: int, width: int, blocks: int, classes: int) -> nn.Sequential:
    """inputs -> width, `blocks` residual blocks (2 width^2 parameters each), width -> classes."""
    return nn.Sequential(nn.Linear(inputs, width), *[Block(width) for _ in range(blocks)], nn.Linear(width, classes))


class WideMLPTrial(dtrain.Trial):
    def _hp(self, name: str, default: int) -> int:
        return int(self.context.hparams.get(name, default))

    def build_model(self) -> nn.Module:
        return build_wide_mlp(self._hp("inputs", 256), self._hp("width", 1024), self._hp("blocks", 8),
                              self._hp("classes", 10))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=float(self.context.hparams.get("learning_rate", 1e-4)))

    def build_training_data(self) -> torch.utils.data.Dataset:
        return synthetic_classification(self._hp("records", 4096), (self._hp("inputs", 256),),
                                        self._hp("classes", 10), seed=1)

    def build_validation_data(self) -> torch.utils.data.Dataset:
        return synthetic_classification(256, (self._hp("inputs", 256),), self._hp("classes", 10), seed=2)

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        return {"loss": F.cross_entropy(model(inputs), labels)}

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        return self.pipeline_metrics(model(inputs), labels)

    def pipeline_metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The metrics from the model's outputs: with strategy pipeline, validation runs through the stages and
        calls this on the last one, so no rank gathers the whole model to validate."""
        return {"loss": F.cross_entropy(outputs, targets), "accuracy": (outputs.argmax(1) == targets).float().mean()}
