"""A pipeline stage's own state, without any rank holding the whole model: built from rank 0's weights on ranks that
built the model on the meta device (`distribute_stages`), and written to and read from a distributed checkpoint
under the whole model's names (`save_stage`, `load_stage`).

Construction: rank 0 builds the model (the run's initial weights); every other rank builds it on the meta device.
Each of those allocates its own stage's tensors with rank 0's strides (so a `channels_last` model keeps its layout)
and receives them from rank 0 point to point, one tensor at a time; the other stages' tensors get their shapes but
no storage. New parameter objects replace the meta ones before the optimizer exists (`.data` cannot move a meta
tensor to a device), tied tensors stay tied, and a tensor that no stage holds goes to every rank.

Checkpoints: every rank offers its stage's parameters, buffers and optimizer state to torch.distributed.checkpoint
in the layout of torch's `get_model_state_dict` / `get_optimizer_state_dict` (`model.NAME`, `optim.state.NAME.KEY`,
`optim.param_groups` with parameter names), which writes each tensor once from one of the replicas holding it;
`dtrain export` joins the stages into a plain state_dict. Reading takes the names, shapes and dtypes of this stage's
optimizer state from the checkpoint's metadata (so stages cut elsewhere load too) and never reads other stages.
torch's `get_optimizer_state_dict` is not used for that template: on a fresh optimizer it runs a zero-gradient step
over every parameter, which would touch the other stages' tensors that hold no storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtrain.comm import Topology, all_gather_object, broadcast_object
from dtrain.errors import CheckpointError, TrialError
from dtrain.runs.storage import ShardFolder

StagedTensors = list[tuple[torch.Tensor, frozenset[int]]]


def distribute_stages(model: nn.Module, parts: Sequence[nn.Module], stage_index: int,
                      topology: Topology) -> dict[int, int]:
    """Give ranks that built `model` on the meta device real tensors, their own stage's received from rank 0 (rank
    d*p + s runs stage s of p = len(parts)). Returns id(tensor) -> the bytes of storage it lacks, for the other
    stages' tensors created without storage. Nothing happens (and {} is returned) when every rank built it whole."""
    tensors = tensors_and_stages(model, parts)
    built_on_meta = any(tensor.is_meta for tensor, _ in tensors)
    meta_ranks = [rank for rank, flag in enumerate(all_gather_object(built_on_meta)) if flag]
    if not meta_ranks:
        return {}
    if 0 in meta_ranks:
        raise TrialError("rank 0 built the model on the meta device; build_model() must create real tensors "
                         "(dtrain runs it on the meta device on the other ranks itself)")
    strides = broadcast_object([tensor.stride() for tensor, _ in tensors] if topology.rank == 0 else None)
    received, released = (materialize_stage(model, tensors, strides, stage_index, topology.device) if built_on_meta
                          else ({}, {}))
    with torch.no_grad():
        for tensor, stages in tensors:
            needing = [rank for rank in meta_ranks if rank % len(parts) in stages]
            if topology.rank == 0:
                payload = tensor.detach().contiguous()
                for rank in needing:
                    dist.send(payload, rank)
            elif topology.rank in needing:
                target = received[id(tensor)].detach()
                if target.is_contiguous():
                    dist.recv(target, 0)
                else:  # another memory format (channels_last): received row-major, then laid out
                    buffer = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                    dist.recv(buffer, 0)
                    target.copy_(buffer)
    return released


def tensors_and_stages(model: nn.Module, parts: Sequence[nn.Module]) -> StagedTensors:
    """Every parameter and buffer of the model once, in model order, with the stages that use it (all stages for a
    tensor that no stage holds)."""
    stages_of: dict[int, set[int]] = {}
    for index, part in enumerate(parts):
        for tensor in [*part.parameters(), *part.buffers()]:
            stages_of.setdefault(id(tensor), set()).add(index)
    everyone = frozenset(range(len(parts)))
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return [(tensor, frozenset(stages_of.get(key, everyone))) for key, tensor in unique.items()]


def materialize_stage(model: nn.Module, tensors: StagedTensors, strides: Sequence[tuple[int, ...]],
                      stage_index: int, device: torch.device) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
    """Replace the meta model's tensors by real ones on `device` (before the optimizer exists, so new parameter
    objects are safe): this stage's with storage, the others' with none. Returns id(meta tensor) -> its replacement
    for the ones to receive, and id(replacement) -> the bytes of storage it lacks for the others."""
    replacement: dict[int, torch.Tensor] = {}
    received: dict[int, torch.Tensor] = {}
    released: dict[int, int] = {}
    for (meta, stages), stride in zip(tensors, strides, strict=True):
        real = torch.empty_strided(meta.shape, stride, dtype=meta.dtype, device=device)
        if isinstance(meta, nn.Parameter):
            real = nn.Parameter(real, requires_grad=meta.requires_grad)
            real.__dict__.update(meta.__dict__)  # attributes a Trial set on its parameters
        if stage_index in stages:
            received[id(meta)] = real
        else:
            released[id(real)] = real.untyped_storage().nbytes()
            real.untyped_storage().resize_(0)
        replacement[id(meta)] = real
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for name, tensor in list(registry.items()):
                if tensor is not None and id(tensor) in replacement:
                    # the registry may be module._buffers, whose values are plain tensors
                    registry[name] = replacement[id(tensor)]  # type: ignore[assignment]
    return received, released


def save_stage(folder: ShardFolder, model: nn.Module, part: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write `part`'s parameters, buffers and optimizer state under `model`'s names (every rank together)."""
    names = parameter_names(model)
    state = {names[id(p)]: dict(optimizer.state[p]) for p in part.parameters() if p in optimizer.state}
    groups = [{**{key: value for key, value in group.items() if key != "params"},
               "params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    dcp.save({"model": _own_state(model, part), "optim": {"state": state, "param_groups": groups}},
             storage_writer=folder.writer())


def load_stage(folder: ShardFolder, model: nn.Module, part: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read `part`'s parameters and buffers in place and its optimizer state from `directory` (every rank
    together); the other stages' entries are not read."""
    reader = folder.reader()
    metadata = reader.read_metadata()
    names = parameter_names(model)
    own_names = {names[id(p)] for p in part.parameters()}
    wanted: dict[str, Any] = {"model": _own_state(model, part)}
    for key, stored in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if path[0] == "optim" and (path[1] == "param_groups" or (path[1] == "state" and path[2] in own_names)):
            # a tensor is allocated here, on the CPU (the optimizer's load_state_dict moves each value to its
            # parameter's device, and keeps a `step` on the CPU); another value is read back whole
            place(wanted, path, torch.empty(stored.size, dtype=stored.properties.dtype)
                  if isinstance(stored, TensorStorageMetadata) else None)
    dcp.load(wanted, storage_reader=reader)  # tensors in place, other values replaced
    state = wanted["optim"].get("state", {})
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    index_of = {names[id(p)]: index for index, p in enumerate(ordered)}
    try:
        groups = [{**group, "params": [index_of[name] for name in group["params"]]}
                  for group in wanted["optim"]["param_groups"]]
    except KeyError as missing:
        raise CheckpointError(f"the checkpoint in {folder} holds optimizer state for parameter {missing}, which "
                              "this model does not have; resume with the model it was written for") from None
    optimizer.load_state_dict({"state": {index_of[name]: values for name, values in state.items()},
                               "param_groups": groups})


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the whole model (the first name of a tied parameter)."""
    return {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def place(root: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    """Put `value` at `path` in a nest of dicts (string keys) and lists (integer keys), creating what is missing:
    the shape torch.distributed.checkpoint flattened a state dict from."""
    node: Any = root
    for key, following in zip(path[:-1], path[1:], strict=True):
        if isinstance(node, list):
            node.extend([None] * (int(key) + 1 - len(node)))
            if node[int(key)] is None:
                node[int(key)] = [] if isinstance(following, int) else {}
            node = node[int(key)]
        else:
            node = node.setdefault(key, [] if isinstance(following, int) else {})
    if isinstance(node, list):
        node.extend([None] * (int(path[-1]) + 1 - len(node)))
        node[int(path[-1])] = value
    else:
        node[path[-1]] = value


def _own_state(model: nn.Module, part: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state_dict entries that belong to `part` (the tensors themselves, detached: loads go in place)."""
    own = {id(tensor) for tensor in [*part.parameters(), *part.buffers()]}
    return {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) in own}
