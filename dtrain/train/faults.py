"""Fault injection for tests and benchmarks, driven by the config's `debug:` section.

Each injection point is a method the Trainer calls at a fixed place in a step, so that a fault happens
at the same step and on the same rank in every run (reproducible straggler, crash and hang scenarios).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dtrain.config import Debug


@dataclass
class FaultInjector:
    """Applies the faults `debug` asks for on this rank."""

    debug: Debug
    rank: int
    _last_compute_seconds: float | None = field(default=None, init=False)

    @property
    def slowed(self) -> bool:
        """True when this rank is the configured straggler."""
        return self.debug.slow_rank == self.rank and self.debug.slow_factor > 1.0

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
