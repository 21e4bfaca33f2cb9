"""Nodes that come and go, for the membership test and benchmark: a "node" is one `dtrain run --nnodes MIN:MAX`
(its elastic agent) and every process under it; losing it is a SIGKILL to all of them at once, from outside, as a
machine that dies would. torch's agent starts each worker in a session of its own, so a kill of the agent's
process group would miss them: the processes are found under the agent in /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import descendants, process_parents  # noqa: E402


def node_command(config: str | Path, run_dir: Path, node_rank: int, nnodes: str, master_addr: str, port: int,
                 settings: Sequence[str] = ()) -> list[str]:
    """`dtrain run` of one node of an elastic job whose chief (node 0) hosts the rendezvous at master_addr:port."""
    args = [sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir), "--nnodes", nnodes,
            "--node-rank", str(node_rank), "--master-addr", master_addr, "--master-port", str(port)]
    for setting in settings:
        args += ["--set", setting]
    return args


def kill_node(agent_pid: int) -> list[int]:
    """SIGKILL the agent and every process under it, all found first; the pids killed."""
    victims = [agent_pid, *descendants(process_parents(), agent_pid)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return victims


def runs_rank_zero(agent_pid: int) -> bool:
    """Whether a worker of global rank 0 runs under this agent (its environment says RANK=0)."""
    for pid in descendants(process_parents(), agent_pid):
        with contextlib.suppress(OSError):
            if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return True
    return False


def uninterrupted_accuracy(config: Path, settings: Sequence[str], run_dir: Path) -> float:
    """The final validation accuracy of the same run on one machine, never interrupted: the reference."""
    subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir),
                    *[arg for setting in settings for arg in ("--set", setting)]],
                   check=True, capture_output=True, timeout=900)
    return float(json.loads((run_dir / "summary.json").read_text())["validation"]["accuracy"])


def membership(run_dir: Path) -> list[dict[str, Any]]:
    """The chief's membership record so far (runs/membership.py)."""
    path = run_dir / "membership.json"
    try:
        found = json.loads(path.read_text()) if path.is_file() else []
    except json.JSONDecodeError:  # never half written (atomic replace), but be safe
        return []
    return found if isinstance(found, list) else []


def latest_step(run_dir: Path) -> int:
    """The step of the chief's latest checkpoint (0 before the first)."""
    latest = run_dir / "checkpoints" / "latest"
    try:
        return int(latest.read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return 0


def wait_for(condition: Callable[[], bool], timeout: float, what: str,
             alive: subprocess.Popen[Any] | None = None) -> None:
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` s or when `alive` ended."""
    deadline = time.monotonic() + timeout
    while not condition():
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the chief ended (exit {alive.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
