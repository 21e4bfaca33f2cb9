"""The SVM solver in one process against scikit-learn's SVC (libsvm) as the oracle: binary and one-vs-one
digits with each kernel and elimination heuristic, CSR input, a larger working set, a forced false-positive
elimination, resuming from a solver's state, the row cache and the estimator API."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.svm import SVC as OracleSVC

from dtrain.errors import ConfigError
from dtrain.svm import SVC
from dtrain.svm.binary import make_solver
from dtrain.svm.cache import KernelRowCache
from dtrain.svm.datasets import digits
from dtrain.svm.elimination import EliminationPolicy
from dtrain.svm.kernels import Kernel
from dtrain.svm.oracle import compare
from dtrain.svm.solver import SolverParams

# the issue's bar: dual objective within 1e-3 relative, SV sets within 1 %, test accuracy within 0.2 points
OBJECTIVE, SUPPORT, ACCURACY = 1e-3, 0.01, 0.2


@pytest.fixture(scope="module")
def three_vs_eight() -> tuple[np.ndarray, ...]:
    (X, y), (Xt, yt) = digits(classes=(3, 8))
    return X, y, Xt, yt


def kernel_of(params: dict[str, object], X: np.ndarray) -> Kernel:
    gamma = float(params.get("gamma", 1.0 / (X.shape[1] * X.var())))  # type: ignore[arg-type]
    return Kernel(str(params.get("kernel", "rbf")), gamma=gamma, degree=int(params.get("degree", 3)),  # type: ignore[call-overload]
                  coef0=float(params.get("coef0", 0.0)))  # type: ignore[arg-type]


KERNELS = {"rbf": {"C": 10.0, "gamma": 0.05}, "linear": {"C": 0.5, "kernel": "linear"},
           "poly": {"C": 1.0, "kernel": "poly", "gamma": 0.1, "degree": 3, "coef0": 1.0}}


@pytest.mark.parametrize("shrinking", ["none", "earliest", "lazy"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_binary_matches_libsvm(three_vs_eight: tuple[np.ndarray, ...], kernel: str, shrinking: str) -> None:
    X, y, Xt, yt = three_vs_eight
    params = KERNELS[kernel]
    ours = SVC(shrinking=shrinking, shrink_every=20, **params).fit(X, y)  # type: ignore[arg-type]
    oracle = OracleSVC(**params).fit(X, y)  # type: ignore[arg-type]
    found = compare(ours, oracle, kernel_of(params, X), Xt, yt)
    assert found["objective_relative"] < OBJECTIVE, found
    assert found["support_mismatch"] <= SUPPORT, found
    assert found["accuracy_points"] <= ACCURACY, found
    assert np.abs(ours.decision_function(Xt) - oracle.decision_function(Xt)).max() < 0.02
    stats = ours.fit_stats_
    assert stats["converged"] and stats["final_kkt_gap"] <= 1e-3
    if shrinking != "none":
        assert stats["eliminated"] > 0  # the heuristic did act on this problem


@pytest.mark.parametrize("shrinking", ["none", "lazy"])
def test_one_vs_one_digits_matches_libsvm(shrinking: str) -> None:
    (X, y), (Xt, yt) = digits()
    ours = SVC(C=10.0, gamma=0.05, shrinking=shrinking, shrink_every=50).fit(X, y)
    oracle = OracleSVC(C=10.0, gamma=0.05).fit(X, y)
    found = compare(ours, oracle, Kernel("rbf", 0.05), Xt, yt)
    assert found["objective_relative"] < OBJECTIVE, found
    assert found["support_mismatch"] <= SUPPORT, found
    assert found["accuracy_points"] <= ACCURACY, found
    assert np.array_equal(ours.n_support_, oracle.n_support_) or found["support_mismatch"] > 0
    assert ours.dual_coef_.shape[0] == 9 and ours.intercept_.shape == (45,)
    ovo = ours.set_params(decision_function_shape="ovo").decision_function(Xt)
    reference = OracleSVC(C=10.0, gamma=0.05, decision_function_shape="ovo").fit(X, y).decision_function(Xt)
    assert np.abs(ovo - reference).max() < 0.02


def test_one_vs_rest_trains_one_problem_per_class() -> None:
    (X, y), (Xt, yt) = digits(classes=(0, 1, 2))
    model = SVC(C=10.0, gamma=0.05, multi_class="ovr").fit(X, y)
    assert model.decision_function(Xt).shape == (len(Xt), 3) and model.fit_stats_["problems"] == 3
    assert model.score(Xt, yt) > 0.97


def test_csr_input_gives_the_dense_solution(three_vs_eight: tuple[np.ndarray, ...]) -> None:
    X, y, Xt, yt = three_vs_eight
    dense = SVC(C=10.0, gamma=0.05).fit(X, y)
    sparse = SVC(C=10.0, gamma=0.05).fit(sp.csr_matrix(X), y)
    assert np.array_equal(dense.support_, sparse.support_)
    np.testing.assert_allclose(sparse.dual_coef_, dense.dual_coef_, rtol=0, atol=1e-9)
    np.testing.assert_allclose(sparse.decision_function(sp.csr_matrix(Xt)), dense.decision_function(Xt), atol=1e-9)


def test_a_larger_working_set_reaches_the_same_solution(three_vs_eight: tuple[np.ndarray, ...]) -> None:
    X, y, Xt, yt = three_vs_eight
    ours = SVC(C=10.0, gamma=0.05, working_set=16).fit(X, y)
    oracle = OracleSVC(C=10.0, gamma=0.05).fit(X, y)
    found = compare(ours, oracle, Kernel("rbf", 0.05), Xt, yt)
    assert found["objective_relative"] < OBJECTIVE and found["support_mismatch"] <= SUPPORT, found


def overlapping_blobs(n: int = 240, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Two overlapping Gaussian clouds in 5-D: many bounded alphas, so eliminations happen early."""
    rng = np.random.default_rng(seed)
    y = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    return rng.normal(size=(n, 5)) + 0.8 * y[:, None], y


def test_forced_false_positive_is_reconstructed_to_the_exact_solution() -> None:
    """An aggressive heuristic (earliest, every iteration, a wide margin) eliminates samples that later violate;
    at convergence their f is rebuilt from the ledger, they come back, and the solve ends at the solution of
    the run without elimination, with every f equal to a from-scratch sum_l alpha_l y_l K_kl - y_k."""
    X, y = overlapping_blobs()
    kernel = Kernel("rbf", gamma=0.2)
    results = {}
    for name, policy in {"none": EliminationPolicy("none"),
                         "aggressive": EliminationPolicy("earliest", every=1, margin=1.0)}.items():
        solver = make_solver(X, y, SolverParams(kernel=kernel, C=5.0, tol=1e-6, policy=policy), 0, 1)
        assert solver.solve()
        results[name] = solver
    aggressive, plain = results["aggressive"], results["none"]
    assert aggressive.stats.reactivated > 0 and aggressive.stats.rechecks > 1  # false positives happened
    direct = kernel.block(X, X) @ (aggressive.alpha * y) - y
    np.testing.assert_allclose(aggressive.f, direct, rtol=0, atol=1e-9)
    assert aggressive.stats.final_gap <= 1e-6
    np.testing.assert_allclose(aggressive.alpha, plain.alpha, rtol=0, atol=1e-5)
    assert abs(aggressive.dual_objective() - plain.dual_objective()) < 1e-9 * abs(plain.dual_objective())


def test_resuming_from_a_solver_state_continues_bitwise() -> None:
    """What a checkpoint holds (alpha, f brought up to date, active set, streaks) is enough to continue exactly."""
    X, y = overlapping_blobs(seed=5)
    params = SolverParams(kernel=Kernel("rbf", 0.2), C=5.0, policy=EliminationPolicy("lazy", every=10, patience=2))
    whole = make_solver(X, y, params, 0, 1)
    halves = make_solver(X, y, params, 0, 1)
    assert not halves.solve(60)
    state = halves.local_state()
    whole.solve(60)
    whole.local_state()  # the uninterrupted run checkpoints at the same point
    resumed = make_solver(X, y, params, 0, 1)
    resumed.load_global(state["alpha"], state["f"], state["active"], state["streak"], 60, False)
    assert resumed.solve() and whole.solve()
    assert np.array_equal(resumed.alpha, whole.alpha)


def test_row_cache_keeps_to_its_byte_budget_and_follows_compaction() -> None:
    cache = KernelRowCache(budget_bytes=3 * 80)
    for key in range(5):
        cache.put(key, np.full(10, float(key)))
    assert len(cache) == 3 and cache.bytes <= 240 and cache.get(0) is None and cache.get(4) is not None
    cache.put(3, np.arange(10.0))
    cache.compact(np.array([0, 2, 4, 5, 9]))
    cache.compact(np.array([1, 2, 4]))  # two compactions before the row is read: applied in order
    row = cache.get(4)
    assert row is not None and row.shape == (3,) and cache.bytes == 2 * 80 + 24
    assert np.array_equal(cache.get(3), [2.0, 4.0, 9.0]) and cache.bytes == 80 + 2 * 24
    cache.put(7, np.zeros(3))  # a row computed after the compactions is not compacted again
    assert cache.get(7).shape == (3,)  # type: ignore[union-attr]


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_rows_and_blocks_match_scikit_learn(three_vs_eight: tuple[np.ndarray, ...], kernel: str) -> None:
    """A row (the SMO loop's) and a block (the reconstruction's) against scikit-learn's pairwise kernels, to 1e-12."""
    from sklearn.metrics.pairwise import linear_kernel, polynomial_kernel, rbf_kernel

    X = three_vs_eight[0][:40]
    ours = kernel_of(KERNELS[kernel], X)
    reference = {"rbf": lambda a, b: rbf_kernel(a, b, gamma=ours.gamma), "linear": linear_kernel,
                 "poly": lambda a, b: polynomial_kernel(a, b, degree=ours.degree, gamma=ours.gamma,
                                                        coef0=ours.coef0)}[kernel](X[:25], X)
    np.testing.assert_allclose(ours.block(X[:25], X), reference, rtol=1e-12, atol=1e-12)
    sq = np.einsum("ij,ij->i", X, X)
    np.testing.assert_allclose(ours.from_dots(X @ X[3], float(sq[3]), sq), reference[3], rtol=1e-12, atol=1e-12)


def test_row_cache_compacts_rows_of_any_age_like_the_active_set() -> None:
    """Rows put at different times and read after any number of compactions line up with the active samples: a
    row's entries are the sample ids it was computed over, so each read must give the ids still active."""
    rng = np.random.default_rng(7)
    cache = KernelRowCache(budget_bytes=10**6)
    active = np.arange(50.0)  # the ids of the active samples, in the rank's compacted order
    rows: dict[int, int] = {}  # key -> compactions seen when the row was put
    for step in range(60):
        action = rng.integers(3)
        if action == 0 or not rows:
            key = int(rng.integers(1000))
            cache.put(key, active.copy())
            rows[key] = step
        elif action == 1 and len(active) > 5:
            keep = np.sort(rng.choice(len(active), size=len(active) - int(rng.integers(1, 4)), replace=False))
            cache.compact(keep)
            active = active[keep]
        else:
            key = int(rng.choice(list(rows)))
            row = cache.get(key)
            assert row is not None and np.array_equal(row, active)
    assert cache.bytes == sum(entry[0].nbytes for entry in cache._rows.values())


def test_estimator_api() -> None:
    model = SVC(C=3.0, kernel="linear", shrinking="earliest")
    assert clone(model).get_params()["C"] == 3.0
    assert model.set_params(C=2.0).C == 2.0
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        model.predict(np.zeros((1, 4)))
    with pytest.raises(ConfigError, match="shrinking 'sometimes'"):
        SVC(shrinking="sometimes").fit(np.eye(4), [0, 1, 0, 1])
    with pytest.raises(ConfigError, match="kernel 'sigmoid'"):
        SVC(kernel="sigmoid").fit(np.eye(4), [0, 1, 0, 1])
