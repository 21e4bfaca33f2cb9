"""`dtrain.svm.SVC`: a scikit-learn-compatible SVM classifier trained by the distributed SMO.

It runs in one process like scikit-learn's `SVC`, or inside a torch.distributed group (a dtrain run, or any
process group): every rank calls `fit(X, y)` with the same data, each solves its block, and every rank ends
with the same model. Several classes are handled one-vs-one (libsvm's and scikit-learn's way, the default) or
one-vs-rest; each binary problem is solved over all ranks in turn.

The attributes follow scikit-learn's: `classes_`, `support_`, `support_vectors_`, `n_support_`,
`dual_coef_` (libsvm's (n_classes - 1, n_SV) layout for one-vs-one), `intercept_`; and `fit_stats_`, the
solver's figures (iterations, kernel evaluations, communication time, eliminations, final KKT gap).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin

from dtrain.comm.shm import check_mode
from dtrain.errors import ConfigError, DataError
from dtrain.svm.binary import BinaryModel, solve_binary
from dtrain.svm.elimination import EliminationPolicy
from dtrain.svm.kernels import Kernel, resolve_gamma
from dtrain.svm.samples import is_sparse
from dtrain.svm.solver import SolverParams


@dataclass
class Problem:
    """One binary problem of a fit: which rows of X, their labels in {-1, +1}, and the solver's parameters."""

    rows: np.ndarray
    labels: np.ndarray
    params: SolverParams


def process_group() -> tuple[int, int]:
    """(rank, world size) of the torch.distributed group this process is in, or (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shrinking_heuristic(shrinking: bool | str) -> str:
    """scikit-learn's boolean `shrinking` (True: lazy, False: none) or a heuristic's name."""
    if shrinking is True:
        return "lazy"
    if shrinking is False:
        return "none"
    return str(shrinking)


class SVC(ClassifierMixin, BaseEstimator):
    """C-support vector classification (libsvm's formulation) with the distributed SMO solver.

    Parameters as scikit-learn's `SVC` (C, kernel, degree, gamma, coef0, tol, cache_size in MB, class_weight,
    max_iter, decision_function_shape) plus: `shrinking` (True/False or 'none', 'earliest', 'lazy'),
    `shrink_every`, `shrink_patience`, `shrink_gap`, `shrink_margin` (see `dtrain.svm.elimination`),
    `multi_class` ('ovo' or 'ovr'), `working_set` (q: 2 is one pair per collective as in the paper; a larger
    even q solves a q-sample subproblem between collectives), `blas_threads` (BLAS threads per rank) and
    `exchange` (the per-iteration all-gather of a distributed fit: 'auto' takes shared memory when every rank is
    on this host with a core of its own, else gloo; 'gloo' or 'shm' forces one).
    """

    def __init__(self, C: float = 1.0, kernel: str = "rbf", degree: int = 3, gamma: float | str = "scale",
                 coef0: float = 0.0, shrinking: bool | str = True, tol: float = 1e-3, cache_size: float = 200,
                 class_weight: dict[Any, float] | str | None = None, max_iter: int = -1,
                 decision_function_shape: str = "ovr", multi_class: str = "ovo", shrink_every: int = 1000,
                 shrink_patience: int = 2, shrink_gap: float | None = None, shrink_margin: float = 0.0,
                 working_set: int = 2, blas_threads: int = 1, exchange: str = "auto") -> None:
        self.C = C
        self.kernel = kernel
        self.degree = degree
        self.gamma = gamma
        self.coef0 = coef0
        self.shrinking = shrinking
        self.tol = tol
        self.cache_size = cache_size
        self.class_weight = class_weight
        self.max_iter = max_iter
        self.decision_function_shape = decision_function_shape
        self.multi_class = multi_class
        self.shrink_every = shrink_every
        self.shrink_patience = shrink_patience
        self.shrink_gap = shrink_gap
        self.shrink_margin = shrink_margin
        self.working_set = working_set
        self.blas_threads = blas_threads
        self.exchange = exchange

    # ------------------------------------------------------------------ fit

    def check_params(self) -> None:
        """The parameters' rules that need no data, as one ConfigError line for the first one broken: `fit`
        checks them, and `dtrain run` does before any worker starts (SVMTrial.check_hyperparameters)."""
        if not self.C > 0:
            raise ConfigError(f"C ({self.C!r}) must be > 0; use e.g. C: 1.0")
        if not self.tol > 0:
            raise ConfigError(f"tol ({self.tol!r}) must be > 0; use e.g. tol: 0.001")
        if int(self.working_set) < 2 or int(self.working_set) % 2:
            raise ConfigError(f"working_set ({self.working_set!r}) must be an even number >= 2 (2: one pair per "
                              "collective, as the paper; e.g. 64 to batch pair steps between collectives)")
        if self.multi_class not in ("ovo", "ovr"):
            raise ConfigError(f"multi_class {self.multi_class!r} must be 'ovo' or 'ovr'")
        check_mode(str(self.exchange))
        # a gamma named by rule ('scale', 'auto') is resolved from the data in fit; any other must be a number > 0
        gamma = 1.0 if self.gamma in ("scale", "auto") else resolve_gamma(self.gamma, None, 1)
        Kernel(self.kernel, gamma=gamma, degree=int(self.degree), coef0=float(self.coef0))
        self._elimination_policy()

    def _elimination_policy(self) -> EliminationPolicy:
        return EliminationPolicy(shrinking_heuristic(self.shrinking), every=int(self.shrink_every),
                                 patience=int(self.shrink_patience), gap=self.shrink_gap,
                                 margin=float(self.shrink_margin))

    def _params(self, X: Any) -> tuple[Kernel, SolverParams]:
        self.check_params()
        gamma = resolve_gamma(self.gamma, X, X.shape[1])
        kernel = Kernel(self.kernel, gamma=gamma, degree=int(self.degree), coef0=float(self.coef0))
        policy = self._elimination_policy()
        params = SolverParams(kernel=kernel, C=float(self.C), tol=float(self.tol),
                              cache_bytes=int(self.cache_size * 2**20), max_iter=int(self.max_iter), policy=policy,
                              working_set=int(self.working_set), exchange=str(self.exchange))
        return kernel, params

    def _class_weights(self, y: np.ndarray) -> np.ndarray:
        """The C multiplier of each class in `classes_` order."""
        weights = np.ones(len(self.classes_))
        if self.class_weight is None:
            return weights
        if self.class_weight == "balanced":
            counts = np.array([(y == c).sum() for c in self.classes_], dtype=np.float64)
            return len(y) / (len(self.classes_) * counts)
        if not isinstance(self.class_weight, dict):
            raise ConfigError(f"class_weight {self.class_weight!r} must be None, 'balanced' or a dict class -> weight")
        for k, c in enumerate(self.classes_):
            weights[k] = float(self.class_weight.get(c, self.class_weight.get(str(c), 1.0)))
        return weights

    def fit(self, X: Any, y: Any) -> SVC:
        """Train on all ranks of the current process group (or in this process alone)."""
        from threadpoolctl import threadpool_limits

        X, y, problems = self.plan(X, y)
        rank, world = process_group()
        models = []
        with threadpool_limits(limits=int(self.blas_threads), user_api="blas"):
            for problem in problems:
                model, _ = solve_binary(X[problem.rows], problem.labels, problem.params, rank, world)
                models.append(model)
        return self.adopt(X, y, problems, models)

    def plan(self, X: Any, y: Any) -> tuple[Any, np.ndarray, list[Problem]]:
        """Check the data and set `classes_`; (X as float64 or CSR, y, the binary problems to solve in order)."""
        X = X.tocsr() if is_sparse(X) else np.asarray(X, dtype=np.float64)
        y = np.asarray(y)
        if X.ndim != 2 or len(y) != X.shape[0]:
            raise DataError(f"X must be (n_samples, n_features) and y (n_samples,); got {X.shape} and {y.shape}")
        self.classes_ = np.unique(y)
        if len(self.classes_) < 2:
            raise DataError(f"y has one class ({self.classes_[0]!r}); an SVM needs at least two")
        self.n_features_in_ = X.shape[1]
        self._kernel, params = self._params(X)
        weights = self._class_weights(y)
        problems = []
        for positive, negative in self._pairs():
            rows = np.flatnonzero(np.isin(y, [self.classes_[k] for k in positive + negative]))
            labels = np.where(np.isin(y[rows], [self.classes_[k] for k in positive]), 1.0, -1.0)
            w_neg = weights[negative[0]] if len(negative) == 1 else 1.0
            w_pos = weights[positive[0]] if len(positive) == 1 else 1.0
            problems.append(Problem(rows, labels, replace(params, class_weight=(w_neg, w_pos))))
        return X, y, problems

    def adopt(self, X: Any, y: np.ndarray, problems: list[Problem], models: list[BinaryModel]) -> SVC:
        """Take the solved problems' models as this estimator's (the last step of `fit`)."""
        self._problems = [(problem.rows, model) for problem, model in zip(problems, models, strict=True)]
        self._build_attributes(X, y)
        self.fit_stats_ = summarize([{"dual_objective": m.dual_objective, "ranks": m.stats} for m in models])
        return self

    def _pairs(self) -> list[tuple[list[int], list[int]]]:
        """(positive classes, negative classes) of each binary problem, by class index."""
        k = len(self.classes_)
        if k == 2:
            return [([1], [0])]  # positive decision -> classes_[1], as scikit-learn
        if self.multi_class == "ovr":
            return [([c], [o for o in range(k) if o != c]) for c in range(k)]
        return [([a], [b]) for a, b in combinations(range(k), 2)]  # positive -> the lower class (libsvm)

    def _build_attributes(self, X: Any, y: np.ndarray) -> None:
        """support_, support_vectors_, n_support_, dual_coef_, intercept_ in scikit-learn's layout."""
        sv_rows = np.unique(np.concatenate([rows[m.support] for rows, m in self._problems]))
        y_sv = np.searchsorted(self.classes_, y[sv_rows])
        order = np.lexsort((sv_rows, y_sv))  # grouped by class, as libsvm orders them
        self.support_ = sv_rows[order].astype(np.int32)
        index_of = {int(r): k for k, r in enumerate(self.support_)}
        dense = X[self.support_]
        self.support_vectors_ = np.asarray(dense.toarray()) if is_sparse(dense) else np.array(dense)
        sv_class = y_sv[order]
        self.n_support_ = np.array([(sv_class == k).sum() for k in range(len(self.classes_))], dtype=np.int32)
        self._columns: list[tuple[np.ndarray, np.ndarray]] = []  # per problem: (columns in support_, coef)
        for rows, model in self._problems:
            self._columns.append((np.array([index_of[int(r)] for r in rows[model.support]], dtype=np.int64),
                                  model.coef))
        self.intercept_ = np.array([-m.rho for _, m in self._problems])
        width = len(self.support_)
        if len(self.classes_) == 2 or self.multi_class == "ovr":
            self.dual_coef_ = np.zeros((len(self._problems), width))
            for p, (cols, coef) in enumerate(self._columns):
                self.dual_coef_[p, cols] = coef
            return
        self.dual_coef_ = np.zeros((len(self.classes_) - 1, width))
        for (a, b), (cols, coef) in zip(combinations(range(len(self.classes_)), 2), self._columns, strict=True):
            in_a = sv_class[cols] == a
            self.dual_coef_[b - 1, cols[in_a]] = coef[in_a]  # libsvm: class a's SVs of (a, b) in row b-1
            self.dual_coef_[a, cols[~in_a]] = coef[~in_a]  # class b's in row a

    # ------------------------------------------------------------------ predict

    def _check_fitted(self) -> None:
        if not hasattr(self, "support_"):
            from sklearn.exceptions import NotFittedError

            raise NotFittedError("this SVC is not fitted yet; call fit(X, y) first")

    def _raw(self, X: Any) -> np.ndarray:
        """(n, n_problems) decision values of every binary problem."""
        self._check_fitted()
        X = X.toarray() if is_sparse(X) else np.asarray(X, dtype=np.float64)
        if X.shape[1] != self.n_features_in_:
            raise DataError(f"X has {X.shape[1]} features, the model was fitted with {self.n_features_in_}")
        gram = np.empty((len(X), len(self.support_)))
        for start in range(0, len(X), 4096):
            gram[start:start + 4096] = self._kernel.block(X[start:start + 4096], self.support_vectors_)
        return np.stack([gram[:, cols] @ coef for cols, coef in self._columns], axis=1) + self.intercept_

    def decision_function(self, X: Any) -> np.ndarray:
        """Binary: (n,), positive for classes_[1]. One-vs-rest: (n, n_classes). One-vs-one: (n, pairs) with
        decision_function_shape='ovo', else scikit-learn's (n, n_classes) transform of votes and confidences."""
        raw = self._raw(X)
        if len(self.classes_) == 2:
            return raw[:, 0]
        if self.multi_class == "ovr" or self.decision_function_shape == "ovo":
            return raw
        return ovr_from_ovo(raw, len(self.classes_))

    def predict(self, X: Any) -> np.ndarray:
        raw = self._raw(X)
        k = len(self.classes_)
        if k == 2:
            return self.classes_[(raw[:, 0] > 0).astype(int)]
        if self.multi_class == "ovr":
            return self.classes_[np.argmax(raw, axis=1)]
        votes = np.zeros((len(raw), k), dtype=np.int64)
        for p, (a, b) in enumerate(combinations(range(k), 2)):
            wins_a = raw[:, p] > 0
            votes[wins_a, a] += 1
            votes[~wins_a, b] += 1
        return self.classes_[np.argmax(votes, axis=1)]  # ties: the lowest class, as libsvm

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        return tags


def ovr_from_ovo(raw: np.ndarray, n_classes: int) -> np.ndarray:
    """scikit-learn's one-vs-rest shape from one-vs-one values: votes plus confidences squashed below 1/3."""
    votes = np.zeros((len(raw), n_classes))
    confidence = np.zeros((len(raw), n_classes))
    for p, (a, b) in enumerate(combinations(range(n_classes), 2)):
        confidence[:, a] += raw[:, p]
        confidence[:, b] -= raw[:, p]
        votes[raw[:, p] > 0, a] += 1
        votes[raw[:, p] <= 0, b] += 1
    return votes + confidence / (3 * (np.abs(confidence) + 1))


def summarize(problems: list[dict[str, Any]]) -> dict[str, Any]:
    """The fit's figures over all binary problems and ranks."""
    ranks = [r for p in problems for r in p["ranks"]]
    world = len(problems[0]["ranks"]) if problems else 1
    per_rank_eliminated = [sum(p["ranks"][r]["eliminated"] for p in problems) for r in range(world)]
    per_rank_reactivated = [sum(p["ranks"][r]["reactivated"] for p in problems) for r in range(world)]
    first = [p["ranks"][0] for p in problems]
    return {
        "problems": len(problems),
        "world_size": world,
        "iterations": sum(s["iterations"] for s in first),
        "kernel_evaluations": sum(s["kernel_evaluations"] for s in ranks),
        "rows_computed": sum(s.get("rows_computed", 0) for s in first),  # on rank 0 (every rank computes the same)
        "comm_seconds": max(sum(p["ranks"][r]["comm_seconds"] for p in problems) for r in range(world)),
        "solve_seconds": max(sum(p["ranks"][r]["solve_seconds"] for p in problems) for r in range(world)),
        "check_seconds": max(sum(p["ranks"][r].get("check_seconds", 0.0) for p in problems) for r in range(world)),
        "reconstruct_seconds": max(sum(p["ranks"][r].get("reconstruct_seconds", 0.0) for p in problems)
                                   for r in range(world)),
        "eliminated_per_rank": per_rank_eliminated,
        "reactivated_per_rank": per_rank_reactivated,
        "eliminated": sum(per_rank_eliminated),
        "reactivated": sum(per_rank_reactivated),
        "rechecks": sum(s["rechecks"] for s in first),
        "final_kkt_gap": max(s["final_gap"] for s in first),
        "exchange": first[0].get("exchange", "local") if first else "local",
        "converged": all(s["converged"] for s in first),
        "dual_objective": sum(p["dual_objective"] for p in problems),
        "dual_objectives": [p["dual_objective"] for p in problems],
    }
