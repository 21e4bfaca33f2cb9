"""scikit-learn's bundled 8x8 handwritten digits: a small real dataset that needs no files or network."""

from __future__ import annotations

import torch

from dtrain.data.arrays import ArrayDataset
from dtrain.errors import DataError

TEST_FRACTION = 0.2


def load_digits(split: str = "train", seed: int = 0) -> ArrayDataset:
    """Images as float32 (N, 1, 8, 8) scaled to [0, 1] and int64 labels; a fixed seeded 80/20 split."""
    if split not in ("train", "test"):
        raise DataError(f"digits split {split!r} does not exist; use 'train' or 'test'")
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - TEST_FRACTION))
    chosen = order[:cut] if split == "train" else order[cut:]
    return ArrayDataset(images[chosen], labels[chosen])
