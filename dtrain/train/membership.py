"""The chief's note of who trains in this attempt (runs/membership.py holds the record): before the first batch of
every attempt the workers gather their nodes' names, and when the nodes or the world size differ from the last
entry the chief appends one, says it in one progress line and marks it in TensorBoard."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from dtrain.comm import Topology, all_gather_object
from dtrain.runs.membership import (
    NODE_NAME_ENV,
    TRAINING,
    append_membership,
    describe_change,
    membership_change,
    read_membership,
    read_restarts,
    record_restart,
)
from dtrain.train.metrics import MetricsWriter
from dtrain.train.progress import Progress


def node_name() -> str:
    """This worker's node as the launcher named it (its address and its agent's pid), else the host's name."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def note_membership(run_dir: Path, topology: Topology, step: int, metrics: MetricsWriter,
                    progress: Progress) -> dict[str, Any] | None:
    """Every rank calls this together at the start of an attempt; the entry the chief recorded, if any."""
    nodes = all_gather_object(node_name()) if topology.world_size > 1 else [node_name()]
    if not topology.is_chief:
        return None
    now = time.time()
    entry = membership_change(read_membership(run_dir), read_restarts(run_dir), step=step,
                              world_size=topology.world_size, nodes=[str(n) for n in nodes], now=now)
    record_restart(run_dir, TRAINING, now)
    if entry is None:
        return None
    append_membership(run_dir, entry)
    if entry["reason"] != "start":
        progress.note(describe_change(entry))
    metrics.scalars(step, {"membership/world_size": float(entry["world_size"]),
                           "membership/nodes": float(len(entry["nodes"]))})
    return entry
