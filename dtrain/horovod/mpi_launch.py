"""`dtrain horovodrun --mpi`: start the command under the `mpirun` on PATH (Open MPI, or MPICH/Intel MPI's Hydra)
instead of torchrun's agent, with the command line Horovod's docs give (`--bind-to none --map-by slot`, `-x` for
the variables), show it, run it. Each rank then finds its rank and its peers from the MPI launcher's variables
(`horovod/mpi.py`). Across hosts (-H, --hostfile) the ranks meet at rank 0's host, passed as MASTER_ADDR unless
one is exported."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from dtrain.errors import LaunchError
from dtrain.horovod.exec import PYTHONS, SHIM
from dtrain.horovod.launcher import LOCAL_NAMES, HorovodRun, environment, is_local
from dtrain.runs.processes import host_cores, threads_per_process

OPEN_MPI, HYDRA = "Open MPI", "Hydra"
SHOWN = ("MASTER_ADDR", "MASTER_PORT")  # given with their values on the mpirun line
NOT_INSTALLED = ("--mpi needs an mpirun on PATH and none is there: install Open MPI (Debian: apt-get install "
                 "openmpi-bin; `make setup` does it as root) or MPICH, or drop --mpi (torchrun's agent starts the "
                 "processes)")


def find_mpirun() -> tuple[str, str]:
    """(path, flavor) of the mpirun on PATH; flavor is Open MPI or Hydra (MPICH, Intel MPI), from its --version."""
    path = shutil.which("mpirun") or shutil.which("mpiexec")
    if path is None:
        raise LaunchError(NOT_INSTALLED)
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        raise LaunchError(f"--mpi: {path} --version failed: {error}") from None
    text = version.stdout + version.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return path, OPEN_MPI
    if "HYDRA" in text.upper() or "Intel(R) MPI" in text:
        return path, HYDRA
    raise LaunchError(f"--mpi: {path} is neither Open MPI's nor Hydra's (MPICH, Intel MPI) mpirun: "
                      f"{text.strip().splitlines()[:1]}")


def check_mpi_run(run: HorovodRun, environ: dict[str, str]) -> None:
    """Refuse what mpirun cannot do for dtrain, before anything starts: restarts, --node-rank."""
    if run.elastic or run.reset_limit is not None:
        raise LaunchError("--mpi: mpirun neither restarts nor resizes a job; drop --min-np/--max-np/--reset-limit, "
                          "or drop --mpi (dtrain's own launcher does both)")
    if run.node_rank is not None:
        raise LaunchError("--mpi: mpirun starts the processes on every host of -H itself; drop --node-rank")


def names_this_host(host: str) -> bool:
    """Whether `host` (a name or an address of -H) is this machine: a loopback or this host's own name, or a name
    whose address this machine can bind (one of its interfaces' addresses), as mpirun judges it."""
    if is_local(host):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    with socket.socket() as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def rank_zero_host(hosts: list[tuple[str, int]], flavor: str) -> str:
    """The host of -H on which mpirun starts rank 0 under `--map-by slot`: Open MPI fills its own host first when
    it is listed (Open MPI 4.1 started on host a with `-H b:2,a:2` gives ranks 0 and 1 to a), otherwise the first
    host; for Hydra (MPICH, Intel MPI) the first host (it places ranks in the list's order; not run across hosts
    here)."""
    if flavor == OPEN_MPI:
        here = [name for name, _ in hosts if names_this_host(name)]
        if here:
            return here[0]
    return hosts[0][0]


def master_address(run: HorovodRun, flavor: str, environ: dict[str, str]) -> str | None:
    """Where the ranks meet: the exported MASTER_ADDR, else, when -H names other machines, rank 0's host as -H
    names it (the other hosts reach it by that name, as mpirun's remote shell did); None on one host, where the
    ranks meet on loopback by themselves."""
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if all(names_this_host(name) for name, _ in run.hosts):
        return None
    host = rank_zero_host(run.hosts, flavor)
    if host in LOCAL_NAMES:
        raise LaunchError(f"--mpi: rank 0 runs on {host}, which the other hosts of -H "
                          f"({','.join(name for name, _ in run.hosts)}) cannot reach it by; name this host in -H as "
                          f"they reach it (its hostname or address), or export MASTER_ADDR=<this host's address>")
    return host


def mpirun_command(run: HorovodRun, mpirun: str, flavor: str, variables: Mapping[str, str], *, root: bool,
                   cores: int) -> list[str]:
    """The mpirun command line: processes, hosts, Horovod's placement flags, and the variables to pass to every
    rank: by name (their values are mpirun's own environment's, as in `-x PATH`), except the meeting point
    (MASTER_ADDR, MASTER_PORT), given with its value so that the line shown can be run by hand."""
    names = [name for name in variables if name not in SHOWN]
    shown = [(name, variables[name]) for name in SHOWN if name in variables]
    np = run.np or (sum(slots for _, slots in run.hosts) if run.hosts else 1)
    command = list(run.command)
    if command[0] in PYTHONS:  # the interpreter dtrain runs in, as under torchrun
        command[0] = sys.executable
    hosts = ",".join(f"{name}:{slots}" for name, slots in run.hosts)
    if flavor == OPEN_MPI:
        line = [mpirun, "-np", str(np)]
        if hosts:
            line += ["-H", hosts]
        line += ["--bind-to", "none", "--map-by", "slot"]
        if root:
            line.append("--allow-run-as-root")
        if not run.hosts and np > cores:
            line.append("--oversubscribe")
        for name in names:
            line += ["-x", name]
        for name, value in shown:
            line += ["-x", f"{name}={value}"]
        return [*line, *command]
    line = [mpirun, "-np", str(np)]
    if hosts:
        line += ["-hosts", hosts]
    if names:
        line += ["-genvlist", ",".join(names)]
    for name, value in shown:
        line += ["-genv", name, value]
    return [*line, *command]


def rank_variables(run: HorovodRun, environ: dict[str, str]) -> dict[str, str]:
    """What every rank gets besides mpirun's own variables: dtrain horovodrun's (knobs, malloc, threads), the
    `horovod` shim first on PYTHONPATH, PATH, and MASTER_ADDR/MASTER_PORT when set."""
    state_dir = Path(tempfile.mkdtemp(prefix="dtrain-horovodrun-mpi-"))
    variables = environment(run, state_dir)
    np = run.np or (sum(slots for _, slots in run.hosts) if run.hosts else 1)
    per_host = max(slots for _, slots in run.hosts) if run.hosts else np
    variables["OMP_NUM_THREADS"] = environ.get("OMP_NUM_THREADS") or str(threads_per_process(per_host, environ))
    paths = [str(SHIM)] if variables["DTRAIN_HOROVOD_SHIM"] == "1" else []
    variables["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [environ.get("PYTHONPATH")])])
    for name in ("PATH", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        if environ.get(name):
            variables[name] = environ[name]
    if run.network_interface:
        variables["GLOO_SOCKET_IFNAME"] = run.network_interface
    return {name: value for name, value in variables.items() if value != ""}


def launch_mpi(run: HorovodRun) -> int:
    """Show the mpirun command line, run it, return its exit code."""
    environ = dict(os.environ)
    check_mpi_run(run, environ)
    mpirun, flavor = find_mpirun()
    master = master_address(run, flavor, environ)
    if master is not None:
        environ["MASTER_ADDR"] = master
    variables = rank_variables(run, environ)
    line = mpirun_command(run, mpirun, flavor, variables, root=os.geteuid() == 0, cores=host_cores())
    print(f"dtrain horovodrun: {shlex.join(line)}", file=sys.stderr, flush=True)
    try:
        return subprocess.run(line, env={**environ, **variables}).returncode
    except KeyboardInterrupt:
        return 130
