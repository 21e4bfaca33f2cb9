"""A same-host all-gather of one small fixed-size float64 buffer per rank through shared memory.

For collectives issued thousands of times per second (the SVM's one exchange per SMO iteration), gloo's latency
(~1 ms for 32 numbers between two processes on the 2-core build machine: its work thread and its transport's
event loop hand the message on) dwarfs the work between calls; two processes that poll a word in a shared page
see each other's write in about a microsecond.

The segment (a file in /dev/shm) holds a header (magic, a nonce, each rank's pid), one 64-byte line per rank
with that rank's sequence number, and two banks of one slot per rank. Call k of `gather`: a rank writes its
payload into its slot of bank k % 2, then its sequence number k; it waits until every rank's number is >= k and
copies bank k % 2 out. Two banks suffice: a rank writes bank k % 2 again at call k + 2, which it starts only
after every rank has written k + 1, i.e. after every rank has finished copying call k out. The payload is
published by the store that follows it only under a memory model that keeps stores in order (x86-64's TSO), so
`supported()` is true there only; elsewhere callers use gloo.

Waiting spins for a short while, then yields the core, then sleeps with back-off; it fails with `StallError`
after `timeout_seconds`, or as soon as a peer's process is seen to have exited, so a dead peer never hangs a
run. `setup_allgather` creates and checks the segment through torch.distributed and unlinks the file once
every rank has mapped it: from then on nothing of it is left in /dev/shm, whatever happens to the processes.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.errors import ConfigError, StallError
from dtrain.runs.processes import process_alive

SHM_DIR = Path("/dev/shm")
PREFIX = "dtrain-allgather-"
MAGIC = 0x64747261696E5348  # "dtrainSH"
LINE = 64  # bytes: one cache line per rank's sequence number, so that ranks do not write the same line
MODES = ("auto", "gloo", "shm")


def supported() -> bool:
    """Whether this machine's memory model publishes a payload before the sequence number written after it."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _round_up(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Byte offsets of a segment for `world` ranks of `count` float64 each."""

    world: int
    count: int

    @property
    def header(self) -> int:
        return _round_up(8 * (4 + self.world), LINE)  # magic, nonce, world, count, then one pid per rank

    @property
    def slot(self) -> int:
        return _round_up(8 * self.count, LINE)

    @property
    def sequences(self) -> int:
        return self.header

    @property
    def banks(self) -> int:
        return self.header + LINE * self.world

    @property
    def size(self) -> int:
        return self.banks + 2 * self.world * self.slot

    def slot_offset(self, bank: int, rank: int) -> int:
        return self.banks + (bank * self.world + rank) * self.slot


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers: spin, then yield the core, then sleep with back-off, then give up."""

    spin_seconds: float = 100e-6
    yield_seconds: float = 2e-3
    first_sleep: float = 20e-6
    longest_sleep: float = 1e-3
    timeout_seconds: float = 1800.0
    liveness_every: float = 1.0  # seconds between checks that the awaited peers' processes still exist


class ShmAllGather:
    """One rank's end of a mapped segment: `gather(send, out)` fills `out` (world, count) with every rank's `send`."""

    def __init__(self, path: Path, layout: Layout, rank: int, *, create: bool, nonce: int = 0,
                 policy: WaitPolicy | None = None) -> None:
        self.path = path
        self.layout = layout
        self.rank = rank
        self.policy = policy or WaitPolicy()
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, layout.size)
            elif os.fstat(fd).st_size != layout.size:
                raise ConfigError(f"shared-memory segment {path} has {os.fstat(fd).st_size} bytes, expected "
                                  f"{layout.size}: ranks disagree on the exchange's size")
            self._map = mmap.mmap(fd, layout.size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")  # int64 words: header and sequence numbers
        self._header = np.frombuffer(self._map, dtype=np.int64, count=4 + layout.world)
        self._banks = [np.frombuffer(self._map, dtype=np.float64, count=layout.world * layout.slot // 8,
                                     offset=layout.slot_offset(bank, 0)).reshape(layout.world, layout.slot // 8)
                       for bank in (0, 1)]
        if create:
            self._header[:4] = (MAGIC, nonce, layout.world, layout.count)
        self._header[4 + rank] = os.getpid()
        self.calls = 0
        self._peers = [r for r in range(layout.world) if r != rank]
        self.watch_pids = True

    def _sequence_word(self, rank: int) -> int:
        return (self.layout.sequences + LINE * rank) // 8

    def matches(self, nonce: int) -> bool:
        """Whether this mapping is the segment rank 0 created (same magic, nonce and shape)."""
        return bool(self._header[0] == MAGIC and self._header[1] == nonce and self._header[2] == self.layout.world
                    and self._header[3] == self.layout.count)

    def pids(self) -> list[int]:
        """Every rank's process id as it wrote it into the header (0 for a rank that has not mapped it yet)."""
        return [int(p) for p in self._header[4:4 + self.layout.world]]

    def gather(self, send: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Every rank's `send` (`count` float64) as the rows of `out` (world, count), the same on every rank."""
        self.calls += 1
        k = self.calls
        bank = self._banks[k & 1]
        count = self.layout.count
        bank[self.rank, :count] = send.reshape(-1)
        self._words[self._sequence_word(self.rank)] = k  # after the payload: publishes it (TSO)
        for peer in self._peers:
            if self._words[self._sequence_word(peer)] < k:
                self._wait(peer, k)
        out.reshape(self.layout.world, count)[:] = bank[:, :count]
        return out

    def _wait(self, peer: int, k: int) -> None:
        words, index, policy = self._words, self._sequence_word(peer), self.policy
        started = time.perf_counter()
        spins = 0
        while words[index] < k:
            spins += 1
            if spins & 63:
                continue
            if time.perf_counter() - started >= policy.spin_seconds:
                break
        else:
            return
        while words[index] < k:
            os.sched_yield()
            if time.perf_counter() - started >= policy.yield_seconds:
                break
        else:
            return
        sleep, checked = policy.first_sleep, time.perf_counter()
        while words[index] < k:
            time.sleep(sleep)
            sleep = min(sleep * 2, policy.longest_sleep)
            now = time.perf_counter()
            if now - started > policy.timeout_seconds:
                raise StallError(f"rank {self.rank} waited {policy.timeout_seconds:g} s in the shared-memory "
                                 f"all-gather (call {k}) for rank {peer}, which did not arrive; look at that rank's "
                                 "log, or raise the process group's timeout")
            if self.watch_pids and now - checked >= policy.liveness_every:
                checked = now
                pid = int(self._header[4 + peer])
                if not process_alive(pid):
                    raise StallError(f"rank {self.rank} waited in the shared-memory all-gather (call {k}) for rank "
                                     f"{peer}, whose process (pid {pid}) has exited; look at that rank's log")

    def unlink(self) -> None:
        """Remove the segment's name (the mappings stay valid); nothing is left in /dev/shm afterwards."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap (the segment's memory goes once every rank has closed or exited)."""
        if self._map.closed:
            return
        self._words.release()
        del self._header, self._banks
        self._map.close()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _group_timeout() -> float:
    """The default process group's timeout in seconds (torch's default when it cannot be read). Reads the gloo
    backend's private options, as comm/stall.py writes them; tests/unit/test_torch_private_api.py pins both."""
    import torch
    import torch.distributed as dist

    try:
        # WORLD is None before init: the AttributeError that gives is caught below
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.default_pg_timeout.total_seconds())


def check_mode(mode: str, what: str = "exchange") -> str:
    """`mode` if it is one of MODES, else one ConfigError line naming the choices."""
    if mode not in MODES:
        raise ConfigError(f"{what} {mode!r} is not one of {', '.join(MODES)}; use auto (shared memory when every "
                          "rank is on this host with a core of its own, else gloo), gloo or shm")
    return mode


def setup_allgather(count: int, mode: str = "auto", *, policy: WaitPolicy | None = None,
                    what: str = "exchange") -> ShmAllGather | None:
    """This rank's shared-memory all-gather of `count` float64 over the default process group, or None for gloo.

    A collective (every rank calls it with the same arguments). `auto` takes shared memory when every rank is on
    this host (the same hostname and boot), the machine is x86-64 and the world size is at most the CPUs each
    rank may run on; `shm` insists (one error line when it cannot); `gloo` returns None.
    """
    import torch.distributed as dist

    check_mode(mode, what)
    if mode == "gloo" or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    me = (socket.gethostname(), _boot_id(), len(os.sched_getaffinity(0)), supported(), SHM_DIR.is_dir(), os.getpid())
    everyone: list[Any] = [None] * world  # all_gather_object fills one `me` tuple per rank
    dist.all_gather_object(everyone, me)
    hosts = sorted({(host, boot) for host, boot, *_ in everyone})
    cpus = min(info[2] for info in everyone)
    reason = ""
    if len(hosts) > 1:
        reason = f"the ranks are on {len(hosts)} hosts ({', '.join(h for h, _ in hosts)})"
    elif not all(info[3] for info in everyone):
        reason = f"this is a {platform.machine()} machine, and the exchange relies on x86-64's store order"
    elif not all(info[4] for info in everyone):
        reason = f"{SHM_DIR} is missing"
    elif mode == "auto" and world > cpus:
        reason = f"{world} ranks share {cpus} CPU(s), and waiting ranks spin"
    if reason:
        if mode == "shm":
            raise ConfigError(f"{what} 'shm' cannot be used: {reason}; use {what} auto or gloo")
        return None
    layout = Layout(world, count)
    wait = policy or WaitPolicy(timeout_seconds=_group_timeout())
    nonce = secrets.randbits(62)
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    channel = None
    error = ""
    if rank == 0:
        channel = ShmAllGather(SHM_DIR / name, layout, 0, create=True, nonce=nonce, policy=wait)
    box = [(name, nonce)]
    dist.broadcast_object_list(box, src=0)
    name, nonce = box[0]
    if rank != 0:
        try:
            channel = ShmAllGather(SHM_DIR / name, layout, rank, create=False, policy=wait)
            if not channel.matches(nonce):
                error = f"rank {rank} mapped {SHM_DIR / name} but found another segment's header"
        except OSError as exc:
            error = f"rank {rank} cannot map {SHM_DIR / name}: {exc.strerror}"
    errors: list[str] = [""] * world
    dist.all_gather_object(errors, error)  # every rank has mapped the segment (or failed) after this
    if rank == 0 and channel is not None:
        channel.unlink()
    failed = [e for e in errors if e]
    if failed:
        if channel is not None:
            channel.close()
        if mode == "shm":
            raise ConfigError(f"{what} 'shm' cannot be used: {failed[0]} (the ranks do not share {SHM_DIR}); use "
                              f"{what} auto or gloo")
        return None
    assert channel is not None
    channel.watch_pids = all(process_alive(info[5]) for info in everyone)  # the peers' pids mean something here
    return channel
