"""Run compressors of several simulated ranks in one process: the collectives done by hand (sum in rank
order for all-reduce, the list of every rank's payloads for all-gather). The reference the unit tests use,
and a way to see what a compressor does to given gradients without starting processes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.compress.base import BucketInfo, Compressor, Round, sum_over_ranks


def reduce_locally(compressors: Sequence[Compressor], tensors: Sequence[torch.Tensor], *, key: int = 0,
                   average: bool = True, shapes: list[torch.Size] | None = None,
                   infos: Sequence[BucketInfo] | None = None) -> list[torch.Tensor]:
    """One communicating step of bucket `key`: rank r compresses `tensors[r]` with `compressors[r]`; returns
    each rank's combined result (they agree for every compressor dtrain has). Wire bytes are recorded on
    each compressor as the hook records them. `infos` (one per rank) replaces the bucket layout made from
    `shapes`."""
    world = len(compressors)
    if infos is None:
        infos = [BucketInfo.single(t, key=key, world_size=world, rank=r, divisor=world if average else 1,
                                   shapes=shapes) for r, t in enumerate(tensors)]
    for compressor, tensor in zip(compressors, tensors, strict=True):
        compressor.wire.record_bucket(tensor.numel() * tensor.element_size(), world)
    rounds: list[torch.Tensor | Round] = [c.compress(t, i) for c, t, i in zip(compressors, tensors, infos, strict=True)]
    while isinstance(rounds[0], Round):
        current = [r for r in rounds if isinstance(r, Round)]
        assert len(current) == world and len({r.collective for r in current}) == 1, "ranks must agree on the round"
        for compressor, round_ in zip(compressors, current, strict=True):
            compressor.wire.record_round(round_, world)
        if current[0].collective == "all_reduce":
            summed = [sum_over_ranks([r.payloads[i] for r in current]) for i in range(len(current[0].payloads))]
            rounds = [c.decompress([s.clone() for s in summed], r.ctx)
                      for c, r in zip(compressors, current, strict=True)]
        else:
            gathered = [[p.clone() for p in r.payloads] for r in current]
            rounds = [c.decompress(gathered, r.ctx) for c, r in zip(compressors, current, strict=True)]
    for compressor, info in zip(compressors, infos, strict=True):
        compressor.end_bucket(info)
    results = [r for r in rounds if isinstance(r, torch.Tensor)]
    assert len(results) == world
    return results
