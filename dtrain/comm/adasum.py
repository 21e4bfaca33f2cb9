"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", arXiv:2006.02924): combine
gradients so that orthogonal ones add up and parallel ones are averaged, over any number of ranks.

The pairwise rule, computed in float64 for every tensor on its own (never for the flattened model):

    Adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b

Over P ranks the rule is applied on a binary tree in rank-bit order, as Horovod does:
Adasum(Adasum(g0, g1), Adasum(g2, g3)) for P = 4. Horovod refuses world sizes that are not a power of two;
here, with P' the largest power of two <= P, each rank r >= P' is first folded into rank r - P'
(Adasum(g_{r-P'}, g_r) becomes that leaf), and the tree runs over the P' leaves. For P = 3 the result is
Adasum(Adasum(g0, g2), g1). Transport is recursive doubling with point-to-point messages: at distance
d = 1, 2, 4, ... rank r swaps its whole vector with rank r XOR d and both compute the same pair (the
lower rank's vector is always `a`), so every rank ends with bitwise the same result and no broadcast is
needed. Each rank sends log2(P') vectors (plus one round trip for folded ranks); for P = 2 that is as much
as a ring all-reduce sends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def adasum_pair(a: torch.Tensor, b: torch.Tensor, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Adasum of two flat vectors, tensor by tensor: `lengths` cuts them into the tensors they hold
    (one tensor if omitted). Dot products, norms and the combination are in float64; the result has a's dtype.
    A zero tensor gets coefficient 1, so Adasum(a, 0) = a."""
    if a.shape != b.shape or a.dim() != 1:
        raise ValueError(f"adasum_pair needs two flat vectors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    sizes = [a.numel()] if lengths is None else [int(n) for n in lengths]
    if sum(sizes) != a.numel():
        raise ValueError(f"tensor lengths add up to {sum(sizes)}, the vectors hold {a.numel()} elements")
    if len(sizes) == 1:
        dot, a_sq, b_sq = torch.dot(a64, b64).reshape(1), torch.dot(a64, a64).reshape(1), torch.dot(b64, b64).reshape(1)
    else:
        segments = torch.tensor(sizes, dtype=torch.long, device=a.device)
        dot = torch.segment_reduce(a64 * b64, "sum", lengths=segments)
        a_sq = torch.segment_reduce(a64 * a64, "sum", lengths=segments)
        b_sq = torch.segment_reduce(b64 * b64, "sum", lengths=segments)
    one = torch.ones_like(dot)
    coef_a = torch.where(a_sq > 0, 1.0 - dot / (2.0 * a_sq.clamp_min(torch.finfo(torch.float64).tiny)), one)
    coef_b = torch.where(b_sq > 0, 1.0 - dot / (2.0 * b_sq.clamp_min(torch.finfo(torch.float64).tiny)), one)
    if len(sizes) > 1:
        coef_a = torch.repeat_interleave(coef_a, segments)
        coef_b = torch.repeat_interleave(coef_b, segments)
    return (coef_a * a64 + coef_b * b64).to(a.dtype)


def tree_partners(world_size: int) -> tuple[int, list[int]]:
    """(P', distances): the largest power of two <= world_size and the recursive-doubling distances over it."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    leaves = 1 << (world_size.bit_length() - 1)
    return leaves, [1 << level for level in range(leaves.bit_length() - 1)]


def adasum_all_reduce_(tensor: torch.Tensor, lengths: Sequence[int] | None = None,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Replace a flat `tensor` on every rank of `group` by the Adasum of all ranks' tensors (in place;
    returns it). Every rank must call it with the same shape, dtype and `lengths`. Blocking."""
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError("adasum_all_reduce_ needs a flat, contiguous tensor (e.g. a DDP gradient bucket)")
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    rank = dist.get_rank(group)
    leaves, distances = tree_partners(world)

    def peer(group_rank: int) -> int:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    if rank >= leaves:  # folded into rank - P': hand over the gradient, get the result back
        dist.send(tensor, peer(rank - leaves), group=group)
        dist.recv(tensor, peer(rank - leaves), group=group)
        return tensor
    other = torch.empty_like(tensor)
    if rank + leaves < world:
        dist.recv(other, peer(rank + leaves), group=group)
        tensor.copy_(adasum_pair(tensor, other, lengths))
    for distance in distances:
        partner = rank ^ distance
        requests = [dist.isend(tensor, peer(partner), group=group), dist.irecv(other, peer(partner), group=group)]
        for request in requests:
            if request is not None:
                request.wait()
        lower, higher = (tensor, other) if rank < partner else (other, tensor)
        tensor.copy_(adasum_pair(lower, higher, lengths))
    if rank + leaves < world:
        dist.send(tensor, peer(rank + leaves), group=group)
    return tensor
