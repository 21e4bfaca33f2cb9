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


def test_restarting_trainer_survives_a_killed_worker(tmp_path: Path) -> None:
    """Without --min-np/--max-np, --reset-limit restarts every process at the same size through torchrun, and
    the @hvd.elastic.run function resumes from the commit written to disk."""
    progress, results = tmp_path / "progress.jsonl", tmp_path / "final.json"
    script = str(SCRIPTS / "elastic_train.py")
    process = subprocess.Popen([*HOROVODRUN, "-np", "2", "--reset-limit", "3", "python", script,
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


RESIZE = str(SCRIPTS / "elastic_resize.py")


@pytest.mark.parametrize("lost_rank", [2, 0])
def test_elastic_job_loses_one_of_three_and_finishes_at_two(tmp_path: Path, lost_rank: int) -> None:
    """Rank 2, or rank 0 (whose place the lowest survivor takes, restoring its own copy of the commit)."""
    log, summary = tmp_path / "log.jsonl", tmp_path / "summary.json"
    done = _run(["-np", "3", "--min-np", "2", "--max-np", "3", "python", RESIZE, "--lose-rank", str(lost_rank),
                 "--lose-at-batch", "7", "--commit-every", "3", "--log", str(log), "--summary", str(summary)],
                tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"rank {lost_rank} (pid" in done.stderr and "exited with code -9" in done.stderr
    assert "the job goes on at 2 process(es) from its last commit" in done.stderr
    final = json.loads(summary.read_text())
    assert final["sizes_after_reset"] == [2] and final["size"] == 2
    assert final["lr"] == pytest.approx(0.02 * 2)  # the reset callback rescaled the learning rate
    assert final["epochs"] == 2 and final["seen"] == 2 * 576  # every sample of each epoch once: no batch redone
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    pids = list(dict.fromkeys(line["pid"] for line in lines))  # the processes that were rank 0, in order
    assert len(pids) == (2 if lost_rank == 0 else 1), "a process was restarted instead of going on"
    at_two = [line for line in lines if line["size"] == 2]
    assert [line["size"] for line in lines] == [3] * (len(lines) - len(at_two)) + [2] * len(at_two)
    assert (at_two[0]["epoch"], at_two[0]["batch"]) == (0, 7), "size 2 did not resume from the commit at batch 6"


def test_elastic_job_grows_when_discovery_reports_more_slots(tmp_path: Path) -> None:
    slots, script = tmp_path / "slots.txt", tmp_path / "discover.sh"
    slots.write_text("localhost:2\n")
    script.write_text(f"#!/bin/sh\ncat {slots}\n")
    script.chmod(0o755)
    log, summary = tmp_path / "log.jsonl", tmp_path / "summary.json"
    process = subprocess.Popen([*HOROVODRUN, "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
                                "python", RESIZE, "--pause", "0.05", "--log", str(log), "--summary", str(summary)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env())
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not log.is_file() or len(log.read_text().splitlines()) < 2):
        time.sleep(0.1)
    slots.write_text("localhost:3\n")
    out, err = process.communicate(timeout=400)
    assert process.returncode == 0, err[-3000:]
    assert "the job grows to 3 process(es) at its next commit" in err
    final = json.loads(summary.read_text())
    assert final["sizes_after_reset"] == [3] and final["size"] == 3 and final["lr"] == pytest.approx(0.02 * 3)
    assert final["epochs"] == 2 and final["seen"] == 2 * 576
    sizes = [json.loads(line)["size"] for line in log.read_text().splitlines()]
    assert sizes[0] == 2 and sizes[-1] == 3 and sizes == sorted(sizes)
