"""The plan model of uneven clusters against hand-computed figures: even vs proportional split of workers of
different speed, local SGD's amortized averaging, and `dtrain plan`'s lines for them."""

from __future__ import annotations

import pytest

from dtrain.cli import main
from dtrain.plan.uneven import local_sgd_speedup, local_sgd_step_seconds, predict_uneven, proportional_batches


def test_half_speed_worker_gains_one_and_a_half() -> None:
    prediction = predict_uneven(128, [100.0, 50.0])
    assert prediction.even_batches == (64, 64) and prediction.proportional_batches == (85, 43)
    assert prediction.even_compute_s == pytest.approx(64 / 50)  # the slow worker decides
    assert prediction.proportional_compute_s == pytest.approx(max(85 / 100, 43 / 50))
    assert prediction.gain == pytest.approx(1.28 / 0.86)  # 1.49, the ideal 1.5 less rounding


def test_proportional_batches_keep_the_global_batch() -> None:
    assert proportional_batches(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(proportional_batches(1000, [3.3, 1.1, 0.7, 2.0])) == 1000


def test_local_sgd_amortizes_the_averaging() -> None:
    assert local_sgd_step_seconds(0.1, 0.8, 8) == pytest.approx(0.2)
    assert local_sgd_speedup(0.1, 0.5, 0.8, 8) == pytest.approx(0.6 / 0.2)
    with pytest.raises(ValueError):
        local_sgd_step_seconds(0.1, 0.8, 0)


def test_dtrain_plan_prints_both(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--parameters", "1e6", "--devices", "2", "--samples-per-second", "100",
                 "--batch-per-device", "32", "--devices-per-node", "1", "--inter-gbit", "1",
                 "--device-speeds", "1,0.5", "--averaging-period", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "uneven workers (speeds 100, 50): even split 32/32 computes 640.0 ms per step, proportional 43/21" in out
    assert "local SGD every 8 updates" in out
    assert main(["plan", "--parameters", "1e6", "--devices", "2", "--samples-per-second", "100",
                 "--device-speeds", "1"]) == 2
