"""Determined's `PyTorchTrialContext` on dtrain's Trainer.

dtrain's loop owns backward, synchronization and the optimizer step; a PyTorchTrial asks for them itself
(`context.backward(loss)`, `context.step_optimizer(optimizer)`). The context keeps Determined's meaning by
recording what train_batch asks for and letting the Trainer do it at the same point: `backward` collects the loss
(the Trainer runs backward on it, scaled for `aggregation_frequency`/`average_aggregated_gradients`, under the
strategy's no_sync between updates, exactly as `backward` and `step_optimizer` do in Determined), and
`step_optimizer` names the optimizer to step and the `clip_grads` to apply to the synchronized gradients just
before the step. `wrap_model` returns the user's own module; while train_batch runs, calling it goes through the
strategy's wrapper (DDP), which is what synchronizes the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.determined.distributed import DistributedContext
from dtrain.determined.pytorch import LRScheduler, MetricReducer
from dtrain.determined.reducers import Reducers
from dtrain.errors import TrialError

if TYPE_CHECKING:
    from dtrain.config import ExperimentConfig
    from dtrain.train.trial import TrialContext


class PyTorchTrialContext:
    """What a PyTorchTrial is given: hyperparameters, batch sizes, ranks, and the wrap/backward/step calls."""

    def __init__(self, trial_context: TrialContext, config: ExperimentConfig, *,
                 distributed: DistributedContext | None = None) -> None:
        self._ctx = trial_context
        self._config = config
        self.distributed = distributed or DistributedContext(
            rank=trial_context.rank, size=trial_context.world_size, local_rank=trial_context.local_rank,
            local_size=trial_context.world_size, cross_rank=0, cross_size=1)
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[LRScheduler] = []
        self._scaler: Any = None
        self._forward_target: nn.Module | None = None  # the strategy's wrapper while train_batch runs
        self._inside_target = False
        self._loss: torch.Tensor | None = None
        self._stepped: list[torch.optim.Optimizer] = []
        # eager: optimizers whose step was held back for a non-finite gradient; dtrain's guard decides (eager.py)
        self._held_back: list[torch.optim.Optimizer] = []
        self._clip: Callable[[Iterator[nn.Parameter]], None] | None = None
        self._averages: list[bool] = []  # per optimizer, in wrap order
        self._eager = False  # the trial steps its models itself (several models or optimizers; eager.py)
        self._communicate = True  # eager: the current batch ends an update
        self._report_loss: torch.Tensor | None = None
        self._batch_idx = 0
        self._stop_requested = False
        self._tensorboard: Any = None
        self._reducers = Reducers(self.distributed.allgather)

    def _bind(self, trial_context: TrialContext) -> None:
        """Use the Trainer's TrialContext from now on (the Trainer API builds this context before the Trainer)."""
        self._ctx = trial_context

    # --------------------------------------------------------------------------- what the trial may read

    def get_hparams(self) -> dict[str, Any]:
        return dict(self._ctx.hparams)

    def get_hparam(self, name: str) -> Any:
        return self._ctx.get_hparam(name)

    def _check_batch_size(self, what: str) -> None:
        if "global_batch_size" not in self._ctx.hparams:
            raise TrialError(f"context.{what}() needs hyperparameters.global_batch_size in the experiment file "
                             "(records per step over all slots); add it, or give the data loader a batch size")

    def get_per_slot_batch_size(self) -> int:
        self._check_batch_size("get_per_slot_batch_size")
        return self._ctx.per_slot_batch_size

    def get_global_batch_size(self) -> int:
        self._check_batch_size("get_global_batch_size")
        return self._ctx.global_batch_size

    def get_data_config(self) -> dict[str, Any]:
        return dict(self._ctx.data_config)

    def get_experiment_config(self) -> dict[str, Any]:
        return self._config.model_dump(mode="json")

    def get_experiment_id(self) -> int:
        from dtrain.determined.cluster import get_cluster_info

        info = get_cluster_info()
        return info.trial.experiment_id if info else 0

    def get_trial_id(self) -> int:
        from dtrain.determined.cluster import get_cluster_info

        info = get_cluster_info()
        return info.trial.trial_id if info else 0

    def get_trial_seed(self) -> int:
        return self._ctx.seed

    @property
    def device(self) -> torch.device:
        return self._ctx.device

    def to_device(self, data: Any) -> Any:
        from dtrain.train.batches import move_to_device

        return move_to_device(data, self._ctx.device)

    def current_train_batch(self) -> int:
        """Batches trained before the one train_batch is on (Determined's batch_idx)."""
        return self._batch_idx

    def current_train_epoch(self) -> int:
        return self._batch_idx // self._batches_per_epoch()

    def _batches_per_epoch(self) -> int:
        return max(int(self._ctx.batches_per_epoch or 1), 1)

    def is_epoch_start(self) -> bool:
        return self._batch_idx % self._batches_per_epoch() == 0

    def is_epoch_end(self) -> bool:
        return (self._batch_idx + 1) % self._batches_per_epoch() == 0

    def get_stop_requested(self) -> bool:
        return self._stop_requested

    def set_stop_requested(self, stop_requested: bool) -> None:
        """Ask dtrain to end the trial at its next meeting point (a report or validation), with a checkpoint."""
        if not isinstance(stop_requested, bool):
            raise TrialError(f"set_stop_requested({stop_requested!r}): give True or False")
        self._stop_requested = stop_requested
        self._ctx.stop_requested = stop_requested

    def get_enable_tensorboard_logging(self) -> bool:
        return True

    def get_tensorboard_path(self) -> Any:
        from pathlib import Path

        run_dir = self._ctx.run_dir or Path.cwd()
        return run_dir / "tensorboard" if self._ctx.rank == 0 else run_dir / "tensorboard" / f"rank-{self._ctx.rank}"

    def get_tensorboard_writer(self) -> Any:
        """A SummaryWriter into the run's TensorBoard directory (rank 0; other ranks get their own subdirectory)."""
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.get_tensorboard_path()))
        return self._tensorboard

    # ------------------------------------------------------------------------------------- wrapping

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Register a model; it is returned as is (moved to the device). With one model, a call to it while
        train_batch runs goes through the strategy's wrapper, which synchronizes the gradients; with several
        (a GAN) the trial's steps synchronize them (eager.py)."""
        if not isinstance(model, nn.Module):
            raise TrialError(f"wrap_model() got {type(model).__name__}; give it a torch.nn.Module")
        if any(model is wrapped for wrapped in self.models):
            raise TrialError("wrap_model() got the same model twice; wrap each model once")
        model = model.to(self._ctx.device)
        _route_calls(model, self)
        self.models.append(model)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, backward_passes_per_step: int = 1,
                       fp16_compression: bool | None = None,
                       average_aggregated_gradients: bool | None = None) -> torch.optim.Optimizer:
        """Register an optimizer. Aggregation comes from the config's `optimizations` section
        (`aggregation_frequency`, `average_aggregated_gradients`), as in Determined; `average_aggregated_gradients`
        given here holds for this optimizer (a trial that sets one differing from the config's steps its
        optimizers itself, eager.py); a different `backward_passes_per_step` is refused with one line."""
        del fp16_compression
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TrialError(f"wrap_optimizer() got {type(optimizer).__name__}; give it a torch.optim.Optimizer")
        if any(optimizer is wrapped for wrapped in self.optimizers):
            raise TrialError("wrap_optimizer() got the same optimizer twice; wrap each optimizer once")
        configured = self._config.optimizations.aggregation_frequency
        if backward_passes_per_step not in (1, configured):
            raise TrialError(f"wrap_optimizer(backward_passes_per_step={backward_passes_per_step}) differs from "
                             f"optimizations.aggregation_frequency ({configured}); set the config key instead")
        average = self._config.optimizations.average_aggregated_gradients
        self._averages.append(average if average_aggregated_gradients is None else bool(average_aggregated_gradients))
        optimizer.register_step_pre_hook(self._before_optimizer_step)
        if self._scaler is not None:
            optimizer.register_step_post_hook(self._after_optimizer_step)
        self.optimizers.append(optimizer)
        return optimizer

    def wrap_lr_scheduler(self, lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
                          step_mode: LRScheduler.StepMode, frequency: int = 1) -> LRScheduler:
        """Register the scheduler; dtrain steps it (per batch, per optimizer step or per epoch, every `frequency`)
        and keeps its state in checkpoints; with MANUAL_STEP the trial steps it and dtrain only checkpoints it."""
        if not isinstance(step_mode, LRScheduler.StepMode):
            raise TrialError(f"wrap_lr_scheduler(step_mode={step_mode!r}): give a LRScheduler.StepMode")
        wrapped = LRScheduler(lr_scheduler, step_mode, frequency)
        self.lr_schedulers.append(wrapped)
        return wrapped

    def wrap_scaler(self, scaler: Any) -> Any:
        """Register a `torch.amp.GradScaler`. A trial passes `scaler.scale(loss)` to `backward` as in Determined;
        dtrain unscales the synchronized gradients before the step (`scaler.unscale_`) and updates the scale after
        it. An overflow is a non-finite gradient to dtrain's guard: use `nan_policy: skip` so that such an update
        is skipped (as `scaler.step` would) instead of stopping the run."""
        if not (hasattr(scaler, "unscale_") and hasattr(scaler, "update")):
            raise TrialError(f"wrap_scaler() got {type(scaler).__name__}; give it a torch.amp.GradScaler")
        if self._scaler is not None:
            raise TrialError("wrap_scaler() was called twice: dtrain keeps one GradScaler per PyTorchTrial")
        self._scaler = scaler
        for optimizer in self.optimizers:
            optimizer.register_step_post_hook(self._after_optimizer_step)
        return scaler

    def wrap_reducer(self, reducer: Any, name: str | None = None, for_training: bool = True,
                     for_validation: bool = True) -> MetricReducer:
        """Register a custom reducer (a `MetricReducer`, or a function of the list of values given to the returned
        reducer's `update`); its metric (`name`, or its dict of metrics with name=None) is reduced over all slots
        at the end of each validation and training report period (reducers.py)."""
        return self._reducers.wrap(reducer, name, for_training, for_validation)

    def reset_reducers(self) -> None:
        """Reset every reducer (dtrain does it at the start of each validation and report period)."""
        self._reducers.reset(for_training=True)
        self._reducers.reset(for_training=False)

    def reduce_metrics(self, for_training: bool) -> dict[str, float]:
        """The reducers' metrics over all slots now (every rank must call it together)."""
        return self._reducers.reduce(for_training=for_training)

    def experimental(self) -> Any:
        raise TrialError("context.experimental is not available in dtrain")

    # ------------------------------------------------------------------------- backward and the step

    def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None = None, retain_graph: bool = False,
                 create_graph: bool = False) -> None:
        """One model and optimizer: record the loss; dtrain runs backward on it right after train_batch returns
        (scaled for gradient aggregation); several calls add up. Several models or optimizers: backward now, as
        in Determined (eager.py)."""
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise TrialError("context.backward(loss): the loss must be a tensor that requires grad (computed from "
                             "the wrapped model's output)")
        if self._eager:
            share = self._ctx.world_size * self._ctx.per_slot_batch_size / max(self._ctx.global_batch_size, 1)
            scaled = loss if share == 1.0 else loss * share
            scaled.backward(gradient=gradient, retain_graph=retain_graph, create_graph=create_graph)
            value = loss.detach().sum() if loss.numel() != 1 else loss.detach().reshape(())
            self._report_loss = value if self._report_loss is None else self._report_loss + value
            self._loss = self._loss if self._loss is not None else loss
            return
        if gradient is not None or create_graph:
            raise TrialError("context.backward(gradient=..., create_graph=True) is not supported by dtrain for a "
                             "trial with one model and one optimizer; call context.backward(loss) with a scalar loss")
        if loss.numel() != 1:
            raise TrialError("context.backward(loss): the loss must be a scalar tensor that requires grad")
        self._loss = loss if self._loss is None else self._loss + loss

    def step_optimizer(self, optimizer: torch.optim.Optimizer,
                       clip_grads: Callable[[Iterator[nn.Parameter]], None] | None = None,
                       auto_zero_grads: bool = True, scaler: Any = None) -> None:
        """One model and optimizer: record the step; dtrain steps the optimizer after the update's last batch
        (every `aggregation_frequency` batches), applies `clip_grads` to the synchronized gradients first, and
        zeroes the gradients after it. Several: step now on the batch that ends an update (eager.py)."""
        index = next((i for i, wrapped in enumerate(self.optimizers) if optimizer is wrapped), None)
        if index is None:
            raise TrialError(f"context.step_optimizer() got a {type(optimizer).__name__} that "
                             "context.wrap_optimizer() did not return; in __init__ write "
                             "`self.opt = context.wrap_optimizer(opt)` and step `self.opt`")
        if not auto_zero_grads and self._config.optimizations.aggregation_frequency > 1:
            raise TrialError("step_optimizer(auto_zero_grads=False) with optimizations.aggregation_frequency > 1: "
                             "dtrain (as Determined) zeroes the gradients after each aggregated update; drop "
                             "auto_zero_grads=False")
        self._stepped.append(optimizer)
        if not self._eager:
            self._clip = clip_grads
            return
        if not self._communicate:
            return  # gradients keep accumulating until the update's last batch
        from dtrain.determined.eager import average_gradients
        from dtrain.train.guard import gradients_finite

        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        average_gradients(parameters, self._ctx.world_size)
        frequency = self._ctx.aggregation_frequency
        if self._averages[index] and frequency > 1:
            for p in parameters:
                if p.grad is not None:
                    p.grad.div_(frequency)
        scaler = scaler if scaler is not None else self._scaler
        if scaler is not None and scaler.is_enabled():
            scaler.unscale_(optimizer)  # a non-finite gradient: scaler.step skips the step and the scale falls
        elif not gradients_finite(parameters):
            self._held_back.append(optimizer)  # not stepped, not zeroed: dtrain's guard sees it after train_batch
            return
        if clip_grads is not None:
            clip_grads(iter(parameters))
        if scaler is not None and scaler.is_enabled():
            scaler.step(optimizer)  # the scale is updated once per update, after train_batch (adapter.py)
        else:
            optimizer.step()
        if auto_zero_grads:
            optimizer.zero_grad()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook (one model and optimizer): unscale (a GradScaler's), then the trial's
        clip_grads, on the synchronized gradients."""
        del args, kwargs
        if self._eager:
            return
        if self._scaler is not None and self._scaler.is_enabled():
            self._scaler.unscale_(optimizer)
        if self._clip is not None:
            self._clip(iter(p for group in optimizer.param_groups for p in group["params"]))

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer's step post-hook (one model and optimizer): the GradScaler's scale update."""
        del optimizer, args, kwargs
        if not self._eager and self._scaler is not None and self._scaler.is_enabled():
            self._scaler.update()

    def _start_batch(self, target: nn.Module, batch_idx: int, *, communicate: bool = True) -> None:
        """Before train_batch `batch_idx`: calls to the model go through `target` (one model), or, eager, the
        steps happen when `communicate` (the batch ends an update)."""
        self._forward_target = None if self._eager else target
        self._batch_idx, self._communicate = batch_idx, communicate
        self._loss, self._report_loss, self._stepped = None, None, []

    def _end_batch(self) -> torch.Tensor:
        """The loss dtrain runs backward on (eager: a zero-gradient tensor whose value is the sum of the losses
        given to backward, for the training report); TrialError when train_batch gave no loss or stepped no
        optimizer."""
        self._forward_target = None
        loss, self._loss = self._loss, None
        if loss is None:
            raise TrialError("train_batch() did not call context.backward(loss); compute the loss, then call "
                             "context.backward(loss) and context.step_optimizer(optimizer)")
        if not self._stepped:
            raise TrialError("train_batch() called context.backward(loss) but not context.step_optimizer(optimizer)"
                             "; call it after backward with the optimizer wrap_optimizer() returned")
        if self._eager:
            assert self._report_loss is not None
            anchor = torch.zeros((), dtype=self._report_loss.dtype, device=self._report_loss.device,
                                 requires_grad=True)
            return self._report_loss + anchor * 0
        return loss


def _route_calls(model: nn.Module, context: PyTorchTrialContext) -> None:
    """Give `model` a class of its own whose `__call__` goes through the strategy's wrapper while train_batch
    runs (the wrapper calls the module back, which then runs its forward as usual). The model stays the user's
    object: attributes, parameters, state_dict keys and isinstance checks are unchanged."""
    base = type(model)
    if getattr(base, "_dtrain_routed", False):
        return

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        target = context._forward_target
        if target is not None and not context._inside_target:
            context._inside_target = True
            try:
                return target(*args, **kwargs)
            finally:
                context._inside_target = False
        return base.__call__(self, *args, **kwargs)

    routed = type(base.__name__, (base,), {"__call__": __call__, "_dtrain_routed": True,
                                           "__module__": base.__module__, "__qualname__": base.__qualname__})
    model.__class__ = routed


__all__ = ["MetricReducer", "PyTorchTrialContext"]
