"""Background checkpoint uploads: training hands a checkpoint over as a snapshot in host memory (cheap: a copy of
its tensors) and goes on while one thread writes it to object storage, `meta.json` last. At most one upload is in
flight: a new checkpoint waits for the previous one to be committed before it is handed over, so no checkpoint is
ever skipped and the order of commits is the order of steps. A kill during an upload loses that checkpoint only
(its folder has no `meta.json`, so a resume never takes it and deletes it); the previous one is complete.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dtrain.errors import CheckpointError
from dtrain.runs.storage import explain_storage_error

log = logging.getLogger(__name__)

UPLOAD_THREAD = "dtrain-checkpoint-upload"
UPLOAD_NICENESS = 19  # the upload's threads' nice value (Linux): training's threads are served first


def lower_upload_priority() -> None:
    """Give this thread, and fsspec's I/O thread that runs the transfers it asks for, the lowest CPU priority (Linux,
    where each thread has a nice value of its own): on cores that training shares, the upload takes what training
    leaves instead of half of it. Raising a nice value needs no privilege; nothing changes elsewhere."""
    if sys.platform != "linux":
        return
    threads = [threading.get_native_id()]
    try:
        import fsspec.asyn

        fsspec.asyn.get_loop()  # starts fsspec's I/O thread if it is not running yet
        io_thread = fsspec.asyn.iothread[0]
        if io_thread is not None and io_thread.native_id is not None:
            threads.append(io_thread.native_id)
    except ImportError:
        pass
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, max(os.getpriority(os.PRIO_PROCESS, thread), UPLOAD_NICENESS))
        except OSError:  # the thread ended meanwhile, or a policy forbids it: the upload runs at normal priority
            pass


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def host_snapshot(value: Any) -> Any:
    """A copy of a checkpoint's state that training can no longer change: tensors copied to host memory (device
    tensors to CPU), containers and plain values copied, as `copy.deepcopy` does (so tensors that share storage
    still share it, and `torch.save` writes the same bytes as it would of the original on CPU)."""
    memo: dict[int, Any] = {}
    for tensor in _tensors(value):
        if tensor.device.type != "cpu" and id(tensor) not in memo:
            memo[id(tensor)] = tensor.detach().to("cpu", copy=True)
    return copy.deepcopy(value, memo)


class BackgroundUploads:
    """Runs one checkpoint upload at a time on a thread of its own (rank 0). `submit` waits for the upload in
    flight, then starts the next; `wait` returns once nothing is in flight; an upload's error is raised, as a
    `CheckpointError`, by the next `submit`, `wait` or `take_committed` on the training thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._committed: list[Any] = []
        self._error: CheckpointError | None = None
        self.waited_seconds = 0.0  # training time spent waiting for an upload in flight (submit and wait)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, what: str, upload: Callable[[], Any]) -> None:
        """Start `upload` (which returns what `take_committed` hands back once it is done) after the one in flight;
        `what` names the checkpoint and its destination in an error."""
        self.wait()
        thread = threading.Thread(target=self._run, args=(what, upload), name=UPLOAD_THREAD, daemon=True)
        self._thread = thread
        thread.start()

    def _run(self, what: str, upload: Callable[[], Any]) -> None:
        try:
            lower_upload_priority()
            done = upload()
        except Exception as exc:  # fsspec, botocore and torch raise many kinds; each means "not uploaded"
            with self._lock:
                self._error = CheckpointError(f"the upload of checkpoint {what} failed: {explain_storage_error(exc)}; "
                                              "training stopped so that no checkpoint goes missing unnoticed")
            return
        with self._lock:
            self._committed.append(done)

    def wait(self) -> None:
        """Until the upload in flight (if any) is committed; raises its error."""
        thread = self._thread
        if thread is not None:
            started = time.perf_counter()
            thread.join()
            self.waited_seconds += time.perf_counter() - started
            self._thread = None
        self._raise()

    def take_committed(self) -> list[Any]:
        """What the uploads committed since the last call, oldest first (raises an upload's error)."""
        self._raise()
        with self._lock:
            done, self._committed = self._committed, []
        return done

    def _raise(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error
