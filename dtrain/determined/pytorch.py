"""The pieces of `determined.pytorch` that a PyTorchTrial uses: `DataLoader`, `LRScheduler`, `PyTorchCallback`,
`MetricReducer` and the training units `Batch`, `Epoch`. `PyTorchTrial` itself stands in `adapter.py`, beside the
dtrain Trial that trains it."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset


class DataLoader:
    """Determined's loader description: the dataset and how to batch it. dtrain shards and batches the dataset
    itself (the per-slot batch size, the shuffle and the sampler are dtrain's, seeded and resumable), so of these
    arguments only `dataset` and `collate_fn` are used; `get_data_loader()` builds the torch loader they describe
    for code that iterates it directly (e.g. `evaluate_full_dataset`)."""

    def __init__(self, dataset: Dataset, batch_size: int | None = 1, shuffle: bool = False, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Callable[..., Any] | None = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[..., Any] | None = None, multiprocessing_context: Any = None,
                 generator: Any = None, *, prefetch_factor: int | None = None, persistent_workers: bool = False
                 ) -> None:
        self.dataset = dataset
        self.batch_size, self.shuffle, self.sampler, self.batch_sampler = batch_size, shuffle, sampler, batch_sampler
        self.num_workers, self.collate_fn, self.pin_memory, self.drop_last = num_workers, collate_fn, pin_memory, \
            drop_last
        self.timeout, self.worker_init_fn = timeout, worker_init_fn
        self.multiprocessing_context, self.generator = multiprocessing_context, generator
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers

    def get_data_loader(self, repeat: bool = False, skip: int = 0, num_replicas: int = 1, rank: int = 0
                        ) -> torch.utils.data.DataLoader:
        """The torch DataLoader these arguments describe (not sharded, not repeated)."""
        del repeat, skip, num_replicas, rank
        return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, shuffle=self.shuffle,
                                           collate_fn=self.collate_fn, num_workers=self.num_workers,
                                           drop_last=self.drop_last)

    def __len__(self) -> int:
        return -(-len(cast(Sized, self.dataset)) // (self.batch_size or 1))  # a map-style dataset: it has a length


class LRScheduler:
    """Determined's scheduler wrapper with its step modes (what `context.wrap_lr_scheduler` returns)."""

    class StepMode(enum.Enum):
        STEP_EVERY_EPOCH = 1
        STEP_EVERY_BATCH = 2
        MANUAL_STEP = 3
        STEP_EVERY_OPTIMIZER_STEP = 4

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, step_mode: LRScheduler.StepMode,
                 frequency: int = 1) -> None:
        self.scheduler, self._step_mode, self._frequency = scheduler, step_mode, frequency

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in self.scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class TrainUnit:
    """A length in Determined's units; `value` is how many."""

    def __init__(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{type(self).__name__}({value!r}): a length is a whole number >= 0")
        self.value = value

    unit = "batches"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.value))


class Batch(TrainUnit):
    unit = "batches"


class Epoch(TrainUnit):
    unit = "epochs"


class PyTorchCallback:
    """Determined's callback hooks; override the ones you need. dtrain calls them at these points (every rank
    unless it says otherwise; docs/determined.md):

    - `on_trial_startup(first_batch_idx, checkpoint_uuid)`: before the first training batch or validation of this
      process (after the data loaders are built: dtrain builds them first); `checkpoint_uuid` is the name of the
      checkpoint the run resumed from (`step-<n>`), else None;
    - `on_training_start()`: before the first training batch of this process (after any checkpoint was loaded);
    - `on_training_epoch_start(epoch_idx)` / `on_training_epoch_end(epoch_idx)`: around each epoch's batches;
    - `on_training_workload_end(avg_metrics, batch_metrics)`: at each training report, with the means since the
      last report over all slots (custom training reducers included) and this slot's per-batch metrics;
    - `on_validation_start()` / `on_validation_end(metrics)`: around each validation; `on_validation_end` on the
      chief only, with the validation metrics (custom reducers included), as Determined documents;
    - `on_checkpoint_save_start(checkpoint)`: on the chief before a checkpoint is written, with the dict dtrain saves
      for the trial (the callbacks' states under "callbacks"; keys added to it are saved too);
    - `on_checkpoint_write_end(checkpoint_dir)` and `on_checkpoint_upload_end(uuid)`: on the chief after a
      checkpoint is written (dtrain's checkpoints are in the run dir: written is stored; `uuid` is its name);
    - `on_checkpoint_load_start(checkpoint)`: when a run resumes, with that saved dict, before the callbacks'
      `load_state_dict`;
    - `on_trial_shutdown()`: when training ends (not after a crash or a kill, as in Determined).

    `state_dict()` / `load_state_dict()` are saved in and restored from dtrain's checkpoints by the name
    `build_callbacks()` gives the callback (plain values and tensors: checkpoints load with weights_only).
    `on_validation_epoch_start/end` and the deprecated `on_validation_step_start/end` and `on_checkpoint_end` are
    Lightning-adapter hooks, not called."""

    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: str | None) -> None: ...
    def on_trial_shutdown(self) -> None: ...
    def on_training_start(self) -> None: ...
    def on_training_epoch_start(self, epoch_idx: int) -> None: ...
    def on_training_epoch_end(self, epoch_idx: int) -> None: ...
    def on_training_workload_end(self, avg_metrics: dict[str, Any], batch_metrics: list[dict[str, Any]]
                                 ) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self, metrics: dict[str, Any]) -> None: ...
    def on_checkpoint_save_start(self, checkpoint: dict[str, Any]) -> None: ...
    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None: ...
    def on_checkpoint_upload_end(self, uuid: str) -> None: ...
    def on_checkpoint_load_start(self, checkpoint: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict


class MetricReducer:
    """Determined's custom reducer interface: the trial updates it (a method of its own, e.g. in evaluate_batch);
    `reset()` starts a validation or a training report period, `per_slot_reduce()` reduces one slot's values, and
    `cross_slot_reduce(per_slot_metrics)` all slots' (a value with the name given to `context.wrap_reducer`, or a
    dict of metrics with name=None). See reducers.py."""

    def reset(self) -> None:
        raise NotImplementedError

    def per_slot_reduce(self) -> Any:
        raise NotImplementedError

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        raise NotImplementedError
