"""The Trial API a user implements, and the context it is given.

A Trial builds the model, the optimizer, the datasets, and says how one batch is trained and evaluated.
The Trainer owns everything else (the loop, data sharding, synchronization, checkpoints, metrics), so
Trial code never imports torch.distributed and runs unchanged on one process or many.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset

from dtrain.data.sharding import BatchSplit
from dtrain.errors import TrialError


@dataclass
class TrialContext:
    """What a Trial may know about its run: hyperparameters, its rank, batch sizes and lengths."""

    hparams: Mapping[str, Any]
    rank: int
    world_size: int
    local_rank: int
    batch_split: BatchSplit
    device: torch.device
    seed: int
    data_config: Mapping[str, Any] = field(default_factory=dict)
    config_dir: Path = field(default_factory=Path.cwd)
    run_dir: Path | None = None
    batches_per_epoch: int | None = None  # known once the training data exists
    total_batches: int | None = None
    aggregation_frequency: int = 1  # of the current batch-size phase
    optimizer_steps_total: int | None = None  # set by the Trainer (a batch-size schedule changes it)
    batches_trained: int = 0  # batches trained before the one train_batch is on (kept current by the Trainer)
    stop_requested: bool = False  # set by the Trial to end the run at the next report or validation
    experiment_config: Any = None  # the whole ExperimentConfig (for adapters of other APIs)

    @property
    def per_slot_batch_size(self) -> int:
        """Records this rank trains on per batch."""
        return self.batch_split.per_rank[self.rank]

    @property
    def global_batch_size(self) -> int:
        """Records trained on per batch over all ranks (after dropping a remainder)."""
        return self.batch_split.global_batch_size

    @property
    def total_optimizer_steps(self) -> int | None:
        """Optimizer updates in the whole run (batches / aggregation_frequency, rounded up)."""
        if self.optimizer_steps_total is not None:
            return self.optimizer_steps_total
        if self.total_batches is None:
            return None
        return -(-self.total_batches // self.aggregation_frequency)

    @property
    def optimizer_steps_per_epoch(self) -> float | None:
        if self.batches_per_epoch is None:
            return None
        return self.batches_per_epoch / self.aggregation_frequency

    def get_hparam(self, name: str) -> Any:
        """One hyperparameter; an unknown name is an error that lists the close ones."""
        if name in self.hparams:
            return self.hparams[name]
        near = difflib.get_close_matches(name, list(self.hparams), n=1)
        hint = f"did you mean `{near[0]}`?" if near else f"defined: {', '.join(sorted(self.hparams))}"
        raise TrialError(f"hyperparameter `{name}` is not in the config's hyperparameters; {hint}")

    def resolve_path(self, path: str | Path) -> Path:
        """A data path from the config, relative to the directory of the experiment file."""
        path = Path(path).expanduser()
        return path if path.is_absolute() else self.config_dir / path


class Trial:
    """Subclass this and name it in the config's `entrypoint` (`module:Class` or `file.py:Class`).

    `train_batch` runs the forward pass and returns a dict with a scalar `loss` (mean over the batch);
    the Trainer runs backward, synchronization and the optimizer step. `evaluate_batch` returns metrics
    that are means over its batch; the Trainer weights them by batch size across batches and ranks.
    """

    # True for a Trial that may set `context.stop_requested` (the ranks then agree on it at each report and
    # validation: one small all-reduce there, which Trials that never ask to stop do not pay)
    may_request_stop: ClassVar[bool] = False

    def __init__(self, context: TrialContext) -> None:
        self.context = context

    @classmethod
    def check_hyperparameters(cls, hparams: Mapping[str, Any]) -> None:
        """Raise a one-line ConfigError or TrialError for hyperparameters this Trial cannot use. `dtrain run`
        calls it before any worker starts, so that a bad value stops the run there rather than in every worker;
        the default accepts any."""

    def build_model(self) -> nn.Module:
        raise NotImplementedError("build_model() must return the torch.nn.Module to train")

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError("build_optimizer(model) must return a torch.optim.Optimizer over model.parameters()")

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        """Optional: a scheduler stepped once per optimizer step (context.total_optimizer_steps is known)."""
        del optimizer
        return None

    def build_training_data(self) -> Dataset:
        raise NotImplementedError("build_training_data() must return a map-style torch Dataset")

    def build_validation_data(self) -> Dataset:
        raise NotImplementedError("build_validation_data() must return a map-style torch Dataset")

    def train_batch(self, batch: Any, model: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError("train_batch(batch, model) must return {'loss': scalar tensor, ...}")

    def evaluate_batch(self, batch: Any, model: nn.Module) -> dict[str, torch.Tensor | float]:
        raise NotImplementedError("evaluate_batch(batch, model) must return {metric name: batch mean}")

    # Optional hooks, for adapters of other training APIs (dtrain/determined: Determined's callbacks and metric
    # reducers). The Trainer calls each on every rank at the same point; the defaults do nothing.

    def validation_started(self) -> None:
        """Before each validation."""

    def validation_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """After each validation, with its metrics reduced over the ranks (every rank together: collectives are
        allowed); returns the metrics to record."""
        return metrics

    def training_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """At each training report, with the means since the last report reduced over the ranks (every rank
        together); returns the metrics to record."""
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The Trial's own state for checkpoints (rank 0's is written; plain Python values and tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """When a run resumes, after the model and optimizer, with the checkpoint's `state_dict()`."""

    def checkpoint_written(self, path: Path | str | None) -> None:
        """After each checkpoint: its directory on rank 0 (a local Path, or its URL when `checkpoint_storage` is object
        storage), None on the other ranks."""

    def training_ended(self, status: str) -> None:
        """When training ends (not after a crash), with the run's status."""
