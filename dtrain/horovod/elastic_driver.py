"""`dtrain horovodrun --min-np/--max-np`: Horovod Elastic's driver, on this host.

The driver starts the worker processes itself (not through torchrun's agent, which restarts every worker at the
same size) and hosts a TCPStore on which it announces each membership of the job as a generation
(`membership.py`). When a worker dies the survivors' collectives fail; the driver announces a generation without
it and the survivors re-form at the smaller size. Every second it runs the host discovery script, if one is given:
when the script reports more slots than the job uses (up to --max-np) it starts workers for them and announces a
larger generation, which the running workers join at their next `state.commit()`; fewer slots remove the
highest ranks at that point. A slot whose worker failed is not given a new worker (Horovod blacklists a failed
host; on one host, one slot per failure): the script must report more slots for the job to grow back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from dtrain.errors import LaunchError
from dtrain.horovod.launcher import HorovodRun
from dtrain.horovod.membership import GENERATION_KEY, STORE_VAR, WORKER_VAR

DISCOVERY_PERIOD_S = 1.0
POLL_S = 0.1


@dataclass
class ElasticLimits:
    """What the job may be: its starting size, the fewest and most workers, the resets allowed (None: any)."""

    initial: int
    min_np: int
    max_np: int
    reset_limit: int | None


@dataclass
class Job:
    """The driver's view: the workers running, the current membership (worker ids by rank), what changed."""

    command: list[str]
    store: Any  # the driver's TCPStore
    port: int
    members: list[str] = field(default_factory=list)
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    leaving: set[str] = field(default_factory=set)
    generation: int = -1
    lost: int = 0
    resets: int = 0
    next_id: int = 0
    finished: set[str] = field(default_factory=set)
    failed_at_end: bool = False


def check_limits(np: int | None, min_np: int | None, max_np: int | None, slots: int,
                 reset_limit: int | None) -> ElasticLimits:
    """The elastic sizes from horovodrun's flags and the slots available now, or one line saying what is wrong."""
    if min_np is not None and min_np < 1:
        raise LaunchError(f"--min-np {min_np}: at least 1 process")
    if min_np is not None and max_np is not None and min_np > max_np:
        raise LaunchError(f"--min-np {min_np} is above --max-np {max_np}: give --min-np <= --max-np")
    low = min_np if min_np is not None else (np or 1)
    high = max_np if max_np is not None else max(slots, low)
    if np is not None and not low <= np <= high:
        raise LaunchError(f"-np {np} is outside --min-np {low} .. --max-np {high}: start within them")
    if reset_limit is not None and reset_limit < 0:
        raise LaunchError(f"--reset-limit {reset_limit}: 0 or more")
    initial = min(np or high, high, slots)
    if initial < low:
        raise LaunchError(f"only {slots} slot(s) available, fewer than --min-np {low}: add hosts or slots, or "
                          "lower --min-np")
    return ElasticLimits(initial, low, high, reset_limit)


def _worker_environment(job: Job, worker_id: str, rank: int, size: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size),
                "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job.port),
                STORE_VAR: f"127.0.0.1:{job.port}", WORKER_VAR: worker_id})
    return env


def _announce(job: Job, members: list[str]) -> None:
    """Publish a new generation: its rank table first, then its number (workers read the number, then the table)."""
    job.generation += 1
    store = job.store
    store.set(f"gen/{job.generation}/ranks", json.dumps({w: r for r, w in enumerate(members)}))
    store.set(GENERATION_KEY, str(job.generation))
    job.members = members


def _die_with_the_driver() -> None:
    """In a worker, before exec: be killed if the driver dies (Linux's PR_SET_PDEATHSIG), so that a driver killed
    from outside leaves no workers behind."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the workers fail on the driver's closed store instead
        pass


def _change_to(job: Job, members: list[str], fresh: list[str]) -> None:
    _announce(job, members)
    for worker_id in fresh:
        rank = members.index(worker_id)
        job.workers[worker_id] = subprocess.Popen(
            [sys.executable, "-u", "-m", "dtrain.horovod.exec", "--", *job.command],
            env=_worker_environment(job, worker_id, rank, len(members)), preexec_fn=_die_with_the_driver)


def _fresh_ids(job: Job, count: int) -> list[str]:
    ids = [f"w{job.next_id + i}" for i in range(count)]
    job.next_id += count
    return ids


def _stop_all(job: Job) -> None:
    for process in job.workers.values():
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + 10
    for process in job.workers.values():
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _joined(job: Job, worker_id: str) -> bool:
    return bool(job.store.check([f"joined/{worker_id}"]))


def _reap(job: Job) -> bool:
    """Collect exited workers; True when a member failed (exited other than 0, or was killed)."""
    failed = False
    for worker_id, process in list(job.workers.items()):
        code = process.poll()
        if code is None:
            continue
        del job.workers[worker_id]
        if worker_id in job.leaving:
            job.leaving.discard(worker_id)
        elif code == 0:
            job.finished.add(worker_id)
        else:
            job.lost += 1
            failed = True
            if job.finished:
                job.failed_at_end = True
            rank = job.members.index(worker_id) if worker_id in job.members else "?"
            print(f"dtrain horovodrun: rank {rank} (pid {process.pid}) exited with code {code}", file=sys.stderr,
                  flush=True)
    return failed


def drive(command: list[str], limits: ElasticLimits, slots_now: Callable[[], int | None]) -> int:
    """Run the elastic job to its end; its exit code. `slots_now()` gives the slots available (None: unchanged,
    or no discovery script)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    job = Job(command=command, store=store, port=store.port)
    first = _fresh_ids(job, limits.initial)
    _change_to(job, first, first)
    slots: int | None = None
    next_discovery = time.monotonic() + DISCOVERY_PERIOD_S
    try:
        while True:
            time.sleep(POLL_S)
            _reap(job)
            if job.finished:  # the job is ending: wait for the members; workers that never joined are stopped
                waiting = [w for w in job.workers if _joined(job, w)]
                if not waiting:
                    _stop_all(job)
                    return 1 if job.failed_at_end else 0
                continue
            if time.monotonic() >= next_discovery:
                found = slots_now()
                slots = found if found is not None else slots
                next_discovery = time.monotonic() + DISCOVERY_PERIOD_S
            alive = [w for w in job.members if w in job.workers and w not in job.leaving]
            if len(alive) < limits.min_np:
                print(f"dtrain horovodrun: {len(alive)} worker(s) left, fewer than --min-np {limits.min_np}; "
                      "stopping the job", file=sys.stderr, flush=True)
                _stop_all(job)
                return 1
            wanted = len(alive)
            if slots is not None:
                wanted = max(min(limits.max_np, slots - job.lost), limits.min_np)
            fresh = _fresh_ids(job, wanted - len(alive)) if wanted > len(alive) else []
            members = alive[:wanted] + fresh
            if members == job.members:
                continue
            if limits.reset_limit is not None and job.resets >= limits.reset_limit:
                print(f"dtrain horovodrun: the job changed size {job.resets} time(s), the --reset-limit; stopping",
                      file=sys.stderr, flush=True)
                _stop_all(job)
                return 1
            job.resets += 1
            job.leaving.update(alive[wanted:])
            if any(w not in job.workers for w in job.members):
                change = f"goes on at {len(members)} process(es) from its last commit"
            else:
                change = f"{'grows' if len(members) > len(job.members) else 'shrinks'} to {len(members)} " \
                         "process(es) at its next commit"
            print(f"dtrain horovodrun: the job {change}", file=sys.stderr, flush=True)
            _change_to(job, members, fresh)
    except KeyboardInterrupt:
        _stop_all(job)
        return 130


def local_slots(hosts: list[tuple[str, int]], source: str) -> int:
    """The slots of hosts that are this machine; the elastic driver starts processes here only."""
    from dtrain.horovod.launcher import is_local

    remote = [name for name, _ in hosts if not is_local(name)]
    if remote:
        raise LaunchError(f"{source} names {remote[0]!r}, not this machine: elastic horovodrun starts processes on "
                          "this host only (list localhost:N)")
    return sum(slots for _, slots in hosts)


def launch_elastic(run: HorovodRun, discovery_script: str | None) -> int:
    """`dtrain horovodrun --min-np/--max-np`: check the sizes, set the workers' variables, drive the job."""
    import tempfile
    from pathlib import Path

    from dtrain.horovod.launcher import discover_hosts, environment
    from dtrain.runs.processes import threads_per_process

    if discovery_script:
        slots = local_slots(discover_hosts(discovery_script), f"--host-discovery-script {discovery_script}")
    else:
        slots = local_slots(run.hosts, "-H") if run.hosts else (run.np or run.max_np or run.min_np or 1)
    limits = check_limits(run.np, run.min_np, run.max_np, slots, run.reset_limit)
    os.environ.update(environment(run, Path(tempfile.mkdtemp(prefix="dtrain-horovodrun-"))))
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_process(limits.max_np, os.environ))

    def slots_now() -> int | None:
        if not discovery_script:
            return None
        try:
            return local_slots(discover_hosts(discovery_script), f"--host-discovery-script {discovery_script}")
        except LaunchError as error:  # a script that fails now and then: keep the slots it last reported
            print(f"dtrain horovodrun: {error}; keeping the last hosts", file=sys.stderr, flush=True)
            return None

    return drive(run.command, limits, slots_now)
