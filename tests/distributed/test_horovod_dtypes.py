"""Every dtype dtrain.horovod reduces, gathers and broadcasts, each op against a local reference, at 2 and 3 gloo
ranks: uint8, int8, int16 (which gloo refuses: "Invalid scalar type"), int32, int64, float16, bfloat16, float32,
float64, and bool where Horovod takes it (allgather, broadcast, alltoall). Integer sums wrap as a sum in the
tensor's own type does (Horovod's gloo sum<T>); the references are computed in int64 and float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.conftest import run_spawned

INTEGERS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _inputs(size: int, dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Every rank's input (the same on every rank, from one seed). Integers span most of their type, so that a
    sum over the ranks overflows int8, uint8 and int16 and the wrap is checked too."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return [torch.randint(0, 2, shape, generator=generator).bool() for _ in range(size)]
    if dtype.is_floating_point:
        return [(torch.randn(shape, generator=generator, dtype=torch.float64) * 10).to(dtype) for _ in range(size)]
    low, high = {torch.uint8: (0, 255), torch.int8: (-120, 120), torch.int16: (-30000, 30000)}.get(
        dtype, (-1000, 1000))
    return [torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype) for _ in range(size)]


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    if expected.dtype in (torch.float16, torch.bfloat16):
        return bool(torch.allclose(got.double(), expected.double(), rtol=1e-2, atol=1e-2))
    if expected.dtype.is_floating_point:  # the ranks' sum rounds once per addition in float32
        tolerance = 1e-6 if expected.dtype == torch.float32 else 1e-12
        return bool(torch.allclose(got.double(), expected.double(), rtol=tolerance, atol=tolerance))
    return bool(torch.equal(got, expected))


def _reduced(inputs: list[torch.Tensor], dtype: torch.dtype, how: str) -> torch.Tensor:
    """The reference reduction: int64 then wrapped to the type (as a sum in that type wraps), float64 then
    rounded to it."""
    wide = torch.stack([t.to(torch.int64 if not dtype.is_floating_point else torch.float64) for t in inputs])
    if how == "sum":
        return wide.sum(0).to(dtype)
    if how == "min":
        return wide.min(0).values.to(dtype)
    if how == "max":
        return wide.max(0).values.to(dtype)
    product = wide[0].clone()
    for row in wide[1:]:
        product = product * row
    return product.to(dtype)


def _integer_scaled(values: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.trunc(values.to(torch.float64) * factor).to(dtype)


def _every_dtype(topology: Any) -> list[str]:
    import dtrain.horovod.torch as hvd

    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    failed: list[str] = []

    def check(label: str, ok: bool) -> None:
        if not ok:
            failed.append(label)

    for seed, dtype in enumerate(INTEGERS + FLOATS):
        inputs = _inputs(size, dtype, (5, 3), seed)
        mine = inputs[rank]
        summed = _reduced(inputs, dtype, "sum")
        check(f"sum {dtype}", _same(hvd.allreduce(mine, op=hvd.Sum), summed))
        check(f"min {dtype}", _same(hvd.allreduce(mine, op=hvd.Min), _reduced(inputs, dtype, "min")))
        check(f"max {dtype}", _same(hvd.allreduce(mine, op=hvd.Max), _reduced(inputs, dtype, "max")))
        check(f"product {dtype}", _same(hvd.allreduce(mine, op=hvd.Product), _reduced(inputs, dtype, "product")))
        if dtype.is_floating_point:
            average = (torch.stack([t.double() for t in inputs]).sum(0) / size).to(dtype)
            scaled = (torch.stack([t.double() * 0.5 for t in inputs]).sum(0) * 0.25).to(dtype)
        else:  # Horovod: the sum in the type, then 1/size in float64, truncated toward zero
            average = _integer_scaled(summed, 1.0 / size, dtype)
            scaled = _integer_scaled(_reduced([_integer_scaled(t, 0.5, dtype) for t in inputs], dtype, "sum"), 0.25,
                                     dtype)
        check(f"average {dtype}", _same(hvd.allreduce(mine), average))
        check(f"prescale/postscale {dtype}", _same(
            hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=0.25), scaled))
        in_place = mine.clone()
        hvd.allreduce_(in_place, op=hvd.Sum)
        check(f"allreduce_ {dtype}", _same(in_place, summed))
        handle = hvd.grouped_allreduce_async([mine, mine], op=hvd.Sum, name=f"grouped.{dtype}")
        check(f"grouped async {dtype}", all(_same(t, summed) for t in hvd.synchronize(handle)))
        tall = _inputs(size, dtype, (size + 1, 2), seed + 100)
        first, count = (0, 2) if rank == 0 else (rank + 1, 1)
        rows = slice(first, first + count)
        check(f"reducescatter sum {dtype}", _same(hvd.reducescatter(tall[rank], op=hvd.Sum),
                                                  _reduced(tall, dtype, "sum")[rows]))
    for seed, dtype in enumerate(INTEGERS + FLOATS + [torch.bool]):
        varying = [_inputs(size, dtype, (r + 1, 2), seed + 200)[r] for r in range(size)]
        check(f"allgather {dtype}", _same(hvd.allgather(varying[rank]), torch.cat(varying)))
        grouped = hvd.grouped_allgather([varying[rank], varying[rank]])
        check(f"grouped_allgather {dtype}", all(_same(t, torch.cat(varying)) for t in grouped))
        inputs = _inputs(size, dtype, (4, 3), seed + 300)
        source = inputs[rank].clone()
        check(f"broadcast {dtype}", _same(hvd.broadcast(source, size - 1), inputs[size - 1])
              and _same(source, inputs[rank]))
        hvd.broadcast_(source, size - 1)
        check(f"broadcast_ {dtype}", _same(source, inputs[size - 1]))
        handle = hvd.broadcast_async(inputs[rank], 0, name=f"bcast.{dtype}")
        check(f"broadcast_async {dtype}", _same(hvd.synchronize(handle), inputs[0]))
        splits = [r + 1 for r in range(size)]  # every rank sends r + 1 rows to rank r
        uneven = _inputs(size, dtype, (sum(splits), 2), seed + 400)
        output, received = hvd.alltoall(uneven[rank], splits=splits)
        start = sum(splits[:rank])
        check(f"alltoall {dtype}", _same(output, torch.cat([u[start:start + rank + 1] for u in uneven]))
              and received.tolist() == [rank + 1] * size)
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
        failed.append("bool allreduce: no error")
    except ValueError:
        pass
    hvd.shutdown()
    return failed


@pytest.mark.parametrize("size", [2, 3])
def test_every_dtype_and_op_against_local_references(size: int) -> None:
    for rank, failed in enumerate(run_spawned(_every_dtype, size, timeout=300)):
        assert failed == [], f"rank {rank}: {failed}"
