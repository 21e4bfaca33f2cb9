"""dtrain.horovod's API where Horovod documents it, at 2 and 3 gloo ranks: `sparse_allreduce_async` returns a handle
to call (or to `synchronize`), async ops really run in the background, Horovod's exception types, a failed
collective (on every rank, or on one rank's bad arguments) followed by a good one, `broadcast_optimizer_state` with
parameters that have no gradient or no state, and SparseAdam on sparse embeddings that keep sparse gradients (or,
with `sparse_as_dense=True`, are reduced dense and handed back sparse), against single-process SparseAdam on the full
batch (float64)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.conftest import run_spawned


class _HeldWork:
    """A transfer that reports itself unfinished until someone waits for it, so that what `poll` says does not
    depend on how fast the transfer is."""

    def __init__(self, work: Any) -> None:
        self.work, self.released = work, False

    def is_completed(self) -> bool:
        return self.released and bool(self.work.is_completed())

    def wait(self) -> Any:
        self.released = True
        return self.work.wait()


def _sparse_and_async(hvd: Any, size: int, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = [torch.tensor([[r % 3, 4], [r, 1]]) for r in range(size)]  # (row, column) pairs, repeated across ranks
    values = [torch.tensor([1.0 + r, 10.0 * (r + 1)], dtype=torch.float64) for r in range(size)]
    mine = torch.sparse_coo_tensor(rows[rank].t(), values[rank], (size + 3, 5))
    dense = sum(torch.sparse_coo_tensor(i.t(), v, (size + 3, 5)).to_dense() for i, v in zip(rows, values, strict=True))
    handle = hvd.sparse_allreduce_async(mine, name="sparse.sum", op=hvd.Sum)
    out["sparse_callable"] = callable(handle)
    out["sparse_sum"] = torch.equal(handle().to_dense(), dense)
    handle = hvd.sparse_allreduce_async(mine, name="sparse.average", op=hvd.Average)
    out["sparse_average"] = torch.allclose(hvd.synchronize(handle).to_dense(), dense / size)
    big = torch.arange(size * 2**18, dtype=torch.float32)
    real_all_reduce, held = torch.distributed.all_reduce, []

    def holding(*args: Any, **kwargs: Any) -> Any:
        work = real_all_reduce(*args, **kwargs)
        if kwargs.get("async_op"):
            work = _HeldWork(work)
            held.append(work)
        return work

    torch.distributed.all_reduce = holding  # each transfer reads unfinished until synchronize waits for it
    try:
        handles = [hvd.reducescatter_async(big * (i + 1), name=f"scatter.{i}", op=hvd.Sum) for i in range(5)]
        # poll must ask the negotiation and the transfer, never wait: unposted elsewhere or held, each is unfinished
        out["reducescatter_polled_false"] = not any(hvd.poll(h) for h in handles)
        share = big.shape[0] // size
        out["reducescatter_results"] = all(
            torch.equal(hvd.synchronize(h), (big[rank * share:(rank + 1) * share] * (i + 1) * size))
            for i, h in enumerate(handles))
        out["reducescatter_polled_false"] &= len(held) == 5  # each transfer was started without waiting
    finally:
        torch.distributed.all_reduce = real_all_reduce
    return out


def _errors_then_good(hvd: Any, size: int, rank: int) -> dict[str, str]:
    """Each failure, then the same kind of collective done right; returns what each step did on this rank."""
    seen: dict[str, str] = {}

    def attempt(label: str, expected: type[BaseException], call: Any) -> None:
        try:
            call()
            seen[label] = "no error"
        except expected:
            seen[label] = "raised"
        except BaseException as error:  # noqa: BLE001 - reported, and the test fails on it
            seen[label] = f"{type(error).__name__}: {error}"

    ones = torch.ones(4, 2)
    attempt("mismatched shapes", RuntimeError, lambda: hvd.allreduce(torch.ones(2 + rank)))
    seen["allreduce after"] = str(hvd.allreduce(ones, op=hvd.Sum)[0, 0].item())
    attempt("adasum reducescatter", RuntimeError, lambda: hvd.reducescatter(ones, op=hvd.Adasum))
    attempt("scalar reducescatter", RuntimeError, lambda: hvd.reducescatter(torch.tensor(1.0)))
    seen["reducescatter after"] = str(hvd.reducescatter(torch.ones(size, 2), op=hvd.Sum).tolist())
    bad = [1] * size if rank != size - 1 else [size + 5] + [0] * (size - 1)  # only the last rank's are wrong
    attempt("bad splits on one rank", ValueError, lambda: hvd.alltoall(torch.ones(size, 2), splits=bad))
    seen["alltoall after"] = str(hvd.alltoall(torch.full((size, 1), float(rank))).flatten().tolist())
    return seen


def _optimizer_state_without_grads(hvd: Any, size: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # every rank starts from different weights and hyperparameters
    model = torch.nn.ModuleDict({"frozen": torch.nn.Linear(2, 2), "trained": torch.nn.Linear(2, 1),
                                 "unused": torch.nn.Linear(2, 1)})
    model["frozen"].requires_grad_(False)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9, weight_decay=0.01),
        named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # its zero-gradient step moves weights (weight decay)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    out: dict[str, Any] = {"frozen_grad_none": model["frozen"].weight.grad is None,
                           "trained_grad": model["trained"].weight.grad.tolist(),
                           "lr": optimizer.param_groups[0]["lr"]}
    optimizer.zero_grad()
    model["trained"](model["frozen"](torch.ones(3, 2))).sum().backward()
    optimizer.step()  # "unused" gets a zero gradient from synchronize(), "frozen" none at all
    optimizer.state.pop(model["unused"].weight)  # a parameter without state on every rank
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    out["momentum"] = optimizer.state[model["trained"].weight]["momentum_buffer"].clone()
    return out


def _sparse_adam(hvd: Any, size: int, rank: int, sparse_as_dense: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 10, (size, 6))
    targets = torch.randn(size, 6, 3, dtype=torch.float64)
    reference = torch.nn.Embedding(10, 3, sparse=True).double()
    model = torch.nn.Embedding(10, 3, sparse=True).double()
    model.load_state_dict(reference.state_dict())
    reference_opt = torch.optim.SparseAdam(reference.parameters(), lr=0.05)
    optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=model)
    reference.weight.grad = torch.zeros_like(reference.weight).to_sparse()  # the state step Horovod takes
    reference_opt.step()
    sparse_grads = []
    for _ in range(3):
        reference_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(tokens), targets).backward()
        reference_opt.step()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(tokens[rank]), targets[rank]).backward()
        optimizer.synchronize()
        sparse_grads.append(model.weight.grad.is_sparse)
        with optimizer.skip_synchronize():
            optimizer.step()
    return {"sparse_grads": sparse_grads,
            "difference": float((model.weight - reference.weight).abs().max())}


def _api(topology: Any) -> dict[str, Any]:
    import dtrain.horovod.torch as hvd

    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    results = {"sparse_async": _sparse_and_async(hvd, size, rank), "errors": _errors_then_good(hvd, size, rank),
               "state": _optimizer_state_without_grads(hvd, size, rank), "sparse_adam": _sparse_adam(hvd, size, rank),
               "sparse_as_dense": _sparse_adam(hvd, size, rank, sparse_as_dense=True)}
    hvd.shutdown()
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_horovod_api_as_horovod_documents_it(size: int) -> None:
    results = run_spawned(_api, size, timeout=300)
    for rank, result in enumerate(results):
        sparse_async = result["sparse_async"]
        assert sparse_async["sparse_callable"] and sparse_async["sparse_sum"] and sparse_async["sparse_average"]
        assert sparse_async["reducescatter_polled_false"] and sparse_async["reducescatter_results"]
        errors = result["errors"]
        for label in ("mismatched shapes", "adasum reducescatter", "scalar reducescatter", "bad splits on one rank"):
            assert errors[label] == "raised", (rank, label, errors[label])
        assert errors["allreduce after"] == str(float(size))
        assert errors["reducescatter after"] == str([[float(size)] * 2])
        assert errors["alltoall after"] == str([float(r) for r in range(size)])
        state = result["state"]
        assert state["frozen_grad_none"] and state["lr"] == pytest.approx(0.1)
        assert state["trained_grad"] == [[0.0, 0.0]]  # the zero gradient the state was made with stays
        for mine, root in zip(state["weights"], results[0]["state"]["weights"], strict=True):
            assert torch.equal(mine, root)
        assert torch.equal(state["momentum"], results[0]["state"]["momentum"])
        # sparse_as_dense: reduced as a dense allreduce, handed back sparse before the step, as Horovod does
        for path in ("sparse_adam", "sparse_as_dense"):
            assert result[path]["sparse_grads"] == [True, True, True], (rank, path)
            assert result[path]["difference"] < 1e-9, (rank, path)
