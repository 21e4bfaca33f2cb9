"""A rank that stops answering: heartbeats through the workers' store while training runs (distributed runs
only), and a collective that timed out turned into one StallError naming the ranks that did not arrive."""

from __future__ import annotations

import threading

from dtrain.comm import Topology
from dtrain.comm.failures import Failure, classify_failure
from dtrain.comm.stall import StallMonitor, default_store, set_collective_timeout, store_attempt
from dtrain.config import Distributed
from dtrain.errors import StallError
from dtrain.profile.timers import StepTimer


class StallWatch:
    """The stall monitor of this rank (None with one process); `abort` is set when another rank gave up."""

    def __init__(self, topology: Topology, settings: Distributed, timer: StepTimer) -> None:
        self.settings = settings
        store = default_store() if topology.is_distributed else None

        def activity() -> tuple[int, str, tuple[int, int], float]:
            now = timer.activity
            return now.step, now.phase, now.position, now.since

        self.monitor = None if store is None else StallMonitor(
            store=store, rank=topology.rank, world_size=topology.world_size, activity=activity,
            warn_after=settings.stall_warning_seconds, attempt=store_attempt(topology.restart_count))
        self.abort = self.monitor.abort if self.monitor is not None else threading.Event()

    def start(self) -> None:
        """Heartbeats from now on; collectives time out after `distributed.timeout_seconds`, however the process
        group was created."""
        if self.monitor is not None:
            set_collective_timeout(self.settings.timeout_seconds)
            self.monitor.start()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def failure(self, exc: RuntimeError) -> Exception:
        """A collective that timed out as one StallError naming the ranks that did not arrive and what they were
        doing; other errors (a peer that died is the worker's to report) pass through unchanged."""
        if self.monitor is None or isinstance(exc, StallError) or classify_failure(exc) is not Failure.TIMEOUT:
            return exc
        return self.monitor.timeout_error(exc, self.settings.timeout_seconds)
