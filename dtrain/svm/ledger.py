"""What lets a rank rebuild the f of its eliminated samples without communication.

Every rank applies every pair update of the run, and the packed exchange gives it both samples' features, so
every rank can keep the same ledger: for each sample that ever entered the working pair, the sum of its
coefficient changes Delta(alpha_g y_g) and its features. An eliminated sample k stopped receiving updates at
its elimination; its f is brought up to date with

    f_k += sum_g (acc_g(now) - acc_g(then)) K(x_k, x_g)

over the samples whose coefficient changed since, which is exact (f is linear in alpha y) and costs one small
kernel block instead of a pass over all support vectors. `then` is a snapshot of the accumulator taken when the
sample was eliminated (one per elimination check, shared by the samples eliminated there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dtrain.svm.kernels import Kernel


@dataclass
class Epoch:
    """Samples (positions in the rank's block) eliminated together, and the accumulator when they were."""

    positions: np.ndarray
    snapshot: dict[int, float]


@dataclass
class Ledger:
    """Cumulative Delta(alpha y) per global index, with features, and the open elimination epochs."""

    acc: dict[int, float] = field(default_factory=dict)
    features: dict[int, np.ndarray] = field(default_factory=dict)
    epochs: list[Epoch] = field(default_factory=list)

    def record(self, index: int, delta: float, x: np.ndarray) -> None:
        self.acc[index] = self.acc.get(index, 0.0) + delta
        if index not in self.features:
            self.features[index] = x.copy()

    def open_epoch(self, positions: np.ndarray) -> None:
        self.epochs.append(Epoch(positions, dict(self.acc)))

    def changes_since(self, snapshot: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
        """(global indices, coefficient changes) of the samples whose alpha y changed since `snapshot`."""
        keys = [g for g, value in self.acc.items() if value != snapshot.get(g, 0.0)]
        deltas = np.array([self.acc[g] - snapshot.get(g, 0.0) for g in keys], dtype=np.float64)
        return np.array(keys, dtype=np.int64), deltas

    def reconstruct(self, f: np.ndarray, dense_rows: Callable[[np.ndarray], np.ndarray], kernel: Kernel,
                    chunk: int = 2048) -> int:
        """Bring f of every eliminated sample up to date (in place); return the kernel evaluations spent.

        `dense_rows(positions)` gives the samples' features as a dense block. Afterwards every eliminated f is
        current, so the ledger starts afresh: one epoch holding them all, an empty accumulator (so a run
        resumed from a checkpoint, whose ledger starts empty, continues with exactly the same numbers).
        """
        evaluations = 0
        for epoch in self.epochs:
            keys, deltas = self.changes_since(epoch.snapshot)
            if len(keys) == 0 or len(epoch.positions) == 0:
                continue
            changed = np.stack([self.features[int(g)] for g in keys])
            for start in range(0, len(epoch.positions), chunk):
                rows = epoch.positions[start:start + chunk]
                block = kernel.block(dense_rows(rows), changed)
                f[rows] += block @ deltas
                evaluations += block.size
        positions = [e.positions for e in self.epochs if len(e.positions)]
        merged = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
        self.acc, self.features = {}, {}
        self.epochs = [Epoch(merged, {})] if len(merged) else []
        return evaluations

    def drop(self, positions: np.ndarray) -> None:
        """Forget `positions` (reactivated samples) in every epoch."""
        for epoch in self.epochs:
            epoch.positions = epoch.positions[~np.isin(epoch.positions, positions)]
        self.epochs = [e for e in self.epochs if len(e.positions)]
