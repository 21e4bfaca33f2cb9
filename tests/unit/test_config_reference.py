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
