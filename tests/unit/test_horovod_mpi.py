"""Horovod scripts under mpirun, without processes: ranks from Open MPI's, Hydra's (MPICH, Intel MPI) and
MVAPICH's variables, local and cross ranks from where the launcher put each rank (not from rank order), the port,
the one-line error across hosts without MASTER_ADDR, and the mpirun command line `dtrain horovodrun --mpi` runs."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

from dtrain.errors import LaunchError
from dtrain.horovod.launcher import HorovodRun, parse_hosts
from dtrain.horovod.mpi import (
    LAUNCHERS,
    across_hosts_error,
    host_layout,
    launcher_process,
    master_port,
    read_mpi_process,
)
from dtrain.horovod.mpi_launch import (
    HYDRA,
    OPEN_MPI,
    check_mpi_run,
    master_address,
    mpirun_command,
    rank_variables,
    rank_zero_host,
)

OPEN_MPI_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "2"}
HYDRA_RANK_3 = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "9"}


def test_ranks_come_from_each_mpi_launcher_s_variables() -> None:
    ompi = read_mpi_process(OPEN_MPI_RANK_1)
    assert ompi is not None and ompi.launcher.name == "Open MPI"
    assert (ompi.rank, ompi.size, ompi.local_rank, ompi.local_size, ompi.single_host) == (1, 4, 2, 4, True)
    hydra = read_mpi_process(HYDRA_RANK_3)
    assert hydra is not None and hydra.launcher.name == "MPICH or Intel MPI (Hydra)"
    assert (hydra.rank, hydra.size, hydra.local_rank, hydra.local_size, hydra.single_host) == (3, 4, 1, 2, False)
    mvapich = read_mpi_process({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"})
    assert mvapich is not None and (mvapich.rank, mvapich.local_rank, mvapich.local_size) == (0, None, None)
    assert not mvapich.single_host  # an unknown spread is not taken for one host
    assert read_mpi_process({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0"}) is None
    with pytest.raises(ValueError, match="PMI_RANK=5 and PMI_SIZE=4"):
        read_mpi_process({"PMI_RANK": "5", "PMI_SIZE": "4"})


def test_local_rank_is_the_launcher_s_not_rank_order() -> None:
    # Open MPI's default mapping under --oversubscribe -np 4 (seen on Open MPI 5): rank 1 is local rank 2
    process = read_mpi_process(OPEN_MPI_RANK_1)
    assert process is not None
    placements: list[tuple[str, int | None]] = [("a", 0), ("a", 2), ("a", 1), ("a", 3)]
    layout = host_layout(process, placements)
    assert (layout.local_rank, layout.local_size, layout.cross_rank, layout.cross_size) == (2, 4, 0, 1)
    assert layout.local_rank != process.rank % layout.local_size


def test_cross_ranks_split_by_local_rank_across_hosts() -> None:
    process = read_mpi_process(HYDRA_RANK_3)
    assert process is not None
    # 2 hosts of 2 ranks, placed round-robin (rank 1 on host b), the local ranks as Hydra gives them
    placements: list[tuple[str, int | None]] = [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    layout = host_layout(process, placements)
    assert (layout.local_rank, layout.local_size, layout.cross_rank, layout.cross_size) == (1, 2, 1, 2)
    # a launcher without local ranks: the position among the ranks on the same host
    blind = read_mpi_process({"PMI_RANK": "2", "PMI_SIZE": "4"})
    assert blind is not None
    layout = host_layout(blind, [("a", None), ("b", None), ("a", None), ("b", None)])
    assert (layout.local_rank, layout.local_size, layout.cross_rank, layout.cross_size) == (1, 2, 0, 2)


def test_across_hosts_without_master_addr_is_one_line_naming_the_fix() -> None:
    process = read_mpi_process(HYDRA_RANK_3)
    assert process is not None
    message = across_hosts_error(process)
    assert "\n" not in message and "MPI_LOCALNRANKS=2 of PMI_SIZE=4" in message
    assert "mpirun -x MASTER_ADDR=" in message and "-genv MASTER_ADDR" in message
    blind = read_mpi_process({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"})
    assert blind is not None and "no MV2_COMM_WORLD_LOCAL_SIZE" in across_hosts_error(blind)


def test_master_port_from_the_environment_or_open_mpi_s_job_id() -> None:
    assert master_port({"MASTER_PORT": "23456", "PMIX_NAMESPACE": "1946288129"}) == 23456
    assert master_port({"PMIX_NAMESPACE": "1946288129"}) == 20000 + zlib.crc32(b"1946288129") % 20000
    assert master_port({}) == 29500


def test_the_launcher_process_is_the_first_ancestor_without_the_rank_variable() -> None:
    assert launcher_process("DTRAIN_NO_SUCH_RANK_VARIABLE")[0] == os.getppid()
    assert launcher_process("DTRAIN_NO_SUCH_RANK_VARIABLE", start=os.getpid())[0] == os.getpid()
    assert {launcher.rank for launcher in LAUNCHERS} == {"OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK"}


def test_mpirun_command_lines() -> None:
    run = HorovodRun(command=["python", "train.py", "--epochs", "1"], np=3)
    line = mpirun_command(run, "/usr/bin/mpirun", OPEN_MPI, {"PYTHONPATH": "/shim", "PATH": "/bin"}, root=True,
                          cores=2)
    assert line == ["/usr/bin/mpirun", "-np", "3", "--bind-to", "none", "--map-by", "slot", "--allow-run-as-root",
                    "--oversubscribe", "-x", "PYTHONPATH", "-x", "PATH", sys.executable, "train.py", "--epochs", "1"]
    run = HorovodRun(command=["bash", "-c", "true"], hosts=[("a", 2), ("b", 2)])
    assert mpirun_command(run, "mpirun", OPEN_MPI, {}, root=False, cores=2) == [
        "mpirun", "-np", "4", "-H", "a:2,b:2", "--bind-to", "none", "--map-by", "slot", "bash", "-c", "true"]
    assert mpirun_command(run, "mpiexec", HYDRA, {"PATH": "/bin", "MASTER_ADDR": "a"}, root=True, cores=2) == [
        "mpiexec", "-np", "4", "-hosts", "a:2,b:2", "-genvlist", "PATH", "-genv", "MASTER_ADDR", "a", "bash", "-c",
        "true"]


def _mpi_line(hosts: str, environ: dict[str, str]) -> list[str]:
    """The Open MPI line `dtrain horovodrun --mpi -H <hosts> python train.py` builds in `environ`, as root."""
    run = HorovodRun(command=["python", "train.py"], hosts=parse_hosts(hosts))
    check_mpi_run(run, environ)
    master = master_address(run, OPEN_MPI, environ)
    if master is not None:
        environ = {**environ, "MASTER_ADDR": master}
    return mpirun_command(run, "/usr/bin/mpirun", OPEN_MPI, rank_variables(run, environ), root=True, cores=2)


def test_several_hosts_meet_at_rank_zero_s_host_passed_as_master_addr(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # rank_variables' state folder
    environ = {"PATH": "/usr/bin", "PYTHONPATH": "/work"}
    line = _mpi_line("host1:1,host2:1", environ)
    assert line[:9] == ["/usr/bin/mpirun", "-np", "2", "-H", "host1:1,host2:1", "--bind-to", "none", "--map-by",
                        "slot"]
    assert line[-2:] == [sys.executable, "train.py"]
    passed = [line[i + 1] for i, arg in enumerate(line) if arg == "-x"]
    assert passed[-1] == "MASTER_ADDR=host1" and "MASTER_PORT" not in " ".join(passed)  # the port: Open MPI's job id
    assert {"PATH", "PYTHONPATH", "OMP_NUM_THREADS"} <= set(passed)
    # the same from a hostfile, and an exported MASTER_ADDR (and port) wins
    assert _mpi_line("host1 slots=1\nhost2 slots=1\n", environ) == line
    line = _mpi_line("host1:2,host2:2", {**environ, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456"})
    assert line[line.index("-np") + 1] == "4"
    assert [line[i + 1] for i, arg in enumerate(line) if arg == "-x"][-2:] == ["MASTER_ADDR=10.0.0.1",
                                                                               "MASTER_PORT=23456"]
    # Open MPI starts rank 0 on its own host when -H lists it, wherever in the list
    here = socket.gethostname()
    assert "MASTER_ADDR=" + here in _mpi_line(f"host2:1,{here}:1", environ)
    assert rank_zero_host([("host2", 1), (here, 1)], HYDRA) == "host2"
    assert rank_zero_host([("host2", 1), ("127.0.0.1", 1)], OPEN_MPI) == "127.0.0.1"
    # on one host the ranks meet on loopback: no MASTER_ADDR
    assert not any(arg.startswith("MASTER_ADDR") for arg in _mpi_line(f"localhost:1,{here}:1", environ))


def test_mpi_launch_refuses_what_mpirun_cannot_do() -> None:
    hosts = [("node-a", 2), ("node-b", 2)]
    check_mpi_run(HorovodRun(command=["true"], hosts=hosts), {})
    check_mpi_run(HorovodRun(command=["true"], np=2), {})
    with pytest.raises(LaunchError, match="neither restarts nor resizes"):
        check_mpi_run(HorovodRun(command=["true"], np=2, min_np=1, max_np=2), {})
    with pytest.raises(LaunchError, match="drop --node-rank"):
        check_mpi_run(HorovodRun(command=["true"], hosts=hosts, node_rank=1), {"MASTER_ADDR": "node-a"})
    # rank 0 on this host called localhost: a name the other hosts cannot reach it by
    with pytest.raises(LaunchError, match=r"rank 0 runs on localhost, which the other hosts of -H \(node-b,"
                                          r"localhost\) cannot reach it by; name this host in -H"):
        master_address(HorovodRun(command=["true"], hosts=[("node-b", 1), ("localhost", 1)]), OPEN_MPI, {})
    assert master_address(HorovodRun(command=["true"], hosts=[("node-b", 1), ("localhost", 1)]), OPEN_MPI,
                          {"MASTER_ADDR": "10.0.0.1"}) == "10.0.0.1"
