"""dtrain/comm/rendezvous_store.py and `dtrain rendezvous`: a store that outlives the nodes, in-process on loopback.

Agents join torch's c10d rendezvous there as clients; a job that ended (its rendezvous closed) can start again with
the same id; an endpoint that nobody serves, a malformed one, and --rdzv-endpoint beside --node-rank or --master-*
are one line each; nodes that prepare one shared run dir at once register it once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from dtrain.cli import main
from dtrain.comm import rendezvous_store
from dtrain.comm.rendezvous_store import (
    check_endpoint,
    parse_endpoint,
    rendezvous_configs,
    reopen_if_closed,
    serve_store,
)
from dtrain.config import load_config
from dtrain.errors import ExitCode, LaunchError
from dtrain.runs import rundir
from tests.conftest import FIXTURES, free_port


def _client(endpoint: str, run_id: str) -> object:
    """A node's rendezvous handler as `dtrain run --rdzv-endpoint` builds it: plain c10d, a client of the store."""
    params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1,
                                  local_addr="127.0.0.1", **rendezvous_configs(endpoint))
    return get_rendezvous_handler(params)


def test_a_job_on_a_served_store_is_a_client_and_the_next_job_with_its_id_starts_again() -> None:
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    assert rendezvous_configs(endpoint) == {"is_host": True}  # nothing serves it yet: this machine's agent hosts it
    store = serve_store("127.0.0.1", port)
    try:
        assert rendezvous_configs(endpoint) == {"is_host": False}  # served: every agent is a client
        first = _client(endpoint, "job")
        info = first.next_rendezvous()  # type: ignore[attr-defined]
        assert (info.rank, info.world_size) == (0, 1)
        first.shutdown()  # type: ignore[attr-defined]  # what torch's launcher does when the job ends
        with pytest.raises(RendezvousClosedError):  # what the next job with this id would meet without reopening
            _client(endpoint, "job").next_rendezvous()  # type: ignore[attr-defined]
        reopened = reopen_if_closed(endpoint, "job")
        assert reopened is not None and reopened >= 1
        assert reopen_if_closed(endpoint, "job") is None  # open now: a second node that starts leaves it alone
        again = _client(endpoint, "job")
        info = again.next_rendezvous()  # type: ignore[attr-defined]
        assert (info.rank, info.world_size) == (0, 1)
        again.shutdown()  # type: ignore[attr-defined]
        assert reopen_if_closed(endpoint, "never-used") is None
    finally:
        del store


def test_an_endpoint_nobody_serves_is_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rendezvous_store, "is_own_address", lambda host: False)  # as seen from another machine
    probes: list[tuple[str, int, float]] = []
    real_probe = rendezvous_store.probe_port

    def recording_probe(address: str, port: int, wait_seconds: float) -> OSError | None:
        probes.append((address, port, wait_seconds))
        return real_probe(address, port, wait_seconds)

    monkeypatch.setattr(rendezvous_store, "probe_port", recording_probe)
    port = free_port()
    with pytest.raises(LaunchError) as raised:
        check_endpoint(f"127.0.0.1:{port}", wait_seconds=1.0)
    assert f"dtrain rendezvous --port {port}` on 127.0.0.1" in str(raised.value)
    assert ", waited 1 s," in str(raised.value)
    # it probed the port once with the wait asked for, not through torch's store and its minutes of retries
    assert probes == [("127.0.0.1", port, 1.0)]
    store = serve_store("127.0.0.1", port)
    try:
        check_endpoint(f"127.0.0.1:{port}", wait_seconds=1.0)  # served: nothing to say
    finally:
        del store
    for bad in ("login1", "login1:http", ":29400", "login1:0"):
        with pytest.raises(LaunchError, match="give HOST:PORT"):
            parse_endpoint(bad)


def test_dtrain_rendezvous_on_a_taken_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    store = serve_store("127.0.0.1", port)
    try:
        assert main(["rendezvous", "--host", "127.0.0.1", "--port", str(port)]) == ExitCode.USER_ERROR
    finally:
        del store
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0] and "give a free --port" in err[0]


@pytest.mark.parametrize("extra", [["--node-rank", "1"], ["--master-addr", "10.0.0.1", "--master-port", "29500"]])
def test_rdzv_endpoint_beside_a_node_rank_or_master_is_one_line(
        extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", str(FIXTURES / "digits.yaml"), "--run-dir", str(tmp_path / "run"), "--nnodes", "1:2",
            "--rdzv-endpoint", "login1:29400", *extra]
    assert main(argv) == ExitCode.USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "there is no node rank or master to give; drop" in err[0], err
    assert not (tmp_path / "run").exists()  # nothing was touched


def test_a_run_with_an_endpoint_nobody_serves_stops_before_any_worker(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(rendezvous_store, "is_own_address", lambda host: False)
    monkeypatch.setattr("dtrain.launch.launch_workers", lambda *_: pytest.fail("the workers were started"))
    port = free_port()
    argv = ["run", str(FIXTURES / "digits.yaml"), "--run-dir", str(tmp_path / "run"), "--nnodes", "1:2",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--set", "distributed.timeout_seconds=1"]
    assert main(argv) == ExitCode.USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"nothing serves the rendezvous at --rdzv-endpoint 127.0.0.1:{port}" in err[0], err


def test_nodes_that_prepare_one_shared_run_dir_at_once_register_it_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DTRAIN_RUNS_ROOT", str(tmp_path / "runs"))
    create = rundir.RunStore.create_experiment

    def slow_create(self: object, *args: object) -> int:  # widen the window in which both would register
        time.sleep(0.3)
        return create(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(rundir.RunStore, "create_experiment", slow_create)
    loaded = load_config(FIXTURES / "digits.yaml")
    found: list[rundir.RunInfo] = []
    start = threading.Barrier(2)

    def node() -> None:
        start.wait()
        found.append(rundir.prepare_run_dir(loaded.config, tmp_path / "shared", loaded.base_dir))

    threads = [threading.Thread(target=node) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 2 and found[0].experiment_id == found[1].experiment_id
    assert sorted(info.resumed for info in found) == [False, True]


def test_an_agent_that_loses_its_store_ends_with_one_line_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The store hosted by node 0's agent goes with node 0: torch's agent raises RendezvousConnectionError (seen on
    the emulated cluster with a traceback of 40 lines); dtrain says what happened and what to do instead."""
    import os

    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher import api

    from dtrain.launch import NodeSpec, launch_workers

    def lost(*_: object, **__: object) -> object:
        def run(*_: object) -> object:
            try:
                raise RuntimeError("Connection reset by peer")
            except RuntimeError as exc:
                raise RendezvousConnectionError("The connection to the C10d store has failed.") from exc
        return run

    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.setattr(api, "elastic_launch", lost)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(FIXTURES / "digits.yaml").config
    node = NodeSpec(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=free_port(), min_nodes=1)
    result = launch_workers(run_dir, config, node)
    assert result.exit_code == ExitCode.FAILED and result.message is not None
    assert "lost the rendezvous store at 127.0.0.1:" in result.message
    assert "(Connection reset by peer)" in result.message
    assert "node 0 (--master-addr)" in result.message and "`dtrain rendezvous`" in result.message
    assert "no checkpoint was written yet" in result.message and "\n" not in result.message
