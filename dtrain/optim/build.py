"""Build the optimizer and the learning-rate schedule that the `large_batch:` config section names.

Where the numbers come from: the base rate is `large_batch.base_lr`, else `hyperparameters.learning_rate`; weight
decay is `large_batch.weight_decay`, else `hyperparameters.weight_decay`, else 0. The optimizer's own options come
from its config section (`dtrain.config.optimizers`), whose defaults are the optimizer's own (torch.optim's, or
the papers' for LARS and LAMB).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dtrain.config import LargeBatch
from dtrain.optim.lamb import LAMB
from dtrain.optim.lars import LARS
from dtrain.optim.lr_schedule import LRSchedule, scaling_factor


def base_rate(config: LargeBatch, hparams: Mapping[str, Any]) -> float:
    """The rate tuned at base_batch_size (validated by the config: one of the two is a positive number)."""
    return float(config.base_lr if config.base_lr is not None else hparams["learning_rate"])


def weight_decay(config: LargeBatch, hparams: Mapping[str, Any]) -> float:
    """`large_batch.weight_decay`, else `hyperparameters.weight_decay`, else 0 (validated by the config: a number
    >= 0 when the config names an optimizer)."""
    return float(config.weight_decay if config.weight_decay is not None else hparams.get("weight_decay", 0.0))


def build_optimizer(config: LargeBatch, model: nn.Module, hparams: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The optimizer `config.optimizer` names, over all of the model's parameters, at the base rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    lr, decay = base_rate(config, hparams), weight_decay(config, hparams)
    given = config.optimizer_options()
    name = config.optimizer
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=decay, **given)
    if name == "lars":
        return LARS(params, lr=lr, weight_decay=decay, **given)
    if name == "lamb":
        return LAMB(params, lr=lr, weight_decay=decay, **given)
    adam_family = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "radam": torch.optim.RAdam}
    if name in adam_family:
        return adam_family[name](params, lr=lr, weight_decay=decay, **given)
    raise ValueError(f"no optimizer named {name!r} is built from config")


def build_lr_schedule(config: LargeBatch, records_per_update: int, total_epochs: float) -> LRSchedule:
    """Scaling rule, warm-up and decay for a run whose first updates see `records_per_update` records.

    The scaling uses the batch at the start of training; a batch-size schedule later grows the batch instead
    of decaying the rate and does not rescale it (Smith et al. 2017).
    """
    decay = config.decay
    return LRSchedule(peak=scaling_factor(config.lr_scaling, records_per_update, config.base_batch_size),
                      warmup_epochs=config.warmup_epochs, decay=decay.name, milestones=tuple(decay.milestones),
                      gamma=decay.gamma, final_fraction=decay.final_fraction, power=decay.power,
                      total_epochs=total_epochs)
