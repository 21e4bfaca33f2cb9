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
