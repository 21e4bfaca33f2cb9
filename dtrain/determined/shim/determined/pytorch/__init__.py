"""`determined.pytorch` on dtrain: PyTorchTrial and its context, DataLoader, LRScheduler, callbacks, training
units, and the Trainer API (`init`, `Trainer`)."""

from dtrain.determined.adapter import PyTorchTrial
from dtrain.determined.context import PyTorchTrialContext
from dtrain.determined.distributed import DistributedContext
from dtrain.determined.pytorch import (
    Batch,
    DataLoader,
    Epoch,
    LRScheduler,
    MetricReducer,
    PyTorchCallback,
    TrainUnit,
)
from dtrain.determined.trainer_api import Trainer, init

__all__ = ["Batch", "DataLoader", "DistributedContext", "Epoch", "LRScheduler", "MetricReducer", "PyTorchCallback",
           "PyTorchTrial", "PyTorchTrialContext", "TrainUnit", "Trainer", "init"]
