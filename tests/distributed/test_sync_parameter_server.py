"""The parameter-server strategy on real processes (workers + servers over torch.distributed.rpc): sync mode
equals the allreduce strategy, async with one worker equals plain SGD, and server state survives a checkpoint."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.comm import Topology
from dtrain.config import ParameterServer
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.sync.base import Consolidating
from dtrain.sync.parameter_server import ParameterServerStrategy, serve

STEPS = 5
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-3


def build_model() -> nn.Module:
    """A convolution stored channels_last (its elements are not in row-major order) and two dense layers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (2, 1, 3)), nn.Conv2d(2, 4, (1, 2)), nn.Flatten(), nn.Tanh(),
                          nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    assert not model[1].weight.is_contiguous()
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, dtype=torch.float64, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # two param groups with different options: the servers must keep each piece in its group
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    return torch.optim.SGD([{"params": weights, "weight_decay": WEIGHT_DECAY}, {"params": biases}], lr=LR,
                           momentum=MOMENTUM, nesterov=True)


def _train(topology: Topology, strategy_name: str, settings: dict[str, Any], first: int, last: int,
           state: dict[str, Any] | None) -> Any:
    """Train steps first..last-1 (the rate halving every step, as a scheduler would); return the parameters and
    what a checkpoint would hold after the last step."""
    ps = ParameterServer(**settings)
    if topology.is_server:
        serve(topology, ps, timeout_seconds=60)
        return None
    model = build_model()
    strategy: Any = (AllReduceStrategy(topology) if strategy_name == "allreduce"
                     else ParameterServerStrategy(topology, ps, timeout_seconds=60))
    optimizer = build_optimizer(model)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        strategy.load_state_dict(state["strategy"])
    wrapped = strategy.wrap_model(model)
    for step in range(first, last):
        for group in optimizer.param_groups:
            group["lr"] = LR * 0.5 ** step
        inputs, labels = batch(topology.rank, step)
        nn.functional.cross_entropy(wrapped(inputs), labels).backward()
        strategy.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    if isinstance(strategy, Consolidating):  # as the Trainer does before a checkpoint
        strategy.consolidate(snapshot=True)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "strategy": strategy.state_dict()}
    strategy.close()
    return [p.detach().clone() for p in model.parameters()], saved


def _allreduce_then_sync_ps(topology: Topology, servers: int) -> Any:
    """The allreduce strategy on the workers' group, then the parameter servers in sync mode, in the same processes."""
    reference = None if topology.is_server else _train(topology, "allreduce", {}, 0, STEPS, None)[0]
    result = _train(topology, "parameter_server", {"servers": servers, "mode": "sync"}, 0, STEPS, None)
    return None if result is None else (reference, result[0])


def test_sync_mode_with_one_and_two_servers_equals_allreduce_after_five_steps(spawn: Any) -> None:
    expected = None
    for servers in (1, 2):
        for reference, params in spawn(_allreduce_then_sync_ps, 2, servers, servers=servers)[:2]:
            expected = reference if expected is None else expected
            for got, want, ref in zip(params, expected, reference, strict=True):
                assert torch.equal(ref, want)  # allreduce: identical on every rank and in every run
                assert torch.allclose(got, want, rtol=0, atol=1e-9), (servers, (got - want).abs().max())
    assert expected is not None
    initial = [p.detach() for p in build_model().parameters()]
    assert max(float((p - q).abs().max()) for p, q in zip(expected, initial, strict=True)) > 1e-2  # not vacuous


def _plain_sgd(last: int) -> list[torch.Tensor]:
    model = build_model()
    optimizer = build_optimizer(model)
    for step in range(last):
        for group in optimizer.param_groups:
            group["lr"] = LR * 0.5 ** step
        inputs, labels = batch(0, step)
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_async_mode_with_one_worker_equals_plain_sgd_across_a_resume(spawn: Any) -> None:
    """One worker, two servers, async: three steps equal plain SGD's; the strategy's state (the servers' parameters
    and momentum) saved; two more steps in new processes from it: plain SGD's five steps."""
    settings = {"servers": 2, "mode": "async"}
    (params_3, saved), *_ = spawn(_train, 1, "parameter_server", settings, 0, 3, None, servers=2)
    for got, want in zip(params_3, _plain_sgd(3), strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert len(saved["strategy"]["servers"]) == 2 and saved["strategy"]["servers"][0]["optimizer"]["state"]
    (resumed, _), *_ = spawn(_train, 1, "parameter_server", settings, 3, STEPS, saved, servers=2)
    for got, want in zip(resumed, _plain_sgd(STEPS), strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
