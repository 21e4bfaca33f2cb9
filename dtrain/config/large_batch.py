"""The `large_batch` section's keys that every optimizer shares: the rate, LR scaling, warm-up, decay and the
batch-size schedule. Each optimizer's own options extend it in `dtrain.config.optimizers`; `dtrain.optim.build`
turns the section into the optimizer and the rate schedule."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from dtrain.config.base import Section
from dtrain.config.names import DecayName, GrowBy, ScalingRule


class Decay(Section):
    """How the rate falls after warm-up: `step` (x gamma at each milestone epoch), `cosine` or `poly`, both to
    `final_fraction` of the peak at the end. A bare name (`decay: cosine`) is short for `{name: cosine}`."""

    name: DecayName = Field(default="none", description="the decay after warm-up")
    milestones: list[float] = Field(default_factory=list, description="step: epochs where the rate is multiplied "
                                                                      "by gamma, increasing")
    gamma: float = Field(default=0.1, gt=0, le=1, description="step: the factor at each milestone")
    final_fraction: float = Field(default=0.0, ge=0, le=1, description="cosine and poly: the end rate as a share "
                                                                       "of the peak")
    power: float = Field(default=2.0, gt=0, description="poly: exponent of (1 - progress)")

    @model_validator(mode="after")
    def _milestones_for_step_only(self) -> Decay:
        if self.name == "step":
            if not self.milestones:
                raise ValueError("large_batch.decay `step` needs milestones (epochs where the rate is multiplied by "
                                 "gamma); write e.g. `decay: {name: step, milestones: [6, 8]}`")
            if any(b <= a for a, b in zip(self.milestones, self.milestones[1:], strict=False)):
                raise ValueError(f"large_batch.decay.milestones {self.milestones} must increase strictly; sort them")
        elif self.milestones:
            raise ValueError(f"large_batch.decay.milestones are for decay `step`, not `{self.name}`; remove them or "
                             "use `name: step`")
        return self


class BatchSizeSchedule(Section):
    """Multiply the global batch at given epochs instead of decaying the rate (Smith et al. 2017); the world size
    stays, the per-slot batch or `aggregation_frequency` grows, and the rate is not rescaled."""

    epochs: list[float] = Field(min_length=1, description="epochs at which the global batch is multiplied, "
                                                          "increasing")
    factor: int | list[int] = Field(default=2, description="the multiplier (>= 2), or one per epoch")
    grow: GrowBy = Field(default="per_slot_batch", description="what grows: the per-slot batch, or "
                                                               "`aggregation_frequency`")
    max_per_slot_batch: int | None = Field(default=None, ge=1, description="per_slot_batch: above it, "
                                           "`aggregation_frequency` grows instead")

    @model_validator(mode="after")
    def _consistent(self) -> BatchSizeSchedule:
        key = "large_batch.batch_size_schedule"
        if any(e <= 0 for e in self.epochs) or any(b <= a for a, b in zip(self.epochs, self.epochs[1:], strict=False)):
            raise ValueError(f"{key}.epochs {self.epochs} must be positive and increase strictly; write e.g. "
                             "`epochs: [4, 8]`")
        factors = self.factors
        if len(factors) != len(self.epochs):
            raise ValueError(f"{key}.factor lists {len(factors)} factors for {len(self.epochs)} epochs; give one per "
                             "epoch or a single number")
        if any(f < 2 for f in factors):
            raise ValueError(f"{key}.factor {self.factor} must be whole numbers >= 2 (the global batch is "
                             "multiplied); write e.g. `factor: 2`")
        if self.max_per_slot_batch is not None and self.grow != "per_slot_batch":
            raise ValueError(f"{key}.max_per_slot_batch applies to `grow: per_slot_batch` only; remove it")
        return self

    @property
    def factors(self) -> list[int]:
        return list(self.factor) if isinstance(self.factor, list) else [self.factor] * len(self.epochs)


class LargeBatch(Section):
    """Large-batch recipes from the config, without writing a scheduler. With an optimizer named here dtrain
    builds it over the model's parameters and owns the rate; with `trial`, scaling, warm-up and decay multiply
    the rates of the Trial's own optimizer. Each optimizer adds its own options beside these keys (the
    sections below, one per `optimizer`)."""

    optimizer: str = Field(
        default="trial", description="`trial`: the Trial's `build_optimizer`/`build_lr_scheduler`; any other: "
        "dtrain builds that optimizer (torch's sgd, radam, adam, adamw; dtrain's lars, lamb) and the Trial's two "
        "builders are not called")
    base_lr: float | None = Field(default=None, gt=0, description="the rate tuned at `base_batch_size`; unset: "
                                  "`hyperparameters.learning_rate` (only for an optimizer named here)")
    weight_decay: float | None = Field(
        default=None, ge=0, description="unset: `hyperparameters.weight_decay`, else 0; LARS and LAMB skip it on 1-D "
        "tensors (see `exclude_bias_and_norm`) (only for an optimizer named here)")
    lr_scaling: ScalingRule = Field(
        default="none", description="`linear` or `sqrt`: the rate is base_lr x (B / base_batch_size) or its square "
        "root, B = records per update at the start (`global_batch_size` x `aggregation_frequency`)")
    base_batch_size: int | None = Field(default=None, ge=1, description="the global batch the base rate was tuned "
                                                                        "at; required with `lr_scaling`")
    warmup_epochs: float = Field(default=0.0, ge=0, description="gradual warm-up (Goyal et al.): per update, "
                                 "linearly from base_lr to the scaled rate; needs `lr_scaling`")
    decay: Decay = Field(default_factory=Decay, description="the decay after warm-up")
    batch_size_schedule: BatchSizeSchedule | None = Field(default=None, description="grow the global batch at "
                                                                                    "given epochs")

    @field_validator("decay", mode="before")
    @classmethod
    def _decay_by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _coherent(self) -> LargeBatch:
        if self.lr_scaling != "none" and self.base_batch_size is None:
            raise ValueError(f"large_batch.lr_scaling `{self.lr_scaling}` needs large_batch.base_batch_size (the "
                             "global batch the base rate was tuned at); add e.g. `base_batch_size: 128`")
        if self.warmup_epochs > 0 and self.lr_scaling == "none":
            raise ValueError(f"large_batch.warmup_epochs ({self.warmup_epochs:g}) ramps from the base rate to the "
                             "scaled rate, which lr_scaling `none` makes equal; set lr_scaling to linear or sqrt, "
                             "or remove warmup_epochs")
        if self.decay.milestones and self.decay.milestones[0] < self.warmup_epochs:
            raise ValueError(f"large_batch.decay.milestones start at epoch {self.decay.milestones[0]:g}, inside the "
                             f"warm-up ({self.warmup_epochs:g} epochs); decay starts after warm-up, so move them later")
        return self

    @property
    def schedules_lr(self) -> bool:
        """Whether the config sets the learning rate over time (scaling, warm-up or decay)."""
        return self.lr_scaling != "none" or self.warmup_epochs > 0 or self.decay.name != "none"

    def optimizer_options(self) -> dict[str, Any]:
        """The named optimizer's own options (its section's keys beyond these), as keyword arguments of its class."""
        return {key: getattr(self, key) for key in type(self).model_fields if key not in LargeBatch.model_fields}
