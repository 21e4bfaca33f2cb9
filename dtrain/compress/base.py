"""What every compressor shares: the per-bucket facts it is given, the rounds of communication it asks for,
error feedback, and the count of bytes it puts on the wire.

A compressor turns one gradient bucket into one or more rounds of communication. `compress(tensor, bucket)`
returns the first `Round` (payload tensors, the collective that carries them, and a context); after the
collective, `decompress(received, ctx)` returns either the combined gradient (the sum over ranks divided
by `bucket.divisor`) or the next `Round` (PowerSGD needs two). Payloads of an `all_reduce` round are summed
by the collective; payloads of an `all_gather` round come back as one list per rank. The compressors never
call torch.distributed: `dtrain.sync.hooks` runs their rounds on the real process group, and
`dtrain.compress.local` runs them in one process for tests and references.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Collective = Literal["all_reduce", "all_gather"]


@dataclass(frozen=True)
class BucketInfo:
    """What a compressor may know about the bucket it compresses.

    `key` identifies the bucket across steps (DDP's bucket index); `spans` are (offset, shape) of each
    gradient inside the flat buffer, in the order DDP lists them; `positions` are each gradient's place in
    the model's forward order, 0 for the first layer and 1 for the last; `divisor` is what the sum over
    ranks is divided by (the world size for op `average`, 1 for `sum`); `is_last` marks the last bucket of
    a step, after which per-step counters advance.
    """

    key: int
    world_size: int
    rank: int
    divisor: int
    spans: tuple[tuple[int, torch.Size], ...] = ()
    positions: tuple[float, ...] = ()
    is_last: bool = True

    @classmethod
    def single(cls, tensor: torch.Tensor, *, key: int = 0, world_size: int = 1, rank: int = 0,
               divisor: int = 1, shapes: list[torch.Size] | None = None) -> BucketInfo:
        """A bucket holding `shapes` (default: the one flat tensor) packed one after the other."""
        spans, offset = [], 0
        for shape in shapes or [tensor.shape]:
            spans.append((offset, torch.Size(shape)))
            offset += int(torch.Size(shape).numel())
        assert offset == tensor.numel(), "the shapes must cover the tensor exactly"
        count = len(spans)
        positions = tuple(i / max(count - 1, 1) for i in range(count))
        return cls(key=key, world_size=world_size, rank=rank, divisor=divisor, spans=tuple(spans),
                   positions=positions)


@dataclass
class Round:
    """One collective a compressor asks for: `payloads` go on the wire, `ctx` comes back to decompress."""

    collective: Collective
    payloads: list[torch.Tensor]
    ctx: Any = None

    @property
    def payload_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.payloads)


def wire_bytes(collective: Collective, payload_bytes: int, world_size: int) -> float:
    """Bytes one rank transmits for a collective whose per-rank payload is `payload_bytes`: a ring
    all-reduce sends 2(n-1)/n of the payload (reduce-scatter, then all-gather), an all-gather (n-1) times it."""
    if world_size <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (world_size - 1) / world_size * payload_bytes
    return float((world_size - 1) * payload_bytes)


@dataclass
class WireStats:
    """Bytes a rank handed to collectives since the last `take()`, beside what dense fp32 all-reduces of the
    same buckets would have cost."""

    payload_bytes: int = 0
    wire_bytes: float = 0.0
    dense_payload_bytes: int = 0
    dense_wire_bytes: float = 0.0
    rounds: int = 0
    buckets: int = 0

    def record_round(self, round_: Round, world_size: int) -> None:
        self.payload_bytes += round_.payload_bytes
        self.wire_bytes += wire_bytes(round_.collective, round_.payload_bytes, world_size)
        self.rounds += 1

    def record_bucket(self, dense_bytes: int, world_size: int) -> None:
        self.dense_payload_bytes += dense_bytes
        self.dense_wire_bytes += wire_bytes("all_reduce", dense_bytes, world_size)
        self.buckets += 1

    def record_uncompressed(self, gradient_bytes: int, world_size: int) -> None:
        """Gradients all-reduced as they are, without a hook (DDP's own reducer)."""
        self.record_bucket(gradient_bytes, world_size)
        self.payload_bytes += gradient_bytes
        self.wire_bytes += wire_bytes("all_reduce", gradient_bytes, world_size)
        self.rounds += 1

    def take(self) -> WireStats:
        """Return the counts so far and start again from zero."""
        taken = WireStats(self.payload_bytes, self.wire_bytes, self.dense_payload_bytes, self.dense_wire_bytes,
                          self.rounds, self.buckets)
        self.payload_bytes, self.wire_bytes, self.dense_payload_bytes = 0, 0.0, 0
        self.dense_wire_bytes, self.rounds, self.buckets = 0.0, 0, 0
        return taken

    @property
    def compression_ratio(self) -> float:
        """Dense wire bytes over the bytes really sent (1.0 without compression)."""
        return self.dense_wire_bytes / self.wire_bytes if self.wire_bytes else float("nan")


@dataclass
class ErrorFeedback:
    """Residuals of what compression left out, one per bucket (Seide et al. 2014; Stich et al. 2018):
    a = g + e; send c(a); e = a - c(a). A bucket whose size changed (DDP rebuilds its buckets after the
    first step) starts again from zero."""

    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def add_residual(self, key: int, tensor: torch.Tensor) -> torch.Tensor:
        """g + e as a new tensor (the bucket is left untouched)."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != tensor.shape or residual.dtype != tensor.dtype:
            return tensor.clone()
        return tensor + residual

    def keep(self, key: int, accumulated: torch.Tensor, sent: torch.Tensor) -> None:
        self.residuals[key] = accumulated - sent

    def residual(self, key: int) -> torch.Tensor | None:
        return self.residuals.get(key)


class Compressor:
    """Base of every compressor: the wire count, the step counter and the (counter-only) checkpoint state.
    `compress` may use the bucket it is given as scratch space and `decompress` may write the result into it
    (the hook copies the result into the bucket anyway), so callers must not expect the input unchanged."""

    name = "base"

    def __init__(self) -> None:
        self.wire = WireStats()
        self.steps = 0  # communicating steps seen (advanced after the last bucket of each step)

    # ------------------------------------------------------------------------------------ protocol
    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        raise NotImplementedError

    def decompress(self, received: Any, ctx: Any) -> torch.Tensor | Round:
        raise NotImplementedError

    def end_bucket(self, bucket: BucketInfo) -> None:
        """Called by the hook once a bucket is done; counts steps."""
        if bucket.is_last:
            self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run keeps: the step count (warm-ups continue). Residuals are per rank and are not
        checkpointed (rank 0 writes checkpoints); error feedback starts again from zero after a resume."""
        return {"name": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") == self.name:
            self.steps = int(state.get("steps", 0))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def sum_over_ranks(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum in rank order, in the dtype of the first tensor."""
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total.add_(tensor)
    return total
