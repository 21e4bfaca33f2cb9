"""docs/config-reference.md is generated from the config classes: it must be current, and every key must
carry a description for it to show."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from dtrain.config import COMPRESSORS, OPTIMIZERS, ExperimentConfig, Length
from dtrain.config.reference import COMMAND, generate, main

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def sections(model: type[BaseModel]) -> list[type[BaseModel]]:
    """`model` and every section class under it."""
    found = [model]
    for info in model.model_fields.values():
        for inner in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in found:
                found += [s for s in sections(inner) if s not in found]
    return found


def test_checked_in_reference_is_what_the_generator_writes() -> None:
    assert REFERENCE.read_text() == generate(), f"docs/config-reference.md is stale: run `{COMMAND} > {REFERENCE}`"


def test_every_key_has_a_description_and_a_row() -> None:
    classes = sections(ExperimentConfig)
    assert Length in classes and len(classes) >= 17
    text = generate()
    for model in classes:
        assert model.__doc__, model.__name__
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            assert f".{name}` |" in text or f"| `{name}` |" in text, name


def test_reference_marks_what_is_not_built_and_which_option_belongs_to_whom() -> None:
    rows = {line.split(" | ")[0].strip("| `"): line for line in generate().splitlines() if line.startswith("| `")}
    assert "`O3` (not built yet)" in rows["optimizations.mixed_precision"]
    assert "`local_sgd`," in rows["distributed.strategy"]
    assert "`parameter_server`," in rows["distributed.strategy"]
    assert "> 0, <= 1" in rows["distributed.compression.ratio"]
    assert "| `{batches: 0}` |" in rows["min_validation_period"]
    assert "| required |" in rows["entrypoint"]
    assert "no effect" not in rows["environment"] and "containers" in rows["environment"]


def test_each_compressor_and_optimizer_has_its_own_section() -> None:
    text = generate()
    for name, section in COMPRESSORS.items():
        assert f"## `distributed.compression` with name `{name}`" in text
        table = text.split(f"## `distributed.compression` with name `{name}`")[1].split("\n## ")[0]
        for key in section.model_fields:
            assert (f"| `distributed.compression.{key}` |" in table) == (key != "name"), (name, key)
    for name in OPTIMIZERS:
        assert f"## `large_batch` with optimizer `{name}`" in text
    lamb = text.split("## `large_batch` with optimizer `lamb`")[1].split("\n## ")[0]
    assert "| `large_batch.eps` | number | `1e-06` |" in lamb and "`large_batch.momentum`" not in lamb
    assert "[`topk`](#distributedcompression-with-name-topk)" in text


def test_check_fails_on_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    current, stale = tmp_path / "current.md", tmp_path / "stale.md"
    current.write_text(generate())
    stale.write_text(generate().replace("`allreduce`", "`all_reduce`"))
    assert main(["--check", str(current)]) == 0
    assert main(["--check", str(stale)]) == 1
    assert main(["--check", str(tmp_path / "missing.md")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "stale" in lines[0] and "cannot read" in lines[1]


def test_the_searcher_rows_are_what_a_search_reads() -> None:
    """The search keys have rows, and the searchers `dtrain run` runs are not marked unbuilt (the reference once
    marked random, grid and adaptive_asha `(not built yet)` while they ran)."""
    rows = {line.split(" | ")[0].strip("| `"): line for line in generate().splitlines() if line.startswith("| `")}
    for key in ("max_trials", "max_concurrent_trials", "max_time", "time_metric", "divisor", "max_rungs", "mode",
                "bracket_rungs", "sampler", "pruner"):
        assert f"searcher.{key}" in rows, key
    assert "`random`, `grid`, `adaptive_asha`, `optuna`, `async_halving` (not built yet)" in rows["searcher.name"]


def test_a_value_marked_unbuilt_is_refused_and_every_other_choice_runs() -> None:
    """The check that missed the stale searcher names: every choice the reference marks `(not built yet)` is
    refused where a run starts (check_buildable, and the search's parse_searcher for a searcher name), and every
    searcher name it leaves unmarked is one that runs (a search, or `single`)."""
    from typing import get_args

    from dtrain.config import check_buildable, load_config
    from dtrain.config.training import SearcherName
    from dtrain.errors import ConfigError
    from dtrain.search.spec import SEARCHERS, parse_searcher

    marked = {name for name in get_args(SearcherName)
              if f"`{name}` (not built yet)" in generate()}
    assert marked == {"async_halving"}
    for name in get_args(SearcherName):
        raw = {"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
               "searcher": {"name": name, "max_length": {"batches": 1}, "max_trials": 2}}
        config = load_config(None, raw=raw).config
        if name in marked:
            with pytest.raises(ConfigError, match="not built"):
                check_buildable(config)
            with pytest.raises(ConfigError, match="is not a search"):
                parse_searcher(raw["searcher"])
        else:
            check_buildable(config)
            assert name == "single" or (name in SEARCHERS and parse_searcher(raw["searcher"]).name == name)


def test_a_search_reads_the_schemas_defaults() -> None:
    """dtrain.search.spec applies the defaults the reference shows."""
    from dtrain.config.training import Searcher
    from dtrain.search.spec import parse_searcher

    spec = parse_searcher({"name": "optuna", "max_trials": 2, "max_length": 3})
    schema = Searcher()
    assert (spec.max_concurrent_trials, spec.divisor, spec.max_rungs, spec.mode, spec.sampler, spec.pruner,
            spec.metric, spec.smaller_is_better, list(spec.bracket_rungs)) == (
        schema.max_concurrent_trials, schema.divisor, schema.max_rungs, schema.mode, schema.sampler, schema.pruner,
        schema.metric, schema.smaller_is_better, schema.bracket_rungs)
    assert parse_searcher({"name": "optuna", "max_trials": 2, "max_time": 3}).unit == schema.time_metric
