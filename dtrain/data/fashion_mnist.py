"""Fashion-MNIST from its four IDX files: the Debian package's directory, a cache, or a download."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import torch

from dtrain.data.arrays import ArrayDataset
from dtrain.data.idx import read_idx
from dtrain.errors import DataError

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path.home() / ".cache" / "dtrain" / "fashion-mnist"
MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
# Mean and standard deviation of the training images' pixels in [0, 1].
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


def candidate_dirs(directory: str | Path | None = None) -> list[Path]:
    """Where to look, in order: the given directory, $DTRAIN_FASHION_MNIST, Debian's package, the cache."""
    if directory is not None:
        return [Path(directory).expanduser()]
    env = os.environ.get("DTRAIN_FASHION_MNIST")
    return ([Path(env)] if env else []) + [DEBIAN_DIR, CACHE_DIR]


def _find_file(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


def find_data_dir(directory: str | Path | None = None) -> Path | None:
    """The first candidate directory that holds all four files, or None."""
    for candidate in candidate_dirs(directory):
        if all(_find_file(candidate, stem) for pair in FILES.values() for stem in pair):
            return candidate
    return None


def download(directory: Path = CACHE_DIR, timeout_seconds: float = 30.0) -> Path:
    """Fetch the four gzip files into `directory` (atomically per file) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    for stem in (s for pair in FILES.values() for s in pair):
        target = directory / f"{stem}.gz"
        if target.is_file():
            continue
        partial = target.with_suffix(".gz.part")
        try:
            with urllib.request.urlopen(MIRROR + target.name, timeout=timeout_seconds) as response:
                partial.write_bytes(response.read())
        except OSError as exc:
            raise DataError(f"cannot download {MIRROR + target.name} ({exc}); install the Debian package "
                            "`dataset-fashion-mnist` or copy the four IDX files into a directory") from None
        partial.replace(target)
    return directory


def load_fashion_mnist(split: str = "train", directory: str | Path | None = None, download_if_missing: bool = False
                       ) -> ArrayDataset:
    """Images as float32 (N, 1, 28, 28), normalised with the training mean and std, and int64 labels."""
    if split not in FILES:
        raise DataError(f"Fashion-MNIST split {split!r} does not exist; use 'train' or 'test'")
    found = find_data_dir(directory)
    if found is None and download_if_missing:
        found = download(Path(directory).expanduser() if directory else CACHE_DIR)
    if found is None:
        looked = ", ".join(str(d) for d in candidate_dirs(directory))
        raise DataError(f"Fashion-MNIST's four IDX files are not in {looked}; run `apt-get install "
                        "dataset-fashion-mnist` (or `make setup` as root), copy the files into one of these "
                        "directories, or set `data.download: true` where the internet is reachable")
    image_stem, label_stem = FILES[split]
    images = read_idx(_find_file(found, image_stem), expected_ndim=3)  # type: ignore[arg-type]
    labels = read_idx(_find_file(found, label_stem), expected_ndim=1)  # type: ignore[arg-type]
    if images.shape[1:] != (28, 28) or len(images) != len(labels):
        raise DataError(f"Fashion-MNIST {split} files in {found} do not match: images {images.shape}, labels "
                        f"{labels.shape} (expected N x 28 x 28 images and N labels); fetch them again")
    pixels = torch.from_numpy(images.copy()).to(torch.float32).div_(255.0)
    pixels = pixels.sub_(PIXEL_MEAN).div_(PIXEL_STD).unsqueeze(1)
    return ArrayDataset(pixels, torch.from_numpy(labels.astype("int64")))
