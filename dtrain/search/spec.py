"""The `searcher:` section of a search, read as Determined's searchers define it (random, grid, adaptive_asha),
plus `optuna` (an Optuna sampler and pruner), with one clear line for what is wrong."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from dtrain.config.gate import NOT_BUILT_SEARCHERS
from dtrain.config.training import Searcher, SearcherName, SearchMode, SearchPruner, SearchSampler, SearchUnit
from dtrain.errors import ConfigError

# the choices are the config schema's (dtrain.config.training.Searcher), so that the reference lists what runs
SEARCHERS = tuple(name for name in get_args(SearcherName) if name not in ("single", *NOT_BUILT_SEARCHERS))
SAMPLERS: tuple[str, ...] = get_args(SearchSampler)
PRUNERS: tuple[str, ...] = get_args(SearchPruner)
UNITS: tuple[str, ...] = get_args(SearchUnit)
MODES: tuple[str, ...] = get_args(SearchMode)


@dataclass(frozen=True)
class SearchSpec:
    name: str
    metric: str
    smaller_is_better: bool
    max_length: int  # 0: a command entrypoint that sets its own length (random, grid); the trial reports it
    unit: str
    max_trials: int
    max_concurrent_trials: int
    divisor: float
    max_rungs: int
    mode: str
    bracket_rungs: tuple[int, ...]
    sampler: str = "tpe"  # searcher optuna
    pruner: str = "none"  # searcher optuna


def _length(value: Any, where: str) -> tuple[int, str]:
    if isinstance(value, Mapping) and len(value) == 1:
        unit, units = next(iter(value.items()))
        if unit in UNITS and isinstance(units, int) and not isinstance(units, bool) and units >= 1:
            return units, str(unit)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value, "batches"
    raise ConfigError(f"searcher.{where} {value!r}: give one of batches, records or epochs with a whole number "
                      f">= 1, e.g. `{where}: {{epochs: 4}}`")


def _whole(raw: Mapping[str, Any], key: str, default: int | None, minimum: int = 1) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ConfigError(f"searcher `{raw.get('name')}` needs {key}, e.g. `{key}: 16`")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"searcher.{key} {value!r} must be a whole number >= {minimum}")
    return value


def is_command_experiment(raw: Mapping[str, Any]) -> bool:
    """Whether the experiment file's entrypoint is a command (which sets its own length), not a Trial class."""
    from dtrain.config.entrypoint import parse_entrypoint

    entrypoint = raw.get("entrypoint")
    if not isinstance(entrypoint, str | list):
        return False
    try:
        return bool(parse_entrypoint(entrypoint).is_command)
    except ValueError:  # the loader says what is wrong with it
        return False


def parse_searcher(raw: Mapping[str, Any], command: bool = False) -> SearchSpec:
    """`searcher:` of a search experiment -> SearchSpec, or one ConfigError. With a `command` entrypoint, random
    and grid need no max_length (as in Determined): the script sets its own length and the searcher counts the
    steps it reports (max_length 0)."""
    defaults = Searcher()  # the schema's defaults, which the config reference shows
    name = raw.get("name", defaults.name)
    if name not in SEARCHERS:
        raise ConfigError(f"searcher.name {name!r} is not a search; the searches are {', '.join(SEARCHERS)}")
    if "max_time" in raw:
        metric_unit = raw.get("time_metric", defaults.time_metric)
        if metric_unit not in UNITS:
            raise ConfigError(f"searcher.time_metric {metric_unit!r}: use batches, records or epochs")
        units, unit = _length({metric_unit: raw["max_time"]}, "max_time")
    elif "max_length" in raw:
        units, unit = _length(raw["max_length"], "max_length")
    elif command and name in ("random", "grid"):
        units, unit = 0, "batches"
    else:
        timed = name in ("adaptive_asha", "optuna")
        wanted = "max_time (with time_metric) or max_length" if timed else "max_length"
        raise ConfigError(f"searcher `{name}` needs {wanted}: how long a trial trains at most, e.g. "
                          + ("`max_time: 4` and `time_metric: epochs`" if timed else "`max_length: {epochs: 4}`"))
    mode = raw.get("mode", defaults.mode)
    if mode not in MODES:
        raise ConfigError(f"searcher.mode {mode!r}: use {', '.join(MODES)}")
    divisor = raw.get("divisor", defaults.divisor)
    if isinstance(divisor, bool) or not isinstance(divisor, int | float) or divisor <= 1:
        raise ConfigError(f"searcher.divisor {divisor!r} must be a number > 1 (Determined's default is 4)")
    sampler, pruner = raw.get("sampler", defaults.sampler), raw.get("pruner", defaults.pruner)
    if sampler not in SAMPLERS:
        raise ConfigError(f"searcher.sampler {sampler!r}: use {', '.join(SAMPLERS)} (Optuna's samplers)")
    if pruner not in PRUNERS:
        raise ConfigError(f"searcher.pruner {pruner!r}: use {', '.join(PRUNERS)} (Optuna's pruners)")
    if name != "optuna" and ("sampler" in raw or "pruner" in raw):
        raise ConfigError(f"searcher.sampler and searcher.pruner belong to `name: optuna`, not `{name}`: drop them "
                          "or set `name: optuna`")
    gridded = name == "grid" or (name == "optuna" and sampler == "grid")
    max_trials = _whole(raw, "max_trials", 0 if gridded else None, 0 if gridded else 1)
    rungs = raw.get("bracket_rungs") or []
    return SearchSpec(name=name, metric=str(raw.get("metric", defaults.metric)),
                      smaller_is_better=bool(raw.get("smaller_is_better", defaults.smaller_is_better)),
                      max_length=units, unit=unit, max_trials=max_trials,
                      max_concurrent_trials=_whole(raw, "max_concurrent_trials", defaults.max_concurrent_trials, 0),
                      divisor=float(divisor), max_rungs=_whole(raw, "max_rungs", defaults.max_rungs), mode=mode,
                      bracket_rungs=tuple(int(r) for r in rungs), sampler=str(sampler), pruner=str(pruner))
