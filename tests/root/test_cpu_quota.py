"""The benchmarks' real straggler (needs root and the cgroup v1 cpu controller; skipped with the reason
otherwise): a worker process of the chosen rank is moved into a cgroup with the asked CFS quota, other ranks
stay where they are, and the group is gone afterwards. How much slower it runs is measured in benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_quota import CPU_CONTROLLER, share_for_slowdown, slowed_rank, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass\n"


def _fake_worker(rank: int) -> subprocess.Popen[bytes]:
    """A process that looks like a dtrain worker of `rank` to the watcher: its command line and RANK."""
    return subprocess.Popen([sys.executable, "-c", SPIN, "dtrain.worker"], env={**os.environ, "RANK": str(rank)})


def test_only_the_slowed_rank_moves_into_the_quota_group() -> None:
    name = f"dtrain-test-slow-{os.getpid()}"
    slow, other = _fake_worker(2), _fake_worker(1)
    try:
        with slowed_rank(2, 0.25, name=name) as moved:
            group = CPU_CONTROLLER / name
            deadline = time.monotonic() + 10
            while slow.pid not in moved and time.monotonic() < deadline:
                time.sleep(0.05)
            assert moved == [slow.pid]
            assert (group / "cpu.cfs_quota_us").read_text().strip() == "25000"
            assert str(slow.pid) in (group / "cgroup.procs").read_text().split()
            assert str(other.pid) not in (group / "cgroup.procs").read_text().split()
        assert not (CPU_CONTROLLER / name).exists()
    finally:
        for process in (slow, other):
            process.kill()
            process.wait()


def test_share_for_a_threefold_slowdown_on_two_cores() -> None:
    quota = share_for_slowdown(3, 3, 2)
    assert quota == pytest.approx(2 / 7)
    assert (2 - quota) / 2 == pytest.approx(3 * quota)
