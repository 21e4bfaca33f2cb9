"""Gradient compressors, picked by name (`distributed.compression.name`): none, fp16, bf16, qsgd, topk,
powersgd, sign, bounded_loss. Each turns a gradient bucket into rounds of communication and back
(`dtrain.compress.base`); `dtrain.sync.hooks` runs them inside DDP's backward pass. How to add one:
docs/compression.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtrain.compress.base import BucketInfo, Compressor, CompressorState, Decoded, Round, WireStats, wire_bytes
from dtrain.compress.bounded_loss import BoundedLoss
from dtrain.compress.cast import CastCompression, NoCompression, bf16, fp16
from dtrain.compress.powersgd import PowerSGD
from dtrain.compress.qsgd import QSGD
from dtrain.compress.sign import SignCompression
from dtrain.compress.topk import TopK

# name -> factory taking the options of that compressor's config section (dtrain.config.compression) as keyword
# arguments; tests/unit/test_config_names.py checks that every section has a factory here and the reverse
REGISTRY: dict[str, Callable[..., Compressor]] = {
    "none": NoCompression,
    "fp16": fp16,
    "bf16": bf16,
    "qsgd": QSGD,
    "topk": TopK,
    "powersgd": PowerSGD,
    "sign": SignCompression,
    "bounded_loss": BoundedLoss,
}


def build_compressor(name: str, **options: Any) -> Compressor:
    """The compressor `name` with `options` (keyword arguments of its class; unset ones take defaults)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name](**{key: value for key, value in options.items() if value is not None})


__all__ = ["REGISTRY", "BoundedLoss", "BucketInfo", "CastCompression", "Compressor", "CompressorState", "Decoded",
           "NoCompression", "PowerSGD", "QSGD", "Round", "SignCompression", "TopK", "WireStats", "bf16",
           "build_compressor", "fp16", "wire_bytes"]
