"""The Trainer on 2 and 3 real gloo processes equals one process training on the full batch: plain, with
gradient aggregation, with uneven (weighted) per-rank batches, and with fusion auto-tuning switching buckets."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtrain.comm import Topology, barrier
from dtrain.config import load_config
from dtrain.data.sharding import ShardedBatchSampler, split_by_sizes, split_global_batch
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.rng import seed_everything
from dtrain.train.trainer import Trainer
from dtrain.train.trial import TrialContext

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

RAW: dict[str, Any] = {
    "name": "equivalence", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 24, "learning_rate": 0.5, "momentum": 0.0, "float64": True,
                        "hidden": 16},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": 5}},
    "reproducibility": {"experiment_seed": 11},
}


def _train(topology: Topology, run_dir: str, raw: dict[str, Any], per_rank: list[int] | None = None
           ) -> dict[str, torch.Tensor]:
    import sys

    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    config = load_config(None, raw=raw).config
    if topology.rank == 0:
        prepare_run_dir(config, Path(run_dir), FIXTURES)
    barrier()
    split = split_by_sizes(per_rank) if per_rank else None
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=topology, run_info=load_run_info(Path(run_dir)),
                      batch_split=split)
    summary = trainer.fit()
    assert summary["status"] == "completed"
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _reference(raw: dict[str, Any], steps: int, batches_per_step: int = 1) -> dict[str, torch.Tensor]:
    """One process, plain SGD written here without the Trainer; each step takes one batch holding the
    next `batches_per_step` global batches."""
    import sys

    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    hp = raw["hyperparameters"]
    seed = raw["reproducibility"]["experiment_seed"]
    split = split_global_batch(hp["global_batch_size"], 1)
    context = TrialContext(hparams=hp, rank=0, world_size=1, local_rank=0, batch_split=split,
                           device=torch.device("cpu"), seed=seed)
    trial = DigitsTrial(context)
    data = trial.build_training_data()
    seed_everything(seed)
    model = trial.build_model()
    images, labels = data.tensors
    order = list(ShardedBatchSampler(len(data), split, 0, seed, epoch=0))
    for step in range(steps):
        index = torch.tensor(sum(order[step * batches_per_step:(step + 1) * batches_per_step], []))
        model.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= hp["learning_rate"] * p.grad
    return model.state_dict()


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_data_parallel_equals_full_batch_sgd(spawn: Any, tmp_path: Path, world_size: int) -> None:
    raw = copy.deepcopy(RAW)
    raw["resources"] = {"slots_per_trial": world_size}
    results = spawn(_train, world_size, str(tmp_path / "run"), raw)
    expected = _reference(raw, steps=5)
    for rank_state in results:
        assert _max_relative_difference(rank_state, expected) < 1e-9
    assert all(torch.equal(results[0][k], r[k]) for r in results[1:] for k in expected)
    # and the run really moved the weights
    start = copy.deepcopy(raw)
    start["searcher"]["max_length"] = {"batches": 0}
    assert _max_relative_difference(_reference(raw, steps=0), expected) > 1e-3


@pytest.mark.parametrize("world_size", [2, 3])
def test_aggregated_micro_batches_equal_one_big_batch(spawn: Any, tmp_path: Path, world_size: int) -> None:
    """aggregation_frequency 2: two accumulated micro-batches per rank and one all-reduce per 2 batches end
    where one process does with one batch holding both global batches."""
    raw = copy.deepcopy(RAW)
    raw["resources"] = {"slots_per_trial": world_size}
    raw["optimizations"] = {"aggregation_frequency": 2}
    raw["searcher"]["max_length"] = {"batches": 10}
    results = spawn(_train, world_size, str(tmp_path / "run"), raw)
    expected = _reference(raw, steps=5, batches_per_step=2)
    for rank_state in results:
        assert _max_relative_difference(rank_state, expected) < 1e-9
    assert _max_relative_difference(_reference(raw, steps=10), expected) > 1e-3  # not the same as 10 steps


@pytest.mark.parametrize("per_rank", [[7, 17], [3, 9, 12]])
def test_uneven_weighted_batches_equal_their_union(spawn: Any, tmp_path: Path, per_rank: list[int]) -> None:
    """Ranks train on 7 and 17 (or 3, 9, 12) records of each global batch of 24; each gradient is weighted by
    its share, so the result is the full-batch gradient of the union."""
    raw = copy.deepcopy(RAW)
    raw["resources"] = {"slots_per_trial": len(per_rank)}
    results = spawn(_train, len(per_rank), str(tmp_path / "run"), raw, per_rank)
    expected = _reference(raw, steps=5)
    for rank_state in results:
        assert _max_relative_difference(rank_state, expected) < 1e-9
    assert all(torch.equal(results[0][k], r[k]) for r in results[1:] for k in expected)


def test_validation_metrics_are_weighted_by_records(spawn: Any, tmp_path: Path) -> None:
    """3 ranks get 120, 120 and 120 of the 360 test digits; the mean must equal one process's mean."""
    raw = copy.deepcopy(RAW)
    raw["resources"] = {"slots_per_trial": 3}
    raw["data_loader"] = {"validation_batch_size": 7}  # uneven last batches on every rank
    spawn(_train, 3, str(tmp_path / "run"), raw)
    import json

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    model = torch.load(summary["checkpoint"], weights_only=True)
    import sys

    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    context = TrialContext(hparams=raw["hyperparameters"], rank=0, world_size=1, local_rank=0,
                           batch_split=split_global_batch(24, 1), device=torch.device("cpu"), seed=0)
    trial = DigitsTrial(context)
    net = trial.build_model()
    net.load_state_dict(model)
    images, labels = trial.build_validation_data().tensors
    with torch.no_grad():
        logits = net(images)
    expected_loss = float(F.cross_entropy(logits, labels))
    expected_accuracy = float((logits.argmax(1) == labels).double().mean())
    assert summary["validation"]["loss"] == pytest.approx(expected_loss, rel=1e-9)
    assert summary["validation"]["accuracy"] == pytest.approx(expected_accuracy, rel=1e-12)


def _train_with_rank_dependent_data(topology: Topology, run_dir: str) -> str:
    import sys

    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    from dtrain.errors import SyncError

    class ShortOnRankOne(DigitsTrial):
        def build_training_data(self) -> Any:
            data = super().build_training_data()
            if self.context.rank == 1:
                data.tensors = tuple(t[:1000] for t in data.tensors)
            return data

    raw = copy.deepcopy(RAW)
    raw["resources"] = {"slots_per_trial": 2}
    config = load_config(None, raw=raw).config
    if topology.rank == 0:
        prepare_run_dir(config, Path(run_dir), FIXTURES)
    barrier()
    trainer = Trainer(config=config, trial_class=ShortOnRankOne, topology=topology,
                      run_info=load_run_info(Path(run_dir)))
    with pytest.raises(SyncError) as caught:
        trainer.fit()
    return str(caught.value)


def test_ranks_with_different_data_stop_at_once_with_one_line(spawn: Any, tmp_path: Path) -> None:
    messages = spawn(_train_with_rank_dependent_data, 2, str(tmp_path / "run"), timeout=60.0)
    for message in messages:
        assert "rank 0: 1437 training" in message and "rank 1: 1000 training" in message
