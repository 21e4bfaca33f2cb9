"""In-memory datasets of aligned tensors that hand out whole batches at once (no per-record Python calls)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset


class ArrayDataset(Dataset):
    """Aligned tensors (e.g. images and labels); `__getitems__` gathers a batch with one index per tensor."""

    returns_batches = True

    def __init__(self, *tensors: torch.Tensor) -> None:
        if not tensors:
            raise ValueError("ArrayDataset needs at least one tensor")
        length = len(tensors[0])
        if any(len(t) != length for t in tensors):
            raise ValueError(f"ArrayDataset tensors differ in length: {[len(t) for t in tensors]}")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t.index_select(0, index) for t in self.tensors)


def keep_batch(batch: object) -> object:
    """Collate function for datasets that already return whole batches."""
    return batch
