"""Rank 0's metric sinks: the SQLite run store and TensorBoard event files, written in batches."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from dtrain.runs.store import RunStore

log = logging.getLogger(__name__)


class MetricsWriter:
    """Buffers training rows and flushes them together; validation rows are written at once."""

    def __init__(self, *, store_path: Path | None, trial_id: int | None, tensorboard_dir: Path | None) -> None:
        self._store = RunStore(store_path) if store_path is not None and trial_id is not None else None
        self._trial_id = trial_id if trial_id is not None else -1
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))
        self._pending: list[tuple[int, float | None, float | None, Mapping[str, float]]] = []

    def training(self, step: int, epoch: float, wall_seconds: float, values: Mapping[str, float]) -> None:
        self._pending.append((step, epoch, wall_seconds, dict(values)))
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(f"train/{name}", value, step)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """TensorBoard-only scalars under their full tags (the per-rank phase profile)."""
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, step)

    def validation(self, step: int, epoch: float, wall_seconds: float, values: Mapping[str, float]) -> None:
        if self._store is not None:
            self._store.add_metrics(self._trial_id, "validation", [(step, epoch, wall_seconds, values)])
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(f"validation/{name}", value, step)
            self._tb.flush()

    def status(self, status: str, summary: Mapping[str, object] | None = None) -> None:
        if self._store is not None and self._trial_id is not None:
            self._store.set_status(self._trial_id, status, summary)

    def flush(self) -> None:
        if self._store is not None and self._pending:
            self._store.add_metrics(self._trial_id, "training", self._pending)
        self._pending = []
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self.flush()
        if self._tb is not None:
            self._tb.close()
        if self._store is not None:
            self._store.close()
