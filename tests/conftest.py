"""Shared test set-up: every test gets its own runs root, so the store and default run dirs stay in tmp."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
DTRAIN = [sys.executable, "-m", "dtrain.cli"]


@pytest.fixture(autouse=True)
def runs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("DTRAIN_RUNS_ROOT", str(root))
    monkeypatch.delenv("DTRAIN_LAUNCHER", raising=False)
    return root


def fashion_mnist_available() -> bool:
    from dtrain.data.fashion_mnist import find_data_dir

    return find_data_dir() is not None


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DTRAIN_LAUNCHER", None)
    env.update(extra)
    return env


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/<name>.py loaded as a module (benchmarks/ is not a package), for tests of its pure functions."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a GPU that torch sees: skipped, with the reason, where there is none (CI);
    `make gpu-check` runs them on the GPU machine (`pytest -m cuda`)."""
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU; torch {torch.__version__} sees none here "
                                   "(run on the GPU machine by `make gpu-check`: docs/gpu.md)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
