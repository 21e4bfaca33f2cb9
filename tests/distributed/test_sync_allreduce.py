"""The allreduce strategy on real gloo processes: the Adasum tree against a local reference, each op through
DDP's comm hook, unused parameters, uneven inputs (join) and fusion auto-tuning that rebuilds the buckets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from dtrain.comm import Topology
from dtrain.comm.adasum import adasum_all_reduce_
from dtrain.errors import SyncError
from dtrain.sync.allreduce import AllReduceStrategy

LENGTHS = [5, 1, 12, 7]  # four tensors in one flat vector


def rank_vector(rank: int) -> torch.Tensor:
    return torch.randn(sum(LENGTHS), dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank))


def reference_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two vectors, tensor by tensor, with Python floats (independent of dtrain's code)."""
    out = []
    for x, y in zip(a.split(LENGTHS), b.split(LENGTHS), strict=True):
        dot, xx, yy = float(x @ y), float(x @ x), float(y @ y)
        out.append((1 - dot / (2 * xx)) * x + (1 - dot / (2 * yy)) * y)
    return torch.cat(out)


def reference_tree(vectors: list[torch.Tensor]) -> torch.Tensor:
    """The documented tree: ranks >= P' (largest power of two) fold into rank - P', then pairs in rank order."""
    leaves = 1 << (len(vectors).bit_length() - 1)
    level = [reference_pair(vectors[i], vectors[i + leaves]) if i + leaves < len(vectors) else vectors[i]
             for i in range(leaves)]
    while len(level) > 1:
        level = [reference_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _adasum_tree(topology: Topology) -> torch.Tensor:
    return adasum_all_reduce_(rank_vector(topology.rank), LENGTHS)


@pytest.mark.parametrize("world_size", [3, 4])
def test_adasum_tree_matches_local_reference(spawn: Any, world_size: int) -> None:
    results = spawn(_adasum_tree, world_size)
    expected = reference_tree([rank_vector(r) for r in range(world_size)])
    for result in results:
        assert torch.equal(result, results[0])  # every rank holds bitwise the same result
        assert float((result - expected).abs().max() / expected.abs().max()) < 1e-12
    # the tree is not the plain sum or mean
    assert float((expected - sum(rank_vector(r) for r in range(world_size))).abs().max()) > 1e-3


class Probe(nn.Module):
    """Parameters whose gradients are exactly the per-rank vectors we choose: loss = sum(p_i * c_i)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in sizes])

    def forward(self, targets: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * c).sum() for w, c in zip(self.weights, targets, strict=True))  # type: ignore[return-value]


def _reduced_gradients(topology: Topology, settings: list[tuple[str, float]], targets_of_rank: list[list[torch.Tensor]]
                       ) -> list[list[torch.Tensor]]:
    """One backward pass per (op, bucket MB) setting; the reduced gradients of each."""
    results = []
    for op, bucket_cap_mb in settings:
        model = Probe([t.numel() for t in targets_of_rank[0]])
        strategy = AllReduceStrategy(topology, op=op, bucket_cap_mb=bucket_cap_mb)  # type: ignore[arg-type]
        wrapped = strategy.wrap_model(model)
        wrapped(targets_of_rank[topology.rank]).backward()
        results.append([w.grad.clone() for w in model.weights])  # type: ignore[union-attr]
        strategy.close()
    return results


def test_adasum_through_ddp_hook_per_tensor(spawn: Any) -> None:
    """Rank 0 / rank 1 gradients: x / 2x (gives 1.5x), u / v orthogonal (gives u + v), y / -y (gives 0) —
    three tensors in tiny buckets and in one bucket."""
    x, y = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64), torch.tensor([0.5, 4.0], dtype=torch.float64)
    u, v = torch.tensor([2.0, 0.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([0.0, 3.0, 7.0, 0.0],
                                                                                 dtype=torch.float64)
    targets = [[x, u, y], [2 * x, v, -y]]
    for rank_results in spawn(_reduced_gradients, 2, [("adasum", 1e-5), ("adasum", 25.0)], targets):
        for grads in rank_results:
            torch.testing.assert_close(grads[0], 1.5 * x, rtol=1e-14, atol=0)
            assert torch.equal(grads[1], u + v)
            assert float(grads[2].abs().max()) < 1e-14


def test_sum_and_average_ops(spawn: Any) -> None:
    c = torch.arange(1.0, 7.0, dtype=torch.float64)
    targets = [[c[:2] * (r + 1), c[2:] * (r + 1)] for r in range(3)]
    for rank_results in spawn(_reduced_gradients, 3, [("sum", 1e-5), ("average", 1e-5), ("average", 25.0)], targets):
        for grads, factor in zip(rank_results, (6.0, 2.0, 2.0), strict=True):
            torch.testing.assert_close(torch.cat(grads), c * factor, rtol=1e-15, atol=0)


# ------------------------------------------------------------------------------ unused parameters


class Branchy(nn.Module):
    """A trunk every rank uses and a head only rank 0 uses (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4).double()
        self.head = nn.Linear(4, 1).double()

    def forward(self, x: torch.Tensor, use_head: bool) -> torch.Tensor:
        hidden = self.trunk(x)
        return self.head(hidden).sum() if use_head else hidden.sum()


def _train_branchy(topology: Topology, find_unused: bool) -> Any:
    model = Branchy()
    strategy = AllReduceStrategy(topology, find_unused_parameters=find_unused)
    wrapped = strategy.wrap_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4, dtype=torch.float64) * (topology.rank + 1)
    errors = []
    try:
        for _ in range(3):
            # rank 1 contributes nothing to the head: the average is rank 0's own head gradient / 2
            replica = copy.deepcopy(model)
            rank0_loss = replica(torch.ones(2, 4, dtype=torch.float64), use_head=True)
            expected = torch.autograd.grad(rank0_loss, replica.head.weight)[0] / 2
            wrapped(x, use_head=topology.rank == 0).backward()
            strategy.step(optimizer)  # the optimizer leaves .grad as it is
            errors.append(float((model.head.weight.grad - expected).abs().max()))  # type: ignore[operator]
            optimizer.zero_grad(set_to_none=True)
    except SyncError as exc:
        return ("SyncError", str(exc))
    except RuntimeError as exc:  # the rank left waiting sees its peer go away
        return ("RuntimeError", str(exc)[:200])
    return ("ok", max(errors), [p.detach().clone() for p in model.parameters()])


def test_unused_parameters_are_handled_with_find_unused_parameters(spawn: Any) -> None:
    results = spawn(_train_branchy, 2, True)
    assert [r[0] for r in results] == ["ok", "ok"]
    assert results[0][1] < 1e-14 and results[1][1] < 1e-14
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2], strict=True))


def test_unused_parameters_without_the_flag_give_one_clear_error(spawn: Any) -> None:
    results = spawn(_train_branchy, 2, False, timeout=120.0)
    kind, message = results[1]
    assert kind == "SyncError", results
    assert "head.weight" in message and "distributed.find_unused_parameters: true" in message
    assert results[0][0] in ("SyncError", "RuntimeError")  # rank 0 is told too instead of waiting forever


# ------------------------------------------------------------------------------------ uneven inputs


def _uneven_steps(topology: Topology) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    strategy = AllReduceStrategy(topology)
    wrapped = strategy.wrap_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    steps = 2 if topology.rank == 0 else 4  # rank 0 runs out of data first
    with strategy.join():
        for step in range(steps):
            x = torch.full((1, 3), float(step + 1 + 10 * topology.rank), dtype=torch.float64)
            wrapped(x).sum().backward()
            strategy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_ranks_with_fewer_batches_join_instead_of_hanging(spawn: Any) -> None:
    results = spawn(_uneven_steps, 2, timeout=120.0)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    with torch.no_grad():  # reference: steps 1-2 average both ranks; steps 3-4 rank 1's gradient / 2
        for step in range(4):
            rows = [float(step + 1 + 10)] + ([float(step + 1)] if step < 2 else [])
            grad_w = torch.stack([torch.full((3,), v, dtype=torch.float64) for v in rows]).sum(0) / 2
            model.weight -= 0.5 * grad_w.expand(2, 3)
            model.bias -= 0.5 * torch.full((2,), len(rows) / 2, dtype=torch.float64)
    for params in results:
        torch.testing.assert_close(params[0], model.weight, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(params[1], model.bias, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------ fusion tuning


def _tuned_training(topology: Topology) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4)).double()  # about 2 MB
    strategy = AllReduceStrategy(topology, auto_tune_fusion=True, tuner_steps_per_visit=2, tuner_rounds=1,
                                 tuner_warmup_steps=1)
    wrapped = strategy.wrap_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(12, 8, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    sizes = []
    for step in range(12):
        batch = data[step][topology.rank * 4:(topology.rank + 1) * 4]
        wrapped(batch).pow(2).mean().backward()
        strategy.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        sizes.append(strategy.bucket_cap_mb)
    return {"params": [p.detach().clone() for p in model.parameters()], "sizes": sizes,
            "state": strategy.state_dict()}


def test_auto_tuning_switches_buckets_without_changing_the_numbers(spawn: Any) -> None:
    results = spawn(_tuned_training, 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(12, 8, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for step in range(12):
        # the mean of the two ranks' mean losses is the mean loss of the whole batch of 8
        model(data[step]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in results:
        for got, want in zip(result["params"], model.parameters(), strict=True):
            want = want.detach()
            assert float((got - want).abs().max() / want.abs().max()) < 1e-12
        tuning = result["state"]["fusion_tuning"]
        assert tuning["done"] and len(tuning["visits"]) == len(tuning["candidates"]) >= 2
        assert len(set(result["sizes"][:2 * len(tuning["candidates"])])) >= 2  # it really trained with each
        assert result["state"]["bucket_cap_mb"] in tuning["candidates"]
    assert results[0]["state"] == results[1]["state"]  # both ranks chose the same


def _bucket_layouts(topology: Topology) -> tuple[list[int], list[int], list[int]]:
    """Bucket sizes (elements) after DDP's rebuild: raw DDP with its defaults, dtrain's defaults, and dtrain
    with 2 MB buckets."""
    from torch.nn.parallel import DistributedDataParallel

    def layers() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])  # 24 x 257 KiB of gradient

    def layout(wrapped: nn.Module, ddp: DistributedDataParallel) -> list[int]:
        for _ in range(2):  # the reducer rebuilds its buckets after the first backward pass
            wrapped(torch.randn(4, 256)).sum().backward()
        return [bucket.buffer().numel() for bucket in ddp.reducer._get_zeros_like_grad_buckets()]

    raw = DistributedDataParallel(layers())
    layouts = [layout(raw, raw)]
    for bucket_mb in (25.0, 2.0):
        strategy = AllReduceStrategy(topology, bucket_cap_mb=bucket_mb)
        wrapped = strategy.wrap_model(layers())
        layouts.append(layout(wrapped, wrapped.ddp))  # type: ignore[attr-defined]
        strategy.close()
    return layouts[0], layouts[1], layouts[2]


def test_first_bucket_is_small_like_ddp_default(spawn: Any) -> None:
    raw, ours, two_mb = spawn(_bucket_layouts, 2)[0]
    assert ours == raw  # the same layout as DDP's defaults: a 1 MiB first bucket, the rest in one
    assert len(ours) == 2 and ours[0] * 4 <= 1.1 * 2**20
    assert two_mb[0] == ours[0] and len(two_mb) > 2 and max(two_mb) * 4 <= 2.3 * 2**20
