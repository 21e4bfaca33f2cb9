"""The optimizers `large_batch.optimizer` names: one small section per optimizer, each extending the shared
`large_batch` keys with its own options and their defaults, picked by `optimizer` (a pydantic discriminated
union). An old file's `large_batch: {optimizer: lars, momentum: 0.9}` is exactly such a section.

The optimizers themselves are built in `dtrain.optim.build` (optim imports config, not the reverse), so their
sections live here; tests/unit/test_config_names.py checks each section's options and defaults against the
optimizer's class.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from dtrain.config.base import variants
from dtrain.config.large_batch import LargeBatch

_OPTIMIZER = "the optimizer (see `large_batch`)"
_EXCLUDE = "1-D tensors (biases, normalisation weights) get neither the trust ratio nor weight decay"


class TrialOptimizer(LargeBatch):
    """`optimizer: trial`: the Trial's `build_optimizer` and `build_lr_scheduler`; the rate and weight decay are
    the Trial's own."""

    optimizer: Literal["trial"] = Field(default="trial", description=_OPTIMIZER)

    @model_validator(mode="after")
    def _rate_is_the_trials(self) -> TrialOptimizer:
        for key in ("base_lr", "weight_decay"):
            value = getattr(self, key)
            if value is not None:
                raise ValueError(f"large_batch.{key} ({value}) applies to an optimizer named in large_batch.optimizer "
                                 "(the Trial's optimizer sets its own), not to `trial`; remove it or change "
                                 "large_batch.optimizer")
        return self


class SGDOptimizer(LargeBatch):
    """`optimizer: sgd`: torch's SGD."""

    optimizer: Literal["sgd"] = Field(default="sgd", description=_OPTIMIZER)
    momentum: float = Field(default=0.9, ge=0, lt=1, description="momentum (dtrain's default; torch's is 0)")
    nesterov: bool = Field(default=False, description="Nesterov momentum")


class LARSOptimizer(LargeBatch):
    """`optimizer: lars`: LARS (You et al. 2017), SGD with momentum and a per-layer trust ratio."""

    optimizer: Literal["lars"] = Field(default="lars", description=_OPTIMIZER)
    momentum: float = Field(default=0.9, ge=0, lt=1, description="momentum")
    trust_coefficient: float = Field(default=0.001, gt=0, description="eta in eta·‖w‖/(‖g‖ + wd·‖w‖)")
    exclude_bias_and_norm: bool = Field(default=True, description=_EXCLUDE)


class _AdamLike(LargeBatch):
    """The moment estimates' options that LAMB and torch's Adam family share."""

    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="the moment estimates' decay rates")
    eps: float = Field(default=1e-8, gt=0, description="added to the denominator")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"large_batch.betas {list(value)} must both be in [0, 1); write e.g. "
                             "`betas: [0.9, 0.999]`")
        return value


class LAMBOptimizer(_AdamLike):
    """`optimizer: lamb`: LAMB (You et al. 2019), Adam with a per-layer trust ratio."""

    optimizer: Literal["lamb"] = Field(default="lamb", description=_OPTIMIZER)
    eps: float = Field(default=1e-6, gt=0, description="added to the denominator")
    bias_correction: bool = Field(default=True, description="Adam's bias correction")
    max_grad_norm: float | None = Field(default=None, gt=0, description="clip the global gradient norm to this; "
                                                                        "unset: no clipping")
    max_trust_ratio: float | None = Field(default=None, gt=0, description="upper bound on the trust ratio; unset: "
                                                                          "none")
    exclude_bias_and_norm: bool = Field(default=True, description=_EXCLUDE)


class AdamOptimizer(_AdamLike):
    """`optimizer: adam`: torch's Adam (L2 weight decay added to the gradient)."""

    optimizer: Literal["adam"] = Field(default="adam", description=_OPTIMIZER)


class AdamWOptimizer(_AdamLike):
    """`optimizer: adamw`: torch's AdamW (decoupled weight decay)."""

    optimizer: Literal["adamw"] = Field(default="adamw", description=_OPTIMIZER)


class RAdamOptimizer(_AdamLike):
    """`optimizer: radam`: torch's RAdam (rectified Adam, no warm-up needed)."""

    optimizer: Literal["radam"] = Field(default="radam", description=_OPTIMIZER)


LargeBatchSection = Annotated[
    TrialOptimizer | SGDOptimizer | LARSOptimizer | LAMBOptimizer | RAdamOptimizer | AdamOptimizer | AdamWOptimizer,
    Field(discriminator="optimizer"),
]

# Each optimizer's section by its name, in the order the union lists them.
OPTIMIZERS = variants(LargeBatchSection, "optimizer", LargeBatch)
