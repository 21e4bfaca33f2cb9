"""The all-reduce calibration's fit, T(S) = 2(n-1)*alpha + 2(n-1)/n * S * beta, on given (bytes, seconds) points:
exact answers worked out by hand, and an independent least-squares solve for noisy points. The measuring path is
only smoke-tested (tests/distributed/test_plan_calibrate.py): the fit is the part with an answer."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain.calibrate.calibrate import fit_ring_alpha_beta

TOL = 1e-9  # relative


def test_two_points_are_reproduced_exactly() -> None:
    # n = 2: T = 2*alpha + S*beta; beta = (2.2 ms - 1.2 ms) / 10000 B = 1e-7 s/B; 2*alpha = 1.2 ms - 0.1 ms
    alpha, beta = fit_ring_alpha_beta([(1000, 1.2e-3), (11000, 2.2e-3)], ranks=2)
    assert (alpha, beta) == pytest.approx((5.5e-4, 1e-7), rel=TOL)


def test_four_ranks_scale_the_terms() -> None:
    # n = 4: T = 6*alpha + 1.5*S*beta; with alpha = 10 us and beta = 2 ns/B: 60 us + 3 ns/B * S
    alpha, beta = fit_ring_alpha_beta([(4096, 60e-6 + 3e-9 * 4096), (1 << 20, 60e-6 + 3e-9 * (1 << 20))], ranks=4)
    assert (alpha, beta) == pytest.approx((10e-6, 2e-9), rel=TOL)


def test_a_negative_latency_is_refitted_through_the_origin() -> None:
    # the line through (1000, 1 ms) and (2000, 3 ms) crosses zero at 500 B: alpha < 0, so beta alone, by least
    # squares on relative error: beta = sum(S/T) / sum((S/T)^2) = (5e6/3) / (13e12/9) = 15/13 us per byte
    alpha, beta = fit_ring_alpha_beta([(1000, 1e-3), (2000, 3e-3)], ranks=2)
    assert alpha == 0.0
    assert beta == pytest.approx(15 / 13 * 1e-6, rel=TOL)


def test_a_negative_bandwidth_cost_is_refitted_as_latency_only() -> None:
    # larger messages measured faster: beta < 0, so alpha alone, by least squares on relative error:
    # alpha = sum(2/T) / sum((2/T)^2) = (5000/3) / (13e6/9) = 15/13 ms
    alpha, beta = fit_ring_alpha_beta([(1000, 3e-3), (2000, 2e-3)], ranks=2)
    assert beta == 0.0
    assert alpha == pytest.approx(15 / 13 * 1e-3, rel=TOL)


def test_noisy_points_match_an_independent_weighted_least_squares() -> None:
    ranks = 3
    sizes = np.array([4096, 16384, 65536, 262144, 1 << 20, 1 << 22], dtype=np.float64)
    noise = np.array([1.07, 0.95, 1.02, 0.97, 1.04, 0.99])
    seconds = (2 * (ranks - 1) * 30e-6 + 2 * (ranks - 1) / ranks * sizes * 1.5e-9) * noise
    design = np.stack([np.full_like(sizes, 2 * (ranks - 1)), 2 * (ranks - 1) / ranks * sizes], axis=1)
    reference, *_ = np.linalg.lstsq(design / seconds[:, None], np.ones_like(seconds), rcond=None)
    got = fit_ring_alpha_beta(list(zip(sizes.tolist(), seconds.tolist(), strict=True)), ranks)
    assert got == pytest.approx(tuple(reference), rel=1e-9)
    assert got == pytest.approx((30e-6, 1.5e-9), rel=0.1)  # and near the ring the noise was put on


def test_too_few_or_degenerate_points_are_refused() -> None:
    with pytest.raises(ValueError, match="at least two"):
        fit_ring_alpha_beta([(4096, 1e-4)], ranks=2)
    with pytest.raises(ValueError, match="several message sizes"):
        fit_ring_alpha_beta([(4096, 1e-4), (4096, 2e-4)], ranks=2)
