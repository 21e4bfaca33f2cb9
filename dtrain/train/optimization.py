"""The optimizer and the learning rate: built after the strategy wrapped the model (a strategy may shard the
parameters in place), handed to the strategy to wrap (a sharded optimizer), then scheduled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.config import ExperimentConfig, LargeBatch, effective_precision
from dtrain.errors import ConfigError, TrialError
from dtrain.optim.build import build_lr_schedule
from dtrain.optim.build import build_optimizer as build_config_optimizer
from dtrain.optim.lr_schedule import ScheduledLR
from dtrain.sync import SyncStrategy
from dtrain.train.schedule import Schedule
from dtrain.train.trial import Trial


@dataclass
class Optimization:
    """The optimizer the strategy steps, the Trial's LR scheduler (stepped once per global batch trained) and the
    config's rate schedule (`large_batch`: scaling, warm-up, decay), which sets the rate before each update."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    lr_schedule: ScheduledLR | None
    schedule: Schedule
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler: its scale is checkpointed with the schedules

    def rate_for_update(self, began_after: int) -> float:
        """Apply the config's schedule for the update that began after batch `began_after`; return the rate this
        update uses (the first param group's)."""
        if self.lr_schedule is not None:
            return self.lr_schedule.apply(self.schedule.epoch_of(began_after))
        return float(self.optimizer.param_groups[0]["lr"])

    def after_batches(self, count: int) -> None:
        """Step the Trial's scheduler once per global batch trained."""
        if self.scheduler is not None:
            for _ in range(count):
                self.scheduler.step()

    def describe(self, lb: LargeBatch) -> list[str]:
        """Console lines on where the optimizer and the rate come from."""
        lines = []
        if lb.optimizer != "trial":
            lines.append(f"large_batch: optimizer {lb.optimizer} at base rate "
                         f"{self.lr_schedule.base_lrs[0] if self.lr_schedule else 0:g} from the config (the "
                         "Trial's build_optimizer() and build_lr_scheduler() are not used)")
        if self.lr_schedule is not None and not self.lr_schedule.schedule.is_constant:
            curve = self.lr_schedule.schedule
            lines.append(f"large_batch: lr_scaling {lb.lr_scaling} x{curve.peak:.4g}, warm-up "
                         f"{curve.warmup_epochs:g} epochs, decay {curve.decay}")
        return lines

    def schedule_state(self) -> dict[str, Any]:
        """The schedulers' part of a checkpoint."""
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "lr_schedule": self.lr_schedule.state_dict() if self.lr_schedule is not None else None,
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_schedule_state(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.lr_schedule is not None and state.get("lr_schedule") is not None:
            self.lr_schedule.load_state_dict(state["lr_schedule"])
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])


def build_optimization(config: ExperimentConfig, trial: Trial, model: nn.Module, schedule: Schedule,
                       strategy: SyncStrategy) -> Optimization:
    """The Trial's optimizer and scheduler (`large_batch.optimizer: trial`), or the config's optimizer; either
    way the config's LR scaling, warm-up and decay, when set, drive the rate. `model` is the user's model after
    the strategy wrapped it: its parameters are the ones to optimize."""
    lb = config.large_batch
    if lb.optimizer == "trial":
        optimizer = trial.build_optimizer(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TrialError(f"build_optimizer() returned {type(optimizer).__name__}; "
                             "return a torch.optim.Optimizer")
    else:  # the config owns the optimizer and its schedule; the Trial's builders are not called
        optimizer = build_config_optimizer(lb, model, config.hyperparameters)
    optimizer = strategy.wrap_optimizer(optimizer)
    scheduler = trial.build_lr_scheduler(optimizer) if lb.optimizer == "trial" else None
    if scheduler is not None and lb.schedules_lr:
        raise ConfigError(
            f"large_batch sets the learning rate over time (lr_scaling {lb.lr_scaling}, warmup_epochs "
            f"{lb.warmup_epochs:g}, decay {lb.decay.name}) and the Trial's build_lr_scheduler() returned "
            f"{type(scheduler).__name__}; both would set the same rate: remove those large_batch keys "
            "or return None from build_lr_scheduler()")
    lr_schedule = None
    if lb.optimizer != "trial" or lb.schedules_lr:
        first = schedule.plan.phases[0]
        curve = build_lr_schedule(lb, first.records_per_update, schedule.epoch_of(schedule.total_batches))
        lr_schedule = ScheduledLR(optimizer, curve)
    scaler = None
    if effective_precision(config.optimizations) == "fp16":
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        scaler = torch.amp.GradScaler(device_type)
    return Optimization(optimizer=optimizer, scheduler=scheduler, lr_schedule=lr_schedule, schedule=schedule,
                        scaler=scaler)
