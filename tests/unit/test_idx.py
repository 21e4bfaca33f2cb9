"""The IDX reader on good, truncated and wrong files, and the Fashion-MNIST loader around it."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from dtrain.data.fashion_mnist import find_data_dir, load_fashion_mnist
from dtrain.data.idx import read_idx
from dtrain.errors import DataError


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode an array as IDX independently of the reader: magic 0 0 type ndim, big-endian sizes, data."""
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D}[array.dtype]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def test_reads_uint8_images(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "x.idx").write_bytes(idx_bytes(images))
    assert np.array_equal(read_idx(tmp_path / "x.idx", expected_ndim=3), images)


def test_reads_gzip_and_big_endian_types(tmp_path: Path) -> None:
    ints = np.array([1, -2, 300000], dtype=">i4")
    floats = np.array([[0.5, -1.25]], dtype=">f4")
    (tmp_path / "i.gz").write_bytes(gzip.compress(idx_bytes(ints)))
    (tmp_path / "f.idx").write_bytes(idx_bytes(floats))
    assert read_idx(tmp_path / "i.gz").tolist() == [1, -2, 300000]
    assert read_idx(tmp_path / "f.idx").tolist() == [[0.5, -1.25]]


def test_truncated_body_is_named(tmp_path: Path) -> None:
    raw = idx_bytes(np.zeros((10, 28, 28), dtype=np.uint8))
    (tmp_path / "short").write_bytes(raw[:-100])
    with pytest.raises(DataError, match=r"short is truncated: 7740 data bytes.*7840 expected"):
        read_idx(tmp_path / "short")


def test_truncated_gzip_is_named(tmp_path: Path) -> None:
    packed = gzip.compress(idx_bytes(np.zeros((100, 28, 28), dtype=np.uint8)))
    (tmp_path / "cut.gz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match="cut.gz cannot be read"):
        read_idx(tmp_path / "cut.gz")


def test_header_cut_short(tmp_path: Path) -> None:
    (tmp_path / "h").write_bytes(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(DataError, match="ends inside its header"):
        read_idx(tmp_path / "h")


def test_wrong_magic_and_wrong_file(tmp_path: Path) -> None:
    (tmp_path / "png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(DataError, match="is not an IDX file"):
        read_idx(tmp_path / "png")
    (tmp_path / "labels").write_bytes(idx_bytes(np.zeros(5, dtype=np.uint8)))
    with pytest.raises(DataError, match="1 dimensions where 3 are expected"):
        read_idx(tmp_path / "labels", expected_ndim=3)
    with pytest.raises(DataError, match="does not exist"):
        read_idx(tmp_path / "nothing")


def test_extra_bytes_are_an_error(tmp_path: Path) -> None:
    (tmp_path / "long").write_bytes(idx_bytes(np.zeros(5, dtype=np.uint8)) + b"\x00")
    with pytest.raises(DataError, match="longer than its header says"):
        read_idx(tmp_path / "long")


def _write_fake_fashion(directory: Path, n: int = 12) -> None:
    rng = np.random.default_rng(0)
    for split, count in (("train", n), ("t10k", n // 2)):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=count, dtype=np.uint8)
        (directory / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
        (directory / f"{split}-labels-idx1-ubyte").write_bytes(idx_bytes(labels))


def test_fashion_loader_normalises_and_shapes(tmp_path: Path) -> None:
    _write_fake_fashion(tmp_path)
    train = load_fashion_mnist("train", tmp_path)
    images, labels = train.tensors
    assert images.shape == (12, 1, 28, 28) and labels.shape == (12,)
    raw = read_idx(tmp_path / "train-images-idx3-ubyte.gz")
    expected = (raw[3].astype(np.float64) / 255 - 0.2860) / 0.3530
    assert np.allclose(images[3, 0].numpy(), expected, atol=1e-6)
    assert len(load_fashion_mnist("test", tmp_path)) == 6


def test_fashion_loader_missing_dir_says_how_to_get_data(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", tmp_path / "empty")


def test_fashion_loader_mismatched_files(tmp_path: Path) -> None:
    _write_fake_fashion(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(3, dtype=np.uint8)))
    with pytest.raises(DataError, match="do not match"):
        load_fashion_mnist("train", tmp_path)


@pytest.mark.skipif(find_data_dir() is None, reason="Fashion-MNIST is not installed (make setup installs it)")
def test_real_fashion_mnist() -> None:
    train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
    assert len(train) == 60000 and len(test) == 10000
    images, labels = train.tensors
    assert abs(float(images.mean())) < 0.01 and abs(float(images.std()) - 1) < 0.01
    assert labels.bincount().tolist() == [6000] * 10
