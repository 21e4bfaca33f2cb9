"""Horovod's process model on torch.distributed: init/shutdown, rank and size (world, host, cross-host),
what is "built", the reduce ops, process sets and the timeline switch.

Rank and size come from the variables `dtrain horovodrun` (or torchrun, or Horovod's own gloo launcher) sets:
`HOROVOD_RANK`/`RANK`, `HOROVOD_SIZE`/`WORLD_SIZE`, and their local and cross-host counterparts; under `mpirun`
from the MPI launcher's (`horovod/mpi.py`). Without any of them (a plain `python train.py`) `init()` makes a world
of one, as Horovod does.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import HashStore

from dtrain.errors import ExitCode
from dtrain.horovod import backends, membership, mpi

Average, Sum, Adasum, Min, Max, Product = 1, 0, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
TORCH_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX,
             Product: dist.ReduceOp.PRODUCT}
NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
IGNORED_KNOBS = {
    "HOROVOD_AUTOTUNE": "fusion is per dtype up to HOROVOD_FUSION_THRESHOLD; nothing is tuned at run time",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "the all-reduce is flat, on gloo and on NCCL alike",
}


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer died or disagreed); `hvd.elastic.run` restores the last commit on it."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """The set of hosts changed; raised on every rank together by `State.commit()`."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class ProcessSet:
    """A subset of the global ranks that collectives can run on (`process_set=`); the global set has id 0."""

    def __init__(self, ranks: list[int] | None = None) -> None:
        self.ranks: list[int] | None = sorted(set(ranks)) if ranks is not None else None
        if ranks is not None and len(self.ranks or []) != len(ranks):
            raise ValueError(f"a process set lists each rank once, got {ranks}")
        self.process_set_id: int | None = None
        self.group: Any = None  # the torch ProcessGroup; None = the world

    def _require(self) -> None:
        if self.process_set_id is None:
            raise ValueError("this process set is not registered: pass it to hvd.init(process_sets=[...]) or "
                             "hvd.add_process_set(...)")

    def size(self) -> int:
        self._require()
        return len(self.ranks) if self.ranks is not None else size()

    def rank(self) -> int:
        self._require()
        if not self.included():
            raise ValueError(f"rank {rank()} is not in process set {self.process_set_id} (ranks {self.ranks})")
        return self.ranks.index(rank()) if self.ranks is not None else rank()

    def included(self) -> bool:
        self._require()
        return self.ranks is None or rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


@dataclass
class _State:
    initialized: bool = False
    owns_group: bool = False
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    sets: dict[int, ProcessSet] = field(default_factory=dict)
    next_set_id: int = 1
    timeline: Any = None
    timeline_at_exit: bool = False
    backends: dict[str, str] = field(default_factory=lambda: {"cpu": "gloo", "cuda": "gloo"})  # device -> backend
    cuda_device: int | None = None  # the GPU init() chose (the negotiation's thread puts a joined rank's zeros there)


STATE = _State()


class JobListener:
    """What a module above this one does as the job starts, stops, resets (elastic) or changes its process sets:
    the negotiation (`negotiation.py`) and the pending operations (`ops.py`) register one each in `LISTENERS` when
    imported, so that this module, below them, calls them without importing them."""

    def started(self) -> None:
        """After `init()` set the ranks and the global process set, before the process sets it was given."""

    def stopping(self) -> None:
        """At `shutdown()`, before the process group is destroyed."""

    def reset(self) -> None:
        """Elastic `reform()`: the process group is about to go; drop what ran on it."""

    def set_added(self, set_id: int, ranks: list[int]) -> None:
        """A process set was registered (on every rank, in the same order)."""

    def set_removed(self, set_id: int, member: bool) -> None:
        """A process set was removed; `member`: this rank was in it."""


LISTENERS: list[JobListener] = []
_AT_EXIT: list[bool] = []
_INITS: list[bool] = []  # one entry per process group this process made through MASTER_PORT
_STORES: dict[tuple[str, str, int, int], dist.Store] = {}  # (address, port, rank, size) -> the store, kept


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def init(comm: Any = None, process_sets: list[ProcessSet] | str | None = None) -> None:
    """Join the job (idempotent). Creates the process group from the launcher's variables unless one exists
    already: gloo for CPU tensors, and for CUDA tensors NCCL where each local rank has a GPU (`backends.py`), the
    GPU of this local rank then made current; `comm` (a list of world ranks) is not supported: use a process set
    instead."""
    if STATE.initialized:
        return
    if comm is not None:
        raise ValueError("hvd.init(comm=...) needs MPI; on dtrain pass process_sets=[hvd.ProcessSet(ranks)] or "
                         "call hvd.add_process_set(ranks) after init()")
    world = _env_int("HOROVOD_SIZE", "WORLD_SIZE", default=1)
    me = _env_int("HOROVOD_RANK", "RANK", default=0)
    mpi_process = None if {"HOROVOD_RANK", "RANK"} & set(os.environ) or membership.active() else \
        mpi.read_mpi_process(os.environ)
    if mpi_process is not None:  # started by mpirun: its variables, and a rendezvous no MPI launcher gives
        world, me = mpi_process.size, mpi_process.rank
        os.environ.setdefault("DTRAIN_HOROVOD_STATE_DIR", mpi.state_dir(mpi_process))
    if not dist.is_initialized() and membership.active():  # elastic: the driver's newest generation
        membership.join(membership.current_generation(), gloo_timeout())
        STATE.owns_group = True
    elif not dist.is_initialized():
        timeout = timedelta(seconds=gloo_timeout())
        alone = world == 1 and "MASTER_ADDR" not in os.environ
        local_size = 1 if alone else mpi_process.local_size if mpi_process is not None else \
            backends.local_size_from(os.environ)
        backend = _backend_or_exit(local_size, me)
        if alone:
            dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
        elif mpi_process is not None:
            mpi.init_process_group(mpi_process, backend, timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1"))
            if "HOROVOD_GLOO_RENDEZVOUS_PORT" in os.environ:
                os.environ.setdefault("MASTER_PORT", os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
            if "HOROVOD_GLOO_IFACE" in os.environ:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["HOROVOD_GLOO_IFACE"])
            _init_env_group(me, world, timeout, backend)
        STATE.owns_group = True
    STATE.backends = backends.device_backends(dist.get_backend_config())
    STATE.rank, STATE.size = dist.get_rank(), dist.get_world_size()
    if mpi_process is not None and STATE.size == mpi_process.size:
        layout = mpi.exchange_layout(mpi_process)
        STATE.local_rank, STATE.local_size = layout.local_rank, layout.local_size
        STATE.cross_rank, STATE.cross_size = layout.cross_rank, layout.cross_size
    else:
        STATE.local_size = _env_int("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=STATE.size)
        STATE.local_rank = _env_int("HOROVOD_LOCAL_RANK", "LOCAL_RANK", default=STATE.rank % STATE.local_size)
        STATE.cross_rank = _env_int("HOROVOD_CROSS_RANK", "GROUP_RANK", default=STATE.rank // STATE.local_size)
        STATE.cross_size = _env_int("HOROVOD_CROSS_SIZE", default=max(1, STATE.size // STATE.local_size))
    if STATE.backends.get("cuda") == "nccl":  # NCCL wants one GPU per rank: this local rank's, as Horovod's docs say
        STATE.cuda_device = backends.use_local_gpu(STATE.local_rank)
    STATE.initialized = True
    if not _AT_EXIT:  # as Horovod does: leave cleanly when the script ends without hvd.shutdown()
        atexit.register(shutdown)
        _AT_EXIT.append(True)
    global_process_set.process_set_id = 0
    global_process_set.group = None
    STATE.sets = {0: global_process_set}
    STATE.next_set_id = 1
    for listener in LISTENERS:
        listener.started()
    if isinstance(process_sets, list):
        for process_set in process_sets:
            add_process_set(process_set)
    if STATE.rank == 0:
        for name, why in IGNORED_KNOBS.items():
            if os.environ.get(name) not in (None, "", "0"):
                warnings.warn(f"dtrain.horovod: {name} is ignored ({why})", stacklevel=2)
        cpu_operations = backends.cpu_operations_ignored(os.environ)
        if cpu_operations is not None:
            warnings.warn(cpu_operations, stacklevel=2)
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if timeline and timeline != "DYNAMIC":
        start_timeline(timeline)


def gloo_timeout() -> float:
    """Seconds a collective waits for its peers ($HOROVOD_GLOO_TIMEOUT_SECONDS, 300 by default)."""
    return float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "300"))


def reform() -> None:
    """Elastic: leave the broken or outgrown process group and join the driver's next membership, so that `rank()`
    and `size()` answer for the new job (what Horovod's reset does with shutdown and init). Process sets other than
    the global one are dropped, as Horovod drops them on a reset."""
    if STATE.initialized:
        for listener in LISTENERS:
            listener.reset()
    if dist.is_initialized():
        dist.destroy_process_group()  # closes this rank's connections, so peers blocked on it fail too
    sets = {key: value for key, value in STATE.sets.items() if key != 0}
    for process_set in sets.values():
        process_set.process_set_id, process_set.group = None, None
    STATE.initialized = False
    init()


def _backend_or_exit(local_size: int | None, me: int) -> str:
    """The backend string for a new process group (`backends.choose_backend`); a HOROVOD_GPU_OPERATIONS this
    machine cannot honour stops every rank with one line (printed by rank 0), exit code 2."""
    try:
        return backends.choose_backend(os.environ, local_size)
    except backends.BackendChoiceError as error:
        if me == 0:
            print(f"dtrain.horovod: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(ExitCode.USER_ERROR) from None


def _init_env_group(me: int, world: int, timeout: timedelta, backend: str) -> None:
    """The process group (`backend`: gloo, or gloo and NCCL by device) from MASTER_ADDR/MASTER_PORT, on a store
    this process keeps for every later init, with keys under a prefix new to each init.

    After shutdown() a quicker rank re-inits while a slower one still holds the last group: with a store made per
    init it finds rank 0's old store still serving, reads the last group's keys and pairs with sockets about to
    close, and rank 0's next store then waits for a client that never comes. One store per process (rank 0's server
    lives as long as the process) and a fresh prefix per init (every rank counts its inits alike: init and shutdown
    run on every rank, as in Horovod) leave no stale key to read."""
    where = (os.environ["MASTER_ADDR"], os.environ.get("MASTER_PORT", ""), me, world)
    if where not in _STORES:
        _STORES[where] = next(dist.rendezvous("env://", rank=me, world_size=world, timeout=timeout))[0]
    _INITS.append(True)
    prefixed = dist.PrefixStore(f"dtrain-horovod-init-{len(_INITS)}", _STORES[where])
    dist.init_process_group(backend, store=prefixed, rank=me, world_size=world, timeout=timeout)


def shutdown() -> None:
    """Leave the job: write the timeline, drop the process sets and the process group this module made."""
    if not STATE.initialized:
        return
    stop_timeline()
    for listener in LISTENERS:
        listener.stopping()
    if STATE.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    for process_set in STATE.sets.values():
        process_set.process_set_id = None
        process_set.group = None
    # re-initialise the one module-level state in place, so every holder of it sees the reset
    STATE.__init__()  # type: ignore[misc]


def is_initialized() -> bool:
    return STATE.initialized


def _check() -> None:
    if not STATE.initialized:
        raise ValueError(NOT_INITIALIZED)


def rank() -> int:
    _check()
    return STATE.rank


def size() -> int:
    _check()
    return STATE.size


def local_rank() -> int:
    _check()
    return STATE.local_rank


def local_size() -> int:
    _check()
    return STATE.local_size


def cross_rank() -> int:
    _check()
    return STATE.cross_rank


def cross_size() -> int:
    _check()
    return STATE.cross_size


def is_homogeneous() -> bool:
    _check()
    return STATE.size == STATE.local_size * STATE.cross_size


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> int:
    return int(dist.is_nccl_available())


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def cuda_built() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def rocm_built() -> bool:
    return False


def add_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Register a process set (every rank must call this, in the same order, with the same ranks)."""
    _check()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(list(process_set))
    if process_set.ranks is None:
        raise ValueError("the global process set is always registered")
    if any(r < 0 or r >= STATE.size for r in process_set.ranks):
        raise ValueError(f"process set ranks {process_set.ranks} must lie in 0..{STATE.size - 1}")
    if any(s.ranks == process_set.ranks for s in STATE.sets.values()):
        raise ValueError(f"a process set with ranks {process_set.ranks} is already registered")
    process_set.group = dist.new_group(process_set.ranks)
    process_set.process_set_id = STATE.next_set_id
    for listener in LISTENERS:
        listener.set_added(STATE.next_set_id, process_set.ranks)
    STATE.sets[STATE.next_set_id] = process_set
    STATE.next_set_id += 1
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank, same order). The global set cannot be removed."""
    _check()
    if process_set.process_set_id in (None, 0):
        return False
    STATE.sets.pop(process_set.process_set_id, None)
    for listener in LISTENERS:
        listener.set_removed(process_set.process_set_id, dist.get_rank() in (process_set.ranks or []))
    if process_set.group is not None and dist.get_rank() in (process_set.ranks or []):
        dist.destroy_process_group(process_set.group)
    process_set.process_set_id, process_set.group = None, None
    return True


# ------------------------------------------------------------------------------------------------ timeline


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective of this rank as a span in a Chrome trace (dtrain's timeline format) until
    `stop_timeline()`. Every rank writes its own file: rank r > 0 appends `.rank-r` to the name."""
    _check()
    from dtrain.profile.timeline import Timeline

    stop_timeline()
    path = Path(file_path) if STATE.rank == 0 else Path(f"{file_path}.rank-{STATE.rank}")
    STATE.timeline = Timeline(rank=STATE.rank, path=path, begin_on_batch=0, end_after_batch=None)
    if not STATE.timeline_at_exit:  # scripts rarely call shutdown(): write what was recorded when they end
        atexit.register(stop_timeline)
        STATE.timeline_at_exit = True
    STATE.timeline.events.append({"name": "horovod", "ph": "M", "pid": STATE.rank, "args": {
        "start_time_since_epoch_in_micros": int(time.time() * 1e6), "host": socket.gethostname(),
        "mark_cycles": mark_cycles}})


def stop_timeline() -> None:
    """Write the timeline started by `start_timeline` (or HOROVOD_TIMELINE) and stop recording."""
    if STATE.timeline is not None:
        STATE.timeline.write()
        STATE.timeline = None


def record_span(kind: str, name: str, start: float, end: float, negotiated: float | None = None,
                args: dict[str, Any] | None = None) -> None:
    """One collective on the timeline: `NEGOTIATE_<KIND>` (the metadata check) then `<KIND>`."""
    timeline = STATE.timeline
    if timeline is None:
        return
    if negotiated is not None:
        timeline.span(f"NEGOTIATE_{kind}", start, negotiated, 0, track=1, args={"tensor": name})
        start = negotiated
    timeline.span(kind, start, end, 0, track=1, args={"tensor": name, **(args or {})})
