"""Small collectives the Trainer needs, written once over torch.distributed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def collective_device() -> torch.device:
    """Where a small tensor for a collective of the default group must live: the current GPU under NCCL (which
    carries CUDA tensors only), the CPU otherwise (gloo; a CPU tensor's read then waits for no device)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sums(values: Mapping[str, float]) -> dict[str, float]:
    """Sum named scalars over all ranks in one float64 all-reduce; every rank must pass the same names."""
    names = sorted(values)
    if not names:
        return {}
    packed = torch.tensor([float(values[name]) for name in names], dtype=torch.float64, device=collective_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(packed)
    return dict(zip(names, packed.tolist(), strict=True))


def weighted_means(sums: Mapping[str, float], weight_name: str) -> dict[str, float]:
    """Turn reduced `{metric: sum of value*weight, weight_name: total weight}` into weighted means."""
    total = sums[weight_name]
    return {name: value / total for name, value in sums.items() if name != weight_name and total > 0}


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    """Wait for every rank (no-op with one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    packed = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return bool(packed.item())


def rank_flags(flags: Sequence[bool]) -> list[tuple[bool, ...]]:
    """Every rank's `flags`, in rank order, from one small all-reduce (all ranks pass the same number)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [tuple(flags)]
    table = torch.zeros(dist.get_world_size(), len(flags), dtype=torch.int32, device=collective_device())
    table[dist.get_rank()] = torch.tensor([1 if flag else 0 for flag in flags], dtype=torch.int32)
    dist.all_reduce(table)
    return [tuple(bool(v) for v in row) for row in table.tolist()]
