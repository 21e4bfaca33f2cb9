"""How a trained model is compared with scikit-learn's `SVC` (libsvm), the oracle of the tests and benchmark.

Both models are read the same way: the per-problem coefficients are taken from the `dual_coef_` layout of
scikit-learn (libsvm's, for one-vs-one), and each problem's dual objective 1/2 c'Kc - sum |c| is evaluated
from them, so the comparison checks the layout as well as the solution.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import numpy as np

from dtrain.svm.kernels import Kernel


def problem_coefficients(model: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """(positions in support_, coefficients alpha*y) of each binary problem, from `dual_coef_`."""
    dual = np.asarray(model.dual_coef_)
    if len(model.classes_) == 2:
        cols = np.flatnonzero(dual[0])
        return [(cols, dual[0, cols])]
    starts = np.concatenate([[0], np.cumsum(model.n_support_)])
    out = []
    for a, b in combinations(range(len(model.classes_)), 2):
        in_a = np.arange(starts[a], starts[a + 1])
        in_b = np.arange(starts[b], starts[b + 1])
        cols = np.concatenate([in_a, in_b])
        coef = np.concatenate([dual[b - 1, in_a], dual[a, in_b]])
        keep = coef != 0
        out.append((cols[keep], coef[keep]))
    return out


def dual_objectives(model: Any, kernel: Kernel) -> list[float]:
    """1/2 c'Kc - sum |c| of each binary problem (libsvm's minimised dual value)."""
    vectors = np.asarray(model.support_vectors_.toarray() if hasattr(model.support_vectors_, "toarray")
                         else model.support_vectors_, dtype=np.float64)
    values = []
    for cols, coef in problem_coefficients(model):
        x = vectors[cols]
        values.append(float(0.5 * coef @ kernel.block(x, x) @ coef - np.abs(coef).sum()))
    return values


def compare(ours: Any, oracle: Any, kernel: Kernel, X_test: np.ndarray, y_test: np.ndarray) -> dict[str, float]:
    """The figures the issue's correctness bar names: the dual objective's relative difference (summed over
    problems), the share of support vectors not in both models, the test accuracy difference in points."""
    mine = sum(dual_objectives(ours, kernel))
    theirs = sum(dual_objectives(oracle, kernel))
    a, b = set(map(int, ours.support_)), set(map(int, oracle.support_))
    return {"objective_relative": abs(mine - theirs) / abs(theirs),
            "support_mismatch": len(a ^ b) / max(len(b), 1),
            "accuracy_points": 100.0 * abs(float(ours.score(X_test, y_test)) - float(oracle.score(X_test, y_test))),
            "objective": mine, "oracle_objective": theirs, "n_support": float(len(a)),
            "oracle_n_support": float(len(b))}
