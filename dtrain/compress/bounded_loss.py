"""Bounded loss, after DLCP (Wang et al., "Domain-specific Communication Optimization for Distributed DNN
Training", arXiv:2008.08445): SGD tolerates losing a bounded fraction of gradient data, so each step up to a
fraction `epsilon` of the bucket's chunks is not sent at all, the least important ones first.

DLCP drops packets in the switches by priority (layer and magnitude). Here, without a lossy network, the
ranks agree on what to drop without talking: a chunk's importance is the mean magnitude of the previous
step's combined gradient over it (the same on every rank) times a layer priority that favours layers the
next forward pass needs first (weight 1 + `layer_priority` for the first layer down to 1 for the last, as
P3/ByteScheduler order them). The floor(epsilon * chunks) least important chunks are left out of the
all-reduce and count as zero; the first step, with no history, sends everything. Each rank sends
(chunks kept) * chunk_size * 4 bytes. With `error_feedback` the dropped local values are kept and added to
the next step's gradient (beyond DLCP). With epsilon = 0 nothing is dropped and the result is bit for bit
that of no compression.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dtrain.compress.base import BucketInfo, Compressor, Decoded, Round


class BoundedLoss(Compressor):
    name = "bounded_loss"

    def __init__(self, epsilon: float = 0.05, chunk_size: int = 256, layer_priority: float = 1.0,
                 error_feedback: bool = False) -> None:
        super().__init__()
        if not 0 <= epsilon < 1:
            raise ValueError(f"bounded_loss epsilon {epsilon} must be in [0, 1)")
        self.epsilon = epsilon
        self.chunk_size = chunk_size
        self.layer_priority = layer_priority
        self.error_feedback = error_feedback and epsilon > 0
        self._weights: dict[int, torch.Tensor] = {}  # a cache of each bucket's chunk weights (from its layout)
        self.dropped_chunks = 0  # for describe()
        self.total_chunks = 0

    @property
    def importance(self) -> dict[int, torch.Tensor]:
        """Per bucket, each chunk's mean magnitude in the last combined gradient (the same on every rank)."""
        return self.state.per_bucket("importance")

    def chunk_weights(self, bucket: BucketInfo, chunks: int) -> torch.Tensor:
        """Layer priority of each chunk: that of the gradient tensor its first element belongs to."""
        weights = self._weights.get(bucket.key)
        if weights is None or weights.numel() != chunks:
            starts = torch.arange(chunks) * self.chunk_size
            weights = torch.ones(chunks, dtype=torch.float64)
            for (offset, _), position in zip(bucket.spans, bucket.positions, strict=False):
                weights[starts >= offset] = 1.0 + self.layer_priority * (1.0 - position)
            self._weights[bucket.key] = weights
        return weights

    def kept_chunks(self, bucket: BucketInfo, chunks: int) -> torch.Tensor | None:
        """Indices of the chunks to send (sorted), or None to send all."""
        drop = math.floor(self.epsilon * chunks)
        history = self.importance.get(bucket.key)
        if drop == 0 or history is None or history.numel() != chunks:
            return None
        priority = history * self.chunk_weights(bucket, chunks)
        order = torch.argsort(priority, stable=True)  # ties broken by position: the same on every rank
        return order[drop:].sort().values

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        flat = tensor.reshape(-1)
        chunks = math.ceil(flat.numel() / self.chunk_size)
        source = self.state.add_residual(bucket.key, flat) if self.error_feedback else flat
        kept = self.kept_chunks(bucket, chunks)
        divisor = bucket.divisor  # divided before the all-reduce, as DDP's reducer does
        self.total_chunks += chunks
        if kept is None:
            payload = source / divisor if divisor != 1 else source.clone()
            if self.error_feedback:
                self.state.residuals.pop(bucket.key, None)  # everything went out
        else:
            padded = torch.zeros(chunks * self.chunk_size, dtype=flat.dtype)
            padded[: flat.numel()] = source
            rows = padded.view(chunks, self.chunk_size)[kept]
            payload = (rows / divisor if divisor != 1 else rows).reshape(-1)
            self.dropped_chunks += chunks - kept.numel()
            if self.error_feedback:
                sent = torch.zeros_like(padded).view(chunks, self.chunk_size)
                sent[kept] = rows
                self.state.keep_residual(bucket.key, source, sent.view(-1)[: flat.numel()])
        return Round("all_reduce", [payload], (bucket, flat.numel(), chunks, kept))

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        bucket, numel, chunks, kept = ctx
        total: torch.Tensor = received[0]
        if kept is not None:
            rows = torch.zeros(chunks, self.chunk_size, dtype=total.dtype)
            rows[kept] = total.view(-1, self.chunk_size)
            total = rows.view(-1)[:numel]
        if self.epsilon > 0:
            padded = torch.zeros(chunks * self.chunk_size, dtype=torch.float64)
            padded[:numel] = total.abs()
            self.importance[bucket.key] = padded.view(chunks, self.chunk_size).mean(dim=1)
        return Decoded.done(total)

    def describe(self) -> dict[str, Any]:
        dropped = self.dropped_chunks / self.total_chunks if self.total_chunks else 0.0
        return {"name": self.name, "epsilon": self.epsilon, "chunk_size": self.chunk_size,
                "layer_priority": self.layer_priority, "error_feedback": self.error_feedback,
                "fraction_of_chunks_dropped": dropped}
