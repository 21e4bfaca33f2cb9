"""Rules that tie the strategy named and mixed precision to the rest of the file: which settings the strategy
takes (read from its section, dtrain/config/strategies.py), which layouts the slots can hold, and which precision
a run trains in."""

from __future__ import annotations

from dtrain.config.compression import Compression
from dtrain.config.distributed import Distributed, Optimizations
from dtrain.config.names import PrecisionName
from dtrain.config.strategies import RunShape, default_strategy, strategies_where


def effective_precision(optimizations: Optimizations) -> PrecisionName:
    """`optimizations.precision`, or fp16 for Determined's `mixed_precision: O1/O2` (Apex's fp16 levels)."""
    if optimizations.mixed_precision in ("O1", "O2"):
        return "fp16"
    return optimizations.precision


def model_parallel_size(distributed: Distributed) -> int:
    """Ranks that share one data replica's batches: the pipeline's stages, else 1."""
    return distributed.chosen.model_parallel_size()


def check_layout(opt: Optimizations, dist: Distributed, compression: Compression, shape: RunShape) -> None:
    """Raise ValueError (one line: value, rule, fix) for a precision, layout or setting the strategy named cannot
    run: the rules every strategy's section declares by value, then the strategy's own `check()`."""
    if opt.mixed_precision in ("O1", "O2") and opt.precision == "bf16":
        raise ValueError(f"optimizations.mixed_precision {opt.mixed_precision} (fp16) and optimizations.precision "
                         "bf16 name two precisions; remove one of them")
    strategy = dist.chosen
    if effective_precision(opt) == "fp16" and not strategy.fp16:
        raise ValueError(f"optimizations.precision fp16 needs a loss scaler that all workers agree on at each step, "
                         f"which strategy {dist.strategy} cannot give; use bf16 or strategy {default_strategy()}")
    if dist.op not in strategy.ops:
        takers = " or ".join(strategies_where(lambda section: dist.op in section.ops))
        raise ValueError(f"distributed.op `{dist.op}` applies to strategy {takers}; strategy {dist.strategy} "
                         f"combines gradients by {' or '.join(strategy.ops)}: remove distributed.op")
    if compression.name != "none" and not strategy.compresses:
        takers = " or ".join(strategies_where(lambda section: section.compresses))
        raise ValueError(f"gradient compression `{compression.name}` applies to strategy {takers}, not to "
                         f"{dist.strategy} (it sends full-precision gradients); remove distributed.compression")
    if dist.heterogeneous is not None and not strategy.uneven_batches:
        raise ValueError(f"distributed.heterogeneous re-balances batches where all ranks meet every update with one "
                         f"batch each; strategy {dist.strategy} does not (it paces ranks on its own or splits a batch "
                         "into microbatches): remove one of them")
    strategy.check(shape)
