"""A Kubeflow PyTorchJob's pods emulated on one machine (no Kubernetes control plane can be had here): one network
namespace per pod, named as the operator names its pods (`<job>-master-0`, `<job>-worker-0`, ...), the pod names
resolving to the pods' addresses as the job's headless service makes them (a hosts file), the pod name as the
hostname, and each container's own command run with exactly the environment the operator injects (v1: what
kubeflow/trainer's pkg/controller.v1/pytorch sets, see `operator_environment`) beside the image's own (PATH, HOME,
PYTHONPATH: here this machine's Python and checkout stand in for the image). The container's workingDir and
volumeMounts are bind-mounted in the pod's mount namespace (the checkout, and a fresh directory per volume); its
/tmp is a fresh directory too.

    with pods_of(job, tmp_path) as pods:
        for pod in pods: pod.start(extra=["--set", "searcher.max_length.batches=8"])

Needs what cluster.py needs (root, iproute2) plus nsenter/unshare.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import Node, build_network, remove_network  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 23456  # the operator's default for the port named pytorchjob-port
PORT_NAME = "pytorchjob-port"
CONTAINER_NAME = "pytorch"


def _container(job: dict[str, Any], replica_type: str) -> dict[str, Any]:
    containers = job["spec"]["pytorchReplicaSpecs"][replica_type]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == CONTAINER_NAME)


def _master_port(job: dict[str, Any]) -> int:
    ports = _container(job, "Master").get("ports") or []
    return next((int(p["containerPort"]) for p in ports if p.get("name") == PORT_NAME), DEFAULT_PORT)


def pod_names(job: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(pod name, replica type, index) of every pod, master first: `<job>-<type in lower case>-<index>`."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    order = sorted(specs, key=lambda kind: (kind != "Master", kind))
    return [(f"{job['metadata']['name']}-{kind.lower()}-{index}", kind, index)
            for kind in order for index in range(int(specs[kind].get("replicas", 1)))]


def operator_environment(job: dict[str, Any], replica_type: str, index: int) -> dict[str, str]:
    """The variables the v1 operator adds to the `pytorch` container of pod (replica_type, index): PYTHONUNBUFFERED;
    with a Master replica MASTER_ADDR (`<job>-master-0`), MASTER_PORT (the port named pytorchjob-port), WORLD_SIZE
    (all replicas x nprocPerNode), RANK (master 0, worker i -> i + 1); PET_NNODES, PET_NODE_RANK (= RANK) and
    PET_NPROC_PER_NODE (spec.nprocPerNode); with an elasticPolicy PET_NNODES as MIN:MAX, PET_RDZV_ENDPOINT
    (`<job>-worker-0:<port>`) and PET_RDZV_BACKEND (default c10d)."""
    spec, name = job["spec"], job["metadata"]["name"]
    specs = spec["pytorchReplicaSpecs"]
    replicas = sum(int(s.get("replicas", 1)) for s in specs.values())
    nproc = str(spec.get("nprocPerNode", "auto"))
    env = {"PYTHONUNBUFFERED": "0"}
    rank = index + 1 if replica_type == "Worker" and "Master" in specs else index
    if "Master" in specs:
        env.update(MASTER_ADDR=f"{name}-master-0", MASTER_PORT=str(_master_port(job)),
                   WORLD_SIZE=str(replicas * int(nproc)) if nproc.isdigit() else str(replicas), RANK=str(rank))
    env.update(PET_NNODES=str(replicas), PET_NODE_RANK=str(rank), PET_NPROC_PER_NODE=nproc)
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        low, high = elastic.get("minReplicas", replicas), elastic.get("maxReplicas", replicas)
        port = int(elastic.get("rdzvPort") or DEFAULT_PORT)
        env.update(PET_NNODES=f"{low}:{high}", PET_RDZV_BACKEND=str(elastic.get("rdzvBackend") or "c10d"),
                   PET_RDZV_ENDPOINT=f"{elastic.get('rdzvHost') or f'{name}-worker-0'}:{port}")
    return env


def image_environment() -> dict[str, str]:
    """What the image's own environment would hold: this Python's bin first on PATH, HOME, and the checkout on
    PYTHONPATH (the image's dtrain)."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": "/root",
            "PYTHONPATH": str(REPO)}


@dataclass
class Pod:
    """One emulated pod: its name, replica type and index, node (namespace), and the container it runs."""

    name: str
    replica_type: str
    index: int
    node: Node
    container: dict[str, Any]
    environment: dict[str, str]
    hosts_file: Path
    scratch: Path
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    def binds(self) -> list[tuple[Path, str]]:
        """(host directory, path in the pod): the workingDir (the checkout), each volume (a fresh directory), and
        /tmp last (the other sources may lie under this machine's /tmp)."""
        found: list[tuple[Path, str]] = []
        if self.container.get("workingDir"):
            found.append((REPO, self.container["workingDir"]))
        for mount in self.container.get("volumeMounts") or []:
            found.append((self.scratch / "volumes" / mount["name"], mount["mountPath"]))
        return [*found, (self.scratch / "tmp", "/tmp")]

    def argv(self, command: Sequence[str]) -> list[str]:
        """`command` in the pod, with exactly its environment (`env -i`) and in its working directory."""
        workdir = ["-C", self.container["workingDir"]] if self.container.get("workingDir") else []
        inside = ["env", "-i", *workdir, *(f"{k}={v}" for k, v in sorted(self.environment.items())), *command]
        return self.node.wrap_host(inside, self.name, self.hosts_file, self.binds())

    def start(self, extra: Sequence[str] = (), **kwargs: object) -> subprocess.Popen[str]:
        """The container's own command (plus `extra` arguments) in the pod."""
        command = [*self.container.get("command", []), *self.container.get("args", []), *extra]
        process = subprocess.Popen(self.argv(command), text=True, **kwargs)  # type: ignore[call-overload]
        self.processes.append(process)
        return process  # type: ignore[no-any-return]

    def path(self, inside: str) -> Path:
        """Where a path in the pod (under a volume or /tmp) lies on this machine."""
        for host, target in sorted(self.binds(), key=lambda b: -len(b[1])):
            if inside == target or inside.startswith(target.rstrip("/") + "/"):
                return host / os.path.relpath(inside, target)
        raise ValueError(f"{inside} is on no volume of pod {self.name}")


@contextmanager
def pods_of(job: dict[str, Any], scratch: Path, rate: str | None = "200mbit",
            subnet: str = "10.203.0") -> Iterator[list[Pod]]:
    """The job's pods on namespaces joined by `rate` links; everything removed on exit (the mount points this
    created on the host too)."""
    names = pod_names(job)
    network = build_network(len(names), rate, subnet=subnet, names=[n for n, _, _ in names])
    created: list[Path] = []
    pods: list[Pod] = []
    try:
        hosts = scratch / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{node.address} {name}\n" for node, (name, _, _) in zip(network.nodes, names, strict=True)))
        for node, (name, kind, index) in zip(network.nodes, names, strict=True):
            container = _container(job, kind)
            environment = {**image_environment(), **{e["name"]: e["value"] for e in container.get("env") or []},
                           **operator_environment(job, kind, index)}
            pod = Pod(name, kind, index, node, container, environment, hosts, scratch / name)
            for host, target in pod.binds():
                host.mkdir(parents=True, exist_ok=True)
                for missing in [p for p in (Path(target), *Path(target).parents) if not p.exists()][::-1]:
                    missing.mkdir()
                    created.append(missing)
            pods.append(pod)
        yield pods
    finally:
        for pod in pods:
            for process in pod.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        remove_network(network)
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()


def unavailable_reason() -> str | None:
    from cluster import unavailable_reason as namespaces_unavailable

    reason = namespaces_unavailable()
    if reason:
        return reason
    missing = [tool for tool in ("nsenter", "unshare") if shutil.which(tool) is None]
    return f"the pod emulation needs {', '.join(missing)} (util-linux)" if missing else None
