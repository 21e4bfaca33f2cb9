"""LARS and LAMB against independent references: torch's SGD and AdamW where they must coincide, and the papers'
update rules written out here in float64; state_dict round trips."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from dtrain.optim import LAMB, LARS

Tensors = list[torch.Tensor]


def _parameters(seed: int = 0) -> Tensors:
    """A 2-D weight, a 1-D bias and a 4-D conv kernel, in float64."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(5, 4), (5,), (3, 2, 3, 3)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]


def _gradients(params: Tensors, steps: int, scale: float = 1.0, seed: int = 1) -> list[Tensors]:
    """Different random gradients for every step (so that two steps can tell the variants apart)."""
    generator = torch.Generator().manual_seed(seed)
    return [[scale * torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]
            for _ in range(steps)]


def _run(make: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer], params: Tensors,
         grads: list[Tensors], lrs: Sequence[float] | None = None) -> Tensors:
    """Apply the optimizer for len(grads) steps with the given gradients (and per-step rates); return the weights."""
    leaves = [nn.Parameter(p.clone()) for p in params]
    optimizer = make(leaves)
    for step, step_grads in enumerate(grads):
        if lrs is not None:
            for group in optimizer.param_groups:
                group["lr"] = lrs[step]
        for leaf, grad in zip(leaves, step_grads, strict=True):
            leaf.grad = grad.clone()
        optimizer.step()
    return [leaf.detach() for leaf in leaves]


def _assert_close(actual: Tensors, expected: Tensors, rtol: float) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * 1e-3)


# ------------------------------------------------------------------------------------------------ LARS


def lars_paper(params: Tensors, grads: list[Tensors], lr: float, momentum: float, weight_decay: float, eta: float,
               skip_1d: bool) -> Tensors:
    """You, Gitman, Ginsburg 2017, Algorithm 1, at a constant global rate gamma (v holds gamma):
    lambda = eta ||w|| / (||g|| + beta ||w||);  v <- m v + gamma lambda (g + beta w);  w <- w - v.
    1-D tensors (biases) take plain momentum SGD without decay when `skip_1d`."""
    weights = [p.clone() for p in params]
    velocity = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for i, (w, g) in enumerate(zip(weights, step_grads, strict=True)):
            if skip_1d and w.ndim == 1:
                local, beta = 1.0, 0.0
            else:
                beta = weight_decay
                local = eta * float(w.norm()) / (float(g.norm()) + beta * float(w.norm()))
            velocity[i] = momentum * velocity[i] + lr * local * (g + beta * w)
            weights[i] = w - velocity[i]
    return weights


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("skip_1d", [True, False])
def test_lars_matches_the_paper(steps: int, skip_1d: bool) -> None:
    params = _parameters()
    grads = _gradients(params, steps)
    options = {"lr": 0.7, "momentum": 0.9, "weight_decay": 5e-3, "eta": 0.02}
    actual = _run(lambda p: LARS(p, lr=0.7, momentum=0.9, weight_decay=5e-3, trust_coefficient=0.02,
                                 exclude_bias_and_norm=skip_1d), params, grads)
    expected = lars_paper(params, grads, skip_1d=skip_1d, **options)
    _assert_close(actual, expected, rtol=1e-12)
    # and the step is really the adapted one, not plain SGD
    plain = _run(lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, weight_decay=5e-3), params, grads)
    assert (actual[0] - plain[0]).abs().max() > 1e-3


def test_lars_without_adaptation_is_sgd_with_momentum() -> None:
    params = _parameters()
    grads = _gradients(params, 6)
    lrs = [0.1, 0.2, 0.3, 0.4, 0.4, 0.2]  # a changing rate: the momentum buffer must not hold it
    actual = _run(lambda p: LARS(p, lr=0.1, momentum=0.9, weight_decay=1e-3, adapt=False,
                                 exclude_bias_and_norm=False), params, grads, lrs)
    expected = _run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3), params, grads, lrs)
    _assert_close(actual, expected, rtol=1e-14)
    # with the default exclusion, 1-D tensors are SGD without decay
    excluded = _run(lambda p: LARS(p, lr=0.1, momentum=0.9, weight_decay=1e-3, adapt=False), params, grads, lrs)
    groups = _run(lambda p: torch.optim.SGD([{"params": [q for q in p if q.ndim > 1]},
                                             {"params": [q for q in p if q.ndim <= 1], "weight_decay": 0.0}],
                                            lr=0.1, momentum=0.9, weight_decay=1e-3), params, grads, lrs)
    _assert_close(excluded, groups, rtol=1e-14)


def test_lars_zero_weights_take_a_plain_step() -> None:
    zero = torch.zeros(3, 3, dtype=torch.float64)
    grad = torch.ones(3, 3, dtype=torch.float64)
    [after] = _run(lambda p: LARS(p, lr=0.5, momentum=0.0, trust_coefficient=0.001), [zero], [[grad]])
    torch.testing.assert_close(after, -0.5 * grad, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ LAMB


def lamb_paper(params: Tensors, grads: list[Tensors], lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, bias_correction: bool = True, max_grad_norm: float | None = None,
               max_ratio: float | None = None, skip_1d: bool = True) -> Tensors:
    """You et al. 2019, Algorithm 2 with phi = identity, written elementwise in float64:
    m, v moments; r = m^ / (sqrt(v^) + eps); u = r + lambda w; w <- w - lr ||w||/||u|| u.
    Optional global clipping g <- g / max(1, ||g_all|| / c) and ratio clipping min(ratio, max_ratio)."""
    weights = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, start=1):
        if max_grad_norm is not None:
            total = math.sqrt(sum(float((g * g).sum()) for g in step_grads))
            step_grads = [g / max(1.0, total / max_grad_norm) for g in step_grads]
        for i, (w, g) in enumerate(zip(weights, step_grads, strict=True)):
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1**t) if bias_correction else m[i]
            v_hat = v[i] / (1 - beta2**t) if bias_correction else v[i]
            r = m_hat / (torch.sqrt(v_hat) + eps)
            if skip_1d and w.ndim == 1:
                weights[i] = w - lr * r
                continue
            u = r + weight_decay * w
            ratio = float(w.norm()) / float(u.norm())
            if max_ratio is not None:
                ratio = min(ratio, max_ratio)
            weights[i] = w - lr * ratio * u
    return weights


LAMB_VARIANTS = {
    "paper defaults": ({}, {}),
    "no bias correction": ({"bias_correction": False}, {"bias_correction": False}),
    "global grad-norm clipping": ({"max_grad_norm": 1.0}, {"max_grad_norm": 1.0}),
    "trust ratio clipping": ({"max_trust_ratio": 0.3}, {"max_ratio": 0.3}),
    "1-D adapted too": ({"exclude_bias_and_norm": False}, {"skip_1d": False}),
}


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("variant", list(LAMB_VARIANTS))
def test_lamb_matches_the_paper(steps: int, variant: str) -> None:
    ours, theirs = LAMB_VARIANTS[variant]
    params = _parameters()
    grads = _gradients(params, steps, scale=3.0)  # ||g_all|| is about 20, so clipping at 1.0 bites
    actual = _run(lambda p: LAMB(p, lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, **ours), params, grads)
    expected = lamb_paper(params, grads, lr=0.05, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, **theirs)
    _assert_close(actual, expected, rtol=1e-12)


def test_lamb_variants_differ() -> None:
    """The variants above are not all the same update (else the test could not tell them apart)."""
    params = _parameters()
    grads = _gradients(params, 2, scale=3.0)
    results = {name: _run(lambda p, o=ours: LAMB(p, lr=0.05, betas=(0.9, 0.99), weight_decay=0.01, **o),
                          params, grads)
               for name, (ours, _) in LAMB_VARIANTS.items()}
    names = list(results)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert any((x - y).abs().max() > 1e-6 for x, y in zip(results[a], results[b], strict=True)), (a, b)


def test_lamb_with_trust_ratio_one_is_adamw() -> None:
    params = _parameters()
    grads = _gradients(params, 5)
    lrs = [1e-3, 2e-3, 3e-3, 3e-3, 1e-3]
    actual = _run(lambda p: LAMB(p, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adapt=False,
                                 exclude_bias_and_norm=False), params, grads, lrs)
    expected = _run(lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
                    params, grads, lrs)
    _assert_close(actual, expected, rtol=1e-12)


# ------------------------------------------------------------------------------------------ state_dict


@pytest.mark.parametrize("make", [
    lambda p: LARS(p, lr=0.3, momentum=0.9, weight_decay=1e-3),
    lambda p: LAMB(p, lr=0.01, max_grad_norm=1.0, max_trust_ratio=5.0),
], ids=["lars", "lamb"])
def test_state_dict_round_trip(make: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]) -> None:
    params = _parameters()
    grads = _gradients(params, 4)
    straight = _run(make, params, grads)
    leaves = [nn.Parameter(p.clone()) for p in params]
    first = make(leaves)
    for step_grads in grads[:2]:
        for leaf, grad in zip(leaves, step_grads, strict=True):
            leaf.grad = grad.clone()
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a checkpoint holds it, read back with weights_only
    buffer.seek(0)
    second = make(leaves)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    for step_grads in grads[2:]:
        for leaf, grad in zip(leaves, step_grads, strict=True):
            leaf.grad = grad.clone()
        second.step()
    for a, b in zip(leaves, straight, strict=True):
        assert torch.equal(a.detach(), b)


def test_bad_hyperparameters_are_refused() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARS(params, lr=0.1, trust_coefficient=0.0)
    with pytest.raises(ValueError, match="betas"):
        LAMB(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_grad_norm"):
        LAMB(params, max_grad_norm=0.0)
