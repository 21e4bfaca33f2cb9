"""Validation through pipeline stages (EvaluatesInStages + the Trial's pipeline_metrics): each replica evaluates
its share of the data, only the ranks that hold the model's outputs count records, and a Trial without
pipeline_metrics keeps evaluate_batch on the whole model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dtrain.train.evaluation as evaluation
from dtrain.comm import Topology

TOPOLOGY = Topology(rank=3, world_size=4, local_rank=3, local_world_size=4, node_rank=0, backend="gloo",
                    device=torch.device("cpu"), launcher="test")
MODEL = torch.nn.Linear(3, 2).double()


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": F.cross_entropy(outputs, targets)}


class MetricsTrial:
    """evaluate_batch on the whole model, pipeline_metrics from the outputs; both give the same metrics."""

    def __init__(self) -> None:
        self.evaluated = 0

    def validation_started(self) -> None:
        pass

    def evaluate_batch(self, batch: Any, model: Any) -> dict[str, torch.Tensor]:
        self.evaluated += 1
        return _loss(model(batch[0]), batch[1])

    def pipeline_metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return _loss(outputs, targets)

    def validation_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


class WholeModelTrial(MetricsTrial):
    pipeline_metrics = None  # type: ignore[assignment]


class Stages:
    """Replica 1 of 2; the last stage (outputs) or an earlier one (None)."""

    evaluation_replica = 1
    evaluation_replicas = 2

    def __init__(self, last: bool) -> None:
        self.last = last
        self.inputs: list[torch.Tensor] = []

    def forward_in_stages(self, inputs: torch.Tensor) -> torch.Tensor | None:
        self.inputs.append(inputs)
        return MODEL(inputs) if self.last else None


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(11, 3, generator=generator, dtype=torch.float64),
                         torch.randint(0, 2, (11,), generator=generator))


def _evaluate(monkeypatch: pytest.MonkeyPatch, trial: MetricsTrial, stages: Stages) -> tuple[dict[str, float], dict]:
    reduced: dict[str, Any] = {}

    def all_reduce_sums(sums: dict[str, float]) -> dict[str, float]:
        reduced.update(sums)
        return dict(sums) if sums["__records"] else {**sums, "__records": 1.0}

    monkeypatch.setattr(evaluation, "all_gather_object", lambda mine: [mine])
    monkeypatch.setattr(evaluation, "all_reduce_sums", all_reduce_sums)
    evaluator = evaluation.Evaluator(_data(), trial, TOPOLOGY, channels_last=False,  # type: ignore[arg-type]
                                     stages=stages)  # type: ignore[arg-type]
    return evaluator.evaluate(MODEL, batch_size=2), reduced


def test_the_last_stage_evaluates_its_replicas_share(monkeypatch: pytest.MonkeyPatch) -> None:
    trial, stages = MetricsTrial(), Stages(last=True)
    metrics, reduced = _evaluate(monkeypatch, trial, stages)
    share = evaluation.validation_shard(11, 1, 2)  # by replica (1 of 2), not by rank (3 of 4)
    inputs, targets = _data()[share.start:share.stop]
    assert torch.equal(torch.cat(stages.inputs), inputs)
    assert [len(batch) for batch in stages.inputs] == [2, 2, 1]
    assert reduced["__records"] == len(share)
    with torch.no_grad():
        expected = float(F.cross_entropy(MODEL(inputs), targets))
    assert metrics["loss"] == pytest.approx(expected, rel=1e-12)
    assert trial.evaluated == 0  # no whole-model pass


def test_an_earlier_stage_hands_batches_on_and_counts_no_records(monkeypatch: pytest.MonkeyPatch) -> None:
    stages = Stages(last=False)
    _, reduced = _evaluate(monkeypatch, MetricsTrial(), stages)
    assert len(stages.inputs) == 3
    assert reduced == {"__records": 0.0}


def test_without_pipeline_metrics_the_whole_model_evaluates(monkeypatch: pytest.MonkeyPatch) -> None:
    trial, stages = WholeModelTrial(), Stages(last=True)
    evaluator = evaluation.Evaluator(_data(), trial, TOPOLOGY, channels_last=False,  # type: ignore[arg-type]
                                     stages=stages)  # type: ignore[arg-type]
    assert not evaluator.staged
    _evaluate(monkeypatch, trial, stages)
    share = evaluation.validation_shard(11, 3, 4)  # by rank
    assert trial.evaluated == len(range(share.start, share.stop, 2))
    assert stages.inputs == []
