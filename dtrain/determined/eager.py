"""Several models and optimizers in one PyTorchTrial (a GAN: a generator and a discriminator, each with its own
optimizer), trained in Determined's own order.

With one model and one optimizer dtrain's Trainer runs backward and the step after train_batch returns (context.py).
With several, the order inside train_batch is the trial's meaning (a generator stepped before the discriminator's
loss is computed, gradients from one loss accumulating into the next), so the context does what Determined does, at
the point the trial asks (`eager` mode):

- `context.backward(loss)` runs backward at once (scaled by the rank's share of the global batch, 1 with even
  batches, as dtrain's contract in `dtrain/sync/base.py` says);
- `context.step_optimizer(opt)` does nothing on a batch that does not end an update (`aggregation_frequency`);
  on the one that does, it averages that optimizer's gradients over the ranks (`average_gradients`: one all-reduce
  per call, as Determined's Horovod backend synchronizes each optimizer in `step_optimizer`), divides them by
  `aggregation_frequency` when that optimizer averages aggregated gradients, applies `clip_grads`, steps, and
  zeroes that optimizer's gradients (`auto_zero_grads`);
- the wrapped LR schedulers are stepped after each train_batch by their `StepMode`;
- a non-finite averaged gradient (NaN or infinity) holds that optimizer's step back: it is neither clipped, stepped
  nor zeroed, so dtrain's guard sees the gradient after train_batch and applies `nan_policy` as for any Trial
  (abort: stop with the one-line error; skip: the held-back gradients are dropped, counted in
  `nan_steps_skipped`, at most `max_consecutive_nan_skips` in a row). The averaged gradient is the same on every
  rank, so every rank holds back the same steps. The optimizers whose gradients were finite have stepped already
  (Determined's order); with a GradScaler, `scaler.step` skips the step itself, as in Determined.

What the Trainer sees is the container `WrappedModels` (every model as `model_<i>`, Determined's names, so one
state_dict and one strategy wrapper hold them all), `WrappedOptimizers` (every optimizer's state in one
state_dict; its `step` and `zero_grad` do nothing: the steps happened in train_batch) and `WrappedSchedulers` (the
schedulers' states). Checkpoints, restarts and validation then work as for any Trial.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dtrain.determined.pytorch import LRScheduler
from dtrain.errors import ConfigError, TrialError


class WrappedModels(nn.Module):
    """Every model the trial wrapped, as `model_0`, `model_1`, ... in wrap order. The trial calls its models
    itself; this container is what dtrain checkpoints, broadcasts at start and puts in eval mode for validation."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        for index, model in enumerate(models):
            self.add_module(f"model_{index}", model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TrialError("the container of a PyTorchTrial's models is not called; the trial calls its own models")


class WrappedOptimizers(torch.optim.Optimizer):
    """Every optimizer the trial wrapped, seen by dtrain as one: `param_groups` are theirs (the first one's
    rate is the one reported), `state_dict` holds each one's. `step` does nothing: the trial's
    `context.step_optimizer` calls stepped them inside train_batch. `zero_grad` (after dtrain's guard decided the
    update) zeroes only the optimizers in `held_back`, whose step the context held back for a non-finite gradient;
    the others were zeroed, or kept on purpose (`auto_zero_grads=False`), by the trial's own calls."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],  # no super().__init__: no params
                 held_back: list[torch.optim.Optimizer] | None = None) -> None:
        self.optimizers = list(optimizers)
        self.held_back = held_back if held_back is not None else []
        self.defaults: dict[str, Any] = {}
        self.state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def __repr__(self) -> str:
        return f"WrappedOptimizers({', '.join(type(o).__name__ for o in self.optimizers)})"

    # Determined's wrapper steps all its optimizers and takes no closure, so it returns None
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        del closure

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.held_back:
            optimizer.zero_grad(set_to_none=set_to_none)
        self.held_back.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            count = len(saved) if isinstance(saved, list) else "no"
            raise TrialError(f"the checkpoint holds {count} optimizer states and the trial wraps "
                             f"{len(self.optimizers)} optimizers; resume with the trial it was written for")
        for optimizer, state in zip(self.optimizers, saved, strict=True):
            optimizer.load_state_dict(state)


class WrappedSchedulers:
    """The trial's LR schedulers as dtrain checkpoints them. They are stepped by the context after each
    train_batch (Determined's timing), so `step` (dtrain's, once per global batch) does nothing."""

    def __init__(self, schedulers: Sequence[LRScheduler]) -> None:
        self.schedulers = list(schedulers)

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [lr for scheduler in self.schedulers for lr in scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [scheduler.state_dict() for scheduler in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler, saved in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)


def step_schedulers(schedulers: Sequence[LRScheduler], batch_idx: int, *, aggregation_frequency: int,
                    batches_per_epoch: int) -> None:
    """After train_batch `batch_idx` (0-based, counted from the start of training): step each scheduler its
    `StepMode` says is due (every `frequency` batches, optimizer steps or epochs; MANUAL_STEP never)."""
    done = batch_idx + 1
    for scheduler in schedulers:
        mode, every = scheduler._step_mode, max(scheduler._frequency, 1)
        if mode is LRScheduler.StepMode.STEP_EVERY_BATCH:
            period = every
        elif mode is LRScheduler.StepMode.STEP_EVERY_OPTIMIZER_STEP:
            period = every * max(aggregation_frequency, 1)
        elif mode is LRScheduler.StepMode.STEP_EVERY_EPOCH:
            period = every * max(batches_per_epoch, 1)
        else:
            continue
        if done % period == 0:
            scheduler.scheduler.step()


def average_gradients(parameters: Sequence[nn.Parameter], world_size: int) -> None:
    """Average the parameters' gradients over all ranks (a collective: every rank calls it with the same
    parameters). A parameter without a gradient on some rank counts as a zero gradient there, and keeps no
    gradient where no rank has one (one small all-reduce of which ranks have which gradients first)."""
    if world_size <= 1 or not parameters:
        return
    import torch.distributed as dist

    present = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    synced = [p for p, anywhere in zip(parameters, present.tolist(), strict=True) if anywhere]
    for p in synced:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not synced:
        return
    # every synced parameter got a gradient in the loop above
    flat = torch.cat([p.grad.reshape(-1) for p in synced])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    flat.div_(world_size)
    offset = 0
    for p in synced:
        grad, count = p.grad, p.numel()
        assert grad is not None
        grad.copy_(flat[offset:offset + count].view_as(grad))
        offset += count


def check_config_for_eager(config: Any, models: int, optimizers: int) -> None:
    """One line for settings whose meaning needs dtrain to own backward and the step (they apply to trials with one
    model and one optimizer)."""
    what = f"this PyTorchTrial wraps {models} model(s) and {optimizers} optimizer(s), so it steps them itself"
    from dtrain.config import default_strategy

    if config.distributed.strategy != default_strategy():
        raise ConfigError(f"distributed.strategy {config.distributed.strategy}: {what} with gradients averaged "
                          f"over the ranks in step_optimizer; remove distributed.strategy ({default_strategy()})")
    if config.compression.name != "none":
        raise ConfigError(f"compression.name {config.compression.name}: {what}, uncompressed; remove compression")
    lb = config.large_batch
    if lb.optimizer != "trial" or lb.schedules_lr or lb.batch_size_schedule is not None:
        raise ConfigError(f"large_batch: {what} with its own optimizers and schedulers; remove the large_batch "
                          "section")
    from dtrain.config import effective_precision

    if effective_precision(config.optimizations) == "fp16":
        raise ConfigError(f"optimizations.precision fp16: {what}; use context.wrap_scaler(GradScaler()) and "
                          "backward(scaler.scale(loss)) instead")
