"""The two-node cluster emulated on one machine (benchmarks/cluster.py; needs root, `ip` and `tc`, skipped with the
reason otherwise): 2 network namespaces x 2 workers, joined by a veth link capped at 200 Mbit/s. A run whose worker
on the second node is killed restarts on both nodes together (the c10d rendezvous of dtrain.comm.rendezvous) from
its checkpoint and ends bitwise identical to an uninterrupted run; a node given an interface that cannot reach the
master fails with one line naming both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cluster import Cluster, ClusterUnavailable, emulated_cluster, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "digits.yaml"
SETTINGS = ["--set", "resources.slots_per_trial=4", "--set", "searcher.max_length.batches=8",
            "--set", "min_checkpoint_period.batches=3", "--set", "min_validation_period.batches=8",
            "--set", "distributed.timeout_seconds=60", "--set", "max_restarts=4"]


def run_job(cluster: Cluster, run_dir: Path, port: int, *extra: str) -> list[str]:
    """Both nodes' `dtrain run` to the end, each with a run dir of its own (as on machines that share no disk;
    the chief's holds the checkpoints); their outputs (stdout and stderr), node 0 first."""
    logs = [run_dir / f"node{i}.out" for i in range(2)]
    run_dir.mkdir()
    processes = [cluster.start(i, cluster.dtrain_run(i, CONFIG, run_dir / f"node{i}", port, [*SETTINGS, *extra]),
                               stdout=logs[i].open("w"), stderr=subprocess.STDOUT) for i in range(2)]
    codes = [process.wait(timeout=600) for process in processes]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    return outputs


def test_a_killed_worker_restarts_and_the_run_ends_bitwise_identical(tmp_path: Path) -> None:
    try:
        with emulated_cluster(nodes=2, rate="200mbit") as cluster:
            run_job(cluster, tmp_path / "whole", 29411)
            outputs = run_job(cluster, tmp_path / "killed", 29412, "--set", "faults.kills=[{rank: 3, batch: 5}]")
    except ClusterUnavailable as exc:  # root, but namespaces are forbidden here (e.g. in a container)
        pytest.skip(str(exc))
    kills = (tmp_path / "killed" / "node1" / "logs" / "faults.jsonl").read_text()
    assert '"rank": 3' in kills and '"batch": 5' in kills  # rank 3, on node 1, did die
    assert "resuming at batch 3" in outputs[0]  # ... and both nodes restarted from the checkpoint at batch 3
    whole = torch.load(tmp_path / "whole" / "node0" / "checkpoints" / "step-8" / "model.pt", weights_only=True)
    killed = torch.load(tmp_path / "killed" / "node0" / "checkpoints" / "step-8" / "model.pt", weights_only=True)
    assert whole.keys() == killed.keys()
    for key in whole:
        assert torch.equal(whole[key], killed[key]), key


def test_a_wrong_interface_is_one_line_naming_it_and_the_master(tmp_path: Path) -> None:
    try:
        with emulated_cluster(nodes=2, rate=None) as cluster:
            log = tmp_path / "node1.out"
            chief = cluster.start(0, cluster.dtrain_run(0, CONFIG, tmp_path / "node0", 29413, SETTINGS),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            node = cluster.start(1, cluster.dtrain_run(1, CONFIG, tmp_path / "node1", 29413,
                                                       [*SETTINGS, "--set", "max_restarts=0",
                                                        "--network-interface", "lo"]),
                                 stdout=log.open("w"), stderr=subprocess.STDOUT)
            code = node.wait(timeout=300)
            chief.kill()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    errors = [line for line in log.read_text().splitlines() if line.startswith("dtrain: error:")]
    assert code == 2 and len(errors) == 1, log.read_text()
    assert "network interface lo (127.0.0.1) cannot reach the master 10.77.0.1:" in errors[0]
    assert "the route to it goes through dtv" in errors[0]


def test_hsdp_across_two_nodes_equals_one_process(tmp_path: Path) -> None:
    """Strategy hsdp on 2 nodes x 2 workers (each node's pair shards one replica, the nodes are replicas) trains,
    in float64, the weights one process trains on the whole batch, within 1e-9. The nodes share no disk, so each
    holds its own ranks' shards: they are put together, as a copy to one machine would, and `dtrain export` joins
    them."""
    import shutil

    from dtrain.commands.export import export_model

    hsdp = ["--set", "distributed.strategy=hsdp", "--set", "hyperparameters.float64=true"]
    try:
        with emulated_cluster(nodes=2, rate="200mbit") as cluster:
            outputs = run_job(cluster, tmp_path / "hsdp", 29414, *hsdp)
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    assert "hsdp, 2 shards x 2 replica(s)" in outputs[0]
    shards = [tmp_path / "hsdp" / f"node{i}" / "checkpoints" / "sharded" / "step-8" for i in range(2)]
    for shard in shards[1].glob("*.distcp"):  # ranks 2 and 3 wrote theirs on node 1
        shutil.copy(shard, shards[0] / shard.name)
    export_model(tmp_path / "hsdp" / "node0", tmp_path / "hsdp.pt")
    trained = torch.load(tmp_path / "hsdp.pt", weights_only=True)
    one = tmp_path / "one"
    single = [arg.replace("slots_per_trial=4", "slots_per_trial=1") for arg in SETTINGS]
    subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--run-dir", str(one), *single,
                    "--set", "hyperparameters.float64=true"], check=True, capture_output=True, timeout=600)
    reference = torch.load(one / "checkpoints" / "step-8" / "model.pt", weights_only=True)
    assert trained.keys() == reference.keys()
    for key in reference:
        scale = float(reference[key].abs().max())
        assert float((trained[key] - reference[key]).abs().max()) <= 1e-9 * scale, key
