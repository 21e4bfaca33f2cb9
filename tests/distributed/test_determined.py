"""Trials written in Determined's three styles (tests/determined_trials/) run unchanged with `dtrain run` on 1 and 2
slots: the legacy PyTorchTrial (also with a worker SIGKILLed and restarted) and the Trainer-API script end within
1e-9 (float64) of the same model written as a native dtrain Trial on 1 slot; a PyTorchTrial with two models and two
optimizers (gan_def.py) on 2 slots with gradient aggregation ends within 1e-9 of a plain torch loop in one process
(gan_reference.py), and with a NaN generator loss on one slot it skips that step on both (nan_policy skip); the
Core API script on 2 slots and on
1 slot, killed with SIGKILL mid-run and resumed from `latest_checkpoint` by the restart, end at the same weights;
adaptive ASHA stops Trainer-API and Core API trials where the searcher says (two searches side by side); a
script that uses no Determined API runs on every slot. The legacy trial's reducer (a median over both slots'
records) and its callback state (restored after the kill) and the two-model trial's evaluate_full_dataset (the chief
over all records) are checked on the same runs. The runs start five at a time, side by side (the machine's
cores are mostly idle while each imports torch), and each test reads the runs it needs. The legacy PyTorchTrial on
1 slot runs in process only (tests/unit/test_determined_api.py: bitwise equal to the native Trial through the same
Trainer); its slot here went to the two-model trial."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # its fixture trains four Determined-API runs; the ASHA test runs two searches

TRIALS = Path(__file__).resolve().parents[1] / "determined_trials"
TOLERANCE = 1e-9
PARALLEL = 5  # runs started side by side: two waves (each picks free ports; more at once only adds load)

RUNS: dict[str, tuple[str, list[str]]] = {
    "legacy-2-killed": ("const.yaml", ["--set", "faults.kills=[{rank: 1, batch: 8}]", "--set", "max_restarts=1"]),
    "core-1-killed": ("core.yaml", ["--set", "resources.slots_per_trial=1", "--set", "max_restarts=1",
                                    "--set", "entrypoint=python3 core_train.py --kill-at 6"]),
    "native-1": ("native.yaml", ["--set", "resources.slots_per_trial=1"]),
    "gan-2": ("gan.yaml", []),
    "gan-2-nan": ("gan.yaml", ["--set", "entrypoint=gan_def:PoisonedOnRankOneTrial", "--set", "nan_policy=skip"]),
    "legacy-2": ("const.yaml", []),
    "trainer-1": ("trainer.yaml", ["--set", "resources.slots_per_trial=1"]),
    "trainer-2": ("trainer.yaml", []),
    "core-2": ("core.yaml", []),
    "plain-2": ("core.yaml", ["--set", "entrypoint=python3 -c \"import os; print('plain rank', os.environ['RANK'])\""]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    root = tmp_path_factory.mktemp("determined")
    env = {k: v for k, v in os.environ.items() if k not in ("DTRAIN_LAUNCHER", "DTRAIN_RUN_DIR")}
    env["DTRAIN_RUNS_ROOT"] = str(root / "runs")
    done = {}
    names = list(RUNS)
    for wave in range(0, len(names), PARALLEL):
        started = {}
        for name in names[wave:wave + PARALLEL]:
            config, extra = RUNS[name]
            command = [sys.executable, "-m", "dtrain.cli", "run", str(TRIALS / config), "--run-dir",
                       str(root / name), *extra]
            started[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                             env=env, cwd=root)
        for name, process in started.items():
            out, err = process.communicate(timeout=400)
            done[name] = (root / name, subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def _completed(runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]], name: str) -> dict[str, object]:
    run_dir, result = runs[name]
    logs = "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}"
                   for log in sorted((run_dir / "logs").glob("rank-*.log")))
    assert result.returncode == 0, f"{name}: {result.stderr[-2000:]}{logs}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    return summary


def _trainer_weights(runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
                     name: str) -> dict[str, torch.Tensor]:
    summary = _completed(runs, name)
    assert summary["steps_completed"] == 12 and summary["world_size"] == int(name.split("-")[1])
    return torch.load(str(summary["checkpoint"]), weights_only=True)


def _core_weights(runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
                  name: str) -> dict[str, torch.Tensor]:
    summary = _completed(runs, name)
    run_dir = runs[name][0]
    state = torch.load(run_dir / "checkpoints" / "determined" / str(summary["checkpoint"]) / "state.pt",
                       weights_only=True)
    assert state["batches"] == 12
    return state["model"]


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and all(t.dtype == torch.float64 for t in a.values())
    return max(float((a[key] - b[key]).abs().max()) for key in a)


@pytest.mark.parametrize("name", ["legacy-2", "legacy-2-killed", "trainer-1", "trainer-2"])
def test_pytorch_trial_and_trainer_api_match_the_native_trial(
        runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]], name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TRIALS))
    monkeypatch.delitem(sys.modules, "data", raising=False)
    native = _trainer_weights(runs, "native-1")
    assert _max_difference(_trainer_weights(runs, name), native) <= TOLERANCE
    # the same run went through dtrain's own pipeline: store, TensorBoard, validation at the configured period
    run_dir = runs[name][0]
    summary = _completed(runs, name)
    assert [entry["step"] for entry in summary["validation_history"]] == [6, 12]  # type: ignore[union-attr]
    assert list((run_dir / "tensorboard").iterdir())
    if name.endswith("killed"):  # rank 1 was SIGKILLed at batch 8; the restart resumed from batch 6
        assert summary["restarts"] == 1 and summary["resumes"] == 1, summary
    if name.startswith("legacy"):  # its reducer's median over both slots' records; its callback's state restored
        from data import regression  # type: ignore[import-not-found]

        inputs, targets = regression(64, seed=2).tensors
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        model.load_state_dict(_trainer_weights(runs, name))
        with torch.no_grad():
            median = float((model(inputs) - targets).abs().median())
        reported = summary["validation_history"][-1]["metrics"]["median_abs_error"]  # type: ignore[index]
        assert abs(reported - median) <= 1e-12, (reported, median)
        state = torch.load(Path(str(summary["checkpoint"])).parent / "state.pt", weights_only=True)
        assert state["trial"]["callbacks"] == {"validations": {"count": 2}}  # 1 before the kill, restored, +1


def test_the_reference_is_not_trivially_matched(runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]
                                                ) -> None:
    """The comparison can fail: the trained model is far from its starting point and from the Core API script's
    (same network, different seed and data order)."""
    assert _max_difference(_trainer_weights(runs, "native-1"), _core_weights(runs, "core-2")) > 1e-3


def test_core_api_script_resumes_from_latest_checkpoint_after_a_kill(
        runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    run_dir, result = runs["core-1-killed"]
    assert "resumed from checkpoint" in result.stdout and "at batch 4" in result.stdout, result.stdout
    assert _max_difference(_core_weights(runs, "core-1-killed"), _core_weights(runs, "core-2")) <= TOLERANCE
    stored = sorted(p.name for p in (run_dir / "checkpoints" / "determined").iterdir())
    assert len(stored) == 4 and "latest" in stored  # batch 4 (before the kill), 8 and 12 (after it), and latest


def test_a_script_without_determined_s_apis_runs_on_every_slot_and_completes(
        runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    run_dir, result = runs["plain-2"]
    summary = _completed(runs, "plain-2")
    assert summary["entrypoint"] == "command" and "plain rank 0" in result.stdout
    assert "plain rank 1" in (run_dir / "logs" / "rank-1.log").read_text()  # ranks > 0 write to their log


def test_core_api_metrics_reach_the_store(runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    summary = _completed(runs, "core-2")
    assert [entry["step"] for entry in summary["validation_history"]] == [4, 8, 12]  # type: ignore[union-attr]
    assert float(summary["validation"]["validation_loss"]) < 0.5  # type: ignore[index]


def test_adaptive_asha_stops_trainer_api_and_core_api_trials_exactly_where_the_searcher_says(tmp_path: Path) -> None:
    """Two searches side by side (each one trial at a time, on one slot: the machine's two cores), over the
    Trainer-API script and over the Core API script (which leaves when `preempt.should_preempt()` says so): each
    trial the searcher stopped ended at the rung whose record stopped it (status `stopped`, its checkpoint kept),
    the others trained to max_time; the decisions replay from the rung values in the study by Determined's rule."""
    env = {k: v for k, v in os.environ.items() if k not in ("DTRAIN_LAUNCHER", "DTRAIN_RUN_DIR")}
    env["DTRAIN_RUNS_ROOT"] = str(tmp_path / "runs")
    searches = {"asha.yaml": ("determined_trainer_asha", tmp_path / "trainer"),
                "core_asha.yaml": ("determined_core_asha", tmp_path / "core")}
    started = {config: subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", str(TRIALS / config), "--slots",
                                         "1", "--search-dir", str(search_dir)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)
               for config, (_, search_dir) in searches.items()}
    for config, process in started.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, config + out[-3000:] + err[-2000:]
    for config, (study_name, search_dir) in searches.items():
        _check_asha_decisions(study_name, search_dir, core_api=config.startswith("core"))


def _check_asha_decisions(study_name: str, search_dir: Path, *, core_api: bool) -> None:
    import optuna

    from dtrain.search import asha

    assert asha.plan(3, 4, 2, 5, "aggressive")[0].units == (2, 4)
    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{search_dir / 'study.db'}")
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    assert len(trials) == 3
    rung = asha.Rung()
    for t in trials:  # one at a time: the order of the trials is the order of the rung records
        expected = "completed" if rung.continue_training(t.user_attrs["rung_0"], 2, smaller_is_better=True) \
            else "stopped"
        trial_dir = search_dir / f"trial-{t.number}"
        summary = json.loads((trial_dir / "summary.json").read_text())
        if expected == "stopped":
            assert t.state == optuna.trial.TrialState.PRUNED, (study_name, t.number)
            assert summary["status"] == "stopped" and summary["steps_completed"] == 2, summary
            kept = trial_dir / "checkpoints" / ("determined" if core_api else "step-2")
            assert kept.is_dir() and any(kept.iterdir())
        else:
            assert t.state == optuna.trial.TrialState.COMPLETE, (study_name, t.number)
            assert summary["status"] == "completed" and summary["steps_completed"] == 4, summary
    assert any(t.state == optuna.trial.TrialState.PRUNED for t in trials), study_name


def test_two_models_and_optimizers_on_two_slots_match_a_one_process_loop(
        runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gan_def.AdversarialTrial on 2 slots (aggregation 2, clipped generator steps, two schedulers): its checkpoint
    holds both models and both optimizers and ends within 1e-9 of gan_reference's plain loop over the same global
    batches from the same initial weights (both recorded from the trial run in this process on one slot)."""
    from dtrain.comm import Topology
    from dtrain.config import load_config
    from dtrain.determined import install_import_path
    from dtrain.runs.rundir import load_run_info, prepare_run_dir
    from dtrain.train.trainer import Trainer

    install_import_path()
    monkeypatch.syspath_prepend(str(TRIALS))
    for module in ("gan_def", "gan_reference", "data"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    from gan_def import AdversarialTrial
    from gan_reference import train_reference

    batches: list[tuple[torch.Tensor, ...]] = []
    initial: dict[str, torch.Tensor] = {}

    class Recording(AdversarialTrial):  # type: ignore[misc]
        def __init__(self, context: object) -> None:
            super().__init__(context)
            initial.update({f"model_0.{k}": v.clone() for k, v in self.generator.state_dict().items()})
            initial.update({f"model_1.{k}": v.clone() for k, v in self.critic.state_dict().items()})

        def train_batch(self, batch: tuple[torch.Tensor, ...], epoch_idx: int, batch_idx: int) -> dict[str, object]:
            batches.append(tuple(t.clone() for t in batch))
            return super().train_batch(batch, epoch_idx, batch_idx)

    config = load_config(TRIALS / "gan.yaml").config
    prepare_run_dir(config, tmp_path / "recorded", TRIALS)
    one = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                   device=torch.device("cpu"), launcher="none")
    Trainer(config=config, trial_class=Recording.__dtrain_trial__(), topology=one,
            run_info=load_run_info(tmp_path / "recorded")).fit()
    expected = train_reference(initial, batches, learning_rate=0.05, aggregation_frequency=2)
    trained = _trainer_weights(runs, "gan-2")
    assert {key.split(".")[0] for key in trained} == {"model_0", "model_1"}
    assert _max_difference(trained, expected) <= TOLERANCE
    assert _max_difference(trained, initial) > 1e-3
    summary = _completed(runs, "gan-2")
    state = torch.load(Path(str(summary["checkpoint"])).parent / "state.pt", weights_only=True)
    assert len(state["optimizer"]["optimizers"]) == 2 and len(state["scheduler"]["schedulers"]) == 2
    # evaluate_full_dataset ran on the chief alone over all 64 validation records, and every rank recorded it
    from data import network, regression

    generator = network()
    generator.load_state_dict({k.removeprefix("model_0."): v for k, v in trained.items() if k.startswith("model_0.")})
    inputs, targets = regression(64, seed=2).tensors
    with torch.no_grad():
        loss = float((generator(inputs) - targets).pow(2).mean())
    metrics = summary["validation_history"][-1]["metrics"]  # type: ignore[index]
    assert metrics["records"] == 64 and metrics["rank"] == 0
    assert abs(metrics["validation_loss"] - loss) <= 1e-12


def test_a_nan_on_one_slot_of_a_two_model_trial_is_skipped_on_both(
        runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]) -> None:
    """gan_def.PoisonedOnRankOneTrial: slot 1's generator loss is NaN at batch 4 (the update of batches 4-5). The
    averaged gradient is NaN on both slots, both hold the generator's step back, dtrain's guard skips it once, and
    the replicas end identical and finite, apart from the run without the NaN."""
    summary = _completed(runs, "gan-2-nan")
    assert summary["nan_steps_skipped"] == 1 and summary["replicas_identical"] is True
    trained = _trainer_weights(runs, "gan-2-nan")
    assert all(bool(torch.isfinite(value).all()) for value in trained.values())
    assert _max_difference(trained, _trainer_weights(runs, "gan-2")) > 1e-6
