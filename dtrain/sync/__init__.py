"""Strategies that keep replicas consistent, behind one protocol, picked by `distributed.strategy`."""

from __future__ import annotations

from dtrain.comm import Topology
from dtrain.compress import build_compressor
from dtrain.config import ExperimentConfig
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.base import SyncStrategy
from dtrain.sync.parameter_server import ParameterServerStrategy

__all__ = ["AllReduceStrategy", "ParameterServerStrategy", "SyncStrategy", "build_strategy"]


def build_strategy(config: ExperimentConfig, topology: Topology) -> SyncStrategy:
    """The strategy the config names, configured from its `distributed` and `optimizations` sections."""
    name = config.distributed.strategy
    if name == "allreduce":
        return AllReduceStrategy(topology, op=config.distributed.op,
                                 bucket_cap_mb=config.optimizations.tensor_fusion_threshold,
                                 first_bucket_mb=config.optimizations.first_bucket_mb,
                                 auto_tune_fusion=config.optimizations.auto_tune_tensor_fusion,
                                 find_unused_parameters=config.distributed.find_unused_parameters,
                                 compressor=build_compressor(config.compression.name, **config.compression.options()))
    if name == "parameter_server":
        return ParameterServerStrategy(topology, config.distributed.parameter_server,
                                       timeout_seconds=config.distributed.timeout_seconds)
    raise ValueError(f"strategy {name!r} is not built")  # check_buildable() refuses it before we get here
