"""NaN gradients under `nan_policy: skip`: a NaN that only rank 1 sees (put into its gradient after the
all-reduce) makes every rank skip that update, and nothing else changes."""

from __future__ import annotations

from pathlib import Path

from faultkit import CONFIG, dtrain, summary


def test_nan_on_one_rank_skips_the_update_on_every_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = dtrain("run", CONFIG, "--set", "nan_policy=skip", "--set", "debug.nan_rank=1",
                    "--set", "debug.nan_batches=[3]", "--set", "searcher.max_length={batches: 5}",
                    "--set", "min_checkpoint_period={batches: 1}", "--set", "checkpoint_storage.save_trial_latest=10",
                    "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    found = summary(run_dir)
    assert found["nan_steps_skipped"] == 1
    assert found["replicas_identical"] is True  # rank 1 skipped too: all ranks hold the same weights
    [warning] = [line for line in result.stderr.splitlines() if "non-finite gradient" in line]
    assert "batch 3: non-finite gradient on rank 1; the update was skipped on every rank" in warning

    def model(step: int) -> bytes:
        return (run_dir / "checkpoints" / f"step-{step}" / "model.pt").read_bytes()

    # rank 0 (whose weights the checkpoints hold) saw no NaN, yet it skipped batch 3's update like rank 1
    assert model(3) == model(2)
    assert model(4) != model(3) and model(2) != model(1)
