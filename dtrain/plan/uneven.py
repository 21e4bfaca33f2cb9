"""The plan model of uneven clusters (pure arithmetic, no torch): workers of different speed with an even or a
speed-proportional split of the global batch (`distributed.heterogeneous`), and local SGD, whose replicas meet
every H updates (`distributed.strategy: local_sgd`). The two-level all-reduce is `hierarchical` in
`dtrain.plan.collectives` / `dtrain.plan.step`.

A synchronous step lasts as long as its slowest rank: max_i(b_i / v_i) for batches b_i and speeds v_i (records
per second). An even split of B gives B/n / min(v); the proportional split b_i = B v_i / sum(v) gives B / sum(v),
so the gain is sum(v) / (n min(v)): 1.5 for two workers of which one runs at half speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


def proportional_batches(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """b_i proportional to v_i, summing to the global batch (largest remainders; at least one record each)."""
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"speeds must be positive, got {list(speeds)}")
    total = sum(speeds)
    exact = [max(v / total * global_batch, 1.0) for v in speeds]
    sizes = [max(int(x), 1) for x in exact]
    for i in sorted(range(len(speeds)), key=lambda i: exact[i] - sizes[i], reverse=True):
        if sum(sizes) >= global_batch:
            break
        sizes[i] += 1
    return sizes


def split_compute_seconds(batches: Sequence[int], speeds: Sequence[float]) -> float:
    """Compute time of one synchronous step: the slowest rank's b_i / v_i."""
    return max(b / v for b, v in zip(batches, speeds, strict=True))


@dataclass(frozen=True)
class UnevenPrediction:
    """Even against proportional split for workers of the given speeds (records per second)."""

    speeds: tuple[float, ...]
    even_batches: tuple[int, ...]
    proportional_batches: tuple[int, ...]
    even_compute_s: float
    proportional_compute_s: float

    @property
    def gain(self) -> float:
        return self.even_compute_s / self.proportional_compute_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gain": self.gain}


def predict_uneven(global_batch: int, speeds: Sequence[float]) -> UnevenPrediction:
    n = len(speeds)
    even = [global_batch // n] * n
    proportional = proportional_batches(global_batch, speeds)
    return UnevenPrediction(tuple(speeds), tuple(even), tuple(proportional), split_compute_seconds(even, speeds),
                            split_compute_seconds(proportional, speeds))


def local_sgd_step_seconds(compute_s: float, allreduce_s: float, period: int) -> float:
    """Mean step time of local SGD averaging every `period` updates (the averaging does not overlap compute)."""
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    return compute_s + allreduce_s / period


def local_sgd_speedup(compute_s: float, exposed_s: float, allreduce_s: float, period: int) -> float:
    """Synchronous step (compute + exposed communication) over local SGD's mean step."""
    return (compute_s + exposed_s) / local_sgd_step_seconds(compute_s, allreduce_s, period)


def format_uneven(prediction: UnevenPrediction) -> str:
    even = "/".join(map(str, prediction.even_batches))
    proportional = "/".join(map(str, prediction.proportional_batches))
    return (f"  uneven workers (speeds {', '.join(f'{v:g}' for v in prediction.speeds)}): even split {even} computes "
            f"{prediction.even_compute_s * 1000:.1f} ms per step, proportional {proportional} "
            f"{prediction.proportional_compute_s * 1000:.1f} ms: {prediction.gain:.2f}x "
            "(distributed.heterogeneous: {split: auto})")


def format_local_sgd(compute_s: float, exposed_s: float, allreduce_s: float, period: int) -> str:
    step = local_sgd_step_seconds(compute_s, allreduce_s, period)
    return (f"  local SGD every {period} updates: {step * 1000:.1f} ms per step (communication "
            f"{allreduce_s / period * 1000:.1f} ms per step instead of {exposed_s * 1000:.1f} ms exposed), "
            f"{local_sgd_speedup(compute_s, exposed_s, allreduce_s, period):.2f}x synchronous")


__all__ = ["UnevenPrediction", "format_local_sgd", "format_uneven", "local_sgd_speedup", "local_sgd_step_seconds",
           "predict_uneven", "proportional_batches", "split_compute_seconds"]
