"""DDP communication hooks: how one ready gradient bucket is combined across ranks (sum, average or Adasum),
with a slot for a compressor between the bucket and the wire.

DDP's C++ reducer keeps doing what it is good at (bucketing in reverse layer order, launching a bucket's
communication while the rest of the backward pass runs); the hook only decides what happens to a bucket.
A compressor is anything with `compress(tensor) -> (payload, ctx)` and `decompress(payload, ctx) -> tensor`
whose payloads can be summed by an all-reduce (fp16, bf16, PowerSGD factors); compressors that need
another collective (top-k's all-gather) will bring their own reduction.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at registration as real objects.
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from dtrain.comm.adasum import adasum_all_reduce_

Op = Literal["average", "sum", "adasum"]


class Compressor(Protocol):
    """Turns a gradient bucket into what is sent, and back."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class NoCompression:
    """Sends the bucket as it is."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        del ctx
        return payload


@dataclass
class HookState:
    """What the hook needs on every call: the op, the group and the compressor (stateful ones keep their
    residuals on themselves, so a compressor's state is the strategy's to checkpoint)."""

    op: Op
    group: dist.ProcessGroup | None = None
    compressor: Compressor = field(default_factory=NoCompression)
    buckets_reduced: int = 0

    def __post_init__(self) -> None:
        if self.op == "adasum" and not isinstance(self.compressor, NoCompression):
            raise ValueError("Adasum combines full-precision gradients; it cannot be used with a compressor")

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)


def bucket_tensor_lengths(bucket: dist.GradBucket) -> list[int]:
    """Element counts of the gradients a bucket's flat buffer holds, in buffer order (no padding between)."""
    buffer = bucket.buffer()
    spans = sorted((grad.storage_offset() - buffer.storage_offset(), grad.numel()) for grad in bucket.gradients())
    position = 0
    for offset, length in spans:
        if offset != position:
            raise RuntimeError(f"gradient bucket {bucket.index()} is not densely packed at element {position}; "
                               "Adasum needs each gradient's place in the bucket")
        position += length
    if position != buffer.numel():
        raise RuntimeError(f"gradient bucket {bucket.index()} holds {buffer.numel()} elements but its gradients "
                           f"only {position}")
    return [length for _, length in spans]


def combine_bucket(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook registered on DDP: reduce one bucket with `state.op` and return its future."""
    state.buckets_reduced += 1
    buffer = bucket.buffer()
    if state.op == "adasum":
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        try:
            done.set_result(adasum_all_reduce_(buffer, bucket_tensor_lengths(bucket), state.group))
        except Exception as exc:  # surfaces in backward() on this rank instead of dying in the reducer
            done.set_exception(exc)  # type: ignore[arg-type]
        return done
    payload, ctx = state.compressor.compress(buffer)
    divisor = state.world_size if state.op == "average" else 1
    work = dist.all_reduce(payload, group=state.group, async_op=True)
    assert work is not None

    def finish(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = state.compressor.decompress(future.value()[0], ctx)
        if divisor != 1:
            reduced.div_(divisor)
        if reduced.data_ptr() != buffer.data_ptr():
            buffer.copy_(reduced)
        return buffer

    return work.get_future().then(finish)


class BucketObserver(Protocol):
    """Told when a gradient bucket is ready for communication and when its collective finished (the profiler's
    bucket clock): `bucket_ready` returns a slot that `bucket_done` gets back."""

    def bucket_ready(self, index: int) -> int: ...

    def bucket_done(self, slot: int) -> None: ...


@dataclass
class ObservedHookState:
    """A hook state plus the observer that times each bucket's communication."""

    inner: HookState
    observer: BucketObserver


def observed_combine_bucket(state: ObservedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """`combine_bucket`, with the bucket's ready and done times reported to the observer."""
    slot = state.observer.bucket_ready(bucket.index())
    future = combine_bucket(state.inner, bucket)

    def done(finished: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.observer.bucket_done(slot)
        return finished.value()

    return future.then(done)
