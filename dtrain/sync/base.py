"""The protocol every synchronization strategy implements, so the Trainer never knows which one runs.

A strategy decides how replicas stay consistent: it wraps the model for the forward pass, says how
backward passes that must not communicate are run (gradient aggregation), and applies an update.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class SyncStrategy(Protocol):
    """How gradients or parameters are made consistent across ranks."""

    name: str

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return the module the Trainer runs forward and backward on (it may be the model itself)."""
        ...

    def unwrap_model(self) -> nn.Module:
        """The user's model, whose state_dict is what checkpoints hold."""
        ...

    def no_sync(self) -> AbstractContextManager[Any]:
        """A context for backward passes whose gradients are only accumulated locally."""
        ...

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply one update after the communicating backward pass (gradients are synchronized by then)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a resumed run needs (e.g. error-feedback residuals); may be empty."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    def close(self) -> None:
        """Release communication resources."""
        ...
