"""Whether a process on this host still runs (without torch, so that the command line can use it): a search's
orphaned trials, the shared-memory exchange's dead peers."""

from __future__ import annotations

import os
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
