"""How much communication shows: gradient buckets become ready during backward and are reduced one
after another while backward goes on (DDP's reducer, Horovod's tensor fusion; Li et al., "PyTorch
Distributed", VLDB 2020, §3.2).

The pipeline is a two-stage flow shop: bucket i is ready at r_i, its collective starts when it is ready and
the previous one is done, and takes d_i. On CPU workers each collective also costs its host h_i <= d_i of
CPU time, which is taken from compute (so later buckets become ready later) and never hides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def bucket_sizes_bytes(gradient_bytes: float, bucket_bytes: float, first_bucket_bytes: float) -> list[float]:
    """Split a gradient into buckets in the order backward produces them: a small first bucket (DDP caps it
    at 1 MiB so the last layers' all-reduce starts early), then full buckets, then the remainder."""
    if gradient_bytes <= 0:
        return []
    sizes = [min(first_bucket_bytes, gradient_bytes)]
    left = gradient_bytes - sizes[0]
    while left > 1e-9:
        sizes.append(min(bucket_bytes, left))
        left -= sizes[-1]
    return sizes


def ddp_bucket_sizes_bytes(parameter_bytes_in_backward_order: Sequence[float], bucket_bytes: float,
                           first_bucket_bytes: float) -> list[float]:
    """DDP's assignment (torch `_compute_bucket_assignment_by_size`): parameters are added to the open
    bucket until it reaches its cap, so a bucket may exceed the cap by its last parameter."""
    sizes: list[float] = []
    open_bytes = 0.0
    cap = first_bucket_bytes
    for size in parameter_bytes_in_backward_order:
        open_bytes += size
        if open_bytes >= cap:
            sizes.append(open_bytes)
            open_bytes, cap = 0.0, bucket_bytes
    if open_bytes > 0:
        sizes.append(open_bytes)
    return sizes


def uniform_ready_times_s(bucket_sizes: Sequence[float], backward_s: float) -> list[float]:
    """Times (from the start of backward) at which each bucket's gradients are all computed, assuming
    backward produces gradient bytes at a constant rate."""
    total = sum(bucket_sizes)
    ready, done = [], 0.0
    for size in bucket_sizes:
        done += size
        ready.append(backward_s * done / total if total else backward_s)
    return ready


@dataclass(frozen=True)
class BucketCost:
    """One bucket's collective: wall time on the link (`link_s`) and the CPU time it costs its host (`host_s`)."""

    link_s: float
    host_s: float = 0.0

    @property
    def duration_s(self) -> float:
        """The collective takes as long as the slower of its two resources (they work in a pipeline)."""
        return max(self.link_s, self.host_s)


def exposed_after_backward_s(buckets: Sequence[BucketCost], ready_s: Sequence[float], backward_s: float,
                             overlap: bool) -> float:
    """Time a step waits for communication beyond its compute (forward + backward).

    Without overlap every collective runs after backward: the sum of their durations. With overlap:
    r_i = ready_i + (host time of earlier buckets), f_i = max(r_i, f_{i-1}) + d_i, and the step ends at
    max(backward + all host time, f_last)."""
    if not buckets:
        return 0.0
    if not overlap:
        return sum(b.duration_s for b in buckets)
    host_so_far, finish = 0.0, 0.0
    for bucket, ready in zip(buckets, ready_s, strict=True):
        start = max(ready + host_so_far, finish)
        finish = start + bucket.duration_s
        host_so_far += bucket.host_s
    return max(backward_s + host_so_far, finish) - backward_s


__all__ = ["BucketCost", "bucket_sizes_bytes", "ddp_bucket_sizes_bytes", "exposed_after_backward_s",
           "uniform_ready_times_s"]
