"""The Kubernetes manifest in examples/clusters/ passes the schemas a cluster would check it against, offline: the
PyTorchJob against Kubeflow's CRD schema (vendored in tests/fixtures/kubeflow with its license and source), its pod
templates and the PersistentVolumeClaim against Kubernetes 1.33's core schemas, with unknown fields refused as
kubectl's default strict field validation refuses them; broken copies fail. And the environment the emulated
operator gives each pod (tests/root/test_kubeflow.py runs the pods with it) is the v1 operator's contract."""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from dtrain.commands.run import _node_options_from_environment, _parse_node_range
from dtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "tests" / "fixtures" / "kubeflow"
MANIFEST = REPO / "examples" / "clusters" / "pytorchjob.yaml"
CORE = "https://kubernetes.io/api/_definitions.json"


def _benchmarks_module(name: str) -> Any:
    """Import benchmarks/<name>.py without leaving benchmarks/ on sys.path (its `determined` folder would shadow
    the shim for the tests after this one)."""
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(REPO / "benchmarks"))
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


PODS = _benchmarks_module("kubeflow_pods")
operator_environment, pod_names = PODS.operator_environment, PODS.pod_names


def _strict(node: Any) -> Any:
    """The CRD schema as strict field validation reads it: an object with listed properties takes no others."""
    if isinstance(node, dict):
        node = {key: _strict(value) for key, value in node.items()}
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(value) for value in node]
    return node


def _validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    core = json.loads((SCHEMAS / "k8s-core-v1.33.json").read_text())
    registry: Registry = Registry().with_resource(CORE, Resource.from_contents(core, DRAFT202012))
    return jsonschema.Draft202012Validator(schema, registry=registry)


PYTORCHJOB = _validator(_strict(yaml.safe_load((SCHEMAS / "kubeflow.org_pytorchjobs.v1.schema.yaml").read_text())))
CORE_KINDS = {("v1", "PersistentVolumeClaim"): "io.k8s.api.core.v1.PersistentVolumeClaim"}


def problems(document: dict[str, Any]) -> list[str]:
    """Every schema error of one manifest document, as `path: message`."""
    kind = (document.get("apiVersion"), document.get("kind"))
    if kind == ("kubeflow.org/v1", "PyTorchJob"):
        validator = PYTORCHJOB
    elif kind in CORE_KINDS:
        validator = _validator({"$ref": f"{CORE}#/$defs/{CORE_KINDS[kind]}"})
    else:
        return [f"no schema here for {kind}"]
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(document)]


def documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


def test_the_manifest_passes_the_operators_and_kubernetes_schemas() -> None:
    found = documents()
    assert [d["kind"] for d in found] == ["PyTorchJob", "PersistentVolumeClaim"]
    for document in found:
        assert problems(document) == [], document["kind"]


def _broken(change: Any) -> list[str]:
    job = copy.deepcopy(documents()[0])
    change(job["spec"]["pytorchReplicaSpecs"])
    return problems(job)


def test_broken_copies_fail() -> None:
    def replicas_as_text(specs: Any) -> None:
        specs["Worker"]["replicas"] = "one"

    def container_without_a_name(specs: Any) -> None:
        del specs["Master"]["template"]["spec"]["containers"][0]["name"]

    def misspelt_command(specs: Any) -> None:
        container = specs["Worker"]["template"]["spec"]["containers"][0]
        container["comand"] = container.pop("command")

    def port_as_text(specs: Any) -> None:
        specs["Master"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "23456"

    assert any("'one' is not of type 'integer'" in p for p in _broken(replicas_as_text))
    assert any("'name' is a required property" in p for p in _broken(container_without_a_name))
    assert any("'comand' was unexpected" in p for p in _broken(misspelt_command))
    assert any("'23456' is not of type 'integer'" in p for p in _broken(port_as_text))
    claim = copy.deepcopy(documents()[1])
    claim["spec"]["accessModes"] = "ReadWriteOnce"  # a list in Kubernetes
    assert any("is not of type 'array'" in p for p in problems(claim))


def test_the_operators_environment_for_each_pod() -> None:
    job = documents()[0]
    assert pod_names(job) == [("dtrain-fashion-mnist-master-0", "Master", 0),
                              ("dtrain-fashion-mnist-worker-0", "Worker", 0)]
    common = {"PYTHONUNBUFFERED": "0", "MASTER_ADDR": "dtrain-fashion-mnist-master-0", "MASTER_PORT": "23456",
              "WORLD_SIZE": "4", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"}
    assert operator_environment(job, "Master", 0) == {**common, "RANK": "0", "PET_NODE_RANK": "0"}
    assert operator_environment(job, "Worker", 0) == {**common, "RANK": "1", "PET_NODE_RANK": "1"}
    elastic = copy.deepcopy(job)
    del elastic["spec"]["pytorchReplicaSpecs"]["Master"]
    elastic["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 2
    elastic["spec"]["elasticPolicy"] = {"minReplicas": 2, "maxReplicas": 2, "rdzvBackend": "c10d"}
    assert problems(elastic) == []
    assert operator_environment(elastic, "Worker", 1) == {
        "PYTHONUNBUFFERED": "0", "PET_NNODES": "2:2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "dtrain-fashion-mnist-worker-0:23456"}


class _Options:
    nnodes = node_rank = master_addr = master_port = rdzv_endpoint = None


def test_dtrain_run_reads_the_v1_and_the_elastic_environment() -> None:
    job = documents()[0]
    options: Any = _Options()
    _node_options_from_environment(options, operator_environment(job, "Worker", 0))
    assert (options.nnodes, options.node_rank, options.master_addr, options.master_port, options.rdzv_endpoint) == (
        2, 1, "dtrain-fashion-mnist-master-0", 23456, None)
    options = _Options()
    _node_options_from_environment(options, {"PET_NNODES": "2:2", "PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "c10d",
                                             "PET_RDZV_ENDPOINT": "job-worker-0:23456"})
    assert (options.nnodes, options.rdzv_endpoint) == (2, "job-worker-0:23456")



class _RangeOptions:
    nnodes: Any = None
    min_nodes: Any = None


def test_an_elastic_pytorchjob_runs_as_nnodes_min_max() -> None:
    """minReplicas < maxReplicas gives PET_NNODES=MIN:MAX: the same job as `dtrain run --nnodes MIN:MAX`, a node
    lost or joining changes its size (docs/clusters.md "Elastic membership"); the command line still wins."""
    environment = {"PET_NNODES": "1:3", "PET_NODE_RANK": "1", "PET_RDZV_BACKEND": "c10d",
                   "PET_RDZV_ENDPOINT": "job-worker-0:23456"}
    options: Any = _RangeOptions()
    _parse_node_range(options, environment)
    assert (options.nnodes, options.min_nodes) == (3, 1)
    full: Any = _Options()
    full.nnodes = options.nnodes
    _node_options_from_environment(full, environment)
    assert (full.nnodes, full.node_rank, full.rdzv_endpoint) == (3, 1, "job-worker-0:23456")
    given: Any = _RangeOptions()
    given.nnodes = "2"
    _parse_node_range(given, environment)
    assert (given.nnodes, given.min_nodes) == (2, None)
    fixed: Any = _RangeOptions()
    _parse_node_range(fixed, {"PET_NNODES": "2:2"})
    assert (fixed.nnodes, fixed.min_nodes) == (None, None)  # a fixed size, read with the other variables
    with pytest.raises(ConfigError, match=r"PET_NNODES='0:2' .* MIN must be >= 1"):
        _parse_node_range(_RangeOptions(), {"PET_NNODES": "0:2"})
