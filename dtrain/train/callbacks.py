"""Step callbacks: code that runs at fixed places of every training step without being a branch of the loop.
Fault injection (`dtrain.train.faults`) registers here; every hook does nothing unless a callback overrides it.

Where each hook runs, in step order:
- `before_step(step)`: at the start of batch `step`, inside its data phase;
- `before_compute()`: at the start of the forward phase, before the Trial's train_batch;
- `after_compute(seconds)`: after the backward pass, with the step's own forward + backward seconds (without
  what `before_compute` spent and without the communication the backward pass waited for);
- `before_update(step, model)`: after the backward pass of an update's last batch (gradients synchronized),
  before all ranks decide whether to apply it;
- `during_checkpoint(step)`: on rank 0, between the files of a checkpoint write (on the upload's thread when
  the checkpoint is uploaded in the background).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


class StepCallback:
    """Override the hooks you need."""

    def before_step(self, step: int) -> None:
        """At the start of batch `step`."""

    def before_compute(self) -> float | None:
        """At the start of the forward phase; may return the seconds it spent (a straggler's delay)."""
        return None

    def after_compute(self, compute_seconds: float) -> None:
        """After the backward pass, with the step's own compute time."""

    def before_update(self, step: int, model: nn.Module) -> None:
        """Before the update that batch `step` completes is decided; `model` holds the synchronized gradients."""

    def during_checkpoint(self, step: int) -> None:
        """Between the files of the checkpoint written after batch `step` (rank 0)."""


class StepCallbacks:
    """The callbacks registered on the step, called in registration order."""

    def __init__(self, callbacks: Iterable[StepCallback] = ()) -> None:
        self._callbacks = list(callbacks)

    def register(self, callback: StepCallback) -> None:
        self._callbacks.append(callback)

    def before_step(self, step: int) -> None:
        for callback in self._callbacks:
            callback.before_step(step)

    def before_compute(self) -> None:
        for callback in self._callbacks:
            callback.before_compute()

    def after_compute(self, compute_seconds: float) -> None:
        for callback in self._callbacks:
            callback.after_compute(compute_seconds)

    def before_update(self, step: int, model: nn.Module) -> None:
        for callback in self._callbacks:
            callback.before_update(step, model)

    def during_checkpoint(self, step: int) -> None:
        for callback in self._callbacks:
            callback.during_checkpoint(step)
