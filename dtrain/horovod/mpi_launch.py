"""`dtrain horovodrun --mpi`: start the command under the `mpirun` on PATH (Open MPI, or MPICH/Intel MPI's Hydra)
instead of torchrun's agent, with the command line Horovod's docs give (`--bind-to none --map-by slot`, `-x` for
the variables), show it, run it. Each rank then finds its rank and its peers from the MPI launcher's variables
(`horovod/mpi.py`)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dtrain.errors import LaunchError
from dtrain.horovod.exec import PYTHONS, SHIM
from dtrain.horovod.launcher import HorovodRun, environment, is_local
from dtrain.runs.processes import host_cores, threads_per_process

OPEN_MPI, HYDRA = "Open MPI", "Hydra"
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
    """Refuse what mpirun cannot do for dtrain, before anything starts: restarts, --node-rank, and ranks on
    several hosts without a MASTER_ADDR to meet at."""
    if run.elastic or run.reset_limit is not None:
        raise LaunchError("--mpi: mpirun neither restarts nor resizes a job; drop --min-np/--max-np/--reset-limit, "
                          "or drop --mpi (dtrain's own launcher does both)")
    if run.node_rank is not None:
        raise LaunchError("--mpi: mpirun starts the processes on every host of -H itself; drop --node-rank")
    if any(not is_local(name) for name, _ in run.hosts) and not environ.get("MASTER_ADDR"):
        raise LaunchError(f"--mpi: the hosts {','.join(name for name, _ in run.hosts)} are several machines and no "
                          f"MASTER_ADDR says where rank 0 is; export MASTER_ADDR=<the first host's address> (and "
                          f"MASTER_PORT) before dtrain horovodrun --mpi, which passes both to every rank")


def mpirun_command(run: HorovodRun, mpirun: str, flavor: str, names: list[str], *, root: bool,
                   cores: int) -> list[str]:
    """The mpirun command line: processes, hosts, Horovod's placement flags, and the variables to pass to every
    rank by name (their values are mpirun's own environment's, as in `-x PATH`)."""
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
        return [*line, *command]
    line = [mpirun, "-np", str(np)]
    if hosts:
        line += ["-hosts", hosts]
    if names:
        line += ["-genvlist", ",".join(names)]
    return [*line, *command]


def rank_variables(run: HorovodRun, environ: dict[str, str]) -> dict[str, str]:
    """What every rank gets besides mpirun's own variables: dtrain horovodrun's (knobs, malloc, threads), the
    `horovod` shim first on PYTHONPATH, PATH, and MASTER_ADDR/MASTER_PORT when exported."""
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
    variables = rank_variables(run, environ)
    line = mpirun_command(run, mpirun, flavor, list(variables), root=os.geteuid() == 0, cores=host_cores())
    print(f"dtrain horovodrun: {shlex.join(line)}", file=sys.stderr, flush=True)
    try:
        return subprocess.run(line, env={**environ, **variables}).returncode
    except KeyboardInterrupt:
        return 130
