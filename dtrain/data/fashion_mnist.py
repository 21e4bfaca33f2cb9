"""Fashion-MNIST from its four IDX files: the Debian package's directory, a cache, or a download over HTTPS that is
kept only when its content matches the SHA-256 below."""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
import zlib
from pathlib import Path

import torch

from dtrain.data.arrays import ArrayDataset
from dtrain.data.idx import read_idx
from dtrain.errors import DataError

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path.home() / ".cache" / "dtrain" / "fashion-mnist"
# Tried in order: the upstream repository (zalandoresearch/fashion-mnist), then Keras's copy of the same files.
MIRRORS = ("https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
           "https://storage.googleapis.com/tensorflow/tf-keras-datasets/")
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
# SHA-256 of each file's uncompressed IDX bytes, so the same for upstream's gzip files and for Debian's copies,
# whose gzip headers lack the file name and carry another time (tests/unit/test_fashion_mnist.py checks them
# against Debian's copies). Upstream's .gz files themselves have MD5 8d4fb7e6..., 25c81989..., bef4ecab...,
# bb300cfd... as published; Debian's copies with upstream's header put back have exactly those MD5s.
SHA256 = {"train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
          "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
          "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
          "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"}
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
    """Fetch the four gzip files into `directory` and return it. A file is written (atomically) only once its
    content matches its SHA-256; a cached file that does not match is fetched again."""
    directory.mkdir(parents=True, exist_ok=True)
    for stem in (s for pair in FILES.values() for s in pair):
        target = directory / f"{stem}.gz"
        if target.is_file() and content_problem(target.read_bytes(), stem) is None:
            continue
        partial = target.with_suffix(".gz.part")
        partial.write_bytes(_fetch_verified(stem, timeout_seconds))
        partial.replace(target)
    return directory


def _fetch_verified(stem: str, timeout_seconds: float) -> bytes:
    """The gzip file `stem`.gz from the first mirror that serves it intact."""
    problems = []
    for mirror in MIRRORS:
        url = f"{mirror}{stem}.gz"
        try:
            with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
                data: bytes = response.read()
        except OSError as exc:  # URLError, HTTPError, TLS errors and timeouts are all OSErrors
            problems.append(f"{url}: {exc}")
            continue
        problem = content_problem(data, stem)
        if problem is None:
            return data
        problems.append(f"{url}: {problem}")
    raise DataError(f"cannot download Fashion-MNIST's {stem}.gz ({'; '.join(problems)}); nothing was kept: try "
                    "again, install the Debian package `dataset-fashion-mnist`, or copy the four IDX files into a "
                    "directory")


def content_problem(data: bytes, stem: str) -> str | None:
    """Why `data` is not Fashion-MNIST's gzip-compressed `stem`, or None when it is."""
    try:
        content = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        return f"not a complete gzip file ({exc or type(exc).__name__}), so truncated or damaged"
    digest = hashlib.sha256(content).hexdigest()
    if digest != SHA256[stem]:
        return f"its content has SHA-256 {digest[:16]}..., not {SHA256[stem][:16]}..., so it is another file"
    return None


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
    # find_data_dir returns a directory only when it holds all four files
    images = read_idx(_find_file(found, image_stem), expected_ndim=3)  # type: ignore[arg-type]
    labels = read_idx(_find_file(found, label_stem), expected_ndim=1)  # type: ignore[arg-type]
    if images.shape[1:] != (28, 28) or len(images) != len(labels):
        raise DataError(f"Fashion-MNIST {split} files in {found} do not match: images {images.shape}, labels "
                        f"{labels.shape} (expected N x 28 x 28 images and N labels); fetch them again")
    pixels = torch.from_numpy(images.copy()).to(torch.float32).div_(255.0)
    pixels = pixels.sub_(PIXEL_MEAN).div_(PIXEL_STD).unsqueeze(1)
    return ArrayDataset(pixels, torch.from_numpy(labels.astype("int64")))
