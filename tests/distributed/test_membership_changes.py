"""Membership changes while running, on one host: two `dtrain run --nnodes 1:2` processes on loopback are two
"nodes" (benchmarks/nodes.py). Node 0 starts alone, node 1 joins and the job grows to 2 workers at the next restart
boundary, then every process of node 1 is SIGKILLed and node 0 goes on alone to the end; `membership.json`,
`summary.json`, the progress line and TensorBoard say each change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from nodes import kill_node, latest_step, membership, node_command, wait_for  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "digits.yaml"
BATCHES = 1500  # long enough that node 1 starts (torch imports, rendezvous) before node 0 ends, under load too
SETTINGS = [f"searcher.max_length.batches={BATCHES}", "min_checkpoint_period.batches=10",
            "min_validation_period.batches=100", "max_restarts=5", "distributed.timeout_seconds=60"]


@pytest.mark.slow
def test_a_node_joins_then_is_lost_and_the_run_completes_alone(tmp_path: Path) -> None:
    port = free_port()
    chief_dir, other_dir = tmp_path / "node0", tmp_path / "node1"
    chief_out = (tmp_path / "node0.out").open("w")
    chief = subprocess.Popen(node_command(CONFIG, chief_dir, 0, "1:2", "127.0.0.1", port, SETTINGS),
                             stdout=chief_out, stderr=subprocess.STDOUT)
    other: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: len(membership(chief_dir)) == 1, 300, "node 0 training alone", chief)
        other = subprocess.Popen(node_command(CONFIG, other_dir, 1, "1:2", "127.0.0.1", port, SETTINGS),
                                 stdout=(tmp_path / "node1.out").open("w"), stderr=subprocess.STDOUT)
        wait_for(lambda: len(membership(chief_dir)) == 2, 300, "node 1 taken in", chief)
        joined_at = membership(chief_dir)[1]["step"]
        wait_for(lambda: latest_step(chief_dir) >= joined_at + 20, 300, "20 batches on two nodes", chief)
        kill_node(other.pid)
        other.wait(timeout=60)
        code = chief.wait(timeout=600)
    finally:
        for process in (chief, other):
            if process is not None and process.poll() is None:
                kill_node(process.pid)
    output = (tmp_path / "node0.out").read_text()
    assert code == 0, output[-3000:]
    record = membership(chief_dir)
    assert [(e["reason"], e["world_size"], len(e["nodes"])) for e in record] == [
        ("start", 1, 1), ("node joined", 2, 2), ("node lost", 1, 1)], record
    grown, shrunk = record[1], record[2]
    assert grown["joined"] == shrunk["lost"] and shrunk["nodes"] == record[0]["nodes"]
    assert 0 < grown["step"] < shrunk["step"] < BATCHES
    assert grown["seconds"] >= 0 and shrunk["seconds"] >= 0
    summary = json.loads((chief_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == BATCHES
    assert summary["membership"] == record and summary["world_size"] == 1
    assert f"membership: node joined (+{grown['joined'][0]}); 2 node(s), 2 worker(s) from batch {grown['step']}" \
        in output
    assert f"membership: node lost (-{shrunk['lost'][0]}); 1 node(s), 1 worker(s) from batch {shrunk['step']}" \
        in output
    assert f"SIGTERM: stopped after batch {grown['step']} with a checkpoint (under --nnodes 1:2 the agents also stop" \
        in output  # the join's restart boundary: a checkpoint at the batch the workers were on, nothing redone
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(chief_dir / "tensorboard"))
    events.Reload()
    marks = [(e.step, e.value) for e in events.Scalars("membership/world_size")]
    assert marks == [(0, 1.0), (grown["step"], 2.0), (shrunk["step"], 1.0)]
