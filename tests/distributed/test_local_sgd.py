"""The local SGD family on real gloo processes, in float64, against references computed here in one process:
H = 1 without momentum is synchronous SGD; post-local SGD whose switch is never reached is synchronous SGD;
DiLoCo with outer SGD lr 1 and momentum 0 is periodic averaging (a wrong pseudo-gradient sign fails it);
DiLoCo with Nesterov against torch's SGD on the averaged pseudo-gradient; the averaging counter with two
parameter groups (pytorch/pytorch#74157); buffers averaged. One spawn runs every case."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from dtrain.comm import Topology
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.local_sgd import LocalSGDStrategy

STEPS, WORLD, LR = 7, 2, 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 5, generator=generator, dtype=torch.float64), torch.randn(6, 3, generator=generator,
                                                                                    dtype=torch.float64)


def make_optimizer(model: nn.Module, momentum: float) -> torch.optim.Optimizer:
    """Two parameter groups (the case that advanced a step counter twice per update in pytorch#74157)."""
    first, rest = list(model[0].parameters()), [p for m in list(model)[1:] for p in m.parameters()]
    return torch.optim.SGD([{"params": first}, {"params": rest}], lr=LR, momentum=momentum)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return ((model(x) - y) ** 2).mean()


CASES: dict[str, dict[str, Any]] = {
    "h1": {"period": 1},
    "post_local_never": {"period": 3, "warmup_steps": 100},
    "periodic": {"period": 3},
    "diloco_lr1": {"period": 3, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0},
    "post_local_momentum": {"period": 2, "warmup_steps": 3, "momentum": 0.9},
    "diloco_nesterov": {"period": 3, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9},
}


def _train(topology: Topology) -> dict[str, Any]:
    results: dict[str, Any] = {}
    runs = {"sync": AllReduceStrategy(topology)}
    for name, settings in CASES.items():
        options = {k: v for k, v in settings.items() if k != "momentum"}
        runs[name] = LocalSGDStrategy(topology, **options)
    for name, strategy in runs.items():
        model = make_model()
        wrapped = strategy.wrap_model(model)
        optimizer = make_optimizer(model, CASES.get(name, {}).get("momentum", 0.0))
        for step in range(1, STEPS + 1):
            loss_of(wrapped, step, topology.rank).backward()
            strategy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        if hasattr(strategy, "consolidate"):
            strategy.consolidate()
        results[name] = {"state": {k: v.clone() for k, v in model.state_dict().items()},
                         "describe": strategy.describe()}
        strategy.close()
    return results


def reference(period: int, warmup_steps: int = 0, momentum: float = 0.0, outer_optimizer: str = "none",
              outer_lr: float = 1.0, outer_momentum: float = 0.0, steps: int = STEPS, sign: float = 1.0
              ) -> dict[str, torch.Tensor]:
    """Both ranks simulated in this process: synchronous updates average the gradients, local ones do not, and
    every `period` local updates (and at the end) the parameters and buffers are averaged, or DiLoCo's outer SGD
    steps from the last round's parameters with the mean of (last round - local)."""
    models = [make_model() for _ in range(WORLD)]
    optimizers = [make_optimizer(m, momentum) for m in models]
    anchor = copy.deepcopy(models[0])
    outer = (torch.optim.SGD(anchor.parameters(), lr=outer_lr, momentum=outer_momentum,
                             nesterov=outer_optimizer == "nesterov") if outer_optimizer != "none" else None)
    local = 0

    def average() -> None:
        with torch.no_grad():
            if outer is None:
                for values in zip(*(m.parameters() for m in models), strict=True):
                    mean = sum(values) / WORLD  # type: ignore[arg-type]
                    for v in values:
                        v.copy_(mean)
            else:
                for a, *values in zip(anchor.parameters(), *(m.parameters() for m in models), strict=True):
                    a.grad = sign * sum(a - v for v in values) / WORLD  # type: ignore[assignment]
                outer.step()
                for a, *values in zip(anchor.parameters(), *(m.parameters() for m in models), strict=True):
                    for v in values:
                        v.copy_(a)
            for values in zip(*(m.buffers() for m in models), strict=True):
                if values[0].is_floating_point():
                    mean = sum(values) / WORLD  # type: ignore[arg-type]
                    for v in values:
                        v.copy_(mean)

    for step in range(1, steps + 1):
        for rank, model in enumerate(models):
            loss_of(model, step, rank).backward()
        if step <= warmup_steps:
            for values in zip(*(m.parameters() for m in models), strict=True):
                mean = sum(v.grad for v in values) / WORLD  # type: ignore[misc]
                for v in values:
                    v.grad = mean.clone()
        else:
            if local == 0:
                anchor.load_state_dict(models[0].state_dict())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step > warmup_steps:
            local += 1
            if local == period:
                average()
                local = 0
    if local:
        average()
    return {name: p.detach() for name, p in models[0].named_parameters()}


def parameters_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-12) -> bool:
    return all(float((a[k] - b[k]).abs().max()) <= tol * max(1.0, float(b[k].abs().max())) for k in b)


def test_local_sgd_family_against_references(spawn: Any) -> None:
    ranks = spawn(_train, WORLD)
    for name in ["sync", *CASES]:  # replicas identical after the last round
        for key, value in parameters_of(ranks[0][name]["state"]).items():
            assert torch.equal(value, ranks[1][name]["state"][key]), (name, key)
    got = {name: parameters_of(ranks[0][name]["state"]) for name in ["sync", *CASES]}
    sync = reference(period=1, warmup_steps=STEPS)
    assert close(got["sync"], sync)
    assert close(got["h1"], got["sync"])  # H = 1, no momentum: synchronous SGD
    assert close(got["post_local_never"], got["sync"])  # the switch is never reached
    periodic = reference(period=3)
    assert not close(periodic, sync, 1e-6)  # local steps make a difference at all
    assert close(got["periodic"], periodic)
    assert close(got["diloco_lr1"], periodic)  # outer SGD lr 1, momentum 0 == periodic averaging
    flipped = reference(period=3, outer_optimizer="sgd", sign=-1.0)  # the sign bug of torchft PR #233
    assert not close(got["diloco_lr1"], flipped, 1e-6)
    post_local = reference(period=2, warmup_steps=3, momentum=0.9)
    assert close(got["post_local_momentum"], post_local)  # one count per update, two parameter groups
    twice = reference(period=1, warmup_steps=3, momentum=0.9)  # a counter advanced per group would average every step
    assert not close(got["post_local_momentum"], twice, 1e-6)
    nesterov = reference(period=3, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    assert close(got["diloco_nesterov"], nesterov)
    for key, value in ranks[0]["periodic"]["state"].items():  # buffers (batch-norm statistics) averaged too
        assert torch.equal(value, ranks[1]["periodic"]["state"][key]), key
    assert ranks[0]["periodic"]["describe"]["averaging_rounds"] == 3  # after 3, 6 and the final consolidation
    assert ranks[0]["post_local_momentum"]["describe"]["synchronous_updates"] == 3
