"""Getting every rank to the same start: `broadcast_parameters`, `broadcast_optimizer_state`, and Python
objects (`broadcast_object`, `allgather_object`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics, ops
from dtrain.horovod.basics import ProcessSet, global_process_set


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite tensors in place with `root_rank`'s: a dict (a `state_dict()`, broadcast in sorted key order),
    a list of tensors, or a list of (name, tensor) pairs (`model.named_parameters()`)."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list | tuple) or isinstance(params, Iterable):
        listed = list(params)
        if all(isinstance(p, tuple) and len(p) == 2 for p in listed):
            items = listed
        elif all(isinstance(p, torch.Tensor) for p in listed):
            items = [(f"param.{i}", p) for i, p in enumerate(listed)]
        else:
            raise ValueError("broadcast_parameters takes a dict, a list of tensors or a list of (name, tensor) pairs")
    else:
        raise ValueError(f"broadcast_parameters takes a dict or a list, got {type(params).__name__}")
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            continue
        target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        ops.broadcast_(target, root_rank, name=f"parameter.{name}")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Give every rank `root_rank`'s optimizer state and hyperparameters (lr, momentum, betas, ...). An optimizer
    with no state yet first takes one step with zero gradients so that its state exists on every rank (as
    Horovod does: Adam's step count becomes 1, SGD with weight decay moves the weights once; the zero gradients
    stay, parameters without `requires_grad` keep none). The zero gradient is sparse for `SparseAdam` and for the
    weights of `model`'s sparse embeddings."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        sparse = {id(module.weight) for module in (model.modules() if model is not None else [])
                  if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag) and module.sparse}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        base_step = getattr(optimizer, "_base_step", None)
        (base_step or optimizer.step)()
    state = broadcast_object(optimizer.state_dict() if basics.rank() == root_rank else None, root_rank,
                             name="optimizer_state")
    if basics.rank() != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """`root_rank`'s Python object (pickled) on every rank of the set; the root gets its own object back."""
    group = ops._group_of(process_set)
    holder = [obj]
    dist.broadcast_object_list(holder, src=root_rank, group=group)
    return obj if basics.rank() == root_rank else holder[0]


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
                     ) -> list[Any]:
    """Every rank's Python object, in rank order."""
    group = ops._group_of(process_set)
    gathered: list[Any] = [None] * process_set.size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
