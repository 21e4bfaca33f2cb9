"""dtrain.horovod's collectives, gradients, optimizer and state against local references, at 2 and 3 real gloo
ranks. Each world size is one spawned job that runs every check and returns what it saw (spawning is the slow
part); the references are computed on every rank from the inputs all ranks would have made."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.conftest import run_spawned

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64]


def _input(rank: int, dtype: torch.dtype, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    values = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    return (values * (rank + 1) + rank).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if dtype.is_floating_point:
        tol = 1e-2 if dtype == torch.float16 else 1e-6
        return bool(torch.allclose(a.double(), b.double(), rtol=tol, atol=tol))
    return bool(torch.equal(a, b))


def _collectives(hvd: Any, size: int, rank: int) -> list[str]:
    """Every collective, dtype and op against a reference computed here; returns the failures."""
    failed: list[str] = []

    def check(label: str, ok: bool) -> None:
        if not ok:
            failed.append(label)

    for dtype in DTYPES:
        inputs = [_input(r, dtype) for r in range(size)]
        wide = torch.stack([t.double() for t in inputs])
        mine = inputs[rank]
        check(f"sum {dtype}", _close(hvd.allreduce(mine, op=hvd.Sum), wide.sum(0).to(dtype), dtype))
        average = wide.sum(0) / size
        expected = average.to(dtype) if dtype.is_floating_point else torch.trunc(average).to(dtype)
        check(f"average {dtype}", _close(hvd.allreduce(mine), expected, dtype))
        check(f"min {dtype}", _close(hvd.allreduce(mine, op=hvd.Min), wide.min(0).values.to(dtype), dtype))
        check(f"max {dtype}", _close(hvd.allreduce(mine, op=hvd.Max), wide.max(0).values.to(dtype), dtype))
        check(f"product {dtype}", _close(hvd.allreduce(mine, op=hvd.Product), wide.prod(0).to(dtype), dtype))
        scaled = (wide * 2).sum(0) * 0.5
        check(f"prescale/postscale {dtype}", _close(
            hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
            scaled.to(dtype) if dtype.is_floating_point else torch.trunc(scaled).to(dtype), dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            check(f"average=False {dtype}", _close(hvd.allreduce(mine, average=False), wide.sum(0).to(dtype), dtype))
        inplace = mine.clone()
        hvd.allreduce_(inplace, op=hvd.Sum)
        check(f"allreduce_ {dtype}", _close(inplace, wide.sum(0).to(dtype), dtype))
        handle = hvd.allreduce_async(mine, op=hvd.Sum, name=f"async.{dtype}")
        check(f"async {dtype}", _close(hvd.synchronize(handle), wide.sum(0).to(dtype), dtype))
        grouped = hvd.grouped_allreduce([mine, mine * 2], op=hvd.Sum)
        check(f"grouped {dtype}", _close(grouped[1], (wide * 2).sum(0).to(dtype), dtype))
        varying = [_input(r, dtype, (r + 1, 2)) for r in range(size)]
        check(f"allgather {dtype}", _close(hvd.allgather(varying[rank]), torch.cat(varying), dtype))
        root = size - 1
        source = mine.clone()
        check(f"broadcast {dtype}", _close(hvd.broadcast(source, root), inputs[root], dtype)
              and _close(source, mine, dtype))
        hvd.broadcast_(source, root)
        check(f"broadcast_ {dtype}", _close(source, inputs[root], dtype))
        rows = [_input(r, dtype, (2 * size, 2)) for r in range(size)]
        check(f"alltoall equal {dtype}", _close(hvd.alltoall(rows[rank]),
                                                torch.cat([rows[r][2 * rank:2 * rank + 2] for r in range(size)]),
                                                dtype))
        splits = [r + 1 for r in range(size)]  # rank s sends r+1 rows to rank r
        uneven = [_input(r, dtype, (sum(splits), 2)) for r in range(size)]
        output, received = hvd.alltoall(uneven[rank], splits=splits)
        start = sum(splits[:rank])
        check(f"alltoall splits {dtype}", _close(output, torch.cat([uneven[r][start:start + rank + 1]
                                                                    for r in range(size)]), dtype)
              and received.tolist() == [rank + 1] * size)
        if dtype.is_floating_point:
            tall = [_input(r, dtype, (size + 1, 2)) for r in range(size)]
            total = torch.stack([t.double() for t in tall]).sum(0)
            first = 0 if rank == 0 else 2 + (rank - 1)
            count = 2 if rank == 0 else 1
            check(f"reducescatter sum {dtype}", _close(hvd.reducescatter(tall[rank], op=hvd.Sum),
                                                       total[first:first + count].to(dtype), dtype))
            check(f"reducescatter average {dtype}", _close(hvd.reducescatter(tall[rank]),
                                                           (total[first:first + count] / size).to(dtype), dtype))
    return failed


def _gradients(hvd: Any, size: int, rank: int) -> list[str]:
    failed = []
    x = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    if not torch.allclose(x.grad, torch.full_like(x, size)):
        failed.append("allreduce grad")
    x = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x).sum().backward()
    if not torch.allclose(x.grad, torch.ones_like(x)):
        failed.append("allreduce average grad")
    x = torch.ones(rank + 1, 2, dtype=torch.float64, requires_grad=True)
    weights = torch.arange(sum(range(1, size + 1)) * 2, dtype=torch.float64).reshape(-1, 2)
    (hvd.allgather(x) * weights).sum().backward()
    offset = sum(range(1, rank + 1))
    if not torch.allclose(x.grad, weights[offset:offset + rank + 1]):
        failed.append("allgather grad")
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (hvd.broadcast(x, 0) * (rank + 1)).sum().backward()
    expected = torch.full((2,), sum(range(1, size + 1)) / size if rank == 0 else 0.0, dtype=torch.float64)
    if not torch.allclose(x.grad, expected):
        failed.append("broadcast grad")
    x = torch.ones(size, 2, dtype=torch.float64, requires_grad=True)
    hvd.alltoall(x).sum().backward()
    if not torch.allclose(x.grad, torch.ones_like(x)):
        failed.append("alltoall grad")
    for op, factor in ((hvd.Sum, size), (hvd.Average, 1)):
        x = torch.ones(size + 1, 2, dtype=torch.float64, requires_grad=True)
        hvd.reducescatter(x, op=op).sum().backward()
        if not torch.allclose(x.grad, torch.full_like(x, factor)):
            failed.append(f"reducescatter grad op {op}")
    return failed


def _errors(hvd: Any, size: int, rank: int) -> list[str]:
    """Mismatched shapes and dtypes raise RuntimeError on every rank (each rank reports what it raised)."""
    seen = []
    try:
        hvd.allreduce(torch.ones(2 + rank))
        seen.append("shape: no error")
    except RuntimeError as error:
        seen.append("shape: " + ("ok" if "Mismatched allreduce" in str(error) else str(error)))
    try:
        hvd.allgather(torch.ones(2, 2, dtype=torch.float32 if rank == 0 else torch.float64))
        seen.append("dtype: no error")
    except RuntimeError as error:
        seen.append("dtype: " + ("ok" if "Mismatched allgather" in str(error) else str(error)))
    return seen


def _process_sets_and_join(hvd: Any, size: int, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pair = hvd.add_process_set([0, 1])
    if rank in (0, 1):
        out["set_sum"] = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, process_set=pair).item()
        out["set_rank"] = pair.rank()
    else:
        try:
            hvd.allreduce(torch.ones(1), process_set=pair)
            out["outsider"] = "no error"
        except ValueError:
            out["outsider"] = "refused"
    hvd.remove_process_set(pair)
    if rank == 0:
        out["last_joined"] = hvd.join()
    else:
        out["joined_average"] = hvd.allreduce(torch.tensor([6.0])).item()
        out["joined_int"] = hvd.allreduce(torch.tensor([5], dtype=torch.int32)).item()
        out["last_joined"] = hvd.join()
    sparse = torch.sparse_coo_tensor(torch.tensor([[rank]]), torch.tensor([float(rank + 1)]), (size,))
    reduced = hvd.synchronize(hvd.sparse_allreduce_async(sparse, name="sparse")).coalesce().to_dense()
    out["sparse"] = reduced.tolist()
    out["objects"] = hvd.allgather_object({"rank": rank})
    out["object"] = hvd.broadcast_object({"from": rank}, root_rank=size - 1)
    return out


def _optimizer(hvd: Any, size: int, rank: int) -> dict[str, float]:
    """DistributedOptimizer against single-process SGD on the full batch, float64: the largest difference."""
    torch.manual_seed(0)
    features, targets = torch.randn(12 * size, 5, dtype=torch.float64), torch.randn(12 * size, 1, dtype=torch.float64)
    differences = {}
    for label, passes, predivide in (("bpps1", 1, 1.0), ("bpps2", 2, 1.0), ("predivide", 1, 2.0)):
        torch.manual_seed(1)
        reference = torch.nn.Linear(5, 1).double()
        model = torch.nn.Linear(5, 1).double()
        model.load_state_dict(reference.state_dict())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                       gradient_predivide_factor=predivide)
        mine = slice(12 * rank, 12 * (rank + 1))
        for _ in range(3):
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(features), targets).backward()
            ref_opt.step()
            opt.zero_grad()
            for micro in torch.arange(12 * rank, 12 * (rank + 1)).chunk(passes):
                loss = torch.nn.functional.mse_loss(model(features[micro]), targets[micro]) / passes
                loss.backward()
            opt.step()
        del mine
        differences[label] = max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                                           reference.parameters(), strict=True))
    return differences


def _optimizer_behaviour(hvd: Any, size: int, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "sometimes": torch.nn.Linear(3, 1)})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["lr"] = opt.param_groups[0]["lr"]
    loss = model["used"](torch.ones(2, 3)).sum()
    if rank == 0:  # a layer only rank 0 uses: the others submit zeros, nobody hangs
        loss = loss + model["sometimes"](torch.ones(2, 3)).sum()
    loss.backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warnings"] = [str(w.message)[:60] for w in caught]
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model["used"](torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    out["isinstance"] = isinstance(opt, torch.optim.SGD)
    for label, compression in (("fp16", hvd.Compression.fp16), ("dtrain_topk", hvd.Compression.dtrain("topk",
                                                                                                   ratio=1.0))):
        layer = torch.nn.Linear(4, 3)
        compressed = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.0), compression=compression,
                                              named_parameters=layer.named_parameters())
        layer(torch.full((2, 4), float(rank + 1))).sum().backward()
        compressed.synchronize()
        # d(sum)/d(bias) = 2 per rank; d(sum)/d(weight) = 2 (rank + 1); averaged over the ranks
        out[label] = (layer.bias.grad.tolist(), float(layer.weight.grad[0, 0]))
    return out


def _optimizer_with_join(hvd: Any, size: int, rank: int) -> list[float]:
    """Rank 0 runs out of data after one step and joins; the others' later steps average in its zeros."""
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    seen = []
    for _ in range(1 if rank == 0 else 3):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        seen.append(float(model.weight.grad[0, 0]))
        with opt.skip_synchronize():
            opt.step()
    hvd.join()
    return seen


def _sync_batch_norm(hvd: Any, size: int, rank: int) -> float:
    torch.manual_seed(3)
    full = torch.randn(4 * size, 3, 5, dtype=torch.float64)
    reference = torch.nn.BatchNorm1d(3).double()
    synced = hvd.SyncBatchNorm(3).double()
    expected = reference(full)
    (expected * torch.arange(5, dtype=torch.float64)).sum().backward()
    mine = full[4 * rank:4 * (rank + 1)].clone().requires_grad_(True)
    got = synced(mine)
    (got * torch.arange(5, dtype=torch.float64)).sum().backward()
    weight_grad = hvd.allreduce(synced.weight.grad, op=hvd.Sum)
    return max(float((got - expected[4 * rank:4 * (rank + 1)]).abs().max()),
               float((weight_grad - reference.weight.grad).abs().max()),
               float((synced.running_var - reference.running_var).abs().max()))


def _everything(topology: Any, timeline: str) -> dict[str, Any]:
    import dtrain.horovod.torch as hvd

    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    hvd.start_timeline(timeline)
    results = {"collectives": _collectives(hvd, size, rank), "gradients": _gradients(hvd, size, rank),
               "errors": _errors(hvd, size, rank), "sets": _process_sets_and_join(hvd, size, rank),
               "optimizer": _optimizer(hvd, size, rank), "behaviour": _optimizer_behaviour(hvd, size, rank),
               "sync_batch_norm": _sync_batch_norm(hvd, size, rank),
               "join_optimizer": _optimizer_with_join(hvd, size, rank)}
    hvd.stop_timeline()
    results["info"] = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    hvd.shutdown()
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_horovod_api_against_local_references(size: int, tmp_path: Path) -> None:
    timeline = str(tmp_path / "timeline.json")
    results = run_spawned(_everything, size, timeline, timeout=300)
    for rank, result in enumerate(results):
        assert result["collectives"] == [], f"rank {rank}"
        assert result["gradients"] == [], f"rank {rank}"
        assert result["errors"] == ["shape: ok", "dtype: ok"], f"rank {rank}"
        assert all(value < 1e-9 for value in result["optimizer"].values()), result["optimizer"]
        assert result["sync_batch_norm"] < 1e-9
        partial = (size - 1) / size
        assert result["join_optimizer"] == pytest.approx([1.0] if rank == 0 else [1.0, partial, partial])
        behaviour = result["behaviour"]
        assert behaviour["lr"] == pytest.approx(0.1) and behaviour["isinstance"]
        assert len(behaviour["warnings"]) == 1 and behaviour["warnings"][0].startswith("optimizer.step() called")
        assert result["info"] == (rank, size, 0, 1)
        mean_weight = 2 * sum(range(1, size + 1)) / size
        for label in ("fp16", "dtrain_topk"):
            bias, weight = behaviour[label]
            assert bias == pytest.approx([2.0] * 3, rel=1e-3) and weight == pytest.approx(mean_weight, rel=1e-3)
        sets = result["sets"]
        if rank < 2:
            assert sets["set_sum"] == 3.0 and sets["set_rank"] == rank
        else:
            assert sets["outsider"] == "refused"
        if rank > 0:
            assert sets["joined_average"] == pytest.approx(6.0 * (size - 1) / size)
            assert sets["joined_int"] == int(5 * (size - 1) / size)
        assert sets["objects"] == [{"rank": r} for r in range(size)]
        assert sets["sparse"] == pytest.approx([(r + 1) / size for r in range(size)])
        assert sets["object"] == {"from": size - 1}
    assert len({r["sets"]["last_joined"] for r in results}) == 1 and results[0]["sets"]["last_joined"] != 0
    assert all(torch.equal(a, b) for a, b in zip(results[0]["behaviour"]["weights"],
                                                  results[-1]["behaviour"]["weights"], strict=True))
    events = json.loads(Path(timeline).read_text())["traceEvents"]
    names = {event["name"] for event in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "ALLGATHER", "BROADCAST"} <= names
    assert any("start_time_since_epoch_in_micros" in event.get("args", {}) for event in events)
