"""The protocol every synchronization strategy implements, so the Trainer never knows which one runs.

A strategy decides how replicas stay consistent: it wraps the model for the forward pass, says how
backward passes that must not communicate are run (gradient aggregation), and applies an update.

Contract with the Trainer: before backward, each rank scales its loss by world_size * weight / k, where
weight is the rank's share of the global batch and k the aggregation frequency (1/k only with
`average_aggregated_gradients`). With even batches that factor is 1/k, and a strategy that averages
(sum / world_size) then yields exactly the full-batch gradient, for uneven batches too; `sum` and `adasum`
combine the same relatively weighted gradients. Strategies never rescale gradients themselves.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dtrain.compress import WireStats


@runtime_checkable
class SyncStrategy(Protocol):
    """How gradients or parameters are made consistent across ranks."""

    name: str
    lockstep: bool  # every rank takes every step together (per-step collectives outside the strategy are safe)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return the module the Trainer runs forward and backward on (it may be the model itself)."""
        ...

    def unwrap_model(self) -> nn.Module:
        """The user's model, whose state_dict is what checkpoints hold."""
        ...

    def no_sync(self) -> AbstractContextManager[Any]:
        """A context for backward passes whose gradients are only accumulated locally."""
        ...

    def join(self) -> AbstractContextManager[Any]:
        """A context for loops in which ranks may run different numbers of steps (uneven inputs): ranks
        that finished early keep answering the others' communication so that nobody waits forever."""
        ...

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply one update after the communicating backward pass (gradients are synchronized by then)."""
        ...

    def steps_done(self, step: int) -> int:
        """Global batches trained once this rank's batch number `step` is done: `step` itself for strategies whose
        ranks move in lockstep; strategies whose ranks may run ahead of others (asynchronous parameter servers)
        report their own count, which the Trainer follows between its meeting points."""
        ...

    def consolidate(self, *, snapshot: bool = False) -> None:
        """Called by every rank together before validation and checkpoints: bring this rank's model to the
        parameters every rank shares (a no-op where replicas never differ); with `snapshot`, capture the state
        that `state_dict()` returns for the checkpoint."""
        ...

    def metrics(self) -> dict[str, float]:
        """Scalars for the run store and TensorBoard at each training report (rank 0); may be empty."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a resumed run needs (e.g. error-feedback residuals); may be empty."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    def take_wire_stats(self) -> WireStats | None:
        """Bytes this rank sent for gradients since the last call, beside what dense fp32 all-reduces would
        have sent (the Trainer logs them per update); None when nothing is sent or counted."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the strategy runs with (op, bucket size, tuning results), for the run's summary."""
        ...

    def close(self) -> None:
        """Release communication resources."""
        ...
