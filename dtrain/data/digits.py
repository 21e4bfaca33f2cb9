"""scikit-learn's bundled 8x8 handwritten digits: a small real dataset that needs no files or network."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from dtrain.data.arrays import ArrayDataset
from dtrain.errors import DataError

TEST_FRACTION = 0.2


def load_digits(split: str = "train", seed: int = 0) -> ArrayDataset:
    """Images as float32 (N, 1, 8, 8) scaled to [0, 1] and int64 labels; a fixed seeded 80/20 split."""
    if split not in ("train", "test"):
        raise DataError(f"digits split {split!r} does not exist; use 'train' or 'test'")
    pixels, targets = _read_bundled_digits()
    images = torch.as_tensor(pixels, dtype=torch.float32).div_(16.0).reshape(-1, 1, 8, 8)
    labels = torch.as_tensor(targets, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - TEST_FRACTION))
    chosen = order[:cut] if split == "train" else order[cut:]
    return ArrayDataset(images[chosen], labels[chosen])


def _read_bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits.csv.gz (64 pixel columns, then the label), read without importing scikit-learn,
    which would add about 2 s to every worker start; falls back to sklearn's loader if the file moved."""
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    return bunch.data, bunch.target
