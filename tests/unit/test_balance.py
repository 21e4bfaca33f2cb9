"""Per-rank batches for uneven workers, without processes: the proportional split keeps the global batch and gives
every rank a record, shares scale to the global batch, the re-balance threshold, and the config's checks."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.train.balance import (
    FixedSplit,
    Rebalancer,
    SpeedMeter,
    equal_finish_split,
    fit_batch_time,
    initial_split,
    needs_rebalance,
    proportional_split,
)

BASE: dict[str, Any] = {"name": "x", "entrypoint": "m:T", "hyperparameters": {"global_batch_size": 128},
                        "resources": {"slots_per_trial": 2},
                        "searcher": {"metric": "loss", "max_length": {"batches": 10}}}


def with_het(het: Any, slots: int = 2) -> dict[str, Any]:
    return {**BASE, "resources": {"slots_per_trial": slots}, "distributed": {"heterogeneous": het}}


@pytest.mark.parametrize(("total", "shares", "expected"), [
    (128, [2.0, 1.0], (85, 43)),  # the half-speed straggler of the benchmark: 128 * 2/3 = 85.3
    (24, [3, 1], (18, 6)),
    (10, [1, 1, 1], (4, 3, 3)),  # largest remainders: the first rank gets the extra record
    (5, [1000, 1, 1], (3, 1, 1)),  # every rank keeps at least one record
    (64, [1.0, 1.0], (32, 32)),
])
def test_proportional_split_keeps_the_global_batch(total: int, shares: list[float], expected: tuple[int, ...]) -> None:
    split = proportional_split(total, shares)
    assert split.per_rank == expected
    assert split.global_batch_size == total and split.dropped == 0


def test_initial_split_from_the_config() -> None:
    assert initial_split(load_config(None, raw=BASE).config, 2).per_rank == (64, 64)
    assert initial_split(load_config(None, raw=with_het({"split": [3, 1]})).config, 2).per_rank == (96, 32)
    assert initial_split(load_config(None, raw=with_het({"split": "auto"}, 3)).config, 3).per_rank == (43, 43, 42)


def test_rebalance_only_beyond_the_tolerance() -> None:
    assert not needs_rebalance((64, 64), (68, 60), 0.1)
    assert needs_rebalance((64, 64), (85, 43), 0.1)


def test_rebalancer_is_due_after_calibration_then_periodically() -> None:
    rebalancer = Rebalancer(SpeedMeter.__new__(SpeedMeter), None, global_batch=128,  # type: ignore[arg-type]
                            calibrate_steps=20, rebalance_every=50, tolerance=0.1)
    assert [u for u in range(1, 200) if rebalancer.due(u)] == [20, 70, 120, 170]
    assert FixedSplit().after_update(20, proportional_split(4, [1, 1])) is None


@pytest.mark.parametrize(("het", "message"), [
    ({"split": [3, 1, 1]}, "has 3 shares for resources.slots_per_trial 2"),
    ({"split": [3, 0]}, "one positive share per rank"),
    ({"split": "fast"}, "split"),
])
def test_bad_heterogeneous_settings_are_one_line(het: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, raw=with_het(het))


def test_heterogeneous_refuses_parameter_servers() -> None:
    raw = with_het({"split": "auto"})
    raw["distributed"]["strategy"] = "parameter_server"
    with pytest.raises(ConfigError, match="re-balances batches where all ranks meet.*parameter_server"):
        load_config(None, raw=raw)


class _Timed:
    """Stands in for a rank's SpeedMeter: every rank's records/s when a batch of n records takes c + b * n seconds."""

    def __init__(self, costs: list[tuple[float, float]]) -> None:
        self.costs = costs
        self.split: tuple[int, ...] = ()

    def update_done(self) -> None:
        pass

    def take(self) -> float:  # this rank's own speed; the stubbed all-gather answers with every rank's
        return 0.0

    def speeds(self) -> list[float]:
        return [n / (c + b * n) for n, (c, b) in zip(self.split, self.costs, strict=True)]


@pytest.mark.parametrize(("costs", "tolerance"), [
    ([(10.0, 1.0), (10.0, 2.0)], 0.0),  # 2x slower per record, the same fixed cost per batch
    ([(43.0, 1.0), (86.0, 2.0)], 0.0),  # 2x slower in both (faults.slow_factor 2): equal finish at 57/7
    ([(0.0, 1.0), (0.0, 2.0)], 0.0),  # no fixed cost: the proportional split is already the equal-finish one
    ([(100.0, 1.0), (100.0, 2.0)], 0.0),  # a large fixed cost: records/s at 32/32 differ by 1.24x only
])
def test_auto_converges_to_the_equal_finish_split_and_stays(
        monkeypatch: pytest.MonkeyPatch, costs: list[tuple[float, float]], tolerance: float) -> None:
    """Ranks whose batch of n records takes c + b * n seconds: from the third re-balance on, the split is within one
    record of the analytic one where both finish together, n0 = (c1 - c0 + b1 * N) / (b0 + b1), and stays there."""
    total = 64
    meter = _Timed(costs)
    monkeypatch.setattr("dtrain.train.balance.all_gather_object", lambda _: meter.speeds())
    rebalancer = Rebalancer(meter, None, global_batch=total, calibrate_steps=2,  # type: ignore[arg-type]
                            rebalance_every=1, tolerance=tolerance)
    (c0, b0), (c1, b1) = costs
    equal_finish = (c1 - c0 + b1 * total) / (b0 + b1)
    split = proportional_split(total, [1.0, 1.0])
    seen = []
    for update in range(2, 14):
        meter.split = split.per_rank
        split = rebalancer.after_update(update, split) or split
        seen.append(split.per_rank)
    assert all(sum(s) == total for s in seen)
    assert all(abs(s[0] - equal_finish) < 1.0 for s in seen[2:]), (equal_finish, seen)
    assert len(set(seen[2:])) == 1, seen


def test_equal_finish_split_keeps_a_record_per_rank_and_fits_the_costs() -> None:
    # rank 1 would need 64 - 109 records to finish with rank 0: it keeps one, rank 0 takes the rest
    assert equal_finish_split(64, [(1.0, 1.0), (200.0, 2.0)]).per_rank == (63, 1)
    # three ranks, T = (60 + 0/1 + 10/2 + 20/4) / (1 + 1/2 + 1/4) = 40: n = 40, (40 - 10)/2, (40 - 20)/4
    assert equal_finish_split(60, [(0.0, 1.0), (10.0, 2.0), (20.0, 4.0)]).per_rank == (40, 15, 5)
    assert fit_batch_time([(32, 42.0), (43, 53.0), (43, 53.0)]) == pytest.approx((10.0, 1.0))
    assert fit_batch_time([(32, 42.0), (32, 40.0)]) is None  # one size: no slope
    assert fit_batch_time([(32, 42.0), (40, 30.0)]) is None  # noise made the time fall with the records
