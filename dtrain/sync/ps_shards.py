"""Which parameter-server process holds which part of the model, balanced by bytes.

The parameters, in model order, form one byte stream that is cut into `servers` runs of equal length; a tensor
that straddles a cut is split into flat pieces. Element-wise optimizers (SGD, momentum, Adam, ...) give the same
result on pieces as on whole tensors. Layer-wise ones (LARS, LAMB: a trust ratio per tensor) need whole tensors:
then whole tensors go to the least-loaded server, largest first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened parameter `param` (its index in model order)."""

    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TensorSize:
    numel: int
    element_size: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def shard_by_bytes(tensors: list[TensorSize], servers: int, *, split_tensors: bool = True) -> list[list[Piece]]:
    """The pieces each server holds, in model order within a server."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if not split_tensors:
        return _whole_tensors(tensors, servers)
    total = sum(t.nbytes for t in tensors)
    cuts = [total * k / servers for k in range(1, servers)] + [float("inf")]
    shards: list[list[Piece]] = [[] for _ in range(servers)]
    server, offset = 0, 0  # offset: bytes of the stream before the current tensor
    for index, tensor in enumerate(tensors):
        start = 0
        while start < tensor.numel:
            # elements of this tensor that end at or before the current server's cut
            room = cuts[server] - offset
            fits = tensor.numel if room == float("inf") else round(room / tensor.element_size)
            stop = min(tensor.numel, max(start, fits))
            if stop > start:
                shards[server].append(Piece(index, start, stop))
            if stop < tensor.numel:
                server += 1
            start = stop
        offset += tensor.nbytes
        while server < servers - 1 and offset >= cuts[server]:
            server += 1
    return shards


def _whole_tensors(tensors: list[TensorSize], servers: int) -> list[list[Piece]]:
    loads = [0] * servers
    owner: dict[int, int] = {}
    for index in sorted(range(len(tensors)), key=lambda i: (-tensors[i].nbytes, i)):
        server = min(range(servers), key=lambda s: (loads[s], s))
        owner[index] = server
        loads[server] += tensors[index].nbytes
    return [[Piece(i, 0, tensors[i].numel) for i in range(len(tensors)) if owner[i] == s] for s in range(servers)]


def shard_bytes(shard: list[Piece], tensors: list[TensorSize]) -> int:
    return sum(piece.numel * tensors[piece.param].element_size for piece in shard)
