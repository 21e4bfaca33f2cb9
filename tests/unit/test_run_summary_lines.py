"""The lines `dtrain run` prints at the end of a run: how the strategy ran, and where the weights are."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.commands.run import _describe_checkpoint, _describe_sync, _print_summary


def test_a_sharded_checkpoint_says_how_to_get_a_plain_model(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step-4").mkdir(parents=True)
    model_file = str(tmp_path / "checkpoints" / "step-4" / "model.pt")
    assert _describe_checkpoint(tmp_path, model_file) == model_file
    (tmp_path / "checkpoints" / "sharded" / "step-4").mkdir(parents=True)
    assert _describe_checkpoint(tmp_path, model_file) == (
        f"{tmp_path / 'checkpoints' / 'step-4'} (weights in shards: `dtrain export {tmp_path}` writes a plain "
        "model.pt)")
    assert _describe_checkpoint(tmp_path, None) == "none"


def test_pipeline_and_fsdp_describe_their_own_layout() -> None:
    pipeline = {"name": "pipeline", "stages": 2, "replicas": 1, "microbatches": 4, "schedule": "1f1b",
                "bubble_fraction": 0.2}
    assert _describe_sync(pipeline) == ("pipeline, 2 stages x 1 replica(s), 1f1b with 4 microbatches (bubble 20% of "
                                        "a step by the formula)")
    assert _describe_sync({"name": "fsdp", "shards": 4, "reshard_after_forward": True}) == (
        "fsdp, 4 shards, reshard_after_forward True")
    assert _describe_sync({"name": "allreduce", "op": "average"}).startswith("allreduce, op average")


def test_an_svm_run_says_smo_iterations_not_epochs_and_samples_per_second(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = {"status": "completed", "world_size": 2, "global_batch_size": 200, "steps_completed": 7,
               "epochs_completed": None, "samples_per_second": None, "wall_seconds": 12.0,
               "validation": {"accuracy": 0.99}, "checkpoint": None,
               "svm": {"iterations": 1234, "n_samples": 1437, "n_support": 321}}
    _print_summary(tmp_path, None, summary, 15.0)
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("dtrain: training completed: 7 batches of 200 SMO iterations (1,234 SMO iterations on 1,437 "
                     "samples, 321 support vectors) on 2 worker(s), 12 s of training (15 s in all)")
    assert "epochs" not in first and "samples/s" not in first
