"""What a Slurm job tells dtrain: whether this process runs in a job step, the job's first host (the master) and
a port that the job's tasks agree on (the run dir keyed by the job id is `runs.rundir.slurm_run_dir`).
`dtrain run` reads it before it starts anything."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from dtrain.errors import LaunchError

DEFAULT_PORT_BASE = 20000  # MASTER_PORT when not exported: 20000 + job id mod 20000, the same in every task
# The signal that asks for a checkpoint and a requeue (`scancel --signal=USR1`, `sbatch --signal=[B:]USR1@N`), as
# submitit and Lightning read it; SIGTERM requeues only when Slurm preempted the job (a plain scancel ends it).
REQUEUE_SIGNAL = "SIGUSR1"


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


def _scontrol(*argv: str) -> subprocess.CompletedProcess[str] | None:
    scontrol = shutil.which("scontrol")
    return subprocess.run([scontrol, *argv], capture_output=True, text=True) if scontrol else None


def requeue(environ: Mapping[str, str]) -> str | None:
    """`scontrol requeue` this job (a preempted job that exits by itself inside its grace time is not requeued by
    Slurm); None when done, else what went wrong."""
    shown = _scontrol("requeue", environ["SLURM_JOB_ID"])
    if shown is None:
        return "`scontrol` is not on PATH"
    return None if shown.returncode == 0 else (shown.stderr.strip() or f"exit code {shown.returncode}")


def preempt_time(environ: Mapping[str, str]) -> float | None:
    """When Slurm selected this job for preemption and signalled it (`scontrol show job`'s PreemptTime, whole
    seconds, local time), as epoch seconds; None when it was not, or scontrol cannot say."""
    job = environ.get("SLURM_JOB_ID")
    shown = _scontrol("show", "job", "-o", job) if job else None
    if shown is None or shown.returncode != 0:
        return None
    fields = dict(part.split("=", 1) for part in shown.stdout.split() if "=" in part)
    try:
        return time.mktime(time.strptime(fields.get("PreemptTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def preempted(environ: Mapping[str, str]) -> bool:
    """Whether Slurm selected this job for preemption (`scontrol show job` gives it a PreemptTime): the SIGTERM
    that stopped the workers was the preemption's, not a user's scancel."""
    return preempt_time(environ) is not None


def requeue_after_stop(run_dir: Path, environ: Mapping[str, str], signal_name: str | None,
                       received_at: float | None) -> str | None:
    """After this job's workers stopped on a signal with a checkpoint in `run_dir`: when Slurm preempted the job
    (it has a PreemptTime) or the signal was SIGUSR1, record what the stop cost (`runs/preemptions.py`: seconds
    from Slurm's PreemptTime, else from `received_at`, when rank 0 got the signal, to the checkpoint on disk) and
    requeue the job (`scontrol requeue`: a job that ends by itself is not requeued by Slurm). Returns the line to
    print; None outside a job step, or after a plain scancel or Ctrl-C (the job just ends)."""
    from dtrain.runs.preemptions import record_preemption

    if not in_job_step(environ):
        return None
    preempted_at = preempt_time(environ)
    if preempted_at is None and signal_name != REQUEUE_SIGNAL:
        return None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue's own SIGTERM: this process ends by itself now
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # and a repeated request is already answered
    job = environ["SLURM_JOB_ID"]
    record_preemption(run_dir, job, preempted_at if preempted_at is not None else received_at, signal_name)
    why = "preempted by Slurm" if preempted_at is not None else f"{signal_name} (checkpoint and requeue)"
    failed = requeue(environ)
    if failed:
        return (f"dtrain: error: {why}, but `scontrol requeue {job}` failed: {failed}; resubmit the job with the "
                f"same run dir {run_dir} to resume")
    return f"dtrain: {why}: job {job} requeued (scontrol requeue); it resumes from {run_dir} when it starts again"
