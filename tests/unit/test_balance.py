"""Per-rank batches for uneven workers, without processes: the proportional split keeps the global batch and gives
every rank a record, shares scale to the global batch, the re-balance threshold, and the config's checks."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.train.balance import FixedSplit, Rebalancer, SpeedMeter, initial_split, needs_rebalance, proportional_split

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
