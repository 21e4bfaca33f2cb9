"""Sharded and pipelined strategies on 2 real gloo processes equal one process training on the full batch
(float64, 5 steps, 1e-9 relative): ZeRO-1, FSDP2 (SGD with momentum, and LARS, whose trust ratio needs whole
tensors) and a 2-stage pipeline with GPipe and 1F1B over 4 microbatches. All cases run in one spawn."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtrain.comm import Topology, barrier
from dtrain.config import load_config
from dtrain.data.sharding import ShardedBatchSampler, split_global_batch
from dtrain.optim.lars import LARS
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.callbacks import StepCallback
from dtrain.train.rng import seed_everything
from dtrain.train.trainer import Trainer
from dtrain.train.trial import TrialContext

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STEPS = 5

RAW: dict[str, Any] = {
    "name": "sharded", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 24, "learning_rate": 0.3, "momentum": 0.9, "float64": True,
                        "hidden": 16},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": STEPS}},
    "reproducibility": {"experiment_seed": 11},
    "resources": {"slots_per_trial": 2},
}
LARS_SETTINGS = {"optimizer": "lars", "base_lr": 0.5, "momentum": 0.9, "weight_decay": 1e-3,
                 "trust_coefficient": 0.02}


def case(strategy: str, **distributed: Any) -> dict[str, Any]:
    raw = copy.deepcopy(RAW)
    raw["distributed"] = {"strategy": strategy, **distributed}
    return raw


UNEVEN_VALIDATION = {"hyperparameters": {**RAW["hyperparameters"], "validation_records": 359},
                     "data_loader": {"validation_batch_size": 179}}
CASES: dict[str, dict[str, Any]] = {
    "zero1": {**case("zero1"), **UNEVEN_VALIDATION},
    "fsdp": {**case("fsdp"), **UNEVEN_VALIDATION},
    "fsdp_keep_gathered": case("fsdp", fsdp={"reshard_after_forward": False}),
    "fsdp_lars": {**case("fsdp"), "large_batch": LARS_SETTINGS},
    "zero1_lars": {**case("zero1"), "large_batch": LARS_SETTINGS},
    "pipeline_gpipe": case("pipeline", pipeline={"stages": 2, "microbatches": 4, "schedule": "gpipe",
                                                 "split_points": ["2"]}),
    "pipeline_1f1b": case("pipeline", pipeline={"stages": 2, "microbatches": 4, "schedule": "1f1b"}),
    # every receive of a step posted when the step starts (distributed.pipeline.receives: ahead)
    "pipeline_gpipe_ahead": case("pipeline", pipeline={"stages": 2, "microbatches": 4, "schedule": "gpipe",
                                                       "receives": "ahead"}),
    "pipeline_1f1b_ahead": case("pipeline", pipeline={"stages": 2, "microbatches": 4, "schedule": "1f1b",
                                                      "receives": "ahead"}),
    # validation through the stages (the Trial defines pipeline_metrics): batches of 179, 179 and 1 records, cut
    # into microbatches of 45, 45, 45, 44 and one of 1
    "pipeline_1f1b_staged": {**case("pipeline", pipeline={"stages": 2, "microbatches": 4, "schedule": "1f1b"}),
                             "hyperparameters": {**UNEVEN_VALIDATION["hyperparameters"], "staged_validation": True},
                             "data_loader": UNEVEN_VALIDATION["data_loader"]},
}
# mixed precision runs (float32 model): they must keep every rank's scaler and parameters identical
PRECISION_CASES: dict[str, dict[str, Any]] = {
    "fsdp_fp16": {**case("fsdp"), "optimizations": {"precision": "fp16"},
                  "hyperparameters": {**RAW["hyperparameters"], "float64": False}},
    "zero1_bf16": {**case("zero1"), "optimizations": {"precision": "bf16"},
                   "hyperparameters": {**RAW["hyperparameters"], "float64": False}},
}


class _OverflowOnRank1:
    """A forward/backward stage that leaves a finite gradient on rank 0 and, at its second batch, an infinite one
    on rank 1 only (as an FSDP shard or a pipeline stage can see alone)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls = 0

    def forward_backward(self, model: torch.nn.Module, batch: Any, train_batch: Any, *, loss_scale: float,
                         communicate: bool, phases: Any) -> dict[str, Any]:
        self.calls += 1
        loss = model(batch).sum() * loss_scale
        loss.backward()
        if self.rank == 1 and self.calls == 2:
            next(model.parameters()).grad[0, 0] = float("inf")
        return {"loss": loss.detach()}


def _agreement(topology: Topology) -> dict[str, Any]:
    from contextlib import nullcontext

    from dtrain.train.guard import GracefulStop, UpdateGuard
    from dtrain.train.precision import MixedPrecision

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    stage = MixedPrecision(_OverflowOnRank1(topology.rank), "fp16", torch.device("cpu"), scaler, optimizer, True)
    phases = type("Phases", (), {"forward": lambda self: nullcontext(), "backward": lambda self: nullcontext()})()
    guard = UpdateGuard("abort", 0, GracefulStop())  # an overflow is not a non-finite gradient: no abort
    history = []
    for step in range(1, 4):
        outputs = stage.forward_backward(model, torch.ones(4, 3), None, loss_scale=1.0, communicate=True,
                                         phases=phases)
        if guard.decide(step, model.parameters(), stage.take_overflow()).overflow:
            stage.skip_update()
        optimizer.step()
        optimizer.zero_grad()
        history.append((float(outputs["loss_scale"]), stage.skipped))
    return {"history": history, "scale": float(scaler.get_scale()),
            "params": [p.detach().clone() for p in model.parameters()]}


def _pipeline_compute_spans(topology: Topology, schedule: str, receives: str) -> dict[str, Any]:
    """One step of a 2-stage pipeline (4 microbatches) whose bubble is timed: for every gradient this rank's stage
    computes, whether the stage's own-compute timer was open at that moment (the bubble is the schedule's time
    outside it), and how many bubbles were recorded."""
    from contextlib import nullcontext

    from dtrain.sync.pipeline import PipelineStrategy

    class Trial:
        def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(outputs, targets)

        def train_batch(self, batch: Any, model: torch.nn.Module) -> Any:
            raise NotImplementedError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    strategy = PipelineStrategy(topology, stages=2, microbatches=4, schedule=schedule, receives=receives)
    bubbles: list[float] = []
    strategy.observe_waits(lambda phase, seconds: bubbles.append(seconds))
    model = strategy.wrap_model(model)
    inside: list[bool] = []
    own = strategy._parts[strategy.stage_index]
    for parameter in own.parameters():
        parameter.register_hook(lambda grad: inside.append(strategy.computing) or grad)
    phases = type("Phases", (), {"forward": lambda self: nullcontext(), "backward": lambda self: nullcontext()})()
    strategy.forward_backward(model, (torch.randn(8, 6), torch.randint(0, 3, (8,))), Trial().train_batch,
                              loss_scale=1.0, communicate=True, phases=phases)
    return {"gradients_inside": inside, "parameters": len(list(own.parameters())), "bubbles": len(bubbles),
            "posted_at_first_forward": strategy._schedule._stage.posted_at_first_forward}


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with sharded tensors gathered whole (a collective under FSDP)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _local_bytes(tensors: Any) -> int:
    """Bytes this rank allocated for `tensors` (a DTensor by its local shard, a meta tensor as 0)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += 0 if local.is_meta else local.numel() * local.element_size()
    return total


def _held_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes this rank has allocated (storage actually held: a pipeline frees the other stages')."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() for p in model.parameters())


def _recording(trial_class: type, staged: bool = False) -> type:
    class Recording(trial_class):  # type: ignore[misc, valid-type]
        """Records the bytes the model held as build_model() returned it on this rank."""

        def build_model(self) -> torch.nn.Module:
            model = super().build_model()
            self.built_bytes = _local_bytes(model.parameters())
            self.model = model
            return model

        def build_validation_data(self) -> torch.utils.data.Dataset:
            """`validation_records` of them: 359 split 180/179 over 2 ranks, with validation_batch_size 179 rank 0
            evaluates 2 batches and rank 1 one (under FSDP it must run one more forward pass to keep rank 0
            company)."""
            data = super().build_validation_data()
            keep = self.context.hparams.get("validation_records")
            return data if keep is None else torch.utils.data.TensorDataset(*(t[:keep] for t in data.tensors))

    class StagedRecording(Recording):
        """Evaluates in pipeline stages (it has pipeline_metrics) and records the parameter bytes this rank held
        when each validation started and whenever it computed metrics."""

        validation_bytes: list[int]

        def validation_started(self) -> None:
            super().validation_started()
            self.validation_bytes = [*getattr(self, "validation_bytes", []), _held_bytes(self.model)]

        def pipeline_metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
            self.validation_bytes.append(_held_bytes(self.model))
            return {"loss": F.cross_entropy(outputs, targets),
                    "accuracy": (outputs.argmax(1) == targets).double().mean()}

    return StagedRecording if staged else Recording


class _HeldWhileTraining(StepCallback):
    """The largest number of parameter bytes this rank had allocated before any update (storage actually held:
    a pipeline frees the other stages' storage while training)."""

    def __init__(self) -> None:
        self.most = 0

    def before_update(self, step: int, model: torch.nn.Module) -> None:
        self.most = max(self.most, _held_bytes(model))


def _train_all(topology: Topology, root: str, cases: dict[str, dict[str, Any]], extras: bool = True
               ) -> dict[str, Any]:
    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    results: dict[str, Any] = {}
    for name, raw in cases.items():
        config = load_config(None, raw=raw).config
        run_dir = Path(root) / name
        if topology.rank == 0:
            prepare_run_dir(config, run_dir, FIXTURES)
        barrier()
        staged = bool(raw["hyperparameters"].get("staged_validation"))
        trainer = Trainer(config=config, trial_class=_recording(DigitsTrial, staged), topology=topology,
                          run_info=load_run_info(run_dir))
        held = _HeldWhileTraining()
        trainer.callbacks.register(held)
        summary = trainer.fit()
        assert summary["status"] == "completed", summary
        model = trainer.strategy.unwrap_model()
        results[name] = {"held_bytes": _local_bytes(model.parameters()), "built_bytes": trainer.trial.built_bytes,
                         "training_bytes": held.most,
                         "validation": [v["metrics"] for v in trainer.state.validation_history],
                         "waits": {phase: summary["profile"]["ranks"][topology.rank]["mean_seconds"].get(phase, 0.0)
                                   for phase in ("all_gather", "reduce_scatter", "bubble")},
                         "validation_bytes": getattr(trainer.trial, "validation_bytes", None),
                         "state": _whole(model), "identical": summary["replicas_identical"]}
        scaler = trainer.optimization.scaler
        if scaler is not None:  # fp16: the scale reached and the updates skipped for an overflow
            results[name]["scaling"] = (float(scaler.get_scale()), trainer.forward_backward.skipped)
    if not extras:
        return results
    results["agreement"] = _agreement(topology)
    results["compute_spans"] = {f"{schedule}_{receives}": _pipeline_compute_spans(topology, schedule, receives)
                                for schedule in ("gpipe", "1f1b") for receives in ("on_demand", "ahead")}
    results["memory"] = _model_state_bytes(topology)
    results["fsdp_resumed"] = _interrupted_and_resumed(topology, Path(root) / "fsdp_resumed", CASES["fsdp"])
    results["pipeline_resumed"] = _interrupted_and_resumed(topology, Path(root) / "pipeline_resumed",
                                                           CASES["pipeline_1f1b"])
    recut = case("pipeline", pipeline={"stages": 2, "microbatches": 4, "schedule": "gpipe", "split_points": ["3"]})
    results["pipeline_recut"] = _interrupted_and_resumed(topology, Path(root) / "pipeline_recut",
                                                         CASES["pipeline_gpipe"], recut)
    results["plain_into_pipeline"] = _interrupted_and_resumed(topology, Path(root) / "plain_into_pipeline",
                                                              case("zero1"), CASES["pipeline_1f1b"])
    return results


def _model_state_bytes(topology: Topology) -> dict[str, Any]:
    """One Adam step of a 4-layer MLP under each layout: this rank's bytes of parameters, gradients and optimizer
    state (DTensors by their local shard), and the parameter count. FSDP first: the bytes its model held when built
    under its `model_construction()`, and how many whole-sized 256 x 256 tensors are alive after its step and a
    validation-like forward (none may be: FSDP never keeps a whole parameter on a rank)."""
    import gc

    from dtrain.sync.allreduce import AllReduceStrategy
    from dtrain.sync.fsdp import FsdpStrategy
    from dtrain.sync.zero import Zero1Strategy

    measured: dict[str, Any] = {}
    for layout, kind in (("fsdp", FsdpStrategy), ("ddp", AllReduceStrategy), ("zero1", Zero1Strategy)):
        torch.manual_seed(0)
        strategy = kind(topology)
        with strategy.model_construction() if isinstance(strategy, FsdpStrategy) else contextlib.nullcontext():
            model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        measured[f"{layout}_built"] = _local_bytes(model.parameters())
        wrapped = strategy.wrap_model(model)
        optimizer: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
        if hasattr(strategy, "wrap_optimizer"):
            optimizer = strategy.wrap_optimizer(optimizer)
        wrapped(torch.randn(8, 256)).sum().backward()
        strategy.step(optimizer)
        states = getattr(optimizer, "optim", optimizer).state.values()  # ZeRO keeps its shard in .optim
        measured[layout] = (_local_bytes(model.parameters())
                            + _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
                            + _local_bytes(v for s in states for v in s.values() if isinstance(v, torch.Tensor)
                                           and v.numel() > 1))
        measured["parameters"] = sum(p.numel() for p in model.parameters())
        if layout == "fsdp":
            with torch.no_grad():
                strategy.unwrap_model().eval()(torch.randn(8, 256))
            gc.collect()
            measured["fsdp_whole_tensors"] = sum(
                1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and not hasattr(o, "to_local")
                and not o.is_meta and o.shape == (256, 256) and o.untyped_storage().nbytes() > 0)
        del model, wrapped, optimizer, strategy, states
    return measured


def _interrupted_and_resumed(topology: Topology, run_dir: Path, raw: dict[str, Any],
                             resumed_raw: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoints every 2 batches; the first attempt ends after batch 3 and its step-3 checkpoint is removed, as
    if it had been killed during batch 3; a second Trainer (with `resumed_raw` when given) resumes from step 2 and
    trains to the end."""
    import shutil

    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    every = {"min_checkpoint_period": {"batches": 2}, "checkpoint_storage": {"save_trial_latest": 3}}
    first = load_config(None, raw={**raw, **every, "faults": {"stop_after_batch": 3}}).config
    if topology.rank == 0:
        prepare_run_dir(first, run_dir, FIXTURES)
    barrier()
    trainer = Trainer(config=first, trial_class=DigitsTrial, topology=topology, run_info=load_run_info(run_dir))
    assert trainer.fit()["status"] == "stopped"
    resumed_from_shards = (run_dir / "checkpoints" / "sharded" / "step-2").is_dir()
    if topology.rank == 0:
        shutil.rmtree(run_dir / "checkpoints" / "step-3")
        (run_dir / "checkpoints" / "latest").write_text("step-2")
    barrier()
    second = load_config(None, raw={**(resumed_raw or raw), **every}).config
    trainer = Trainer(config=second, trial_class=DigitsTrial, topology=topology, run_info=load_run_info(run_dir))
    assert trainer.resumed and trainer.state.steps_completed == 2
    assert trainer.fit()["status"] == "completed"
    result: dict[str, Any] = {"state": _whole(trainer.strategy.unwrap_model()),
                              "resumed_from_shards": resumed_from_shards}
    if topology.rank == 0:  # the checkpoint's model.pt holds no weights: they are the ranks' shards
        from dtrain.commands.export import export_model

        final = run_dir / "checkpoints" / "step-5"
        result["model_pt"] = torch.load(final / "model.pt", weights_only=True)
        shards = run_dir / "checkpoints" / "sharded" / "step-5"
        result["shard_files"] = sorted(p.name for p in shards.iterdir()) if shards.exists() else []
        export_model(run_dir, run_dir / "exported.pt")
        result["exported"] = torch.load(run_dir / "exported.pt", weights_only=True)
    return result


def _reference(raw: dict[str, Any], make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
               ) -> dict[str, torch.Tensor]:
    """One process without the Trainer: each step trains on the whole global batch."""
    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    hp = raw["hyperparameters"]
    seed = raw["reproducibility"]["experiment_seed"]
    split = split_global_batch(hp["global_batch_size"], 1)
    trial = DigitsTrial(TrialContext(hparams=hp, rank=0, world_size=1, local_rank=0, batch_split=split,
                                     device=torch.device("cpu"), seed=seed))
    data = trial.build_training_data()
    seed_everything(seed)
    model = trial.build_model()
    optimizer = make_optimizer(model)
    images, labels = data.tensors
    order = list(ShardedBatchSampler(len(data), split, 0, seed, epoch=0))
    for step in range(STEPS):
        index = torch.tensor(order[step])
        optimizer.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        optimizer.step()
    return model.state_dict()


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=RAW["hyperparameters"]["learning_rate"],
                           momentum=RAW["hyperparameters"]["momentum"])


def _lars(model: torch.nn.Module) -> torch.optim.Optimizer:
    s = LARS_SETTINGS
    return LARS(model.parameters(), lr=s["base_lr"], momentum=s["momentum"], weight_decay=s["weight_decay"],
                trust_coefficient=s["trust_coefficient"])


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.fixture(scope="module")
def trained(spawn: Callable[..., list[Any]], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_train_all, 2, str(tmp_path_factory.mktemp("sharded")), {**CASES, **PRECISION_CASES},
                 timeout=240)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_training_equals_single_process(trained: list[dict[str, Any]], name: str) -> None:
    reference = _reference(CASES[name], _lars if name.endswith("lars") else _sgd)
    start = _reference({**CASES[name], "searcher": RAW["searcher"]}, lambda m: torch.optim.SGD(m.parameters(), lr=0))
    assert _relative(start, reference) > 1e-3  # the run moved the weights
    for rank in trained:
        assert _relative(rank[name]["state"], reference) < 1e-9
        assert rank[name]["identical"]
    assert all(torch.equal(trained[0][name]["state"][k], trained[1][name]["state"][k]) for k in reference)


@pytest.mark.parametrize("name", sorted(PRECISION_CASES))
def test_mixed_precision_keeps_ranks_identical(trained: list[dict[str, Any]], name: str) -> None:
    first, second = trained[0][name], trained[1][name]
    assert first["identical"] and second["identical"]
    assert all(torch.equal(first["state"][k], second["state"][k]) for k in first["state"])
    assert first.get("scaling") == second.get("scaling")
    if name.endswith("fp16"):
        assert first["scaling"] is not None


def test_an_overflow_on_one_rank_skips_the_update_on_every_rank(trained: list[dict[str, Any]]) -> None:
    """pytorch/pytorch#136009: rank 0's gradient stays finite, rank 1's overflows at update 2; both skip it
    and halve their scale, and their parameters stay equal."""
    first, second = trained[0]["agreement"], trained[1]["agreement"]
    assert first["history"] == second["history"] == [(1024.0, 0), (1024.0, 1), (512.0, 1)]
    assert first["scale"] == second["scale"] == 512.0
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"], strict=True))


@pytest.mark.parametrize("layout", ["ddp", "zero1", "fsdp"])
def test_plan_predicts_each_ranks_model_state_bytes_within_10_percent(trained: list[dict[str, Any]],
                                                                      layout: str) -> None:
    """dtrain plan's memory model (16 bytes per parameter with Adam: DDP whole, ZeRO-1 the Adam moments / N,
    FSDP all / N) against the bytes each rank really holds after an Adam step."""
    from dtrain.plan.memory import model_state_bytes

    for rank in trained:
        measured = rank["memory"][layout]
        predicted = model_state_bytes(rank["memory"]["parameters"], layout, 2, "adam").total_bytes
        assert abs(predicted - measured) / measured < 0.10, (layout, predicted, measured)
    assert trained[0]["memory"]["fsdp"] <= 0.55 * trained[0]["memory"]["ddp"]  # ideal 0.5 at 2 ranks


def test_fsdp_never_materializes_the_whole_model_on_a_rank(trained: list[dict[str, Any]]) -> None:
    """Rank 1 builds the model on the meta device (0 bytes of parameters), rank 0 builds it whole and gives it
    away; after training (and validation) each rank holds its half of the parameters, and no whole-sized plain
    parameter stays alive on any rank (the plain copy an earlier version kept for validation)."""
    for index, rank in enumerate(trained):
        memory = rank["memory"]
        assert memory["fsdp_built"] == (memory["ddp_built"] if index == 0 else 0)
        assert memory["ddp_built"] == memory["parameters"] * 4
        assert memory["fsdp_whole_tensors"] == 0
        for name, plain in (("fsdp", "zero1"), ("fsdp_lars", "zero1"), ("fsdp_fp16", "zero1_bf16")):
            whole = rank[plain]["held_bytes"]
            assert rank[plain]["built_bytes"] == whole
            assert rank[name]["built_bytes"] == (whole if index == 0 else 0), name
            assert 0.45 * whole <= rank[name]["held_bytes"] <= 0.55 * whole, name


@pytest.mark.parametrize("name", sorted({**CASES, **PRECISION_CASES}))
def test_fsdp_collectives_and_the_pipeline_bubble_are_phases_of_their_own(trained: list[dict[str, Any]],
                                                                          name: str) -> None:
    """dtrain diagnose's phases: FSDP's all-gathers and reduce-scatters and a pipeline stage's bubble are carved out
    of forward and backward (present, not compared in size), and no other strategy reports them."""
    expected = ({"all_gather", "reduce_scatter"} if name.startswith("fsdp")
                else {"bubble"} if name.startswith("pipeline") else set())
    for rank in trained:
        assert {phase for phase, seconds in rank[name]["waits"].items() if seconds > 0} == expected


@pytest.mark.parametrize("schedule", ["gpipe_on_demand", "1f1b_on_demand", "gpipe_ahead", "1f1b_ahead"])
def test_the_bubble_excludes_every_stages_own_backward(trained: list[dict[str, Any]], schedule: str) -> None:
    """A stage's bubble is its schedule's time outside its own compute; every gradient of its own parameters (4
    microbatches each) is computed inside that compute on both stages, the first stage included (whose input needs
    no gradient: a module's full backward hook fires there before the backward pass, so hooks counted the first
    stage's whole backward as bubble)."""
    for rank in trained:
        spans = rank["compute_spans"][schedule]
        assert spans["bubbles"] == 1
        assert len(spans["gradients_inside"]) == 4 * spans["parameters"] > 0
        assert all(spans["gradients_inside"]), spans


def test_receives_ahead_are_all_posted_before_the_first_forward(trained: list[dict[str, Any]]) -> None:
    """With `receives: ahead` each stage has posted its step's 4 receives (the second stage its activations, the
    first its gradients) before it computes anything; torch's own order posts them one at a time."""
    for rank in trained:
        for schedule in ("gpipe", "1f1b"):
            assert rank["compute_spans"][f"{schedule}_ahead"]["posted_at_first_forward"] == 4
            assert rank["compute_spans"][f"{schedule}_on_demand"]["posted_at_first_forward"] == 0


def test_fsdp_validation_with_unequal_batch_counts_per_rank_equals_zero1s(trained: list[dict[str, Any]]) -> None:
    """359 validation records in batches of 179: rank 0 evaluates 2 batches, rank 1 one plus, under FSDP, a forward
    pass whose outputs are dropped (without it FSDP's all-gathers would pair up wrongly). The metrics equal ZeRO-1's
    (the same weights within 1e-9) on both ranks."""
    for rank in trained:
        fsdp, zero1 = rank["fsdp"]["validation"], rank["zero1"]["validation"]
        assert fsdp and len(fsdp) == len(zero1)
        for sharded, plain in zip(fsdp, zero1, strict=True):
            assert sharded.keys() == plain.keys()
            assert all(sharded[k] == pytest.approx(plain[k], rel=1e-9) for k in plain), (sharded, plain)


def test_pipeline_validation_in_stages_equals_the_whole_model_and_holds_one_stage(
        trained: list[dict[str, Any]]) -> None:
    """With pipeline_metrics the validation batches run through the stages: the metrics equal ZeRO-1's (the same
    weights within 1e-9, the whole model on each rank) on both ranks, and every rank held only its own stage's
    parameters while it validated (no stage was gathered)."""
    stage_bytes = [(64 * 16 + 16) * 8, (16 * 10 + 10) * 8]
    for index, rank in enumerate(trained):
        staged, plain = rank["pipeline_1f1b_staged"]["validation"], rank["zero1"]["validation"]
        assert staged and len(staged) == len(plain)
        for mine, theirs in zip(staged, plain, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(mine[k] == pytest.approx(theirs[k], rel=1e-9) for k in theirs), (mine, theirs)
        held = rank["pipeline_1f1b_staged"]["validation_bytes"]
        assert held and set(held) == {stage_bytes[index]}
        assert len(held) == len(staged) * (4 if index == 1 else 1)  # the last stage computed 3 batches' metrics


def test_an_interrupted_pipeline_run_resumes_bitwise_identical(trained: list[dict[str, Any]]) -> None:
    """Each stage writes its own part of a pipeline checkpoint (DCP: one file per rank, model.pt without weights);
    resuming from it reads each rank's stage back and ends bitwise where the uninterrupted run ends, and `dtrain
    export` joins the stages into the whole model's final weights."""
    for rank in trained:
        uninterrupted = rank["pipeline_1f1b"]["state"]
        assert all(torch.equal(rank["pipeline_resumed"]["state"][k], uninterrupted[k]) for k in uninterrupted)
    chief = trained[0]["pipeline_resumed"]
    assert chief["model_pt"] == {}
    assert ".metadata" in chief["shard_files"] and len([f for f in chief["shard_files"] if f.endswith(".distcp")]) == 2
    exported = chief["exported"]
    assert set(exported) == set(trained[0]["pipeline_1f1b"]["state"])
    assert all(torch.equal(exported[k], trained[0]["pipeline_1f1b"]["state"][k]) for k in exported)


def test_a_pipeline_checkpoint_resumes_into_stages_cut_elsewhere(trained: list[dict[str, Any]]) -> None:
    """Written by stages cut before child 2 (Flatten, Linear | Tanh, Linear), resumed by stages cut before child 3
    (Flatten, Linear, Tanh | Linear): the shards are named by the whole model, so each new stage finds its tensors
    and optimizer state, and the run ends where the uninterrupted one does (1e-12, float64)."""
    for rank in trained:
        uninterrupted = rank["pipeline_gpipe"]["state"]
        assert _relative(rank["pipeline_recut"]["state"], uninterrupted) < 1e-12


def test_a_plain_checkpoint_resumes_into_pipeline_stages(trained: list[dict[str, Any]]) -> None:
    """A plain checkpoint (a whole model.pt and one optimizer state keyed by index: what ZeRO-1 writes, and what
    pipeline checkpoints were before they were written by stage) resumes into a pipeline, and the run ends where an
    uninterrupted pipeline run does (1e-9, float64)."""
    for rank in trained:
        assert _relative(rank["plain_into_pipeline"]["state"], rank["pipeline_1f1b"]["state"]) < 1e-9
    assert not trained[0]["plain_into_pipeline"]["resumed_from_shards"]  # step-2 was ZeRO-1's plain checkpoint
    assert trained[0]["pipeline_resumed"]["resumed_from_shards"]


@pytest.mark.parametrize("name", ["pipeline_gpipe", "pipeline_1f1b"])
def test_pipeline_ranks_hold_only_their_stage_while_training(trained: list[dict[str, Any]], name: str) -> None:
    """Stage 0 (Flatten, Linear(64, 16)) and stage 1 (Tanh, Linear(16, 10)) in float64: rank 0 builds the whole
    model (the initial weights), rank 1 builds it on the meta device (0 bytes) and receives its stage; before every
    update each rank has allocated only its own stage's parameters; the whole model is back for the final state."""
    stage_bytes = [(64 * 16 + 16) * 8, (16 * 10 + 10) * 8]
    for index, rank in enumerate(trained):
        assert rank[name]["built_bytes"] == (sum(stage_bytes) if index == 0 else 0)
        assert rank[name]["training_bytes"] == stage_bytes[index]
        assert sum(v.numel() * 8 for v in rank[name]["state"].values()) == sum(stage_bytes)


def test_an_interrupted_fsdp_run_resumes_bitwise_identical(trained: list[dict[str, Any]]) -> None:
    """Checkpoints of the FSDP run are each rank's shards (DCP): resuming from them ends bitwise where the
    uninterrupted run ends, and `dtrain export` joins them into a plain state_dict with the same weights."""
    for rank in trained:
        uninterrupted = rank["fsdp"]["state"]
        assert all(torch.equal(rank["fsdp_resumed"]["state"][k], uninterrupted[k]) for k in uninterrupted)
    chief = trained[0]["fsdp_resumed"]
    assert chief["model_pt"] == {}
    assert ".metadata" in chief["shard_files"] and len([f for f in chief["shard_files"] if f.endswith(".distcp")]) == 2
    exported = chief["exported"]
    assert set(exported) == set(trained[0]["fsdp"]["state"])
    assert all(torch.equal(exported[k], trained[0]["fsdp"]["state"][k]) for k in exported)


PIPELINE_X_DATA = {**case("pipeline", pipeline={"stages": 2, "microbatches": 4, "schedule": "1f1b"}),
                   "resources": {"slots_per_trial": 4}}


def test_pipeline_x_data_on_a_2x2_mesh_equals_single_process(spawn: Callable[..., list[Any]],
                                                             tmp_path: Path) -> None:
    """4 ranks: 2 pipeline replicas (data) x 2 stages; each replica trains on half the global batch in 4
    microbatches and the stages' gradients are averaged over the replicas. Validated in stages too, each replica
    on its half of the validation data, the metrics equal the whole model's."""
    staged = {**PIPELINE_X_DATA, "hyperparameters": {**PIPELINE_X_DATA["hyperparameters"], "staged_validation": True},
              "distributed": {**PIPELINE_X_DATA["distributed"],
                              "pipeline": {**PIPELINE_X_DATA["distributed"]["pipeline"], "receives": "ahead"}}}
    ranks = spawn(_train_all, 4, str(tmp_path), {"pipe_x_data": PIPELINE_X_DATA, "staged": staged}, False,
                  timeout=240)
    reference = _reference(PIPELINE_X_DATA, _sgd)
    stage_bytes = [(64 * 16 + 16) * 8, (16 * 10 + 10) * 8]  # rank d*p + s runs stage s
    for index, rank in enumerate(ranks):
        assert _relative(rank["pipe_x_data"]["state"], reference) < 1e-9
        assert _relative(rank["staged"]["state"], reference) < 1e-9  # its receives posted ahead
        assert rank["pipe_x_data"]["identical"]
        assert rank["pipe_x_data"]["built_bytes"] == (sum(stage_bytes) if index == 0 else 0)  # the others: meta
        assert rank["pipe_x_data"]["training_bytes"] == stage_bytes[index % 2]
        held = rank["staged"]["validation_bytes"]
        assert held and set(held) == {stage_bytes[index % 2]}
        # validation through the stages, each replica its half of the data: the whole model's metrics
        staged_metrics, whole_metrics = rank["staged"]["validation"], rank["pipe_x_data"]["validation"]
        assert staged_metrics and len(staged_metrics) == len(whole_metrics)
        for mine, theirs in zip(staged_metrics, whole_metrics, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(mine[k] == pytest.approx(theirs[k], rel=1e-9) for k in theirs), (mine, theirs)


HSDP_2X2 = {**case("hsdp", hsdp={"shard_size": 2}), **UNEVEN_VALIDATION, "resources": {"slots_per_trial": 4}}


def _hsdp_state_bytes(topology: Topology) -> dict[str, Any]:
    """One Adam step of a 4-layer MLP under HSDP (2 replicas x 2 shards) and under FSDP2 over the 2 ranks of this
    rank's shard group alone (a node of 2): this rank's bytes of parameters, gradients and optimizer state under
    each, and the parameter count."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from dtrain.sync.fsdp import FsdpStrategy
    from dtrain.sync.hsdp import HsdpStrategy

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order

    class FsdpInANode(FsdpStrategy):
        def shard_mesh(self) -> DeviceMesh:
            return DeviceMesh.from_group(pairs[topology.rank // 2], "cpu", mesh_dim_names=("data",))

    measured: dict[str, Any] = {}
    for layout, strategy in (("hsdp", HsdpStrategy(topology, shard_size=2)), ("fsdp_in_a_node", FsdpInANode(topology))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        wrapped = strategy.wrap_model(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        wrapped(torch.randn(8, 256)).sum().backward()
        strategy.step(optimizer)
        states = optimizer.state.values()
        measured[layout] = (_local_bytes(model.parameters())
                            + _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
                            + _local_bytes(v for s in states for v in s.values() if isinstance(v, torch.Tensor)
                                           and v.numel() > 1))
        measured["parameters"] = sum(p.numel() for p in model.parameters())
        del model, wrapped, optimizer, states
    return measured


def _hsdp_all(topology: Topology, root: str) -> dict[str, Any]:
    results = _train_all(topology, root, {"hsdp": HSDP_2X2}, False)
    results["memory"] = _hsdp_state_bytes(topology)
    results["resumed"] = _interrupted_and_resumed(topology, Path(root) / "hsdp_resumed", HSDP_2X2)
    return results


def test_hsdp_on_a_2x2_mesh_equals_single_process_and_holds_fsdps_state_of_a_node(
        spawn: Callable[..., list[Any]], tmp_path: Path) -> None:
    """4 ranks: 2 replicas x 2 shards (distributed.hsdp.shard_size 2). Each rank's weights after 5 steps equal one
    process on the full batch (float64, 1e-9); validation with unequal batch counts per rank runs as FSDP's does;
    a run resumed from its sharded step-2 checkpoint ends bitwise equal, and `dtrain export` joins its shards;
    a rank holds the model state FSDP2 over its own pair of ranks holds, half DDP's, as `dtrain plan` predicts."""
    from dtrain.plan.memory import model_state_bytes

    ranks = spawn(_hsdp_all, 4, str(tmp_path), timeout=240)
    reference = _reference(HSDP_2X2, _sgd)
    start = _reference({**HSDP_2X2, "searcher": RAW["searcher"]}, lambda m: torch.optim.SGD(m.parameters(), lr=0))
    assert _relative(start, reference) > 1e-3  # the run moved the weights
    for rank in ranks:
        assert _relative(rank["hsdp"]["state"], reference) < 1e-9
        assert rank["hsdp"]["identical"]
        assert rank["hsdp"]["validation"]
        memory = rank["memory"]
        assert memory["hsdp"] == memory["fsdp_in_a_node"]
        predicted = model_state_bytes(memory["parameters"], "hsdp", 4, "adam", shard_ranks=2).total_bytes
        assert abs(memory["hsdp"] - predicted) <= 0.1 * predicted
    assert ranks[0]["hsdp"]["validation"] == ranks[3]["hsdp"]["validation"]
    for rank in ranks:
        uninterrupted = rank["hsdp"]["state"]
        assert rank["resumed"]["resumed_from_shards"]
        assert all(torch.equal(rank["resumed"]["state"][k], uninterrupted[k]) for k in uninterrupted)
    exported = ranks[0]["resumed"]["exported"]
    assert set(exported) == set(reference) and all(torch.equal(exported[k], ranks[0]["hsdp"]["state"][k])
                                                   for k in exported)
