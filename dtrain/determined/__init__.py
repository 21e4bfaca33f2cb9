"""Determined's training APIs on dtrain, so that Determined users bring their code and experiment files unchanged.

- `pytorch.py`, `context.py`, `adapter.py`: the legacy `PyTorchTrial` and its `PyTorchTrialContext`, trained by
  dtrain's own Trainer through an adapter Trial (so restarts, checkpoints, the store, TensorBoard, the
  `distributed:` strategies and `large_batch:` all apply);
- `trainer_api.py`: `det.pytorch.init()` and `det.pytorch.Trainer(trial, context).fit(...)` for scripts;
- `core.py`: `det.core.init()` (metrics, checkpoints, searcher operations, preemption, distributed);
- `cluster.py`: `det.get_cluster_info()` (None outside dtrain, as in Determined's local mode);
- `command.py`: a command entrypoint run on each slot (cluster info, hyperparameters, latest checkpoint);
- `shim/determined`: the package importable as `determined` when the real one is not installed.

Written from Determined's public API reference: names and semantics, not its code.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "shim"


def real_determined_installed() -> bool:
    """Whether a real `determined` package (not dtrain's shim) is importable by this interpreter."""
    spec = importlib.util.find_spec("determined")
    if spec is None or spec.origin in (None, "namespace"):  # a stray `determined/` folder without __init__.py on
        return False  # sys.path (benchmarks/determined, when a test puts benchmarks/ there) is no package
    return not str(spec.origin).startswith(str(SHIM))


def install_import_path() -> None:
    """Make `import determined` give dtrain's layer in this process, unless the real package is installed (the
    shim goes last on sys.path, so an installed `determined` is found first)."""
    if str(SHIM) not in sys.path and not real_determined_installed():
        sys.path.append(str(SHIM))
        imported = sys.modules.get("determined")
        if imported is not None and getattr(imported, "__file__", None) is None:  # a namespace package cached
            del sys.modules["determined"]  # before the shim was on the path: import the shim instead


def pythonpath_with_shim(current: str | None) -> str | None:
    """PYTHONPATH for a command entrypoint's processes: the shim in front, unless a real Determined is installed."""
    if real_determined_installed():
        return current
    return ":".join([str(SHIM), *filter(None, [current])])
