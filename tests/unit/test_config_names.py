"""The names config accepts against what the other packages implement: strategy names are spelled once in
dtrain/config/names.py, compressors and optimizers by their config sections (dtrain/config/compression.py,
dtrain/config/optimizers.py); these tests fail when an implementation and its config part ways."""

from __future__ import annotations

import inspect
from typing import Any, get_args, get_type_hints

import pytest
import torch
from torch import nn

import dtrain.sync
from dtrain.compress import QSGD, REGISTRY, build_compressor
from dtrain.config import COMPRESSORS, OPTIMIZERS, LargeBatch, QSGDNorm, StrategyName, is_built
from dtrain.optim import LAMB, LARS
from dtrain.optim.build import build_optimizer

# A valid value, other than the default, for every option of every compressor's and optimizer's section.
COMPRESSION_VALUES: dict[str, Any] = {
    "ratio": 0.05, "error_feedback": True, "warmup_steps": 3, "warmup_start_ratio": 0.5, "levels": 15, "norm": "max",
    "chunk_size": 64, "rank": 2, "start_iter": 3, "warm_start": False, "min_compression_rate": 1.5, "epsilon": 0.1,
    "layer_priority": 0.5, "seed": 7,
}
OPTIMIZER_VALUES: dict[str, Any] = {
    "base_lr": 0.3, "weight_decay": 0.01, "momentum": 0.5, "nesterov": True, "trust_coefficient": 0.01,
    "exclude_bias_and_norm": False, "betas": (0.8, 0.9), "eps": 1e-4, "bias_correction": False, "max_grad_norm": 2.0,
    "max_trust_ratio": 5.0,
}
# The class each optimizer's section builds, and the defaults dtrain sets on purpose that differ from the class's.
OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "lars": LARS, "lamb": LAMB, "radam": torch.optim.RAdam, "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW}
DTRAIN_DEFAULTS: dict[tuple[str, str], Any] = {("sgd", "momentum"): 0.9}


def test_every_compressor_section_has_a_factory_that_says_that_name() -> None:
    assert list(REGISTRY) == list(COMPRESSORS)
    for name in REGISTRY:
        assert build_compressor(name).name == name


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_each_compressor_section_holds_its_class_options_and_defaults(name: str) -> None:
    section = COMPRESSORS[name]()
    parameters = inspect.signature(REGISTRY[name]).parameters
    assert section.options() == {key: parameters[key].default for key in section.options()}, name


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_each_compressor_takes_the_options_config_gives_it(name: str) -> None:
    given = {key: value for key, value in COMPRESSION_VALUES.items() if key in COMPRESSORS[name].model_fields}
    section = COMPRESSORS[name](**given)
    assert section.options() == {**COMPRESSORS[name]().options(), **given}
    described = build_compressor(section.name, **section.options()).describe()
    assert {key: described[key] for key in given if key in described} == {
        key: value for key, value in given.items() if key in described}


def test_every_compressor_option_has_a_test_value() -> None:
    options = {key for section in COMPRESSORS.values() for key in section.model_fields if key != "name"}
    assert options == set(COMPRESSION_VALUES)


def test_qsgd_norms_are_configs() -> None:
    assert get_type_hints(QSGD.__init__)["norm"] == QSGDNorm


def test_every_optimizer_section_but_trial_builds_a_class() -> None:
    assert set(OPTIMIZERS) - set(OPTIMIZER_CLASSES) == {"trial"}
    options = {key for section in OPTIMIZERS.values() for key in section.model_fields}
    assert options - set(LargeBatch.model_fields) | {"base_lr", "weight_decay"} == set(OPTIMIZER_VALUES)


@pytest.mark.parametrize("name", list(OPTIMIZER_CLASSES))
def test_each_optimizer_section_defaults_are_its_class_defaults(name: str) -> None:
    options = OPTIMIZERS[name]().optimizer_options()
    parameters = inspect.signature(OPTIMIZER_CLASSES[name]).parameters
    expected = {key: DTRAIN_DEFAULTS.get((name, key), parameters[key].default) for key in options}
    assert options == expected


@pytest.mark.parametrize("name", list(OPTIMIZER_CLASSES))
def test_each_optimizer_is_built_with_the_options_config_gives_it(name: str) -> None:
    section = OPTIMIZERS[name]
    given = {key: value for key, value in OPTIMIZER_VALUES.items() if key in section.model_fields}
    optimizer = build_optimizer(section(**given), nn.Linear(3, 2), {})
    assert isinstance(optimizer, OPTIMIZER_CLASSES[name])
    assert optimizer.defaults["lr"] == given["base_lr"] and optimizer.defaults["weight_decay"] == given["weight_decay"]
    for key, value in given.items():
        if key not in ("base_lr", "weight_decay"):
            assert optimizer.defaults.get(key, getattr(optimizer, key, None)) == value, key


def test_built_strategies_are_the_ones_sync_implements() -> None:
    implemented = set(dtrain.sync.REGISTRY)
    assert implemented <= set(get_args(StrategyName))
    assert {name for name in get_args(StrategyName) if is_built("distributed.strategy", name)} == implemented
