"""Validation: every rank evaluates its shard of the validation data (or, in pipeline stages, every replica its
shard), and the metrics are averaged over all ranks weighted by records, so the result is the same as one process
evaluating everything."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dtrain.comm import Topology, all_gather_object, all_reduce_sums
from dtrain.data.sharding import validation_shard
from dtrain.errors import TrialError
from dtrain.sync.base import EvaluatesInStages
from dtrain.train.batches import SizedDataset, batch_length, metric_value, move_to_device, returns_batches
from dtrain.train.trial import Trial

log = logging.getLogger(__name__)


class Evaluator:
    """Runs the Trial's evaluate_batch over this rank's shard and reduces the record-weighted sums; or, with a
    strategy that evaluates in stages and a Trial with `pipeline_metrics`, runs each batch through the stages and
    takes the metrics from the last one."""

    def __init__(self, data: SizedDataset, trial: Trial, topology: Topology, *, channels_last: bool,
                 lockstep: bool = False, stages: EvaluatesInStages | None = None) -> None:
        """`lockstep`: the model's forward pass is a collective (FSDP), so every rank runs as many batches as the
        rank with the most; the extra ones are evaluated and their outputs dropped. `stages`: the strategy that
        runs the forward pass in stages, used when the Trial defines `pipeline_metrics(outputs, targets)`."""
        self.data = data
        self.trial = trial
        self.topology = topology
        self.channels_last = channels_last
        self.lockstep = lockstep and topology.is_distributed
        self.batched = returns_batches(data)
        metrics_of = getattr(trial, "pipeline_metrics", None)
        self.stages = stages if callable(metrics_of) else None
        self.staged = self.stages is not None  # no rank needs the whole model to validate

    def evaluate(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """The metrics over the whole validation data (a collective: every rank calls it together)."""
        model.eval()
        with torch.no_grad():
            sums = self._sums_in_stages(batch_size) if self.stages is not None else self._sums(model, batch_size)
        names = all_gather_object(sorted(sums)) if self.topology.is_distributed else [sorted(sums)]
        for name in set().union(*names):
            sums.setdefault(name, 0.0)
        reduced = all_reduce_sums(sums)
        records = reduced.pop("__records")
        return self.trial.validation_metrics({name: value / records for name, value in reduced.items()})

    def _sums(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """This rank's share, each batch through `evaluate_batch` on the whole model."""
        shard = validation_shard(len(self.data), self.topology.rank, self.topology.world_size)
        sums: dict[str, float] = {"__records": 0.0}
        starts = range(shard.start, shard.stop, batch_size)
        extra = max(all_gather_object(len(starts))) - len(starts) if self.lockstep else 0
        for _ in range(extra):  # a forward pass that only keeps the other ranks' collectives company
            self.trial.evaluate_batch(self._batch(range(min(batch_size, len(self.data)))), model)
        self.trial.validation_started()  # after the padding: what a Trial counts from here (reducers) is real
        for first in starts:
            batch = self._batch(range(first, min(first + batch_size, shard.stop)))
            _add(sums, self.trial.evaluate_batch(batch, model), batch_length(batch), "evaluate_batch()")
        return sums

    def _sums_in_stages(self, batch_size: int) -> dict[str, float]:
        """This replica's share, each batch through the stages; only the last stage's ranks count records (the
        others hand activations on), so the reduction over all ranks still weighs every record once."""
        assert self.stages is not None
        shard = validation_shard(len(self.data), self.stages.evaluation_replica, self.stages.evaluation_replicas)
        sums: dict[str, float] = {"__records": 0.0}
        self.trial.validation_started()
        for first in range(shard.start, shard.stop, batch_size):
            batch = self._batch(range(first, min(first + batch_size, shard.stop)))
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TrialError("validation in pipeline stages needs batches of (inputs, targets); the batch was "
                                 f"{type(batch).__name__}")
            inputs, targets = batch
            outputs = self.stages.forward_in_stages(inputs)
            if outputs is not None:
                # pipeline_metrics is an optional Trial method; this branch runs only when the Trial has it
                _add(sums, self.trial.pipeline_metrics(outputs, targets),  # type: ignore[attr-defined]
                     batch_length(batch), "pipeline_metrics()")
        return sums

    def _batch(self, records: range) -> Any:
        indices = list(records)
        if self.batched:
            # self.batched means the dataset defines __getitems__
            batch = self.data.__getitems__(indices)  # type: ignore[attr-defined]
        else:
            batch = torch.utils.data.default_collate([self.data[i] for i in indices])
        return move_to_device(batch, self.topology.device, self.channels_last)


def _add(sums: dict[str, float], outputs: Any, size: int, source: str) -> None:
    """Add a batch's metrics (batch means), weighted by its records, to the running sums."""
    if not isinstance(outputs, Mapping) or not outputs:
        raise TrialError(f"{source} must return a non-empty dict {{metric name: batch mean}}")
    for name, value in outputs.items():
        sums[name] = sums.get(name, 0.0) + metric_value(name, value, source) * size
    sums["__records"] += size


class SearcherMetric:
    """The config's `searcher.metric` among validation metrics (with or without a `validation_` prefix), and
    which of its values is the best so far."""

    def __init__(self, name: str, *, smaller_is_better: bool) -> None:
        self.name = name
        self.smaller_is_better = smaller_is_better
        self.warned = False  # the metric was missing once: say so only once

    def of(self, metrics: Mapping[str, float]) -> float | None:
        for candidate in (self.name, self.name.removeprefix("validation_")):
            if candidate in metrics:
                return metrics[candidate]
        if not self.warned:
            self.warned = True
            log.warning("searcher.metric %r is not among the validation metrics %s; best-checkpoint selection "
                        "keeps the latest ones", self.name, sorted(metrics))
        return None

    def is_best(self, metric: float, earlier_validations: Sequence[Mapping[str, Any]]) -> bool:
        """True when `metric` beats every earlier validation's (ties are not new bests)."""
        earlier = [m for m in (self.of(v["metrics"]) for v in earlier_validations) if m is not None]
        if not earlier:
            return True
        better = min if self.smaller_is_better else max
        return better(earlier + [metric]) == metric and metric not in earlier
