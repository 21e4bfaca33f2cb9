"""Horovod scripts started by `mpirun` (Open MPI, MPICH, Intel MPI, MVAPICH): rank, size and local rank from the
MPI launcher's variables, and where the ranks meet, which no MPI launcher says.

On one host (every rank local) rank 0 hosts a TCPStore on 127.0.0.1 on a port the kernel picks and publishes the port
in a file that only this job's ranks look for: a folder under the temp dir named after the launcher's process on
this host (its pid and start time, the one process every local rank descends from), so two jobs never share it and
no port is guessed or released before it is held. Across hosts the ranks need `MASTER_ADDR` (and `MASTER_PORT`)
passed by the launcher (`mpirun -x MASTER_ADDR=...`); without it `hvd.init()` stops with one line naming the fix.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed import TCPStore

from dtrain.errors import ExitCode


@dataclass(frozen=True)
class MpiLauncher:
    """The variables one MPI launcher gives each rank."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str


LAUNCHERS = (
    MpiLauncher("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    MpiLauncher("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_SIZE"),
    MpiLauncher("MPICH or Intel MPI (Hydra)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
DEFAULT_MASTER_PORT = 29500
STORE_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class MpiProcess:
    """This process as the MPI launcher placed it. The local rank is the launcher's own (never rank % local size:
    with some mappings rank 1 is local rank 2); None where the launcher does not say."""

    launcher: MpiLauncher
    rank: int
    size: int
    local_rank: int | None
    local_size: int | None

    @property
    def single_host(self) -> bool:
        return self.local_size == self.size


def read_mpi_process(environ: Mapping[str, str]) -> MpiProcess | None:
    """The MPI rank of this process from its launcher's variables, or None when no MPI launcher started it."""
    for launcher in LAUNCHERS:
        if environ.get(launcher.rank, "") != "" and environ.get(launcher.size, "") != "":

            def number(name: str) -> int | None:
                value = environ.get(name, "")
                return int(value) if value.strip().isdigit() else None

            rank, size = number(launcher.rank), number(launcher.size)
            if rank is None or size is None or not 0 <= rank < size:
                raise ValueError(f"{launcher.rank}={environ[launcher.rank]} and {launcher.size}="
                                 f"{environ[launcher.size]} are not a rank and a world size")
            return MpiProcess(launcher, rank, size, number(launcher.local_rank), number(launcher.local_size))
    return None


def across_hosts_error(process: MpiProcess) -> str:
    """The one line for ranks on several hosts (or an unknown spread) and no MASTER_ADDR."""
    launcher = process.launcher
    spread = (f"{launcher.local_size}={process.local_size} of {launcher.size}={process.size}"
              if process.local_size is not None else f"{launcher.size}={process.size} and no {launcher.local_size}")
    return (f"dtrain.horovod: error: {launcher.name} started ranks on several hosts ({spread}) and no MASTER_ADDR "
            f"says where rank 0 is; pass rank 0's host to every rank: mpirun -x MASTER_ADDR=<rank 0's host> "
            f"-x MASTER_PORT=29500 ... (MPICH: -genv MASTER_ADDR <host>), or start with dtrain horovodrun --mpi -H ...")


def master_port(environ: Mapping[str, str]) -> int:
    """MASTER_PORT, else one derived from Open MPI's job id (the same on every host, rarely another job's), else
    torch's default 29500."""
    if environ.get("MASTER_PORT"):
        return int(environ["MASTER_PORT"])
    job = environ.get("PMIX_NAMESPACE") or environ.get("OMPI_MCA_ess_base_jobid")
    return 20000 + zlib.crc32(job.encode()) % 20000 if job else DEFAULT_MASTER_PORT


def _environ_of(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def launcher_process(rank_variable: str, start: int | None = None) -> tuple[int, str]:
    """(pid, start time) of the launcher's process on this host: the nearest ancestor whose environment has no
    `rank_variable` (mpirun or orted for Open MPI, hydra_pmi_proxy for Hydra). Wrappers between it and the rank
    (`bash -c ...`) carry the variable and are passed over."""
    pid = os.getppid() if start is None else start
    marker = f"{rank_variable}=".encode()
    for _ in range(64):
        environ = _environ_of(pid)
        fields = _stat_fields(pid)
        if environ is None or not any(entry.startswith(marker) for entry in environ.split(b"\0")) or int(
                fields[1]) <= 1:
            return pid, fields[19]  # field 22 of /proc/PID/stat: start time in clock ticks after boot
        pid = int(fields[1])
    return pid, _stat_fields(pid)[19]


def rendezvous_folder(process: MpiProcess) -> Path:
    """Where this job's rank 0 publishes its store's port on this host."""
    pid, started = launcher_process(process.launcher.rank)
    return Path(tempfile.gettempdir()) / f"dtrain-mpi-{os.getuid()}" / f"{pid}-{started}"


def _single_host_store(process: MpiProcess, timeout: timedelta) -> tuple[TCPStore, Path]:
    folder = rendezvous_folder(process)
    port_file = folder / "port"
    if process.rank == 0:
        store = TCPStore("127.0.0.1", 0, process.size, is_master=True, timeout=timeout, wait_for_workers=False)
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"port.{os.getpid()}"
        partial.write_text(str(store.port))
        os.replace(partial, port_file)
        return store, folder
    deadline = time.monotonic() + timeout.total_seconds()
    while not port_file.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"dtrain.horovod: rank 0 of this {process.launcher.name} job did not publish its "
                               f"store in {port_file} within {timeout.total_seconds():.0f} s")
        time.sleep(0.02)
    store = TCPStore("127.0.0.1", int(port_file.read_text()), process.size, is_master=False, timeout=timeout)
    return store, folder


def init_process_group(process: MpiProcess, backend: str, timeout: timedelta) -> None:
    """Join the MPI job's ranks in a torch process group: at MASTER_ADDR when given, on loopback when every rank
    is on this host; otherwise stop with one line (exit code 2) naming the fix."""
    if os.environ.get("MASTER_ADDR"):
        os.environ["MASTER_PORT"] = str(master_port(os.environ))
        dist.init_process_group(backend, rank=process.rank, world_size=process.size, timeout=timeout)
        return
    if not process.single_host:
        if process.rank == 0:
            print(across_hosts_error(process), file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.USER_ERROR)
    store, folder = _single_host_store(process, timeout)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(store.port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, store=store, rank=process.rank, world_size=process.size, timeout=timeout)
    if process.rank == 0:  # every rank has connected to the store by now: the port file has done its job
        shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class HostLayout:
    """Horovod's local and cross ranks: the local rank among the ranks on this host, the cross rank among the
    ranks with the same local rank (in rank order), as Horovod's communicators split them."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def host_layout(process: MpiProcess, placements: list[tuple[str, int | None]]) -> HostLayout:
    """This rank's layout from every rank's (hostname, launcher's local rank or None), indexed by rank. Where the
    launcher gives no local rank, it is the position among the ranks on the same host."""
    host = placements[process.rank][0]
    same_host = [rank for rank, (name, _) in enumerate(placements) if name == host]
    local_ranks = [given if given is not None else [r for r, (name, _) in enumerate(placements)
                                                   if name == placements[rank][0]].index(rank)
                   for rank, (_, given) in enumerate(placements)]
    local_rank = local_ranks[process.rank]
    peers = [rank for rank, value in enumerate(local_ranks) if value == local_rank]
    return HostLayout(local_rank=local_rank, local_size=len(same_host), cross_rank=peers.index(process.rank),
                      cross_size=len(peers))


def exchange_layout(process: MpiProcess) -> HostLayout:
    """All-gather every rank's host and local rank once (after the process group is up) and work out the layout."""
    placements: list[tuple[str, int | None] | None] = [None] * process.size
    dist.all_gather_object(placements, (socket.gethostname(), process.local_rank))
    return host_layout(process, [p for p in placements if p is not None])


def state_dir(process: MpiProcess) -> str:
    """A folder for hvd.elastic's committed state that belongs to this job only (mpirun has no restarts, so a new
    job must not resume from an older job's commit)."""
    pid, started = launcher_process(process.launcher.rank)
    return str(Path(tempfile.gettempdir()) / f"dtrain-horovod-mpi-{pid}-{started}")
