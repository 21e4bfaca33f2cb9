"""A real slow worker: one rank's process in a cgroup (v1 `cpu` controller) whose CFS quota caps its CPU share.

Unlike `faults.slow_rank` (a sleep), a quota takes CPU away for real: the process computes, communicates and
loads data more slowly, and the CPU it cannot use goes to the others, as on a cluster with an older machine.
Needs root and the cgroup v1 `cpu` controller (mounted at /sys/fs/cgroup/cpu); `unavailable_reason()` says why
not, so a benchmark can fall back to the sleep and say so.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CPU_CONTROLLER = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def unavailable_reason() -> str | None:
    """Why a CPU quota cannot be set here, or None when it can."""
    if os.geteuid() != 0:
        return "a CPU quota needs root (cgroup v1 cpu controller)"
    if not (CPU_CONTROLLER / "cpu.cfs_quota_us").is_file():
        return f"no cgroup v1 cpu controller at {CPU_CONTROLLER}"
    return None


def worker_rank(pid: int) -> int | None:
    """The RANK of a `dtrain.worker` process (from its environment), or None for any other process."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"dtrain.worker" not in command:
            return None
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


@contextmanager
def slowed_rank(rank: int, cores: float, name: str = "dtrain-bench-slow") -> Iterator[list[int]]:
    """While inside, every `dtrain.worker` process of `rank` that starts is moved into a cgroup limited to
    `cores` of CPU (0.5 = half a core). Yields the list of the pids moved so far."""
    group = CPU_CONTROLLER / name
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(cores * PERIOD_US))))
    moved: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) not in moved and worker_rank(int(entry.name)) == rank:
                    try:
                        (group / "cgroup.procs").write_text(entry.name)
                        moved.append(int(entry.name))
                    except OSError:
                        continue  # it ended in between

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield moved
    finally:
        stop.set()
        thread.join()
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CPU_CONTROLLER / "cgroup.procs").write_text(pid)  # back to the root group before removing ours
            except OSError:
                pass
        try:
            group.rmdir()
        except OSError:
            pass


def share_for_slowdown(factor: float, workers: int, cores: int) -> float:
    """The CPU share (in cores) that makes one of `workers` single-threaded processes on `cores` cores about
    `factor` times slower than the others, which share what it leaves: (cores - q) / (workers - 1) = factor * q,
    capped so that no process gets more than one core."""
    others = workers - 1
    fair = min(1.0, cores / workers)
    quota = cores / (factor * others + 1)
    if (cores - quota) / others > 1.0:  # the others are capped at one core each: slow relative to a full core
        quota = 1.0 / factor
    return min(quota, fair)
