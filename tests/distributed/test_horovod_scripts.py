"""Horovod-style scripts (tests/horovod_scripts/, written as Horovod's docs teach) run unchanged under
`dtrain horovodrun -np 2`: the synthetic benchmark, the Fashion-MNIST trainer, and the elastic trainer surviving
a worker killed from outside mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, fashion_mnist_available, subprocess_env

SCRIPTS = REPO / "tests" / "horovod_scripts"
HOROVODRUN = [sys.executable, "-m", "dtrain.cli", "horovodrun"]


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HOROVODRUN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env())


def test_synthetic_benchmark_prints_img_per_sec(tmp_path: Path) -> None:
    results = tmp_path / "bench.json"
    done = _run(["-np", "2", "python", str(SCRIPTS / "synthetic_benchmark.py"), "--num-iters", "2",
                 "--num-batches-per-iter", "1", "--num-warmup-batches", "1", "--batch-size", "4",
                 "--image-size", "16", "--results", str(results)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Img/sec per GPU:" in done.stdout and "Number of GPUs: 2" in done.stdout
    assert json.loads(results.read_text())["size"] == 2


@pytest.mark.skipif(not fashion_mnist_available(), reason="Fashion-MNIST is not installed (make setup installs it)")
def test_fashion_mnist_trainer_with_amp_pattern(tmp_path: Path) -> None:
    from dtrain.data.fashion_mnist import find_data_dir

    results = tmp_path / "metrics.json"
    done = _run(["-np", "2", "--timeline-filename", str(tmp_path / "timeline.json"), "python",
                 str(SCRIPTS / "fashion_mnist.py"), "--epochs", "1", "--train-samples", "1024", "--use-amp",
                 "--data-dir", str(find_data_dir()), "--results", str(results)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads(results.read_text())
    assert metrics["size"] == 2 and 0.0 <= metrics["accuracy"] <= 1.0
    assert "Test set: Average loss" in done.stdout
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert any(event["name"] == "ALLREDUCE" for event in trace)


def test_any_command_runs_with_horovod_variables(tmp_path: Path) -> None:
    done = _run(["-np", "2", "bash", "-c", "echo rank=$HOROVOD_RANK/$HOROVOD_SIZE local=$HOROVOD_LOCAL_RANK"],
                tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank=")) == [
        "rank=0/2 local=0", "rank=1/2 local=1"]


def test_a_failing_command_fails_the_job_with_one_line(tmp_path: Path) -> None:
    done = _run(["-np", "2", "python", "-c", "import sys; sys.exit(3)"], tmp_path)
    assert done.returncode == 1
    assert "dtrain horovodrun: python -c import sys; sys.exit(3) failed (rank 0: exit code 3" in done.stderr


def _worker_pids(root: int, script: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if script in command and "dtrain.horovod.exec" not in command and b"HOROVOD_RANK=1" in environ:
            pids.append(int(entry.name))
    return pids


def test_elastic_trainer_survives_a_killed_worker(tmp_path: Path) -> None:
    progress, results = tmp_path / "progress.jsonl", tmp_path / "final.json"
    script = str(SCRIPTS / "elastic_train.py")
    process = subprocess.Popen([*HOROVODRUN, "-np", "2", "--min-np", "2", "--max-np", "2", "python", script,
                                "--epochs", "2", "--sleep", "0.05", "--progress", str(progress),
                                "--results", str(results)], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=subprocess_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not progress.is_file() or len(progress.read_text().splitlines()) < 6):
        time.sleep(0.1)
    victims = _worker_pids(process.pid, script)
    assert victims, "no worker of rank 1 found to kill"
    os.kill(victims[0], signal.SIGKILL)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err[-2000:]
    lines = [json.loads(line) for line in progress.read_text().splitlines()]
    pids = list(dict.fromkeys(line["pid"] for line in lines))
    assert len(pids) == 2, "rank 0 should have run in two attempts"
    resumed = next(line for line in lines if line["pid"] == pids[1])
    assert (resumed["epoch"], resumed["batch"]) > (0, 1), "the restart began from scratch, not from the commit"
    final = json.loads(results.read_text())
    assert final["epochs"] == 2 and final["trained"] == 2 * 16  # 512 samples / (16 x 2 ranks) per epoch
