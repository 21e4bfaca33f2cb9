"""Strategies that keep replicas consistent, behind one protocol, picked by `distributed.strategy` from a registry:
a new strategy is one module (its class and its `StrategySpec`), one line in `REGISTRY`, and its config section
with its rules in dtrain/config/strategies.py (docs/strategies.md)."""

from __future__ import annotations

from dtrain.comm import Topology
from dtrain.config import ExperimentConfig
from dtrain.sync import allreduce, fsdp, hierarchical, hsdp, local_sgd, parameter_server, pipeline, zero
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.base import (
    AsynchronousPacing,
    CollectiveForward,
    ComputePhases,
    Consolidating,
    EvaluatesInStages,
    HoldsModelParts,
    OwnsCheckpointState,
    RunsForwardBackward,
    ShardedConstruction,
    StrategyBase,
    SyncStrategy,
    TrainBatch,
    WritesShardedCheckpoint,
    forward_is_collective,
)
from dtrain.sync.fsdp import FsdpStrategy
from dtrain.sync.hierarchical import HierarchicalStrategy
from dtrain.sync.local_sgd import LocalSGDStrategy
from dtrain.sync.parameter_server import ParameterServerStrategy
from dtrain.sync.pipeline import PipelineStrategy
from dtrain.sync.spec import StrategyBuilder, StrategySpec
from dtrain.sync.zero import Zero1Strategy

# distributed.strategy -> the strategy's spec (builder, server processes, summary line), one line each
REGISTRY: dict[str, StrategySpec] = {spec.name: spec for spec in (
    allreduce.SPEC,
    parameter_server.SPEC,
    local_sgd.SPEC,
    hierarchical.SPEC,
    zero.SPEC,
    fsdp.SPEC,
    pipeline.SPEC,
    hsdp.SPEC,
)}


def strategy_spec(name: str) -> StrategySpec:
    """The spec registered as `name` (a `distributed.strategy` value)."""
    spec = REGISTRY.get(name)
    if spec is None:  # check_buildable() refuses it before we get here
        raise ValueError(f"strategy {name!r} is not built; registered: {', '.join(sorted(REGISTRY))}")
    return spec


def build_strategy(config: ExperimentConfig, topology: Topology) -> SyncStrategy:
    """The strategy the config names, built by its registered builder."""
    return strategy_spec(config.distributed.strategy).build(config, topology)


__all__ = ["REGISTRY", "AllReduceStrategy", "AsynchronousPacing", "CollectiveForward", "ComputePhases",
           "Consolidating", "EvaluatesInStages", "FsdpStrategy", "HierarchicalStrategy", "HoldsModelParts",
           "LocalSGDStrategy", "OwnsCheckpointState", "ParameterServerStrategy", "PipelineStrategy",
           "RunsForwardBackward", "ShardedConstruction", "StrategyBase", "StrategyBuilder", "StrategySpec",
           "SyncStrategy", "TrainBatch", "WritesShardedCheckpoint", "Zero1Strategy", "build_strategy",
           "forward_is_collective", "strategy_spec"]
