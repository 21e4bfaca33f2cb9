"""The Trainer's counters and history (what a checkpoint carries so that a resumed run continues the same curve),
and the clock they are kept by."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """Counters and history that a checkpoint carries so that a resumed run continues the same curve."""

    steps_completed: int = 0
    samples_trained: int = 0
    wall_seconds: float = 0.0  # training time up to the last checkpoint, across restarts
    training_seconds: float = 0.0  # the part of it spent in training steps (no validation or checkpoints)
    validation_history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_metrics: dict[int, float] = field(default_factory=dict)  # step -> searcher metric
    resumes: int = 0  # times training continued from a checkpoint (after a crash or a stop)
    communicating_steps: int = 0  # optimizer updates whose gradients crossed the wire
    wire_bytes: float = 0.0  # bytes this rank sent for them (chief's count)
    payload_bytes: float = 0.0  # bytes it handed to collectives (compressed payloads)
    dense_wire_bytes: float = 0.0  # what dense fp32 all-reduces would have sent
    nan_steps_skipped: int = 0  # updates skipped for a non-finite gradient (nan_policy skip)
    batch_split: list[int] | None = None  # per-rank batches a re-balance chose (distributed.heterogeneous: auto)

    def to_dict(self) -> dict[str, Any]:
        return {"steps_completed": self.steps_completed, "samples_trained": self.samples_trained,
                "wall_seconds": self.wall_seconds, "training_seconds": self.training_seconds,
                "validation_history": self.validation_history,
                "checkpoint_metrics": {str(k): v for k, v in self.checkpoint_metrics.items()},
                "resumes": self.resumes, "communicating_steps": self.communicating_steps,
                "wire_bytes": self.wire_bytes, "payload_bytes": self.payload_bytes,
                "dense_wire_bytes": self.dense_wire_bytes, "nan_steps_skipped": self.nan_steps_skipped,
                "batch_split": self.batch_split}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrainerState:
        return cls(steps_completed=int(raw["steps_completed"]), samples_trained=int(raw["samples_trained"]),
                   wall_seconds=float(raw["wall_seconds"]), training_seconds=float(raw["training_seconds"]),
                   validation_history=list(raw["validation_history"]),
                   checkpoint_metrics={int(k): float(v) for k, v in raw["checkpoint_metrics"].items()},
                   resumes=int(raw.get("resumes", 0)), communicating_steps=int(raw.get("communicating_steps", 0)),
                   wire_bytes=float(raw.get("wire_bytes", 0.0)), payload_bytes=float(raw.get("payload_bytes", 0.0)),
                   dense_wire_bytes=float(raw.get("dense_wire_bytes", 0.0)),
                   nan_steps_skipped=int(raw.get("nan_steps_skipped", 0)),
                   batch_split=[int(size) for size in raw["batch_split"]] if raw.get("batch_split") else None)


class TrainingClock:
    """Wall time since training first started and the part of it spent in training steps, carried across
    restarts by the state's counters (validation and checkpoints are not training time)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()  # when training began, shifted back by the wall time before a resume
        self.training_seconds = 0.0

    def start(self, state: TrainerState) -> None:
        """Training (re)starts now, after `state.wall_seconds` of earlier attempts."""
        self.started = time.perf_counter() - state.wall_seconds
        self.training_seconds = state.training_seconds

    def wall(self) -> float:
        return time.perf_counter() - self.started

    def save(self, state: TrainerState) -> None:
        """Write both times into `state` (before a checkpoint, and at the end)."""
        state.wall_seconds = self.wall()
        state.training_seconds = self.training_seconds
