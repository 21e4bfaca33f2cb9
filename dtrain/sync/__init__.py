"""Strategies that keep replicas consistent, behind one protocol, picked by `distributed.strategy` from a registry:
a new strategy is one module and one line in `REGISTRY` (docs/strategies.md)."""

from __future__ import annotations

from collections.abc import Callable

from dtrain.comm import Topology
from dtrain.config import ExperimentConfig
from dtrain.sync.allreduce import AllReduceStrategy, build_allreduce
from dtrain.sync.base import (
    AsynchronousPacing,
    BucketObserving,
    CollectiveForward,
    ComputePhases,
    Consolidating,
    EvaluatesInStages,
    HoldsModelParts,
    OptimizerWrapping,
    OwnsCheckpointState,
    ReportingMetrics,
    RunsForwardBackward,
    ShardedConstruction,
    SyncStrategy,
    TimesWaits,
    TrainBatch,
    WireMetering,
    WritesShardedCheckpoint,
)
from dtrain.sync.fsdp import FsdpStrategy, build_fsdp
from dtrain.sync.hierarchical import HierarchicalStrategy, build_hierarchical
from dtrain.sync.local_sgd import LocalSGDStrategy, build_local_sgd
from dtrain.sync.parameter_server import ParameterServerStrategy, build_parameter_server
from dtrain.sync.pipeline import PipelineStrategy, build_pipeline
from dtrain.sync.zero import Zero1Strategy, build_zero1

StrategyBuilder = Callable[[ExperimentConfig, Topology], SyncStrategy]

# distributed.strategy -> the function that builds it from the config
REGISTRY: dict[str, StrategyBuilder] = {
    "allreduce": build_allreduce,
    "parameter_server": build_parameter_server,
    "local_sgd": build_local_sgd,
    "hierarchical": build_hierarchical,
    "zero1": build_zero1,
    "fsdp": build_fsdp,
    "pipeline": build_pipeline,
}


def build_strategy(config: ExperimentConfig, topology: Topology) -> SyncStrategy:
    """The strategy the config names, built by its registered builder."""
    name = config.distributed.strategy
    builder = REGISTRY.get(name)
    if builder is None:  # check_buildable() refuses it before we get here
        raise ValueError(f"strategy {name!r} is not built; registered: {', '.join(sorted(REGISTRY))}")
    return builder(config, topology)


__all__ = ["REGISTRY", "AllReduceStrategy", "AsynchronousPacing", "BucketObserving", "CollectiveForward",
           "ComputePhases", "Consolidating", "EvaluatesInStages", "FsdpStrategy", "HierarchicalStrategy",
           "HoldsModelParts",
           "LocalSGDStrategy",
           "OptimizerWrapping", "OwnsCheckpointState", "ParameterServerStrategy", "PipelineStrategy",
           "ReportingMetrics", "RunsForwardBackward", "ShardedConstruction", "StrategyBuilder", "SyncStrategy",
           "TimesWaits", "TrainBatch", "WireMetering", "WritesShardedCheckpoint", "Zero1Strategy", "build_strategy"]
