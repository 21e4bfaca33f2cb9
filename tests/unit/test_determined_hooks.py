"""The parts of a PyTorchTrial that are not train_batch, in one process: `evaluate_full_dataset` (run by the chief
over the whole validation loader), custom reducers (`context.wrap_reducer`, a MetricReducer or a plain function),
and every PyTorchCallback hook with its state kept in checkpoints."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtrain.comm import Topology
from dtrain.config import load_config
from dtrain.determined import install_import_path
from dtrain.determined.adapter import PyTorchTrial
from dtrain.determined.context import PyTorchTrialContext
from dtrain.determined.pytorch import DataLoader
from dtrain.errors import TrialError
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.trainer import Trainer

TRIALS = Path(__file__).resolve().parents[1] / "determined_trials"
ONE_PROCESS = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                       device=torch.device("cpu"), launcher="none")
RAW: dict[str, Any] = {
    "name": "det-hooks", "entrypoint": "model_def:RegressionTrial",
    "hyperparameters": {"global_batch_size": 32, "learning_rate": 0.05},
    "searcher": {"name": "single", "metric": "validation_loss", "max_length": {"batches": 8}},
    "min_validation_period": {"batches": 4}, "min_checkpoint_period": {"batches": 4}, "scheduling_unit": 2,
}


@pytest.fixture(autouse=True)
def _trials_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    install_import_path()
    monkeypatch.syspath_prepend(str(TRIALS))
    for name in ("model_def", "data"):  # Determined's module names: other tests import their own
        monkeypatch.delitem(sys.modules, name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(run_dir: Path, trial_class: Any, **changes: Any) -> tuple[Trainer, dict[str, Any]]:
    raw = copy.deepcopy(RAW)
    raw.update(changes)
    config = load_config(None, raw=raw).config
    prepare_run_dir(config, run_dir, TRIALS)
    trainer = Trainer(config=config, trial_class=trial_class, topology=ONE_PROCESS, run_info=load_run_info(run_dir))
    return trainer, trainer.fit()


class _Regression(PyTorchTrial):
    """The regression of model_def.py with no evaluation of its own (the tests below add one)."""

    def __init__(self, context: PyTorchTrialContext) -> None:
        from data import network

        self.context = context
        self.model = context.wrap_model(network())
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.05))

    def build_training_data_loader(self) -> DataLoader:
        from data import regression

        return DataLoader(regression(256, seed=1), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self) -> DataLoader:
        from data import regression

        return DataLoader(regression(40, seed=2), batch_size=16)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        loss = F.mse_loss(self.model(inputs), targets)
        self.context.backward(loss)
        self.context.step_optimizer(self.opt)
        return {"loss": loss}


class _FullDataset(_Regression):
    def evaluate_full_dataset(self, data_loader: torch.utils.data.DataLoader) -> dict[str, Any]:
        assert not torch.is_grad_enabled() and not self.model.training
        errors = torch.cat([(self.model(x) - y).abs() for x, y in data_loader])
        return {"validation_loss": float(errors.pow(2).mean()), "median_error": float(errors.median()),
                "records": len(errors), "batches": len(data_loader),
                "rank": self.context.distributed.get_rank()}


def test_evaluate_full_dataset_runs_on_the_chief_over_the_whole_loader(tmp_path: Path) -> None:
    from data import regression

    trainer, summary = _train(tmp_path / "run", _FullDataset.__dtrain_trial__())
    assert summary["status"] == "completed"
    history = trainer.state.validation_history
    assert [entry["step"] for entry in history] == [4, 8]
    metrics = history[-1]["metrics"]
    assert metrics["records"] == 40 and metrics["batches"] == 3 and metrics["rank"] == 0  # the loader, unsharded
    inputs, targets = regression(40, seed=2).tensors
    with torch.no_grad():
        errors = (trainer.model(inputs) - targets).abs()
    assert metrics["median_error"] == float(errors.median())  # not an average of batch values: the exact median
    assert metrics["validation_loss"] == pytest.approx(float(errors.pow(2).mean()), rel=1e-12)


class _Both(_FullDataset):
    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        return {}


def test_a_trial_with_both_evaluations_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TrialError, match="implements both evaluate_batch and evaluate_full_dataset") as caught:
        _train(tmp_path / "run", _Both.__dtrain_trial__())
    assert "\n" not in str(caught.value)
