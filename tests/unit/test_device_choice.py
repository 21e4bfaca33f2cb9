"""Where a worker trains (distributed.device, distributed.backend) and the one-line refusal, before any worker
starts, of a run that asks for a GPU on a machine where torch sees none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.cli import main
from dtrain.comm.topology import check_devices, choose_backend, choose_device
from dtrain.config import load_config
from dtrain.errors import ConfigError, ExitCode, LaunchError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "fashion_mnist" / "distributed.yaml"


@pytest.fixture()
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture()
def never_launched(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    started: list[Any] = []
    monkeypatch.setattr("dtrain.launch.launch_workers", lambda *args: started.append(args))
    return started


@pytest.mark.parametrize(("setting", "key", "fix"), [
    ("distributed.backend=nccl", "distributed.backend 'nccl'", "set distributed.backend to gloo or auto"),
    ("distributed.device=cuda", "distributed.device 'cuda'", "set distributed.device to cpu or auto"),
])
def test_a_gpu_asked_for_without_one_is_one_line_before_any_worker_starts(
        setting: str, key: str, fix: str, tmp_path: Path, no_gpu: None, never_launched: list[Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(DEMO), "--run-dir", str(tmp_path / "run"), "--set", setting])
    assert code == ExitCode.USER_ERROR and never_launched == []
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"dtrain: error: {key} needs a CUDA GPU and torch.cuda.is_available() is False")
    assert lines[0].endswith(fix)
    assert not (tmp_path / "run").exists()  # refused before the run dir is made


def test_a_worker_refuses_the_same_in_one_line(no_gpu: None) -> None:
    with pytest.raises(LaunchError, match="distributed.backend 'nccl' needs a CUDA GPU"):
        choose_backend("nccl")
    with pytest.raises(LaunchError, match="distributed.device 'cuda' needs a CUDA GPU"):
        choose_backend("gloo", "cuda")
    assert choose_backend("auto") == "gloo"
    check_devices("auto", "auto")
    check_devices("gloo", "cpu")


def test_the_device_follows_the_backend_unless_set() -> None:
    assert choose_device("gloo", "auto", 1) == torch.device("cpu")
    assert choose_device("nccl", "cpu", 0) == torch.device("cpu")  # refused by the config; here: the setting wins
    gpus = max(torch.cuda.device_count(), 1)
    assert choose_device("nccl", "auto", 3) == torch.device("cuda", 3 % gpus)
    assert choose_device("gloo", "cuda", 2) == torch.device("cuda", 2 % gpus)  # workers share GPUs over gloo


def test_cpu_with_nccl_is_refused_by_the_config() -> None:
    raw = {"name": "x", "entrypoint": "a:B", "hyperparameters": {"global_batch_size": 2},
           "searcher": {"metric": "loss", "max_length": {"batches": 1}},
           "distributed": {"backend": "nccl", "device": "cpu"}}
    with pytest.raises(ConfigError, match="NCCL carries CUDA tensors only"):
        load_config(None, raw=raw)
