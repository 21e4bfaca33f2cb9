"""Learning-rate scaling, warm-up and decay at chosen iterations (Goyal et al.'s formula written out), and the
batch-size plan against a batch-by-batch simulation of the data it walks through."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import pytest
import torch
from torch import nn

from dtrain.config import load_config
from dtrain.optim import BatchChange, BatchPlan, LRSchedule, ScheduledLR, resolve_changes, scaling_factor
from dtrain.optim.build import build_lr_schedule, build_optimizer

# ----------------------------------------------------------------------------------------- LR schedule


def test_scaling_rules() -> None:
    assert scaling_factor("none", 8192, 128) == 1.0
    assert scaling_factor("linear", 8192, 128) == 64.0
    assert scaling_factor("sqrt", 8192, 128) == pytest.approx(8.0, rel=1e-15)
    assert scaling_factor("linear", 64, 128) == 0.5


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)


def test_gradual_warmup_per_iteration_then_step_decay() -> None:
    """Goyal et al.: lr(i) = eta + (k eta - eta) i / W for i < W iterations, then k eta, divided by 10 at
    milestones. 1000 records in batches of 100 give 10 iterations per epoch; W = 2 epochs = 20 iterations."""
    eta, k = 0.1, 4.0
    plan = BatchPlan(num_records=1000, global_batch_size=100, aggregation_frequency=1)
    schedule = LRSchedule(peak=scaling_factor("linear", 100, 25), warmup_epochs=2, decay="step", milestones=(5, 8))
    driver = ScheduledLR(_optimizer(eta), schedule)

    def lr_at_iteration(i: int) -> float:
        return driver.apply(float(plan.epoch_of(i)))  # iteration i starts after i batches

    expected = {0: eta, 1: eta + (k * eta - eta) * 1 / 20, 7: eta + (k * eta - eta) * 7 / 20,
                19: eta + (k * eta - eta) * 19 / 20, 20: k * eta, 49: k * eta, 50: k * eta / 10, 79: k * eta / 10,
                80: k * eta / 100, 120: k * eta / 100}
    for iteration, lr in expected.items():
        assert lr_at_iteration(iteration) == pytest.approx(lr, rel=1e-12), iteration


def test_warmup_counts_updates_when_gradients_are_aggregated() -> None:
    """With aggregation_frequency 2, update j starts after 2j batches: 5 updates per epoch of 10 batches."""
    plan = BatchPlan(num_records=1000, global_batch_size=100, aggregation_frequency=2)
    schedule = LRSchedule(peak=8.0, warmup_epochs=1)
    assert [schedule.factor(float(plan.epoch_of(2 * j))) for j in range(6)] == pytest.approx(
        [1.0, 1 + 7 * 0.2, 1 + 7 * 0.4, 1 + 7 * 0.6, 1 + 7 * 0.8, 8.0], rel=1e-12)


@pytest.mark.parametrize(("decay", "shape"), [
    ("cosine", lambda progress: 0.5 * (1 + math.cos(math.pi * progress))),
    ("poly", lambda progress: (1 - progress) ** 2),
])
def test_cosine_and_poly_decay_after_warmup(decay: str, shape: Callable[[float], float]) -> None:
    """Peak 4 after 2 warm-up epochs, decaying to 0 at epoch 10: epoch 6 is half-way, epoch 8 three quarters."""
    schedule = LRSchedule(peak=4.0, warmup_epochs=2, decay=decay, total_epochs=10)  # type: ignore[arg-type]
    assert schedule.factor(1.0) == pytest.approx(2.5)
    assert schedule.factor(2.0) == pytest.approx(4.0)
    assert schedule.factor(6.0) == pytest.approx(4.0 * shape(0.5), rel=1e-12)
    assert schedule.factor(8.0) == pytest.approx(4.0 * shape(0.75), rel=1e-12)
    assert schedule.factor(10.0) == pytest.approx(0.0, abs=1e-15)
    assert schedule.factor(6.0) == pytest.approx({"cosine": 2.0, "poly": 1.0}[decay])
    floor = LRSchedule(peak=4.0, warmup_epochs=2, decay=decay, total_epochs=10,  # type: ignore[arg-type]
                       final_fraction=0.1)
    assert floor.factor(10.0) == pytest.approx(0.4)


def test_scheduled_lr_state_keeps_the_base_rates() -> None:
    optimizer = _optimizer(0.1)
    driver = ScheduledLR(optimizer, LRSchedule(peak=8.0, warmup_epochs=1))
    driver.apply(0.5)
    saved_optimizer, saved_driver = optimizer.state_dict(), driver.state_dict()
    # a resumed run: the optimizer comes back with the scheduled rate (0.45), the schedule with the base rate
    fresh = _optimizer(0.1)
    fresh.load_state_dict(saved_optimizer)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.45)
    resumed = ScheduledLR(fresh, LRSchedule(peak=8.0, warmup_epochs=1))
    resumed.load_state_dict(saved_driver)
    assert resumed.apply(0.75) == pytest.approx(0.1 * (1 + 7 * 0.75))
    assert resumed.last_epoch == 0.75


RAW = {"name": "t", "entrypoint": "m:T", "hyperparameters": {"global_batch_size": 256, "learning_rate": 0.05,
                                                                "weight_decay": 1e-4},
       "resources": {"slots_per_trial": 2}, "searcher": {"max_length": {"epochs": 4}},
       "optimizations": {"aggregation_frequency": 2}}


def test_config_builds_optimizer_and_schedule() -> None:
    raw = dict(RAW, large_batch={"optimizer": "lars", "lr_scaling": "linear", "base_batch_size": 128,
                                  "warmup_epochs": 1, "decay": "cosine", "trust_coefficient": 0.01})
    config = load_config(None, raw=raw).config
    optimizer = build_optimizer(config.large_batch, nn.Linear(3, 2), config.hyperparameters)
    group = optimizer.param_groups[0]
    assert type(optimizer).__name__ == "LARS"
    options = (group["lr"], group["weight_decay"], group["trust_coefficient"], group["momentum"])
    assert options == (0.05, 1e-4, 0.01, 0.9)
    schedule = build_lr_schedule(config.large_batch, records_per_update=512, total_epochs=4.0)
    assert schedule.peak == 4.0 and schedule.decay == "cosine" and schedule.warmup_epochs == 1
    own_rate = dict(RAW, large_batch={"optimizer": "radam", "base_lr": 0.002, "weight_decay": 0.0,
                                       "betas": [0.8, 0.9]})
    config = load_config(None, raw=own_rate).config
    radam = build_optimizer(config.large_batch, nn.Linear(3, 2), config.hyperparameters)
    assert isinstance(radam, torch.optim.RAdam)
    assert (radam.param_groups[0]["lr"], radam.param_groups[0]["betas"], radam.param_groups[0]["weight_decay"]) == (
        0.002, (0.8, 0.9), 0.0)


# ------------------------------------------------------------------------------------ batch-size plan


def simulate(num_records: int, global_batch: int, k: int, records_per_epoch: int, changes: list[BatchChange],
             steps: int) -> list[dict[str, object]]:
    """Walk the run batch by batch: each pass is cut into consecutive global batches, a tail too short for the
    next batch is skipped; a change applies after the first optimizer update that ends at or past its epoch."""
    rows = []
    data_pass, offset, samples, in_window = 0, 0, 0, 0
    batch, frequency, pending = global_batch, k, list(changes)
    for _ in range(steps):
        if offset + batch > num_records:
            data_pass, offset = data_pass + 1, 0
        start = (data_pass, offset)
        offset += batch
        samples += batch
        in_window += 1
        epoch = (Fraction(samples, records_per_epoch) if records_per_epoch
                 else data_pass + Fraction(offset, num_records // batch * batch))
        boundary = in_window == frequency
        rows.append({"start": start, "batch": batch, "k": frequency, "boundary": boundary, "epoch": epoch,
                     "samples": samples})
        if boundary:
            in_window = 0
            if pending and epoch >= Fraction(pending[0].epoch):
                change = pending.pop(0)
                batch, frequency = global_batch * change.batch_multiplier, change.aggregation_frequency
    return rows


PLANS = {
    "no schedule": (1000, 64, 1, 0, []),
    "per-slot growth, passes": (1000, 64, 1, 0, [BatchChange(1, 2, 1), BatchChange(2.5, 4, 1)]),
    "aggregation growth mid-pass": (1000, 48, 2, 0, [BatchChange(0.7, 1, 4), BatchChange(3, 2, 4)]),
    "records_per_epoch": (1000, 64, 1, 700, [BatchChange(1.5, 3, 1), BatchChange(4, 3, 2)]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_a_batch_by_batch_walk(name: str) -> None:
    records, batch, k, per_epoch, changes = PLANS[name]
    plan = BatchPlan(num_records=records, global_batch_size=batch, aggregation_frequency=k,
                     records_per_epoch=per_epoch, changes=changes)
    steps = 150
    walk = simulate(records, batch, k, per_epoch, changes, steps)
    assert len({(row["batch"], row["k"]) for row in walk}) == 1 + len(changes)  # every change happened
    for step, row in enumerate(walk, start=1):
        phase = plan.phase_at(step - 1)
        assert plan.position_at(step - 1) == row["start"], step
        assert (phase.global_batch_size, phase.aggregation_frequency) == (row["batch"], row["k"]), step
        assert plan.is_boundary(step) == row["boundary"], step
        assert plan.epoch_of(step) == row["epoch"], step
        assert plan.samples_at(step) == row["samples"], step
    for total in (37, 100, 150):
        updates = sum(row["boundary"] for row in walk[:total]) + (not walk[total - 1]["boundary"])
        assert plan.optimizer_steps(total) == updates
    for epochs in (1, 2, 3.5):
        first = next(i for i, row in enumerate(walk, start=1) if row["epoch"] >= Fraction(epochs))
        assert plan.first_step_reaching(epochs, "epochs") == first
    assert plan.first_step_reaching(5000, "records") == next(
        i for i, row in enumerate(walk, start=1) if row["samples"] >= 5000)  # type: ignore[operator]


def test_every_phase_change_happens() -> None:
    records, batch, k, per_epoch, changes = PLANS["per-slot growth, passes"]
    plan = BatchPlan(num_records=records, global_batch_size=batch, aggregation_frequency=k,
                     records_per_epoch=per_epoch, changes=changes)
    # 1000 // 64 = 15 batches per pass; epoch 1 ends at batch 15, then 7 batches of 128 per pass
    assert [(p.start_step, p.global_batch_size) for p in plan.phases] == [(0, 64), (15, 128), (15 + 7 + 4, 256)]
    assert plan.epoch_of(15) == 1 and plan.epoch_of(22) == 2


def test_growth_moves_to_aggregation_above_the_per_slot_limit() -> None:
    changes = resolve_changes([2, 4, 6], [2, 2, 3], "per_slot_batch", 64, per_slot_batch=32, aggregation_frequency=1)
    assert [(c.batch_multiplier, c.aggregation_frequency) for c in changes] == [(2, 1), (2, 2), (2, 6)]
    only_k = resolve_changes([1], [4], "aggregation_frequency", None, per_slot_batch=32, aggregation_frequency=2)
    assert [(c.batch_multiplier, c.aggregation_frequency) for c in only_k] == [(1, 8)]


def test_a_batch_larger_than_the_data_is_refused() -> None:
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="grows the global batch to 1024 at epoch 1"):
        BatchPlan(num_records=1000, global_batch_size=256, aggregation_frequency=1,
                  changes=[BatchChange(1, 4, 1)])
