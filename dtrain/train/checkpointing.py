"""Checkpoints in a run: when one is due and which are kept (the policy), what one holds and who writes it
(every rank captures its part, rank 0 writes the files through `dtrain.train.checkpoint`), and resuming. The
checkpoints' root is a `CheckpointStore` (dtrain.runs.storage): a local folder or object storage alike.

What a strategy's model and optimizer state look like in a checkpoint is its own business when it implements
the OwnsCheckpointState extension (sharded parameters); `PlainCheckpointState` is the default.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.comm import Topology, all_gather_object, barrier, broadcast_object
from dtrain.config import ExperimentConfig, StorageSection
from dtrain.config.storage import ObjectStorage
from dtrain.errors import CheckpointError
from dtrain.runs.storage import CheckpointStore, ShardFolder, with_secrets
from dtrain.sync import OwnsCheckpointState, SyncStrategy, WritesShardedCheckpoint
from dtrain.train import checkpoint as ckpt
from dtrain.train.callbacks import StepCallbacks
from dtrain.train.evaluation import SearcherMetric
from dtrain.train.optimization import Optimization
from dtrain.train.rng import capture_rng_state, restore_rng_state
from dtrain.train.schedule import Schedule
from dtrain.train.state import TrainerState
from dtrain.train.upload import BackgroundUploads, host_snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as rank 0 read it, on every rank: its step, the model's state and the rest (`state.pt`)."""

    step: int
    model_state: dict[str, Any]
    state: dict[str, Any]

    @property
    def strategy_state(self) -> dict[str, Any]:
        return dict(self.state.get("strategy", {}))


def agreed_store(recorded: CheckpointStore, topology: Topology) -> CheckpointStore:
    """Rank 0's checkpoint store on every rank (each node records its own in its run dir), with the credentials the
    launcher put in the environment (a collective)."""
    data = recorded.to_json()
    if topology.is_distributed:
        data = broadcast_object(data)
    return with_secrets(CheckpointStore.from_json(data))


def read_checkpoint(root: CheckpointStore, topology: Topology) -> Checkpoint | None:
    """The latest complete checkpoint under `root`, read by rank 0 and broadcast to the others; None if none."""
    payload = None
    if topology.is_chief:
        ckpt.remove_stale_partials(root)
        ref = ckpt.find_resume_checkpoint(root)
        if ref is not None:
            model_state, state = ckpt.load_checkpoint(ref)
            payload = (ref.step, model_state, state)
    if topology.is_distributed:
        step = broadcast_object(payload[0] if payload else None)
        if step is None:
            return None
        payload = broadcast_object(payload)
    if payload is None:
        return None
    step, model_state, state = payload
    return Checkpoint(step=step, model_state=model_state, state=state)


def uploads_in_background(section: StorageSection, root: CheckpointStore) -> bool:
    """Whether rank 0 uploads plain checkpoints in the background: on object storage with
    `checkpoint_storage.background_upload: true`; a local folder is written before training goes on."""
    return isinstance(section, ObjectStorage) and section.background_upload and not root.is_local


class PlainCheckpointState:
    """The default checkpoint state: the unwrapped model's and the optimizer's own state_dict."""

    def __init__(self, strategy: SyncStrategy) -> None:
        self.strategy = strategy

    def model_state_dict(self) -> dict[str, Any]:
        return self.strategy.unwrap_model().state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.unwrap_model().load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)


def checkpoint_state_of(strategy: SyncStrategy) -> OwnsCheckpointState:
    """The strategy itself where it owns its checkpoint state, else the plain default."""
    return strategy if isinstance(strategy, OwnsCheckpointState) else PlainCheckpointState(strategy)


def resume(checkpoint: Checkpoint, root: CheckpointStore, owner: OwnsCheckpointState, optimization: Optimization,
           rank: int) -> TrainerState:
    """Load a checkpoint's model, optimizer, schedules and this rank's RNG state (the strategy's own state was
    loaded before it wrapped the model); return the trainer state it carries, counting this resume."""
    sharded = checkpoint.state.get("sharded")
    try:
        if sharded is not None:  # every rank reads its own shards
            if not isinstance(owner, WritesShardedCheckpoint):
                raise CheckpointError(f"checkpoint step-{checkpoint.step} in {root.describe()} holds sharded state "
                                      "(written by strategy fsdp or pipeline); resume it with the strategy that wrote "
                                      "it, or make a plain model.pt with `dtrain export` and start a new run from it")
            owner.load_sharded(ShardFolder(root, str(sharded)), optimization.optimizer)
        else:
            owner.load_model_state_dict(checkpoint.model_state)
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint step-{checkpoint.step} in {root.describe()} does not fit this Trial's "
                              f"model ({' '.join(str(exc).split())[:300]}); resume with the model it was written "
                              "for, or give a new --run-dir") from None
    if sharded is None:
        owner.load_optimizer_state_dict(optimization.optimizer, checkpoint.state["optimizer"])
    optimization.load_schedule_state(checkpoint.state)
    state = TrainerState.from_dict(checkpoint.state["trainer"])
    state.resumes += 1
    rng = checkpoint.state["rng"]
    restore_rng_state(rng[rank] if rank < len(rng) else rng[0])
    log.info("resumed from checkpoint step-%d", checkpoint.step)
    return state


def batch_meta(state: TrainerState) -> dict[str, Any]:
    """What `meta.json` says of the global batch and its data replicas: `dtrain run` checks, before any worker
    starts, that a resume at another size can split it (dtrain.train.resize)."""
    if not state.batch_split:
        return {}
    return {"global_batch": sum(state.batch_split), "data_replicas": len(state.batch_split)}


class CheckpointPolicy:
    """When a checkpoint is written (the schedule's period and the end, after a validation with
    `checkpoint_policy: all`, or with `best` when the searcher metric improved) and which are kept."""

    def __init__(self, config: ExperimentConfig, schedule: Schedule, searcher: SearcherMetric) -> None:
        self.policy = config.checkpoint_policy
        self.keep_latest = config.checkpoint_storage.save_trial_latest
        self.keep_best = config.checkpoint_storage.save_trial_best
        self.schedule = schedule
        self.searcher = searcher

    def due(self, step: int, *, validated: bool, metric: float | None,
            validations: Sequence[Mapping[str, Any]]) -> bool:
        """`validations` is the run's history, this step's validation last when `validated`."""
        if self.schedule.checkpoint_due(step):
            return True
        if not validated:
            return False
        if self.policy == "all":
            return True
        if self.policy == "best":
            return metric is not None and self.searcher.is_best(metric, validations[:-1])
        return False

    def best_steps(self, checkpoint_metrics: Mapping[int, float]) -> set[int]:
        """The steps of the `save_trial_best` checkpoints with the best searcher metric."""
        if not self.keep_best or not checkpoint_metrics:
            return set()
        ordered = sorted(checkpoint_metrics.items(), key=lambda item: item[1],
                         reverse=not self.searcher.smaller_is_better)
        return {step for step, _ in ordered[:self.keep_best]}


class Checkpointer:
    """Writes the run's checkpoints (all ranks call `write` together) and remembers the latest complete one. With
    `background` (object storage with `checkpoint_storage.background_upload`), rank 0 hands a plain
    checkpoint to a background upload (dtrain.train.upload) and training goes on; a sharded one (FSDP, pipeline)
    is written by every rank before training goes on, as on local storage."""

    def __init__(self, root: CheckpointStore, topology: Topology, owner: OwnsCheckpointState, policy: CheckpointPolicy,
                 callbacks: StepCallbacks, *, background: bool = False) -> None:
        self.root = root
        self.topology = topology
        self.owner = owner
        self.policy = policy
        self.callbacks = callbacks
        self.uploads = BackgroundUploads() if background and topology.is_chief else None
        self.latest: ckpt.CheckpointRef | None = None  # the newest complete one this process (rank 0) wrote
        self._committed: list[ckpt.CheckpointRef] = []  # complete since the last take_committed

    def write(self, step: int, metric: float | None, *, state: TrainerState, optimization: Optimization,
              strategy: SyncStrategy, epoch: float, trial_state: dict[str, Any] | None = None) -> None:
        """Every rank's RNG state and the model, optimizer, schedules, strategy, trainer state and the Trial's own
        state after `step`; `metric` is the searcher metric of a validation at this step (kept for best-checkpoint
        pruning). With a background upload this returns once rank 0 holds a snapshot; `take_committed` tells when
        the checkpoint is complete."""
        rng_states = all_gather_object(capture_rng_state())
        if metric is not None:
            state.checkpoint_metrics[step] = metric
        sharded: dict[str, str] = {}
        if isinstance(strategy, WritesShardedCheckpoint):  # every rank its shards; the files below hold no weights
            folder = ckpt.shard_folder(self.root, step)
            if self.topology.is_chief:  # the same step written again after a restart: it stops counting first
                self.root.remove(f"{ckpt.checkpoint_name(step)}/{ckpt.META_FILE}")
                self.root.remove(folder.name, recursive=True)
            barrier()
            strategy.save_sharded(folder, optimization.optimizer)
            model_state: dict[str, Any] = {}
            optimizer_state: dict[str, Any] = {}
            sharded = {"sharded": folder.name}
        else:
            model_state = self.owner.model_state_dict()
            optimizer_state = self.owner.optimizer_state_dict(optimization.optimizer)
        if not self.topology.is_chief:
            return
        contents = {"optimizer": optimizer_state, **optimization.schedule_state(), "strategy": strategy.state_dict(),
                    "trainer": state.to_dict(), "rng": rng_states, "trial": trial_state or {}, **sharded}
        extra_meta = {"world_size": self.topology.world_size, "epoch": epoch, **sharded, **batch_meta(state)}
        keep_best = self.policy.best_steps(state.checkpoint_metrics)
        if self.uploads is None or sharded:
            if self.uploads is not None:
                self.uploads.wait()
            self._committed.append(self._commit(step, model_state, contents, extra_meta, keep_best))
            return
        model_state, contents = host_snapshot(model_state), host_snapshot(contents)
        self.uploads.submit(self.root.describe(ckpt.checkpoint_name(step)),
                            lambda: self._commit(step, model_state, contents, extra_meta, keep_best))

    def _commit(self, step: int, model_state: dict[str, Any], contents: dict[str, Any], extra_meta: dict[str, Any],
                keep_best: set[int]) -> ckpt.CheckpointRef:
        """Write the checkpoint (`meta.json` last, then `latest`), then delete what keep-latest/keep-best drop:
        nothing is deleted before the new checkpoint counts."""
        started = time.perf_counter()
        ref = ckpt.write_checkpoint(self.root, step, model_state, contents, extra_meta=extra_meta,
                                    after_model_file=lambda: self.callbacks.during_checkpoint(step))
        ckpt.prune_checkpoints(self.root, self.policy.keep_latest, keep_best)
        log.info("checkpoint %s written in %.2f s%s", ref.path, time.perf_counter() - started,
                 " (background upload)" if self.uploads is not None and not extra_meta.get("sharded") else "")
        return ref

    def take_committed(self) -> list[ckpt.CheckpointRef]:
        """The checkpoints that became complete since the last call, oldest first (rank 0; [] elsewhere); raises
        a background upload's error."""
        if self.uploads is not None:
            self._committed.extend(self.uploads.take_committed())
        done, self._committed = self._committed, []
        if done:
            self.latest = done[-1]
        return done

    def finish_uploads(self, *, failed: bool = False) -> None:
        """Wait for the upload in flight (at the end of training, a stop, or a failure: the snapshot in flight is a
        complete, consistent checkpoint worth keeping). After a failure an upload's own error is logged, not
        raised, so that the failure that ended training is the one reported."""
        if self.uploads is None:
            return
        try:
            self.uploads.wait()
        except CheckpointError as exc:
            if not failed:
                raise
            log.error("%s", exc)

    def newest(self) -> ckpt.CheckpointRef | None:
        """The checkpoint this run wrote last, else (on rank 0) the newest complete one on disk."""
        if self.latest is None and self.topology.is_chief:
            return ckpt.find_resume_checkpoint(self.root)
        return self.latest
