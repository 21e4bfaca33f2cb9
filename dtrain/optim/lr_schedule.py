"""Learning-rate scaling rules, gradual warm-up and the decay after it (Goyal et al. 2017, "Accurate, Large
Minibatch SGD: Training ImageNet in 1 Hour", arXiv:1706.02677), as pure functions of training progress in epochs.

Progress is counted in epochs rather than optimizer steps so that the curve stays the same when a batch-size
schedule changes the number of steps in an epoch, and so that a resumed run, which knows how many records it
has trained on, lands on the same point of the curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.config import DecayName, ScalingRule


def scaling_factor(rule: ScalingRule, batch_size: int, base_batch_size: int | None) -> float:
    """How much larger the rate for `batch_size` is than the base rate tuned at `base_batch_size`:
    1 (none), B/B0 (linear, Goyal et al.) or sqrt(B/B0) (sqrt, Krizhevsky 2014; You et al. 2019 for LAMB)."""
    if rule == "none":
        return 1.0
    if base_batch_size is None or base_batch_size < 1:
        raise ValueError(f"lr_scaling {rule!r} needs a base batch size")
    ratio = batch_size / base_batch_size
    return ratio if rule == "linear" else math.sqrt(ratio)


@dataclass(frozen=True)
class LRSchedule:
    """The multiplier of the base rate at any point of training.

    Warm-up raises it linearly, per update, from 1 (the base rate) to `peak` (the scaling rule's factor) over
    `warmup_epochs`; after that `peak` is decayed: `step` multiplies by `gamma` at each of `milestones` (epochs),
    `cosine` and `poly` ((1 - progress)^power) go from `peak` to `final_fraction * peak` at `total_epochs`.
    """

    peak: float = 1.0
    warmup_epochs: float = 0.0
    decay: DecayName = "none"
    milestones: tuple[float, ...] = ()
    gamma: float = 0.1
    final_fraction: float = 0.0
    power: float = 2.0
    total_epochs: float = 0.0

    def factor(self, epoch: float) -> float:
        """Multiplier for an update that starts `epoch` epochs into training."""
        if epoch < self.warmup_epochs:
            return 1.0 + (self.peak - 1.0) * epoch / self.warmup_epochs
        return self.peak * self.decay_factor(epoch)

    def decay_factor(self, epoch: float) -> float:
        """The decay alone (1 until it starts); it starts when warm-up ends."""
        if self.decay == "step":
            return float(self.gamma ** sum(1 for milestone in self.milestones if epoch >= milestone))
        if self.decay in ("cosine", "poly"):
            span = self.total_epochs - self.warmup_epochs
            if span <= 0:
                return 1.0
            progress = min(max((epoch - self.warmup_epochs) / span, 0.0), 1.0)
            if self.decay == "cosine":
                shape = 0.5 * (1.0 + math.cos(math.pi * progress))
            else:
                shape = (1.0 - progress) ** self.power
            return self.final_fraction + (1.0 - self.final_fraction) * shape
        return 1.0

    @property
    def is_constant(self) -> bool:
        return self.peak == 1.0 and self.decay == "none"


class ScheduledLR:
    """Sets every param group's rate to its base rate times the schedule's factor, before each optimizer step.

    The base rates are the groups' rates when it is created; they are part of its state, so a resumed run
    whose optimizer state_dict holds the last scheduled rates still scales from the original ones.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.last_epoch: float | None = None

    def apply(self, epoch: float) -> float:
        """Set the rates for an update starting `epoch` epochs into training; return the first group's rate."""
        factor = self.schedule.factor(epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        self.last_epoch = epoch
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        base_lrs = [float(lr) for lr in state["base_lrs"]]
        if len(base_lrs) != len(self.optimizer.param_groups):
            raise ValueError(f"the saved schedule has {len(base_lrs)} base rates for "
                             f"{len(self.optimizer.param_groups)} param groups")
        self.base_lrs = base_lrs
        self.last_epoch = state.get("last_epoch")
