"""The kernels (linear, RBF, polynomial) as libsvm defines them, evaluated one row or one block at a time.

A row is K(x, X) for one sample x against a rank's (active) samples: the SMO loop needs two per iteration, so
the row is built from one matrix-vector product plus a few elementwise operations in float64, and the squared
norms of the samples are computed once (RBF: |x|^2 + |X_k|^2 - 2 x.X_k, as libsvm does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dtrain.errors import ConfigError

KERNELS = ("linear", "rbf", "poly")


@dataclass(frozen=True)
class Kernel:
    """K(x, z): linear x.z; rbf exp(-gamma |x - z|^2); poly (gamma x.z + coef0)^degree."""

    name: str = "rbf"
    gamma: float = 1.0
    degree: int = 3
    coef0: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in KERNELS:
            raise ConfigError(f"kernel {self.name!r} is not one of {', '.join(KERNELS)}; pick one of them")
        if self.name != "linear" and not self.gamma > 0:
            raise ConfigError(f"gamma {self.gamma!r} must be > 0 for the {self.name} kernel; use e.g. "
                              "gamma: scale or a positive number")

    def from_dots(self, dots: np.ndarray, x_sq: float, sq_norms: np.ndarray, out: np.ndarray | None = None
                  ) -> np.ndarray:
        """The kernel values from the dot products `dots` = X.x (modified in place when `out` is `dots`)."""
        out = dots if out is None else out
        if self.name == "linear":
            if out is not dots:
                np.copyto(out, dots)
            return out
        if self.name == "rbf":
            # exp(-g (|x|^2 + |X|^2 - 2 x.X)); clamp tiny negative distances from rounding at 0
            np.multiply(dots, -2.0, out=out)
            out += sq_norms
            out += x_sq
            np.maximum(out, 0.0, out=out)
            out *= -self.gamma
            np.exp(out, out=out)
            return out
        np.multiply(dots, self.gamma, out=out)
        out += self.coef0
        np.power(out, self.degree, out=out)
        return out

    def diagonal(self, sq_norms: np.ndarray) -> np.ndarray:
        """K(x_k, x_k) for every sample, from its squared norm."""
        if self.name == "linear":
            return sq_norms.copy()
        if self.name == "rbf":
            return np.ones_like(sq_norms)
        return np.power(self.gamma * sq_norms + self.coef0, self.degree)

    def pair(self, x: np.ndarray, z: np.ndarray) -> float:
        """K(x, z) for two dense vectors."""
        if self.name == "rbf":
            diff = x - z
            return float(np.exp(-self.gamma * float(diff @ diff)))
        dot = float(x @ z)
        return dot if self.name == "linear" else float((self.gamma * dot + self.coef0) ** self.degree)

    def block(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """K(left_a, right_b) for two dense blocks (rows are samples), built in place on the product (the
        reconstruction's blocks are millions of values: no temporaries of that size)."""
        out = left @ right.T
        if self.name == "linear":
            return out
        if self.name == "rbf":
            out *= -2.0
            out += np.einsum("ij,ij->i", left, left)[:, None]
            out += np.einsum("ij,ij->i", right, right)[None, :]
            np.maximum(out, 0.0, out=out)
            out *= -self.gamma
            return np.exp(out, out=out)
        out *= self.gamma
        out += self.coef0
        return np.power(out, self.degree, out=out)


def resolve_gamma(gamma: float | str, features: np.ndarray | object, n_features: int) -> float:
    """scikit-learn's meaning of gamma: a number, 'scale' = 1 / (n_features * X.var()), 'auto' = 1 / n_features."""
    if isinstance(gamma, str):
        if gamma == "auto":
            return 1.0 / n_features
        if gamma == "scale":
            variance = _variance(features)
            return 1.0 / (n_features * variance) if variance > 0 else 1.0
        raise ConfigError(f"gamma {gamma!r} must be a positive number, 'scale' or 'auto'")
    return float(gamma)


def _variance(features: object) -> float:
    if hasattr(features, "multiply"):  # scipy sparse: E[x^2] - E[x]^2 over all entries
        sparse: Any = features  # a scipy sparse matrix (scipy has no type hints here)
        size = sparse.shape[0] * sparse.shape[1]
        mean = float(sparse.sum()) / size
        return float(sparse.multiply(sparse).sum()) / size - mean * mean
    return float(np.asarray(features, dtype=np.float64).var())
