"""NaN gradients under `nan_policy: skip`: a NaN that only rank 1 sees (put into its gradient after the
all-reduce) makes every rank skip that update, and nothing else changes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from faultkit import CONFIG, dtrain, summary

from dtrain.comm import Topology, shm
from dtrain.config import load_config
from tests.distributed.conftest import fixture_trainer, run_spawned  # the one spawn fixture's functions

NAN_SETTINGS = ["nan_policy=skip", "faults.nan_rank=1", "faults.nan_batches=[3]", "searcher.max_length={batches: 5}"]


def test_nan_on_one_rank_skips_the_update_on_every_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    settings = [*NAN_SETTINGS, "min_checkpoint_period={batches: 1}", "checkpoint_storage.save_trial_latest=10"]
    result = dtrain("run", CONFIG, *(arg for setting in settings for arg in ("--set", setting)), "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    assert summary(run_dir)["nan_steps_skipped"] == 1
    [warning] = [line for line in result.stderr.splitlines() if "non-finite gradient" in line]
    assert "batch 3: non-finite gradient on rank 1; the update was skipped on every rank" in warning

    def model(step: int) -> bytes:
        return (run_dir / "checkpoints" / f"step-{step}" / "model.pt").read_bytes()

    # rank 0 (whose weights the checkpoints hold) saw no NaN, yet it skipped batch 3's update like rank 1
    assert model(3) == model(2)
    assert model(4) != model(3) and model(2) != model(1)


def _train_with_a_nan_on_rank_1(topology: Topology, run_dir: str) -> dict[str, Any]:
    trainer = fixture_trainer(topology, load_config(CONFIG, overrides=NAN_SETTINGS).config, run_dir)
    exchange = trainer.guard.exchange
    trainer.fit()
    weights = hashlib.sha256()
    for tensor in trainer.strategy.unwrap_model().state_dict().values():
        weights.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return {"weights": weights.hexdigest(), "skipped": trainer.guard.skipped, "steps": trainer.state.steps_completed,
            "exchanged": exchange.calls if exchange is not None else None}


def test_every_rank_holds_the_same_weights_after_the_skip(tmp_path: Path) -> None:
    """The weights of each rank, compared here (the run's own end-of-training check is not relied on): rank 0,
    which saw no NaN, skipped the update exactly as rank 1 did. On one x86-64 host with a core per rank the
    guard's flags go through shared memory, not a gloo all-reduce: one exchange per update."""
    zero, one = run_spawned(_train_with_a_nan_on_rank_1, 2, str(tmp_path / "run"))
    assert zero["steps"] == one["steps"] == 5
    assert zero["skipped"] == one["skipped"] == 1
    assert zero["weights"] == one["weights"]
    if shm.supported() and len(os.sched_getaffinity(0)) >= 2:
        assert zero["exchanged"] == one["exchanged"] == 5
