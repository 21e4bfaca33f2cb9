"""Strategies as plug-ins: the registry, which protocols each built-in strategy implements, and the Trainer (one
process, in-process) running a strategy that implements only the core protocol, and one that implements every
extension, against the built-in allreduce strategy."""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtrain import sync
from dtrain.comm import Topology
from dtrain.config import Distributed as DistributedSection
from dtrain.config import ExperimentConfig, is_built, load_config
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.runs.store import RunStore
from dtrain.sync import (
    AllReduceStrategy,
    AsynchronousPacing,
    CollectiveForward,
    ComputePhases,
    Consolidating,
    EvaluatesInStages,
    HoldsModelParts,
    OwnsCheckpointState,
    ParameterServerStrategy,
    PipelineStrategy,
    RunsForwardBackward,
    ShardedConstruction,
    StrategyBase,
    SyncStrategy,
    TrainBatch,
    WritesShardedCheckpoint,
    build_strategy,
)
from dtrain.sync.fsdp import FsdpStrategy
from dtrain.sync.zero import Zero1Strategy
from dtrain.train.trainer import Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ONE_PROCESS = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                       device=torch.device("cpu"), launcher="none")
EXTENSIONS = (AsynchronousPacing, CollectiveForward, Consolidating, EvaluatesInStages, HoldsModelParts,
              OwnsCheckpointState, RunsForwardBackward, ShardedConstruction, WritesShardedCheckpoint)
DEFAULTED = ("observe_buckets", "observe_waits", "take_wire_stats", "metrics", "wrap_optimizer")  # on StrategyBase


def _overridden(strategy: object) -> set[str]:
    """The hooks with StrategyBase defaults that `strategy`'s class overrides."""
    return {hook for hook in DEFAULTED if getattr(type(strategy), hook) is not getattr(StrategyBase, hook)}
RAW: dict[str, Any] = {
    "name": "plugins", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 24, "learning_rate": 0.5, "momentum": 0.9, "float64": True,
                        "hidden": 16},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": 12}},
    "min_validation_period": {"batches": 4}, "min_checkpoint_period": {"batches": 4}, "scheduling_unit": 2,
    "optimizations": {"aggregation_frequency": 2},
    "reproducibility": {"experiment_seed": 3},
}


# ---------------------------------------------------------------------------------------------- registry


def test_every_strategy_the_config_accepts_is_registered() -> None:
    names = typing.get_args(DistributedSection.model_fields["strategy"].annotation)
    built = {name for name in names if is_built("distributed.strategy", name)}
    assert built and built <= set(sync.REGISTRY)


def test_every_strategy_has_one_spec_one_config_section_and_one_name() -> None:
    from dtrain.config import StrategyName, StrategySection, strategy_names

    assert set(sync.REGISTRY) == set(typing.get_args(StrategyName)) == set(strategy_names())
    for name, spec in sync.REGISTRY.items():
        assert spec.name == name
        assert isinstance(getattr(DistributedSection(), name), StrategySection)


def test_a_collective_forward_marker_is_read_by_its_value() -> None:
    class Declines:
        collective_forward = False

    class Declares:
        collective_forward = True

    assert isinstance(Declines(), CollectiveForward) and not sync.forward_is_collective(Declines())
    assert sync.forward_is_collective(Declares()) and sync.forward_is_collective(FsdpStrategy(ONE_PROCESS))
    assert not sync.forward_is_collective(object())


def test_an_unregistered_strategy_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sync.REGISTRY, "allreduce")
    with pytest.raises(ValueError, match="strategy 'allreduce' is not built; registered: .*parameter_server"):
        build_strategy(load_config(None, raw=copy.deepcopy(RAW)).config, ONE_PROCESS)


def test_the_defaulted_hooks_do_what_an_absent_extension_did() -> None:
    base = StrategyBase()
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert base.take_wire_stats() is None and base.metrics() == {} and base.wrap_optimizer(optimizer) is optimizer
    assert base.observe_buckets(None) is None and base.observe_waits(None) is None


def test_allreduce_is_the_core_plus_bucket_observation_wire_metering_and_consolidation() -> None:
    strategy = build_strategy(load_config(None, raw=copy.deepcopy(RAW)).config, ONE_PROCESS)
    assert isinstance(strategy, AllReduceStrategy) and isinstance(strategy, SyncStrategy)
    assert {kind for kind in EXTENSIONS if isinstance(strategy, kind)} == {Consolidating}
    assert _overridden(strategy) == {"observe_buckets", "take_wire_stats"}
    strategy.consolidate(snapshot=True)  # one process: nothing to rebuild


def test_local_sgd_and_hierarchical_are_registered_with_their_extensions() -> None:
    raw = copy.deepcopy(RAW)
    raw["distributed"] = {"strategy": "local_sgd"}
    local = build_strategy(load_config(None, raw=raw).config, ONE_PROCESS)
    assert {kind for kind in EXTENSIONS if isinstance(local, kind)} == {Consolidating, OwnsCheckpointState}
    assert _overridden(local) == {"take_wire_stats", "metrics"}
    raw["distributed"] = {"strategy": "hierarchical"}
    assert build_strategy(load_config(None, raw=raw).config, ONE_PROCESS).name == "hierarchical"


def test_zero1_adds_a_sharded_optimizer_and_its_checkpoint_state_to_allreduce() -> None:
    strategy = Zero1Strategy(ONE_PROCESS)  # Consolidating: allreduce's fresh DDP wrapper before checkpoints
    assert {kind for kind in EXTENSIONS if isinstance(strategy, kind)} == {OwnsCheckpointState, Consolidating}
    assert _overridden(strategy) == {"observe_buckets", "take_wire_stats", "wrap_optimizer"}


def test_fsdp_is_the_core_plus_sharded_construction_collective_forward_checkpoint_state_and_waits() -> None:
    strategy = FsdpStrategy(ONE_PROCESS)  # no Consolidating: no plain copy of the model to refresh
    assert isinstance(strategy, SyncStrategy)
    assert {kind for kind in EXTENSIONS if isinstance(strategy, kind)} == {
        ShardedConstruction, CollectiveForward, OwnsCheckpointState, WritesShardedCheckpoint}
    assert _overridden(strategy) == {"observe_waits"}


def test_pipeline_is_the_core_plus_its_per_stage_construction_schedule_checkpoints_and_checks() -> None:
    strategy = object.__new__(PipelineStrategy)  # its constructor builds a device mesh
    strategy.evaluation_replica, strategy.evaluation_replicas = 0, 1
    assert isinstance(strategy, SyncStrategy)
    assert {kind for kind in EXTENSIONS if isinstance(strategy, kind)} == {
        ShardedConstruction, RunsForwardBackward, Consolidating, OwnsCheckpointState, WritesShardedCheckpoint,
        EvaluatesInStages, HoldsModelParts}
    assert _overridden(strategy) == {"observe_waits"}


def test_parameter_server_is_the_core_plus_pacing_consolidation_and_metrics() -> None:
    strategy = object.__new__(ParameterServerStrategy)  # its constructor joins an RPC group
    strategy.lockstep = False
    assert isinstance(strategy, SyncStrategy)
    assert {kind for kind in EXTENSIONS if isinstance(strategy, kind)} == {AsynchronousPacing, Consolidating}
    assert _overridden(strategy) == {"metrics"}


# ------------------------------------------------------------------------------------ strategies to plug in


class CoreOnly(StrategyBase):
    """The core protocol and nothing else (StrategyBase's defaults for its hooks): every rank applies its own
    gradient (one process here)."""

    name = "core_only"

    def __init__(self) -> None:
        self.model: nn.Module | None = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.model = model
        return model

    def unwrap_model(self) -> nn.Module:
        assert self.model is not None
        return self.model

    def no_sync(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def close(self) -> None:
        self.model = None


class EveryExtension(CoreOnly):
    """The core and every extension: forward/backward over two microbatches, an optimizer it hands back, its own
    checkpoint state (the plain one, counted), consolidation and a metric of its own; lockstep pacing."""

    name = "every_extension"
    lockstep = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def steps_done(self, step: int) -> int:
        self._count("steps_done")
        return step

    def consolidate(self, *, snapshot: bool = False) -> None:
        self._count("consolidate_snapshot" if snapshot else "consolidate")

    def observe_buckets(self, observer: Any, *, per_bucket: bool = False) -> None:
        self._count("observe_buckets")

    def take_wire_stats(self) -> None:
        self._count("take_wire_stats")

    def metrics(self) -> dict[str, float]:
        return {"every_extension_reports": 1.0}

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._count("wrap_optimizer")
        return optimizer

    def forward_backward(self, model: nn.Module, batch: Any, train_batch: TrainBatch, *, loss_scale: float,
                         communicate: bool, phases: ComputePhases) -> Mapping[str, Any]:
        self._count("forward_backward")
        images, labels = batch
        half = len(labels) // 2
        model.train()
        losses = []
        for part in (slice(0, half), slice(half, None)):
            with phases.forward():
                outputs = train_batch((images[part], labels[part]), model)
            with phases.backward():
                (outputs["loss"] * loss_scale / 2).backward()
            losses.append(outputs["loss"].detach())
        return {"loss": sum(losses) / 2}

    def model_state_dict(self) -> dict[str, Any]:
        self._count("model_state_dict")
        return self.unwrap_model().state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self._count("load_model_state_dict")
        self.unwrap_model().load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self._count("optimizer_state_dict")
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self._count("load_optimizer_state_dict")
        optimizer.load_state_dict(state)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny float64 matrices: torch's thread pool only costs time here (a lot of it on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(run_dir: Path, raw: Mapping[str, Any], strategy: SyncStrategy | None,
           monkeypatch: pytest.MonkeyPatch) -> tuple[Trainer, dict[str, Any]]:
    """One in-process run on the digits fixture with `strategy` registered as `allreduce` (None: the real one)."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    from digits_trial import DigitsTrial

    registered = sync.REGISTRY["allreduce"]
    monkeypatch.setitem(sync.REGISTRY, "allreduce", registered if strategy is None else
                        dataclasses.replace(registered, build=lambda config, topology: strategy))
    config: ExperimentConfig = load_config(None, raw=copy.deepcopy(dict(raw))).config
    if not (run_dir / "config.yaml").is_file():
        prepare_run_dir(config, run_dir, FIXTURES)
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=ONE_PROCESS, run_info=load_run_info(run_dir))
    return trainer, trainer.fit()


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in trainer.model.state_dict().items()}


def test_a_core_only_strategy_trains_like_allreduce_with_the_default_behaviours(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, _ = _train(tmp_path / "allreduce", RAW, None, monkeypatch)
    trainer, summary = _train(tmp_path / "core", RAW, CoreOnly(), monkeypatch)
    assert summary["status"] == "completed" and summary["steps_completed"] == 12
    assert summary["strategy"] == {"name": "core_only"}
    assert summary["communication"]["communicating_steps"] == 0  # the default take_wire_stats: nothing counted
    assert [v["step"] for v in summary["validation_history"]] == [4, 8, 12]
    expected = _weights(reference)
    for name, value in _weights(trainer).items():
        assert torch.equal(value, expected[name]), name


def test_a_core_only_strategy_resumes_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole, _ = _train(tmp_path / "whole", RAW, CoreOnly(), monkeypatch)
    stopped_raw = {**RAW, "faults": {"stop_after_batch": 6}}
    _, first = _train(tmp_path / "resumed", stopped_raw, CoreOnly(), monkeypatch)
    assert first["status"] == "stopped" and first["steps_completed"] == 6
    resumed, second = _train(tmp_path / "resumed", RAW, CoreOnly(), monkeypatch)
    assert second["status"] == "completed" and second["resumes"] == 1
    expected = _weights(whole)
    for name, value in _weights(resumed).items():
        assert torch.equal(value, expected[name]), name


def test_every_extension_is_used_where_the_protocol_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, _ = _train(tmp_path / "core", RAW, CoreOnly(), monkeypatch)
    strategy = EveryExtension()
    trainer, summary = _train(tmp_path / "every", RAW, strategy, monkeypatch)
    assert summary["status"] == "completed" and summary["strategy"] == {"name": "every_extension"}
    expected = _weights(reference)  # two half-batch backward passes at half scale: the same mean gradient
    for name, value in _weights(trainer).items():
        assert float((value - expected[name]).abs().max()) <= 1e-12 * float(expected[name].abs().max()), name
    checkpoints = 3  # after batches 4, 8, 12
    assert strategy.calls == {
        "wrap_optimizer": 1, "forward_backward": 12, "steps_done": 6, "take_wire_stats": 6,
        "consolidate": 3, "consolidate_snapshot": checkpoints,  # before each validation and checkpoint
        "model_state_dict": checkpoints, "optimizer_state_dict": checkpoints}  # one process: no observe_buckets
    run = load_run_info(tmp_path / "every")
    assert run.store is not None and run.trial_id is not None
    series = RunStore(run.store).metric_series(run.trial_id, "training")
    assert [step for step, _ in series["every_extension_reports"]] == [2, 4, 6, 8, 10, 12]

    resumed_strategy = EveryExtension()
    stopped = {**RAW, "faults": {"stop_after_batch": 6}}
    _train(tmp_path / "resumed", stopped, EveryExtension(), monkeypatch)
    _train(tmp_path / "resumed", RAW, resumed_strategy, monkeypatch)
    assert resumed_strategy.calls["load_model_state_dict"] == 1
    assert resumed_strategy.calls["load_optimizer_state_dict"] == 1
