"""The two shipped data sets the SVM examples, tests and benchmark use, as flat float64 arrays.

- `fashion_pair`: Fashion-MNIST restricted to two classes (by default 6 = shirt vs 0 = T-shirt/top, the hardest
  pair), the first `train_samples` of the training split in file order and the first `test_samples` of the test
  split, pixels scaled to [0, 1] and flattened to 784 features;
- `digits`: scikit-learn's 8x8 digits (all ten classes or a subset) with dtrain's fixed 80/20 split, pixels in
  [0, 1] flattened to 64 features;
- `from_file`: one's own data, a NumPy `.npz` holding arrays `X` (samples x features) and `y` (labels), or a CSV
  file whose last column is the label (a header line is skipped).
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


def from_file(path: Path) -> Split:
    """(X, y) from a `.npz` (arrays `X` or `x`, and `y`) or a `.csv` (numbers, the label last, an optional header
    line); X as float64, y as int64 class labels. A file that cannot be read so is one DataError line."""
    if not path.is_file():
        raise DataError(f"SVM data file {path} does not exist; give data.train and data.validation as .npz (arrays "
                        "X and y) or .csv (label last) files, relative to the experiment file")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as arrays:
            names = [name for name in ("X", "x") if name in arrays]
            if not names or "y" not in arrays:
                raise DataError(f"{path} holds arrays {', '.join(arrays.files) or 'none'}; an SVM .npz needs X "
                                "(samples x features) and y (labels): np.savez(path, X=X, y=y)")
            features, labels = np.asarray(arrays[names[0]]), np.asarray(arrays["y"])
    elif path.suffix == ".csv":
        features, labels = _csv(path)
    else:
        raise DataError(f"SVM data file {path}: use a .npz (arrays X and y) or a .csv (the label last)")
    if features.ndim != 2 or labels.ndim != 1 or len(features) != len(labels) or not len(labels):
        raise DataError(f"{path}: X has shape {features.shape} and y {labels.shape}; X must be samples x features "
                        "and y one label per sample")
    if not np.issubdtype(labels.dtype, np.integer):
        if not np.issubdtype(labels.dtype, np.number) or not np.all(labels == np.round(labels)):
            raise DataError(f"{path}: the labels must be whole numbers (class ids); found {labels[:3].tolist()}")
    return features.astype(np.float64), labels.astype(np.int64)


def _csv(path: Path) -> Split:
    with path.open() as handle:
        first = handle.readline()
    try:
        [float(cell) for cell in first.split(",")]
        header = 0
    except ValueError:
        header = 1
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=header, ndmin=2, dtype=np.float64)
    except ValueError as exc:
        raise DataError(f"{path}: not a CSV of numbers ({exc}); each line: features..., label") from None
    if table.shape[1] < 2:
        raise DataError(f"{path}: each line needs at least one feature and the label (the last column)")
    return table[:, :-1], table[:, -1]
