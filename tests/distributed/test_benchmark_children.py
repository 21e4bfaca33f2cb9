"""A benchmark stopped with SIGTERM stops the processes it started (benchmarks/common.py): before, a killed
benchmark left its `dtrain run` children and their workers running, loading the machine the next one timed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtrain.runs.processes import process_alive

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import common  # what every benchmark imports first
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "g = subprocess.Popen(['sleep', '300']); print(g.pid, flush=True); time.sleep(300)"],
                         stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def _gone(pid: int, within: float = 60.0) -> bool:
    """The process has ended (a zombie waiting for its parent has), polled for up to `within` seconds."""
    deadline = time.monotonic() + within
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not process_alive(pid)


def test_a_terminated_benchmark_takes_its_children_and_grandchildren_with_it() -> None:
    benchmark = subprocess.Popen([sys.executable, "-c", BENCHMARK, str(REPO / "benchmarks")],
                                 stdout=subprocess.PIPE, text=True)
    started = [int(pid) for pid in benchmark.stdout.readline().split()]  # type: ignore[union-attr]
    try:
        child, grandchild = started
        benchmark.send_signal(signal.SIGTERM)
        assert benchmark.wait(timeout=60) == 128 + signal.SIGTERM
        assert _gone(child) and _gone(grandchild)
    finally:
        for pid in [benchmark.pid, *started]:  # nothing left behind when the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
