"""Adaptive elimination ("shrinking"): which active samples a rank removes, by the paper's range of heuristics.

A sample that can only enter the working pair from one side (alpha at a bound) cannot form a violating pair
while its f lies on the wrong side of the other side's extreme: a sample only in I_low with f < b_up, or only in
I_up with f > b_low. Such a sample is *eliminable*. The heuristics differ in how soon one is eliminated:

- `none`: never;
- `earliest`: at the first check that finds it eliminable;
- `lazy`: once it has been eliminable at `patience` consecutive checks, and only once the gap b_low - b_up has
  fallen below `gap` (when set), i.e. late in the solve when the extremes move little.

`margin` widens the test (f < b_up + margin): a positive margin is aggressive and eliminates samples that
may still become violators — the false positives the recheck at convergence must catch (tests use it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtrain.errors import ConfigError

HEURISTICS = ("none", "earliest", "lazy")


@dataclass(frozen=True)
class EliminationPolicy:
    """When and how eagerly samples leave the active set."""

    heuristic: str = "lazy"
    every: int = 1000  # iterations between checks
    patience: int = 2  # lazy: consecutive eliminable checks before a sample is removed
    gap: float | None = None  # lazy: eliminate only once b_low - b_up is below this
    margin: float = 0.0  # > 0: aggressive (may eliminate future violators)

    def __post_init__(self) -> None:
        if self.heuristic not in HEURISTICS:
            raise ConfigError(f"shrinking {self.heuristic!r} is not one of {', '.join(HEURISTICS)}; use e.g. "
                              "shrinking: lazy")
        if self.every < 1 or self.patience < 1:
            raise ConfigError(f"shrink_every ({self.every}) and shrink_patience ({self.patience}) must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.heuristic != "none"

    def due(self, before: int, after: int) -> bool:
        """Whether a check falls due as the iteration count goes from `before` to `after`."""
        return self.enabled and after // self.every > before // self.every

    def select(self, f: np.ndarray, pen_up: np.ndarray, pen_low: np.ndarray, b_up: float, b_low: float,
               streak: np.ndarray) -> np.ndarray:
        """A boolean mask of the active samples to eliminate now; updates `streak` (consecutive eliminable checks).

        `pen_up`/`pen_low` are 0 where a sample is in I_up/I_low and +inf/-inf where it is not.
        """
        up = pen_up == 0.0
        low = pen_low == 0.0
        eliminable = (low & ~up & (f < b_up + self.margin)) | (up & ~low & (f > b_low - self.margin))
        if self.heuristic == "earliest":
            return eliminable
        streak[:] = np.where(eliminable, streak + 1, 0)
        if self.gap is not None and b_low - b_up > self.gap:
            return np.zeros_like(eliminable)
        return streak >= self.patience
