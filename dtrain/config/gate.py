"""Settings that the config contract accepts but whose feature is not built yet: refused by name before a run
starts, so that a valid Determined file fails with one line instead of training something else."""

from __future__ import annotations

from typing import Any, get_args

from dtrain.config.experiment import ExperimentConfig
from dtrain.config.training import SearcherName
from dtrain.errors import ConfigError

NOT_BUILT_SEARCHERS = ("async_halving",)  # in the schema (Determined's names), refused by the search and a run

# (dotted key, the values that work today, why the others are refused)
NOT_BUILT_YET: list[tuple[str, tuple[Any, ...], str]] = [
    ("optimizations.mixed_precision", ("O0", "O1", "O2"), "O3 (pure fp16 weights) is not built; O1 and O2 run as "
     "`optimizations.precision: fp16` (autocast and a loss scaler)"),
    ("searcher.name", tuple(n for n in get_args(SearcherName) if n not in NOT_BUILT_SEARCHERS),
     "Determined's async_halving is not built; adaptive_asha is its adaptive form (docs/search.md)"),
]


def check_buildable(config: ExperimentConfig) -> None:
    """Refuse settings that are valid by the contract but whose feature is not built yet (docs/guide.md)."""
    for dotted, working, reason in NOT_BUILT_YET:
        value: Any = config
        for part in dotted.split("."):
            value = getattr(value, part)
        if value not in working:
            shown = " or ".join(repr(v) for v in working)
            raise ConfigError(f"`{dotted}` = {value!r}: {reason} (README, 'What works'); "
                              f"remove it or set it to {shown}")


def is_built(dotted: str, value: Any) -> bool:
    """False when `check_buildable` would refuse `value` for the key `dotted` (its feature is not built yet)."""
    return all(key != dotted or value in working for key, working, _ in NOT_BUILT_YET)
