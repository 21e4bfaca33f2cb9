"""Resuming at another world size, refused before any worker starts with one `dtrain: error:` line, every saved file
left as it was: a size that cannot split the run's global batch, a stage count or an hsdp shard group the new size
cannot hold, a strategy whose trajectory depends on the worker count, and (at any size) an FSDP checkpoint whose
shards lack one rank's file."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from faultkit import FIXTURES, error_lines

from dtrain import cli
from dtrain.comm import Topology
from dtrain.config import dump_config, load_config
from tests.distributed.conftest import fixture_trainer, run_spawned

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

RAW: dict[str, Any] = {
    "name": "resize_bad", "entrypoint": str(FIXTURES / "digits_trial.py") + ":DigitsTrial",
    "hyperparameters": {"global_batch_size": 8, "learning_rate": 0.1},
    "resources": {"slots_per_trial": 3},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": 6}},
}


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("a bad input reached the launcher")

    monkeypatch.setattr("dtrain.launch.launch_workers", refuse)


def hashes(root: Path) -> dict[str, str]:
    """SHA-256 of every file under `root` (config.yaml and run.json included: a refused resume rewrites nothing)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def stopped_run(root: Path, raw: dict[str, Any], meta: dict[str, Any]) -> tuple[Path, Path]:
    """A run dir stopped after batch 2 whose latest checkpoint's meta.json is `meta`, and its experiment file."""
    run = root / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(load_config(None, raw=raw).config))
    (run / "summary.json").write_text(json.dumps({"status": "stopped"}))
    (run / "checkpoints" / "step-2" / "meta.json").write_text(json.dumps({"format": 1, "step": 2, **meta}))
    (run / "checkpoints" / "latest").write_text("step-2\n")
    experiment = root / "experiment.yaml"
    experiment.write_text(yaml.safe_dump(raw))
    return run, experiment


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    return lines[0]


def test_a_size_that_cannot_split_the_global_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   no_launch: None) -> None:
    """8 records on 3 slots trained 6 per batch (Determined's even split drops 2); 7 slots cannot share 6."""
    run, experiment = stopped_run(tmp_path, RAW, {"global_batch": 6, "data_replicas": 3, "world_size": 3})
    before = hashes(run)
    line = refused(["run", str(experiment), "--set", "resources.slots_per_trial=7", "--run-dir", str(run)], capsys)
    assert "this run's global batch is 6 records (written by 3 data replica(s)); 7 data replicas cannot" in line
    assert "resume on at most 6 replicas" in line
    assert hashes(run) == before


@pytest.mark.parametrize(("distributed", "expected"), [
    ({"strategy": "pipeline", "pipeline": {"stages": 2, "microbatches": 2}},
     ["distributed.pipeline.stages (2) must divide resources.slots_per_trial (3)"]),
    # shard_size may change at a resume (tests/distributed/test_resize.py resumes a 2 x 2 mesh on 3 slots unset)
    ({"strategy": "hsdp", "hsdp": {"shard_size": 2}},
     ["distributed.hsdp.shard_size (2) must divide resources.slots_per_trial (3)", "use a divisor of 3, or leave it"]),
], ids=["pipeline_stages", "hsdp_shard_groups"])
def test_a_layout_the_new_size_cannot_hold(distributed: dict[str, Any], expected: list[str], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], no_launch: None) -> None:
    """4 slots as 2 stages x 2 replicas, or as 2 replicas x 2 shards, cannot resume on 3 slots as they are."""
    raw = {**RAW, "resources": {"slots_per_trial": 4}, "distributed": distributed}
    replicas = 2 if distributed["strategy"] == "pipeline" else 4
    run, experiment = stopped_run(tmp_path, raw, {"global_batch": 8, "data_replicas": replicas, "world_size": 4})
    before = hashes(run)
    line = refused(["run", str(experiment), "--set", "resources.slots_per_trial=3", "--run-dir", str(run)], capsys)
    assert all(part in line for part in expected), line
    assert hashes(run) == before


def test_a_strategy_whose_trajectory_depends_on_the_worker_count(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 no_launch: None) -> None:
    raw = {**RAW, "distributed": {"strategy": "local_sgd"}}
    run, experiment = stopped_run(tmp_path, raw, {"global_batch": 6, "data_replicas": 3, "world_size": 3})
    before = hashes(run)
    line = refused(["run", str(experiment), "--set", "resources.slots_per_trial=2", "--run-dir", str(run)], capsys)
    assert "written by 3 worker(s) with strategy local_sgd, which cannot resume at another size" in line
    assert hashes(run) == before


def _fsdp_checkpoint(topology: Topology, raw: dict[str, Any], run_dir: str) -> str:
    sys.path.insert(0, str(FIXTURES))
    trainer = fixture_trainer(topology, load_config(None, raw=raw).config, run_dir)
    return str(trainer.fit()["status"])


def test_an_fsdp_checkpoint_whose_shards_lack_one_ranks_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             no_launch: None) -> None:
    """A real FSDP checkpoint of 2 ranks with rank 1's shard file gone: resuming at 1 slot (or any) is one line."""
    raw = {**RAW, "hyperparameters": {**RAW["hyperparameters"], "hidden": 8}, "resources": {"slots_per_trial": 2},
           "distributed": {"strategy": "fsdp"}, "faults": {"stop_after_batch": 2}}
    run = tmp_path / "run"
    assert run_spawned(_fsdp_checkpoint, 2, raw, str(run), timeout=240) == ["stopped", "stopped"]
    shards = run / "checkpoints" / "sharded" / "step-2"
    lost = sorted(shards.glob("__1_*.distcp"))
    assert lost, sorted(p.name for p in shards.iterdir())
    for path in lost:
        path.unlink()
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(yaml.safe_dump({key: value for key, value in raw.items() if key != "faults"}))
    before = hashes(run)
    for slots in ("1", "2"):
        line = refused(["run", str(experiment), "--set", f"resources.slots_per_trial={slots}", "--run-dir", str(run)],
                       capsys)
        assert "no usable checkpoint in" in line and f"lack {lost[0].name} (written by rank 1)" in line, line
        assert hashes(run) == before
