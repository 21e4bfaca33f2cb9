"""The demo's native Trial without its one-cycle schedule: the reference for
fashion_pytorch_trial.FashionMNISTPyTorchTrial."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist"))
from model_def import FashionMNISTTrial  # type: ignore[attr-defined]  # noqa: E402  (examples/fashion_mnist's)


class FashionMNISTNative(FashionMNISTTrial):
    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> None:
        del optimizer
        return None
