"""Horovod's collectives on torch.distributed: allreduce, allgather, broadcast, alltoall, reducescatter (plain,
in place, async, grouped), join, barrier, poll and synchronize, each differentiable as Horovod defines it.

Every collective is posted to this rank's background negotiation (`negotiation.py`), which matches it by name
and process set with the other ranks' posts, whatever order they come in, and runs it on its own process groups
once every member has posted it: ranks may post in different orders, a joined rank contributes zeros to the
others' allreduces, mismatched shapes or dtypes under one name raise RuntimeError on every rank that posted it,
and a name still pending on a rank raises ValueError there only. Blocking calls post and wait; `*_async` calls
return a handle at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import backends, basics
from dtrain.horovod.backends import MOVE_WIRE
from dtrain.horovod.basics import (
    Adasum,
    Average,
    ProcessSet,
    Sum,
    global_process_set,
)
from dtrain.horovod.negotiation import (
    COORDINATOR,
    DIMS,
    ROW,
    Entry,
    Ready,
    Started,
    describe,
    fusion_key,
    metadata_row,
    rows_differ,
)

REDUCIBLE = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
             torch.float32, torch.float64}
MOVABLE = REDUCIBLE | {torch.bool}
# What a backend cannot carry travels as a wider type and is narrowed back, exactly (backends.py): int16 moves as
# int32 (every value fits) and is reduced in int64 then wrapped to 16 bits, as a sum in int16 would wrap; on gloo
# fp16 and bf16 are reduced in fp32 (as Horovod does on CPU), on NCCL in their own type (as Horovod's NCCL path).
# Every buffer stays on its tensor's device: CUDA tensors reach NCCL where it carries them, never through the host.


# ------------------------------------------------------------------------------------------- posting


def _group_of(process_set: ProcessSet) -> Any:
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered (hvd.add_process_set) or was removed")
    if not process_set.included():
        raise ValueError(f"rank {basics.rank()} is not in process set {process_set.process_set_id} "
                         f"(ranks {process_set.ranks}): only its members may call collectives on it")
    return process_set.group


def _members(process_set: ProcessSet) -> list[int]:
    return list(process_set.ranks) if process_set.ranks is not None else list(range(basics.size()))


def _post(kind: str, name: str, process_set: ProcessSet, tensor: torch.Tensor | None,
          execute: Callable[[Ready], Any], op: int = 0, root: int = -1, buffer: torch.Tensor | None = None
          ) -> Entry:
    """Post one collective to the negotiation; `execute(ready)` runs on its thread when every member posted."""
    _group_of(process_set)
    coordinator = COORDINATOR[0]
    if coordinator is None:
        raise ValueError(basics.NOT_INITIALIZED)
    set_id = process_set.process_set_id
    assert set_id is not None
    entry = Entry(kind, name, set_id, _members(process_set), metadata_row(kind, tensor, op, root, set_id), execute,
                  fusion=fusion_key(set_id, buffer.dtype, op, buffer.device) if buffer is not None else None,
                  buffer=buffer)
    return coordinator.post(entry)


def _data_group(process_set: ProcessSet) -> Any:
    coordinator = COORDINATOR[0]
    assert coordinator is not None and process_set.process_set_id is not None
    return coordinator.data_group(process_set.process_set_id)


def _firsts(ready: Ready) -> list[int]:
    return [int(ready.rows[r][DIMS]) for r in ready.members]


# ------------------------------------------------------------------------------------------- order-matched check
# DistributedOptimizer's dtrain-compressor path runs its rounds on the process set's own group from the main
# thread; it is matched by call order with this all-gathered check, as before the negotiation by name.


def _exchange(row: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    rows = [torch.empty(ROW, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows)


def negotiate(kind: str, name: str, tensor: torch.Tensor | None, group: Any, op: int = 0, root: int = -1,
              ranks: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather this rank's row on `group` and check the table (matched by call order); returns it. Raises
    RuntimeError, the same on every rank, when the ranks disagree."""
    table = _exchange(metadata_row(kind, tensor, op, root), group)
    members = list(ranks) if ranks is not None else list(range(table.shape[0]))
    reference = table[0]
    for i in range(1, table.shape[0]):
        row = table[i]
        if rows_differ(kind, row, reference):
            raise RuntimeError(f"Mismatched {kind.lower()} '{name}': rank {members[0]} submitted "
                               f"{describe(reference)} but rank {members[i]} submitted {describe(row)}; every "
                               "rank must call the same collectives with the same dtypes and shapes")
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
    """Drop every async op not yet synchronized and this rank's negotiation (elastic: the process group they ran
    on is gone; `init` starts a new negotiation, with an empty cache, for the new membership)."""
    _HANDLES.clear()
    coordinator, COORDINATOR[0] = COORDINATOR[0], None
    if coordinator is not None:
        coordinator.abandon()


class _PendingOps(basics.JobListener):
    """Forgets the pending operations when an elastic job re-forms (`basics.reform`)."""

    def reset(self) -> None:
        forget_pending()


basics.LISTENERS.append(_PendingOps())


def _submit(name: str, finish: Callable[[], Any], work: Any = None) -> int:
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
    """The buffer the reduction runs in: a contiguous copy, on the tensor's device, in the type its backend reduces
    it in (`backends.reduce_wire`)."""
    wire = backends.reduce_wire(tensor.dtype, tensor.device, basics.STATE.backends)
    if wire != tensor.dtype:
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
                     name: str, lengths: Sequence[int] | None = None) -> tuple[torch.Tensor, Entry, float]:
    """Post the reduction; returns (buffer, the posted entry to wait on, postscale still to apply). Adasum combines
    the pieces of `lengths` (default: the whole tensor) separately."""
    if tensor.dtype not in REDUCIBLE:
        raise ValueError(f"allreduce '{name}': dtype {tensor.dtype} is not reducible; use uint8, int8, int16, int32, "
                         "int64, float16, bfloat16, float32 or float64")
    if op not in basics.OP_NAMES:
        raise ValueError(f"allreduce '{name}': unknown op {op}; use hvd.Average, Sum, Adasum, Min, Max or Product")
    buffer = _scaled_input(_work_tensor(tensor), tensor.dtype, prescale)
    world = process_set.size()
    if op == Adasum:
        if not buffer.is_floating_point():
            raise ValueError(f"allreduce '{name}': Adasum needs a floating-point tensor, got {tensor.dtype}")

        def adasum(ready: Ready) -> torch.Tensor:
            from dtrain.comm.adasum import adasum_all_reduce_

            return adasum_all_reduce_(buffer.view(-1), lengths, group=_data_group(process_set))

        return buffer, _post("ALLREDUCE", name, process_set, tensor, adasum, op=op), postscale
    entry = _post("ALLREDUCE", name, process_set, tensor, _fused_only, op=op, buffer=buffer)
    return buffer, entry, postscale / world if op == Average else postscale


def _fused_only(ready: Ready) -> None:
    raise AssertionError("a fusable allreduce is run by the negotiation's fused path")


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
                     ) -> tuple[Entry, Callable[[], tuple[torch.Tensor, list[int]]]]:
    """Post the all-gather; returns (entry, finish), finish giving (output, dim 0 of each rank)."""
    if tensor.dim() == 0:
        raise ValueError(f"allgather '{name}' needs a tensor of at least one dimension (it concatenates dim 0)")
    if tensor.dtype not in MOVABLE:
        raise ValueError(f"allgather '{name}': unsupported dtype {tensor.dtype}")
    source = tensor.detach()

    def gather(ready: Ready) -> tuple[torch.Tensor, list[int]]:
        firsts = _firsts(ready)
        padded = torch.zeros((max(firsts), *source.shape[1:]), dtype=MOVE_WIRE.get(source.dtype, source.dtype),
                             device=source.device)
        padded[:source.shape[0]] = source
        pieces = [torch.empty_like(padded) for _ in firsts]
        dist.all_gather(pieces, padded, group=_data_group(process_set))
        gathered = torch.cat([piece[:n] for piece, n in zip(pieces, firsts, strict=True)]).to(source.dtype)
        return gathered, firsts

    entry = _post("ALLGATHER", name, process_set, tensor, gather)
    return entry, lambda: entry.wait()


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
                     out: torch.Tensor | None) -> tuple[Entry, Callable[[], torch.Tensor]]:
    """Post the broadcast; returns (entry, finish), finish writing `out` (if given) and returning the result."""
    if tensor.dtype not in MOVABLE:
        raise ValueError(f"broadcast '{name}': unsupported dtype {tensor.dtype}")
    members = _members(process_set)
    if root_rank not in members:
        raise ValueError(f"broadcast '{name}': root_rank {root_rank} is not in the process set (ranks {members}); "
                         "root_rank is a global rank")
    buffer = _to_wire(tensor)

    def send(ready: Ready) -> torch.Tensor:
        dist.broadcast(buffer, src=root_rank, group=_data_group(process_set))
        return buffer

    entry = _post("BROADCAST", name, process_set, tensor, send, root=root_rank)

    def finish() -> torch.Tensor:
        result = entry.wait().to(tensor.dtype)
        if out is None:
            return result
        with torch.no_grad():
            out.copy_(result)
        return out

    return entry, finish


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
                    ) -> tuple[Entry, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """Post the all-to-all; returns (entry, finish). When it runs, the ranks exchange their splits first: bad
    splits on any rank raise the same ValueError on every rank, so no rank is left waiting."""
    if tensor.dtype not in MOVABLE:
        raise ValueError(f"alltoall '{name}': unsupported dtype {tensor.dtype}")
    _group_of(process_set)
    world = process_set.size()
    if tensor.dim() == 0:
        raise ValueError(f"alltoall '{name}' needs a tensor of at least one dimension")
    if splits is None:
        send = [tensor.shape[0] // world] * world
    else:
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    problem = _split_problem(send, tensor.shape[0], world, splits is not None)
    sent = _to_wire(tensor)
    me = process_set.rank()

    def exchange(ready: Ready) -> tuple[torch.Tensor, torch.Tensor]:
        group = _data_group(process_set)
        row = torch.full((world + 1,), -1, dtype=torch.int64)
        if problem is None:
            row[:world] = torch.tensor(send, dtype=torch.int64)
            row[world] = 0
        columns = [torch.empty(world + 1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(columns, row, group=group)
        bad = [r for r, column in enumerate(columns) if int(column[world]) != 0]
        if bad:
            raise ValueError(f"alltoall '{name}': rank(s) {[ready.members[r] for r in bad]} gave unusable splits"
                             + (f" ({problem})" if problem else ""))
        received = [int(column[me]) for column in columns]
        output = torch.empty((sum(received), *sent.shape[1:]), dtype=sent.dtype, device=sent.device)
        dist.all_to_all_single(output, sent, output_split_sizes=received, input_split_sizes=send, group=group)
        return output.to(tensor.dtype), torch.tensor(received, dtype=torch.int32)

    entry = _post("ALLTOALL", name, process_set, tensor, exchange)
    return entry, lambda: entry.wait()


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
                         process_set: ProcessSet, name: str) -> tuple[Entry, Callable[[], torch.Tensor]]:
    """Post the reduction; returns (entry, finish), finish giving this rank's rows. Only Sum and Average: any
    other op raises RuntimeError, as Horovod's core answers it."""
    if op not in (Average, Sum):
        raise RuntimeError(f"reducescatter '{name}' supports hvd.Average and hvd.Sum, not "
                           f"{basics.OP_NAMES.get(op, op)}")
    if tensor.dim() == 0:
        raise RuntimeError(f"reducescatter '{name}' needs a tensor of at least one dimension (it splits dim 0)")
    if tensor.dtype not in REDUCIBLE:
        raise ValueError(f"reducescatter '{name}': dtype {tensor.dtype} is not reducible")
    buffer = _scaled_input(_work_tensor(tensor), tensor.dtype, prescale)
    offset, count = _my_rows(tensor.shape[0], process_set.size(), process_set.rank())

    def reduce(ready: Ready) -> Started:  # started, not waited for: poll asks the transfer
        return Started(dist.all_reduce(buffer, group=_data_group(process_set), async_op=True), buffer)

    entry = _post("REDUCESCATTER", name, process_set, tensor, reduce, op=op)

    def finish() -> torch.Tensor:
        reduced = _wrap(entry.wait(), tensor.dtype)
        _scale(reduced, postscale / process_set.size() if op == Average else postscale)
        return reduced.narrow(0, offset, count).to(tensor.dtype).clone()

    return entry, finish


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
    """Wait until every rank of the set gets here (other named operations may stay pending across it)."""
    _post("BARRIER", "barrier", process_set, None, lambda ready: None).wait()


def join(device: int = -1) -> int:
    """Declare that this rank has no more data. Until every rank has joined, this rank takes part in the
    others' allreduces with zeros (Average still divides by the full size) and barriers; returns the last rank
    to join, the same on every rank."""
    coordinator = COORDINATOR[0]
    if coordinator is None:
        raise ValueError(basics.NOT_INITIALIZED)

    def last(ready: Ready) -> int:
        rank = coordinator.last_joined()
        coordinator.joined_done()
        return rank

    return int(_post("JOIN", "join", global_process_set, None, last).wait())
