"""What losing k of N workers costs an elastic job that keeps its global batch: the step time at the new size,
and the time to recover = restart + checkpoint load + the steps redone since the last checkpoint.

A loss comes at a moment uniform within a checkpoint period of P steps, so on average P/2 steps are redone
(at most P), each at the new size's step time. The checkpoint read is the model's weights and optimizer state
(no gradients) at the given read rate; every surviving worker reads it at once, each at that rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dtrain.plan.memory import model_state_bytes
from dtrain.plan.spec import ComputeSpec, ModelSpec, StrategySpec, TopologySpec
from dtrain.plan.step import Prediction, per_device_batch_for, predict_step


@dataclass(frozen=True)
class RecoveryAssumptions:
    """What the recovery time is built from: the restart (processes, rendezvous, imports), the checkpoint period in
    steps, the checkpoint read rate, and the optimizer whose state the checkpoint holds (memory.PRECISIONS)."""

    restart_s: float
    checkpoint_period_steps: int
    checkpoint_read_bytes_per_s: float
    optimizer_state: str = "adam"

    def __post_init__(self) -> None:
        if self.restart_s < 0:
            raise ValueError(f"restart time {self.restart_s} s must be >= 0")
        if self.checkpoint_period_steps < 1:
            raise ValueError(f"checkpoint period {self.checkpoint_period_steps} steps must be >= 1")
        if not self.checkpoint_read_bytes_per_s > 0:
            raise ValueError(f"checkpoint read rate {self.checkpoint_read_bytes_per_s} B/s must be > 0")


@dataclass(frozen=True)
class LossCost:
    """The answer for one loss of `lost` of `devices_before` workers."""

    devices_before: int
    lost: int
    devices_after: int
    global_batch: int
    per_device_batch_after: int
    step_before_s: float
    step_after_s: float
    samples_per_s_before: float
    samples_per_s_after: float
    restart_s: float
    checkpoint_bytes: float
    checkpoint_load_s: float
    checkpoint_period_steps: int
    redone_steps_expected: float
    redone_steps_worst: int
    recovery_expected_s: float
    recovery_worst_s: float

    @property
    def slowdown(self) -> float:
        """Step time after the loss over before it."""
        return self.step_after_s / self.step_before_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "slowdown": self.slowdown}


def checkpoint_bytes(model: ModelSpec, optimizer_state: str) -> float:
    """Bytes of a replicated checkpoint: the weights and the optimizer state, not the gradients."""
    state = model_state_bytes(model.parameters, "ddp", 1, optimizer_state)
    return state.weight_bytes + state.optimizer_bytes


def cost_of_losing(model: ModelSpec, compute: ComputeSpec, topology: TopologySpec, strategy: StrategySpec,
                   devices: int, lost: int, global_batch: int, assumptions: RecoveryAssumptions,
                   before: Prediction | None = None) -> LossCost:
    """Losing `lost` of `devices` workers while the global batch stays `global_batch` (split over the survivors,
    remainder dropped as dtrain splits it). `before`: the prediction at `devices`, if already made."""
    if not 1 <= lost < devices:
        raise ValueError(f"losing {lost} of {devices} workers: give 1 <= k < N (at least one must survive)")
    after_devices = devices - lost
    if before is None:
        before = predict_step(model, compute, topology, strategy, devices,
                              per_device_batch_for(devices, global_batch=global_batch))
    per_device_after = per_device_batch_for(after_devices, global_batch=global_batch)
    after = predict_step(model, compute, topology, strategy, after_devices, per_device_after)
    size = checkpoint_bytes(model, assumptions.optimizer_state)
    load_s = size / assumptions.checkpoint_read_bytes_per_s
    period = assumptions.checkpoint_period_steps
    expected_steps = period / 2
    fixed = assumptions.restart_s + load_s
    return LossCost(
        devices_before=devices, lost=lost, devices_after=after_devices, global_batch=global_batch,
        per_device_batch_after=per_device_after, step_before_s=before.step_s, step_after_s=after.step_s,
        samples_per_s_before=before.samples_per_s, samples_per_s_after=after.samples_per_s,
        restart_s=assumptions.restart_s, checkpoint_bytes=size, checkpoint_load_s=load_s,
        checkpoint_period_steps=period, redone_steps_expected=expected_steps, redone_steps_worst=period,
        recovery_expected_s=fixed + expected_steps * after.step_s, recovery_worst_s=fixed + period * after.step_s)


def format_loss_cost(cost: LossCost) -> str:
    """Three lines for `dtrain plan --lose K`."""
    c = cost
    return "\n".join([
        f"losing {c.lost} of {c.devices_before} workers (global batch {c.global_batch:,} kept: "
        f"{c.per_device_batch_after} per worker on {c.devices_after}" + (
            f", {c.per_device_batch_after * c.devices_after:,} trained: the remainder is dropped)"
            if c.per_device_batch_after * c.devices_after != c.global_batch else ")"),
        f"  step            {c.step_after_s * 1e3:,.1f} ms (was {c.step_before_s * 1e3:,.1f} ms, x{c.slowdown:.2f}); "
        f"{c.samples_per_s_after:,.0f} samples/s (was {c.samples_per_s_before:,.0f})",
        f"  recovery        {c.recovery_expected_s:,.1f} s expected = restart {c.restart_s:,.1f} s + checkpoint load "
        f"{c.checkpoint_load_s:,.2f} s ({c.checkpoint_bytes / 1e9:.3g} GB) + {c.redone_steps_expected:g} of "
        f"{c.checkpoint_period_steps} steps redone ({c.redone_steps_expected * c.step_after_s:,.1f} s); at worst "
        f"{c.recovery_worst_s:,.1f} s (all {c.checkpoint_period_steps} steps redone)"])


__all__ = ["LossCost", "RecoveryAssumptions", "checkpoint_bytes", "cost_of_losing", "format_loss_cost"]
