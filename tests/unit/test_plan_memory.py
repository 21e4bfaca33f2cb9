"""The plan's memory model against the ZeRO paper's own figures and the GPipe bubble formula."""

from __future__ import annotations

import pytest

from dtrain.plan.memory import (
    bubble_fraction,
    model_state_bytes,
    pipeline_efficiency,
    recommend_layout,
    step_traffic,
)

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


def test_hsdp_holds_fsdps_model_state_over_one_shard_group() -> None:
    """16 bytes per parameter with Adam, divided by the S ranks of a shard group, not by all N ranks."""
    assert model_state_bytes(1e6, "hsdp", 8, shard_ranks=4).total_bytes == model_state_bytes(1e6, "fsdp", 4).total_bytes
    assert model_state_bytes(1e6, "hsdp", 8, shard_ranks=4).total_bytes == 4e6
    with pytest.raises(ValueError, match="shard_ranks 3 must divide ranks 8"):
        model_state_bytes(1e6, "hsdp", 8, shard_ranks=3)


def test_fsdp_sends_one_and_a_half_times_ddps_bytes() -> None:
    """ZeRO (Rajbhandari et al. 2020, sec. 7.2.2): stage 3 moves 3 Psi per rank against data parallelism's 2 Psi."""
    for ranks in (2, 8, 64):
        fsdp, ddp = step_traffic(1e9, "fsdp", ranks, 8), step_traffic(1e9, "ddp", ranks, 8)
        assert fsdp.total_bytes == pytest.approx(1.5 * ddp.total_bytes)
    assert step_traffic(1e9, "fsdp", 64, 8).total_bytes == pytest.approx(3e9, rel=0.02)
    assert step_traffic(1e9, "fsdp", 4, 8, reshard_after_forward=False).total_bytes == pytest.approx(2 * 0.75e9)


def test_hsdp_keeps_gathers_in_a_node_and_all_reduces_a_shard_between_nodes() -> None:
    """4 nodes of 8: the within-node part is FSDP's over 8 ranks; across nodes each rank all-reduces its 1/8
    shard over the 4 nodes (DDP's bytes for a model 8 times smaller on 4 ranks)."""
    hsdp = step_traffic(8e9, "hsdp", 32, 8)
    assert hsdp.within_node_bytes == pytest.approx(step_traffic(8e9, "fsdp", 8, 8).total_bytes)
    assert hsdp.across_nodes_bytes == pytest.approx(step_traffic(1e9, "ddp", 4, 1).across_nodes_bytes)
    assert hsdp.across_nodes_bytes == pytest.approx(1.5e9)
    fsdp, ddp = step_traffic(8e9, "fsdp", 32, 8), step_traffic(8e9, "ddp", 32, 8)
    assert fsdp.within_node_bytes == 0 and ddp.within_node_bytes == 0  # their rings span the nodes
    assert hsdp.across_nodes_bytes < ddp.across_nodes_bytes / 8
    one_node = step_traffic(8e9, "hsdp", 8, 8)
    assert one_node.across_nodes_bytes == 0 and one_node.total_bytes == pytest.approx(
        step_traffic(8e9, "fsdp", 8, 8).total_bytes)

