"""Large-batch recipes in real runs: the Trainer's rate, batch phases and data walk against a reference loop written
here, and a whole `dtrain run` stopped in the middle of warm-up (and again after the batch grew) that resumes onto
the same curve, bitwise."""

from __future__ import annotations

import copy
import json
import re
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dtrain.data.sharding import epoch_permutation, split_global_batch
from dtrain.runs.store import RunStore
from dtrain.train.rng import seed_everything
from dtrain.train.trial import TrialContext

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_runs import completed_run, dtrain, final_model  # noqa: E402
from test_trainer_ddp import _train  # noqa: E402

BASE_LR, BASE_BATCH, WARMUP, MILESTONE = 0.05, 12, 0.5, 2.5
RAW: dict[str, Any] = {
    "name": "large_batch_equivalence", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 24, "learning_rate": BASE_LR, "float64": True, "hidden": 16,
                        "one_cycle": True},
    "resources": {"slots_per_trial": 2},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"epochs": 3}},
    "reproducibility": {"experiment_seed": 5},
    "large_batch": {"optimizer": "sgd", "momentum": 0.9, "lr_scaling": "linear", "base_batch_size": BASE_BATCH,
                    "warmup_epochs": WARMUP, "decay": {"name": "step", "milestones": [MILESTONE], "gamma": 0.1},
                    # per-slot 12 -> 24 at epoch 1; at epoch 2 a per-slot 48 would pass 24, so k 1 -> 2
                    "batch_size_schedule": {"epochs": [1, 2], "factor": 2, "max_per_slot_batch": 24}},
}


def _reference(raw: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[tuple[int, float, int]]]:
    """One process on whole global batches: walk each shuffled pass in consecutive batches (a tail too short for
    the next batch is skipped); Goyal's warm-up from the base rate to the linearly scaled one over 0.5 epochs,
    per update, then x0.1 from epoch 2.5; the batch doubles after the first update ending at epoch >= 1 (per-slot)
    and >= 2 (aggregating 2 batches per update). Returns the weights and (step, lr, records) of every update."""
    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    hp = raw["hyperparameters"]
    seed = raw["reproducibility"]["experiment_seed"]
    context = TrialContext(hparams=hp, rank=0, world_size=1, local_rank=0, batch_split=split_global_batch(24, 1),
                           device=torch.device("cpu"), seed=seed)
    trial = DigitsTrial(context)
    images, labels = trial.build_training_data().tensors
    records = len(labels)
    seed_everything(seed)
    model = trial.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    peak = 24 / BASE_BATCH
    batch, k, changes = 24, 1, [(Fraction(1), 48, 1), (Fraction(2), 48, 2)]
    data_pass, offset, epoch, window_epoch, in_window, step = 0, 0, Fraction(0), Fraction(0), 0, 0
    updates = []
    while epoch < 3:
        if offset + batch > records:
            data_pass, offset = data_pass + 1, 0
        index = epoch_permutation(records, seed, data_pass)[offset:offset + batch]
        offset += batch
        step += 1
        epoch = data_pass + Fraction(offset, records // batch * batch)
        (F.cross_entropy(model(images[index]), labels[index]) / k).backward()
        in_window += 1
        if in_window == k or epoch >= 3:
            e = float(window_epoch)
            if e < WARMUP:
                lr = BASE_LR * (1 + (peak - 1) * e / WARMUP)
            else:
                lr = BASE_LR * peak * (0.1 if e >= MILESTONE else 1)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad()
            updates.append((step, lr, batch * k))
            in_window, window_epoch = 0, epoch
            if changes and epoch >= changes[0][0]:
                _, batch, k = changes.pop(0)
    return model.state_dict(), updates


def test_trainer_follows_the_reference_recipe(spawn: Any, tmp_path: Path) -> None:
    raw = copy.deepcopy(RAW)
    state, other = spawn(_train, 2, str(tmp_path / "run"), raw)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected, updates = _reference(raw)
    for name, value in expected.items():
        assert float((state[name] - value).abs().max() / value.abs().max()) < 1e-9, name
        assert torch.equal(state[name], other[name])
    assert summary["steps_completed"] == updates[-1][0]
    assert summary["epochs_completed"] == pytest.approx(3.0, abs=0.05)
    assert [(p["global_batch_size"], p["aggregation_frequency"]) for p in summary["batch_size_phases"]] == [
        (24, 1), (48, 1), (48, 2)]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    series = RunStore(Path(run["store"])).metric_series(run["trial_id"], "training")
    assert [s for s, _ in series["lr"]] == [u[0] for u in updates]
    assert [lr for _, lr in series["lr"]] == pytest.approx([u[1] for u in updates], rel=1e-12)
    assert [b for _, b in series["effective_batch_size"]] == [u[2] for u in updates]
    assert {lr for _, lr in series["lr"]} >= {BASE_LR, BASE_LR * 2, BASE_LR * 0.2}  # warm-up start, peak, decayed


# ------------------------------------------------------------------------------- whole runs, resumed

CONFIG = FIXTURES / "digits_large_batch.yaml"


def _training_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    run = json.loads((run_dir / "run.json").read_text())
    return RunStore(Path(run["store"])).metric_series(run["trial_id"], "training")


@pytest.fixture(scope="module")
def clean_large_batch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return completed_run(CONFIG, tmp_path_factory.mktemp("large_batch"))


def test_config_recipe_runs_with_the_promised_rate_and_batch(clean_large_batch_run: Path) -> None:
    summary = json.loads((clean_large_batch_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 66  # 22 per epoch
    assert [e["step"] for e in summary["validation_history"]] == [22, 44, 66]
    assert summary["validation"]["accuracy"] > 0.8
    series = _training_series(clean_large_batch_run)
    lr = dict(series["lr"])
    # one update per batch up to batch 44, then one per 2 batches; the first 22 updates warm up from 0.1 to 0.4
    assert sorted(lr)[:3] == [1, 2, 3] and sorted(lr)[-3:] == [62, 64, 66] and len(lr) == 44 + 11
    assert lr[1] == pytest.approx(0.1) and lr[12] == pytest.approx(0.1 * (1 + 3 * 11 / 22))
    assert lr[23] == pytest.approx(0.4)  # warm-up done; cosine decay starts at epoch 1
    assert dict(series["effective_batch_size"])[44] == 64 and dict(series["effective_batch_size"])[46] == 128


@pytest.mark.slow  # starts `dtrain run` two or more times
def test_resume_mid_warmup_and_mid_phase_is_bitwise_identical(clean_large_batch_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "resumed"
    first = dtrain("run", CONFIG, "--set", "faults.stop_after_batch=9", "--run-dir", run_dir)
    assert first.returncode == 3, first.stderr  # stopped inside the warm-up (epoch 9/22)
    second = dtrain("run", CONFIG, "--set", "faults.stop_after_batch=49", "--run-dir", run_dir)
    assert second.returncode == 3, second.stderr  # stopped after the batch doubled, inside an aggregation phase
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-50"
    third = dtrain("run", CONFIG, "--run-dir", run_dir)
    assert third.returncode == 0, third.stderr
    assert final_model(run_dir) == final_model(clean_large_batch_run)
    clean, resumed = _training_series(clean_large_batch_run), _training_series(run_dir)
    for name in ("lr", "global_batch_size", "effective_batch_size"):
        assert resumed[name] == clean[name], name
    clean_summary = json.loads((clean_large_batch_run / "summary.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumes"] == 2
    assert [e["metrics"] for e in summary["validation_history"]] == [
        e["metrics"] for e in clean_summary["validation_history"]]


def test_trial_scheduler_beside_a_config_schedule_is_one_clear_error(tmp_path: Path) -> None:
    result = dtrain("run", FIXTURES / "digits.yaml", "--set", "large_batch.lr_scaling=linear",
                    "--set", "large_batch.base_batch_size=32", "--run-dir", tmp_path / "run")
    assert result.returncode == 2, result.stderr
    assert "build_lr_scheduler() returned OneCycleLR" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_diverging_recipe_stops_with_one_clear_line(tmp_path: Path) -> None:
    result = dtrain("run", FIXTURES / "digits.yaml", "--set", "large_batch.optimizer=sgd", "--set",
                    "large_batch.base_lr=1e38", "--set", "scheduling_unit=5", "--run-dir", tmp_path / "run")
    assert result.returncode == 2, result.stderr
    # the first non-finite gradient stops it (nan_policy abort), before that update is applied
    assert re.search(r"training diverged: batch \d+: the gradient on ranks 0, 1 is not finite", result.stderr)
    assert "warm it up (large_batch.warmup_epochs)" in result.stderr
    assert "Traceback" not in result.stderr
