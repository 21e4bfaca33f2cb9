"""A model whose stages do not chain one tensor to the next is stopped at the first training step, on every rank,
with one line naming the stage, its modules, what it returned or raised, and the fix (2 gloo ranks, 2 stages).
The model is a recurrent one: nn.GRU returns a tuple (output, h_n)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtrain.comm import Topology


class GRUTagger(nn.Sequential):
    """Embedding, GRU, layer norm, head: the GRU's tuple breaks any cut that ends a stage on it or starts one after
    it; `pipeline_stages(p)` gives a cut that works (the GRU wrapped to return its output tensor)."""

    def __init__(self, with_own_cut: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.with_own_cut = with_own_cut

    def pipeline_stages(self, p: int) -> list[nn.Module]:
        if not self.with_own_cut:
            return [nn.Sequential(self.embed, self.gru), nn.Sequential(self.norm, self.head)]
        return [nn.Sequential(self.embed, _Outputs(self.gru)), _LastStep(self.norm, self.head)]


class _Outputs(nn.Module):
    def __init__(self, gru: nn.GRU) -> None:
        super().__init__()
        self.gru = gru

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


class _LastStep(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x[:, -1]))


class _Trial:
    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def train_batch(self, batch: Any, model: nn.Module) -> Any:
        raise NotImplementedError


def _first_step(topology: Topology, split_points: list[str], with_own_cut: bool) -> str:
    """One training step of a 2-stage pipeline over the GRU model: 'ok' or the TrialError's line."""
    from dtrain.errors import TrialError
    from dtrain.sync.pipeline import PipelineStrategy

    torch.manual_seed(0)
    model = GRUTagger(with_own_cut)
    strategy = PipelineStrategy(topology, stages=2, microbatches=2, schedule="gpipe", split_points=split_points)
    model = strategy.wrap_model(model)
    phases = type("Phases", (), {"forward": lambda self: nullcontext(), "backward": lambda self: nullcontext()})()
    batch = (torch.randint(0, 10, (4, 5)), torch.randint(0, 3, (4,)))
    try:
        strategy.forward_backward(model, batch, _Trial().train_batch, loss_scale=1.0, communicate=True,
                                  phases=phases)
    except TrialError as exc:
        return str(exc)
    return "ok"


def test_a_stage_that_returns_a_tuple_is_named_with_its_modules_and_the_fix(
        spawn: Callable[..., list[Any]]) -> None:
    messages = spawn(_first_step, 2, [], False)
    assert messages[0] == messages[1], "every rank stops with the same line"
    line = messages[0]
    assert "\n" not in line
    assert line.startswith("pipeline stage 0 of 2 (modules: 0 (Embedding), 1 (GRU)) returned a tuple of 2 "
                           "(Tensor[2, 5, 8] float32, Tensor[1, 2, 8] float32), not one tensor")
    assert "split_points" in line and "pipeline_stages(p)" in line


def test_an_exception_inside_a_stage_is_a_trial_error_naming_the_stage(spawn: Callable[..., list[Any]]) -> None:
    """Cut at the GRU: stage 0 (the embedding) is fine; stage 1 runs the GRU and hands its tuple to the layer norm,
    which raises."""
    messages = spawn(_first_step, 2, ["gru"], False)
    assert messages[0] == messages[1]
    line = messages[0]
    assert line.startswith("pipeline stage 1 of 2 (modules: gru (GRU), norm (LayerNorm), head (Linear)), cut at "
                           "split_points ['gru'], raised TypeError: ")
    assert "pipeline_stages(p)" in line


def test_the_models_own_cut_into_one_tensor_stages_trains(spawn: Callable[..., list[Any]]) -> None:
    assert spawn(_first_step, 2, [], True) == ["ok", "ok"]


def test_a_trial_method_pipeline_stages_is_named_not_ignored() -> None:
    from dtrain.errors import TrialError
    from dtrain.sync.pipeline import PipelineStrategy

    class Misplaced(_Trial):
        def pipeline_stages(self, p: int) -> list[nn.Module]:
            return []

    strategy = PipelineStrategy.__new__(PipelineStrategy)
    with pytest.raises(TrialError, match="the Trial Misplaced defines pipeline_stages, which dtrain does not read"):
        strategy.forward_backward(nn.Linear(2, 2), (torch.zeros(2, 2), torch.zeros(2)), Misplaced().train_batch,
                                  loss_scale=1.0, communicate=True, phases=None)  # type: ignore[arg-type]
