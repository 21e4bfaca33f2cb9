"""Horovod's collectives on torch.distributed: allreduce, allgather, broadcast, alltoall, reducescatter (plain,
in place, async, grouped), join, barrier, poll and synchronize, each differentiable as Horovod defines it.

Every collective first *negotiates*: the ranks of the process set all-gather one small row each (what op, which
dtype and shape, which root), and all compare the same table. A mismatch raises `RuntimeError` on every rank,
naming the ranks and what differs, instead of leaving gloo to hang or scribble; a rank that has called `join()`
answers with a JOIN row and contributes zeros to the others' allreduces. Horovod matches ops by name in a
background cycle; here they are matched by call order, which is what scripts that run the same code on every
rank do (names are still checked for duplicates among pending async ops).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics
from dtrain.horovod.basics import Adasum, Average, Max, Min, ProcessSet, Product, Sum, global_process_set

KINDS = {"ALLREDUCE": 1, "ALLGATHER": 2, "BROADCAST": 3, "ALLTOALL": 4, "REDUCESCATTER": 5, "BARRIER": 6,
         "JOIN": 7}
KIND_NAMES = {code: name for name, code in KINDS.items()}
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]
REDUCIBLE = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
             torch.float32, torch.float64}
MOVABLE = REDUCIBLE | {torch.bool}
# What gloo cannot carry travels as a wider type and is narrowed back, exactly: int16 moves as int32 (every value
# fits) and is reduced in int64 then wrapped to 16 bits, as a sum in int16 would wrap; fp16 and bf16 are reduced
# in fp32 (as Horovod does on CPU) and move as themselves.
MOVE_WIRE = {torch.int16: torch.int32}
REDUCE_WIRE = {torch.int16: torch.int64, torch.float16: torch.float32, torch.bfloat16: torch.float32}
MAX_DIMS = 8
ROW = 6 + MAX_DIMS  # kind, dtype, ndim, op, root, join cycle, dims
TORCH_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX,
             Product: dist.ReduceOp.PRODUCT}


@dataclass
class _Join:
    joined: bool = False
    cycle: int = 0  # negotiations so far: the same count on every rank of the world


JOIN = _Join()


# ------------------------------------------------------------------------------------------- negotiation


def _group_of(process_set: ProcessSet) -> Any:
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered (hvd.add_process_set) or was removed")
    if not process_set.included():
        raise ValueError(f"rank {basics.rank()} is not in process set {process_set.process_set_id} "
                         f"(ranks {process_set.ranks}): only its members may call collectives on it")
    return process_set.group


def _row(kind: str, tensor: torch.Tensor | None, op: int = 0, root: int = -1) -> torch.Tensor:
    row = torch.zeros(ROW, dtype=torch.int64)
    row[0], row[3], row[4], row[5] = KINDS[kind], op, root, JOIN.cycle
    if tensor is not None:
        row[1] = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else 99
        row[2] = tensor.dim()
        dims = list(tensor.shape)
        if len(dims) > MAX_DIMS:
            dims = dims[:MAX_DIMS - 1] + [math.prod(dims[MAX_DIMS - 1:])]
        row[6:6 + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    return row


def _exchange(row: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    rows = [torch.empty(ROW, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    table = torch.stack(rows)
    if group is None:
        JOIN.cycle += 1
    return table


def _describe(row: torch.Tensor) -> str:
    kind = KIND_NAMES.get(int(row[0]), "?")
    dtype = DTYPES[int(row[1])] if int(row[1]) < len(DTYPES) else "unsupported"
    shape = tuple(int(d) for d in row[6:6 + min(int(row[2]), MAX_DIMS)])
    return f"{kind} of {dtype} {shape}" + (f" op {basics.OP_NAMES.get(int(row[3]), row[3])}" if int(row[0]) in (
        1, 5) else "") + (f" root {int(row[4])}" if int(row[0]) == 3 else "")


def negotiate(kind: str, name: str, tensor: torch.Tensor | None, group: Any, op: int = 0, root: int = -1,
              ranks: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather this rank's row and check the table; returns it (rows in group-rank order). Raises
    RuntimeError, the same on every rank, when the ranks disagree or a rank has joined and the op needs it."""
    return check_table(kind, name, _exchange(_row(kind, tensor, op, root), group), ranks)


def negotiate_async(kind: str, name: str, tensor: torch.Tensor, group: Any, op: int = 0,
                    ranks: Sequence[int] | None = None) -> Callable[[], torch.Tensor]:
    """Start the same exchange without waiting; the returned function waits and checks. For a collective whose
    every rank is known to agree on shapes (a DistributedOptimizer bucket after its first, checked, step): the
    rows still travel, so a joined rank still answers, but backward never blocks on them."""
    world = dist.get_world_size(group)
    rows = [torch.empty(ROW, dtype=torch.int64) for _ in range(world)]
    work = dist.all_gather(rows, _row(kind, tensor, op), group=group, async_op=True)
    if group is None:
        JOIN.cycle += 1

    def check() -> torch.Tensor:
        assert work is not None
        work.wait()
        return check_table(kind, name, torch.stack(rows), ranks)

    return check


def check_table(kind: str, name: str, table: torch.Tensor, ranks: Sequence[int] | None) -> torch.Tensor:
    """Compare the gathered rows; the same RuntimeError on every rank when they disagree."""
    members = list(ranks) if ranks is not None else list(range(table.shape[0]))
    joined = [members[i] for i in range(table.shape[0]) if int(table[i, 0]) == KINDS["JOIN"]]
    if joined and kind not in ("ALLREDUCE", "BARRIER"):
        raise RuntimeError(f"{kind.lower()} '{name}' cannot run while rank(s) {joined} have called hvd.join(): "
                           "only allreduce (zeros from the joined ranks) and barrier can")
    live = [i for i in range(table.shape[0]) if int(table[i, 0]) != KINDS["JOIN"]]
    reference = table[live[0]]
    compare = list(range(0, 6))  # kind, dtype, ndim, op, root (the join cycle differs: skipped below)
    compare.remove(5)
    free_first_dim = kind in ("ALLGATHER", "ALLTOALL")
    for i in live[1:]:
        row = table[i]
        same = all(int(row[c]) == int(reference[c]) for c in compare)
        dims = int(reference[2])
        first = 7 if free_first_dim else 6
        same = same and torch.equal(row[first:6 + min(dims, MAX_DIMS)], reference[first:6 + min(dims, MAX_DIMS)])
        if not same:
            raise RuntimeError(f"Mismatched {kind.lower()} '{name}': rank {members[live[0]]} submitted "
                               f"{_describe(reference)} but rank {members[i]} submitted {_describe(row)}; every "
                               "rank must call the same collectives with the same dtypes and shapes")
    if int(reference[1]) == 99:
        raise RuntimeError(f"{kind.lower()} '{name}': unsupported dtype")
    return table


# ------------------------------------------------------------------------------------------- handles


@dataclass
class _Pending:
    name: str
    finish: Callable[[], Any]
    work: Any = None
    result: Any = None
    done: bool = False


_HANDLES: dict[int, _Pending] = {}
_NEXT = [0]


def forget_pending() -> None:
    """Drop every async op not yet synchronized and the join count (elastic: the process group they ran on is
    gone, and a new membership starts counting negotiations afresh on every rank)."""
    _HANDLES.clear()
    JOIN.joined, JOIN.cycle = False, 0


def _submit(name: str, finish: Callable[[], Any], work: Any = None) -> int:
    if any(p.name == name for p in _HANDLES.values()):
        raise ValueError(f"a collective named '{name}' is still pending on this rank: synchronize it first or use "
                         "another name")
    _NEXT[0] += 1
    _HANDLES[_NEXT[0]] = _Pending(name, finish, work)
    return _NEXT[0]


class SparseHandle:
    """What `sparse_allreduce_async` returns, as in Horovod: call it (or pass it to `synchronize`) for the
    reduced sparse tensor; `poll` says whether both all-gathers (indices, values) have finished."""

    def __init__(self, indices: int, values: int, op: int, size: int, shape: torch.Size) -> None:
        self._handles, self._op, self._size, self._shape = (indices, values), op, size, shape
        self._result: torch.Tensor | None = None

    def poll(self) -> bool:
        return self._result is not None or all(poll(h) for h in self._handles)

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            indices, values = (synchronize(h) for h in self._handles)
            if self._op == Average:
                values = values / self._size
            self._result = torch.sparse_coo_tensor(indices.t(), values, self._shape)
        return self._result


def poll(handle: int | SparseHandle) -> bool:
    """Whether the async op behind `handle` has finished (then `synchronize` will not block)."""
    if isinstance(handle, SparseHandle):
        return handle.poll()
    pending = _HANDLES.get(handle)
    if pending is None:
        raise ValueError(f"unknown handle {handle}")
    works = pending.work if isinstance(pending.work, list) else [pending.work]
    return all(w is None or w.is_completed() for w in works)


def synchronize(handle: int | SparseHandle) -> Any:
    """Wait for the async op behind `handle` and return its output."""
    if isinstance(handle, SparseHandle):
        return handle()
    pending = _HANDLES.pop(handle, None)
    if pending is None:
        raise ValueError(f"unknown handle {handle} (already synchronized?)")
    try:
        works = pending.work if isinstance(pending.work, list) else [pending.work]
        for work in works:
            if work is not None:
                work.wait()
        return pending.finish()
    except RuntimeError as error:
        raise basics.HorovodInternalError(str(error)) from error


def _name(kind: str, name: str | None) -> str:
    return f"{kind.lower()}.{name}" if name else f"{kind.lower()}.noname.{_NEXT[0] + 1}"


# ------------------------------------------------------------------------------------------- reductions


def _resolve_op(op: int | None, average: bool | None) -> int:
    if average is not None:
        if op is not None:
            raise ValueError("op and average cannot both be given; average= is deprecated: use op=hvd.Average or "
                             "op=hvd.Sum")
        warnings.warn("the average= argument is deprecated; use op=hvd.Average or op=hvd.Sum", DeprecationWarning,
                      stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def _scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place; integers are scaled in float64 and truncated toward zero, as Horovod's are."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        return tensor.mul_(factor)
    return tensor.copy_(torch.trunc(tensor.to(torch.float64) * factor).to(tensor.dtype))


def _work_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The buffer the reduction runs in: a contiguous copy in the type it is reduced in (REDUCE_WIRE)."""
    wire = REDUCE_WIRE.get(tensor.dtype)
    if wire is not None:
        return tensor.detach().to(wire).contiguous()
    return tensor.detach().clone().contiguous()


def _wrap(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An integer buffer reduced in a wider type, narrowed to `dtype` (two's-complement wrap, as the sum or
    product in `dtype` itself gives); floating buffers are returned as they are (scaled before narrowing)."""
    if buffer.dtype == dtype or dtype.is_floating_point:
        return buffer
    return buffer.to(dtype)


def _scaled_input(buffer: torch.Tensor, dtype: torch.dtype, prescale: float) -> torch.Tensor:
    """`prescale` applied to a rank's input before the reduction; integers are truncated to `dtype`, as Horovod's
    prescale on an integer tensor is."""
    _scale(buffer, prescale)
    if prescale != 1.0 and buffer.dtype != dtype and not dtype.is_floating_point:
        buffer.copy_(buffer.to(dtype))
    return buffer


def _to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` in a type the backend carries (MOVE_WIRE), for allgather, broadcast,
    alltoall."""
    wire = MOVE_WIRE.get(tensor.dtype)
    return tensor.detach().to(wire).contiguous() if wire is not None else tensor.detach().clone().contiguous()


def _start_allreduce(tensor: torch.Tensor, op: int, prescale: float, postscale: float, process_set: ProcessSet,
                     name: str, checked_before: bool = False) -> tuple[torch.Tensor, Any, float]:
    """Negotiate and start the reduction; returns (buffer, work, postscale still to apply). With
    `checked_before` (the same collective already agreed on by every rank) the negotiation is not waited for
    here: the returned work waits for it and checks it."""
    if tensor.dtype not in REDUCIBLE:
        raise ValueError(f"allreduce '{name}': dtype {tensor.dtype} is not reducible; use uint8, int8, int16, int32, "
                         "int64, float16, bfloat16, float32 or float64")
    if op not in basics.OP_NAMES:
        raise ValueError(f"allreduce '{name}': unknown op {op}; use hvd.Average, Sum, Adasum, Min, Max or Product")
    group = _group_of(process_set)
    started = time.perf_counter()
    pending_check = None
    if checked_before and op != Adasum:
        pending_check = negotiate_async("ALLREDUCE", name, tensor, group, op=op, ranks=process_set.ranks)
    else:
        negotiate("ALLREDUCE", name, tensor, group, op=op, ranks=process_set.ranks)
    negotiated = time.perf_counter()
    buffer = _scaled_input(_work_tensor(tensor), tensor.dtype, prescale)
    world = process_set.size()
    if op == Adasum:
        if not buffer.is_floating_point():
            raise ValueError(f"allreduce '{name}': Adasum needs a floating-point tensor, got {tensor.dtype}")
        from dtrain.comm.adasum import adasum_all_reduce_

        flat = buffer.view(-1)
        adasum_all_reduce_(flat, group=group)
        basics.record_span("ADASUM", name, started, time.perf_counter(), negotiated)
        return buffer, None, postscale
    work = dist.all_reduce(buffer, op=TORCH_OPS[op], group=group, async_op=True)
    basics.record_span("ALLREDUCE", name, started, time.perf_counter(), negotiated,
                       {"dtype": str(tensor.dtype), "shape": list(tensor.shape)})
    if pending_check is not None:
        work = _CheckedWork(work, pending_check)
    return buffer, work, postscale / world if op == Average else postscale


@dataclass
class _CheckedWork:
    """An allreduce's work whose negotiation is checked when it is waited for."""

    work: Any
    check: Callable[[], torch.Tensor]

    def wait(self) -> bool:
        self.check()
        return bool(self.work.wait())

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def _finish_allreduce(tensor: torch.Tensor, buffer: torch.Tensor, post: float, out: torch.Tensor | None
                      ) -> torch.Tensor:
    buffer = _wrap(buffer, tensor.dtype)
    _scale(buffer, post)
    if out is None:
        return buffer.to(tensor.dtype) if buffer.dtype != tensor.dtype else buffer
    with torch.no_grad():
        out.copy_(buffer.view_as(out))
    return out


def _allreduce_now(tensor: torch.Tensor, op: int, prescale: float, postscale: float, process_set: ProcessSet,
                   name: str) -> torch.Tensor:
    buffer, work, post = _start_allreduce(tensor, op, prescale, postscale, process_set, name)
    if work is not None:
        work.wait()
    return _finish_allreduce(tensor, buffer, post, None)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                process_set: ProcessSet, name: str) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set, name)
        return _allreduce_now(tensor, op, prescale, postscale, process_set, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, prescale, postscale, process_set, name = ctx.args
        return (_allreduce_now(grad.contiguous(), op, prescale, postscale, process_set, name + ".grad"),
                None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = None, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of `tensor` over the ranks of `process_set` (Average by default), out of place:
    `postscale * reduce(prescale * x_i)`. Differentiable: the gradient is the same allreduce of the gradient."""
    op = _resolve_op(op, average)
    full = _name("allreduce", name)
    if compression is not None:
        compressed, context = compression.compress(tensor)
        reduced = _AllreduceFn.apply(compressed, op, prescale_factor, postscale_factor, process_set, full)
        return compression.decompress(reduced, context)
    return _AllreduceFn.apply(tensor, op, prescale_factor, postscale_factor, process_set, full)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """`allreduce` in place; returns `tensor`."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an out-of-place allreduce; `synchronize(handle)` returns the result."""
    op = _resolve_op(op, average)
    full = _name("allreduce", name)
    buffer, work, post = _start_allreduce(tensor, op, prescale_factor, postscale_factor, process_set, full)
    return _submit(full, lambda: _finish_allreduce(tensor, buffer, post, None), work)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce; `synchronize(handle)` writes it into `tensor` and returns it."""
    op = _resolve_op(op, average)
    full = _name("allreduce", name)
    buffer, work, post = _start_allreduce(tensor, op, prescale_factor, postscale_factor, process_set, full)
    return _submit(full, lambda: _finish_allreduce(tensor, buffer, post, tensor), work)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = None, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set
                      ) -> list[torch.Tensor]:
    """`allreduce` of each tensor of the group (differentiable), results in order."""
    op = _resolve_op(op, average)
    base = name or f"noname.{_NEXT[0] + 1}"
    return [allreduce(t, name=f"{base}.{i}", compression=compression, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, process_set=process_set) for i, t in enumerate(tensors)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def _grouped_async(tensors: Sequence[torch.Tensor], op: int, name: str | None, prescale: float, postscale: float,
                   process_set: ProcessSet, in_place: bool) -> int:
    base = _name("allreduce", name)
    started = [(t, *_start_allreduce(t, op, prescale, postscale, process_set, f"{base}.{i}"))
               for i, t in enumerate(tensors)]
    works = [work for _, _, work, _ in started if work is not None]
    return _submit(base, lambda: [_finish_allreduce(t, b, p, t if in_place else None) for t, b, _, p in started],
                   works)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    return _grouped_async(tensors, _resolve_op(op, average), name, prescale_factor, postscale_factor, process_set,
                          False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    return _grouped_async(tensors, _resolve_op(op, average), name, prescale_factor, postscale_factor, process_set,
                          True)


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int = Average,
                           process_set: ProcessSet = global_process_set) -> SparseHandle:
    """A sparse gradient's reduction as Horovod does it: indices and values all-gathered asynchronously (values
    divided by the set's size for Average) into one sparse tensor, duplicates kept (coalesce to sum them).
    Returns a handle to call, or to pass to `synchronize`, for the result."""
    if op not in (Average, Sum):
        raise ValueError(f"sparse allreduce '{name}' supports hvd.Average and hvd.Sum, not "
                         f"{basics.OP_NAMES.get(op, op)}")
    indices = allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    values = allgather_async(tensor._values().contiguous(), name=f"{name}.values", process_set=process_set)
    return SparseHandle(indices, values, op, process_set.size(), tensor.shape)


# ------------------------------------------------------------------------------------------- allgather


def _start_allgather(tensor: torch.Tensor, process_set: ProcessSet, name: str
                     ) -> tuple[Any, Callable[[], tuple[torch.Tensor, list[int]]]]:
    """Negotiate and start the all-gather; returns (work, finish), finish giving (output, dim 0 of each rank)."""
    if tensor.dim() == 0:
        raise ValueError(f"allgather '{name}' needs a tensor of at least one dimension (it concatenates dim 0)")
    if tensor.dtype not in MOVABLE:
        raise ValueError(f"allgather '{name}': unsupported dtype {tensor.dtype}")
    group = _group_of(process_set)
    started = time.perf_counter()
    table = negotiate("ALLGATHER", name, tensor, group, ranks=process_set.ranks)
    negotiated = time.perf_counter()
    firsts = [int(row[6]) for row in table]
    largest = max(firsts)
    padded = torch.zeros((largest, *tensor.shape[1:]), dtype=MOVE_WIRE.get(tensor.dtype, tensor.dtype))
    padded[:tensor.shape[0]] = tensor.detach()
    pieces = [torch.empty_like(padded) for _ in firsts]
    work = dist.all_gather(pieces, padded, group=group, async_op=True)

    def finish() -> tuple[torch.Tensor, list[int]]:
        basics.record_span("ALLGATHER", name, started, time.perf_counter(), negotiated)
        return torch.cat([piece[:n] for piece, n in zip(pieces, firsts, strict=True)]).to(tensor.dtype), firsts

    return work, finish


def _allgather_now(tensor: torch.Tensor, process_set: ProcessSet, name: str) -> tuple[torch.Tensor, list[int]]:
    work, finish = _start_allgather(tensor, process_set, name)
    work.wait()
    return finish()


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, process_set: ProcessSet, name: str) -> torch.Tensor:
        gathered, firsts = _allgather_now(tensor, process_set, name)
        ctx.args = (process_set, name, firsts)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        process_set, name, firsts = ctx.args
        reduced = _allreduce_now(grad.contiguous(), Average, 1.0, 1.0, process_set, name + ".grad")
        me = process_set.rank()
        offset = sum(firsts[:me])
        return reduced.narrow(0, offset, firsts[me]), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
              ) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0, in rank order (dim 0 may differ per rank). Differentiable:
    the gradient is the Average-allreduce of the incoming gradient, this rank's rows."""
    return _AllgatherFn.apply(tensor, process_set, _name("allgather", name))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    full = _name("allgather", name)
    work, finish = _start_allgather(tensor, process_set, full)
    return _submit(full, lambda: finish()[0], work)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    base = name or f"noname.{_NEXT[0] + 1}"
    return [allgather(t, name=f"{base}.{i}", process_set=process_set) for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    base = _name("allgather", name)
    started = [_start_allgather(t, process_set, f"{base}.{i}") for i, t in enumerate(tensors)]
    return _submit(base, lambda: [finish()[0] for _, finish in started], [work for work, _ in started])


# ------------------------------------------------------------------------------------------- broadcast


def _start_broadcast(tensor: torch.Tensor, root_rank: int, process_set: ProcessSet, name: str,
                     out: torch.Tensor | None) -> tuple[Any, Callable[[], torch.Tensor]]:
    """Negotiate and start the broadcast; returns (work, finish), finish writing `out` (if given) and returning
    the result."""
    if tensor.dtype not in MOVABLE:
        raise ValueError(f"broadcast '{name}': unsupported dtype {tensor.dtype}")
    group = _group_of(process_set)
    members = process_set.ranks if process_set.ranks is not None else list(range(basics.size()))
    if root_rank not in members:
        raise ValueError(f"broadcast '{name}': root_rank {root_rank} is not in the process set (ranks {members}); "
                         "root_rank is a global rank")
    started = time.perf_counter()
    negotiate("BROADCAST", name, tensor, group, root=root_rank, ranks=process_set.ranks)
    negotiated = time.perf_counter()
    direct = out is not None and out.is_contiguous() and tensor.dtype not in MOVE_WIRE
    # direct is true only when out is a tensor
    buffer = out.detach() if direct else _to_wire(tensor)  # type: ignore[union-attr]
    work = dist.broadcast(buffer, src=root_rank, group=group, async_op=True)

    def finish() -> torch.Tensor:
        basics.record_span("BROADCAST", name, started, time.perf_counter(), negotiated)
        result = buffer.to(tensor.dtype)
        if out is None:
            return result
        if not direct:
            with torch.no_grad():
                out.copy_(result)
        return out

    return work, finish


def _broadcast_now(tensor: torch.Tensor, root_rank: int, process_set: ProcessSet, name: str,
                   out: torch.Tensor | None) -> torch.Tensor:
    work, finish = _start_broadcast(tensor, root_rank, process_set, name, out)
    work.wait()
    return finish()


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, process_set: ProcessSet, name: str
                ) -> torch.Tensor:
        ctx.args = (root_rank, process_set, name)
        return _broadcast_now(tensor, root_rank, process_set, name, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        root_rank, process_set, name = ctx.args
        reduced = _allreduce_now(grad.contiguous(), Average, 1.0, 1.0, process_set, name + ".grad")
        if basics.rank() != root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """`root_rank`'s tensor on every rank, out of place. Differentiable: the gradient is the Average-allreduce
    of the incoming gradient on the root, zero elsewhere."""
    return _BroadcastFn.apply(tensor, root_rank, process_set, _name("broadcast", name))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """`broadcast` in place; returns `tensor`."""
    return _broadcast_now(tensor, root_rank, process_set, _name("broadcast", name), tensor)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    full = _name("broadcast", name)
    work, finish = _start_broadcast(tensor, root_rank, process_set, full, None)
    return _submit(full, finish, work)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    full = _name("broadcast", name)
    work, finish = _start_broadcast(tensor, root_rank, process_set, full, tensor)
    return _submit(full, finish, work)


# ------------------------------------------------------------------------------------------- alltoall


def _split_problem(send: list[int], first: int, world: int, given: bool) -> str | None:
    """Why a rank's splits cannot be used (None when they can)."""
    if not given and first % world:
        return f"dim 0 ({first}) must divide evenly by the number of ranks ({world}) when no splits are given"
    if len(send) != world or any(s < 0 for s in send) or sum(send) != first:
        return f"splits {send} must give one non-negative count per rank ({world}) adding up to dim 0 ({first})"
    return None


def _start_alltoall(tensor: torch.Tensor, splits: Any, process_set: ProcessSet, name: str
                    ) -> tuple[Any, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """Negotiate, exchange the splits and start the all-to-all; returns (work, finish). Bad splits on any rank
    raise the same ValueError on every rank, after the exchange, so no rank is left waiting."""
    if tensor.dtype not in MOVABLE:
        raise ValueError(f"alltoall '{name}': unsupported dtype {tensor.dtype}")
    group = _group_of(process_set)
    world = process_set.size()
    if tensor.dim() == 0:
        raise ValueError(f"alltoall '{name}' needs a tensor of at least one dimension")
    if splits is None:
        send = [tensor.shape[0] // world] * world
    else:
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    started = time.perf_counter()
    negotiate("ALLTOALL", name, tensor, group, ranks=process_set.ranks)
    negotiated = time.perf_counter()
    problem = _split_problem(send, tensor.shape[0], world, splits is not None)
    row = torch.full((world + 1,), -1, dtype=torch.int64)
    if problem is None:
        row[:world] = torch.tensor(send, dtype=torch.int64)
        row[world] = 0
    columns = [torch.empty(world + 1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(columns, row, group=group)
    bad = [r for r, column in enumerate(columns) if int(column[world]) != 0]
    if bad:
        members = process_set.ranks if process_set.ranks is not None else list(range(world))
        raise ValueError(f"alltoall '{name}': rank(s) {[members[r] for r in bad]} gave unusable splits"
                         + (f" ({problem})" if problem else ""))
    matrix = torch.stack(columns)[:, :world]
    me = process_set.rank()
    received = [int(v) for v in matrix[:, me]]
    sent = _to_wire(tensor) if tensor.dtype in MOVE_WIRE else tensor.detach().contiguous()
    output = torch.empty((sum(received), *tensor.shape[1:]), dtype=sent.dtype)
    work = dist.all_to_all_single(output, sent, output_split_sizes=received, input_split_sizes=send, group=group,
                                  async_op=True)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        basics.record_span("ALLTOALL", name, started, time.perf_counter(), negotiated)
        return output.to(tensor.dtype), torch.tensor(received, dtype=torch.int32)

    return work, finish


def _alltoall_now(tensor: torch.Tensor, splits: Any, process_set: ProcessSet, name: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    work, finish = _start_alltoall(tensor, splits, process_set, name)
    work.wait()
    return finish()


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, process_set: ProcessSet, name: str) -> Any:
        output, received = _alltoall_now(tensor, splits, process_set, name)
        ctx.args = (received, process_set, name)
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        received, process_set, name = ctx.args
        back, _ = _alltoall_now(grad.contiguous(), received, process_set, name + ".grad")
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows of dim 0 to each rank (`splits` rows to rank i, or equal shares) and receive theirs, in rank
    order. Returns the output, and with `splits` also the received splits. Differentiable."""
    output, received = _AlltoallFn.apply(tensor, splits, process_set, _name("alltoall", name))
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    full = _name("alltoall", name)
    work, finish = _start_alltoall(tensor, splits, process_set, full)

    def result() -> Any:
        output, received = finish()
        return output if splits is None else (output, received)

    return _submit(full, result, work)


# ------------------------------------------------------------------------------------------- reducescatter


def _my_rows(first: int, world: int, me: int) -> tuple[int, int]:
    """(offset, count) of this rank's rows: ranks 0..first % world - 1 get one extra row."""
    base, extra = divmod(first, world)
    return me * base + min(me, extra), base + (1 if me < extra else 0)


def _start_reducescatter(tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                         process_set: ProcessSet, name: str) -> tuple[Any, Callable[[], torch.Tensor]]:
    """Negotiate and start the reduction; returns (work, finish), finish giving this rank's rows. Only Sum and
    Average: any other op raises RuntimeError, as Horovod's core answers it."""
    if op not in (Average, Sum):
        raise RuntimeError(f"reducescatter '{name}' supports hvd.Average and hvd.Sum, not "
                           f"{basics.OP_NAMES.get(op, op)}")
    if tensor.dim() == 0:
        raise RuntimeError(f"reducescatter '{name}' needs a tensor of at least one dimension (it splits dim 0)")
    group = _group_of(process_set)
    started = time.perf_counter()
    negotiate("REDUCESCATTER", name, tensor, group, op=op, ranks=process_set.ranks)
    if tensor.dtype not in REDUCIBLE:
        raise ValueError(f"reducescatter '{name}': dtype {tensor.dtype} is not reducible")
    buffer = _scaled_input(_work_tensor(tensor), tensor.dtype, prescale)
    work = dist.all_reduce(buffer, group=group, async_op=True)

    def finish() -> torch.Tensor:
        reduced = _wrap(buffer, tensor.dtype)
        _scale(reduced, postscale / process_set.size() if op == Average else postscale)
        offset, count = _my_rows(tensor.shape[0], process_set.size(), process_set.rank())
        basics.record_span("REDUCESCATTER", name, started, time.perf_counter())
        return reduced.narrow(0, offset, count).to(tensor.dtype).clone()

    return work, finish


def _reducescatter_now(tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                       process_set: ProcessSet, name: str) -> torch.Tensor:
    work, finish = _start_reducescatter(tensor, op, prescale, postscale, process_set, name)
    work.wait()
    return finish()


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                process_set: ProcessSet, name: str) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set, name)
        return _reducescatter_now(tensor, op, prescale, postscale, process_set, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, prescale, postscale, process_set, name = ctx.args
        gathered, _ = _allgather_now(grad.contiguous(), process_set, name + ".grad")
        factor = prescale * postscale * (process_set.size() if op == Sum else 1)
        return gathered * factor, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """The reduction over the set, of which this rank keeps its rows of dim 0 (ranks below dim0 % size get one
    extra). Differentiable as Horovod defines it: the allgather of the gradient, times size for Sum."""
    full = _name("reducescatter", name)
    if compression is not None:
        compressed, context = compression.compress(tensor)
        out = _ReducescatterFn.apply(compressed, op, prescale_factor, postscale_factor, process_set, full)
        return compression.decompress(out, context)
    return _ReducescatterFn.apply(tensor, op, prescale_factor, postscale_factor, process_set, full)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    full = _name("reducescatter", name)
    work, finish = _start_reducescatter(tensor, op, prescale_factor, postscale_factor, process_set, full)
    return _submit(full, finish, work)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression: Any = None,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    base = name or f"noname.{_NEXT[0] + 1}"
    return [reducescatter(t, f"{base}.{i}", compression, op, process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    base = _name("reducescatter", name)
    started = [_start_reducescatter(t, op, prescale_factor, postscale_factor, process_set, f"{base}.{i}")
               for i, t in enumerate(tensors)]
    return _submit(base, lambda: [finish() for _, finish in started], [work for work, _ in started])


# ------------------------------------------------------------------------------------------- barrier, join


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set gets here."""
    group = _group_of(process_set)
    negotiate("BARRIER", "barrier", None, group, ranks=process_set.ranks)
    dist.barrier(group=group)


def join(device: int = -1) -> int:
    """Declare that this rank has no more data. Until every rank has joined, this rank takes part in the
    others' allreduces with zeros (Average still divides by the full size) and barriers; returns the last rank
    to join, the same on every rank."""
    JOIN.joined = True
    my_cycle = JOIN.cycle
    try:
        while True:
            table = _exchange(_row("JOIN", None, root=my_cycle), None)
            kinds = [int(k) for k in table[:, 0]]
            if all(k == KINDS["JOIN"] for k in kinds):
                cycles = [int(c) for c in table[:, 4]]
                latest = max(cycles)
                return max(r for r, c in enumerate(cycles) if c == latest)
            live = table[next(i for i, k in enumerate(kinds) if k != KINDS["JOIN"])]
            kind = KIND_NAMES[int(live[0])]
            if kind == "ALLREDUCE":
                dims = [int(d) for d in live[6:6 + min(int(live[2]), MAX_DIMS)]]
                dtype = DTYPES[int(live[1])]
                work_dtype = REDUCE_WIRE.get(dtype, dtype)
                op = int(live[3])
                zeros = torch.zeros(dims, dtype=work_dtype)
                if op == Adasum:
                    from dtrain.comm.adasum import adasum_all_reduce_

                    adasum_all_reduce_(zeros.view(-1))
                else:
                    dist.all_reduce(zeros, op=TORCH_OPS.get(op, dist.ReduceOp.SUM))
            elif kind == "BARRIER":
                dist.barrier()
            # any other op: the live ranks raise after the same negotiation; nothing to take part in
    finally:
        JOIN.joined = False

