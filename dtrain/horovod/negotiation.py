"""Horovod's negotiation by name: a background coordinator per rank that matches collectives by name (and process
set), whatever order the ranks post them in, and runs each ready set in one agreed order on every rank.

Each rank's coordinator thread, while it has operations pending, exchanges the list of what it has posted (a
63-bit key of process set and name, and the metadata row: kind, dtype, shape, op, root) with every rank through
an all-gather on its own gloo group. An operation is ready when every member of its process set has posted it
(a rank that has called `join()` counts as having posted every allreduce and barrier, and contributes zeros);
every rank computes the same ready list from the same table and runs it sorted by key, allreduces of one process
set, dtype and op fused into one buffer up to the fusion threshold, as Horovod fuses what one cycle makes ready.
Collectives run on the coordinator's own process groups, so the thread never races the main thread's
torch.distributed calls. A name posted twice on one rank while the first is pending raises ValueError on that
rank only; mismatched shapes or dtypes under one name raise RuntimeError on every rank that posted it; an
operation some ranks have not posted for HOROVOD_STALL_CHECK_TIME_SECONDS (60) is reported as Horovod's stall
warning, naming the missing ranks. With HOROVOD_STALL_SHUTDOWN_TIME_SECONDS set (> 0), a rank with an operation
pending that long says so in the next full exchange, and every rank shuts the negotiation down in that same cycle, as
Horovod's coordinator does: every pending operation on every rank raises HorovodInternalError naming the stalled
tensors and the ranks that never posted them, later collectives raise until `hvd.shutdown()` and `hvd.init()`. A
rank whose peers no longer exchange at all (busy elsewhere, gone) gives up alone after twice that time.

The response cache (Horovod's, HOROVOD_CACHE_CAPACITY entries, 1024 by default, 0 turns it off): once every member
has posted an allreduce, broadcast, reducescatter or barrier under one name with one row, that response gets a
position in a cache every rank builds identically from the agreed table. A cycle then starts with one all-gather of
a byte per position (1: posted here with the cached row, or not a member of its set) and a first byte saying
whether everything this rank has pending is cached; when every rank says so, the positions set on every rank run
in cache order and the full exchange is skipped. A new name, a changed row (shape, dtype, op, root), a join, a
shutdown, or a cycle that ran nothing sends everyone through the full exchange, which re-caches a changed row under
its old position and drops one that mismatched.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import backends, basics
from dtrain.horovod.basics import OP_NAMES, TORCH_OPS

KINDS = {"ALLREDUCE": 1, "ALLGATHER": 2, "BROADCAST": 3, "ALLTOALL": 4, "REDUCESCATTER": 5, "BARRIER": 6,
         "JOIN": 7, "SHUTDOWN": 8}
KIND_NAMES = {code: name for name, code in KINDS.items()}
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]
DEVICES = ["cpu", "cuda"]  # the device column: a CPU tensor goes through gloo, a CUDA one through NCCL where it runs
MAX_DIMS = 8
DEVICE = 6  # the device column
DIMS = 7  # where the dims start
ROW = DIMS + MAX_DIMS  # kind, dtype, ndim, op, root, set id, device, dims
WIDTH = 1 + ROW  # key, row
FIRST_BATCH = 32  # entries that travel in a cycle's first all-gather; more take a second one
HEADER = 2  # a full exchange's first all-gather starts with: entries posted, stalled past the shutdown time (0/1)
ADASUM = 2
DEFAULT_FUSION_BYTES = 64 * 1024 * 1024
DEFAULT_CACHE_CAPACITY = 1024
DEFAULT_CYCLE_MS = 1.0
CACHEABLE = {KINDS["ALLREDUCE"], KINDS["BROADCAST"], KINDS["REDUCESCATTER"], KINDS["BARRIER"]}


def metadata_row(kind: str, tensor: torch.Tensor | None, op: int = 0, root: int = -1, set_id: int = 0
                 ) -> torch.Tensor:
    """What every rank must agree on under one name: kind, dtype, shape, op, root, process set, device type (a CPU
    tensor on one rank and a CUDA one on another would go through two different backends)."""
    row = torch.zeros(ROW, dtype=torch.int64)
    row[0], row[3], row[4], row[5] = KINDS[kind], op, root, set_id
    if tensor is not None:
        row[1] = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else 99
        row[2] = tensor.dim()
        row[DEVICE] = DEVICES.index(tensor.device.type) if tensor.device.type in DEVICES else len(DEVICES)
        dims = list(tensor.shape)
        if len(dims) > MAX_DIMS:
            dims = dims[:MAX_DIMS - 1] + [math.prod(dims[MAX_DIMS - 1:])]
        row[DIMS:DIMS + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    return row


def describe(row: torch.Tensor) -> str:
    kind = KIND_NAMES.get(int(row[0]), "?")
    dtype = DTYPES[int(row[1])] if int(row[1]) < len(DTYPES) else "unsupported"
    shape = tuple(int(d) for d in row[DIMS:DIMS + min(int(row[2]), MAX_DIMS)])
    device = DEVICES[int(row[DEVICE])] if int(row[DEVICE]) < len(DEVICES) else "another device"
    return f"{kind} of {dtype} {shape} on {device}" + (f" op {OP_NAMES.get(int(row[3]), row[3])}" if int(row[0]) in (
        1, 5) else "") + (f" root {int(row[4])}" if int(row[0]) == 3 else "")


def rows_differ(kind: str, row: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether two ranks' rows disagree on what must agree under one name (dim 0 is free for allgather and
    alltoall)."""
    first = DIMS + 1 if kind in ("ALLGATHER", "ALLTOALL") else DIMS
    dims = min(int(reference[2]), MAX_DIMS)
    return not (all(int(row[c]) == int(reference[c]) for c in range(DIMS))
                and torch.equal(row[first:DIMS + dims], reference[first:DIMS + dims]))


def shape_of(row: torch.Tensor) -> list[int]:
    return [int(d) for d in row[DIMS:DIMS + min(int(row[2]), MAX_DIMS)]]


def device_of(row: torch.Tensor) -> torch.device:
    """Where a joined rank puts its zeros for `row`: the CPU, or the GPU `hvd.init()` made current (this thread's
    current device is not the main thread's)."""
    if int(row[DEVICE]) == DEVICES.index("cuda"):
        index = basics.STATE.cuda_device
        return torch.device("cuda", index if index is not None else torch.cuda.current_device())
    return torch.device("cpu")


def key_of(set_id: int, name: str) -> int:
    """A 63-bit key for (process set, name), the same in every process (Python's hash() is not)."""
    digest = hashlib.blake2b(f"{set_id}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class Ready:
    """What the agreed table says about one ready operation."""

    key: int
    rows: dict[int, torch.Tensor]  # global rank -> its row, for the members that posted it
    members: list[int]
    joined: list[int]  # members that have called join() and take part with zeros


@dataclass
class Cached:
    """One response in the cache: the agreed row under a key, and the global ranks that take part in it."""

    key: int
    row: tuple[int, ...] | None  # None: dropped after a mismatch (the position stays, so positions agree)
    members: list[int]


@dataclass
class Started:
    """What an `execute` returns when it started its transfer without waiting: the entry's result, and the work
    that `wait` (and `poll`) ask."""

    work: Any
    result: Any


@dataclass
class Entry:
    """One posted operation: `execute(ready)` runs on the coordinator thread once every member has posted it."""

    kind: str
    name: str
    set_id: int
    members: list[int]
    row: torch.Tensor
    execute: Callable[[Ready], Any]
    fusion: tuple[Any, ...] | None = None  # allreduces with the same fusion key may share one buffer
    buffer: torch.Tensor | None = None  # the fused allreduce's input and output
    key: int = 0
    row_key: tuple[int, ...] = ()  # `row` as Python ints, compared with the cache
    posted: float = field(default_factory=time.monotonic)
    posted_perf: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    warned: bool = False
    work: Any = None  # an allreduce the thread started and did not wait for
    unpack: Callable[[], None] | None = None  # after `work`: copy this entry's part out of the fused buffer

    def wait(self) -> Any:
        """Block until the operation ran, running the negotiation's cycles on this thread when no other thread
        is; re-raise its error. Warns of a stall while waiting."""
        while not self.done.is_set():
            coordinator = COORDINATOR[0]
            if coordinator is not None and coordinator.drive(self.done):
                continue
            if not self.done.wait(timeout=0.05 if coordinator is not None else 1.0) and coordinator is not None:
                coordinator.check_stalls()
        if self.error is not None:
            raise self.error
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.unpack is not None:
            self.unpack()
            self.unpack = None
        return self.result

    def is_completed(self) -> bool:
        return self.done.is_set() and (self.work is None or bool(self.work.is_completed()))


class Coordinator:
    """The background negotiation of one rank (see the module docstring)."""

    def __init__(self, rank: int, size: int, timeout_seconds: float) -> None:
        self.rank, self.size = rank, size
        self.stall_shutdown_seconds = float(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0") or 0)
        # an idle peer is a stall (warned of), not an error; with a stall shutdown, an exchange that no peer joins
        # for twice that time ends the negotiation on this rank alone (no shutdown can be agreed without them)
        long = timedelta(seconds=2 * self.stall_shutdown_seconds) if self.stall_shutdown_seconds > 0 else \
            timedelta(days=7)
        self.control = dist.new_group(backend="gloo", timeout=long)
        self.data: dict[int, Any] = {0: dist.new_group(timeout=timedelta(seconds=timeout_seconds))}
        self.timeout_seconds = timeout_seconds
        self.pending: dict[int, Entry] = {}
        self.set_members: dict[int, list[int]] = {0: list(range(size))}  # process set id -> its global ranks
        self.cycle_lock = threading.Lock()  # one cycle at a time, run by the background thread or a waiter
        self.cycle_seconds = float(os.environ.get("HOROVOD_CYCLE_TIME", str(DEFAULT_CYCLE_MS))) / 1000
        self.progressed = True  # the last cycle ran something (else the next one is a full exchange)
        self.idle_cycles = 0
        self.lock = threading.Condition()
        self.cycle = 0
        self.join_seen: dict[int, int] = {}  # rank -> the cycle its join was first seen in
        self.last_table: dict[int, dict[int, torch.Tensor]] = {}
        self.last_flags: list[list[int]] | None = None  # the last cached cycle's flags, rank by rank
        self.last_ran: set[int] = set()  # keys the last cycle ran: no longer posted anywhere
        self.cache: list[Cached] = []
        self.cache_index: dict[int, int] = {}  # key -> position
        self.cache_capacity = int(os.environ.get("HOROVOD_CACHE_CAPACITY", str(DEFAULT_CACHE_CAPACITY)))
        self.cycles_cached = 0  # cycles that skipped the full exchange (read by tests)
        self.stall_seconds = float(os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "60"))
        self.stall_disabled = os.environ.get("HOROVOD_STALL_CHECK_DISABLE") == "1"
        self.fusion_bytes = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", str(DEFAULT_FUSION_BYTES)))
        self.stopped = False
        self.stopping = False  # set by the SHUTDOWN every rank posts: the thread ends after that cycle
        self._zero_buffers: dict[int, torch.Tensor] = {}
        self.failure: BaseException | None = None
        self.stalled_ranks: list[int] = []  # who said, in the last full exchange, it is past the shutdown time
        self.thread = threading.Thread(target=self._run, name="horovod-negotiation", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------------------------------- posting

    def add_set(self, set_id: int, ranks: list[int]) -> None:
        """A data group for a new process set (every rank calls this, in the same order). Its members are known
        to this thread before new_group's barrier lets any rank post to the set, and kept after the set is
        removed (ids are not reused), so every rank reads the same members from the same table."""
        self.set_members[set_id] = list(ranks)
        self.data[set_id] = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout_seconds))

    def remove_set(self, set_id: int, member: bool) -> None:
        group = self.data.pop(set_id, None)
        if group is not None and member:
            dist.destroy_process_group(group)

    def post(self, entry: Entry) -> Entry:
        """Queue `entry`; ValueError (on this rank only) when its name is still pending here."""
        entry.key = key_of(entry.set_id, entry.name)
        entry.row_key = tuple(entry.row.tolist())
        with self.lock:
            if isinstance(self.failure, basics.HorovodInternalError):
                raise basics.HorovodInternalError(f"Horovod has been shut down: {self.failure} Call hvd.shutdown() "
                                                  "and hvd.init() on every rank to start again")
            if self.failure is not None:
                raise RuntimeError(f"the negotiation thread failed earlier: {self.failure}")
            if self.stopped:
                raise RuntimeError("Horovod has been shut down")
            if entry.key in self.pending:
                raise ValueError(f"a collective named '{entry.name}' is still pending on this rank: synchronize it "
                                 "first or use another name")
            self.pending[entry.key] = entry
            self.lock.notify()
        return entry

    # ---------------------------------------------------------------------------------------- the cycle

    def _run(self) -> None:
        """The background thread: after a post, wait one cycle time (a rank about to wait for the operation runs
        the cycle itself meanwhile, see `drive`), then cycle while anything is pending. While another thread holds
        the cycle (blocked until the other ranks post), it keeps the stall warning going."""
        while True:
            with self.lock:
                while not self.pending and not self.stopped:
                    self.lock.wait()
                if self.stopped and not self.pending:
                    return
            time.sleep(self.cycle_seconds)
            if not self.cycle_lock.acquire(timeout=1.0):
                self.check_stalls()
                continue
            try:
                self._one_cycle()
            finally:
                self.cycle_lock.release()
            if self.stopping or self.failure is not None:
                return
            self.check_stalls()

    def drive(self, done: threading.Event) -> bool:
        """Run cycles on the calling thread (one waiting for an operation) until `done` is set: no hand-over to
        the background thread and back on the way. False when the cycle is busy elsewhere or cannot run."""
        if not self.cycle_lock.acquire(blocking=False):
            return False
        try:
            while not done.is_set():
                if self._one_cycle() is None:
                    return False
            return True
        finally:
            self.cycle_lock.release()

    def _one_cycle(self) -> bool | None:
        """One cycle over what this rank has pending (the caller holds `cycle_lock`): whether it ran anything
        anywhere, or None when nothing is pending, the negotiation ended or it failed (every waiter is told)."""
        with self.lock:
            if not self.pending or self.stopping or self.failure is not None:
                return None
            mine = sorted(self.pending.values(), key=lambda e: e.key)
        started = time.monotonic()
        try:
            progressed = self._cycle(mine, refresh=not self.progressed)
        except BaseException as error:  # noqa: BLE001 - every waiter gets it
            waited = time.monotonic() - started
            if self.stall_shutdown_seconds > 0 and waited >= 2 * self.stall_shutdown_seconds * 0.9 and \
                    not isinstance(error, basics.HorovodInternalError):
                error = basics.HorovodInternalError(
                    f"stall shutdown: no other rank joined the negotiation's exchange for {waited:.0f} s (twice "
                    f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) while {[e.name for e in mine]} waited; rank {self.rank} "
                    f"shut Horovod down alone ({error})")
            self._fail(error)
            return None
        self.progressed = progressed
        if progressed:
            self.idle_cycles = 0
        else:  # the others are behind: back off a little rather than spin the all-gather
            self.idle_cycles += 1
            time.sleep(min(0.0002 * self.idle_cycles, 0.005))
        return progressed

    def _cycle(self, mine: list[Entry], refresh: bool) -> bool:
        """One negotiation cycle, the same on every rank: the cached fast path when every rank has only cached
        responses pending, else the full exchange. `refresh` (the last cycle ran nothing) asks for the full
        exchange, so that a stall warning names who is missing from a table of this moment."""
        stalled = self._past_shutdown(mine)
        if self.cache:
            flags = self._exchange_flags(mine, refresh or stalled)
            if all(row[0] for row in flags):
                return self._run_cached(flags, {entry.key: entry for entry in mine})
        table = self._exchange(mine, stalled)
        if self.stalled_ranks:
            raise basics.HorovodInternalError(self._shutdown_message(table))
        return self._run_ready(table)

    def _past_shutdown(self, mine: list[Entry]) -> bool:
        """Whether an operation of `mine` has waited longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS."""
        if self.stall_shutdown_seconds <= 0:
            return False
        now = time.monotonic()
        return any(now - entry.posted > self.stall_shutdown_seconds for entry in mine
                   if entry.kind not in ("JOIN", "SHUTDOWN"))

    def _shutdown_message(self, table: dict[int, dict[int, torch.Tensor]]) -> str:
        """What every rank raises at a stall shutdown: the operations some ranks posted and others did not."""
        with self.lock:
            names = {entry.key: entry.name for entry in self.pending.values()}
        lines = []
        for key in sorted({key for rows in table.values() for key in rows}):
            holders = [rank for rank, rows in sorted(table.items()) if key in rows]
            missing = [r for r in self._members(int(table[holders[0]][key][5])) if r not in holders]
            if missing:
                name = names.get(key, "an operation not posted here")
                lines.append(f"{name} (posted by rank(s) {holders}, not by {missing})")
        return (f"stall shutdown: rank(s) {self.stalled_ranks} waited more than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS "
                f"({self.stall_shutdown_seconds:g}) for other ranks to post the same operations; every rank shut "
                f"Horovod down. Not posted by every rank: {'; '.join(lines) or 'none named'}.")

    def _is_cached(self, entry: Entry) -> bool:
        position = self.cache_index.get(entry.key)
        return position is not None and self.cache[position].row == entry.row_key

    def _exchange_flags(self, mine: list[Entry], refresh: bool) -> list[list[int]]:
        """All-gather a byte per cache position (this rank posted it with the cached row, or is no member) and a
        first byte (everything pending here is cached)."""
        flags = [0] * (1 + len(self.cache))
        flags[0] = int(not refresh and all(self._is_cached(entry) for entry in mine))
        for entry in mine:
            if self._is_cached(entry):
                flags[1 + self.cache_index[entry.key]] = 1
        for position, cached in enumerate(self.cache):
            if self.rank not in cached.members:
                flags[1 + position] = 1
        mine_flags = torch.tensor(flags, dtype=torch.uint8)
        gathered = [torch.empty_like(mine_flags) for _ in range(self.size)]
        dist.all_gather(gathered, mine_flags, group=self.control)
        return torch.stack(gathered).tolist()

    def _run_cached(self, flags: list[list[int]], mine: dict[int, Entry]) -> bool:
        """Run, in cache order, the cached responses every rank has flagged."""
        self.cycle += 1
        self.cycles_cached += 1
        self.last_flags, self.last_table = flags, {}
        ready = [position for position in range(len(self.cache)) if all(row[1 + position] for row in flags)
                 and self.cache[position].row is not None]
        runnable: list[tuple[Ready, Entry]] = []
        for position in ready:
            cached = self.cache[position]
            entry = mine.get(cached.key)
            if entry is not None:  # None: this rank is no member of the response's process set
                runnable.append((Ready(cached.key, {}, cached.members, []), entry))
        self.last_ran = {self.cache[position].key for position in ready}
        self._dispatch(runnable)
        return bool(ready)

    def _exchange(self, mine: list[Entry], stalled: bool = False) -> dict[int, dict[int, torch.Tensor]]:
        """Every rank's posted entries: rank -> key -> row; `stalled_ranks` says who is past the shutdown time."""
        count = len(mine)
        first = torch.full((HEADER + FIRST_BATCH * WIDTH,), -1, dtype=torch.int64)
        first[0], first[1] = count, int(stalled)
        for i, entry in enumerate(mine[:FIRST_BATCH]):
            first[HEADER + i * WIDTH] = entry.key
            first[HEADER + 1 + i * WIDTH:HEADER + (i + 1) * WIDTH] = entry.row
        gathered = [torch.empty_like(first) for _ in range(self.size)]
        dist.all_gather(gathered, first, group=self.control)
        counts = [int(g[0]) for g in gathered]
        self.stalled_ranks = [rank for rank, g in enumerate(gathered) if int(g[1]) == 1]
        if max(counts) > FIRST_BATCH:
            longest = max(counts)
            full = torch.full((longest * WIDTH,), -1, dtype=torch.int64)
            for i, entry in enumerate(mine):
                full[i * WIDTH] = entry.key
                full[1 + i * WIDTH:(i + 1) * WIDTH] = entry.row
            rows = [torch.empty_like(full) for _ in range(self.size)]
            dist.all_gather(rows, full, group=self.control)
            flat = [r.view(longest, WIDTH) for r in rows]
        else:
            flat = [g[HEADER:].view(FIRST_BATCH, WIDTH) for g in gathered]
        self.cycle += 1
        table: dict[int, dict[int, torch.Tensor]] = {}
        for rank, (rows_of_rank, n) in enumerate(zip(flat, counts, strict=True)):
            table[rank] = {int(rows_of_rank[i, 0]): rows_of_rank[i, 1:] for i in range(n)}
            for row in table[rank].values():
                if int(row[0]) == KINDS["JOIN"]:
                    self.join_seen.setdefault(rank, self.cycle)
        self.last_table, self.last_flags = table, None
        return table

    def _members(self, set_id: int) -> list[int]:
        return self.set_members.get(set_id, self.set_members[0])

    def _ready(self, table: dict[int, dict[int, torch.Tensor]]) -> list[Ready]:
        """The operations every member has posted (joined ranks count for allreduce and barrier), by key."""
        joined = {r for r, rows in table.items() if any(int(row[0]) == KINDS["JOIN"] for row in rows.values())}
        keys = sorted({key for rows in table.values() for key in rows})
        ready = []
        for key in keys:
            holders = {r: rows[key] for r, rows in table.items() if key in rows}
            row = next(iter(holders.values()))
            kind = KIND_NAMES.get(int(row[0]), "?")
            members = list(range(self.size)) if kind in ("JOIN", "SHUTDOWN") else self._members(int(row[5]))
            missing = [r for r in members if r not in holders]
            if kind in ("JOIN", "SHUTDOWN"):
                if not missing:
                    ready.append(Ready(key, holders, members, []))
                continue
            if missing and all(r in joined for r in missing) and len(missing) < len(members):
                ready.append(Ready(key, holders, members, missing))
            elif not missing:
                ready.append(Ready(key, holders, members, []))
        return ready

    def _run_ready(self, table: dict[int, dict[int, torch.Tensor]]) -> bool:
        ready = self._ready(table)
        self.last_ran = {item.key for item in ready}
        if not ready:
            return False
        fused: dict[tuple[Any, ...], list[tuple[Ready, Entry | None]]] = {}
        runnable: list[tuple[Ready, Entry]] = []
        for item in ready:
            problem = self._problem(item)
            self._remember(item, problem)
            entry = self.pending.get(item.key)
            if self.rank not in item.members:
                continue
            if entry is None:  # this rank joined: it takes part in allreduces with zeros
                if problem is None and int(next(iter(item.rows.values()))[0]) == KINDS["ALLREDUCE"]:
                    self._zeros(item, fused)
                continue
            if problem is not None:
                self._finish(entry, error=problem)
                continue
            runnable.append((item, entry))
        self._dispatch(runnable, fused)
        return True

    def _remember(self, item: Ready, problem: BaseException | None) -> None:
        """Update the response cache from one agreed ready item (the same on every rank, members or not): cache a
        new cacheable response, re-cache a changed row under its position, drop one that mismatched."""
        position = self.cache_index.get(item.key)
        if problem is not None:
            if position is not None:
                self.cache[position].row = None
            return
        rows = [tuple(row.tolist()) for row in item.rows.values()]
        if item.joined or rows[0][0] not in CACHEABLE or any(row != rows[0] for row in rows):
            return
        if position is not None:
            self.cache[position].row = rows[0]
        elif len(self.cache) < self.cache_capacity:
            self.cache_index[item.key] = len(self.cache)
            self.cache.append(Cached(item.key, rows[0], item.members))

    def _dispatch(self, runnable: list[tuple[Ready, Entry]],
                  fused: dict[tuple[Any, ...], list[tuple[Ready, Entry | None]]] | None = None) -> None:
        """Run this rank's part of a ready set in the agreed order: fusable allreduces by fusion key, after the
        others."""
        fused = {} if fused is None else fused
        for item, entry in runnable:
            if entry.fusion is not None:
                fused.setdefault(entry.fusion, []).append((item, entry))
            else:
                self._execute(entry, item)
        for key, group in fused.items():
            self._run_fused(key, group)

    def _problem(self, item: Ready) -> BaseException | None:
        """The error every rank that posted `item` raises (the same on each): mismatched metadata, or a rank
        that has joined when the op needs every rank."""
        ranks = sorted(item.rows)
        reference = item.rows[ranks[0]]
        kind = KIND_NAMES.get(int(reference[0]), "?")
        name = self._name_of(item.key)
        if item.joined and kind not in ("ALLREDUCE", "BARRIER"):
            return RuntimeError(f"{kind.lower()} '{name}' cannot run while rank(s) {item.joined} have called "
                                "hvd.join(): only allreduce (zeros from the joined ranks) and barrier can")
        for rank in ranks[1:]:
            row = item.rows[rank]
            if rows_differ(kind, row, reference):
                return RuntimeError(f"Mismatched {kind.lower()} '{name}': rank {ranks[0]} submitted "
                                    f"{describe(reference)} but rank {rank} submitted {describe(row)}; every rank must "
                                    "submit the same dtype and shape under one name")
        if int(reference[1]) == 99:
            return RuntimeError(f"{kind.lower()} '{name}': unsupported dtype")
        return None

    def _name_of(self, key: int) -> str:
        entry = self.pending.get(key)
        return entry.name if entry is not None else f"<key {key}>"

    def _execute(self, entry: Entry, item: Ready) -> None:
        started = time.perf_counter()
        try:
            result = entry.execute(item)
        except BaseException as error:  # noqa: BLE001 - raised at synchronize on this rank
            self._finish(entry, error=error)
            return
        if entry.kind not in ("JOIN", "SHUTDOWN", "BARRIER"):
            self._record(entry, started)
        if isinstance(result, Started):
            entry.work, result = result.work, result.result
        self._finish(entry, result=result)

    def _finish(self, entry: Entry, result: Any = None, error: BaseException | None = None) -> None:
        with self.lock:
            self.pending.pop(entry.key, None)
        entry.result, entry.error = result, error
        entry.done.set()

    # ---------------------------------------------------------------------------------------- allreduce

    def data_group(self, set_id: int) -> Any:
        return self.data[set_id]

    def _zeros(self, item: Ready, fused: dict[tuple[Any, ...], list[tuple[Ready, Entry | None]]]) -> None:
        row = next(iter(item.rows.values()))
        device = device_of(row)
        dtype = backends.reduce_wire(DTYPES[int(row[1])], device, basics.STATE.backends)
        op, set_id = int(row[3]), int(row[5])
        zeros = torch.zeros(shape_of(row), dtype=dtype, device=device)
        if op == ADASUM:
            from dtrain.comm.adasum import adasum_all_reduce_

            adasum_all_reduce_(zeros.view(-1), group=self.data_group(set_id))
            return
        fused.setdefault(fusion_key(set_id, dtype, op, device), []).append((item, None))
        self._zero_buffers[item.key] = zeros

    def _run_fused(self, key: tuple[Any, ...], group: list[tuple[Ready, Entry | None]]) -> None:
        """One all-reduce per run of same-key allreduces up to the fusion threshold (the same runs on every rank:
        they come from the agreed table, in key order)."""
        set_id, _, op, _ = key
        chunk: list[tuple[Ready, Entry | None, torch.Tensor]] = []
        size = 0
        for item, entry in group:
            buffer = entry.buffer if entry is not None else self._zero_buffers.pop(item.key)
            assert buffer is not None
            nbytes = buffer.numel() * buffer.element_size()
            if chunk and size + nbytes > self.fusion_bytes:
                self._reduce_chunk(set_id, op, chunk)
                chunk, size = [], 0
            chunk.append((item, entry, buffer))
            size += nbytes
        if chunk:
            self._reduce_chunk(set_id, op, chunk)

    def _reduce_chunk(self, set_id: int, op: int, chunk: list[tuple[Ready, Entry | None, torch.Tensor]]) -> None:
        group = self.data_group(set_id)
        started = time.perf_counter()
        flat = chunk[0][2] if len(chunk) == 1 else torch.cat([buffer.reshape(-1) for _, _, buffer in chunk])
        try:  # started, not waited for: the thread goes on negotiating while it travels
            work = dist.all_reduce(flat, op=TORCH_OPS[op], group=group, async_op=True)
        except BaseException as error:  # noqa: BLE001 - raised at synchronize
            for _, entry, _ in chunk:
                if entry is not None:
                    self._finish(entry, error=error)
            return
        offset = 0
        for _, entry, buffer in chunk:
            n = buffer.numel()
            if entry is not None:
                entry.work = work
                if len(chunk) > 1:
                    entry.unpack = _copier(buffer, flat, offset, n)
                self._record(entry, started)
                self._finish(entry, result=entry.buffer)
            offset += n

    def _record(self, entry: Entry, started: float) -> None:
        basics.record_span(entry.kind, entry.name, entry.posted_perf, time.perf_counter(), started)

    # ---------------------------------------------------------------------------------------- join, stalls, end

    def last_joined(self) -> int:
        latest = max(self.join_seen.values())
        return max(r for r, c in self.join_seen.items() if c == latest)

    def joined_done(self) -> None:
        self.join_seen = {}

    def check_stalls(self) -> None:
        """Horovod's stall warning, once per operation: what this rank has posted that other ranks have not, for
        longer than HOROVOD_STALL_CHECK_TIME_SECONDS."""
        now = time.monotonic()
        if self.stall_disabled:
            return
        with self.lock:
            stalled = [e for e in self.pending.values() if not e.warned and now - e.posted > self.stall_seconds
                       and e.kind not in ("JOIN", "SHUTDOWN")]
        if not stalled:
            return
        missing: dict[int, list[str]] = {}
        for entry in stalled:
            entry.warned = True
            for rank in entry.members:
                if rank != self.rank and entry.key not in self._posted_by(rank):
                    missing.setdefault(rank, []).append(entry.name)
        lines = "\n".join(f"{rank}: [{', '.join(names)}]" for rank, names in sorted(missing.items()))
        warnings.warn(
            f"One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are "
            f"waiting for remainder of ranks for more than {self.stall_seconds:g} seconds. This may indicate that "
            "different ranks are trying to submit different tensors or that only subset of ranks is submitting "
            f"tensors, which will cause deadlock.\nMissing ranks (as of the last exchange):\n{lines}", stacklevel=2)

    def _posted_by(self, rank: int) -> set[int]:
        """The keys `rank` had posted at the last cycle, from its full table or its cache flags."""
        if self.last_flags is None:
            return set(self.last_table.get(rank, {})) - self.last_ran
        flags = self.last_flags[rank]
        return {cached.key for position, cached in enumerate(self.cache[:len(flags) - 1])
                if flags[1 + position] and rank in cached.members} - self.last_ran

    def _fail(self, error: BaseException) -> None:
        with self.lock:
            self.failure = error
            entries = list(self.pending.values())
            self.pending.clear()
        for entry in entries:
            entry.error = error if isinstance(error, basics.HorovodInternalError) else RuntimeError(
                f"the negotiation failed: {error}")
            entry.done.set()

    def stop(self, wait_seconds: float) -> None:
        """Leave together: a SHUTDOWN every rank posts, then the thread ends. Pending operations fail."""
        if self.failure is None and self.thread.is_alive():
            entry = Entry("SHUTDOWN", "shutdown", 0, list(range(self.size)), metadata_row("SHUTDOWN", None),
                          execute=self._leave)
            try:
                self.post(entry)
                entry.done.wait(timeout=wait_seconds)
            except RuntimeError:
                pass
        self._drop_pending("Horovod was shut down before this operation ran")
        self.thread.join(timeout=1.0)

    def abandon(self) -> None:
        """Stop without the other ranks (elastic: the process group broke and is being destroyed): pending
        operations fail; the thread ends when its collective, if any, fails with the group."""
        self._drop_pending("the process group was re-formed before this operation ran")

    def _drop_pending(self, message: str) -> None:
        with self.lock:
            self.stopped = True
            leftovers = list(self.pending.values())
            self.pending.clear()
            self.lock.notify()
        for entry in leftovers:
            entry.error = RuntimeError(message)
            entry.done.set()


    def _leave(self, ready: Ready) -> None:
        self.stopping = True


def _copier(buffer: torch.Tensor, flat: torch.Tensor, offset: int, n: int) -> Callable[[], None]:
    def copy() -> None:
        buffer.view(-1).copy_(flat[offset:offset + n])

    return copy


def fusion_key(set_id: int, wire_dtype: torch.dtype, op: int, device: torch.device) -> tuple[Any, ...]:
    """Allreduces fused into one buffer share a process set, wire type, op and device (a fused buffer lives on
    one device, and goes through that device's backend)."""
    return (set_id, wire_dtype, op, str(device))


COORDINATOR: list[Coordinator | None] = [None]


class _Negotiation(basics.JobListener):
    """Starts this rank's coordinator when the job starts, tells it of process sets, stops it at shutdown."""

    def started(self) -> None:
        COORDINATOR[0] = Coordinator(basics.STATE.rank, basics.STATE.size, basics.gloo_timeout())

    def stopping(self) -> None:
        coordinator, COORDINATOR[0] = COORDINATOR[0], None
        if coordinator is not None:
            coordinator.stop(wait_seconds=basics.gloo_timeout())

    def set_added(self, set_id: int, ranks: list[int]) -> None:
        if COORDINATOR[0] is not None:
            COORDINATOR[0].add_set(set_id, ranks)

    def set_removed(self, set_id: int, member: bool) -> None:
        if COORDINATOR[0] is not None:
            COORDINATOR[0].remove_set(set_id, member)


basics.LISTENERS.append(_Negotiation())
if basics.STATE.initialized and COORDINATOR[0] is None:  # init() ran before this module was first imported
    basics.LISTENERS[-1].started()
    for _set_id, _process_set in basics.STATE.sets.items():
        if _set_id != 0 and _process_set.ranks is not None:
            basics.LISTENERS[-1].set_added(_set_id, _process_set.ranks)
