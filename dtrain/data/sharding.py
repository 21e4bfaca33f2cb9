"""Which records each rank trains on: one seeded shuffle per epoch, split across ranks by per-rank batch sizes.

The split takes a list of per-rank batch sizes rather than one number, so that ranks of different speed
can later train on different shares of each global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dtrain.errors import ConfigError


@dataclass(frozen=True)
class BatchSplit:
    """How one global batch is cut into per-rank batches."""

    per_rank: tuple[int, ...]
    requested_global: int

    @property
    def global_batch_size(self) -> int:
        return sum(self.per_rank)

    @property
    def dropped(self) -> int:
        return self.requested_global - self.global_batch_size

    def offsets(self) -> list[int]:
        """Start of each rank's slice within a global batch."""
        starts, total = [], 0
        for size in self.per_rank:
            starts.append(total)
            total += size
        return starts

    def weight(self, rank: int) -> float:
        """The rank's share of the global batch: its gradient's weight in an exact full-batch average."""
        return self.per_rank[rank] / self.global_batch_size


def split_global_batch(global_batch_size: int, world_size: int) -> BatchSplit:
    """Determined's rule: every rank gets global // world records; a remainder is dropped."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if global_batch_size < world_size:
        raise ConfigError(f"hyperparameters.global_batch_size ({global_batch_size}) must be >= the number of "
                          f"workers ({world_size}); raise it to {world_size}")
    per = global_batch_size // world_size
    return BatchSplit(per_rank=(per,) * world_size, requested_global=global_batch_size)


def split_by_sizes(per_rank: Sequence[int]) -> BatchSplit:
    """A split with explicit (possibly uneven) per-rank batch sizes."""
    if not per_rank or any(size < 1 for size in per_rank):
        raise ValueError(f"every rank needs a batch of at least one record, got {list(per_rank)}")
    return BatchSplit(per_rank=tuple(int(s) for s in per_rank), requested_global=int(sum(per_rank)))


def epoch_permutation(num_records: int, seed: int, epoch: int) -> torch.Tensor:
    """The same shuffle on every rank for a given seed and epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_records, generator=generator)


class ShardedBatchSampler:
    """Yields this rank's index batches for the global batches of one epoch, from a given batch on.

    Every epoch is one permutation of the dataset cut into `len(self)` full global batches (an incomplete
    last batch is dropped, so that every step trains on exactly the configured global batch); rank r takes
    its slice of each. Starting at `start_batch` lets a resumed run continue in the middle of an epoch;
    `start_record` (instead) starts at any record, where a batch-size schedule changed the global batch. With
    `passes` > 1 each of this rank's batches comes as that many parts, trained one pass each
    (`optimizations.max_per_slot_batch`).
    """

    def __init__(self, num_records: int, split: BatchSplit, rank: int, seed: int, epoch: int,
                 start_batch: int = 0, *, start_record: int | None = None, passes: int = 1) -> None:
        if num_records < split.global_batch_size:
            raise ConfigError(f"the training data has {num_records} records, fewer than one global batch "
                              f"({split.global_batch_size}); lower hyperparameters.global_batch_size")
        self.num_records, self.split, self.rank = num_records, split, rank
        self.seed, self.epoch = seed, epoch
        self.passes = passes  # each of this rank's batches is yielded as this many consecutive, near-equal parts
        self.start_record = start_batch * split.global_batch_size if start_record is None else start_record

    def __len__(self) -> int:
        return max(self.num_records - self.start_record, 0) // self.split.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_permutation(self.num_records, self.seed, self.epoch)
        global_size = self.split.global_batch_size
        start = self.start_record + self.split.offsets()[self.rank]
        size = self.split.per_rank[self.rank]
        for batch in range(len(self)):
            base = batch * global_size + start
            for offset, records in zip(pass_offsets(size, self.passes), pass_sizes(size, self.passes), strict=True):
                yield order[base + offset:base + offset + records].tolist()


def pass_sizes(records: int, passes: int) -> tuple[int, ...]:
    """`records` cut into `passes` consecutive parts whose sizes differ by at most one, the larger first."""
    base, extra = divmod(records, passes)
    return tuple(base + (1 if index < extra else 0) for index in range(passes))


def pass_offsets(records: int, passes: int) -> list[int]:
    """Where each of the parts `pass_sizes` gives starts."""
    starts, total = [], 0
    for size in pass_sizes(records, passes):
        starts.append(total)
        total += size
    return starts


def batches_per_epoch(num_records: int, split: BatchSplit) -> int:
    """Full global batches in one pass over the data."""
    return num_records // split.global_batch_size


def validation_shard(num_records: int, rank: int, world_size: int) -> range:
    """A contiguous, near-equal share of the validation set for each rank; every record is used once."""
    base, extra = divmod(num_records, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
