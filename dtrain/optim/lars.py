"""LARS, layer-wise adaptive rate scaling: You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional
Networks" (arXiv:1708.03888), Algorithm 1."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtrain.optim.common import closure_loss, guarded_ratio


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step for each tensor is scaled by its trust ratio.

    Per tensor w with gradient g (the paper's Algorithm 1, eta = `trust_coefficient`, beta = `weight_decay`):

        local_lr = eta * ||w|| / (||g|| + beta * ||w||)       (1 when ||w|| or the denominator is 0)
        v <- momentum * v + local_lr * (g + beta * w)
        w <- w - lr * v

    The paper keeps the global rate inside v; here it stays outside, as in torch.optim.SGD, so a rate that
    changes (warm-up, decay) needs no momentum correction (Goyal et al. 2017, section 2.1). At a constant
    rate the two are the same update. Tensors with one dimension (biases, normalisation weights) skip both the
    trust ratio and weight decay while `exclude_bias_and_norm` is true (the usual practice, e.g. MLPerf's
    ResNet); `adapt=False` turns the trust ratio off everywhere, which leaves SGD with momentum.
    """

    needs_whole_tensors = True  # a trust ratio per tensor: parameter servers must not split tensors

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, exclude_bias_and_norm: bool = True, adapt: bool = True) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(f"LARS needs lr, momentum, weight_decay >= 0 and trust_coefficient > 0; got lr={lr}, "
                             f"momentum={momentum}, weight_decay={weight_decay}, trust_coefficient={trust_coefficient}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "exclude_bias_and_norm": exclude_bias_and_norm,
                    "adapt": adapt}
        super().__init__(params, defaults)

    # torch's Optimizer.step is two overloads on closure; torch's own optimizers define this one signature
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                excluded = group["exclude_bias_and_norm"] and param.ndim <= 1
                decay = 0.0 if excluded else group["weight_decay"]
                update = param.grad.add(param, alpha=decay) if decay else param.grad.clone()
                if group["adapt"] and not excluded:
                    update.mul_(trust_ratio(param, param.grad, decay, group["trust_coefficient"]))
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(update)
                param.add_(buffer, alpha=-group["lr"])
        return loss


def trust_ratio(param: torch.Tensor, grad: torch.Tensor, weight_decay: float, coefficient: float) -> torch.Tensor:
    """eta * ||w|| / (||g|| + wd * ||w||), or 1 where ||w|| or the denominator is zero (a fresh zero tensor)."""
    weight_norm = torch.linalg.vector_norm(param)
    return guarded_ratio(coefficient * weight_norm, torch.linalg.vector_norm(grad) + weight_decay * weight_norm)
