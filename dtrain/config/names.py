"""The names the config accepts and other packages implement, each spelled once here.

Config is the lowest layer that knows these names, so they live here and the implementing packages import
them (`compress`, `optim`, `sync`): a name added here without an implementation, or the reverse, fails the
tests that tie each registry to its vocabulary (tests/unit/test_config_names.py).
"""

from __future__ import annotations

from typing import Literal, get_args

StrategyName = Literal["allreduce", "parameter_server", "local_sgd", "hierarchical", "zero1", "fsdp", "pipeline"]
ReduceOp = Literal["average", "sum", "adasum"]
ParameterServerMode = Literal["sync", "async", "ssp"]
PrecisionName = Literal["fp32", "bf16", "fp16"]
PipelineScheduleName = Literal["gpipe", "1f1b"]

CompressorName = Literal["none", "fp16", "bf16", "qsgd", "topk", "powersgd", "sign", "bounded_loss"]
QSGDNorm = Literal["l2", "max"]

OptimizerName = Literal["trial", "sgd", "lars", "lamb", "radam", "adam", "adamw"]
ScalingRule = Literal["none", "linear", "sqrt"]
DecayName = Literal["none", "step", "cosine", "poly"]
GrowBy = Literal["per_slot_batch", "aggregation_frequency"]

# Options of `distributed.compression` and the compressors they apply to (unset = that compressor's default).
COMPRESSION_OPTIONS: dict[str, tuple[CompressorName, ...]] = {
    "ratio": ("topk",),
    "error_feedback": ("topk", "powersgd", "sign", "qsgd", "bounded_loss"),
    "warmup_steps": ("topk",),
    "warmup_start_ratio": ("topk",),
    "levels": ("qsgd",),
    "norm": ("qsgd",),
    "chunk_size": ("qsgd", "bounded_loss"),
    "rank": ("powersgd",),
    "start_iter": ("powersgd",),
    "warm_start": ("powersgd",),
    "min_compression_rate": ("powersgd",),
    "epsilon": ("bounded_loss",),
    "layer_priority": ("bounded_loss",),
    "seed": ("qsgd", "topk", "powersgd"),
}

# The optimizers dtrain builds from config: every name but `trial` (the Trial builds its own).
CONFIG_OPTIMIZERS: tuple[OptimizerName, ...] = tuple(name for name in get_args(OptimizerName) if name != "trial")

# Optimizer options of `large_batch` and the optimizers they apply to (unset = that optimizer's default).
OPTIMIZER_OPTIONS: dict[str, tuple[OptimizerName, ...]] = {
    "base_lr": CONFIG_OPTIMIZERS,
    "weight_decay": CONFIG_OPTIMIZERS,
    "momentum": ("sgd", "lars"),
    "nesterov": ("sgd",),
    "trust_coefficient": ("lars",),
    "exclude_bias_and_norm": ("lars", "lamb"),
    "betas": ("lamb", "radam", "adam", "adamw"),
    "eps": ("lamb", "radam", "adam", "adamw"),
    "bias_correction": ("lamb",),
    "max_grad_norm": ("lamb",),
    "max_trust_ratio": ("lamb",),
}
