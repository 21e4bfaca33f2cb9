"""`faults.synthetic_data`'s replay dataset: as long as the real training data, records of the same structure,
shapes and dtypes (so the Trial's code runs unchanged), batches equal to stacked records, and deterministic."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from dtrain.data import ArrayDataset, load_digits
from dtrain.data.arrays import keep_batch
from dtrain.data.synthetic import ReplayDataset, synthetic_replay


@pytest.fixture(scope="module")
def digits() -> ArrayDataset:
    return load_digits("train")


def assert_same_kind(fake: Any, real: Any) -> None:
    """Same structure, and tensors of the same shape and dtype, field by field."""
    if isinstance(real, dict):
        assert isinstance(fake, dict) and list(fake) == list(real)
        for key in real:
            assert_same_kind(fake[key], real[key])
    elif isinstance(real, (tuple, list)):
        assert isinstance(fake, (tuple, list)) and len(fake) == len(real)
        for fake_field, real_field in zip(fake, real, strict=True):
            assert_same_kind(fake_field, real_field)
    else:
        real = torch.as_tensor(real)
        assert isinstance(fake, torch.Tensor) and fake.shape == real.shape and fake.dtype == real.dtype


def test_replay_matches_the_real_data_record_by_record(digits: ArrayDataset) -> None:
    replay = synthetic_replay(digits, pool_size=100)
    assert len(replay) == len(digits) == 1437 and len(replay.pool) == 100
    for index in (0, 1, 99, 100, 777, len(digits) - 1):
        assert_same_kind(replay[index], digits[index])
    images, labels = replay.pool.tensors
    assert images.dtype == torch.float32 and images.shape == (100, 1, 8, 8)
    assert labels.dtype == torch.int64 and int(labels.min()) >= 0
    assert int(labels.max()) <= int(digits.tensors[1].max())  # no class the model's output cannot score
    assert labels.unique().numel() >= 2  # not one constant label


def test_batches_equal_stacked_records_and_indices_wrap_around_the_pool(digits: ArrayDataset) -> None:
    replay = synthetic_replay(digits, pool_size=64)
    indices = [0, 5, 63, 64, 69, 1000, 1436]
    batch = replay.__getitems__(indices)
    stacked = default_collate([replay[i] for i in indices])
    assert len(batch) == len(stacked) == 2
    for got, expected in zip(batch, stacked, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for index in (0, 5, 63):  # record i is the pool's record i mod 64
        for later in (replay[index + 64], replay[index + 64 * 22]):
            for got, expected in zip(later, replay.pool[index], strict=True):
                assert torch.equal(got, expected)


def test_replay_is_deterministic_and_a_small_dataset_is_its_own_pool_size(digits: ArrayDataset) -> None:
    first, second = synthetic_replay(digits), synthetic_replay(digits)
    for a, b in zip(first.pool.tensors, second.pool.tensors, strict=True):
        assert torch.equal(a, b)
    small = ArrayDataset(digits.tensors[0][:10], digits.tensors[1][:10])
    replay = synthetic_replay(small, pool_size=1024)
    assert len(replay) == 10 and len(replay.pool) == 10


def test_a_loader_over_the_replay_gives_batches_like_the_real_ones(digits: ArrayDataset) -> None:
    replay = synthetic_replay(digits, pool_size=50)
    sampler = [[3, 60, 9, 1200]]
    real = next(iter(DataLoader(digits, batch_sampler=sampler, collate_fn=keep_batch)))
    fake = next(iter(DataLoader(replay, batch_sampler=sampler, collate_fn=keep_batch)))
    assert_same_kind(fake, real)


class RecordDataset(Dataset):
    """A plain per-record dataset (no batch `__getitems__`) whose records are `make(index)`."""

    def __init__(self, make: Any, length: int = 40) -> None:
        self.make = make
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.make(index)


@pytest.mark.parametrize("make", [
    lambda i: (torch.full((3, 4), float(i)), i % 5),  # a Python int label
    lambda i: [torch.zeros(6, dtype=torch.float64), torch.tensor(i % 3)],
    lambda i: torch.full((2, 5), float(i)),  # one tensor per record (e.g. an autoencoder)
    lambda i: {"pixels": torch.ones(4) * i, "label": torch.tensor(i % 7)},  # fields by name
], ids=["tuple", "list", "tensor", "dict"])
def test_records_keep_their_structure(make: Any) -> None:
    real = RecordDataset(make)
    replay = synthetic_replay(real, pool_size=8)
    assert isinstance(replay, ReplayDataset) and len(replay) == len(real)
    for index in (0, 7, 8, 39):
        assert_same_kind(replay[index], real[index])
    indices = [1, 9, 30]
    real_batch = default_collate([real[i] for i in indices])  # what the loader makes of the real records
    fake_batch = replay.__getitems__(indices)
    assert_same_kind(fake_batch, real_batch)
    torch.testing.assert_close(fake_batch, default_collate([replay[i] for i in indices]), rtol=0, atol=0)
