"""Kubeflow's PyTorchJob contract on one machine (benchmarks/kubeflow_pods.py; needs root, iproute2 and util-linux,
skipped with the reason otherwise; no Kubernetes control plane can be had here): the pods of
examples/clusters/pytorchjob.yaml as network namespaces named as the operator names them, each given exactly the
environment the v1 operator injects beside the image's own, running the manifest's own command (shortened through
--set): the two pods train the experiment together, the master's run dir on its volume holds the checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import ClusterUnavailable  # noqa: E402
from kubeflow_pods import image_environment, operator_environment, pods_of, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

MANIFEST = REPO / "examples" / "clusters" / "pytorchjob.yaml"
SHORTER = ["--set", "searcher.max_length={batches: 8}", "--set", "min_validation_period={batches: 8}",
           "--set", "min_checkpoint_period={batches: 4}", "--set", "distributed.timeout_seconds=120"]


def pytorchjob() -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "PyTorchJob")


def test_the_pods_train_together_with_the_operators_environment_only(tmp_path: Path) -> None:
    job = pytorchjob()
    try:
        with pods_of(job, tmp_path) as pods:
            assert [pod.name for pod in pods] == ["dtrain-fashion-mnist-master-0", "dtrain-fashion-mnist-worker-0"]
            for pod in pods:  # what a process in the pod sees: the image's variables and the operator's, no more
                seen = subprocess.run(pod.argv(["env"]), capture_output=True, text=True, check=True).stdout
                assert dict(line.split("=", 1) for line in seen.splitlines()) == {
                    **image_environment(), **operator_environment(job, pod.replica_type, pod.index)}
                hostname = subprocess.run(pod.argv(["hostname"]), capture_output=True, text=True).stdout.strip()
                assert hostname == pod.name
            logs = [(tmp_path / f"{pod.name}.out").open("w") for pod in pods]
            processes = [pod.start(SHORTER, stdout=log, stderr=subprocess.STDOUT)
                         for pod, log in zip(pods, logs, strict=True)]
            codes = [process.wait(timeout=600) for process in processes]
            outputs = [(tmp_path / f"{pod.name}.out").read_text() for pod in pods]
            assert codes == [0, 0], outputs
            master_run = pods[0].path("/runs/fashion-mnist")
            worker_run = pods[1].path("/tmp/run")
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))
    summary = json.loads((master_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4 and summary["steps_completed"] == 8
    assert (master_run / "checkpoints" / "step-8" / "model.pt").is_file()
    assert sorted(p.name for p in (worker_run / "logs").glob("rank-*.log")) == ["rank-2.log", "rank-3.log"]
    assert "dtrain: training completed: 8 batches" in outputs[0]
