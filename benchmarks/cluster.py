"""A cluster of "nodes" on one machine: each node a network namespace with its own loopback and one Ethernet-like
link to the others, capped by a token bucket, so that traffic between nodes crosses a slow link while traffic
inside a node stays on its fast loopback.

    with emulated_cluster(nodes=2, rate="200mbit") as cluster:
        procs = [cluster.start(i, cluster.dtrain_run(i, "exp.yaml", run_dir, port)) for i in range(2)]

Two nodes are joined by a veth pair; more than two by a bridge in the root namespace with one veth per node. Each
link end gets a `tbf` qdisc at `rate` (per direction, as full-duplex Ethernet). The kernel here has no `netem`, so
latency cannot be added on the link; dtrain's fault injection is the place for that. Every node then runs
`dtrain run --nnodes N --node-rank i --master-addr <node 0's address>` inside its namespace, and the workers find
their interface from the route to the master (dtrain.comm.topology.choose_interface).

Needs root and iproute2 (`ip`, `tc`): `unavailable_reason()` says why not, so tests and benchmarks skip cleanly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.runs.processes import process_alive


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built here (not root, no iproute2, or namespaces are forbidden)."""


def unavailable_reason() -> str | None:
    """None when namespaces, veth links and tbf can be set up; otherwise why not, in one line."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (ip netns, veth, tc); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs `{tool}` from iproute2 (apt-get install iproute2)"
    return None


def _run(*argv: str) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class Node:
    """One emulated machine: its namespace, its link's name inside it and its address on that link."""

    namespace: str
    interface: str
    address: str

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` on this node."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def wrap_host(self, argv: Sequence[str], hostname: str, hosts_file: str | Path,
                  binds: Sequence[tuple[str | Path, str | Path]] = ()) -> list[str]:
        """The command line that runs `argv` on this node as a machine named `hostname` that resolves names
        through `hosts_file`: in the node's network namespace (entered with nsenter, which leaves /sys alone,
        unlike `ip netns exec`) and a mount and UTS namespace of its own, where the hosts file is bind-mounted
        over /etc/hosts, each (source, target) of `binds` over its existing target, and the hostname set.
        Everything the command starts inherits them."""
        script = ('mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 || exit 1\n'
                  'while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 1; shift 2; done\nshift\nexec "$@"')
        pairs = [str(path) for pair in binds for path in pair]
        return ["nsenter", f"--net=/run/netns/{self.namespace}", "unshare", "--mount", "--uts", "sh", "-c", script,
                "sh", str(hosts_file), hostname, *pairs, "--", *argv]


@dataclass
class Network:
    """Namespaces and links built by `build_network`: enough to remove them again, from this process or another
    (`to_json` / `from_json`)."""

    nodes: list[Node]
    rate: str | None
    links: list[str] = field(default_factory=list)  # root-namespace ends to delete
    bridge: str | None = None
    bridge_address: str | None = None  # the root namespace's own address on the bridge, if it has one

    def to_json(self) -> dict[str, object]:
        return {"nodes": [vars(node) for node in self.nodes], "rate": self.rate, "links": self.links,
                "bridge": self.bridge, "bridge_address": self.bridge_address}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Network:
        return cls([Node(**node) for node in data["nodes"]], data["rate"], list(data["links"]), data["bridge"],
                   data.get("bridge_address"))


@dataclass
class Cluster:
    """The nodes, the rate of each node's link (None: uncapped), and the processes started on them."""

    nodes: list[Node]
    rate: str | None
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def master(self) -> Node:
        return self.nodes[0]

    def dtrain_run(self, node_rank: int, config: str | Path, run_dir: str | Path, port: int,
                   extra: Sequence[str] = ()) -> list[str]:
        """`dtrain run` of node `node_rank`, with the chief's address on the link as the master address."""
        return [sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir), "--nnodes",
                str(len(self.nodes)), "--node-rank", str(node_rank), "--master-addr", self.master.address,
                "--master-port", str(port), *extra]

    def start(self, node_rank: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start `argv` on a node (output to the caller's files or pipes, as `kwargs` say)."""
        process = subprocess.Popen(self.nodes[node_rank].wrap(argv), text=True, **kwargs)  # type: ignore[call-overload]
        self.processes.append(process)
        return process  # type: ignore[no-any-return]

    def train(self, config: str | Path, settings: Sequence[str], run_dir: Path, port: int) -> dict[str, Any]:
        """One `dtrain run` of `config` with `settings` (`--set` values) on every node to the end, each node's
        output in `run_dir/node<i>.out` and its run dir in `run_dir/node<i>`; node 0's summary."""
        import json

        run_dir.mkdir(parents=True)
        args = [arg for setting in settings for arg in ("--set", setting)]
        logs = [(run_dir / f"node{i}.out").open("w") for i in range(len(self.nodes))]
        processes = [self.start(i, self.dtrain_run(i, config, run_dir / f"node{i}", port, args),
                                stdout=log, stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
        codes = [p.wait(timeout=3600) for p in processes]
        if any(codes):
            raise RuntimeError(f"cluster run failed {codes}: {(run_dir / 'node0.out').read_text()[-1500:]}")
        summary: dict[str, Any] = json.loads((run_dir / "node0" / "summary.json").read_text())
        return summary

    def run(self, node_rank: int, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.nodes[node_rank].wrap(argv), text=True, **kwargs)  # type: ignore[call-overload, no-any-return]

    def describe(self) -> str:
        link = f"tbf {self.rate} per direction" if self.rate else "uncapped"
        return f"{len(self.nodes)} network namespaces, links {link}, addresses " + ", ".join(
            n.address for n in self.nodes)


def _shape(namespace: str | None, device: str, rate: str, burst: str, latency: str) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", burst, "latency", latency)


def build_network(nodes: int, rate: str | None, *, subnet: str = "10.77.0", burst: str = "256kbit",
                  latency: str = "50ms", names: Sequence[str] | None = None, first_host: int = 1,
                  bridge_address: str | None = None) -> Network:
    """Create `nodes` namespaces (named `names`, or dtn<tag><i>) joined by links capped at `rate`; node i gets
    `<subnet>.<first_host + i>`. Two nodes are joined by a veth pair, unless the root namespace joins them too
    (`bridge_address`, its own address on a bridge, e.g. for a controller that runs there); more by a bridge.
    On a failure half way, what was built is removed and ClusterUnavailable raised."""
    reason = unavailable_reason()
    if reason:
        raise ClusterUnavailable(reason)
    if not 2 <= nodes <= 200:
        raise ValueError(f"nodes must be in 2..200, got {nodes}")
    tag = uuid.uuid4().hex[:6]
    use_bridge = nodes > 2 or bridge_address is not None
    network = Network([], rate, bridge=f"dtb{tag}" if use_bridge else None, bridge_address=bridge_address)
    try:
        if network.bridge:
            _run("ip", "link", "add", network.bridge, "type", "bridge")
            network.links.append(network.bridge)
            if bridge_address:
                _run("ip", "addr", "add", f"{bridge_address}/24", "dev", network.bridge)
            _run("ip", "link", "set", network.bridge, "up")
        for index in range(nodes):
            namespace = names[index] if names else f"dtn{tag}{index}"
            inner, outer = f"dtv{tag}{index}", f"dto{tag}{index}"
            _run("ip", "netns", "add", namespace)
            network.nodes.append(Node(namespace, inner, f"{subnet}.{first_host + index}"))
            if network.bridge or index == 0:
                peer = outer if network.bridge else f"dtv{tag}1"
                _run("ip", "link", "add", inner, "type", "veth", "peer", "name", peer)
                network.links.append(inner)
                _run("ip", "link", "set", inner, "netns", namespace)
                if network.bridge:
                    _run("ip", "link", "set", outer, "master", network.bridge)
                    _run("ip", "link", "set", outer, "up")
            else:  # the second end of the pair
                _run("ip", "link", "set", inner, "netns", namespace)
        for node in network.nodes:
            inside = ["ip", "netns", "exec", node.namespace]
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "addr", "add", f"{node.address}/24", "dev", node.interface)
            _run(*inside, "ip", "link", "set", node.interface, "up")
            if rate:
                _shape(node.namespace, node.interface, rate, burst, latency)
    except BaseException:
        remove_network(network)
        raise
    return network


def remove_network(network: Network) -> None:
    """Kill every process left in the namespaces, then delete the namespaces, links and bridge; what is already
    gone is skipped, so that removing twice is harmless."""
    for node in network.nodes:  # torch's agent starts each worker in a session of its own
        _kill_everything_in(node.namespace)
        subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True)
    for link in network.links:
        subprocess.run(["ip", "link", "del", link], capture_output=True)


@contextmanager
def emulated_cluster(nodes: int = 2, rate: str | None = "200mbit", *, subnet: str = "10.77.0",
                     burst: str = "256kbit", latency: str = "50ms",
                     names: Sequence[str] | None = None) -> Iterator[Cluster]:
    """Create `nodes` namespaces (named `names`, else dtn<tag><i>) joined by links capped at `rate`; remove
    everything on exit."""
    network = build_network(nodes, rate, subnet=subnet, burst=burst, latency=latency, names=names)
    cluster = Cluster(network.nodes, rate)
    try:
        yield cluster
    finally:
        for process in cluster.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        remove_network(network)


def _kill_everything_in(namespace: str) -> None:
    """SIGKILL every process still in `namespace` (workers orphaned by a killed agent would otherwise live on
    until their rendezvous times out), and wait until they are gone."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    pids = [int(pid) for pid in listed if pid.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if process_alive(pid)]
        time.sleep(0.05)


def measure_link_mbit_per_s(cluster: Cluster, megabytes: int = 8) -> float:
    """Send `megabytes` from node 1 to node 0 over the link with plain TCP; the achieved Mbit/s."""
    server = ("import socket,sys\n"
              f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{cluster.master.address}',29999));s.listen(1);print('ready',flush=True)\n"
              "c,_=s.accept();n=0\n"
              "while (b:=c.recv(1<<20)): n+=len(b)\n")
    client = ("import socket,time\n"
              f"s=socket.create_connection(('{cluster.master.address}',29999));chunk=b'x'*(1<<20)\n"
              f"t=time.perf_counter()\nfor _ in range({megabytes}): s.sendall(chunk)\n"
              f"s.shutdown(socket.SHUT_WR);s.recv(1);print({megabytes}*8*1.048576/(time.perf_counter()-t))\n")
    sink = cluster.start(0, [sys.executable, "-c", server], stdout=subprocess.PIPE)
    assert sink.stdout is not None
    sink.stdout.readline()
    result = cluster.run(1, [sys.executable, "-c", client], capture_output=True, check=True)
    sink.wait(timeout=60)
    return float(result.stdout.strip())


__all__ = ["Cluster", "ClusterUnavailable", "Network", "Node", "build_network", "emulated_cluster",
           "measure_link_mbit_per_s", "remove_network", "unavailable_reason"]
