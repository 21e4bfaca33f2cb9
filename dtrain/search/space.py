"""Determined's hyperparameter types as a search space: `const`, `int`, `double`, `log` (with `base`),
`categorical`, nested dictionaries; a plain value is a constant. Each trial gets concrete values: drawn at
random (`sample`) or from the grid (`grid`: `count` points per numeric hyperparameter, every value of a
categorical, as Determined's grid searcher builds it)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dtrain.errors import ConfigError

TYPES = ("const", "int", "double", "log", "categorical")


@dataclass(frozen=True)
class HParam:
    """One searchable hyperparameter (dotted name for nested ones)."""

    name: str
    kind: str
    minval: float = 0.0
    maxval: float = 0.0
    base: float = 10.0
    count: int | None = None
    vals: tuple[Any, ...] = ()

    def sample(self, rng: random.Random) -> Any:
        if self.kind == "const":
            return self.vals[0]
        if self.kind == "int":
            return rng.randint(int(self.minval), int(self.maxval))
        if self.kind == "double":
            return rng.uniform(self.minval, self.maxval)
        if self.kind == "log":
            return self.base ** rng.uniform(self.minval, self.maxval)
        return self.vals[rng.randrange(len(self.vals))]

    def grid(self) -> list[Any]:
        if self.kind in ("const", "categorical"):
            return list(self.vals)
        if self.count is None:
            raise ConfigError(f"hyperparameters.{self.name} (`type: {self.kind}`) needs `count` for a grid search: "
                              f"how many values between minval and maxval to try, e.g. `count: 3`")
        if self.kind == "int":
            count = min(self.count, int(self.maxval) - int(self.minval) + 1)
            if count == 1:
                return [_round_half_away((self.minval + self.maxval) / 2)]
            return [_round_half_away(self.minval + i * (self.maxval - self.minval) / (count - 1))
                    for i in range(count)]
        points = [(self.minval + self.maxval) / 2] if self.count == 1 else [
            self.minval + i * (self.maxval - self.minval) / (self.count - 1) for i in range(self.count)]
        return points if self.kind == "double" else [self.base ** p for p in points]


def _round_half_away(value: float) -> int:
    return int(math.floor(abs(value) + 0.5)) * (1 if value >= 0 else -1)


def _number(name: str, spec: Mapping[str, Any], key: str) -> float:
    value = spec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"hyperparameters.{name} (`type: {spec['type']}`) needs a number `{key}`, got {value!r}; "
                          f"e.g. `{key}: 1`")
    return float(value)


def parse_hparam(name: str, spec: Mapping[str, Any]) -> HParam:
    """One `{type: ...}` mapping -> HParam, or one clear ConfigError."""
    kind = spec["type"]
    if kind not in TYPES:
        raise ConfigError(f"hyperparameters.{name} has `type: {kind}`; the types are {', '.join(TYPES)}")
    if kind == "const":
        if "val" not in spec:
            raise ConfigError(f"hyperparameters.{name} has `type: const` without `val`; add e.g. `val: 0.1`")
        return HParam(name, kind, vals=(spec["val"],))
    if kind == "categorical":
        vals = spec.get("vals")
        if not isinstance(vals, list) or not vals:
            raise ConfigError(f"hyperparameters.{name} (`type: categorical`) needs a non-empty list `vals`, e.g. "
                              "`vals: [32, 64]`")
        return HParam(name, kind, vals=tuple(vals))
    low, high = _number(name, spec, "minval"), _number(name, spec, "maxval")
    if low > high:
        raise ConfigError(f"hyperparameters.{name}: minval {spec['minval']} is greater than maxval {spec['maxval']}; "
                          "swap them")
    if kind == "int" and (low != int(low) or high != int(high)):
        raise ConfigError(f"hyperparameters.{name} (`type: int`) needs whole minval and maxval, got {low} and {high}")
    count = spec.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ConfigError(f"hyperparameters.{name}: count {count!r} must be a whole number >= 1")
    base = float(spec.get("base", 10.0))
    if kind == "log" and (base <= 0 or base == 1):
        raise ConfigError(f"hyperparameters.{name}: log base {base} must be positive and not 1, e.g. `base: 10`")
    return HParam(name, kind, minval=low, maxval=high, base=base, count=count)


@dataclass(frozen=True)
class Space:
    """The hyperparameters of an experiment file, searchable ones and constants, by dotted name."""

    params: tuple[HParam, ...]

    @classmethod
    def parse(cls, hyperparameters: Mapping[str, Any]) -> Space:
        found: list[HParam] = []

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, Mapping) and "type" in value:
                found.append(parse_hparam(prefix, value))
            elif isinstance(value, Mapping):
                for key, inner in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), inner)
            else:
                found.append(HParam(prefix, "const", vals=(value,)))

        walk("", hyperparameters)
        return cls(tuple(found))

    @property
    def searchable(self) -> tuple[HParam, ...]:
        return tuple(p for p in self.params if p.kind != "const")

    def sample(self, rng: random.Random) -> dict[str, Any]:
        """One trial's hyperparameters, nested as in the file."""
        return _nest({p.name: p.sample(rng) for p in self.params})

    def grid(self) -> list[dict[str, Any]]:
        """Every point of the grid, in Determined's order (the first hyperparameter varies slowest)."""
        axes = [p.grid() for p in self.params]
        return [_nest(dict(zip((p.name for p in self.params), point, strict=True)))
                for point in itertools.product(*axes)]


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        target = nested
        *parents, leaf = dotted.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    return nested
