"""The end-of-run replica check: ranks are compared with the ranks that hold the same part of the model (a
pipeline's stages), and a difference within a part is a SyncError naming the ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtrain.train.summary as summary
from dtrain.errors import SyncError
from dtrain.sync.pipeline_state import place


def _model(value: float) -> torch.nn.Module:
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.fill_(value)
    return layer


def _gathering(others: list[tuple[int, torch.nn.Module]]) -> Any:
    """all_gather_object as if the other ranks held `others` (their part, their module)."""
    def gather(mine: Any) -> list[Any]:
        return [mine, *((part, summary.model_digest(module)) for part, module in others)]
    return gather


def test_stages_that_differ_from_each_other_are_not_a_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 replicas x 2 stages: rank d*2 + s holds stage s; the two stages hold different weights
    monkeypatch.setattr(summary, "all_gather_object", _gathering([(1, _model(2.0)), (0, _model(1.0)),
                                                                  (1, _model(2.0))]))
    assert summary.replicas_identical(_model(1.0), part=0)


def test_a_stage_that_differs_from_its_other_replica_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(summary, "all_gather_object", _gathering([(1, _model(2.0)), (0, _model(1.0)),
                                                                  (1, _model(2.5))]))
    with pytest.raises(SyncError, match=r"rank 3: \w+ \(part 1\)"):
        summary.replicas_identical(_model(1.0), part=0)


def test_whole_models_are_compared_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(summary, "all_gather_object", _gathering([(0, _model(1.0))]))
    assert summary.replicas_identical(_model(1.0))
    monkeypatch.setattr(summary, "all_gather_object", _gathering([(0, _model(1.5))]))
    with pytest.raises(SyncError, match=r"rank 1: \w+\)"):
        summary.replicas_identical(_model(1.0))


def test_place_rebuilds_the_nest_a_checkpoint_was_flattened_from() -> None:
    """torch.distributed.checkpoint names a nested value by its path (string keys for dicts, integers for lists);
    the pipeline rebuilds the nest its optimizer state and param groups were written from."""
    root: dict[str, Any] = {}
    place(root, ("optim", "param_groups", 1, "lr"), 0.5)
    place(root, ("optim", "param_groups", 0, "params"), ["0.weight"])
    place(root, ("optim", "state", "0.weight", "momentum_buffer"), "buffer")
    place(root, ("optim", "param_groups", 0, "lr"), 0.1)
    assert root == {"optim": {"param_groups": [{"params": ["0.weight"], "lr": 0.1}, {"lr": 0.5}],
                              "state": {"0.weight": {"momentum_buffer": "buffer"}}}}
