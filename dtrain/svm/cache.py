"""A least-recently-used cache of kernel rows, bounded by bytes.

A row is K(x_g, active samples of this rank) for a working sample with global index g. The rows follow the
active set: when samples are eliminated, each cached row is compacted the same way, lazily, the next time it is
read (so a row handed out always lines up with the rank's compacted arrays, and an elimination costs nothing
for rows never used again: compacting all of a 200 MB cache at every elimination check cost more than the
elimination saved). However many compactions a row has missed, it is compacted with one gather: the cache
keeps, for every earlier layout, the map from the current positions to that layout's positions. When samples
come back the cache is emptied, because its rows lack the returning samples' entries. Each rank caches rows
over its own block only, so W ranks together hold W times the rows one process could (the super-linear
effect the parallel SMO papers report).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class KernelRowCache:
    """Rows by global sample index, evicting the least recently used beyond `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(int(budget_bytes), 0)
        self._rows: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()  # row, the layout it is in
        self._maps: list[np.ndarray] = []  # _maps[s]: current positions in layout s (layout s: after s compactions)
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: int) -> np.ndarray | None:
        entry = self._rows.get(key)
        if entry is None:
            self.misses += 1
            return None
        row, layout = entry
        if layout < len(self._maps):
            self.bytes -= row.nbytes
            row = row[self._maps[layout]]
            self.bytes += row.nbytes
            self._rows[key] = (row, len(self._maps))
        self._rows.move_to_end(key)
        self.hits += 1
        return row

    def put(self, key: int, row: np.ndarray) -> None:
        """Keep `row` (unless it alone exceeds the budget), evicting old rows to make room."""
        if row.nbytes > self.budget_bytes:
            return
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old[0].nbytes
        while self._rows and self.bytes + row.nbytes > self.budget_bytes:
            _, (evicted, _) = self._rows.popitem(last=False)
            self.bytes -= evicted.nbytes
        self._rows[key] = (row, len(self._maps))
        self.bytes += row.nbytes

    def compact(self, keep: np.ndarray) -> None:
        """Every row keeps only the entries at positions `keep` (the samples that stay active), when next read."""
        keep = np.asarray(keep, dtype=np.int64)
        self._maps = [positions[keep] for positions in self._maps]
        self._maps.append(keep)

    def clear(self) -> None:
        self._rows.clear()
        self._maps.clear()
        self.bytes = 0
