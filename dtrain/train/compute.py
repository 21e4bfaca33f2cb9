"""The forward/backward stage of a training step: the default way it runs, and the timed phases it runs in.

A strategy with the RunsForwardBackward extension (a pipeline schedule) replaces `LocalForwardBackward`;
whatever runs the stage enters the Trainer's `TimedCompute` phases, so timers, the timeline and the step
callbacks see every strategy's compute alike. Wrappers that change how forward and backward run (autocast,
loss scaling) wrap this one stage.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from dtrain.errors import TrialError
from dtrain.profile import Profiler
from dtrain.sync import ComputePhases, SyncStrategy, TrainBatch
from dtrain.train.callbacks import StepCallbacks


def training_loss(outputs: Any) -> torch.Tensor:
    """The `loss` of train_batch()'s outputs; TrialError unless it is a scalar tensor that requires grad."""
    if not isinstance(outputs, Mapping) or "loss" not in outputs:
        what = "a dict without `loss`" if isinstance(outputs, Mapping) else type(outputs).__name__
        raise TrialError(f"train_batch() returned {what}; return a dict with a scalar tensor `loss`")
    loss = outputs["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TrialError("train_batch()'s `loss` must be a scalar tensor that requires grad (the mean loss of "
                         "the batch, computed from the model's output)")
    return loss


class TimedCompute:
    """The forward and backward phases of a step as the profiler times them, with the step callbacks around the
    compute: `before_compute` at the start of forward (a straggler's delay counts as its compute), and, at
    `finish`, `after_compute` with the step's own compute seconds."""

    def __init__(self, profiler: Profiler, callbacks: StepCallbacks) -> None:
        self.profiler = profiler
        self.callbacks = callbacks
        self.started = 0.0  # when this step's own compute began
        self._forward = _ForwardPhase(self)

    def forward(self) -> AbstractContextManager[None]:
        return self._forward

    def backward(self) -> AbstractContextManager[None]:
        return self.profiler.phase("backward")

    def finish(self) -> None:
        """After the stage: report the compute time, without the communication the backward pass waited for."""
        waited = self.profiler.exposed_comm_seconds()
        self.callbacks.after_compute(time.perf_counter() - self.started - waited)


class _ForwardPhase:
    """The forward phase, with `before_compute` at its start and the compute clock started after it."""

    def __init__(self, compute: TimedCompute) -> None:
        self.compute = compute
        self.phase: AbstractContextManager[None] = nullcontext()

    def __enter__(self) -> None:
        self.phase = self.compute.profiler.phase("forward")
        self.phase.__enter__()
        self.compute.callbacks.before_compute()
        self.compute.started = time.perf_counter()

    def __exit__(self, *exc: Any) -> bool | None:
        return self.phase.__exit__(*exc)  # exc is what __exit__ was given


class LocalForwardBackward:
    """The default stage: the Trial's train_batch on the wrapped model, then backward on the scaled loss; a batch
    that does not end an update runs under the strategy's no_sync() (a forward pass under no_sync leaves its
    backward pass unsynchronized too)."""

    def __init__(self, strategy: SyncStrategy) -> None:
        self.strategy = strategy

    def forward_backward(self, model: nn.Module, batch: Any, train_batch: TrainBatch, *,
                         loss_scale: float | torch.Tensor, communicate: bool,
                         phases: ComputePhases) -> Mapping[str, Any]:
        model.train()
        with nullcontext() if communicate else self.strategy.no_sync():
            with phases.forward():
                outputs = train_batch(batch, model)
                loss = training_loss(outputs)
            with phases.backward():
                (loss if isinstance(loss_scale, float) and loss_scale == 1.0 else loss * loss_scale).backward()
        return outputs
