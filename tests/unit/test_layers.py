"""dtrain's packages import one way down: no cycle between packages, no import up the layer order.

`LAYERS` is the map of docs/architecture.md, top to bottom: a package may import its own layer's packages and
the layers below, never one above. Every import counts, wherever it stands: at module level, inside a function
(the lazy imports that keep `dtrain --help` quick), under `TYPE_CHECKING`, and `importlib.import_module` with a
literal name. A new package must be given a layer here before its imports can pass.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

DTRAIN = Path(__file__).resolve().parents[2] / "dtrain"

# One entry per layer, top to bottom. A unit is a package under dtrain/ or a module dtrain/<name>.py;
# "dtrain" is the package's own face (dtrain/__init__.py: the version and the lazily imported Trial API).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dtrain", "cli"),  # the `dtrain` command: builds its parser from the command registry
    ("commands",),  # one module per subcommand
    ("launch", "worker", "diagnose", "calibrate", "horovod", "search", "svm", "determined"),  # processes, the
    # tools that drive runs or time a machine, Horovod's API (it drives its own processes and collectives),
    # hyperparameter search, the SVM (its own solver and the runner a worker runs instead of the Trainer),
    # Determined's training APIs (they drive dtrain's Trainer or run a command on each slot)
    ("train",),  # the Trial API and the Trainer
    ("sync", "optim", "profile", "data"),  # what the Trainer is made of
    ("comm", "compress", "config", "runs"),  # torch.distributed, compressors, the config schema, run files
    ("plan", "errors"),  # the pure performance model; named exceptions and exit codes
)
PURE = {"plan": ("torch",)}  # units that must not import these, anywhere


@dataclass(frozen=True)
class Import:
    """One import statement of a dtrain file: who imports, which module, where."""

    source: str  # the importing module, e.g. dtrain.commands.run
    target: str  # the imported module, e.g. dtrain.launch
    where: str  # path:line

    def arrow(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def module_name(path: Path, root: Path) -> str:
    """`root/sync/hooks.py` -> `dtrain.sync.hooks`; a package's `__init__.py` is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    """Whether `name` is a module or package under `root` (not a name defined in one)."""
    parts = name.split(".")
    if parts[0] != root.name:
        return False
    folder = root.joinpath(*parts[1:])
    return folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file()


def _absolute(node: ast.ImportFrom, source: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    anchor = source.split(".") if is_package else source.split(".")[:-1]
    anchor = anchor[:len(anchor) - node.level + 1]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def named_imports(path: Path, root: Path) -> Iterator[tuple[str, int]]:
    """(module, line) for every import in the file at `path`, of any package, wherever it stands."""
    source = module_name(path, root)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Import | ast.ImportFrom | ast.Call):
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, source, path.name == "__init__.py")
            # `from dtrain.train import checkpoint` imports the module dtrain.train.checkpoint
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", root) else base for a in node.names]
        elif node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__"):
                names = [node.args[0].value]
        for name in dict.fromkeys(names):
            yield name, node.lineno


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    """Every import of a module of `root`'s package in the file at `path`."""
    source, package = module_name(path, root), root.name
    for name, line in named_imports(path, root):
        if name == package or name.startswith(package + "."):
            yield Import(source, name, f"{path.relative_to(root.parent)}:{line}")


def all_imports(root: Path) -> list[Import]:
    return [found for path in sorted(root.rglob("*.py")) for found in imports_of(path, root)]


def unit_of(module: str) -> str:
    """`dtrain.sync.hooks` -> `sync`; `dtrain.cli` -> `cli`; `dtrain` -> `dtrain`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph(imports: Sequence[Import]) -> dict[str, set[str]]:
    """Which unit imports which other one."""
    graph: dict[str, set[str]] = {}
    for found in imports:
        source, target = unit_of(found.source), unit_of(found.target)
        graph.setdefault(source, set())
        graph.setdefault(target, set())
        if source != target:
            graph[source].add(target)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan's algorithm): each is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward(imports: Sequence[Import], layers: Sequence[Sequence[str]]) -> list[Import]:
    """The imports from a unit to a unit of a higher layer."""
    layer_of = {unit: depth for depth, units in enumerate(layers) for unit in units}
    # a unit without a layer counts as the top one when imported (and the placement test names it)
    return [found for found in imports
            if layer_of.get(unit_of(found.target), -1) < layer_of.get(unit_of(found.source), len(layers))]


# --------------------------------------------------------------------------------------------- dtrain


@functools.cache
def dtrain_imports() -> tuple[Import, ...]:
    return tuple(all_imports(DTRAIN))


def test_every_unit_has_a_layer_and_every_layer_entry_exists() -> None:
    units = {unit_of(module_name(path, DTRAIN)) for path in DTRAIN.rglob("*.py")}
    placed = [unit for layer in LAYERS for unit in layer]
    assert len(placed) == len(set(placed)), "a unit stands in two layers"
    assert units - set(placed) == set(), "give these a layer in LAYERS (and in docs/architecture.md)"
    assert set(placed) - units == set(), "these are in LAYERS but not in dtrain/ any more"


def test_no_cycle_between_packages() -> None:
    imports = dtrain_imports()
    found = cycles(unit_graph(imports))
    detail = [f.arrow() for f in imports for group in found
              if unit_of(f.source) in group and unit_of(f.target) in group and unit_of(f.source) != unit_of(f.target)]
    assert found == [], "packages that import each other:\n" + "\n".join(detail)


def test_imports_only_go_down_the_layers() -> None:
    wrong = upward(dtrain_imports(), LAYERS)
    assert wrong == [], "imports up the layers of docs/architecture.md:\n" + "\n".join(f.arrow() for f in wrong)


def test_the_performance_model_imports_no_torch() -> None:
    for unit, banned in PURE.items():
        for path in sorted((DTRAIN / unit).rglob("*.py")):
            found = [f"{path.relative_to(DTRAIN.parent)}:{line} imports {name}"
                     for name, line in named_imports(path, DTRAIN) if name.split(".")[0] in banned]
            assert found == [], "\n".join(found)


# --------------------------------------------------------------------------------------------- the check


@pytest.fixture()
def toy(tmp_path: Path) -> Path:
    """A package `toy` whose imports break both rules in every way an import can be written."""
    root = tmp_path / "toy"
    files = {
        "__init__.py": "",
        "top.py": "from toy import low\n",
        "low/__init__.py": "",
        "low/a.py": "def later():\n    from toy.top import x\n",  # lazy: up the layers, and a cycle
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..mid import y\n",
        "low/c.py": "import importlib\nimportlib.import_module('toy.mid.z')\n",
        "mid/__init__.py": "from . import z\n",
        "mid/z.py": "import os\nimport toy.low.a\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_check_sees_lazy_relative_type_checking_and_importlib_imports(toy: Path) -> None:
    arrows = {(f.source, f.target) for f in all_imports(toy)}
    assert arrows == {("toy.top", "toy.low"), ("toy.low.a", "toy.top"), ("toy.low.b", "toy.mid"),
                      ("toy.low.c", "toy.mid.z"), ("toy.mid", "toy.mid.z"), ("toy.mid.z", "toy.low.a")}


def test_the_check_finds_cycles_and_imports_up(toy: Path) -> None:
    imports = all_imports(toy)
    assert cycles(unit_graph(imports)) == [["low", "mid", "top"]]
    layers = (("top",), ("mid",), ("low",))
    assert sorted((f.source, f.target) for f in upward(imports, layers)) == [
        ("toy.low.a", "toy.top"), ("toy.low.b", "toy.mid"), ("toy.low.c", "toy.mid.z")]
    assert sorted((f.source, f.target) for f in upward(imports, (("low",), ("mid",), ("top",)))) == [
        ("toy.mid.z", "toy.low.a"), ("toy.top", "toy.low")]
