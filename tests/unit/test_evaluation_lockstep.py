"""Validation in lockstep (FSDP: a forward pass is a collective): a rank with fewer batches runs padding
forward passes whose outputs are dropped, and the Trial's validation_started hook comes after them, so what a
Trial accumulates from there (Determined's custom reducers) sees only real records."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import dtrain.train.evaluation as evaluation
from dtrain.comm import Topology


class CountingTrial:
    """Counts the records evaluate_batch sees since validation_started (as a reducer does)."""

    def __init__(self) -> None:
        self.seen = 0
        self.calls = 0

    def validation_started(self) -> None:
        self.seen = 0

    def evaluate_batch(self, batch: Any, model: Any) -> dict[str, float]:
        self.calls += 1
        self.seen += len(batch[0])
        return {"value": float(batch[0].mean())}

    def validation_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


def test_padding_batches_do_not_reach_what_the_trial_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    def all_gather_object(mine: Any) -> list[Any]:  # the peer has one batch more; the same metric names
        return [mine, mine + 1] if isinstance(mine, int) else [mine, mine]

    monkeypatch.setattr(evaluation, "all_gather_object", all_gather_object)
    monkeypatch.setattr(evaluation, "all_reduce_sums", lambda sums: dict(sums))
    topology = Topology(rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0, backend="gloo",
                        device=torch.device("cpu"), launcher="test")
    data = TensorDataset(torch.arange(8, dtype=torch.float64).unsqueeze(1))
    trial = CountingTrial()
    evaluator = evaluation.Evaluator(data, trial, topology, channels_last=False, lockstep=True)  # type: ignore[arg-type]
    metrics = evaluator.evaluate(torch.nn.Identity(), batch_size=2)
    shard = evaluation.validation_shard(8, 0, 2)
    assert trial.calls == len(range(shard.start, shard.stop, 2)) + 1  # the padding pass ran
    assert trial.seen == len(shard)  # but only the shard's records count
    assert metrics["value"] == pytest.approx(sum(range(shard.start, shard.stop)) / len(shard))
