"""What LARS and LAMB share: the closure convention of torch.optim and the zero-guarded trust ratio."""

from __future__ import annotations

from collections.abc import Callable

import torch


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """Re-evaluate the loss through an optimizer step's optional closure, with gradients on (torch's convention)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def guarded_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, or 1 where either is zero (a tensor still at zero, or a zero gradient)."""
    usable = (numerator > 0) & (denominator > 0)
    return torch.where(usable, numerator / torch.where(usable, denominator, 1.0), torch.ones_like(numerator))
