"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019, arXiv:1905.13727): rank-r approximation of each
gradient matrix by one step of power iteration, with error feedback and warm start.

For a gradient reshaped to M (n x m, conv kernels as out x rest) and Q (m x r) from the previous step:
P = M Q, all-reduced and orthogonalized; Q = M^T P, all-reduced and divided by the world size; the update is
P Q^T. P and Q are sums over ranks, so two all-reduces carry (n + m) r numbers instead of n m. Vectors
(biases, norms) and matrices that would not shrink by `min_compression_rate` go in full with the first
all-reduce. Error feedback keeps M - P Q^T for the next step. Before `start_iter` steps the bucket is
all-reduced whole (DDP rebuilds its buckets after the first step, and the first steps' gradients are large).

This follows torch's `powerSGD_hook` step for step (layout of P and Q grouped by shape, Q drawn from a numpy
RandomState seeded with `seed`, Gram-Schmidt for r <= 2 and QR above, error feedback on the whole bucket),
so with the same seed it computes the same numbers; tested against it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dtrain.compress.base import BucketInfo, Compressor, Decoded, Round


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each matrix of a batch (b x n x r) orthonormal, in place: Gram-Schmidt for r <= 2
    (cheaper there), Householder QR otherwise."""
    rank = matrices.shape[2]
    if rank > 2:
        torch.linalg.qr(matrices, out=(matrices, torch.empty(matrices.shape[0], rank, rank, dtype=matrices.dtype)))
        return
    for i in range(rank):
        column = matrices[:, :, i : i + 1]
        column /= torch.norm(column, dim=1, keepdim=True) + epsilon
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column


@dataclass
class _Plan:
    """How one bucket is split: matrices to approximate (as offsets and n, m, r) and the rest sent whole."""

    matrices: list[tuple[int, int, int, int]]  # offset in the bucket, n, m, rank
    whole: list[tuple[int, int]]  # offset, numel
    p_size: int
    q_size: int


class PowerSGD(Compressor):
    name = "powersgd"

    def __init__(self, rank: int = 4, start_iter: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, epsilon: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        if (error_feedback or warm_start) and start_iter <= 1:
            raise ValueError("powersgd start_iter must be > 1 with error feedback or warm start (DDP rebuilds "
                             "its buckets after the first step)")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.epsilon = epsilon
        self.seed = seed
        self._rng = np.random.RandomState(seed)

    @property
    def p_memory(self) -> dict[int, torch.Tensor]:
        """Per bucket, P of the last step (all matrices' factors one after the other)."""
        return self.state.per_bucket("p")

    @property
    def q_memory(self) -> dict[int, torch.Tensor]:
        """Per bucket, Q of the last step: the warm start of the next power iteration."""
        return self.state.per_bucket("q")

    def plan(self, bucket: BucketInfo) -> _Plan:
        matrices, whole, p_size, q_size = [], [], 0, 0
        for offset, shape in bucket.spans:
            n = shape[0] if len(shape) else 1
            m = shape.numel() // n
            r = min(n, m, self.rank)
            if (n + m) * r * self.min_compression_rate < n * m:
                matrices.append((offset, n, m, r))
                p_size, q_size = p_size + n * r, q_size + m * r
            else:
                whole.append((offset, int(shape.numel())))
        by_shape: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
        for matrix in matrices:  # torch's hook lays out P and Q grouped by shape, in order of first appearance
            by_shape[(matrix[1], matrix[2])].append(matrix)
        ordered = [matrix for group in by_shape.values() for matrix in group]
        return _Plan(ordered, whole, p_size, q_size)

    @staticmethod
    def _views(memory: torch.Tensor, plan: _Plan, which: int) -> list[torch.Tensor]:
        """Per matrix, a 1 x (n or m) x r view of the P (which=1) or Q (which=2) memory."""
        views, position = [], 0
        for matrix in plan.matrices:
            rows, r = matrix[which], matrix[3]
            views.append(memory[position : position + rows * r].view(1, rows, r))
            position += rows * r
        return views

    @staticmethod
    def _matrix_views(work: torch.Tensor, plan: _Plan) -> list[torch.Tensor]:
        return [work[o : o + n * m].view(1, n, m) for o, n, m, _ in plan.matrices]

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        flat = tensor.reshape(-1)
        if self.state.steps < self.start_iter:
            return Round("all_reduce", [flat / bucket.divisor], ("whole", tensor.dtype))
        key = bucket.key
        plan = self.plan(bucket)
        # the gradient (+ error); the result is written into the bucket `flat` at the end
        work = self.state.add_residual(key, flat) if self.error_feedback else flat
        whole = torch.cat([work[o : o + n] for o, n in plan.whole]) if plan.whole else work.new_empty(0)
        fresh = not self.warm_start or key not in self.p_memory or self.p_memory[key].numel() != plan.p_size
        if fresh:
            self.p_memory[key] = work.new_empty(plan.p_size)
            self.q_memory[key] = work.new_empty(plan.q_size)
        qs = self._views(self.q_memory[key], plan, 2)
        if fresh:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self._rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, dtype=work.dtype))
                    orthogonalize(q, self.epsilon)
        else:
            for q in qs:
                orthogonalize(q, self.epsilon)
        ps = self._views(self.p_memory[key], plan, 1)
        for matrix, q, p in zip(self._matrix_views(work, plan), qs, ps, strict=True):
            torch.mm(matrix[0], q[0].t().contiguous().t(), out=p[0])  # M Q, Q column-major: much faster on CPUs
        ctx = ("p", key, plan, work, flat, bucket.divisor, tensor.dtype)
        return Round("all_reduce", [whole, self.p_memory[key]], ctx, final=False)

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        if ctx[0] == "whole":
            return Decoded.done(received[0].to(ctx[1]))
        stage, key, plan, work, out, divisor, dtype = ctx
        if stage == "p":
            whole = received[0].div_(divisor)
            position = 0
            for offset, numel in plan.whole:
                out[offset : offset + numel].copy_(whole[position : position + numel])
                position += numel
            self.p_memory[key] = received[1]
            ps = self._views(received[1], plan, 1)
            for p in ps:
                orthogonalize(p, self.epsilon)
            qs = self._views(self.q_memory[key], plan, 2)
            for matrix, p, q in zip(self._matrix_views(work, plan), ps, qs, strict=True):
                q[0].copy_((p[0].t() @ matrix[0]).t())  # M^T P as (P^T M)^T: M is read row by row
            return Decoded.then(Round("all_reduce", [self.q_memory[key]], ("q", key, plan, work, out, divisor, dtype)))
        self.q_memory[key] = received[0].div_(divisor)
        ps = self._views(self.p_memory[key], plan, 1)
        qs = self._views(self.q_memory[key], plan, 2)
        for p, q, matrix in zip(ps, qs, self._matrix_views(out, plan), strict=True):
            torch.mm(p[0], q[0].t(), out=matrix[0])
        if self.error_feedback:
            self.state.keep_residual(key, work, out)
        if not self.warm_start:
            self.p_memory.clear()
            self.q_memory.clear()
        return Decoded.done(out if out.dtype == dtype else out.to(dtype))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "start_iter": self.start_iter,
                "min_compression_rate": self.min_compression_rate, "error_feedback": self.error_feedback,
                "warm_start": self.warm_start}
