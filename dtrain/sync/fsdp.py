"""Fully sharded data parallelism with torch's FSDP2 (`fully_shard`): each rank keeps 1/N of every parameter,
gradient and optimizer state (ZeRO stage 3). Forward and backward all-gather a block's parameters just before
it runs and free them after (`reshard_after_forward`); backward reduce-scatters each block's gradients, so
each rank receives the average of its shard only.

Averaging: FSDP2 divides the reduce-scattered sum by the world size itself. On gloo, which has no native
average, torch 2.8 summed instead (pytorch/pytorch#162338: gradients came out x world size);
tests/distributed/test_sharded.py checks the result against single-process training, so that trap fails a test.

Whole-tensor optimizers: parameters are DTensors, and LARS's and LAMB's `torch.linalg.vector_norm(param)` on a
sharded DTensor is a sum of the shards' partial norms all-reduced by DTensor: the trust ratio is the whole
tensor's, on every rank alike (checked by the LARS case of the equivalence test).

Construction without a whole model per rank (ShardedConstruction): the Trial's `build_model()` runs on the meta
device on every rank but rank 0, every rank shards its (meta) model, allocates only its own shards (`to_empty`),
and the shards are filled from rank 0's model, one tensor at a time (`set_model_state_dict` with
`broadcast_from_rank0`); rank 0 then drops its whole copy. The run therefore starts from exactly the weights a
non-sharded run with the same seed starts from, rank 0 holds the whole parameters only while the shards are filled,
and the other ranks never hold more than their shards plus one whole tensor.

Validation runs on the sharded model (every rank the same number of forward passes: CollectiveForward); the
replica check gathers one whole parameter at a time. Checkpoints are written by every rank, its own shards of the
parameters and optimizer state, through torch.distributed.checkpoint (WritesShardedCheckpoint): no rank gathers
the model for them. `dtrain export` turns such a checkpoint into a plain `model.pt`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import chain
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import all_gather_single, broadcast, reduce_scatter_single
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from dtrain.comm import Topology, device_mesh
from dtrain.config import ExperimentConfig
from dtrain.runs.storage import ShardFolder
from dtrain.sync.base import StrategyBase
from dtrain.sync.spec import StrategySpec

FULL = StateDictOptions(full_state_dict=True)
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded on their own (each gathered just before it runs): the root's children that hold
    parameters, and the items of the root's ModuleLists and Sequentials (a transformer's layers)."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units.extend(item for item in child.children() if any(True for _ in item.parameters()))
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


class FsdpStrategy(StrategyBase):
    """FSDP2 over all workers: the core protocol plus ShardedConstruction, CollectiveForward, OwnsCheckpointState
    and WritesShardedCheckpoint."""

    name = "fsdp"
    collective_forward = True

    def __init__(self, topology: Topology, *, reshard_after_forward: bool = True) -> None:
        self.topology = topology
        self.reshard_after_forward = reshard_after_forward
        self._sharded: nn.Module | None = None
        self._record: Callable[[str, float], None] | None = None

    def shard_mesh(self) -> DeviceMesh:
        """The device mesh the parameters are sharded over (built once, in `wrap_model`): every worker in one
        dimension. A 2-D mesh (replicate, shard) makes `fully_shard` hybrid: sharded along the second dimension,
        replicated along the first (HSDP)."""
        return device_mesh(self.topology, (self.topology.world_size,), ("data",))

    # ------------------------------------------------------------------------------- core protocol

    def model_construction(self) -> AbstractContextManager[Any]:
        """Rank 0 builds the real model (its weights are the run's initial weights); the others build it on the
        meta device, which allocates nothing."""
        return nullcontext() if self.topology.rank == 0 else torch.device("meta")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Shard `model` in place: its parameters become DTensor shards, which the optimizer is built over. A model
        built whole (rank 0, or every rank when built outside `model_construction`) gives its weights to the
        shards; the other ranks' meta models receive rank 0's."""
        source = self.topology.rank == 0
        whole = _materialized(model)
        full = model.state_dict() if source else {}  # references, no copies
        transient = {name: buffer for name, buffer in _non_persistent_buffers(model)} if source else {}
        if whole:
            model.to(device="meta")  # the whole tensors live on only in `full` (rank 0) until the shards are filled
        mesh = self.shard_mesh()
        for unit in sharding_units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        if self._record is not None:  # the phase timers are on: time every all-gather and reduce-scatter
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    # duck-typed: FSDP2's AllGather/ReduceScatter base classes live in a private module
                    module.set_custom_all_gather(TimedAllGather(self._record))  # type: ignore[arg-type]
                    module.set_custom_reduce_scatter(TimedReduceScatter(self._record))  # type: ignore[arg-type]
        model.to_empty(device=self.topology.device)  # this rank's shards only
        set_model_state_dict(model, full, options=BROADCAST_FROM_RANK0)
        _broadcast_buffers(model, transient, self.topology.device)
        del full, transient
        self._sharded = model
        return model

    def unwrap_model(self) -> nn.Module:
        """The sharded model itself (no whole copy is kept): validation runs forward on it on every rank together;
        `get_model_state_dict(..., full_state_dict=True)` or `dtrain export` gathers whole weights on demand."""
        return self._root()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the next communicating backward reduce-scatters their sum."""
        module = self._fsdp_root()
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "reshard_after_forward": self.reshard_after_forward,
                "shards": self.topology.world_size}

    def close(self) -> None:
        """Nothing to release: the sharded model stays readable after the run (the process group outlives it)."""

    # ---------------------------------------------------------------------------------- extensions

    def observe_waits(self, record: Callable[[str, float], None] | None) -> None:
        """Report each all-gather and reduce-scatter's wall time (set before `wrap_model`)."""
        self._record = record

    def model_state_dict(self) -> dict[str, Any]:
        """The whole weights gathered on rank 0 (on the CPU, one tensor at a time); the other ranks get {}."""
        return get_model_state_dict(self._root(), options=FULL_ON_RANK0)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Each rank keeps its shard of the full state rank 0 read."""
        set_model_state_dict(self._root(), state, options=FULL)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter names, gathered on rank 0 (the others get an empty dict)."""
        return get_optimizer_state_dict(self._root(), optimizer, options=FULL_ON_RANK0)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self._root(), optimizer, state, options=FULL)

    def save_sharded(self, folder: ShardFolder, optimizer: torch.optim.Optimizer) -> None:
        """Each rank writes its DTensor shards of the parameters and of the optimizer state (DCP)."""
        root = self._root()
        dcp.save({"model": get_model_state_dict(root), "optim": get_optimizer_state_dict(root, optimizer)},
                 storage_writer=folder.writer())

    def load_sharded(self, folder: ShardFolder, optimizer: torch.optim.Optimizer) -> None:
        """Each rank reads its own shards back (DCP re-shards when the number of ranks changed)."""
        root = self._root()
        model_state, optimizer_state = get_model_state_dict(root), get_optimizer_state_dict(root, optimizer)
        dcp.load({"model": model_state, "optim": optimizer_state}, storage_reader=folder.reader())  # in place
        set_model_state_dict(root, model_state)
        set_optimizer_state_dict(root, optimizer, optimizer_state)

    # ------------------------------------------------------------------------------------- internals

    def _root(self) -> nn.Module:
        assert self._sharded is not None, "wrap_model() first"
        return self._sharded

    def _fsdp_root(self) -> FSDPModule:
        root = self._root()
        assert isinstance(root, FSDPModule)
        return root


class TimedAllGather:
    """FSDP2's all-gather (`dist.all_gather_single`, as its default; `all_gather_into_tensor`, which torch 2.13
    deprecates with a FutureWarning at every call, is not used) with its wall time reported as phase `all_gather`.
    FSDP2 calls it synchronously on the CPU (no separate stream), so the call's time is the wait."""

    def __init__(self, record: Callable[[str, float], None]) -> None:
        self.record = record

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        started = time.perf_counter()
        work = all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        self.record("all_gather", time.perf_counter() - started)
        return work


class TimedReduceScatter:
    """FSDP2's reduce-scatter (`dist.reduce_scatter_single`, as its default) with its wall time reported as phase
    `reduce_scatter` (FSDP2 calls it synchronously)."""

    def __init__(self, record: Callable[[str, float], None]) -> None:
        self.record = record

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        started = time.perf_counter()
        work = reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.record("reduce_scatter", time.perf_counter() - started)
        return work


def _materialized(model: nn.Module) -> bool:
    return not any(tensor.is_meta for tensor in chain(model.parameters(), model.buffers()))


def _non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers a state_dict leaves out (caches such as rotary tables): `to_empty` erases them, so they are
    broadcast from rank 0 beside the state_dict."""
    saved = set(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers():
        if name not in saved:
            yield name, buffer


def _broadcast_buffers(model: nn.Module, source: dict[str, torch.Tensor], device: torch.device) -> None:
    """Fill the non-persistent buffers of every rank's model with rank 0's (`source`, empty on the others)."""
    for name, buffer in _non_persistent_buffers(model):
        if name in source:
            buffer.copy_(source[name])
        broadcast(buffer, src=0)


def build_fsdp(config: ExperimentConfig, topology: Topology) -> FsdpStrategy:
    return FsdpStrategy(topology, reshard_after_forward=config.distributed.fsdp.reshard_after_forward)


def fsdp_summary(described: Mapping[str, Any]) -> str:
    return (f"{described.get('name')}, {described.get('shards')} shards, reshard_after_forward "
            f"{described.get('reshard_after_forward')}")


SPEC = StrategySpec("fsdp", build_fsdp, summary=fsdp_summary)
