"""The two shipped data sets the SVM examples, tests and benchmark use, as flat float64 arrays.

- `fashion_pair`: Fashion-MNIST restricted to two classes (by default 6 = shirt vs 0 = T-shirt/top, the hardest
  pair), the first `train_samples` of the training split in file order and the first `test_samples` of the test
  split, pixels scaled to [0, 1] and flattened to 784 features;
- `digits`: scikit-learn's 8x8 digits (all ten classes or a subset) with dtrain's fixed 80/20 split, pixels in
  [0, 1] flattened to 64 features.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dtrain.data import load_digits, load_fashion_mnist
from dtrain.data.fashion_mnist import PIXEL_MEAN, PIXEL_STD
from dtrain.errors import DataError

Split = tuple[np.ndarray, np.ndarray]


def _restrict(features: np.ndarray, labels: np.ndarray, classes: Sequence[int] | None, limit: int | None) -> Split:
    if classes is not None:
        keep = np.isin(labels, list(classes))
        features, labels = features[keep], labels[keep]
    if limit is not None:
        if limit > len(labels):
            raise DataError(f"asked for {limit} samples, the data set has {len(labels)} of classes {classes}; "
                            "ask for fewer")
        features, labels = features[:limit], labels[:limit]
    return features, labels


def fashion_pair(classes: Sequence[int] = (6, 0), train_samples: int | None = 10000, test_samples: int | None = 2000,
                 directory: str | Path | None = None) -> tuple[Split, Split]:
    """((X_train, y_train), (X_test, y_test)) of Fashion-MNIST restricted to `classes`."""
    out = []
    for split, limit in (("train", train_samples), ("test", test_samples)):
        images, labels = load_fashion_mnist(split, directory).tensors
        pixels = (images.reshape(len(images), -1).double() * PIXEL_STD + PIXEL_MEAN).clamp_(0.0, 1.0).numpy()
        out.append(_restrict(pixels, labels.numpy(), classes, limit))
    return out[0], out[1]


def digits(classes: Sequence[int] | None = None) -> tuple[Split, Split]:
    """((X_train, y_train), (X_test, y_test)) of the digits, optionally restricted to `classes`."""
    out = []
    for split in ("train", "test"):
        images, labels = load_digits(split).tensors
        out.append(_restrict(images.reshape(len(images), -1).double().numpy(), labels.numpy(), classes, None))
    return out[0], out[1]
