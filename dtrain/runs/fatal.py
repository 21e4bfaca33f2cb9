"""The fatal-error file: how a worker tells the launcher that a run failed through the user's fault.

A worker that meets a user error (bad data, a broken Trial, an exception in the Trial's code that came back
after a restart: `runs/repeats.py`) writes `fatal-error.json` into the run dir and exits with
`ExitCode.USER_ERROR` (`INVALID_HP` when the Trial rejected its hyperparameters). The launcher's agent then
ends the run without a restart and prints that one line instead of a crash report; a worker restarted by
another launcher (plain torchrun) that finds it fails at once instead of repeating the error. The record
names the launch (torchrun's run id, Slurm's job id) so that an old record never stops a new launch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FATAL_FILE = "fatal-error.json"


def launch_id() -> str:
    """The id of this launch as the workers see it: torchrun's run id, else Slurm's job id, else `local`."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "local"


def read_fatal(run_dir: Path, launch: str | None = None) -> dict[str, object] | None:
    """The user error that a worker of this launch (or of `launch`) recorded, if any."""
    path = run_dir / FATAL_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("launch") == (launch or launch_id()) else None


def write_fatal(run_dir: Path, message: str, rank: int, exit_code: int = 2, traceback: str | None = None) -> None:
    """Record a user error of this launch (and the exit code it ends the run with: 2, or 4 for a Trial's
    InvalidHP; for an exception in user code, the user's frames of its traceback); the first rank to record one
    keeps it."""
    path = run_dir / FATAL_FILE
    tmp = path.with_name(f".{FATAL_FILE}.{os.getpid()}")
    record = {"launch": launch_id(), "rank": rank, "message": message, "exit_code": int(exit_code)}
    tmp.write_text(json.dumps({**record, "traceback": traceback} if traceback else record))
    if not path.exists() or read_fatal(run_dir) is None:
        tmp.replace(path)
    else:
        tmp.unlink(missing_ok=True)
