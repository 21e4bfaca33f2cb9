"""The membership record of a run whose nodes come and go (`dtrain run --nnodes MIN:MAX`): which nodes trained from
which batch, why the set changed, and how long the job stood still.

Two files in the run dir. Each node's launcher appends to `logs/restarts.jsonl` the instant its elastic agent
restarts the workers and why (`failure`: a worker failed, e.g. a peer on a lost node is gone; `nodes_waiting`: a
node asks to join), and the chief worker the instant each attempt starts training (`training`). Before its first
batch the chief worker of every attempt compares the nodes that met with the last entry of `membership.json`;
when they differ it appends an entry: the batch it trains from, the world size, the nodes, the reason (`start`,
`node lost`, `node joined`, `nodes changed`, or `resumed` for a new `dtrain run` at another size), and the seconds
from the first restart since an attempt last trained (the loss or the join, as the agent saw it) to this moment.
`summary.json` copies the list as `membership`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

MEMBERSHIP_FILE = "membership.json"
RESTARTS_FILE = "logs/restarts.jsonl"
TRAINING = "training"  # the cause of a line the chief worker writes when an attempt starts training
NODE_NAME_ENV = "DTRAIN_NODE_NAME"  # set by the launcher: this node's address and its agent's pid
NODE_RANGE_ENV = "DTRAIN_NODE_RANGE"  # set by the launcher under --nnodes MIN:MAX: "MIN:MAX"


def record_restart(run_dir: Path, cause: str, at: float | None = None) -> None:
    """Append that this node's agent restarts its workers now (epoch seconds), because of `cause` (`failure` or
    `nodes_waiting`), or that an attempt starts training (`TRAINING`)."""
    path = run_dir / RESTARTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps({"cause": cause, "at": time.time() if at is None else at}) + "\n")


def read_restarts(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / RESTARTS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill of the launcher
            continue
    return rows


def read_membership(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / MEMBERSHIP_FILE
    if not path.is_file():
        return []
    found = json.loads(path.read_text())
    return found if isinstance(found, list) else []


def membership_change(previous: list[dict[str, Any]], restarts: list[dict[str, Any]], *, step: int, world_size: int,
                      nodes: list[str], now: float) -> dict[str, Any] | None:
    """The entry for an attempt that trains from batch `step` on `nodes` with `world_size` workers, or None when the
    nodes and size are the last entry's (a restart at the same membership is counted in `restarts`, not here)."""
    nodes = sorted(set(nodes))
    last = previous[-1] if previous else None
    if last is not None and last["world_size"] == world_size and last["nodes"] == nodes:
        return None
    entry: dict[str, Any] = {"step": step, "world_size": world_size, "nodes": nodes, "reason": "start",
                             "lost": [], "joined": [], "seconds": None, "at": round(now, 3)}
    if last is None:
        return entry
    entry["lost"] = sorted(set(last["nodes"]) - set(nodes))
    entry["joined"] = sorted(set(nodes) - set(last["nodes"]))
    trained = [float(r["at"]) for r in restarts if r.get("cause") == TRAINING]
    began = max([float(last["at"]), *trained])
    since = [r for r in restarts if r.get("cause") != TRAINING and float(r.get("at", 0)) > began]
    if not since:  # no agent restarted: a new `dtrain run` of the same run dir at another size
        entry["reason"] = "resumed"
        return entry
    entry["reason"] = ("nodes changed" if entry["lost"] and entry["joined"] else
                       "node lost" if entry["lost"] else "node joined" if entry["joined"] else "nodes changed")
    entry["seconds"] = round(now - min(float(r["at"]) for r in since), 2)
    return entry


def append_membership(run_dir: Path, entry: dict[str, Any]) -> None:
    """Add `entry` to `membership.json` (written whole, atomically: a kill leaves the old or the new list)."""
    entries = [*read_membership(run_dir), entry]
    tmp = run_dir / f".{MEMBERSHIP_FILE}.tmp"
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    tmp.replace(run_dir / MEMBERSHIP_FILE)


def describe_change(entry: dict[str, Any]) -> str:
    """One line for the progress output: `membership: node lost (10.0.0.2:411); 1 node(s), 2 worker(s) from batch
    40, training again 12.3 s after the restart`."""
    who = ", ".join([*(f"-{n}" for n in entry["lost"]), *(f"+{n}" for n in entry["joined"])])
    seconds = entry.get("seconds")
    after = f", training again {seconds:.1f} s after the agents restarted" if seconds is not None else ""
    return (f"membership: {entry['reason']}{f' ({who})' if who else ''}; {len(entry['nodes'])} node(s), "
            f"{entry['world_size']} worker(s) from batch {entry['step']}{after}")
