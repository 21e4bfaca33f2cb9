"""`dtrain preview`: what a search would run, like Determined's `det preview-search`, without training."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from dtrain.errors import ConfigError
from dtrain.search import asha
from dtrain.search.space import Space
from dtrain.search.spec import is_command_experiment, parse_searcher


def preview(raw: Mapping[str, Any]) -> str:
    """The plan of the search an experiment file (as a dict) describes."""
    searcher = raw.get("searcher")
    if not isinstance(searcher, Mapping):
        raise ConfigError("the experiment file has no `searcher:` section; add one, e.g. `searcher: {name: random, "
                          "max_trials: 8, max_length: {epochs: 4}, metric: validation_loss}`")
    spec = parse_searcher(searcher, command=is_command_experiment(raw))
    space = Space.parse(raw.get("hyperparameters") or {})
    names = ", ".join(p.name for p in space.searchable) or "none (every hyperparameter is a constant)"
    lines = [f"searcher {spec.name}, metric {spec.metric} ({'smaller' if spec.smaller_is_better else 'larger'} is "
             f"better); searched: {names}"]
    own = "the length the command sets itself (no searcher.max_length: the searcher counts what it reports)"
    if spec.name == "random":
        each = f"{spec.max_length} {spec.unit}" if spec.max_length else own
        in_all = f"{spec.max_trials * spec.max_length} {spec.unit} in all" if spec.max_length else "each trial its own"
        lines.append(f"{spec.max_trials} trials of {each}, up to {spec.max_concurrent_trials or spec.max_trials} at "
                     f"once: {in_all}")
        example = space.sample(random.Random(0))
        lines.append(f"first trial's hyperparameters (seed 0): {example}")
    elif spec.name == "optuna":
        total = len(space.grid()) if spec.sampler == "grid" else spec.max_trials
        lines.append(f"Optuna sampler {spec.sampler}, pruner {spec.pruner}: {total} trials of at most "
                     f"{spec.max_length} {spec.unit}, up to {spec.max_concurrent_trials or total} at once: at most "
                     f"{total * spec.max_length} {spec.unit} in all (the pruner stops trials as they report)")
    elif spec.name == "grid":
        points = space.grid()
        if spec.max_length:
            lines.append(f"{len(points)} grid points, each trained for {spec.max_length} {spec.unit}: "
                         f"{len(points) * spec.max_length} {spec.unit} in all")
        else:
            lines.append(f"{len(points)} grid points, each trained for {own}")
        for p in space.searchable:
            lines.append(f"  {p.name}: {p.grid()}")
    else:
        brackets = asha.plan(spec.max_trials, spec.max_length, spec.divisor, spec.max_rungs, spec.mode,
                             spec.max_concurrent_trials, list(spec.bracket_rungs) or None)
        total = 0
        for index, bracket in enumerate(brackets):
            reached = bracket.expected_trials_per_rung(spec.divisor)
            lines.append(f"bracket {index + 1}: {bracket.rungs} rung(s), {bracket.max_trials} trials, up to "
                         f"{bracket.max_concurrent_trials} at once")
            before = 0
            for rung, (units, trials) in enumerate(zip(bracket.units, reached, strict=True)):
                lines.append(f"  rung {rung + 1}: {trials} trial(s) reach {units} {spec.unit}")
                total += trials * (units - before)
                before = units
        full = spec.max_trials * spec.max_length
        lines.append(f"about {total} {spec.unit} in all if every rung keeps exactly its top 1/{spec.divisor:g} "
                     f"({total / full:.0%} of training all {spec.max_trials} trials fully: {full} {spec.unit})")
    return "\n".join(lines)
