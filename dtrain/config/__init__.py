"""Experiment YAML -> typed, validated config: Determined's classic keys plus dtrain's own sections.

Every rule violation becomes one `ConfigError` line that names the key, the value, the rule and the fix.
Determined keys that configure its cluster (containers, pools, ...) are accepted with a warning, so a
classic experiment file runs unchanged; any other unknown key is rejected with the closest valid key.

One module per job: `base` (strict sections, Length), a module per group of sections (`training`,
`distributed`, `compression` (one section per compressor), `large_batch`, `optimizers` (one section per
optimizer), `profiling`, `faults`, `tracking`), `experiment` (the whole file), `names` (the names other
packages implement), `ignored` (Determined's cluster keys), `loading` (YAML and `--set`), `messages` (the
one-line errors), `gate` (features not built yet), `strategies` (each strategy's section and its rules),
`parallelism` (the rules every strategy declares by value, precision) and `reference`
(docs/config-reference.md).
"""

from dtrain.config.base import Length, Section
from dtrain.config.compression import COMPRESSORS, Compression, CompressorConfig, QSGDNorm
from dtrain.config.distributed import Distributed, Heterogeneous, Optimizations
from dtrain.config.experiment import ExperimentConfig
from dtrain.config.faults import Faults, Kill
from dtrain.config.gate import check_buildable, is_built
from dtrain.config.ignored import IGNORED_KEYS
from dtrain.config.large_batch import BatchSizeSchedule, Decay, LargeBatch
from dtrain.config.loading import LoadedConfig, apply_override, dump_config, load_config, parse_override, read_yaml
from dtrain.config.names import (
    DecayName,
    GrowBy,
    ParameterServerMode,
    ReduceOp,
    ScalingRule,
    StrategyName,
)
from dtrain.config.optimizers import OPTIMIZERS, LargeBatchSection
from dtrain.config.parallelism import effective_precision, model_parallel_size
from dtrain.config.profiling import Profiling
from dtrain.config.storage import STORAGE_TYPES, CheckpointStorage, StorageSection
from dtrain.config.strategies import (
    AllReduce,
    Fsdp,
    Hierarchical,
    LocalSGD,
    ParameterServer,
    Pipeline,
    StrategySection,
    StrategySections,
    Zero1,
    default_strategy,
    strategy_names,
)
from dtrain.config.tracking import MlflowTracking, Tracking
from dtrain.config.training import DataLoaderConfig, Reproducibility, Resources, Searcher

__all__ = ["COMPRESSORS", "IGNORED_KEYS", "OPTIMIZERS", "STORAGE_TYPES", "BatchSizeSchedule", "StorageSection",
           "CheckpointStorage", "Compression", "CompressorConfig", "DataLoaderConfig", "Faults", "Decay", "DecayName",
           "Distributed", "ExperimentConfig", "GrowBy", "Heterogeneous", "Kill", "LargeBatch", "LargeBatchSection",
           "Length", "LoadedConfig", "LocalSGD", "Optimizations", "ParameterServer", "ParameterServerMode",
           "Profiling", "QSGDNorm", "ReduceOp", "Reproducibility", "Resources", "ScalingRule", "Searcher", "Section",
           "StrategyName", "StrategySection", "StrategySections", "AllReduce", "Hierarchical", "Zero1", "Fsdp",
           "Pipeline", "MlflowTracking", "Tracking", "default_strategy", "strategy_names", "effective_precision",
           "model_parallel_size", "apply_override", "check_buildable", "dump_config", "is_built", "load_config",
           "parse_override", "read_yaml"]
