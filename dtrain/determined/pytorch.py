"""The pieces of `determined.pytorch` that a PyTorchTrial uses: `DataLoader`, `LRScheduler`, `PyTorchCallback`,
`MetricReducer` and the training units `Batch`, `Epoch`. `PyTorchTrial` itself stands in `adapter.py`, beside the
dtrain Trial that trains it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

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
        return -(-len(self.dataset) // (self.batch_size or 1))  # type: ignore[arg-type]


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
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.value))


class Batch(TrainUnit):
    unit = "batches"


class Epoch(TrainUnit):
    unit = "epochs"


class PyTorchCallback:
    """Determined's callback hooks. dtrain calls `on_training_start`, `on_training_epoch_start/end` and
    `on_validation_start`; the others are not called and `state_dict`/`load_state_dict` are not checkpointed
    (docs/determined.md lists this as half done)."""

    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: str | None) -> None: ...
    def on_training_start(self) -> None: ...
    def on_training_epoch_start(self, epoch_idx: int) -> None: ...
    def on_training_epoch_end(self, epoch_idx: int) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self, metrics: dict[str, Any]) -> None: ...
    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None: ...
    def on_trial_shutdown(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict


class MetricReducer:
    """Determined's custom reducer interface (`reset`, `per_slot_reduce`, `cross_slot_reduce`). dtrain averages
    evaluate_batch's means by record count instead; `context.wrap_reducer` is refused with one line."""

    def reset(self) -> None:
        raise NotImplementedError

    def per_slot_reduce(self) -> Any:
        raise NotImplementedError

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        raise NotImplementedError
