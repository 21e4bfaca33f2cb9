"""Processes on this host (without torch, so that the command line can use it): whether one still runs (a search's
orphaned trials, the shared-memory exchange's dead peers), and how many compute threads each of the processes
dtrain starts here gets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether process `pid` on this host exists and has not exited (a zombie, not yet reaped, has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


CONCURRENT_RUNS_ENV = "DTRAIN_CONCURRENT_RUNS"  # runs started side by side on this host (a search's trials at once)


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def concurrent_runs(environ: Mapping[str, str]) -> int:
    """How many runs, this one included, dtrain runs side by side on this host: the search that started this run
    says so in DTRAIN_CONCURRENT_RUNS; 1 for a run of its own."""
    value = environ.get(CONCURRENT_RUNS_ENV, "")
    return max(int(value), 1) if value.isdigit() else 1


def threads_per_process(processes_per_run: int, environ: Mapping[str, str], cores: int | None = None) -> int:
    """Compute threads (OMP_NUM_THREADS, torch.set_num_threads) for each of the `processes_per_run` processes of
    a run (its workers and any parameter servers beside them): the host's cores shared by every process dtrain
    runs here, all concurrent runs counted, so that the machine is not oversubscribed; at least 1."""
    processes = max(processes_per_run, 1) * concurrent_runs(environ)
    return max((host_cores() if cores is None else cores) // processes, 1)
