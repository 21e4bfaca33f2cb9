"""Run compressors of several simulated ranks in one process: the collectives done by hand (sum in rank
order for all-reduce, the list of every rank's payloads for all-gather) and their bytes counted as the comm
hook counts them. The reference the unit tests use, and a way to see what a compressor does to given
gradients without starting processes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtrain.compress.base import BucketInfo, Compressor, Round, WireStats, sum_over_ranks


def collect_locally(rounds: Sequence[Round]) -> list[Any]:
    """What each rank receives from one round that every rank issued: the payloads summed in rank order
    (all-reduce, a copy per rank) or every rank's payloads in rank order (all-gather, one list for all)."""
    assert len({r.collective for r in rounds}) == 1, "ranks must agree on the round"
    if rounds[0].collective == "all_reduce":
        summed = [sum_over_ranks([r.payloads[i] for r in rounds]) for i in range(len(rounds[0].payloads))]
        return [[s.clone() for s in summed] for _ in rounds]
    gathered = [[p.clone() for p in r.payloads] for r in rounds]
    return [gathered for _ in rounds]


def reduce_locally(compressors: Sequence[Compressor], tensors: Sequence[torch.Tensor], *, key: int = 0,
                   average: bool = True, shapes: list[torch.Size] | None = None,
                   infos: Sequence[BucketInfo] | None = None,
                   meters: Sequence[WireStats] | None = None) -> list[torch.Tensor]:
    """One communicating step of bucket `key`: rank r compresses `tensors[r]` with `compressors[r]`; returns
    each rank's combined result (they agree for every compressor dtrain has). `infos` (one per rank) replaces
    the bucket layout made from `shapes`; `meters` (one per rank) get each rank's bytes."""
    world = len(compressors)
    if infos is None:
        infos = [BucketInfo.single(t, key=key, world_size=world, rank=r, divisor=world if average else 1,
                                   shapes=shapes) for r, t in enumerate(tensors)]
    meters = meters if meters is not None else [WireStats() for _ in compressors]
    for meter, tensor in zip(meters, tensors, strict=True):
        meter.record_bucket(tensor.numel() * tensor.element_size(), world)
    rounds = [c.compress(t, i) for c, t, i in zip(compressors, tensors, infos, strict=True)]
    while True:
        for meter, round_ in zip(meters, rounds, strict=True):
            meter.record_round(round_, world)
        received = collect_locally(rounds)
        decoded = [c.decompress(got, r.ctx) for c, got, r in zip(compressors, received, rounds, strict=True)]
        further = [d.next_round for d in decoded if d.next_round is not None]
        if not further:
            break
        assert len(further) == world, "ranks must agree on the number of rounds"
        assert not rounds[0].final, "a round followed by another must say so (final=False)"
        rounds = further
    for compressor, info in zip(compressors, infos, strict=True):
        compressor.state.end_bucket(info)
    results = [d.gradient for d in decoded if d.gradient is not None]
    assert len(results) == world
    return results
