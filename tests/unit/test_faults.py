"""Fault injection: the straggler delay and the config rules around it."""

from __future__ import annotations

import pytest

from dtrain.config import Debug, load_config
from dtrain.errors import ConfigError
from dtrain.train import faults
from dtrain.train.faults import FaultInjector


def test_straggler_sleeps_factor_minus_one_times_its_last_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    injector = FaultInjector(Debug(slow_rank=1, slow_factor=3.0), rank=1)
    assert injector.before_compute() == 0.0  # nothing measured yet
    injector.after_compute(0.2)
    assert injector.before_compute() == pytest.approx(0.4)
    injector.after_compute(0.1)
    assert injector.before_compute() == pytest.approx(0.2)
    assert slept == pytest.approx([0.4, 0.2])


def test_other_ranks_and_factor_one_are_never_slowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults.time, "sleep", lambda seconds: pytest.fail("slept"))
    for injector in (FaultInjector(Debug(slow_rank=1, slow_factor=3.0), rank=0),
                     FaultInjector(Debug(slow_rank=0, slow_factor=1.0), rank=0)):
        injector.after_compute(0.5)
        assert injector.before_compute() == 0.0


def test_slow_rank_outside_the_world_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"debug.slow_rank \(2\) must name a worker rank"):
        load_config(None, raw={"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
                               "resources": {"slots_per_trial": 2}, "searcher": {"max_length": {"batches": 1}},
                               "debug": {"slow_rank": 2, "slow_factor": 2}})
