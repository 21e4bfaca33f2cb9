"""Starting on real clusters without processes: the network interface is picked from the route to the master and
a wrong one fails at once with one line naming it and the peer; `dtrain run` reads the PET_* variables that a
Kubeflow PyTorchJob sets (an option given on the command line wins)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from dtrain.cli import main
from dtrain.comm.topology import check_interface, interface_addresses, route_interface
from dtrain.errors import ExitCode, LaunchError
from dtrain.launch import LaunchResult, NodeSpec

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "fashion_mnist" / "distributed.yaml"


def test_the_interface_comes_from_the_route() -> None:
    assert route_interface("127.0.0.1") == "lo"
    assert interface_addresses()["lo"] == "127.0.0.1"
    others = {name: address for name, address in interface_addresses().items() if name != "lo"}
    for name, address in others.items():  # the route to an interface's own address leaves from it
        assert route_interface(address) == name


def test_a_wrong_interface_fails_at_once_naming_interface_and_peer() -> None:
    with pytest.raises(LaunchError, match="network interface 'nosuch0' has no IPv4 address"):
        check_interface("nosuch0", "10.255.255.1", 29500, timeout_seconds=60)
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"network interface lo \(127.0.0.1\) cannot reach the master "
                                          r"10.255.255.1:29500"):
        check_interface("lo", "10.255.255.1", 29500, timeout_seconds=60)  # no route from lo: no 60 s wait
    assert time.monotonic() - started < 30  # a bound, not a timing claim: it must not wait for the timeout


def test_a_listening_master_passes_and_a_silent_one_fails_within_the_timeout() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.2", 0))  # loopback, but not an address dtrain treats as "one machine"
        server.listen(1)
        port = server.getsockname()[1]
        check_interface("lo", "127.0.0.2", port, 5)
    with pytest.raises(LaunchError, match=f"network interface lo .* cannot reach the master 127.0.0.2:{port}"):
        check_interface("lo", "127.0.0.2", port, 1.0)  # refused until the timeout


def test_dtrain_run_reads_the_pytorchjob_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[NodeSpec] = []

    def launch(run_dir: Path, config: Any, node: NodeSpec) -> LaunchResult:
        seen.append(node)
        return LaunchResult(ExitCode.FAILED, "not started in this test")

    monkeypatch.setattr("dtrain.launch.launch_workers", launch)
    monkeypatch.setattr("dtrain.comm.topology.check_master_reachable", lambda *args: None)  # no such host here
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    monkeypatch.setenv("PET_MASTER_ADDR", "pytorchjob-master-0")
    monkeypatch.setenv("PET_MASTER_PORT", "23456")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "1")
    main(["run", str(DEMO), "--run-dir", str(tmp_path / "a")])
    assert (seen[-1].nnodes, seen[-1].node_rank, seen[-1].master_addr, seen[-1].master_port) == (
        2, 1, "pytorchjob-master-0", 23456)
    main(["run", str(DEMO), "--run-dir", str(tmp_path / "b"), "--node-rank", "0", "--network-interface", "eth0"])
    assert seen[-1].node_rank == 0 and seen[-1].network_interface == "eth0"  # the command line wins
    monkeypatch.setenv("PET_MASTER_PORT", "many")
    assert main(["run", str(DEMO), "--run-dir", str(tmp_path / "c")]) == ExitCode.USER_ERROR


def test_a_node_that_did_not_run_rank_0_ends_ok_without_the_chiefs_summary(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --rdzv-endpoint every node has --node-rank 0 and the rendezvous picks the chief: the agent returns the
    global ranks this node ran (ran_rank_zero); a node without rank 0 has no summary and must not say it stopped."""
    from dtrain.launch import ran_rank_zero

    assert ran_rank_zero({0: None, 1: None}) and not ran_rank_zero({2: None, 3: None}) and not ran_rank_zero(None)
    monkeypatch.setattr("dtrain.launch.launch_workers", lambda *_: LaunchResult(ExitCode.OK, chief=False))
    assert main(["run", str(DEMO), "--run-dir", str(tmp_path / "a"), "--nnodes", "2",
                 "--rdzv-endpoint", "10.0.0.1:29400"]) == ExitCode.OK
    assert "training" not in capsys.readouterr().out


SLURM_STEP = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
              "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[1-2]"}


def _in_slurm_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **changed: str) -> list[NodeSpec]:
    """`dtrain run` as a task of `srun --ntasks-per-node=1` would see it (scontrol replaced: it expands n[1-2])."""
    seen: list[NodeSpec] = []

    def launch(run_dir: Path, config: Any, node: NodeSpec) -> LaunchResult:
        seen.append(node)
        (tmp_path / "run_dir").write_text(str(run_dir))
        return LaunchResult(ExitCode.FAILED, "not started in this test")

    monkeypatch.setattr("dtrain.launch.launch_workers", launch)
    monkeypatch.setattr("dtrain.comm.slurm.first_host", lambda environ: "n1")
    monkeypatch.setattr("dtrain.comm.topology.check_master_reachable", lambda *args: None)
    monkeypatch.setenv("DTRAIN_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for name, value in {**SLURM_STEP, **changed}.items():
        monkeypatch.setenv(name, value)
    return seen


def test_dtrain_run_in_a_slurm_step_takes_the_job_from_slurm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = _in_slurm_step(monkeypatch, tmp_path)
    main(["run", str(DEMO), "--set", "resources.slots_per_trial=4"])
    assert (seen[-1].nnodes, seen[-1].node_rank, seen[-1].master_addr, seen[-1].master_port) == (
        2, 1, "n1", 20000 + 1234)
    # the run dir is keyed by the job id, so a requeued job (same id) resumes there; node 1 keeps its own
    assert (tmp_path / "run_dir").read_text() == str((tmp_path / "runs" / "fashion_mnist_distributed" /
                                                      "slurm-1234-node1").resolve())
    monkeypatch.setenv("MASTER_PORT", "29555")
    main(["run", str(DEMO), "--set", "resources.slots_per_trial=4", "--run-dir", str(tmp_path / "b")])
    assert seen[-1].master_port == 29555


def test_dtrain_run_in_the_batch_script_itself_takes_nothing_from_slurm(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = _in_slurm_step(monkeypatch, tmp_path)
    monkeypatch.delenv("SLURM_STEP_ID")  # the batch shell has the job's variables but no step
    main(["run", str(DEMO), "--run-dir", str(tmp_path / "a")])
    assert (seen[-1].nnodes, seen[-1].node_rank, seen[-1].master_addr) == (1, 0, "127.0.0.1")


def test_bad_slurm_steps_are_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    seen = _in_slurm_step(monkeypatch, tmp_path)
    assert main(["run", str(DEMO), "--nnodes", "3"]) == ExitCode.USER_ERROR
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == ["dtrain: error: --nnodes 3 disagrees with this Slurm job step's SLURM_NNODES=2: drop --nnodes "
                      "(dtrain run takes it from Slurm), or submit the job with --nodes=3"]
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # srun --ntasks-per-node=2 dtrain run ...
    assert main(["run", str(DEMO)]) == ExitCode.USER_ERROR
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "start one per node (srun --ntasks-per-node=1)" in errors[0]
    assert seen == []


def test_the_slurm_master_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.comm import slurm

    assert slurm.master_port({"SLURM_JOB_ID": "45678"}) == 20000 + 45678 % 20000
    assert slurm.master_port({"SLURM_JOB_ID": "1", "MASTER_PORT": "29500"}) == 29500
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST is not set"):
        slurm.first_host({})
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(LaunchError, match="`scontrol` is not on PATH"):
        slurm.first_host({"SLURM_JOB_NODELIST": "n[1-2]"})


def test_a_master_this_node_cannot_reach_is_one_line() -> None:
    from dtrain.comm.topology import check_master_reachable

    with pytest.raises(LaunchError, match="cannot resolve the master's name 'no-such-host.invalid'"):
        check_master_reachable("no-such-host.invalid", 29500, timeout_seconds=60)
    with socket.socket() as server:
        server.bind(("127.0.0.2", 0))
        server.listen(1)
        port = server.getsockname()[1]
        check_master_reachable("127.0.0.2", port, 5)
    with pytest.raises(LaunchError, match=f"cannot reach the master 127.0.0.2:{port}: Connection refused; every "
                                          "node must reach node 0"):
        check_master_reachable("127.0.0.2", port, 0.5)  # refused until the timeout


def test_a_preemption_is_recorded_with_its_cost(tmp_path: Path) -> None:
    from dtrain.runs.preemptions import describe_preemptions, read_preemptions, record_preemption

    (tmp_path / "checkpoints").mkdir()
    latest = tmp_path / "checkpoints" / "latest"
    latest.write_text("step-352")
    written = latest.stat().st_mtime
    record_preemption(tmp_path, "7", written - 2.5)  # the checkpoint came 2.5 s after the signal: nothing redone
    record_preemption(tmp_path, "7", written + 10)  # the newest checkpoint is older than the signal: lost batches
    found = read_preemptions(tmp_path)
    assert [(p["checkpoint"], p["seconds_to_checkpoint"], p["batches_redone"]) for p in found] == [
        ("step-352", 2.5, 0), ("step-352", -10.0, None)]
    assert describe_preemptions(found[:1]) == "1 (2.5 s from the signal to the checkpoint on disk; 0 batches redone)"
    assert "unknown batches redone" in describe_preemptions(found)
