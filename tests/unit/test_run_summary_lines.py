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


def test_local_sgd_says_how_its_replicas_met_and_what_its_bytes_are_per(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    described = {"name": "local_sgd", "period": 8, "warmup_steps": 0, "node_sync": False, "average_buffers": True,
                 "outer_optimizer": None, "compression": {"name": "none"}, "updates": 80, "synchronous_updates": 0,
                 "averaging_rounds": 10}
    line = _describe_sync(described)
    assert line == ("local_sgd, every 8 updates parameters averaged: 10 averaging rounds, 0 of 80 updates "
                    "synchronous")
    assert "op" not in line.split()
    summary = {"status": "completed", "world_size": 2, "steps_completed": 80, "epochs_completed": 1.0,
               "samples_per_second": 100.0, "wall_seconds": 3.0, "validation": {}, "checkpoint": None,
               "strategy": described, "communication": {"compression": "none", "communicating_steps": 10,
                                                        "bytes_per_step": 2e6, "compression_ratio": 1.0,
                                                        "total_bytes": 2e7}}
    _print_summary(tmp_path, None, summary, 4.0)
    wire = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  wire"))
    assert "MB sent per update that communicated (10 of 80 batches) by each worker" in wire
