"""Fault injection for tests and benchmarks, driven by the config's `debug:` section.

Each injection point is a method the Trainer calls at a fixed place in a step, so that a fault happens
at the same step and on the same rank in every run (reproducible straggler, crash and hang scenarios).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from dtrain.config import Debug
from dtrain.errors import StallError


@dataclass
class FaultInjector:
    """Applies the faults `debug` asks for on this rank."""

    debug: Debug
    rank: int
    _last_compute_seconds: float | None = field(default=None, init=False)
    release: threading.Event = field(default_factory=threading.Event)  # set when the hang may end (run aborted)

    @property
    def slowed(self) -> bool:
        """True when this rank is the configured straggler."""
        return self.debug.slow_rank == self.rank and self.debug.slow_factor > 1.0

    def before_step(self, step: int) -> None:
        """Hang before batch `debug.hang_at_step` on `debug.hang_rank`, as a stuck data loader or device would,
        until `release` is set (the run gave up on this rank); then raise StallError."""
        if self.debug.hang_rank != self.rank or step != self.debug.hang_at_step:
            return
        while not self.release.wait(0.05):
            pass
        raise StallError(f"rank {self.rank} hung before batch {step} (debug.hang_rank) and was stopped because "
                         "the other ranks timed out waiting for it")

    def before_compute(self) -> float:
        """Sleep so that this rank's forward + backward take `slow_factor` times as long as they did in the
        previous step (a straggler's slower device); return the seconds slept. The first step is not slowed:
        there is no measurement yet."""
        if not self.slowed or self._last_compute_seconds is None:
            return 0.0
        delay = (self.debug.slow_factor - 1.0) * self._last_compute_seconds
        time.sleep(delay)
        return delay

    def after_compute(self, compute_seconds: float) -> None:
        """Record how long this step's own forward + backward took (without the injected delay)."""
        self._last_compute_seconds = compute_seconds
