"""DDP communication hooks: how one ready gradient bucket is combined across ranks (sum, average or Adasum),
with a compressor between the bucket and the wire.

DDP's C++ reducer keeps doing what it is good at (bucketing in reverse layer order, launching a bucket's
communication while the rest of the backward pass runs); the hook only decides what happens to a bucket.
A compressor (`dtrain.compress`) turns the bucket into rounds of communication: the hook runs each round's
collective - an all-reduce when payloads can be summed (fp16, bf16, PowerSGD's factors, bounded loss), an
all-gather when they cannot (top-k's values and indices, sign bits and scales, QSGD's levels and norms) -
and hands what came back to the compressor, until it says it is done and gives the combined gradient. The
hook counts the bytes of every collective where it issues it, in the `WireStats` the strategy gave it.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at registration as real objects.
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtrain.comm.adasum import adasum_all_reduce_
from dtrain.compress import BucketInfo, Compressor, NoCompression, Round, WireStats
from dtrain.config import ReduceOp as Op


@dataclass
class HookState:
    """What the hook needs on every call: the op, the group, the compressor (which carries its own state),
    each parameter's place in the forward order (for priorities) and the meter its bytes go to."""

    op: Op
    group: dist.ProcessGroup | None = None
    compressor: Compressor = field(default_factory=NoCompression)
    parameter_positions: dict[int, float] = field(default_factory=dict)  # id(parameter) -> 0 (first) .. 1 (last)
    wire: WireStats = field(default_factory=WireStats)
    unfinished: torch.futures.Future[torch.Tensor] | None = None  # a bucket with rounds still to issue

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


def bucket_info(state: HookState, bucket: dist.GradBucket) -> BucketInfo:
    """The facts a compressor gets about `bucket`: its gradients' places and shapes, in DDP's order."""
    buffer = bucket.buffer()
    spans = tuple((int(grad.storage_offset() - buffer.storage_offset()), grad.shape) for grad in bucket.gradients())
    positions = tuple(state.parameter_positions.get(id(p), 0.0) for p in bucket.parameters())
    world = state.world_size
    return BucketInfo(key=bucket.index(), world_size=world, rank=dist.get_rank(state.group),
                      divisor=world if state.op == "average" else 1, spans=spans, positions=positions,
                      is_last=bucket.is_last())


def _pack(payloads: list[torch.Tensor]) -> torch.Tensor:
    """Payloads of any dtypes as one byte tensor, so that one all-gather carries them all."""
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in payloads])


def _unpack(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    parts, position = [], 0
    for template in like:
        size = template.numel() * template.element_size()
        parts.append(packed[position : position + size].clone().view(template.dtype).view(template.shape))
        position += size
    return parts


def values_or_raise(collected: torch.futures.Future[list[torch.futures.Future[Any]]]) -> list[Any]:
    """The values of the futures `collect_all` gathered, raising the first error among them: its own future
    succeeds even when one of them failed (a timed-out or broken collective), and an unreduced gradient must
    not pass for a reduced one."""
    return [future.value() for future in collected.value()]


def run_round(round_: Round, group: dist.ProcessGroup | None, wire: WireStats) -> torch.futures.Future[Any]:
    """Start the collective of one round and count its bytes in `wire`; the future's value is what the
    compressor's decompress takes: the summed payloads (all-reduce, in place) or, per rank, the list of its
    payloads (all-gather)."""
    world = dist.get_world_size(group)
    wire.record_round(round_, world)
    payloads = round_.payloads
    if round_.collective == "all_reduce":
        works = [dist.all_reduce(p, group=group, async_op=True) for p in payloads if p.numel()]
        futures = [work.get_future() for work in works if work is not None]

        def reduced(collected: torch.futures.Future[list[torch.futures.Future[Any]]]) -> list[torch.Tensor]:
            values_or_raise(collected)
            return payloads

        return torch.futures.collect_all(futures).then(reduced)
    packed = _pack(payloads)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    work = dist.all_gather(gathered, packed, group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda _: [_unpack(part, payloads) for part in gathered])


def wait_for_unfinished_bucket(state: HookState) -> None:
    """Every rank must issue its collectives in the same order. A bucket's further rounds are issued from a
    callback, at a moment that differs between ranks, so the next bucket's collectives wait until they are
    done. A failure there reaches backward() through that bucket's own future."""
    unfinished, state.unfinished = state.unfinished, None
    if unfinished is not None:
        with suppress(Exception):
            unfinished.wait()


def combine_bucket(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook registered on DDP: reduce one bucket with `state.op` and return its future."""
    buffer = bucket.buffer()
    if state.op == "adasum":
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        try:
            done.set_result(adasum_all_reduce_(buffer, bucket_tensor_lengths(bucket), state.group))
        except Exception as exc:  # surfaces in backward() on this rank instead of dying in the reducer
            # torch's stub types set_exception's argument as the future's result type; it takes an exception
            done.set_exception(exc)  # type: ignore[arg-type]
        return done
    compressor, info = state.compressor, bucket_info(state, bucket)
    wait_for_unfinished_bucket(state)
    state.wire.record_bucket(buffer.numel() * buffer.element_size(), info.world_size)
    first = compressor.compress(buffer, info)

    def finish(future: torch.futures.Future[Any]) -> torch.Tensor:
        decoded = compressor.decompress(future.value(), first.ctx)
        while (further := decoded.next_round) is not None:  # PowerSGD's Q: run it here, in the callback
            decoded = compressor.decompress(run_round(further, state.group, state.wire).wait(), further.ctx)
        compressor.state.end_bucket(info)
        result = decoded.gradient
        assert result is not None, "a compressor that asks for no further round gives the gradient"
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result.view_as(buffer))
        return buffer

    combined = run_round(first, state.group, state.wire).then(finish)
    if not first.final:
        state.unfinished = combined
    return combined


class BucketObserver(Protocol):
    """The profiler's bucket clock: told when a gradient is ready (`gradient_ready`, from a parameter hook), or
    when a gradient bucket is ready for communication and when its collective finished (from the comm hook):
    `bucket_ready` returns a slot that `bucket_done` gets back."""

    def gradient_ready(self) -> None: ...

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
