"""`determined.core` on dtrain: `init()` and its contexts (train, checkpoint, searcher, preempt, distributed)."""

from dtrain.determined.core import (
    CheckpointContext,
    Context,
    PreemptContext,
    PreemptMode,
    SearcherContext,
    SearcherMode,
    SearcherOperation,
    TensorboardMode,
    TrainContext,
    init,
)
from dtrain.determined.distributed import DistributedContext

DummyDistributedContext = DistributedContext.single

__all__ = ["CheckpointContext", "Context", "DistributedContext", "DummyDistributedContext", "PreemptContext",
           "PreemptMode", "SearcherContext", "SearcherMode", "SearcherOperation", "TensorboardMode", "TrainContext",
           "init"]
