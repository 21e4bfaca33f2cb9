"""Determined's APIs on dtrain, in one process: the `determined` shim, a PyTorchTrial trained by dtrain's Trainer
(gradient aggregation, clip_grads, scheduler step modes, set_stop_requested), the Core API's checkpoints and
searcher outside a cluster, and the bad input that must be one clear line."""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.config import load_config
from dtrain.data.sharding import split_global_batch
from dtrain.determined import SHIM
from dtrain.determined.adapter import PyTorchTrial, adapter_for
from dtrain.determined.command import check_command, resolve_argv
from dtrain.determined.context import PyTorchTrialContext
from dtrain.determined.pytorch import DataLoader, LRScheduler
from dtrain.errors import ConfigError, InvalidHP, TrialError
from dtrain.train.trainer import Trainer
from dtrain.train.trial import TrialContext
from tests.unit.determined_support import train, trials_on_path

RAW: dict[str, Any] = {
    "name": "det-unit", "entrypoint": "model_def:RegressionTrial",
    "hyperparameters": {"global_batch_size": 32, "learning_rate": 0.05},
    "searcher": {"name": "single", "metric": "validation_loss", "max_length": {"batches": 8}},
    "min_validation_period": {"batches": 4}, "scheduling_unit": 2,
}


@pytest.fixture(autouse=True)
def _trials_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from trials_on_path(monkeypatch, ("model_def", "data", "native"))


def _train(run_dir: Path, trial_class: Any, **changes: Any) -> tuple[Trainer, dict[str, Any]]:
    return train(RAW, run_dir, trial_class, **changes)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in trainer.model.state_dict().items()}


def _context(**changes: Any) -> PyTorchTrialContext:
    raw = copy.deepcopy(RAW)
    raw.update(changes)
    config = load_config(None, raw=raw).config
    trial_context = TrialContext(hparams=config.hyperparameters, rank=0, world_size=1, local_rank=0,
                                 batch_split=split_global_batch(32, 1), device=torch.device("cpu"), seed=0,
                                 experiment_config=config)
    return PyTorchTrialContext(trial_context, config)


def test_the_shim_is_determined_when_the_real_package_is_absent() -> None:
    import determined
    from determined import core, pytorch

    assert str(SHIM) in str(determined.__file__)
    assert determined.InvalidHP is InvalidHP and isinstance(determined.LOG_FORMAT, str)
    assert pytorch.PyTorchTrial is PyTorchTrial and core.init is importlib.import_module("dtrain.determined.core").init
    assert determined.get_cluster_info() is None or "DTRAIN_RUN_DIR" in __import__("os").environ
    with pytest.raises(ImportError, match="dtrain trains PyTorch models only"):
        importlib.import_module("determined.keras")


@pytest.mark.parametrize("changes", [
    {"optimizations": {"aggregation_frequency": 1}},
    {"optimizations": {"aggregation_frequency": 2, "average_aggregated_gradients": True}},
    {"large_batch": {"optimizer": "lars", "base_lr": 0.05, "lr_scaling": "linear", "base_batch_size": 16,
                     "warmup_epochs": 0.5}},
], ids=["plain", "aggregation-2", "large-batch-lars"])
def test_a_pytorch_trial_trains_exactly_like_the_native_trial(tmp_path: Path, changes: dict[str, Any]) -> None:
    """Through dtrain's Trainer, with gradient aggregation or a large_batch recipe (the config's optimizer and
    rate schedule then replace the trial's, for both)."""
    from model_def import RegressionTrial
    from native import NativeRegression

    native, _ = _train(tmp_path / "native", NativeRegression, **changes)
    adapted, summary = _train(tmp_path / "legacy", RegressionTrial.__dtrain_trial__(), **changes)
    assert summary["status"] == "completed" and summary["steps_completed"] == 8
    expected = _weights(native)
    for name, value in _weights(adapted).items():
        assert torch.equal(value, expected[name]), name


class _Clipped(PyTorchTrial):
    """Clips every gradient to a tiny norm: if clip_grads ran before the step, the weights barely move."""

    def __init__(self, context: PyTorchTrialContext) -> None:
        from data import network

        self.context = context
        self.model = context.wrap_model(network())
        self.opt = context.wrap_optimizer(torch.optim.SGD(self.model.parameters(), lr=1.0))
        self.start = {k: v.clone() for k, v in self.model.state_dict().items()}

    def build_training_data_loader(self) -> DataLoader:
        from data import regression

        return DataLoader(regression(64, seed=1), batch_size=self.context.get_per_slot_batch_size())

    build_validation_data_loader = build_training_data_loader

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
        loss = torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])
        self.context.backward(loss)
        self.context.step_optimizer(self.opt, clip_grads=lambda params: torch.nn.utils.clip_grad_norm_(params, 1e-6))
        if batch_idx == 2:
            self.context.set_stop_requested(True)
        return loss

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"validation_loss": torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])}


def test_clip_grads_runs_before_the_step_and_stop_requested_ends_the_run(tmp_path: Path) -> None:
    trainer, summary = _train(tmp_path / "clipped", _Clipped.__dtrain_trial__())
    trial = trainer.trial.det_trial  # type: ignore[attr-defined]
    moved = sum(float((v - trial.start[k]).pow(2).sum()) for k, v in trainer.model.state_dict().items()) ** 0.5
    assert 0 < moved <= 4 * 1e-6 + 1e-12  # at most lr * 1e-6 per update, 4 updates
    assert summary["status"] == "completed" and summary["steps_completed"] == 4  # asked at batch 3, met at 4


@pytest.mark.parametrize(("mode", "frequency", "steps"), [
    (LRScheduler.StepMode.STEP_EVERY_BATCH, 1, 8), (LRScheduler.StepMode.STEP_EVERY_BATCH, 2, 4),
    (LRScheduler.StepMode.STEP_EVERY_EPOCH, 1, 4), (LRScheduler.StepMode.MANUAL_STEP, 1, 0)])
def test_scheduler_step_modes(mode: LRScheduler.StepMode, frequency: int, steps: int) -> None:
    from dtrain.determined.adapter import _SchedulerSteps

    context = _context()
    context._ctx.batches_per_epoch = 2
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    wrapped = context.wrap_lr_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), mode, frequency)
    stepping = _SchedulerSteps(wrapped, context._ctx)
    for _ in range(8):
        optimizer.step()
        stepping.step()
    assert optimizer.param_groups[0]["lr"] == 0.5 ** steps


class _NoOptimizer(PyTorchTrial):
    def __init__(self, context: PyTorchTrialContext) -> None:
        self.context = context
        self.model = context.wrap_model(torch.nn.Linear(2, 1))


def test_a_trial_that_never_wraps_its_optimizer_is_one_line() -> None:
    adapter = adapter_for(_NoOptimizer)
    context = _context()
    trial = adapter(context._ctx)
    with pytest.raises(TrialError, match=r"never called context.wrap_optimizer\(optimizer\)") as caught:
        trial.build_model()
    assert "\n" not in str(caught.value)


def test_step_optimizer_on_an_unwrapped_optimizer_is_one_line() -> None:
    context = _context()
    model = context.wrap_model(torch.nn.Linear(2, 1))
    context.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    stray = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TrialError, match="that context.wrap_optimizer\\(\\) did not return") as caught:
        context.step_optimizer(stray)
    assert "\n" not in str(caught.value)


def test_wrap_calls_dtrain_does_not_have_are_one_line() -> None:
    context = _context(optimizations={"aggregation_frequency": 2})
    model = context.wrap_model(torch.nn.Linear(2, 1))
    with pytest.raises(TrialError, match="set the config key instead"):
        context.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=4)
    with pytest.raises(TrialError, match="wrap_model\\(\\) got the same model twice"):
        context.wrap_model(model)
    with pytest.raises(TrialError, match="wrap_optimizer\\(\\) got the same optimizer twice"):
        optimizer = context.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        context.wrap_optimizer(optimizer)


def test_train_batch_without_backward_or_step_is_one_line() -> None:
    context = _context()
    model = context.wrap_model(torch.nn.Linear(2, 1))
    optimizer = context.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    context._start_batch(model, 0)
    with pytest.raises(TrialError, match="did not call context.backward"):
        context._end_batch()
    context._start_batch(model, 0)
    context.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(TrialError, match="but not context.step_optimizer"):
        context._end_batch()
    context._start_batch(model, 0)
    context.backward(model(torch.ones(1, 2)).sum())
    context.step_optimizer(optimizer)
    assert context._end_batch().requires_grad


def test_calls_to_the_wrapped_model_go_through_the_strategy_wrapper_during_train_batch() -> None:
    context = _context()
    model = context.wrap_model(torch.nn.Linear(2, 1))
    seen: list[str] = []

    class Wrapper(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append("wrapper")
            return model(x)  # the wrapper calls the module back, which then runs its own forward

    context._start_batch(Wrapper(), 0)
    out = model(torch.ones(1, 2))
    context._forward_target = None
    model(torch.ones(1, 2))
    assert seen == ["wrapper"] and out.shape == (1, 1)
    assert isinstance(model, torch.nn.Linear) and set(model.state_dict()) == {"weight", "bias"}


def test_a_command_that_is_not_found_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    check_command(["python3", "train.py", "--epochs", "1"], tmp_path)
    check_command(["python3", "-m", "somewhere"], tmp_path)
    for argv, named in ((["python3", "trian.py"], "script trian.py does not exist"),
                        (["./launch.sh"], "is not an executable file"),
                        (["no-such-program-xyz", "--x"], "program no-such-program-xyz is not found")):
        with pytest.raises(ConfigError, match=named) as caught:
            check_command(argv, tmp_path)
        assert "\n" not in str(caught.value)
    assert resolve_argv(["python3", "train.py"]) == [sys.executable, "train.py"]
    assert resolve_argv(["python", "-u", "t.py"])[0] == sys.executable


def test_dtrain_run_stops_before_launch_on_a_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    from dtrain.cli import main

    config = tmp_path / "exp.yaml"
    config.write_text("entrypoint: python3 -m determined.launch.torch_distributed python3 trian.py\n"
                      "searcher: {name: single, metric: loss}\n")
    code = main(["run", str(config), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "script trian.py does not exist" in err[0], err
    assert not (tmp_path / "run").exists()


def test_core_api_outside_dtrain_checkpoints_and_gives_the_configured_length(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from determined import core

    monkeypatch.delenv("DTRAIN_RUN_DIR", raising=False)
    with core.init(checkpoint_storage=str(tmp_path)) as context:
        with context.checkpoint.store_path({"steps_completed": 3}) as (path, storage_id):
            (path / "w.txt").write_text("3")
        with context.checkpoint.restore_path(storage_id) as restored:
            assert (restored / "w.txt").read_text() == "3"
        assert context.checkpoint.get_metadata(storage_id)["steps_completed"] == 3
        assert not context.preempt.should_preempt() and context.distributed.get_size() == 1
        with pytest.raises(ConfigError, match="needs searcher.max_length"):
            list(context.searcher.operations())
        with pytest.raises(TrialError, match="does not exist"):
            with context.checkpoint.restore_path("nope"):
                pass


class _FakeLink:
    """A search link whose searcher stops the trial at its second report (as ASHA at a rung)."""

    def __init__(self) -> None:
        self.reports: list[tuple[dict[str, float], float]] = []

    @property
    def max_length(self) -> tuple[int, str]:
        return 6, "batches"

    def report(self, units: dict[str, float], metric: float) -> str | None:
        self.reports.append((dict(units), metric))
        return "not in the top 1 of 2 at rung 1" if len(self.reports) == 2 else None


def test_a_core_api_loop_stops_where_the_searcher_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Core API loop in Determined's style: train to op.length, report validation every 2 batches, leave when
    preempt.should_preempt() says so; the searcher (the search link) stops it at its second report."""
    from determined import core

    import dtrain.determined.core as det_core

    link = _FakeLink()
    monkeypatch.delenv("DTRAIN_RUN_DIR", raising=False)
    with core.init(checkpoint_storage=str(tmp_path)) as context:
        context._run.link = link  # what a trial of a search gets from search-trial.json
        context._run.config = {"searcher": {"metric": "validation_loss"}}
        trained = 0
        for op in context.searcher.operations():
            assert op.length == 6
            for batch in range(op.length):
                trained = batch + 1
                if trained % 2 == 0:
                    context.train.report_validation_metrics(trained, {"validation_loss": 1.0 / trained})
                    op.report_progress(trained)
                    if context.preempt.should_preempt():
                        break
        assert trained == 4 and [units["batches"] for units, _ in link.reports] == [2.0, 4.0]
        assert list(context.searcher.operations()) == []  # no more work once the searcher stopped the trial
    assert det_core.PreemptMode.WorkersAskChief.value == "WORKERS_ASK_CHIEF"


def test_a_grad_scaler_is_unscaled_before_the_step(tmp_path: Path) -> None:
    """Determined's AMP pattern without apex: backward(scaler.scale(loss)), step_optimizer(opt, scaler=scaler).
    Scaling by a power of two and unscaling before the step is exact: the weights equal the unscaled trial's."""
    from model_def import RegressionTrial

    class Scaled(RegressionTrial):
        def __init__(self, context: PyTorchTrialContext) -> None:
            super().__init__(context)
            self.scaler = context.wrap_scaler(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> Any:
            inputs, targets = batch
            loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
            self.context.backward(self.scaler.scale(loss))
            self.context.step_optimizer(self.optimizer, scaler=self.scaler)
            return {"loss": loss}

    plain, _ = _train(tmp_path / "plain", RegressionTrial.__dtrain_trial__())
    scaled, summary = _train(tmp_path / "scaled", Scaled.__dtrain_trial__())
    assert summary["status"] == "completed"
    expected = _weights(plain)
    for name, value in _weights(scaled).items():
        assert torch.equal(value, expected[name]), name
    scaler = scaled.trial.det_trial.scaler  # type: ignore[attr-defined]
    assert scaler._get_growth_tracker() == 8  # update() after each of the 8 steps, none overflowed


def test_trainer_api_local_mode_without_a_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python3 train.py` by hand (Determined's local mode): init(hparams=...) and fit(max_length=...) train in this
    process, in a run dir of its own; without global_batch_size the data loader's batch size gives it."""
    from model_def import RegressionTrial

    from dtrain.determined.trainer_api import Trainer as DetTrainer
    from dtrain.determined.trainer_api import init

    class LoaderSized(RegressionTrial):
        def build_training_data_loader(self) -> DataLoader:
            from data import regression

            return DataLoader(regression(256, seed=1), batch_size=16)

        build_validation_data_loader = build_training_data_loader

    for name in ("DTRAIN_RUN_DIR", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # restored (or removed) after the test: init() sets DTRAIN_RUN_DIR
        monkeypatch.delenv(name)
    monkeypatch.setenv("DTRAIN_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    import determined as det
    import torch.distributed as dist
    from determined import pytorch

    assert det.get_cluster_info() is None  # off-cluster, before init() makes a run dir
    try:
        with init(hparams={"learning_rate": 0.05}) as context:
            with pytest.raises(TrialError, match="needs hyperparameters.global_batch_size"):
                context.get_per_slot_batch_size()
            trial = LoaderSized(context)
            summary = DetTrainer(trial, context).fit(max_length=pytorch.Batch(4),
                                                     validation_period=pytorch.Batch(2))
    finally:
        if dist.is_initialized():  # the one-process group init() made
            dist.destroy_process_group()
    assert summary["status"] == "completed" and summary["steps_completed"] == 4
    assert summary["global_batch_size"] == 16 and [e["step"] for e in summary["validation_history"]] == [2, 4]
    assert context.get_per_slot_batch_size() == 16
