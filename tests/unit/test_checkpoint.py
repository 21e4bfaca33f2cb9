"""Checkpoints: atomic, verified, loadable with weights_only, and never `latest` when a write was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dtrain.errors import CheckpointError
from dtrain.train import checkpoint as ckpt


def _write(root: Path, step: int) -> ckpt.CheckpointRef:
    model = {"w": torch.full((3,), float(step))}
    state = {"optimizer": {"state": {}, "param_groups": []}, "trainer": {"steps_completed": step},
             "rng": [torch.get_rng_state()]}
    return ckpt.write_checkpoint(root, step, model, state)


def test_write_then_resume_from_latest(tmp_path: Path) -> None:
    _write(tmp_path, 5)
    ref = _write(tmp_path, 10)
    assert (tmp_path / "latest").read_text().strip() == "step-10"
    found = ckpt.find_resume_checkpoint(tmp_path)
    assert found == ref
    model, state = ckpt.load_checkpoint(found)
    assert model["w"].tolist() == [10.0] * 3 and state["trainer"]["steps_completed"] == 10
    assert torch.load(ref.model_path, weights_only=True)["w"][0] == 10.0


def test_no_checkpoint_means_fresh_start(tmp_path: Path) -> None:
    assert ckpt.find_resume_checkpoint(tmp_path / "none") is None


def test_corrupt_latest_falls_back_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(tmp_path, 5)
    ref = _write(tmp_path, 10)
    with ref.model_path.open("r+b") as handle:
        handle.seek(40)
        handle.write(b"\xff\xff")
    with caplog.at_level("WARNING"):
        found = ckpt.find_resume_checkpoint(tmp_path)
    assert found is not None and found.step == 5
    assert "does not match its checksum" in caplog.text


def test_all_corrupt_is_one_clear_error(tmp_path: Path) -> None:
    ref = _write(tmp_path, 3)
    (ref.path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint.*never completed"):
        ckpt.find_resume_checkpoint(tmp_path)


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    _write(tmp_path, 4)
    ref = ckpt.write_checkpoint(tmp_path, 4, {"w": torch.zeros(1)}, {"trainer": {}})
    assert ckpt.verify_checkpoint(ref.path).step == 4
    assert ckpt.load_checkpoint(ref)[0]["w"].tolist() == [0.0]


def test_prune_keeps_latest_and_best(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        _write(tmp_path, step)
    ckpt.prune_checkpoints(tmp_path, keep_latest=2, keep_steps={2})
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-2", "step-4", "step-5"]


def test_failed_write_leaves_latest_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, 1)
    original = ckpt._save_file

    def die_on_state(obj: object, path: Path) -> None:
        if path.name == ckpt.STATE_FILE:
            raise OSError("disk full")
        original(obj, path)

    monkeypatch.setattr(ckpt, "_save_file", die_on_state)
    with pytest.raises(OSError):
        _write(tmp_path, 2)
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-1"]
    ckpt.remove_stale_partials(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".partial")]


WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from dtrain.train.checkpoint import write_checkpoint
    root = Path(sys.argv[1])
    big = torch.randn(4_000_000)
    for step in range(1, 1000):
        write_checkpoint(root, step, {"w": big + step}, {"trainer": {"steps_completed": step}})
        print(step, flush=True)
""")


@pytest.mark.parametrize("delay", [0.35, 0.8, 1.3])
def test_killed_in_the_middle_of_writes_latest_is_complete(tmp_path: Path, delay: float) -> None:
    """SIGKILL a process that writes 16 MB checkpoints back to back; `latest` must name a verified one."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # one checkpoint is complete
    assert first.strip() == "1"
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    latest = (tmp_path / "latest").read_text().strip()
    ref = ckpt.verify_checkpoint(tmp_path / latest)
    model, state = ckpt.load_checkpoint(ref)
    assert state["trainer"]["steps_completed"] == ref.step
    assert float(model["w"][0] - model["w"][1]) != 0.0
    # whatever the kill interrupted carries no real name
    for child in tmp_path.iterdir():
        if child.name.startswith("step-"):
            ckpt.verify_checkpoint(child)
