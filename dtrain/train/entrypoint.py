"""Find the user's Trial class from `entrypoint` (`module:Class` or `path/file.py:Class`).

A class of another API that dtrain runs through an adapter (Determined's PyTorchTrial) says so with a
`__dtrain_trial__()` classmethod that returns the dtrain Trial class to train.

Code is imported only from where the user points: the experiment file's directory for a module name,
or the named file (its directory is put first on sys.path so that it can import its siblings).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from dtrain.errors import TrialError
from dtrain.train.trial import Trial


def load_trial_class(entrypoint: str, base_dir: Path) -> type[Trial]:
    """Import the module or file and return the Trial subclass it names."""
    target, _, qualname = entrypoint.partition(":")
    if target.endswith(".py"):
        module = _import_file(Path(target), base_dir, entrypoint)
    else:
        module = _import_module(target, base_dir, entrypoint)
    module_name = getattr(module, "__name__", target)
    obj: object = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            names = [n for n, v in vars(module).items()
                     if isinstance(v, type) and issubclass(v, Trial) and v is not Trial]
            hint = f"Trial classes there: {', '.join(names)}" if names else "it defines no Trial subclass"
            raise TrialError(f"entrypoint {entrypoint!r}: {module_name} has no attribute `{qualname}`; {hint}")
        obj = getattr(obj, part)
    adapt = getattr(obj, "__dtrain_trial__", None)
    if isinstance(obj, type) and callable(adapt):  # another API's trial class (Determined's PyTorchTrial)
        obj = adapt()
    if not (isinstance(obj, type) and issubclass(obj, Trial)):
        raise TrialError(f"entrypoint {entrypoint!r} names {obj!r}, which is not a subclass of dtrain.Trial; "
                         "define `class MyTrial(dtrain.Trial)` and name it")
    return obj


def _import_file(path: Path, base_dir: Path, entrypoint: str) -> object:
    file = (path if path.is_absolute() else base_dir / path).resolve()
    if not file.is_file():
        raise TrialError(f"entrypoint {entrypoint!r}: file {file} does not exist; paths are relative to the "
                         "directory of the experiment file")
    module_name = f"dtrain_user_{file.stem}"
    if module_name in sys.modules and getattr(sys.modules[module_name], "__file__", None) == str(file):
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise TrialError(f"entrypoint {entrypoint!r}: importing {file} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str, base_dir: Path, entrypoint: str) -> object:
    if str(base_dir) in sys.path:
        sys.path.remove(str(base_dir))
    sys.path.insert(0, str(base_dir))
    _forget_if_from_elsewhere(name.split(".")[0], base_dir)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name or name.startswith(f"{exc.name}."):
            raise TrialError(f"entrypoint {entrypoint!r}: no module `{name}` in {base_dir} or on the Python path; "
                             "put the model file next to the experiment file or write `file.py:Class`") from None
        raise TrialError(f"entrypoint {entrypoint!r}: importing `{name}` failed: {exc}") from exc
    except Exception as exc:
        raise TrialError(f"entrypoint {entrypoint!r}: importing `{name}` failed: {type(exc).__name__}: {exc}") from exc


def _forget_if_from_elsewhere(top: str, base_dir: Path) -> None:
    """A process that loads two experiments (a plan or benchmark over several workloads) may meet two modules of
    one name, each beside its own experiment file (`model_def`): when the one imported earlier is not the one in
    `base_dir`, drop it (and its submodules) from the import cache so that `base_dir`'s is imported."""
    loaded = sys.modules.get(top)
    candidates = [base_dir / f"{top}.py", base_dir / top / "__init__.py"]
    if loaded is None or not any(candidate.is_file() for candidate in candidates):
        return
    origin = getattr(loaded, "__file__", None)
    if origin is not None and Path(origin).resolve() in {candidate.resolve() for candidate in candidates}:
        return
    for key in [key for key in sys.modules if key == top or key.startswith(f"{top}.")]:
        del sys.modules[key]
    importlib.invalidate_caches()
