"""Which precision ran: bf16 autocast on CPU leaves recurrent layers (whose ops CPU autocast does not list) in fp32,
and the run says so (summary.json's `precision`, the terminal's `precision` line) instead of nothing."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtrain.commands.run import _print_summary
from dtrain.train.precision import MixedPrecision


class _Outputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


class _Stage:
    """The inner forward/backward stage, as LocalForwardBackward runs it."""

    def forward_backward(self, model: nn.Module, batch: Any, train_batch: Any, *, loss_scale: float,
                         communicate: bool, phases: Any) -> dict[str, Any]:
        with phases.forward():
            loss = model(batch).float().mean()
        with phases.backward():
            loss.backward()
        return {"loss": loss.detach()}


def test_bf16_on_cpu_names_the_modules_autocast_left_in_fp32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), _Outputs(), nn.Linear(8, 2))  # a GRU fed fp32 embeddings
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stage = MixedPrecision(_Stage(), "bf16", torch.device("cpu"), None, optimizer, False)  # type: ignore[arg-type]
    phases = type("Phases", (), {"forward": lambda self: nullcontext(), "backward": lambda self: nullcontext()})()
    for _ in range(2):
        stage.forward_backward(model, torch.randint(0, 10, (3, 5)), None, loss_scale=1.0, communicate=True,
                               phases=phases)
    described = stage.describe()
    assert described["name"] == "bf16" and described["autocast_dtype"] == "bfloat16"
    assert described["modules_in_fp32"] == ["0 (Embedding)", "1.gru (GRU)"]  # the head (a linear layer): bf16
    assert not any(hook for module in model.modules() for hook in module._forward_hooks.values())


def test_the_terminal_says_which_precision_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = {"status": "completed", "world_size": 1, "steps_completed": 4, "epochs_completed": 1.0,
               "samples_per_second": 10.0, "wall_seconds": 1.0, "validation": {}, "checkpoint": None,
               "precision": {"name": "bf16", "autocast_dtype": "bfloat16", "loss_scaling": False,
                             "modules_in_fp32": ["1.gru (GRU)"]}}
    _print_summary(tmp_path, None, summary, 2.0)
    assert "  precision    bf16: autocast to bfloat16; left in fp32 by autocast: 1.gru (GRU)" in (
        capsys.readouterr().out.splitlines())
