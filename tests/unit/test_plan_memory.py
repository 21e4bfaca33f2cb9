"""The plan's memory model against the ZeRO paper's own figures and the GPipe bubble formula."""

from __future__ import annotations

import pytest

from dtrain.plan.memory import bubble_fraction, model_state_bytes, pipeline_efficiency, recommend_layout

GB = 1e9


@pytest.mark.parametrize(("layout", "expected_gb"), [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6),
                                                      ("fsdp", 1.88)])
def test_zero_paper_figure_1_for_7_5b_parameters_on_64_gpus(layout: str, expected_gb: float) -> None:
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12."""
    estimate = model_state_bytes(7.5e9, layout, 64, optimizer="zero-paper")
    assert estimate.total_bytes / GB == pytest.approx(expected_gb, rel=0.01)


def test_dtrain_fp32_adam_is_16_bytes_per_parameter_and_fsdp_divides_all_of_it() -> None:
    assert model_state_bytes(1e6, "ddp", 4).total_bytes == 16e6
    assert model_state_bytes(1e6, "zero1", 4).total_bytes == 4e6 + 4e6 + 8e6 / 4
    assert model_state_bytes(1e6, "fsdp", 4).total_bytes == 4e6


def test_a_pipeline_rank_holds_one_stage_of_everything() -> None:
    estimate = model_state_bytes(1e6, "ddp", 2, optimizer="sgd-momentum", stages=2)
    assert (estimate.weight_bytes, estimate.gradient_bytes, estimate.optimizer_bytes) == (2e6, 2e6, 2e6)


@pytest.mark.parametrize(("m", "efficiency"), [(2, 2 / 3), (4, 0.8), (8, 8 / 9)])
def test_bubble_at_two_stages(m: int, efficiency: float) -> None:
    assert pipeline_efficiency(2, m) == pytest.approx(efficiency)
    assert bubble_fraction(2, m) == pytest.approx(1 - efficiency)


def test_the_least_sharded_layout_that_fits_is_recommended() -> None:
    assert recommend_layout(1e9, 8, 80 * GB)[0] == "ddp"  # 16 GB fits
    assert recommend_layout(1e9, 8, 12 * GB)[0] == "zero1"  # 8 + 1 GB
    assert recommend_layout(1e9, 8, 4 * GB)[0] == "fsdp"  # 2 GB
    assert recommend_layout(1e9, 8, 1 * GB)[0] is None
