"""Determined's `PyTorchTrial`, and the dtrain Trial that trains it: dtrain's Trainer runs that like any Trial, so
restarts, checkpoints, the store, TensorBoard, `distributed:` strategies, `large_batch:` and `faults:` apply unchanged.

The PyTorchTrial is built in the adapter's `__init__` (Determined builds the trial before its data loaders);
its wrapped model and optimizer are what `build_model`/`build_optimizer` return, the datasets of its data loaders
are what dtrain shards, and its train_batch runs inside the adapter's, with the context recording the loss given
to `context.backward` (see `context.py`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from dtrain.determined.context import PyTorchTrialContext
from dtrain.determined.eager import (
    WrappedModels,
    WrappedOptimizers,
    WrappedSchedulers,
    check_config_for_eager,
    step_schedulers,
)
from dtrain.determined.pytorch import DataLoader, LRScheduler, PyTorchCallback
from dtrain.errors import TrialError
from dtrain.train.batches import batch_length
from dtrain.train.checkpoint import checkpoint_name
from dtrain.train.trial import Trial, TrialContext


class PyTorchTrial:
    """Subclass this as in Determined: `__init__(context)` builds and wraps the model and optimizer,
    `train_batch(batch, epoch_idx, batch_idx)` runs forward, `context.backward(loss)` and
    `context.step_optimizer(optimizer)`, and `evaluate_batch(batch[, batch_idx])` returns metrics."""

    trial_context_class: type[Any] | None = None

    def __init__(self, context: PyTorchTrialContext) -> None:
        self.context = context

    @classmethod
    def __dtrain_trial__(cls) -> type[Trial]:
        """The dtrain Trial that trains this class (dtrain's entrypoint loader calls it)."""
        return adapter_for(cls)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> torch.Tensor | dict[str, Any]:
        raise NotImplementedError("train_batch(batch, epoch_idx, batch_idx) must run the model, call "
                                  "context.backward(loss) and context.step_optimizer(optimizer), and return metrics")

    def build_training_data_loader(self) -> DataLoader:
        raise NotImplementedError("build_training_data_loader() must return a determined.pytorch.DataLoader")

    def build_validation_data_loader(self) -> DataLoader:
        raise NotImplementedError("build_validation_data_loader() must return a determined.pytorch.DataLoader")

    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        return {}

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        raise NotImplementedError("evaluate_batch(batch) must return {metric name: batch mean}")

    def evaluate_full_dataset(self, data_loader: torch.utils.data.DataLoader) -> dict[str, Any]:
        raise NotImplementedError

    def get_batch_length(self, batch: Any) -> int:
        return batch_length(batch)


_ADAPTERS: dict[type[PyTorchTrial], type[DeterminedTrial]] = {}


def adapter_for(trial_class: type[PyTorchTrial]) -> type[Trial]:
    """The dtrain Trial class that trains `trial_class` (one per class)."""
    if trial_class not in _ADAPTERS:
        _ADAPTERS[trial_class] = type(f"{trial_class.__name__}OnDtrain", (DeterminedTrial,),
                                      {"pytorch_trial_class": trial_class, "__module__": __name__})
    return _ADAPTERS[trial_class]


class DeterminedTrial(Trial):
    """A dtrain Trial around one PyTorchTrial; subclasses made by `adapter_for` name the class."""

    pytorch_trial_class: ClassVar[type[PyTorchTrial]]
    may_request_stop = True  # context.set_stop_requested()

    def __init__(self, context: TrialContext, *, det_context: PyTorchTrialContext | None = None,
                 det_trial: PyTorchTrial | None = None) -> None:
        super().__init__(context)
        if context.experiment_config is None:
            raise TrialError("a PyTorchTrial needs the experiment config in its context; run it with `dtrain run`")
        if det_context is None:
            det_context = PyTorchTrialContext(context, context.experiment_config)
        else:
            det_context._bind(context)
        self.det_context = det_context
        self.det_trial = det_trial if det_trial is not None else self.pytorch_trial_class(det_context)
        trial_type = type(self.det_trial)
        self.full_dataset = _overrides(trial_type, "evaluate_full_dataset")
        if self.full_dataset and _overrides(trial_type, "evaluate_batch"):
            raise TrialError(f"{trial_type.__name__} implements both evaluate_batch and evaluate_full_dataset; "
                             "implement only one (as Determined asks)")
        self._validation_loader: Any = None
        det_context._eager = self.eager = _needs_eager(det_context)
        if self.eager:
            check_config_for_eager(context.experiment_config, len(det_context.models), len(det_context.optimizers))
        self._evaluate_takes_index = _takes_batch_idx(self.det_trial.evaluate_batch)
        self._eval_index = 0
        callbacks = self.det_trial.build_callbacks() or {}
        if not isinstance(callbacks, Mapping):
            raise TrialError("build_callbacks() must return a dict {name: PyTorchCallback}")
        self.callbacks: dict[str, PyTorchCallback] = {str(name): cb for name, cb in callbacks.items()}
        self._started = False  # training started in this process
        self._startup_done = False  # on_trial_startup called
        self._resumed = False  # a checkpoint was loaded
        self._batch_metrics: list[dict[str, Any]] = []  # this slot's, since the last training report

    # ------------------------------------------------------------------------------- build

    def build_training_data(self) -> Dataset:
        return _dataset(self.det_trial.build_training_data_loader(), "build_training_data_loader")

    def build_validation_data(self) -> Dataset:
        """The validation loader's dataset, which dtrain shards over the ranks for evaluate_batch; for
        evaluate_full_dataset one placeholder record instead, which validation hands to rank 0 only (the chief
        then runs evaluate_full_dataset over the whole loader, as Determined does)."""
        loader = self.det_trial.build_validation_data_loader()
        dataset = _dataset(loader, "build_validation_data_loader")
        if not self.full_dataset:
            return dataset
        self._validation_loader = loader
        return _ChiefOnly()

    def build_model(self) -> nn.Module:
        name = type(self.det_trial).__name__
        if not self.det_context.models:
            raise TrialError(f"{name}.__init__ never called context.wrap_model(model); write "
                             "`self.model = context.wrap_model(model)` there")
        if not self.det_context.optimizers:
            raise TrialError(f"{name}.__init__ never called context.wrap_optimizer(optimizer); write "
                             "`self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), ...))`")
        if self.eager:
            return WrappedModels(self.det_context.models)
        return self.det_context.models[0]

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        ours = {id(p) for p in model.parameters()}
        for optimizer in self.det_context.optimizers:
            if any(id(p) not in ours for group in optimizer.param_groups for p in group["params"]):
                raise TrialError("an optimizer given to context.wrap_optimizer() optimizes parameters that are not "
                                 "a wrapped model's; build it over the model context.wrap_model() returned")
        if self.eager:
            return WrappedOptimizers(self.det_context.optimizers, self.det_context._held_back)
        return self.det_context.optimizers[0]

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        del optimizer
        if not self.det_context.lr_schedulers:
            return None
        if self.eager:
            return cast(torch.optim.lr_scheduler.LRScheduler, WrappedSchedulers(self.det_context.lr_schedulers))
        return cast(torch.optim.lr_scheduler.LRScheduler,
                    _SchedulerSteps(self.det_context.lr_schedulers[0], self.context))

    # -------------------------------------------------------------------------------- train

    def train_batch(self, batch: Any, model: nn.Module) -> dict[str, Any]:
        """The PyTorchTrial's train_batch, calls to its model going through `model` (the strategy's wrapper);
        returns its metrics with `loss` the loss it gave to context.backward."""
        index = self.context.batches_trained
        self._startup(index)
        if not self._started:
            self._started = True
            self.det_context.reset_reducers()
            self._call("on_training_start")
        per_epoch = max(int(self.context.batches_per_epoch or 1), 1)
        epoch = index // per_epoch
        if index % per_epoch == 0:
            self._call("on_training_epoch_start", epoch)
        frequency = max(self.context.aggregation_frequency, 1)
        communicate = (index + 1) % frequency == 0 or index + 1 == self.context.total_batches
        self.det_context._start_batch(model, index, communicate=communicate)
        try:
            returned = self.det_trial.train_batch(batch, epoch, index)
        finally:
            self.det_context._forward_target = None
        loss = self.det_context._end_batch()
        if self.eager:
            scaler = self.det_context._scaler
            if communicate and scaler is not None and scaler.is_enabled():
                scaler.update()  # once per update, after every optimizer stepped (as Determined's loop does)
            step_schedulers(self.det_context.lr_schedulers, index, aggregation_frequency=frequency,
                            batches_per_epoch=per_epoch)
        if (index + 1) % per_epoch == 0:
            self._call("on_training_epoch_end", epoch)
        metrics = {**_metrics(returned, "train_batch"), "loss": loss}
        if self.callbacks:
            self._batch_metrics.append({name: _plain(value) for name, value in metrics.items()})
        return metrics

    def evaluate_batch(self, batch: Any, model: nn.Module) -> dict[str, Any]:
        del model  # the wrapped models are the user's own modules, in eval mode now
        if self.full_dataset:  # rank 0, once per validation (the placeholder record); metrics as returned
            loader = self._validation_loader
            if isinstance(loader, DataLoader):
                loader = loader.get_data_loader()
            return _metrics(self.det_trial.evaluate_full_dataset(data_loader=loader), "evaluate_full_dataset")
        if self._evaluate_takes_index:
            returned = self.det_trial.evaluate_batch(batch, self._eval_index)
        else:
            # an older Determined evaluate_batch(batch) takes no batch_idx (checked above)
            returned = self.det_trial.evaluate_batch(batch)  # type: ignore[call-arg]
        self._eval_index += 1
        return _metrics(returned, "evaluate_batch")

    # ------------------------------------------------------------------ callbacks, reducers, state

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks.values():
            getattr(callback, hook)(*args)

    def _startup(self, first_batch_idx: int) -> None:
        """on_trial_startup, before this process's first batch or validation (a resumed run's first event is a
        batch: the one after its checkpoint's, whose name is `step-<that batch>`)."""
        if not self._startup_done:
            self._startup_done = True
            self._call("on_trial_startup", first_batch_idx,
                       checkpoint_name(first_batch_idx) if self._resumed else None)

    def validation_started(self) -> None:
        self._startup(self.context.batches_trained)
        self._eval_index = 0
        self.det_context._reducers.reset(for_training=False)
        self._call("on_validation_start")

    def validation_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The validation metrics with the custom reducers' (reduced over all slots); on_validation_end on the
        chief."""
        metrics = {**metrics, **self.det_context._reducers.reduce(for_training=False)}
        if self.context.rank == 0:
            self._call("on_validation_end", dict(metrics))
        return metrics

    def training_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The report's means with the custom training reducers'; then on_training_workload_end, and the reducers
        start a new period."""
        metrics = {**metrics, **self.det_context._reducers.reduce(for_training=True)}
        self._call("on_training_workload_end", dict(metrics), self._batch_metrics)
        self._batch_metrics = []
        self.det_context._reducers.reset(for_training=True)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """What dtrain's checkpoints keep for the trial: every callback's state_dict by its name (on the chief,
        on_checkpoint_save_start sees this dict first and may add to it)."""
        checkpoint: dict[str, Any] = {"callbacks": {name: cb.state_dict() for name, cb in self.callbacks.items()}}
        if self.context.rank == 0:
            self._call("on_checkpoint_save_start", checkpoint)
        return checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run: on_checkpoint_load_start with the saved dict, then each callback's load_state_dict."""
        self._resumed = True
        self._call("on_checkpoint_load_start", state)
        saved = state.get("callbacks", {})
        for name, callback in self.callbacks.items():
            if name in saved:
                callback.load_state_dict(saved[name])

    def checkpoint_written(self, path: Path | str | None) -> None:
        if path is not None:
            self._call("on_checkpoint_write_end", str(path))
            self._call("on_checkpoint_upload_end", str(path).rstrip("/").rsplit("/", 1)[-1])

    def training_ended(self, status: str) -> None:
        del status
        self._call("on_trial_shutdown")


class _SchedulerSteps:
    """The scheduler as dtrain steps it (once per global batch trained), stepping the user's scheduler as its
    `StepMode` says; its state (with the count) goes into dtrain's checkpoints."""

    def __init__(self, wrapped: LRScheduler, context: TrialContext) -> None:
        self.wrapped, self.context, self.batches = wrapped, context, 0

    def step(self) -> None:
        self.batches += 1
        mode, every = self.wrapped._step_mode, max(self.wrapped._frequency, 1)
        if mode is LRScheduler.StepMode.MANUAL_STEP:
            return
        if mode is LRScheduler.StepMode.STEP_EVERY_BATCH:
            period = every
        elif mode is LRScheduler.StepMode.STEP_EVERY_OPTIMIZER_STEP:
            period = every * max(self.context.aggregation_frequency, 1)
        else:
            period = every * max(int(self.context.batches_per_epoch or 1), 1)
        if self.batches % period == 0:
            self.wrapped.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.wrapped.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "scheduler": self.wrapped.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = int(state["batches"])
        self.wrapped.load_state_dict(state["scheduler"])


class _ChiefOnly(Dataset):
    """One placeholder record: the validation data of a trial that implements evaluate_full_dataset. dtrain's
    validation shards it to rank 0 alone and weights its metrics by its one record, so they are the chief's
    evaluate_full_dataset metrics exactly, on every rank."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return torch.zeros(1)


class _Collated(Dataset):
    """A dataset whose batches go through the trial's `collate_fn` (dtrain asks it for whole batches)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Any:
        return self.collate_fn([self.dataset[i] for i in indices])


def _dataset(loader: Any, method: str) -> Dataset:
    """The dataset a data loader holds (dtrain shards and batches it); a collate_fn is kept."""
    if isinstance(loader, (DataLoader, torch.utils.data.DataLoader)):
        dataset, collate = loader.dataset, loader.collate_fn
        if isinstance(loader, torch.utils.data.DataLoader) and collate is torch.utils.data.default_collate:
            collate = None
        return _Collated(dataset, collate) if collate is not None else dataset
    raise TrialError(f"{method}() returned {type(loader).__name__}; return a determined.pytorch.DataLoader("
                     "dataset, batch_size=context.get_per_slot_batch_size())")


def _metrics(returned: Any, method: str) -> dict[str, Any]:
    if isinstance(returned, torch.Tensor):
        return {"loss": returned}
    if isinstance(returned, Mapping):
        return dict(returned)
    raise TrialError(f"{method}() returned {type(returned).__name__}; return a dict of metrics (or the loss tensor)")


def _needs_eager(context: PyTorchTrialContext) -> bool:
    """True when the trial steps its models itself: several models, optimizers or schedulers, or an optimizer whose
    `average_aggregated_gradients` differs from the config's."""
    configured = context._config.optimizations.average_aggregated_gradients
    return (len(context.models) > 1 or len(context.optimizers) > 1 or len(context.lr_schedulers) > 1
            or any(average != configured for average in context._averages))


def _plain(value: Any) -> Any:
    """A metric as a plain number where it is a scalar tensor (what a callback is given)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    return value


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(PyTorchTrial, name)


def _takes_batch_idx(method: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)
