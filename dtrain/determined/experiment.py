"""Determined's experiment-file habits that reach beyond one config key. Searcher `single` over hyperparameters
given as ranges (Determined's Core API tutorials do this): Determined trains one trial with values drawn from the
ranges, so dtrain draws them once, from `reproducibility.experiment_seed` (the same values on every resume)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any


def single_searcher_draw(raw: Mapping[str, Any]) -> list[str]:
    """`--set hyperparameters.<name>=<value>` overrides for the ranges of a `single` experiment (none otherwise)."""
    from dtrain.search.space import Space

    searcher = raw.get("searcher")
    if isinstance(searcher, Mapping) and searcher.get("name", "single") != "single":
        return []
    hyperparameters = raw.get("hyperparameters")
    if not isinstance(hyperparameters, Mapping):
        return []
    space = Space.parse(hyperparameters)
    if not space.searchable:
        return []
    seed = (raw.get("reproducibility") or {}).get("experiment_seed", 0)
    rng = random.Random(int(seed) if isinstance(seed, int) else 0)
    return [f"hyperparameters.{p.name}={json.dumps(p.sample(rng))}" for p in space.searchable]
