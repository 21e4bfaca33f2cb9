"""The `determined` package dtrain puts on the path when the real one is not installed: Determined's training
APIs (`determined.pytorch`, `determined.core`, `get_cluster_info`, `InvalidHP`, `LOG_FORMAT`) on dtrain.
See docs/determined.md."""

from __future__ import annotations

import importlib
from typing import Any

from dtrain.determined.cluster import ClusterInfo, TrialInfo, get_cluster_info
from dtrain.errors import InvalidHP

__version__ = "0.38.0+dtrain"
LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"

_SUBMODULES = ("pytorch", "core", "keras", "launch")


def __getattr__(name: str) -> Any:
    """`det.pytorch` and `det.core` after a bare `import determined as det`, as in Determined."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'determined' (dtrain's) has no attribute {name!r}; see docs/determined.md for "
                         "what dtrain provides")


__all__ = ["LOG_FORMAT", "ClusterInfo", "InvalidHP", "TrialInfo", "get_cluster_info"]
