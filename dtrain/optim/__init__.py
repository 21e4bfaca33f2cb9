"""Large-batch training: LARS and LAMB, LR scaling rules with gradual warm-up and decay, batch-size schedules."""

from dtrain.optim.batch_schedule import BatchChange, BatchPhase, BatchPlan, resolve_changes
from dtrain.optim.lamb import LAMB
from dtrain.optim.lars import LARS
from dtrain.optim.lr_schedule import LRSchedule, ScheduledLR, scaling_factor

__all__ = ["LAMB", "LARS", "BatchChange", "BatchPhase", "BatchPlan", "LRSchedule", "ScheduledLR", "resolve_changes",
           "scaling_factor"]
