"""Sharding (same shuffle everywhere, disjoint slices, resumable), batch splits, digits and synthetic data."""

from __future__ import annotations

import pytest
import torch

from dtrain.data import ArrayDataset, load_digits, synthetic_classification, synthetic_like
from dtrain.data.sharding import (
    ShardedBatchSampler,
    split_by_sizes,
    split_global_batch,
    validation_shard,
)
from dtrain.errors import ConfigError


def test_split_drops_remainder() -> None:
    split = split_global_batch(130, 4)
    assert split.per_rank == (32, 32, 32, 32)
    assert split.global_batch_size == 128 and split.dropped == 2
    assert split.offsets() == [0, 32, 64, 96]
    with pytest.raises(ConfigError, match=r"global_batch_size \(3\) must be >= the number of workers \(4\)"):
        split_global_batch(3, 4)


def test_uneven_split_weights_sum_to_one() -> None:
    split = split_by_sizes([10, 30, 24])
    assert split.global_batch_size == 64
    assert sum(split.weight(r) for r in range(3)) == pytest.approx(1.0)
    assert split.weight(1) == 30 / 64


@pytest.mark.parametrize("sizes", [(8, 8), (5, 11, 16), (32,)])
def test_ranks_partition_each_global_batch(sizes: tuple[int, ...]) -> None:
    split = split_by_sizes(sizes)
    per_rank = [list(ShardedBatchSampler(200, split, rank, seed=3, epoch=1)) for rank in range(len(sizes))]
    batches = 200 // split.global_batch_size
    assert all(len(batches_of_rank) == batches for batches_of_rank in per_rank)
    for b in range(batches):
        union = [i for rank in range(len(sizes)) for i in per_rank[rank][b]]
        assert len(union) == len(set(union)) == split.global_batch_size
        assert [len(per_rank[r][b]) for r in range(len(sizes))] == list(sizes)
    # one global batch is one contiguous slice of the epoch's permutation
    generator = torch.Generator().manual_seed(3 * 1_000_003 + 1)
    order = torch.randperm(200, generator=generator).tolist()
    assert [i for r in range(len(sizes)) for i in per_rank[r][0]] == order[: split.global_batch_size]


def test_epochs_reshuffle_and_seeds_repeat() -> None:
    split = split_global_batch(10, 2)
    a = list(ShardedBatchSampler(100, split, 0, seed=1, epoch=0))
    assert a == list(ShardedBatchSampler(100, split, 0, seed=1, epoch=0))
    assert a != list(ShardedBatchSampler(100, split, 0, seed=1, epoch=1))
    assert a != list(ShardedBatchSampler(100, split, 0, seed=2, epoch=0))


def test_resume_in_the_middle_of_an_epoch() -> None:
    split = split_global_batch(16, 2)
    full = list(ShardedBatchSampler(100, split, 1, seed=0, epoch=2))
    tail = ShardedBatchSampler(100, split, 1, seed=0, epoch=2, start_batch=4)
    assert len(tail) == len(full) - 4
    assert list(tail) == full[4:]


def test_too_little_data_for_one_batch() -> None:
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        ShardedBatchSampler(10, split_global_batch(16, 2), 0, 0, 0)


@pytest.mark.parametrize(("n", "world"), [(10, 3), (7, 7), (3, 4), (10000, 2)])
def test_validation_shards_cover_everything_once(n: int, world: int) -> None:
    shards = [validation_shard(n, r, world) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(n))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_array_dataset_batches() -> None:
    data = ArrayDataset(torch.arange(10).float(), torch.arange(10) * 2)
    x, y = data.__getitems__([3, 1])
    assert x.tolist() == [3.0, 1.0] and y.tolist() == [6, 2]
    assert data[4][1].item() == 8
    with pytest.raises(ValueError, match="differ in length"):
        ArrayDataset(torch.zeros(3), torch.zeros(4))


def test_digits_split_is_fixed_and_disjoint() -> None:
    train, test = load_digits("train"), load_digits("test")
    assert len(train) + len(test) == 1797
    assert train.tensors[0].shape[1:] == (1, 8, 8)
    assert 0.0 <= float(train.tensors[0].min()) and float(train.tensors[0].max()) <= 1.0
    rows = {tuple(r.flatten().tolist()) for r in test.tensors[0]}
    assert torch.equal(load_digits("train").tensors[0], train.tensors[0])
    overlap = sum(tuple(r.flatten().tolist()) in rows for r in train.tensors[0])
    assert overlap < 20  # digits has a few duplicate images, but the index split is disjoint


def test_synthetic_is_learnable_and_shaped() -> None:
    data = synthetic_classification(256, (3, 4, 4), num_classes=5, seed=1)
    x, y = data.tensors
    assert x.shape == (256, 3, 4, 4) and y.max() < 5
    # the labels come from a linear teacher, so least squares on one-hot targets beats chance by far
    onehot = torch.nn.functional.one_hot(y, 5).double()
    solution = torch.linalg.lstsq(x.flatten(1).double(), onehot).solution
    accuracy = ((x.flatten(1).double() @ solution).argmax(1) == y).double().mean()
    assert accuracy > 0.6


def test_synthetic_like_copies_shapes_and_dtypes() -> None:
    sample = (torch.zeros(2, 5, dtype=torch.float16), torch.tensor(7))
    data = synthetic_like(sample, 9)
    x, y = data.tensors
    assert x.shape == (9, 2, 5) and x.dtype == torch.float16
    assert y.shape == (9,) and y.dtype == torch.int64 and int(y.max()) <= 7
