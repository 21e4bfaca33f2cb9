"""What a synchronization strategy is to the Trainer: one core protocol that every strategy implements (its
last five hooks have defaults on `StrategyBase`, which strategies subclass), and optional extensions, each its
own protocol, whose absence changes the Trainer's flow: the Trainer checks them with `isinstance` once at set-up
and takes its one default path when a strategy lacks them (docs/strategies.md says when each is called).

Contract with the Trainer: before backward, each rank scales its loss by world_size * weight / k, where
weight is the rank's share of the global batch and k the aggregation frequency (1/k only with
`average_aggregated_gradients`). With even batches that factor is 1/k, and a strategy that averages
(sum / world_size) then yields exactly the full-batch gradient, for uneven batches too; `sum` and `adasum`
combine the same relatively weighted gradients. Strategies never rescale gradients themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dtrain.compress import WireStats
from dtrain.runs.storage import ShardFolder
from dtrain.sync.hooks import BucketObserver

TrainBatch = Callable[[Any, nn.Module], Mapping[str, Any]]  # the Trial's train_batch(batch, model) -> outputs


@runtime_checkable
class SyncStrategy(Protocol):
    """The core: how gradients or parameters are made consistent across ranks."""

    name: str

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return the module the Trainer runs forward and backward on (it may be the model itself). Called once,
        before the optimizer is built, so a strategy may replace the parameters (sharding) in place."""
        ...

    def unwrap_model(self) -> nn.Module:
        """The user's model: what validation runs and checkpoints hold."""
        ...

    def no_sync(self) -> AbstractContextManager[Any]:
        """A context for forward and backward passes whose gradients are only accumulated locally (all but the
        last batch of an aggregated update)."""
        ...

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply one update after the communicating backward pass (gradients are synchronized by then)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a resumed run needs (e.g. error-feedback residuals, a tuned bucket size); may be empty."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called before `wrap_model` when a run resumes: the state may decide how the model is wrapped."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the strategy runs with (op, bucket size, tuning results), for the run's summary."""
        ...

    def close(self) -> None:
        """Release communication resources."""
        ...

    # -- hooks whose absence changes nothing in the Trainer's flow: StrategyBase gives each a default

    def observe_buckets(self, observer: BucketObserver | None, *, per_bucket: bool = False) -> None:
        """Tell the profiler, from now on, when gradients are ready and when their communication is done
        (comm-wait phase, timeline bucket spans); called before `wrap_model`, in distributed runs with the phase
        timers on; None stops it. Default: nothing is reported (phases are timed, waits not split out)."""
        ...

    def observe_waits(self, record: Callable[[str, float], None] | None) -> None:
        """Call `record(phase, seconds)` for every communication wait inside forward and backward from now on
        (FSDP's all-gathers and reduce-scatters, a pipeline stage's bubble), so the phase timers show them as
        phases of their own; called before `wrap_model`, with the phase timers on; None stops it. Default:
        those waits stay inside the forward and backward phases."""
        ...

    def take_wire_stats(self) -> WireStats | None:
        """Bytes this rank sent for gradients since the last call, beside what dense fp32 all-reduces would
        have sent (logged per update); None when nothing is sent or counted. Default: None."""
        ...

    def metrics(self) -> dict[str, float]:
        """Scalars of its own for each training report (rank 0). Default: none."""
        ...

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the Trainer schedules, checkpoints and hands to `step()`, in place of the one built over
        the wrapped model's parameters (a sharded optimizer such as ZeRO-1's). Default: the optimizer as built."""
        ...


class StrategyBase:
    """The defaults of the hooks whose absence changes nothing in the Trainer's flow (`SyncStrategy`'s last
    five): a strategy subclasses it and overrides the ones it has."""

    def observe_buckets(self, observer: BucketObserver | None, *, per_bucket: bool = False) -> None:
        """No bucket reports."""

    def observe_waits(self, record: Callable[[str, float], None] | None) -> None:
        """No waits of its own to report."""

    def take_wire_stats(self) -> WireStats | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer


# ------------------------------------------------------------------------------------------------ extensions


@runtime_checkable
class AsynchronousPacing(Protocol):
    """Ranks that may run ahead of each other between meeting points (asynchronous parameter servers).
    Without it a strategy moves in lockstep: every rank takes every step together."""

    lockstep: bool  # True when ranks move together after all (per-step collectives outside the strategy are safe)

    def steps_done(self, step: int) -> int:
        """Global batches trained once this rank's batch number `step` is done: the strategy's own count, which
        the Trainer follows up to its next meeting point (report, validation, checkpoint, stop, end)."""
        ...


@runtime_checkable
class Consolidating(Protocol):
    """Replicas that may differ between meeting points. Without it they are identical after every step."""

    def consolidate(self, *, snapshot: bool = False) -> None:
        """Called by every rank together before validation and checkpoints: bring this rank's model to the
        parameters every rank shares; with `snapshot`, capture the state that `state_dict()` returns next."""
        ...


class ComputePhases(Protocol):
    """The Trainer's timed phases of one step's compute, entered by whoever runs forward and backward."""

    def forward(self) -> AbstractContextManager[Any]: ...

    def backward(self) -> AbstractContextManager[Any]: ...


@runtime_checkable
class RunsForwardBackward(Protocol):
    """Owns how one batch's forward and backward passes run (a pipeline schedule over microbatches). Without it
    the Trainer runs the Trial's train_batch on the wrapped model, then backward on the scaled loss."""

    def forward_backward(self, model: nn.Module, batch: Any, train_batch: TrainBatch, *,
                         loss_scale: float | torch.Tensor, communicate: bool,
                         phases: ComputePhases) -> Mapping[str, Any]:
        """Run forward and backward for `batch` and return the Trial's outputs (with a scalar `loss`, the mean
        over this rank's batch). The backward pass must scale the loss by `loss_scale` and, unless
        `communicate`, leave gradients local (as under `no_sync()`)."""
        ...


@runtime_checkable
class OwnsCheckpointState(Protocol):
    """Model or optimizer state that is not one plain state_dict per rank (sharded parameters): the strategy
    captures it for checkpoints and loads it back. Without it checkpoints hold the unwrapped model's and the
    optimizer's own state_dict."""

    def model_state_dict(self) -> dict[str, Any]:
        """The model's state for `model.pt` (called by every rank together; rank 0 writes it)."""
        ...

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's model state (after wrapping; every rank gets rank 0's reading)."""
        ...

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state for `state.pt` (called by every rank together; rank 0 writes it)."""
        ...

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a checkpoint's optimizer state (after the optimizer is built and wrapped)."""
        ...


@runtime_checkable
class WritesShardedCheckpoint(Protocol):
    """Model and optimizer state that each rank writes as its own shard (torch.distributed.checkpoint), so that
    no rank ever holds the whole of it. The checkpoint's `model.pt` then holds no weights (`dtrain export` makes
    a plain one); without this extension rank 0 writes the state OwnsCheckpointState (or the default) returns."""

    def save_sharded(self, folder: ShardFolder, optimizer: torch.optim.Optimizer) -> None:
        """Write this rank's shards of the model and optimizer state into `folder` (every rank together; DCP
        through `folder.writer()`, a local folder or object storage alike)."""
        ...

    def load_sharded(self, folder: ShardFolder, optimizer: torch.optim.Optimizer) -> None:
        """Load this rank's shards back from `folder` (every rank together; after wrapping and building; DCP
        through `folder.reader()`)."""
        ...


@runtime_checkable
class ShardedConstruction(Protocol):
    """Builds the model without a whole copy on every rank: the Trial's `build_model()` runs inside
    `model_construction()` (the meta device on every rank but rank 0, so they allocate nothing), and `wrap_model`
    materializes only this rank's shards, filled from rank 0's model. Without it every rank builds the whole
    model on its device."""

    def model_construction(self) -> AbstractContextManager[Any]:
        """The context `build_model()` runs in on this rank."""
        ...


@runtime_checkable
class CollectiveForward(Protocol):
    """A wrapped model whose forward pass is a collective (FSDP all-gathers each block's shards as it runs), so
    every rank must run the same number of forward passes in validation too. Without it each rank evaluates its
    share of the validation data on its own."""

    collective_forward: bool


def forward_is_collective(strategy: object) -> bool:
    """CollectiveForward read by value: a strategy that declares `collective_forward = False` evaluates as one
    without the marker does."""
    return isinstance(strategy, CollectiveForward) and bool(strategy.collective_forward)


@runtime_checkable
class EvaluatesInStages(Protocol):
    """Validation without the whole model on any rank: the strategy runs each validation batch's forward pass
    through the ranks that hold the model's parts, and the outputs exist only on the ranks of the last part. Used
    when the Trial defines `pipeline_metrics(outputs, targets)`; otherwise the Trainer consolidates the model and
    every rank evaluates its share with `evaluate_batch`."""

    evaluation_replica: int  # which copy of the model this rank belongs to: validation data is shared out by copy
    evaluation_replicas: int

    def forward_in_stages(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's outputs for `inputs` on the ranks that hold its last part, None on the others (a
        collective of the ranks of one replica: each gives the same inputs)."""
        ...


@runtime_checkable
class HoldsModelParts(Protocol):
    """Ranks that hold different parts of the model (pipeline stages): the end-of-run replica check compares each
    rank's part with the same part on the other replicas, so no rank assembles the whole model for it. Without it
    every rank's whole unwrapped model is compared with every other rank's."""

    def replica_part(self) -> tuple[nn.Module, int]:
        """The module this rank holds and its part number (ranks with the same number must hold equal weights)."""
        ...
