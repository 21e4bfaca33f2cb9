"""`dtrain plan --lose K`: what losing k of N workers costs an elastic job that keeps its global batch, against
values worked out by hand (ring all-reduce 2(n-1)/n S/B + 2(n-1) alpha, one bucket, no overlap)."""

from __future__ import annotations

import json

import pytest

from dtrain.cli import main
from dtrain.plan.losing import RecoveryAssumptions, checkpoint_bytes, cost_of_losing
from dtrain.plan.spec import ComputeSpec, ModelSpec, StrategySpec, TopologySpec

MODEL = ModelSpec(name="toy", parameters=1_000_000, bytes_per_parameter=4)  # 4e6 gradient bytes, one bucket
COMPUTE = ComputeSpec.from_samples_per_second(400)  # 2.5 ms per sample
TOPOLOGY = TopologySpec(devices_per_node=8, intra_bandwidth_bytes_per_s=25e9, intra_latency_s=5e-6)
STRATEGY = StrategySpec(algorithm="ring", overlap=False)
ASSUMED = RecoveryAssumptions(restart_s=30.0, checkpoint_period_steps=100, checkpoint_read_bytes_per_s=1e9)


def test_losing_one_of_four_by_hand() -> None:
    cost = cost_of_losing(MODEL, COMPUTE, TOPOLOGY, STRATEGY, devices=4, lost=1, global_batch=96, assumptions=ASSUMED)
    # before: 24 per device: 60 ms of compute + ring over 4: 2*3/4 * 4e6/25e9 + 2*3*5e-6 = 0.27 ms
    assert cost.step_before_s == pytest.approx(0.060 + 2.4e-4 + 3e-5, rel=1e-12)
    # after: 32 per device on 3: 80 ms + 2*2/3 * 4e6/25e9 + 2*2*5e-6
    step_after = 0.080 + 4 / 3 * 4e6 / 25e9 + 2e-5
    assert cost.devices_after == 3 and cost.per_device_batch_after == 32
    assert cost.step_after_s == pytest.approx(step_after, rel=1e-12)
    assert cost.samples_per_s_after == pytest.approx(96 / step_after, rel=1e-12)
    # checkpoint: fp32 weights 4 B + Adam 8 B per parameter = 12e6 B, read at 1e9 B/s
    assert cost.checkpoint_bytes == 12e6 and cost.checkpoint_load_s == pytest.approx(0.012, rel=1e-12)
    # a loss uniform within 100 steps redoes 50 on average, 100 at most, at the new step time
    assert cost.redone_steps_expected == 50 and cost.redone_steps_worst == 100
    assert cost.recovery_expected_s == pytest.approx(30 + 0.012 + 50 * step_after, rel=1e-12)
    assert cost.recovery_worst_s == pytest.approx(30 + 0.012 + 100 * step_after, rel=1e-12)
    assert cost.slowdown == pytest.approx(step_after / (0.060 + 2.7e-4), rel=1e-12)


def test_down_to_one_worker_there_is_no_communication_and_the_remainder_is_dropped() -> None:
    cost = cost_of_losing(MODEL, COMPUTE, TOPOLOGY, STRATEGY, devices=2, lost=1, global_batch=64, assumptions=ASSUMED)
    assert cost.step_after_s == pytest.approx(64 * 2.5e-3, rel=1e-12)
    odd = cost_of_losing(MODEL, COMPUTE, TOPOLOGY, STRATEGY, devices=8, lost=2, global_batch=256, assumptions=ASSUMED)
    assert odd.per_device_batch_after == 42  # 256 // 6, as dtrain splits it


def test_sgd_checkpoints_hold_no_optimizer_state() -> None:
    assert checkpoint_bytes(MODEL, "sgd") == 4e6 and checkpoint_bytes(MODEL, "sgd-momentum") == 8e6


@pytest.mark.parametrize("lost", [0, 4, 5])
def test_at_least_one_loses_and_one_survives(lost: int) -> None:
    with pytest.raises(ValueError, match="1 <= k < N"):
        cost_of_losing(MODEL, COMPUTE, TOPOLOGY, STRATEGY, devices=4, lost=lost, global_batch=96, assumptions=ASSUMED)


def test_plan_lose_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--parameters", "1e6", "--samples-per-second", "400", "--devices", "4", "--global-batch", "96",
            "--intra-gbit", "200", "--intra-latency-us", "5", "--no-overlap", "--bucket-mb", "25",
            "--first-bucket-mb", "25"]
    assert main([*base, "--lose", "1", "--checkpoint-period", "100", "--checkpoint-read-gbit", "8", "--json"]) == 0
    losing = json.loads(capsys.readouterr().out)["losing"]
    step_after = 0.080 + 4 / 3 * 4e6 / 25e9 + 2e-5
    assert losing["devices_after"] == 3 and losing["step_after_s"] == pytest.approx(step_after, rel=1e-12)
    assert losing["recovery_expected_s"] == pytest.approx(30 + 0.012 + 50 * step_after, rel=1e-12)
    assert main([*base, "--lose", "1"]) == 0
    text = capsys.readouterr().out
    assert "losing 1 of 4 workers (global batch 96 kept: 32 per worker on 3)" in text
    assert "recovery" in text and "50 of 100 steps redone" in text
    assert main(base) == 0 and "losing" not in capsys.readouterr().out  # the report without --lose is unchanged


@pytest.mark.parametrize(("extra", "message"), [
    (["--lose", "4"], "--lose 4 of 4 workers: give 1 <= K < --devices"),
    (["--lose", "1", "--checkpoint-period", "0"], "--checkpoint-period 0 must be > 0"),
    (["--lose", "1", "--restart-s", "-1"], "--restart-s -1.0 must be >= 0"),
    (["--lose", "1", "--sweep", "devices=2,4"], "--lose answers for one --devices count"),
])
def test_bad_lose_input_is_one_line(capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    code = main(["plan", "--model", "resnet50", "--samples-per-second", "400", "--devices", "4", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
