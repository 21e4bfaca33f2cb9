"""Synthetic data of any shape, learnable, generated in memory: tells compute from the input pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from dtrain.data.arrays import ArrayDataset


def synthetic_classification(num_records: int, input_shape: Sequence[int], num_classes: int, seed: int = 0,
                             dtype: torch.dtype = torch.float32) -> ArrayDataset:
    """Gaussian inputs labelled by a fixed random linear teacher, so that a model can learn them."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((num_records, *input_shape), generator=generator, dtype=torch.float64)
    teacher = torch.randn((int(torch.tensor(input_shape).prod()), num_classes), generator=generator,
                          dtype=torch.float64)
    labels = (inputs.flatten(1) @ teacher).argmax(dim=1)
    return ArrayDataset(inputs.to(dtype), labels)


def synthetic_regression(num_records: int, num_features: int, num_outputs: int = 1, seed: int = 0,
                         noise: float = 0.1, dtype: torch.dtype = torch.float32) -> ArrayDataset:
    """Inputs and targets of a random linear map plus noise."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((num_records, num_features), generator=generator, dtype=torch.float64)
    weights = torch.randn((num_features, num_outputs), generator=generator, dtype=torch.float64)
    targets = inputs @ weights + noise * torch.randn((num_records, num_outputs), generator=generator,
                                                     dtype=torch.float64)
    return ArrayDataset(inputs.to(dtype), targets.to(dtype))


def synthetic_like(sample: Sequence[torch.Tensor], num_records: int, seed: int = 0) -> ArrayDataset:
    """Random tensors with the shapes and dtypes of one record (e.g. `dataset[0]`), integer ones kept in range."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for item in sample:
        item = torch.as_tensor(item)
        shape = (num_records, *item.shape)
        if item.dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator, dtype=torch.float64).to(item.dtype))
        else:
            high = max(int(item.max()) + 1, 2)
            tensors.append(torch.randint(0, high, shape, generator=generator).to(item.dtype))
    return ArrayDataset(*tensors)


class ReplayDataset(Dataset):
    """A dataset of `length` records that cycles through a small in-memory pool (random data of the real data's
    shapes): training on it costs no input pipeline at all, which is what `faults.synthetic_data` measures.
    Records keep the real records' structure: a tuple of fields (no `keys`), one tensor (`keys` None) or a dict of
    fields named by `keys`."""

    returns_batches = True

    def __init__(self, pool: ArrayDataset, length: int, keys: Sequence[str] | None = ()) -> None:
        self.pool = pool
        self.length = length
        self.keys = keys

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self._pack(self.pool[index % len(self.pool)])

    def __getitems__(self, indices: Sequence[int]) -> Any:
        return self._pack(self.pool.__getitems__([i % len(self.pool) for i in indices]))

    def _pack(self, fields: tuple[torch.Tensor, ...]) -> Any:
        if self.keys is None:
            return fields[0]
        if self.keys:
            return dict(zip(self.keys, fields, strict=True))
        return fields


def synthetic_replay(dataset: Any, pool_size: int = 1024) -> ReplayDataset:
    """Random data with the structure, shapes and dtypes of `dataset[0]`, as long as `dataset`, from a pool of
    `pool_size` records."""
    sample = dataset[0]
    keys: Sequence[str] | None = ()
    if isinstance(sample, dict):
        keys, items = list(sample), list(sample.values())
    elif isinstance(sample, (tuple, list)):
        items = list(sample)
    else:
        keys, items = None, [sample]
    return ReplayDataset(synthetic_like(items, min(pool_size, len(dataset))), len(dataset), keys)
