"""Load a Horovod-style script of tests/horovod_scripts as a module (with dtrain's `horovod` shim importable), so
that a benchmark's other variants use exactly the script's model and data code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "dtrain" / "horovod" / "shim"


def load_script(name: str) -> ModuleType:
    """tests/horovod_scripts/<name>.py, imported under the name `horovod_script_<name>` (its main() not run)."""
    if str(SHIM) not in sys.path:
        sys.path.append(str(SHIM))  # after site-packages: a real Horovod, if installed, still wins
    path = REPO / "tests" / "horovod_scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"horovod_script_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
