"""The data every trial here trains on: a small noisy regression in float64, the same on every rank."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

FEATURES = 8


def regression(records: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(records, FEATURES, generator=generator, dtype=torch.float64)
    weights = torch.linspace(-1.0, 1.0, FEATURES, dtype=torch.float64).unsqueeze(1)
    targets = torch.tanh(inputs @ weights) + 0.05 * torch.randn(records, 1, generator=generator, dtype=torch.float64)
    return TensorDataset(inputs, targets)


def network() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
