"""Rank 0's metric sinks: the SQLite run store and TensorBoard event files, written on a thread of their own (and,
with `tracking.mlflow`, an MLflow run, fed through its own thread: dtrain.train.tracking).

A commit to the store ends with an fsync of its write-ahead log, which on a busy disk takes from milliseconds to
seconds, and TensorBoard serializes an event per scalar. On the training thread both stalled rank 0 at every
report while the other ranks waited for it at the next all-reduce (measured on the shared 2-core build machine:
0.6-3 s per report of 100 updates, a quarter of the demo's gap to a hand-written DDP loop; issue 22). Here the
training thread only queues rows; one writer thread owns the store's connection and the TensorBoard writer and
applies the queued writes in order. Every write is committed as before (nothing is synced less): `status()`
and `close()` return once everything queued before them is on disk, a process that exits without `close()`
(a failed run) still drains the queue at exit, and a write that failed raises on the training thread at the
next call.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dtrain.runs.store import RunStore
from dtrain.train.tracking import RunTracker

log = logging.getLogger(__name__)

Row = tuple[int, float | None, float | None, Mapping[str, float]]


class MetricsWriter:
    """Buffers training rows and hands them to the writer thread together at each `flush()`; validation rows and
    status changes are handed over at once."""

    def __init__(self, *, store_path: Path | None, trial_id: int | None, tensorboard_dir: Path | None,
                 tracker: RunTracker | None = None) -> None:
        """`tracker` (rank 0's MLflow run, or None) gets the same training and validation rows, the checkpoints'
        locations and the end status; it is closed with the writer."""
        self._trial_id = trial_id if trial_id is not None else -1
        self._tracker = tracker
        self._store: RunStore | None = None
        self._tb: Any = None
        self._pending: list[Row] = []
        self._pending_scalars: list[tuple[int, dict[str, float]]] = []
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        wants_store = store_path is not None and trial_id is not None
        if not wants_store and tensorboard_dir is None and tracker is None:
            return  # not rank 0: nothing to write, no thread

        def open_sinks() -> None:  # on the writer thread: a SQLite connection belongs to the thread that made it
            if wants_store and store_path is not None:
                self._store = RunStore(store_path)
            if tensorboard_dir is not None:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

        self._thread = threading.Thread(target=self._work, name="dtrain-metrics-writer", daemon=True)
        self._thread.start()
        atexit.register(self._drain_at_exit)
        self._submit(open_sinks)
        self._wait()  # a store that cannot be opened fails here, as it did before

    # ------------------------------------------------------------------------- the training thread's side

    def training(self, step: int, epoch: float, wall_seconds: float, values: Mapping[str, float]) -> None:
        """A training row (store: `training/<name>`, TensorBoard: `train/<name>`), written at the next flush."""
        if self._thread is not None:
            self._pending.append((step, epoch, wall_seconds, dict(values)))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """TensorBoard-only scalars under their full tags (the per-rank phase profile), written at the next flush."""
        if self._thread is not None and values:
            self._pending_scalars.append((step, dict(values)))

    def validation(self, step: int, epoch: float, wall_seconds: float, values: Mapping[str, float]) -> None:
        row: Row = (step, epoch, wall_seconds, dict(values))
        if self._tracker is not None:
            self._tracker.metrics("validation", [row])

        def write() -> None:
            if self._store is not None:
                self._store.add_metrics(self._trial_id, "validation", [row])
            if self._tb is not None:
                for name, value in row[3].items():
                    self._tb.add_scalar(f"validation/{name}", value, step)
                self._tb.flush()

        self._submit(write)

    def checkpoint(self, step: int, location: str) -> None:
        """A checkpoint was written at `location` (a path or URL): the tracker records it (the store has the newest
        in the summary)."""
        if self._tracker is not None:
            self._tracker.checkpoint(step, location)

    def status(self, status: str, summary: Mapping[str, object] | None = None) -> None:
        """Record the run's status (and summary); returns once it and everything before it is written (the store
        and TensorBoard; the tracker sends it on its own thread)."""
        if self._tracker is not None:
            self._tracker.end(status)

        def write() -> None:
            if self._store is not None:
                self._store.set_status(self._trial_id, status, summary)

        self._submit(write)
        self._wait()

    def flush(self) -> None:
        """Hand the buffered training rows and scalars to the writer thread (one store transaction)."""
        rows, scalars = self._pending, self._pending_scalars
        self._pending, self._pending_scalars = [], []
        if not rows and not scalars:
            return
        if self._tracker is not None:
            self._tracker.metrics("train", rows)

        def write() -> None:
            if self._store is not None and rows:
                self._store.add_metrics(self._trial_id, "training", rows)
            if self._tb is not None:
                for step, _, _, values in rows:
                    for name, value in values.items():
                        self._tb.add_scalar(f"train/{name}", value, step)
                for step, tagged in scalars:
                    for tag, value in tagged.items():
                        self._tb.add_scalar(tag, value, step)
                self._tb.flush()

        self._submit(write)

    def close(self) -> None:
        """Write everything, close the sinks and end the writer thread."""
        if self._thread is None:
            return
        self.flush()
        self._submit(self._close_sinks)
        self._stop()
        atexit.unregister(self._drain_at_exit)
        if self._tracker is not None:
            self._tracker.close()
        self._raise_error()

    # ------------------------------------------------------------------------------ the writer thread

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:  # after a failure, later writes are dropped (the error is raised)
                    job()
            except BaseException as exc:  # raised on the training thread at its next call
                self._error = exc
            finally:
                self._jobs.task_done()

    def _close_sinks(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._store is not None:
            self._store.close()

    def _submit(self, job: Callable[[], None]) -> None:
        self._raise_error()
        if self._thread is not None:
            self._jobs.put(job)

    def _wait(self) -> None:
        self._jobs.join()
        self._raise_error()

    def _stop(self) -> None:
        self._jobs.put(None)
        assert self._thread is not None
        self._thread.join()
        self._thread = None

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _drain_at_exit(self) -> None:
        """A run that ended without close() (it failed): write what was queued, then close the sinks."""
        if self._thread is None:
            return
        try:
            self.flush()
            self._submit(self._close_sinks)
        except Exception as exc:  # an earlier write failed and nobody called again to see it
            log.warning("metrics not written: %s", exc)
        self._stop()
        if self._tracker is not None:
            self._tracker.end("failed")
            self._tracker.close()
        if self._error is not None:
            log.warning("metrics not written at exit: %s", self._error)
