"""dtrain on a real Slurm cluster (benchmarks/slurm_cluster.py: Debian's Slurm 22.05, munged and slurmctld in the
root namespace, a slurmd in each of 2 node namespaces; needs root, iproute2 and the Slurm packages, which the
fixture installs when missing; skipped with the reason otherwise). `sbatch examples/clusters/sbatch.sh` (one
`dtrain run` per node) and `examples/clusters/srun_per_slot.sh` (one worker per slot, no torchrun) end with the
same final model, bitwise, as the same experiment started by hand with `dtrain run --nnodes 2` on the namespace
cluster; bad input under Slurm is one line naming the fix; jobs of both forms preempted and sent SIGUSR1, requeued
and resumed, end bitwise identical to one uninterrupted run (the long ones: about 6.5 minutes of the file's 9)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import ClusterUnavailable, emulated_cluster  # noqa: E402
from slurm_cluster import SlurmCluster, install_packages, slurm_down, slurm_up, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the Slurm cluster needs root (namespaces, daemons)")

CONFIG = REPO / "tests" / "fixtures" / "digits.yaml"
SETTINGS = ["--set", "searcher.max_length.batches=8", "--set", "min_checkpoint_period.batches=3",
            "--set", "min_validation_period.batches=8", "--set", "distributed.timeout_seconds=120"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A 2-node cluster of its own (its own subnet and ports, beside one that `make slurm-up` may have started)."""
    root = tmp_path_factory.mktemp("slurm")
    try:
        install_packages()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the Slurm packages could not be installed: {exc}")
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        cluster = slurm_up(root, subnet="10.202.0", port=6837)
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        slurm_down(root)


def final_model(run_dir: Path, step: int = 8) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step-{step}" / "model.pt",  # type: ignore[no-any-return]
                      weights_only=True)


def test_sbatch_and_srun_per_slot_end_as_dtrain_run_by_hand(slurm: SlurmCluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    env = slurm.job_environment(runs)
    per_node = slurm.submit(["examples/clusters/sbatch.sh", str(CONFIG), *SETTINGS], env, tmp_path / "sbatch.out")
    per_slot = slurm.submit(["examples/clusters/srun_per_slot.sh", str(CONFIG), *SETTINGS], env,
                            tmp_path / "per-slot.out")
    with emulated_cluster(nodes=2, rate="200mbit") as cluster:  # the same experiment by hand, meanwhile
        logs = [(tmp_path / f"hand{i}.out").open("w") for i in range(2)]
        hand = [cluster.start(i, cluster.dtrain_run(i, CONFIG, tmp_path / f"hand{i}", 29421,
                                                    ["--set", "resources.slots_per_trial=4", *SETTINGS]),
                              stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
        codes = [process.wait(timeout=600) for process in hand]
    assert codes == [0, 0], [(tmp_path / f"hand{i}.out").read_text() for i in range(2)]
    states = [slurm.wait(per_node), slurm.wait(per_slot)]
    assert states == ["COMPLETED", "COMPLETED"], [(tmp_path / n).read_text() for n in ("sbatch.out", "per-slot.out")]
    reference = final_model(tmp_path / "hand0")
    # the run dirs are keyed by the job id: runs/<name>/slurm-<job id>, node 1's beside it for `dtrain run`
    assert (runs / "digits_test" / f"slurm-{per_node}-node1" / "logs").is_dir()
    for job in (per_node, per_slot):
        model = final_model(runs / "digits_test" / f"slurm-{job}")
        assert model.keys() == reference.keys()
        for key in reference:
            assert torch.equal(model[key], reference[key]), (job, key)


def test_nnodes_that_disagree_with_slurm_and_tasks_per_node_are_one_line(slurm: SlurmCluster, tmp_path: Path) -> None:
    env = slurm.job_environment(tmp_path / "runs")
    dtrain_run = ["dtrain", "run", str(CONFIG), "--set", "resources.slots_per_trial=4"]
    wrong = subprocess.run(["srun", "-N2", "--ntasks-per-node=1", *dtrain_run, "--nnodes", "3"], env=env,
                           capture_output=True, text=True, timeout=300)
    errors = [line for line in wrong.stderr.splitlines() if line.startswith("dtrain: error:")]
    assert wrong.returncode != 0 and len(errors) == 2, wrong.stderr  # one line from each node's task
    assert "--nnodes 3 disagrees with this Slurm job step's SLURM_NNODES=2: drop --nnodes" in errors[0]
    many = subprocess.run(["srun", "-N1", "--ntasks-per-node=2", *dtrain_run], env=env, capture_output=True,
                          text=True, timeout=300)
    errors = [line for line in many.stderr.splitlines() if line.startswith("dtrain: error:")]
    assert many.returncode != 0 and len(errors) == 2, many.stderr
    assert "start one per node (srun --ntasks-per-node=1)" in errors[0]


def test_a_node_that_cannot_reach_the_master_is_one_line(slurm: SlurmCluster, tmp_path: Path) -> None:
    env = slurm.job_environment(tmp_path / "runs")
    job = slurm.submit(["examples/clusters/sbatch.sh", str(CONFIG), *SETTINGS, "--master-addr", "10.202.0.99"], env,
                       tmp_path / "job.out")
    assert slurm.wait(job, timeout=300) == "FAILED"
    output = (tmp_path / "job.out").read_text()
    errors = [line for line in output.splitlines() if "cannot reach the master" in line]
    assert len(errors) == 1, output
    assert errors[0].startswith("dtrain: error: this node (n2) cannot reach the master 10.202.0.99:"), output
    assert "Traceback" not in output


def _wait_for_line(path: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} did not appear in {path}: {path.read_text() if path.is_file() else ''}")


LONG = ["--set", "searcher.max_length.batches=1000", "--set", "min_checkpoint_period.batches=100000",
        "--set", "min_validation_period.batches=100000", "--set", "distributed.find_unused_parameters=true",
        "--set", "distributed.timeout_seconds=120"]


@pytest.fixture(scope="module")
def uninterrupted(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """The 1000-batch run (`LONG`) by hand with `dtrain run --nnodes 2` on the namespace cluster, started once in
    the background for the preemption tests; call it to wait for its run dir. find_unused_parameters keeps DDP's
    bucket layout fixed: with 3 or more ranks, the default rebuilds it after the first step, which a resumed run
    repeats one step later."""
    out = tmp_path_factory.mktemp("uninterrupted")
    with emulated_cluster(nodes=2, rate="200mbit") as cluster:
        logs = [(out / f"hand{i}.out").open("w") for i in range(2)]
        hand = [cluster.start(i, cluster.dtrain_run(i, CONFIG, out / f"hand{i}", 29431,
                                                    ["--set", "resources.slots_per_trial=4", *LONG]),
                              stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]

        def finished() -> Path:
            codes = [process.wait(timeout=900) for process in hand]
            assert codes == [0, 0], [(out / f"hand{i}.out").read_text()[-3000:] for i in range(2)]
            return out / "hand0"

        try:
            yield finished
        finally:
            for process in hand:
                if process.poll() is None:
                    process.kill()
                    process.wait()


def _requeued(slurm: SlurmCluster, job: str, output: Path, restarts: int) -> None:
    """Wait until `job` is requeued (pending, its restart count at `restarts`), then lift Slurm's begin-time hold
    so that it starts again at once."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=slurm.environment(), capture_output=True,
                               text=True).stdout
        if "JobState=PENDING" in shown and f"Restarts={restarts}" in shown:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"job {job} was not requeued: {shown}\n{output.read_text()}")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm.environment(), check=True)


def _preempt(slurm: SlurmCluster, job: str, output: Path, restarts: int) -> None:
    """Submit a job to the high partition that needs every CPU of both nodes: Slurm preempts `job` (SIGTERM with a
    PreemptTime); once it is requeued and the high job has ended, it starts again at once."""
    high = slurm.submit(["-p", "high", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=4", "--wrap", "sleep 1"],
                        slurm.environment(), output.with_name(f"high-{restarts}.out"))
    _requeued(slurm, job, output, restarts)
    assert slurm.wait(high) == "COMPLETED"


def _signal(slurm: SlurmCluster, job: str, output: Path, restarts: int, *scancel: str) -> None:
    """`scancel --signal=USR1 [--batch] JOB`: the checkpoint-and-requeue request, to the job's steps or (--batch,
    as `sbatch --signal=B:USR1@N` sends it) to the batch shell only, which passes it on."""
    subprocess.run(["scancel", "--signal=USR1", *scancel, job], env=slurm.environment(), check=True)
    _requeued(slurm, job, output, restarts)


def _same_model(run_dir: Path, reference_dir: Path) -> None:
    reference = final_model(reference_dir, 1000)
    model = final_model(run_dir, 1000)
    for key in reference:
        assert torch.equal(model[key], reference[key]), key


def test_a_job_preempted_twice_is_requeued_and_ends_bitwise_identical(
        slurm: SlurmCluster, uninterrupted: Callable[[], Path], tmp_path: Path) -> None:
    """One `dtrain run` per node: each preemption's SIGTERM makes the workers checkpoint after their batch;
    `dtrain run` requeues the job, which resumes from its run dir (keyed by its id). A third stop, `scancel
    --signal=USR1` to the job's steps (torchrun's agent included, which torch's default signal list would let die),
    is a checkpoint and a requeue too."""
    runs, output = tmp_path / "runs", tmp_path / "job.out"
    job = slurm.submit(["examples/clusters/sbatch.sh", str(CONFIG), *LONG], slurm.job_environment(runs), output)
    _wait_for_line(output, "batch 100/1000")
    _preempt(slurm, job, output, restarts=1)
    _wait_for_line(output, "batch 500/1000")
    _preempt(slurm, job, output, restarts=2)
    _wait_for_line(output, "batch 800/1000")
    _signal(slurm, job, output, 3)
    assert slurm.wait(job) == "COMPLETED", output.read_text()
    text = output.read_text()
    stops = [(name, int(n)) for name, n in re.findall(r"(SIG\w+): stopped after batch (\d+) with a checkpoint", text)]
    assert [name for name, _ in stops] == ["SIGTERM", "SIGTERM", "SIGUSR1"], text
    assert text.count(f"dtrain: preempted by Slurm: job {job} requeued") == 2, text
    assert text.count(f"dtrain: SIGUSR1 (checkpoint and requeue): job {job} requeued") == 1, text
    assert all(f"resuming at batch {n}, preemptions survived: {i + 1} (" in text for i, (_, n) in enumerate(stops))
    summary = json.loads((runs / "digits_test" / f"slurm-{job}" / "summary.json").read_text())
    assert [(p["signal"], p["checkpoint"]) for p in summary["preemptions"]] == [
        (name, f"step-{n}") for name, n in stops]
    assert all(p["batches_redone"] == 0 and p["seconds_to_checkpoint"] >= 0 for p in summary["preemptions"])
    assert "  preempted    3 (" in text and "; 0 batches redone)" in text
    _same_model(runs / "digits_test" / f"slurm-{job}", uninterrupted())


def test_a_per_slot_job_preempted_then_signalled_is_requeued_and_ends_bitwise_identical(
        slurm: SlurmCluster, uninterrupted: Callable[[], Path], tmp_path: Path) -> None:
    """One process per slot, no torchrun: on the preemption's SIGTERM, then on a SIGUSR1 sent to the batch shell
    only (`scancel --batch`, as `sbatch --signal=B:USR1@N` does; the script passes it on), every worker stops after
    its batch, rank 0 writes the checkpoint and requeues the job, which resumes bitwise where it would have gone."""
    runs, output = tmp_path / "runs", tmp_path / "job.out"
    job = slurm.submit(["examples/clusters/srun_per_slot.sh", str(CONFIG), *LONG], slurm.job_environment(runs),
                       output)
    _wait_for_line(output, "batch 100/1000")
    _preempt(slurm, job, output, restarts=1)
    _wait_for_line(output, "batch 500/1000")
    _signal(slurm, job, output, 2, "--batch")
    assert slurm.wait(job) == "COMPLETED", output.read_text()
    text = output.read_text()
    stops = [(name, int(n)) for name, n in re.findall(r"(SIG\w+): stopped after batch (\d+) with a checkpoint", text)]
    assert [name for name, _ in stops] == ["SIGTERM", "SIGUSR1"], text
    assert f"dtrain: preempted by Slurm: job {job} requeued" in text, text
    assert f"dtrain: SIGUSR1 (checkpoint and requeue): job {job} requeued" in text, text
    assert "srun_per_slot.sh: SIGUSR1" in text, text
    summary = json.loads((runs / "digits_test" / f"slurm-{job}" / "summary.json").read_text())
    assert [(p["signal"], p["checkpoint"], p["batches_redone"]) for p in summary["preemptions"]] == [
        (name, f"step-{n}", 0) for name, n in stops]
    _same_model(runs / "digits_test" / f"slurm-{job}", uninterrupted())
