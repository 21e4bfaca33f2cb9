"""Rules that tie the sharded and pipelined strategies and mixed precision to the rest of the file: which layouts
the slots can hold, which settings the strategies take, and which precision a run trains in."""

from __future__ import annotations

from dtrain.config.distributed import Compression, Distributed, Optimizations
from dtrain.config.names import PrecisionName

SHARDED_STRATEGIES = ("zero1", "fsdp", "pipeline")


def effective_precision(optimizations: Optimizations) -> PrecisionName:
    """`optimizations.precision`, or fp16 for Determined's `mixed_precision: O1/O2` (Apex's fp16 levels)."""
    if optimizations.mixed_precision in ("O1", "O2"):
        return "fp16"
    return optimizations.precision


def model_parallel_size(distributed: Distributed) -> int:
    """Ranks that share one data replica's batches: the pipeline's stages, else 1."""
    return distributed.pipeline.stages if distributed.strategy == "pipeline" else 1


def check_layout(*, optimizations: Optimizations, distributed: Distributed, compression: Compression,
                 world_size: int, global_batch_size: object) -> None:
    """Raise ValueError (one line: value, rule, fix) for a layout or setting the strategy cannot run."""
    opt, dist = optimizations, distributed
    if opt.mixed_precision in ("O1", "O2") and opt.precision == "bf16":
        raise ValueError(f"optimizations.mixed_precision {opt.mixed_precision} (fp16) and optimizations.precision "
                         "bf16 name two precisions; remove one of them")
    if effective_precision(opt) == "fp16" and dist.strategy == "parameter_server":
        raise ValueError("optimizations.precision fp16 needs a loss scaler that all workers agree on at each step, "
                         "which strategy parameter_server cannot give; use bf16 or strategy allreduce")
    if dist.strategy not in SHARDED_STRATEGIES:
        return
    if dist.op != "average":
        raise ValueError(f"distributed.op `{dist.op}` applies to strategy allreduce; strategy {dist.strategy} "
                         "averages gradients: remove distributed.op")
    if compression.name != "none":
        raise ValueError(f"gradient compression `{compression.name}` applies to strategy allreduce, not to "
                         f"{dist.strategy}; remove distributed.compression")
    if dist.strategy == "pipeline":
        _check_pipeline(opt, dist, world_size, global_batch_size)


def _check_pipeline(opt: Optimizations, dist: Distributed, slots: int, gbs: object) -> None:
    p = dist.pipeline
    if slots % p.stages:
        raise ValueError(f"distributed.pipeline.stages ({p.stages}) must divide resources.slots_per_trial ({slots}): "
                         f"each pipeline replica needs {p.stages} slots; use slots_per_trial "
                         f"{max(p.stages, slots - slots % p.stages)} or stages that divide {slots}")
    replicas = slots // p.stages
    if isinstance(gbs, int) and gbs % (replicas * p.microbatches):
        raise ValueError(f"hyperparameters.global_batch_size ({gbs}) must split into {replicas} pipeline replica(s) x "
                         f"{p.microbatches} microbatches of equal size; use a multiple of {replicas * p.microbatches}")
    if p.split_points and len(p.split_points) != p.stages - 1:
        raise ValueError(f"distributed.pipeline.split_points names {len(p.split_points)} cut(s) "
                         f"({', '.join(p.split_points)}) for {p.stages} stages; name stages - 1 = {p.stages - 1}")
    if dist.heterogeneous is not None:
        raise ValueError("distributed.heterogeneous with strategy pipeline: per-rank batch shares are not built for "
                         "pipeline replicas; remove distributed.heterogeneous")
    if opt.aggregation_frequency != 1:
        raise ValueError("optimizations.aggregation_frequency > 1 with strategy pipeline: raise "
                         "distributed.pipeline.microbatches instead (microbatches already accumulate gradients)")
