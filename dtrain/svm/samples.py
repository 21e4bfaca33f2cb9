"""One rank's block of samples, dense (numpy) or sparse (scipy CSR), and the few operations SMO needs on it.

Samples are block-partitioned: rank r of W holds the contiguous global indices [n r / W, n (r+1) / W). A rank
keeps a compacted copy of its *active* samples (the ones not eliminated), so that a kernel row costs work in
proportion to the active set only; `subset` builds that copy when the active set changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dtrain.errors import DataError


def is_sparse(features: Any) -> bool:
    """True for a scipy sparse matrix (anything with `tocsr`)."""
    return hasattr(features, "tocsr") and hasattr(features, "nnz")


def block_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The global indices [start, stop) rank `rank` of `world_size` owns."""
    return n * rank // world_size, n * (rank + 1) // world_size


@dataclass
class SampleBlock:
    """Rows of a float64 matrix (dense ndarray or CSR) with their squared norms."""

    matrix: Any  # np.ndarray (n, d) C-contiguous float64, or scipy.sparse.csr_matrix
    sq_norms: np.ndarray

    @classmethod
    def of(cls, features: Any) -> SampleBlock:
        if is_sparse(features):
            matrix = features.tocsr().astype(np.float64)
            matrix.sort_indices()
            sq = np.asarray(matrix.multiply(matrix).sum(axis=1)).ravel()
        else:
            matrix = np.ascontiguousarray(np.asarray(features, dtype=np.float64))
            if matrix.ndim != 2:
                raise DataError(f"samples must be a 2-D array (n_samples, n_features), not shape {matrix.shape}; "
                                "flatten images first (e.g. X.reshape(len(X), -1))")
            sq = np.einsum("ij,ij->i", matrix, matrix)
        if not np.all(np.isfinite(sq)):
            raise DataError("samples contain NaN or infinite values; clean or impute them before training")
        return cls(matrix, sq)

    @property
    def sparse(self) -> bool:
        return is_sparse(self.matrix)

    def __len__(self) -> int:
        return int(self.matrix.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.matrix.shape[1])

    def dots(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """X @ x for a dense vector x (into `out` when given, dense blocks only)."""
        if self.sparse:
            result = np.asarray(self.matrix @ x).ravel()
            if out is not None:
                np.copyto(out, result)
                return out
            return result
        if out is not None:
            return np.matmul(self.matrix, x, out=out)
        return self.matrix @ x

    def dense_row(self, k: int, out: np.ndarray) -> np.ndarray:
        """Row k as a dense vector written into `out`."""
        if self.sparse:
            out[:] = 0.0
            start, stop = self.matrix.indptr[k], self.matrix.indptr[k + 1]
            out[self.matrix.indices[start:stop]] = self.matrix.data[start:stop]
        else:
            out[:] = self.matrix[k]
        return out

    def dense_rows(self, rows: np.ndarray) -> np.ndarray:
        """Several rows as a dense (len(rows), d) array."""
        picked = self.matrix[rows]
        return np.asarray(picked.toarray()) if self.sparse else np.array(picked)

    def subset(self, rows: np.ndarray) -> SampleBlock:
        """The rows `rows` (positions in this block) as a new compacted block."""
        return SampleBlock(self.matrix[rows], self.sq_norms[rows])
