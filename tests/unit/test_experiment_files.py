"""Every experiment file in the repository (examples, fixtures, Determined-style trials, benchmarks' configs)
loads the way `dtrain run` loads it, and its resolved config (what a run dir's config.yaml holds) loads back
to the same config; the bad-input corpus is tests/faults/test_bad_input.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dtrain.config import load_config
from dtrain.config.loading import dump_config
from dtrain.errors import ConfigError
from tests.unit.test_determined_examples import load_as_dtrain_run

ROOT = Path(__file__).resolve().parents[2]
PLACES = ("examples", "tests/fixtures", "tests/determined_trials", "benchmarks")
# Experiment files that dtrain refuses on purpose, with the one line it refuses them with.
REFUSED = {"tests/determined_trials/examples/deepspeed.yaml": "DeepSpeed launch is not available"}


def experiment_files() -> list[str]:
    """Every YAML file under PLACES whose top level is an experiment's (it names an entrypoint)."""
    found = []
    for place in PLACES:
        for path in sorted((ROOT / place).rglob("*.y*ml")):
            documents = list(yaml.safe_load_all(path.read_text()))  # a Kubernetes manifest may hold several
            raw = documents[0] if len(documents) == 1 else None
            if isinstance(raw, dict) and "entrypoint" in raw:
                found.append(str(path.relative_to(ROOT)))
    return found


FILES = experiment_files()


def test_the_files_are_found() -> None:
    assert len(FILES) >= 35
    for place in PLACES:
        assert any(name.startswith(place) for name in FILES), place


@pytest.mark.parametrize("name", [name for name in FILES if name not in REFUSED])
def test_experiment_file_loads_and_its_resolved_config_loads_back(name: str) -> None:
    config = load_as_dtrain_run(ROOT / name)
    resolved = yaml.safe_load(dump_config(config))
    assert load_config(None, raw=resolved).config == config


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_experiment_file_gets_one_line(name: str) -> None:
    with pytest.raises(ConfigError, match=REFUSED[name]) as caught:
        load_config(ROOT / name)
    assert "\n" not in str(caught.value)
