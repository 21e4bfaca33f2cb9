"""A least-recently-used cache of kernel rows, bounded by bytes.

A row is K(x_g, active samples of this rank) for a working sample with global index g. The rows follow the
active set: when samples are eliminated every cached row is compacted the same way (so a cached row always
lines up with the rank's compacted arrays); when samples come back the cache is emptied, because its rows
lack the returning samples' entries. Each rank caches rows over its own block only, so W ranks together hold
W times the rows one process could (the super-linear effect the parallel SMO papers report).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class KernelRowCache:
    """Rows by global sample index, evicting the least recently used beyond `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(int(budget_bytes), 0)
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: int) -> np.ndarray | None:
        row = self._rows.get(key)
        if row is None:
            self.misses += 1
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return row

    def put(self, key: int, row: np.ndarray) -> None:
        """Keep `row` (unless it alone exceeds the budget), evicting old rows to make room."""
        if row.nbytes > self.budget_bytes:
            return
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        while self._rows and self.bytes + row.nbytes > self.budget_bytes:
            _, evicted = self._rows.popitem(last=False)
            self.bytes -= evicted.nbytes
        self._rows[key] = row
        self.bytes += row.nbytes

    def compact(self, keep: np.ndarray) -> None:
        """Every row keeps only the entries at positions `keep` (the samples that stay active)."""
        for key, row in self._rows.items():
            self._rows[key] = row[keep]
        self.bytes = sum(row.nbytes for row in self._rows.values())

    def clear(self) -> None:
        self._rows.clear()
        self.bytes = 0
