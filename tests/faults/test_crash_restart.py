"""Crash-and-restart scenarios: workers SIGKILLed at different batches and ranks, in the middle of a
checkpoint write, several times in one run, a corrupt latest checkpoint and a graceful Ctrl-C. Each run
ends with a final model bitwise identical to the uninterrupted run with the same seed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultkit import CONFIG, dtrain, error_lines, fault_records, final_model, summary, uninterrupted_model

from dtrain.train import checkpoint as ckpt

pytestmark = pytest.mark.slow  # workers are killed and restarted, several runs per test


@pytest.fixture(scope="module")
def clean_model(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return uninterrupted_model(tmp_path_factory.mktemp("clean"))


# Five crashes in two runs (a restart costs a few seconds of worker start-up, a run more): each kill is
# (rank, batch, during) and each restart resumes from the checkpoint listed (None: from scratch).
# digits.yaml checkpoints after batches 10, 20, 30 and 40.
SCENARIOS = {
    # rank 0 before the first checkpoint (restart from scratch), then rank 1 in the middle of an interval
    "from-scratch-then-mid-interval": ("[{rank: 0, batch: 5}, {rank: 1, batch: 25}]", [None, 20]),
    # rank 1 right after a checkpoint, rank 0 in the middle of a checkpoint write (its partial directory is
    # never used), rank 0 again inside the final checkpoint write
    "after-and-inside-checkpoint-writes": (
        "[{rank: 1, batch: 11}, {rank: 0, batch: 20, during: checkpoint}, {rank: 0, batch: 40, during: checkpoint}]",
        [10, 10, 30]),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_killed_workers_restart_and_end_bitwise_identical(name: str, clean_model: bytes, tmp_path: Path) -> None:
    kills, resumed_from = SCENARIOS[name]
    run_dir = tmp_path / "run"
    result = dtrain("run", CONFIG, "--set", f"faults.kills={kills}", "--set", "max_restarts=3", "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    fired = fault_records(run_dir)
    assert [(r["rank"], r["batch"], r["during"]) for r in fired] == [
        (k["rank"], k["batch"], k.get("during", "step")) for k in _parse(kills)]
    assert [r["restart"] for r in fired] == list(range(len(fired)))  # one kill per attempt, in order
    assert summary(run_dir)["restarts"] == len(fired)
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert [int(line.rsplit("step-", 1)[1]) for line in log.splitlines() if "resumed from checkpoint" in line] == [
        step for step in resumed_from if step is not None]
    assert final_model(run_dir) == clean_model
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".partial")]


def _parse(kills: str) -> list[dict[str, object]]:
    import yaml

    return list(yaml.safe_load(kills))


def test_ctrl_c_checkpoints_then_a_corrupt_checkpoint_falls_back(clean_model: bytes, tmp_path: Path) -> None:
    """SIGINT to `dtrain run` (what Ctrl-C sends): the agent passes it on, the workers agree to stop after
    the current batch, write a checkpoint there and exit with 130. That checkpoint is then corrupted: the
    same command warns, resumes from the previous complete one and ends bitwise identical."""
    run_dir = tmp_path / "run"
    slow = ["--set", "faults.slow_rank=1", "--set", "faults.slow_factor=60"]  # ~0.1 s per batch: time to interrupt
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), *slow, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert latest.exists(), "no checkpoint appeared"
    kept_before = int(latest.read_text().strip().removeprefix("step-"))
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    [line] = error_lines(stderr)
    assert "interrupted by SIGINT" in line and "checkpoints/step-" in line
    stopped_at = int(latest.read_text().strip().removeprefix("step-"))
    assert kept_before < stopped_at < 40, (kept_before, stopped_at)  # after the signal, before the end (batch 40)
    assert f"SIGINT: stopped after batch {stopped_at} with a checkpoint" in stderr
    assert summary(run_dir)["status"] == "interrupted"
    ref = ckpt.verify_checkpoint(run_dir / "checkpoints" / f"step-{stopped_at}")
    assert ckpt.load_checkpoint(ref)[1]["trainer"]["steps_completed"] == stopped_at

    # then the checkpoint it wrote is damaged (one flipped byte): the resume falls back to the previous one
    previous = [c.step for c in map(ckpt.verify_checkpoint, ckpt.list_checkpoints(run_dir / "checkpoints"))
                if c.step < stopped_at][-1]
    model = ref.model_path
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    resumed = dtrain("run", CONFIG, "--run-dir", run_dir)
    assert resumed.returncode == 0, resumed.stderr
    warning = [line for line in resumed.stderr.splitlines() if "does not match its checksum" in line]
    assert len(warning) == 1 and "resuming from the previous complete checkpoint" in warning[0], resumed.stderr
    assert f"resuming at batch {previous}" in resumed.stderr
    assert final_model(run_dir) == clean_model
