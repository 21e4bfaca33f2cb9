"""Reader for the IDX format of (Fashion-)MNIST, plain or gzip-compressed, with checks that name the file."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.errors import DataError

_DTYPES: dict[int, Any] = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
           0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _read_bytes(path: Path) -> bytes:
    try:
        with path.open("rb") as handle:
            head = handle.read(2)
            handle.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=handle) as unzipped:
                    return unzipped.read()
            return handle.read()
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist; check the data directory") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"data file {path} cannot be read ({exc}); the download is probably truncated: "
                        "delete it and fetch it again") from None


def read_idx(path: str | Path, expected_ndim: int | None = None) -> np.ndarray:
    """Return the array stored in an IDX file, checking its magic number, dimensions and length."""
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise DataError(f"data file {path} is not an IDX file (magic bytes {raw[:4].hex() or 'missing'}, "
                        "expected 0000 08|09|0b|0c|0d|0e followed by the dimension count); "
                        "point the loader at the (Fashion-)MNIST IDX files")
    dtype = np.dtype(_DTYPES[raw[2]])
    ndim = raw[3]
    if expected_ndim is not None and ndim != expected_ndim:
        raise DataError(f"data file {path} has {ndim} dimensions where {expected_ndim} are expected; "
                        "images and labels may be swapped")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"data file {path} ends inside its header ({len(raw)} bytes); fetch it again")
    shape = struct.unpack(f">{ndim}I", raw[4:header_len])
    expected_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    body = len(raw) - header_len
    if body != expected_bytes:
        rule = "truncated" if body < expected_bytes else "longer than its header says"
        raise DataError(f"data file {path} is {rule}: {body} data bytes for shape {tuple(shape)} "
                        f"({expected_bytes} expected); fetch it again")
    return np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape).astype(dtype.newbyteorder("="))
