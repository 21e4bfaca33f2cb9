"""The performance model: predict step time and scaling of synchronous data parallelism before the cluster
exists. Pure functions in SI units (the unit is in every name), each citing its source. Nothing here imports
torch or the rest of dtrain: measuring a machine or a model for it is dtrain.calibrate.

    from dtrain.plan import MODELS, ComputeSpec, TopologySpec, StrategySpec, predict_step
    p = predict_step(MODELS["resnet50"], ComputeSpec.from_samples_per_second(400), TopologySpec(...),
                     StrategySpec(algorithm="ring"), devices=64, per_device_batch=32)
"""

from dtrain.plan.collectives import (
    allreduce_seconds,
    fewest_servers_to_carry,
    halving_doubling_allreduce_seconds,
    hierarchical_allreduce_seconds,
    parameter_server_bytes_per_server,
    parameter_server_seconds,
    ring_allreduce_seconds,
    shared_medium_allreduce_seconds,
    tree_allreduce_seconds,
)
from dtrain.plan.presets import MODELS, model_preset
from dtrain.plan.spec import ComputeSpec, HostCost, ModelSpec, StrategySpec, TopologySpec
from dtrain.plan.step import Prediction, predict_step, sweep_devices

__all__ = ["MODELS", "ComputeSpec", "HostCost", "ModelSpec", "Prediction", "StrategySpec", "TopologySpec",
           "allreduce_seconds", "fewest_servers_to_carry", "halving_doubling_allreduce_seconds",
           "hierarchical_allreduce_seconds", "model_preset", "parameter_server_bytes_per_server",
           "parameter_server_seconds", "predict_step", "ring_allreduce_seconds", "shared_medium_allreduce_seconds",
           "sweep_devices", "tree_allreduce_seconds"]
