"""The names the config accepts and other packages implement, each spelled once here.

Config is the lowest layer that knows these names, so they live here and the implementing packages import
them (`sync`, `optim`): a name added here without an implementation, or the reverse, fails the tests that tie
each registry to its vocabulary (tests/unit/test_config_names.py). Compressors and optimizers are named by their
own config sections instead (`config/compression.py`, `config/optimizers.py`).
"""

from __future__ import annotations

from typing import Literal

StrategyName = Literal["allreduce", "parameter_server", "local_sgd", "hierarchical", "zero1", "fsdp", "pipeline",
                       "hsdp"]
DEFAULT_STRATEGY: StrategyName = "allreduce"
ReduceOp = Literal["average", "sum", "adasum"]
ParameterServerMode = Literal["sync", "async", "ssp"]
PrecisionName = Literal["fp32", "bf16", "fp16"]
PipelineScheduleName = Literal["gpipe", "1f1b"]

ScalingRule = Literal["none", "linear", "sqrt"]
DecayName = Literal["none", "step", "cosine", "poly"]
GrowBy = Literal["per_slot_batch", "aggregation_frequency"]

