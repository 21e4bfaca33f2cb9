"""Adaptive ASHA as Determined 0.38 defines it (stop-based): brackets of successive halving with different
numbers of rungs, trials split among them so each gets about the same budget, and in each rung a trial goes on
only if it ranks in the top 1/divisor of the trials that reached that rung so far.

Formulas (from Determined's master/pkg/searcher/adaptive_asha.go and asha_stopping.go, re-derived here):
- rungs available: min(max_rungs, 1 + floor(log_divisor(max_length)), 1 + floor(log_divisor(max_trials)));
  the floors are computed exactly in integers (Determined divides two float logarithms, which can land a hair
  below a whole number, e.g. log(64)/log(4)).
- brackets by mode, most early stopping first: aggressive [R]; standard [R, R-1, ..., floor((R-1)/2)+1];
  conservative [R, R-1, ..., 1] (or `bracket_rungs` as given).
- trials of a bracket with r rungs: weight divisor^(r-1)/r; max(floor(weight / total * max_trials), 1); the
  remainder goes to the first bracket.
- concurrent trials: max_concurrent_trials split evenly (at least one per bracket), the remainder to the first
  brackets; without it, max(trials of the last bracket, divisor) each.
- rung i of r needs max(floor(max_length / divisor^(r - i - 1)), 1) units.
- stop rule: with n results in the rung (the new one included), the trial continues when its rank (0 = best)
  is below max(floor(n / divisor), 1).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def floor_log(value: int, base: float) -> int:
    """The largest k with base**k <= value (value >= 1, base > 1), in exact arithmetic."""
    k, power = 0, base
    while power <= value:
        k += 1
        power *= base
    return k


def bracket_rungs(mode: str, max_rungs: int, max_length: int, max_trials: int, divisor: float,
                  given: list[int] | None = None) -> list[int]:
    """The rung count of each bracket, most rungs (most early stopping) first."""
    if given:
        return sorted(given, reverse=True)
    rungs = min(max_rungs, floor_log(max_length, divisor) + 1, floor_log(max_trials, divisor) + 1)
    if mode == "aggressive":
        brackets = [rungs]
    elif mode == "standard":
        brackets = list(range((rungs - 1) // 2 + 1, rungs + 1))
    elif mode == "conservative":
        brackets = list(range(1, rungs + 1))
    else:
        raise ValueError(f"unknown adaptive mode {mode!r}")
    return sorted(brackets, reverse=True)


def bracket_max_trials(max_trials: int, divisor: float, brackets: list[int]) -> list[int]:
    weights = [divisor ** (r - 1) / r for r in brackets]
    total = sum(weights)
    trials = [max(int(w / total * max_trials), 1) for w in weights]
    trials[0] += max(max_trials - sum(trials), 0)
    return trials


def bracket_max_concurrent(max_concurrent: int, divisor: float, trials: list[int]) -> list[int]:
    count = len(trials)
    if max_concurrent == 0:
        return [max(trials[-1], int(divisor))] * count
    max_concurrent = max(max_concurrent, count)
    share, remainder = divmod(max_concurrent, count)
    return [share + (1 if i < remainder else 0) for i in range(count)]


def rung_units(max_length: int, divisor: float, rungs: int) -> list[int]:
    return [max(int(max_length / divisor ** (rungs - i - 1)), 1) for i in range(rungs)]


@dataclass(frozen=True)
class Bracket:
    rungs: int
    max_trials: int
    max_concurrent_trials: int
    units: tuple[int, ...]  # training units a trial has reached at each rung

    def expected_trials_per_rung(self, divisor: float) -> list[int]:
        """How many trials reach each rung if every rung keeps exactly its top 1/divisor."""
        return [max(int(self.max_trials / divisor ** i), 1) for i in range(self.rungs)]


def plan(max_trials: int, max_length: int, divisor: float = 4, max_rungs: int = 5, mode: str = "standard",
         max_concurrent_trials: int = 0, given_rungs: list[int] | None = None) -> list[Bracket]:
    """Adaptive ASHA's brackets for a search of `max_trials` trials of at most `max_length` units."""
    brackets = bracket_rungs(mode, max_rungs, max_length, max_trials, divisor, given_rungs)
    trials = bracket_max_trials(max_trials, divisor, brackets)
    concurrent = bracket_max_concurrent(max_concurrent_trials, divisor, trials)
    return [Bracket(r, n, c, tuple(rung_units(max_length, divisor, r)))
            for r, n, c in zip(brackets, trials, concurrent, strict=True)]


@dataclass
class Rung:
    """The results one rung has seen, best first (metrics are negated when larger is better)."""

    metrics: list[float] = field(default_factory=list)

    def continue_training(self, metric: float, divisor: float, smaller_is_better: bool = True) -> bool:
        """Record a trial's result at this rung; whether it goes on to the next rung."""
        value = metric if smaller_is_better else -metric
        promote = max(int((len(self.metrics) + 1) / divisor), 1)
        index = bisect.bisect_left(self.metrics, value)
        self.metrics.insert(index, value)
        return index < promote
