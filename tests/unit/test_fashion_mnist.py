"""The Fashion-MNIST download against a fake web server (no network): HTTPS only, a file is kept only when its
content matches its SHA-256, a corrupt or truncated one is one DataError and leaves nothing behind. The real
checksums are checked against Debian's copies of the dataset."""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from dtrain.data import fashion_mnist
from dtrain.data.fashion_mnist import DEBIAN_DIR, FILES, MIRRORS, SHA256, download, load_fashion_mnist
from dtrain.errors import DataError

STEMS = [stem for pair in FILES.values() for stem in pair]


@pytest.mark.skipif(not DEBIAN_DIR.is_dir(), reason="Debian's dataset-fashion-mnist package is not installed")
def test_checksums_are_those_of_debians_copies() -> None:
    for stem in STEMS:
        content = gzip.decompress((DEBIAN_DIR / f"{stem}.gz").read_bytes())
        assert hashlib.sha256(content).hexdigest() == SHA256[stem], stem


def _idx(array: np.ndarray) -> bytes:
    """`array` (uint8) as an IDX file."""
    return struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


class FakeWeb:
    """urllib.request.urlopen over a dict of URL -> bytes (or an exception to raise); records what was asked."""

    def __init__(self) -> None:
        self.pages: dict[str, bytes | Exception] = {}
        self.asked: list[str] = []

    def urlopen(self, url: str, timeout: float) -> io.BytesIO:
        self.asked.append(url)
        page = self.pages.get(url, urllib.error.HTTPError(url, 404, "Not Found", None, None))  # type: ignore[arg-type]
        if isinstance(page, Exception):
            raise page
        return io.BytesIO(page)


@pytest.fixture
def web(monkeypatch: pytest.MonkeyPatch) -> FakeWeb:
    """Two tiny, valid Fashion-MNIST splits served by the first mirror, with their checksums in place of the real."""
    fake = FakeWeb()
    rng = np.random.default_rng(0)
    contents = {"train-images-idx3-ubyte": _idx(rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)),
                "train-labels-idx1-ubyte": _idx(np.array([1, 2, 3], dtype=np.uint8)),
                "t10k-images-idx3-ubyte": _idx(rng.integers(0, 256, (2, 28, 28), dtype=np.uint8)),
                "t10k-labels-idx1-ubyte": _idx(np.array([4, 5], dtype=np.uint8))}
    monkeypatch.setattr(fashion_mnist, "SHA256", {stem: hashlib.sha256(c).hexdigest() for stem, c in contents.items()})
    fake.pages = {f"{MIRRORS[0]}{stem}.gz": gzip.compress(content) for stem, content in contents.items()}
    monkeypatch.setattr(fashion_mnist.urllib.request, "urlopen", fake.urlopen)
    return fake


def test_mirrors_are_https() -> None:
    assert all(mirror.startswith("https://") for mirror in MIRRORS)


def test_a_verified_download_is_kept_and_loads(web: FakeWeb, tmp_path: Path) -> None:
    test = load_fashion_mnist("test", directory=tmp_path, download_if_missing=True)
    assert len(test) == 2 and test.tensors[1].tolist() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{stem}.gz" for stem in STEMS)
    assert web.asked == [f"{MIRRORS[0]}{stem}.gz" for stem in STEMS]
    download(tmp_path)  # all there and intact: nothing is fetched again
    assert len(web.asked) == len(STEMS)


def _damage(web: FakeWeb, stem: str, how: str) -> None:
    url = f"{MIRRORS[0]}{stem}.gz"
    good = web.pages[url]
    assert isinstance(good, bytes)
    web.pages[url] = good[: len(good) // 2] if how == "truncated" else gzip.compress(b"\0\0\x08\x01\0\0\0\1x")


@pytest.mark.parametrize(("how", "says"), [("truncated", "not a complete gzip file"),
                                           ("altered", "its content has SHA-256")])
def test_a_damaged_download_is_one_error_and_not_kept(web: FakeWeb, tmp_path: Path, how: str, says: str) -> None:
    _damage(web, "t10k-images-idx3-ubyte", how)
    with pytest.raises(DataError) as caught:
        download(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and says in message and "nothing was kept" in message, message
    assert message.startswith("cannot download Fashion-MNIST's t10k-images-idx3-ubyte.gz")
    assert not (tmp_path / "t10k-images-idx3-ubyte.gz").exists()
    assert not list(tmp_path.glob("*.part"))
    assert (tmp_path / "train-images-idx3-ubyte.gz").is_file()  # the intact files fetched before it stay


def test_the_next_mirror_serves_when_the_first_fails(web: FakeWeb, tmp_path: Path) -> None:
    stem = "train-labels-idx1-ubyte"
    web.pages[f"{MIRRORS[1]}{stem}.gz"] = web.pages[f"{MIRRORS[0]}{stem}.gz"]
    web.pages[f"{MIRRORS[0]}{stem}.gz"] = urllib.error.URLError("connection refused")
    download(tmp_path)
    assert f"{MIRRORS[1]}{stem}.gz" in web.asked
    assert load_fashion_mnist("train", directory=tmp_path).tensors[1].tolist() == [1, 2, 3]


def test_no_mirror_is_one_error_naming_each(web: FakeWeb, tmp_path: Path) -> None:
    web.pages = {}
    with pytest.raises(DataError) as caught:
        download(tmp_path)
    message = str(caught.value)
    assert all(f"{mirror}train-images-idx3-ubyte.gz: HTTP Error 404" in message for mirror in MIRRORS), message
    assert not list(tmp_path.iterdir())


def test_a_damaged_cached_file_is_fetched_again(web: FakeWeb, tmp_path: Path) -> None:
    download(tmp_path)
    cached = tmp_path / "train-labels-idx1-ubyte.gz"
    cached.write_bytes(cached.read_bytes()[:-10])
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()  # so the directory is incomplete and a download runs
    load_fashion_mnist("train", directory=tmp_path, download_if_missing=True)
    assert web.asked[-2:] == [f"{MIRRORS[0]}train-labels-idx1-ubyte.gz", f"{MIRRORS[0]}t10k-labels-idx1-ubyte.gz"]
    assert cached.read_bytes() == web.pages[f"{MIRRORS[0]}train-labels-idx1-ubyte.gz"]
