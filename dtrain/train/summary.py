"""What `summary.json` says about a finished (or stopped) run, and the end-of-run checks that go into it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from dtrain.comm import Topology, all_gather_object
from dtrain.errors import SyncError
from dtrain.profile import Profiler
from dtrain.runs.membership import read_membership
from dtrain.train.batches import BatchSizes
from dtrain.train.checkpoint import CheckpointRef
from dtrain.train.guard import model_digest
from dtrain.train.schedule import Schedule
from dtrain.train.state import TrainerState


def run_summary(*, status: str, topology: Topology, sizes: BatchSizes, state: TrainerState, schedule: Schedule,
                checkpoint: CheckpointRef | None, run_dir: Path, strategy: dict[str, Any],
                compression: str) -> dict[str, Any]:
    """The summary's fields in their contract order (docs/guide.md, "What a run writes"); `strategy` is the
    strategy's describe()."""
    history = state.validation_history
    split = sizes.split
    return {
        "status": status,
        "world_size": topology.world_size,
        "global_batch_size": split.global_batch_size,
        "per_slot_batch_size": split.per_rank[0],
        "per_rank_batch_sizes": list(split.per_rank),
        "steps_completed": state.steps_completed,
        "epochs_completed": schedule.epoch_of(state.steps_completed),
        "samples_per_second": state.samples_trained / state.training_seconds if state.training_seconds else 0.0,
        "wall_seconds": state.wall_seconds,
        "validation": history[-1]["metrics"] if history else {},
        "validation_history": history,
        "checkpoint": checkpoint.model_location if checkpoint is not None else None,
        "restarts": topology.restart_count,
        "resumes": state.resumes,
        "membership": read_membership(run_dir),
        "nan_steps_skipped": state.nan_steps_skipped,
        "tensorboard": str(run_dir / "tensorboard"),
        "strategy": strategy,
        "communication": communication_summary(state, compression),
        **({"batch_size_phases": [
            {"start_step": p.start_step, "global_batch_size": p.global_batch_size,
             "per_slot_batch_size": sizes.split_of(p).per_rank[0], "aggregation_frequency": p.aggregation_frequency}
            for p in schedule.plan.phases if p.start_step < schedule.total_batches]}
           if schedule.batch_size_changes else {}),
    }


def communication_summary(state: TrainerState, compression: str) -> dict[str, Any]:
    """Bytes per communicating update (this rank's, by the ring model) and the ratio to dense fp32."""
    steps = state.communicating_steps
    return {"compression": compression, "communicating_steps": steps,
            "bytes_per_step": state.wire_bytes / steps if steps else 0.0,
            "payload_bytes_per_step": state.payload_bytes / steps if steps else 0.0,
            "dense_bytes_per_step": state.dense_wire_bytes / steps if steps else 0.0,
            "compression_ratio": state.dense_wire_bytes / state.wire_bytes if state.wire_bytes else None,
            "total_bytes": state.wire_bytes}


def replicas_identical(model: nn.Module, part: int = 0) -> bool:
    """Every rank must end with the same weights (a skipped update, a restart or a bug that broke that would
    otherwise go unnoticed); one digest per rank, compared on all. `model` is the part of the model this rank
    holds and `part` which one (pipeline stages): ranks are compared with the ranks that hold the same part.
    SyncError when they differ."""
    digests = all_gather_object((part, model_digest(model)))
    by_part: dict[int, set[str]] = {}
    for held, digest in digests:
        by_part.setdefault(held, set()).add(digest)
    if any(len(seen) > 1 for seen in by_part.values()):
        groups = ", ".join(f"rank {rank}: {digest[:12]}" + (f" (part {held})" if len(by_part) > 1 else "")
                           for rank, (held, digest) in enumerate(digests))
        raise SyncError(f"the model replicas differ at the end of training ({groups}); a rank applied an update "
                        "the others did not - please report this with the run's logs")
    return True


def run_profile(profiler: Profiler, topology: Topology) -> dict[str, Any]:
    """Every rank's phase profile (gathered to all ranks) and the timeline files."""
    mine = profiler.run_profile()
    files = profiler.close()
    ranks = all_gather_object(mine) if topology.is_distributed else [mine]
    timelines = all_gather_object(files) if topology.is_distributed else [files]
    return {"ranks": ranks, "timelines": [path for paths in timelines for path in paths],
            "phase_timers": profiler.enabled}
