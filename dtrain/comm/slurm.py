"""What a Slurm job tells dtrain: whether this process runs in a job step, the job's first host (the master) and
a port that the job's tasks agree on (the run dir keyed by the job id is `runs.rundir.slurm_run_dir`).
`dtrain run` reads it before it starts anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

from dtrain.errors import LaunchError

DEFAULT_PORT_BASE = 20000  # MASTER_PORT when not exported: 20000 + job id mod 20000, the same in every task


def in_job_step(environ: Mapping[str, str]) -> bool:
    """True in a task that srun started (a job step); False in the batch script itself or outside Slurm."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" in environ


def job_id(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_JOB_ID")


def first_host(environ: Mapping[str, str]) -> str:
    """The first host of the step's node list (the job's outside a step), as `scontrol show hostnames` expands
    it: the node that runs task 0, so the master."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("under Slurm, SLURM_JOB_NODELIST is not set, so the master is unknown; export "
                          "MASTER_ADDR=<the first host of the job> before srun")
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise LaunchError(f"`scontrol` is not on PATH, so the node list {nodelist!r} cannot be expanded to find the "
                          "master; add Slurm's bin directory to PATH or export MASTER_ADDR before srun")
    shown = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True)
    hosts = shown.stdout.split()
    if shown.returncode != 0 or not hosts:
        raise LaunchError(f"`scontrol show hostnames {nodelist}` failed ({shown.stderr.strip() or 'no hosts'}); "
                          "export MASTER_ADDR=<the first host of the job> before srun")
    return hosts[0]


def master_port(environ: Mapping[str, str]) -> int:
    """MASTER_PORT when exported, else one derived from the job id: every task of the job computes the same, and
    two jobs sharing a node rarely collide."""
    exported = environ.get("MASTER_PORT")
    if exported:
        try:
            return int(exported)
        except ValueError:
            raise LaunchError(f"MASTER_PORT={exported!r} must be a TCP port number") from None
    return DEFAULT_PORT_BASE + int(environ.get("SLURM_JOB_ID", "0")) % 20000


def hostname() -> str:
    return os.uname().nodename
