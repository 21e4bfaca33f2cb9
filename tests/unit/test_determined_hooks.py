"""The parts of a PyTorchTrial that are not train_batch, in one process: `evaluate_full_dataset` (run by the chief
over the whole validation loader), custom reducers (`context.wrap_reducer`, a MetricReducer or a plain function),
and every PyTorchCallback hook with its state kept in checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtrain.determined.adapter import PyTorchTrial
from dtrain.determined.context import PyTorchTrialContext
from dtrain.determined.pytorch import DataLoader, MetricReducer, PyTorchCallback
from dtrain.determined.reducers import Reducers
from dtrain.errors import TrialError
from dtrain.train.checkpoint import find_resume_checkpoint, load_checkpoint
from dtrain.train.trainer import Trainer
from tests.unit.determined_support import train, trials_on_path

RAW: dict[str, Any] = {
    "name": "det-hooks", "entrypoint": "model_def:RegressionTrial",
    "hyperparameters": {"global_batch_size": 32, "learning_rate": 0.05},
    "searcher": {"name": "single", "metric": "validation_loss", "max_length": {"batches": 8}},
    "min_validation_period": {"batches": 4}, "min_checkpoint_period": {"batches": 4}, "scheduling_unit": 2,
}


@pytest.fixture(autouse=True)
def _trials_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from trials_on_path(monkeypatch, ("model_def", "data"))


def _train(run_dir: Path, trial_class: Any, **changes: Any) -> tuple[Trainer, dict[str, Any]]:
    return train(RAW, run_dir, trial_class, **changes)


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


# ------------------------------------------------------------------------------------------------ reducers


class _MaxError(MetricReducer):
    """The largest absolute error over every slot's records (not a mean: the default reduction cannot give it)."""

    def __init__(self) -> None:
        self.largest = 0.0
        self.resets = 0

    def reset(self) -> None:
        self.largest, self.resets = 0.0, self.resets + 1

    def update(self, errors: torch.Tensor) -> None:
        self.largest = max(self.largest, float(errors.max()))

    def per_slot_reduce(self) -> float:
        return self.largest

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> float:
        return max(per_slot_metrics)


def _median(values: list[torch.Tensor]) -> float:
    return float(torch.cat(values).median())


def _quantiles(values: list[torch.Tensor]) -> dict[str, float]:
    errors = torch.cat(values)
    return {"error_q25": float(errors.quantile(0.25)), "error_q75": float(errors.quantile(0.75))}


class _Reduced(_Regression):
    def __init__(self, context: PyTorchTrialContext) -> None:
        super().__init__(context)
        self.max_error = context.wrap_reducer(_MaxError(), name="max_error", for_training=False)
        self.median = context.wrap_reducer(_median, name="median_error", for_training=False)
        self.quantiles = context.wrap_reducer(_quantiles, for_training=False)
        self.trained = context.wrap_reducer(lambda counts: sum(counts), name="records_trained", for_validation=False)

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        self.trained.update(len(batch[0]))
        return super().train_batch(batch, epoch_idx, batch_idx)

    def evaluate_batch(self, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        errors = (self.model(inputs) - targets).abs()
        self.max_error.update(errors)
        self.median.update(errors)
        self.quantiles.update(errors)
        return {"validation_loss": float(errors.pow(2).mean())}


class _Recorder(PyTorchCallback):
    """Records every hook it is given, and counts validations in a state kept by checkpoints."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.validations = 0

    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: str | None) -> None:
        self.calls.append(("startup", (first_batch_idx, checkpoint_uuid)))

    def on_trial_shutdown(self) -> None:
        self.calls.append(("shutdown", None))

    def on_training_start(self) -> None:
        self.calls.append(("training_start", None))

    def on_training_epoch_start(self, epoch_idx: int) -> None:
        self.calls.append(("epoch_start", epoch_idx))

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        self.calls.append(("epoch_end", epoch_idx))

    def on_training_workload_end(self, avg_metrics: dict[str, Any], batch_metrics: list[dict[str, Any]]) -> None:
        self.calls.append(("workload_end", (avg_metrics, batch_metrics)))

    def on_validation_start(self) -> None:
        self.calls.append(("validation_start", None))

    def on_validation_end(self, metrics: dict[str, Any]) -> None:
        self.validations += 1
        self.calls.append(("validation_end", metrics))

    def on_checkpoint_save_start(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["note"] = f"saved after {self.validations} validations"
        self.calls.append(("save_start", dict(checkpoint)))

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        self.calls.append(("write_end", (checkpoint_dir, (Path(checkpoint_dir) / "model.pt").is_file())))

    def on_checkpoint_upload_end(self, uuid: str) -> None:
        self.calls.append(("upload_end", uuid))

    def on_checkpoint_load_start(self, checkpoint: dict[str, Any]) -> None:
        self.calls.append(("load_start", checkpoint))

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validations = state_dict["validations"]


class _Called(_Reduced):
    def build_callbacks(self) -> dict[str, PyTorchCallback]:
        self.recorder = _Recorder()
        return {"recorder": self.recorder}


def test_custom_reducers_give_metrics_over_all_records(tmp_path: Path) -> None:
    from data import regression

    trainer, _ = _train(tmp_path / "run", _Called.__dtrain_trial__())
    metrics = trainer.state.validation_history[-1]["metrics"]
    inputs, targets = regression(40, seed=2).tensors
    with torch.no_grad():
        errors = (trainer.model(inputs) - targets).abs()
    assert metrics["max_error"] == float(errors.max()) and metrics["median_error"] == float(errors.median())
    assert metrics["error_q25"] == float(errors.quantile(0.25)) and metrics["error_q75"] == float(errors.quantile(0.75))
    assert metrics["validation_loss"] == pytest.approx(float(errors.pow(2).mean()), rel=1e-12)
    assert "records_trained" not in metrics  # a training-only reducer
    reports = [args[0] for name, args in trainer.trial.det_trial.recorder.calls if name == "workload_end"]
    assert [r["records_trained"] for r in reports] == [64, 64, 64, 64]  # reset at each report (every 2 batches)
    assert trainer.trial.det_trial.max_error.resets >= 2  # reset before each validation


def test_reducers_combine_every_slot_s_values_and_bad_results_are_one_line() -> None:
    """Two slots simulated by the allgather: a function reducer sees the slots' values interleaved (batch order when
    each slot updates once per batch), a MetricReducer every slot's per-slot value."""
    other_slot: list[Any] = [[10.0, 30.0], 5.0]  # what the second slot's reducers hold
    reducers = Reducers(lambda mine: [mine, other_slot])
    ordered = reducers.wrap(lambda values: values, name="ordered", for_training=False, for_validation=True)
    largest = reducers.wrap(_MaxError(), name="largest", for_training=False, for_validation=True)
    ordered.update(0.0)  # type: ignore[attr-defined]
    ordered.update(20.0)  # type: ignore[attr-defined]
    ordered.update(40.0)  # type: ignore[attr-defined]
    largest.update(torch.tensor([7.0]))  # type: ignore[attr-defined]
    with pytest.raises(TrialError, match="ordered.*returned `ordered` of type list") as caught:
        reducers.reduce(for_training=False)
    reducers.wrapped[0].reducer.fn = lambda values: float(sum(v * i for i, v in enumerate(values)))  # type: ignore
    assert reducers.reduce(for_training=False) == {"ordered": 0 * 0 + 1 * 10 + 2 * 20 + 3 * 30 + 4 * 40,
                                                   "largest": 7.0}
    assert "\n" not in str(caught.value)
    with pytest.raises(TrialError, match="wrap each reducer once"):
        reducers.wrap(reducers.wrapped[1].reducer, name="again", for_training=False, for_validation=True)
    with pytest.raises(TrialError, match="give it a function"):
        reducers.wrap(42, name="x", for_training=False, for_validation=True)
    named_dict = Reducers(lambda mine: [mine])
    named_dict.wrap(lambda values: {"a": 1.0}, name="a", for_training=True, for_validation=False)
    with pytest.raises(TrialError, match="with a name it must return one value"):
        named_dict.reduce(for_training=True)


# ----------------------------------------------------------------------------------------------- callbacks


def test_every_callback_hook_is_called_at_its_point(tmp_path: Path) -> None:
    trainer, _ = _train(tmp_path / "run", _Called.__dtrain_trial__())
    calls = trainer.trial.det_trial.recorder.calls
    names = [name for name, _ in calls]
    checkpoint = ["save_start", "write_end", "upload_end"]
    assert names == ["startup", "training_start", "epoch_start", "workload_end", "workload_end",
                     "validation_start", "validation_end", *checkpoint, "workload_end", "epoch_end",
                     "workload_end", "validation_start", "validation_end", *checkpoint, "shutdown"]
    args = dict(calls[:2])
    assert args["startup"] == (0, None)
    first_report = calls[names.index("workload_end")][1]
    assert len(first_report[1]) == 2 and set(first_report[0]) >= {"loss", "records_trained"}  # 2 batches a report
    assert all(isinstance(m["loss"], float) for m in first_report[1])
    ends = [args for name, args in calls if name == "validation_end"]
    assert ends[0]["max_error"] >= ends[0]["median_error"] > 0
    written = [args for name, args in calls if name == "write_end"]
    assert [(Path(path).name, complete) for path, complete in written] == [("step-4", True), ("step-8", True)]
    assert [args for name, args in calls if name == "upload_end"] == ["step-4", "step-8"]
    assert calls[names.index("save_start")][1]["callbacks"] == {"recorder": {"validations": 1}}


def test_callback_state_is_saved_in_checkpoints_and_restored(tmp_path: Path) -> None:
    _train(tmp_path / "run", _Called.__dtrain_trial__(), faults={"stop_after_batch": 4})
    saved = load_checkpoint(find_resume_checkpoint(tmp_path / "run" / "checkpoints"))[1]["trial"]  # type: ignore
    assert saved == {"callbacks": {"recorder": {"validations": 1}}, "note": "saved after 1 validations"}
    trainer, summary = _train(tmp_path / "run", _Called.__dtrain_trial__())
    assert summary["resumes"] == 1
    recorder = trainer.trial.det_trial.recorder
    assert recorder.calls[0] == ("load_start", saved)
    assert recorder.calls[1] == ("startup", (4, "step-4"))
    assert recorder.validations == 2  # 1 restored + the validation at batch 8
