"""The shared-memory all-gather (dtrain.comm.shm) without torch.distributed: the segment's layout, the
sequence and two-bank logic across forked processes (every call, every rank, the right payload), the timeout
and the dead-peer error, the mode check. Its setup over a process group and the SVM's use of it are tested in
tests/distributed/test_svm_ranks.py."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dtrain.comm.shm import LINE, SHM_DIR, Layout, ShmAllGather, WaitPolicy, check_mode, supported
from dtrain.errors import ConfigError, StallError

pytestmark = pytest.mark.skipif(not supported() or not hasattr(os, "fork"), reason="x86-64 Linux only")


@pytest.fixture
def segment(tmp_path: Path) -> Iterator[Path]:
    root = SHM_DIR if SHM_DIR.is_dir() else tmp_path
    path = root / f"dtrain-allgather-test-{os.getpid()}-{secrets.token_hex(4)}"
    yield path
    path.unlink(missing_ok=True)


def test_layout_keeps_every_rank_on_its_own_cache_lines() -> None:
    layout = Layout(world=3, count=5)
    assert layout.header == 64 and layout.slot == 64 and layout.sequences == 64 and layout.banks == 64 + 3 * LINE
    offsets = [layout.slot_offset(bank, rank) for bank in (0, 1) for rank in range(3)]
    assert offsets == [layout.banks + i * 64 for i in range(6)]
    assert layout.size == offsets[-1] + 64
    wide = Layout(world=70, count=1000)  # the header grows with the pids; slots round up to whole lines
    assert wide.header == 640 and wide.slot == 8000 and wide.banks % LINE == 0


def _payload(rank: int, call: int, count: int) -> np.ndarray:
    return np.random.default_rng(rank * 1_000_003 + call).standard_normal(count)


def _rank_main(path: Path, layout: Layout, rank: int, calls: int) -> None:
    """One forked rank: `calls` gathers, some after a random pause; exit code 0 only if every table was right."""
    code = 1
    try:
        channel = ShmAllGather(path, layout, rank, create=False, policy=WaitPolicy(timeout_seconds=60))
        out = np.empty((layout.world, layout.count))
        pause = np.random.default_rng(rank)
        wrong = 0
        for call in range(1, calls + 1):
            if pause.random() < 0.05:
                time.sleep(pause.random() * 1e-3)  # a slow rank: the others must wait, not read a stale bank
            channel.gather(_payload(rank, call, layout.count), out)
            expected = np.stack([_payload(r, call, layout.count) for r in range(layout.world)])
            wrong += not np.array_equal(out, expected)
        code = 0 if wrong == 0 else 2
    finally:
        os._exit(code)


def test_every_call_gives_every_rank_every_payload(segment: Path) -> None:
    layout = Layout(world=3, count=37)
    creator = ShmAllGather(segment, layout, 0, create=True, nonce=7)
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank_main, args=(segment, layout, r, 400)) for r in (1, 2)]
    for process in ranks:
        process.start()
    out = np.empty((3, 37))
    wrong = 0
    for call in range(1, 401):
        creator.gather(_payload(0, call, 37), out)
        wrong += not np.array_equal(out, np.stack([_payload(r, call, 37) for r in range(3)]))
    for process in ranks:
        process.join(60)
    assert wrong == 0
    assert [process.exitcode for process in ranks] == [0, 0]
    assert creator.matches(7) and not creator.matches(8)
    assert creator.pids()[0] == os.getpid() and set(creator.pids()[1:]) == {p.pid for p in ranks}
    creator.unlink()  # the name goes; the mapping stays usable
    assert not segment.exists()
    creator.close()


def test_a_missing_peer_times_out_with_one_line(segment: Path) -> None:
    layout = Layout(world=2, count=4)
    channel = ShmAllGather(segment, layout, 0, create=True, policy=WaitPolicy(timeout_seconds=0.3))
    channel.watch_pids = False
    with pytest.raises(StallError, match="waited 0.3 s in the shared-memory all-gather .call 1. for rank 1"):
        channel.gather(np.zeros(4), np.empty((2, 4)))
    channel.close()


def test_a_dead_peer_is_named_before_the_timeout(segment: Path) -> None:
    layout = Layout(world=2, count=4)
    channel = ShmAllGather(segment, layout, 0, create=True,
                           policy=WaitPolicy(timeout_seconds=600, liveness_every=0.05))
    pid = os.fork()
    if pid == 0:  # rank 1 maps the segment, then dies before its first gather
        ShmAllGather(segment, layout, 1, create=False)
        os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(StallError, match=f"for rank 1, whose process .pid {pid}. has exited"):
        channel.gather(np.zeros(4), np.empty((2, 4)))
    channel.close()


def test_attach_refuses_a_segment_of_another_size(segment: Path) -> None:
    ShmAllGather(segment, Layout(world=2, count=4), 0, create=True).close()
    with pytest.raises(ConfigError, match="ranks disagree on the exchange's size"):
        ShmAllGather(segment, Layout(world=2, count=400), 1, create=False)


def test_mode_check() -> None:
    assert check_mode("shm") == "shm"
    with pytest.raises(ConfigError, match="exchange 'fast' is not one of auto, gloo, shm"):
        check_mode("fast")
