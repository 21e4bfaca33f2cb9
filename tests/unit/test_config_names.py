"""The names config accepts against what the other packages implement: each vocabulary is spelled once in
dtrain/config/names.py, and these tests fail when an implementation and its vocabulary part ways."""

from __future__ import annotations

import inspect
from typing import Any, get_args, get_type_hints

import pytest
from torch import nn

import dtrain.sync
from dtrain.compress import QSGD, REGISTRY, build_compressor
from dtrain.config import (
    COMPRESSION_OPTIONS,
    CONFIG_OPTIMIZERS,
    OPTIMIZER_OPTIONS,
    Compression,
    CompressorName,
    LargeBatch,
    OptimizerName,
    QSGDNorm,
    StrategyName,
    is_built,
)
from dtrain.optim.build import build_optimizer
from dtrain.sync.base import SyncStrategy

# A valid value, other than the default, for every option of `distributed.compression` and of `large_batch`.
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


def test_every_compressor_name_has_a_factory_that_says_that_name() -> None:
    assert sorted(REGISTRY) == sorted(get_args(CompressorName))
    for name in REGISTRY:
        assert build_compressor(name).name == name


def test_compression_section_has_a_field_for_each_option() -> None:
    assert set(Compression.model_fields) - {"name"} == set(COMPRESSION_OPTIONS)
    assert set(COMPRESSION_VALUES) == set(COMPRESSION_OPTIONS)


@pytest.mark.parametrize("name", get_args(CompressorName))
def test_each_compressor_takes_the_options_config_gives_it(name: str) -> None:
    given = {key: value for key, value in COMPRESSION_VALUES.items() if name in COMPRESSION_OPTIONS[key]}
    section = Compression(name=name, **given)
    assert section.options() == given
    assert set(given) <= set(inspect.signature(REGISTRY[name]).parameters)
    described = build_compressor(section.name, **section.options()).describe()
    assert {key: described[key] for key in given if key in described} == {
        key: value for key, value in given.items() if key in described}


def test_qsgd_norms_are_configs() -> None:
    assert get_type_hints(QSGD.__init__)["norm"] == QSGDNorm


def test_large_batch_section_has_a_field_for_each_option() -> None:
    assert set(OPTIMIZER_OPTIONS) <= set(LargeBatch.model_fields)
    assert set(OPTIMIZER_VALUES) == set(OPTIMIZER_OPTIONS)
    assert set(get_args(OptimizerName)) - set(CONFIG_OPTIMIZERS) == {"trial"}


@pytest.mark.parametrize("name", CONFIG_OPTIMIZERS)
def test_each_optimizer_is_built_with_the_options_config_gives_it(name: str) -> None:
    given = {key: value for key, value in OPTIMIZER_VALUES.items() if name in OPTIMIZER_OPTIONS[key]}
    optimizer = build_optimizer(LargeBatch(optimizer=name, **given), nn.Linear(3, 2), {})
    assert optimizer.defaults["lr"] == given["base_lr"] and optimizer.defaults["weight_decay"] == given["weight_decay"]
    for key, value in given.items():
        if key not in ("base_lr", "weight_decay"):
            assert optimizer.defaults.get(key, getattr(optimizer, key, None)) == value, key


def test_built_strategies_are_the_ones_sync_implements() -> None:
    implemented = {obj.name for obj in vars(dtrain.sync).values()
                   if isinstance(obj, type) and obj is not SyncStrategy and isinstance(getattr(obj, "name", None), str)}
    assert implemented <= set(get_args(StrategyName))
    assert {name for name in get_args(StrategyName) if is_built("distributed.strategy", name)} == implemented
