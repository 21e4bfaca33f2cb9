"""What every compressor shares: the per-bucket facts it is given, the rounds of communication it asks for,
what decompressing a round gives back, the state it carries between steps, and the ring model of the bytes
a collective puts on the wire.

A compressor turns one gradient bucket into one or more rounds of communication. `compress(tensor, bucket)`
returns the first `Round` (payload tensors, the collective that carries them, and a context); after the
collective, `decompress(received, ctx)` returns a `Decoded`: either done, with the combined gradient (the
sum over ranks divided by `bucket.divisor`), or the next `Round` to run (PowerSGD needs two). Payloads of an
`all_reduce` round are summed by the collective; payloads of an `all_gather` round come back as one list per
rank. Whatever a compressor keeps from one step to the next lives in its `state` (`CompressorState`). The
compressors never call torch.distributed and count no bytes: `dtrain.sync.hooks` runs their rounds on the real
process group and counts each one, and `dtrain.compress.local` does both in one process for tests and
references.
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
    """One collective a compressor asks for: `payloads` go on the wire, `ctx` comes back to decompress.
    `final` is False when decompressing this round will ask for another one (the hook then issues no other
    bucket's collective before that one, so that every rank issues them in the same order)."""

    collective: Collective
    payloads: list[torch.Tensor]
    ctx: Any = None
    final: bool = True

    @property
    def payload_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.payloads)


@dataclass
class Decoded:
    """What `decompress` returns: `Decoded.done(gradient)` once the bucket is combined, or
    `Decoded.then(round)` when another round of communication must run first."""

    gradient: torch.Tensor | None = None
    next_round: Round | None = None

    @classmethod
    def done(cls, gradient: torch.Tensor) -> Decoded:
        return cls(gradient=gradient)

    @classmethod
    def then(cls, next_round: Round) -> Decoded:
        return cls(next_round=next_round)


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
    same buckets would have cost. Filled by whoever issues the collectives (the comm hook, or the one-process
    runner), never by the compressors."""

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
class CompressorState:
    """All a compressor carries from one step to the next (as torch's comm-hook states do): the count of
    communicating steps (warm-ups, PowerSGD's start), the error-feedback residual of each bucket, and other
    per-bucket tensors under a name (`per_bucket`: PowerSGD's P and Q, bounded loss's chunk importance).

    Error feedback (Seide et al. 2014; Stich et al. 2018): a = g + e; send c(a); e = a - c(a). A bucket whose
    size changed (DDP rebuilds its buckets after the first step) starts again from zero. Only the step count
    is checkpointed: residuals and the per-bucket tensors are every rank's own and rank 0 writes checkpoints,
    so a resumed run starts them again from zero.
    """

    steps: int = 0  # communicating steps seen (advanced after the last bucket of each step)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    memory: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def add_residual(self, key: int, tensor: torch.Tensor) -> torch.Tensor:
        """g + e as a new tensor (the bucket is left untouched)."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != tensor.shape or residual.dtype != tensor.dtype:
            return tensor.clone()
        return tensor + residual

    def keep_residual(self, key: int, accumulated: torch.Tensor, sent: torch.Tensor) -> None:
        self.residuals[key] = accumulated - sent

    def per_bucket(self, name: str) -> dict[int, torch.Tensor]:
        """The tensors kept under `name`, by bucket key."""
        return self.memory.setdefault(name, {})

    def end_bucket(self, bucket: BucketInfo) -> None:
        """Called by whoever runs the rounds once a bucket is combined: counts steps."""
        if bucket.is_last:
            self.steps += 1

    def state_dict(self, owner: str) -> dict[str, Any]:
        """What a resumed run keeps: the step count (warm-ups continue), under the compressor's name."""
        return {"name": owner, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any], owner: str) -> None:
        """Take the step count of a checkpoint written by the same compressor (another one's is ignored)."""
        if state.get("name") == owner:
            self.steps = int(state.get("steps", 0))


class Compressor:
    """Base of every compressor: its name, its `state`, and the protocol. `compress` may use the bucket it is
    given as scratch space and `decompress` may write the result into it (the hook copies the result into
    the bucket anyway), so callers must not expect the input unchanged."""

    name = "base"

    def __init__(self) -> None:
        self.state = CompressorState()

    # ------------------------------------------------------------------------------------ protocol
    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        raise NotImplementedError

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict(self.name)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state, self.name)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def sum_over_ranks(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum in rank order, in the dtype of the first tensor."""
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total.add_(tensor)
    return total
