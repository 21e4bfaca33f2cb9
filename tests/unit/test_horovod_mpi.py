"""Horovod scripts under mpirun, without processes: ranks from Open MPI's, Hydra's (MPICH, Intel MPI) and
MVAPICH's variables, local and cross ranks from where the launcher put each rank (not from rank order), the port,
the one-line error across hosts without MASTER_ADDR, and the mpirun command line `dtrain horovodrun --mpi` runs."""

from __future__ import annotations

import os
import sys
import zlib

import pytest

from dtrain.errors import LaunchError
from dtrain.horovod.launcher import HorovodRun
from dtrain.horovod.mpi import (
    LAUNCHERS,
    across_hosts_error,
    host_layout,
    launcher_process,
    master_port,
    read_mpi_process,
)
from dtrain.horovod.mpi_launch import HYDRA, OPEN_MPI, check_mpi_run, mpirun_command

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
    line = mpirun_command(run, "/usr/bin/mpirun", OPEN_MPI, ["PYTHONPATH", "PATH"], root=True, cores=2)
    assert line == ["/usr/bin/mpirun", "-np", "3", "--bind-to", "none", "--map-by", "slot", "--allow-run-as-root",
                    "--oversubscribe", "-x", "PYTHONPATH", "-x", "PATH", sys.executable, "train.py", "--epochs", "1"]
    run = HorovodRun(command=["bash", "-c", "true"], hosts=[("a", 2), ("b", 2)])
    assert mpirun_command(run, "mpirun", OPEN_MPI, [], root=False, cores=2) == [
        "mpirun", "-np", "4", "-H", "a:2,b:2", "--bind-to", "none", "--map-by", "slot", "bash", "-c", "true"]
    assert mpirun_command(run, "mpiexec", HYDRA, ["PATH", "MASTER_ADDR"], root=True, cores=2) == [
        "mpiexec", "-np", "4", "-hosts", "a:2,b:2", "-genvlist", "PATH,MASTER_ADDR", "bash", "-c", "true"]


def test_mpi_launch_refuses_what_mpirun_cannot_do() -> None:
    hosts = [("node-a", 2), ("node-b", 2)]
    with pytest.raises(LaunchError, match="no MASTER_ADDR says where rank 0 is; export MASTER_ADDR"):
        check_mpi_run(HorovodRun(command=["true"], hosts=hosts), {})
    check_mpi_run(HorovodRun(command=["true"], hosts=hosts), {"MASTER_ADDR": "node-a"})
    check_mpi_run(HorovodRun(command=["true"], np=2), {})
    with pytest.raises(LaunchError, match="neither restarts nor resizes"):
        check_mpi_run(HorovodRun(command=["true"], np=2, min_np=1, max_np=2), {})
    with pytest.raises(LaunchError, match="drop --node-rank"):
        check_mpi_run(HorovodRun(command=["true"], hosts=hosts, node_rank=1), {"MASTER_ADDR": "node-a"})
