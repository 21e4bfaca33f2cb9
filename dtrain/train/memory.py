"""Activation checkpointing by block type: the blocks the config names keep only their inputs in forward and
recompute their activations in backward (torch.utils.checkpoint), trading compute for activation memory."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from dtrain.errors import ConfigError


def apply_activation_checkpointing(model: nn.Module, block_types: Sequence[str]) -> list[str]:
    """Make every module whose class name is in `block_types` recompute its activations in backward; return the
    names of the modules it changed. A named type the model does not contain is a ConfigError (a typo would
    otherwise silently keep all activations)."""
    if not block_types:
        return []
    wanted = set(block_types)
    changed: list[str] = []
    found: set[str] = set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in wanted:
            found.add(kind)
            module.forward = functools.partial(_checkpointed, module.forward)
            changed.append(name or "<root>")
    missing = sorted(wanted - found)
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"optimizations.activation_checkpointing names {', '.join(missing)}, which the model does "
                          f"not contain; its block types are {', '.join(present)}")
    return changed


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
