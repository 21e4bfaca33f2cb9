"""The `distributed.compression` section: one small section per compressor, picked by `name` (a pydantic
discriminated union), each holding only its compressor's options with that compressor's defaults.

The compressors themselves live in `dtrain.compress`, which imports config (config may not import it back),
so each compressor's section lives here; `dtrain.compress.REGISTRY` maps the same names to the classes and
tests/unit/test_config_names.py checks that each section's options and defaults are its class's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from dtrain.config.base import Section, variants

QSGDNorm = Literal["l2", "max"]

_ERROR_FEEDBACK = "keep what compression left out and add it to the next update's gradient"
_SEED = "seed of the compressor's random choices"


class CompressorConfig(Section):
    """Gradient compression for the allreduce strategy: a compressor between each gradient bucket and the wire,
    picked by `name`. Each compressor has its own options (the sections below, one per name); options left out
    take that compressor's default."""

    name: str = Field(description="the compressor")

    def options(self) -> dict[str, Any]:
        """The compressor's options, as keyword arguments of its class."""
        return {key: getattr(self, key) for key in type(self).model_fields if key != "name"}


class NoCompressionConfig(CompressorConfig):
    """`none`: the gradients go on the wire as they are (DDP's own all-reduce)."""

    name: Literal["none"] = Field(default="none", description="the compressor")


class Fp16Config(CompressorConfig):
    """`fp16`: the gradients divided by the world size and all-reduced in 16-bit floats."""

    name: Literal["fp16"] = Field(default="fp16", description="the compressor")


class Bf16Config(CompressorConfig):
    """`bf16`: the gradients divided by the world size and all-reduced in bfloat16."""

    name: Literal["bf16"] = Field(default="bf16", description="the compressor")


class QSGDConfig(CompressorConfig):
    """`qsgd`: QSGD (Alistarh et al. 2017), per chunk one norm and per element a stochastically rounded level."""

    name: Literal["qsgd"] = Field(default="qsgd", description="the compressor")
    levels: int = Field(default=127, ge=1, le=127, description="s, the quantization levels (sign and level share "
                                                               "one byte)")
    chunk_size: int = Field(default=512, ge=1, description="elements per chunk (one norm each)")
    norm: QSGDNorm = Field(default="l2", description="the norm each chunk is scaled by")
    error_feedback: bool = Field(default=False, description=_ERROR_FEEDBACK)
    seed: int = Field(default=0, ge=0, description=_SEED)


class TopKConfig(CompressorConfig):
    """`topk`: the entries of largest magnitude with error feedback, with the sparsity warm-up of Deep Gradient
    Compression."""

    name: Literal["topk"] = Field(default="topk", description="the compressor")
    ratio: float = Field(default=0.01, gt=0, le=1, description="density: the fraction of entries sent")
    error_feedback: bool = Field(default=True, description=_ERROR_FEEDBACK)
    warmup_steps: int = Field(default=0, ge=0, description="updates of the sparsity warm-up (Deep Gradient "
                              "Compression): density falls geometrically from `warmup_start_ratio` to `ratio`")
    warmup_start_ratio: float = Field(default=0.25, gt=0, le=1, description="density at the start of the warm-up")
    seed: int = Field(default=0, ge=0, description=_SEED)


class PowerSGDConfig(CompressorConfig):
    """`powersgd`: PowerSGD (Vogels et al. 2019), a rank-r approximation of each gradient matrix."""

    name: Literal["powersgd"] = Field(default="powersgd", description="the compressor")
    rank: int = Field(default=4, ge=1, description="r, the rank of the approximation")
    start_iter: int = Field(default=10, ge=2, description="updates with the plain all-reduce before compression "
                                                          "starts")
    min_compression_rate: float = Field(default=2.0, ge=1, description="tensors that would not shrink by this "
                                                                       "factor go in full")
    error_feedback: bool = Field(default=True, description=_ERROR_FEEDBACK)
    warm_start: bool = Field(default=True, description="start each power iteration from the previous Q")
    seed: int = Field(default=0, ge=0, description=_SEED)


class SignConfig(CompressorConfig):
    """`sign`: one bit per element and one scale per tensor (EF-SignSGD)."""

    name: Literal["sign"] = Field(default="sign", description="the compressor")
    error_feedback: bool = Field(default=True, description=_ERROR_FEEDBACK)


class BoundedLossConfig(CompressorConfig):
    """`bounded_loss`: the least important chunks are not sent (after DLCP, Wang et al. 2020)."""

    name: Literal["bounded_loss"] = Field(default="bounded_loss", description="the compressor")
    epsilon: float = Field(default=0.05, ge=0, lt=1, description="the fraction of chunks not sent (the least "
                                                                 "important)")
    chunk_size: int = Field(default=256, ge=1, description="elements per chunk")
    layer_priority: float = Field(default=1.0, ge=0, description="how much more the layers the next forward pass "
                                  "needs first weigh (1.0: the first layer weighs 2, the last 1)")
    error_feedback: bool = Field(default=False, description=_ERROR_FEEDBACK)


Compression = Annotated[
    NoCompressionConfig | Fp16Config | Bf16Config | QSGDConfig | TopKConfig | PowerSGDConfig | SignConfig
    | BoundedLossConfig,
    Field(discriminator="name"),
]

# Each compressor's section by its name, in the order the union lists them.
COMPRESSORS = variants(Compression, "name", CompressorConfig)
