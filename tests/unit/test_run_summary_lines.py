"""The lines `dtrain run` prints at the end of a run: how the strategy ran, and where the weights are."""

from __future__ import annotations

from pathlib import Path

from dtrain.commands.run import _describe_checkpoint, _describe_sync


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
