"""LAMB, layer-wise adaptive moments: You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT
in 76 Minutes" (arXiv:1904.00962, ICLR 2020), Algorithm 2."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtrain.optim.common import closure_loss, guarded_ratio


class LAMB(torch.optim.Optimizer):
    """Adam's direction, decoupled weight decay, and a per-tensor trust ratio ||w|| / ||update||.

    Per tensor w, step t from 1 (beta1, beta2 = `betas`, lambda = `weight_decay`):

        m <- beta1 m + (1 - beta1) g ;   v <- beta2 v + (1 - beta2) g^2
        m^ = m / (1 - beta1^t) ;         v^ = v / (1 - beta2^t)          (with `bias_correction`)
        u = m^ / (sqrt(v^) + eps) + lambda w
        w <- w - lr * ratio * u,         ratio = ||w|| / ||u||           (1 when either norm is 0)

    Options: `max_grad_norm` first scales all gradients by 1 / max(1, ||g_all|| / max_grad_norm), the norm taken
    over every parameter (as NVIDIA's reference LAMB does); `max_trust_ratio` clips the ratio from above (LAMBC).
    Tensors with one dimension (biases, normalisation weights) skip the trust ratio and weight decay while
    `exclude_bias_and_norm` is true, as in LARS. With `adapt=False` the ratio is 1 everywhere and the update is
    AdamW's.
    """

    needs_whole_tensors = True  # a trust ratio per tensor: parameter servers must not split tensors

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 max_grad_norm: float | None = None, max_trust_ratio: float | None = None,
                 exclude_bias_and_norm: bool = True, adapt: bool = True) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LAMB needs lr, eps, weight_decay >= 0 and betas in [0, 1); got lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay}, betas={betas}")
        if (max_grad_norm is not None and max_grad_norm <= 0) or (max_trust_ratio is not None and max_trust_ratio <= 0):
            raise ValueError("LAMB's max_grad_norm and max_trust_ratio must be positive when given")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "max_trust_ratio": max_trust_ratio,
                    "exclude_bias_and_norm": exclude_bias_and_norm, "adapt": adapt}
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm

    def _gradient_scale(self) -> torch.Tensor | None:
        """1 / max(1, ||g_all|| / max_grad_norm) over every parameter of every group, or None without clipping."""
        if self.max_grad_norm is None:
            return None
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return None
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        return 1.0 / torch.clamp(total / self.max_grad_norm, min=1.0)

    # torch's Optimizer.step is two overloads on closure; torch's own optimizers define this one signature
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        scale = self._gradient_scale()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if scale is None else param.grad * scale.to(param.grad.dtype)
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                correction1 = 1 - beta1**t if group["bias_correction"] else 1.0
                correction2 = 1 - beta2**t if group["bias_correction"] else 1.0
                update = (exp_avg / correction1) / ((exp_avg_sq / correction2).sqrt().add_(group["eps"]))
                excluded = group["exclude_bias_and_norm"] and param.ndim <= 1
                if group["weight_decay"] and not excluded:
                    update.add_(param, alpha=group["weight_decay"])
                if group["adapt"] and not excluded:
                    update.mul_(_lamb_ratio(param, update, group["max_trust_ratio"]))
                param.add_(update, alpha=-group["lr"])
        return loss


def _lamb_ratio(param: torch.Tensor, update: torch.Tensor, max_ratio: float | None) -> torch.Tensor:
    """||w|| / ||u||, 1 where either norm is zero, clipped to `max_ratio` when given."""
    ratio = guarded_ratio(torch.linalg.vector_norm(param), torch.linalg.vector_norm(update))
    return ratio if max_ratio is None else torch.clamp(ratio, max=max_ratio)

