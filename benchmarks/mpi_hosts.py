"""Hosts for Open MPI's `mpirun` on one machine: each host a network namespace of `cluster.py` with its own address
on a bridge, its own hostname and a hosts file naming every host (`Node.wrap_host`), and a remote-launch agent
standing in for ssh: Open MPI runs `<agent> <host> <orted command line>` for each remote host, and the agent
(a generated shell script) runs that command line with `sh -c` inside the named host's namespaces, as sshd would
run it in the remote user's shell. The hosts share this machine's file system, as hosts sharing an NFS home do.

    with mpi_hosts(scratch) as hosts:
        subprocess.run(hosts.argv(0, ["mpirun", "-np", "2", "-H", "mhhost1:1,mhhost2:1", ...]),
                       env={**os.environ, **hosts.environment()})

`mpirun` runs on the first host, as a user runs it on one of their hosts; the agent is passed by Open MPI's
variables (`OMPI_MCA_plm_rsh_agent`, and `OMPI_MCA_oob_tcp_if_include` for the subnet its daemons call back on).
Needs what cluster.py needs (root, iproute2) plus nsenter/unshare and Open MPI's mpirun.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import Network, build_network, remove_network  # noqa: E402

DEFAULT_SUBNET = "10.211.0"


@dataclass(frozen=True)
class MpiHosts:
    """The emulated hosts: their names (as in the hosts file and -H), the network under them, and the agent."""

    names: list[str]
    network: Network
    hosts_file: Path
    agent: Path
    agent_log: Path
    subnet: str

    def argv(self, host: int, command: Sequence[str]) -> list[str]:
        """`command` run on host `host` (its namespaces, hostname and hosts file)."""
        return self.network.nodes[host].wrap_host(command, self.names[host], self.hosts_file)

    def environment(self) -> dict[str, str]:
        """Open MPI's settings for these hosts: the agent instead of ssh, and the out-of-band channel of its
        daemons kept to the hosts' subnet."""
        return {"OMPI_MCA_plm_rsh_agent": str(self.agent), "OMPI_MCA_oob_tcp_if_include": f"{self.subnet}.0/24"}

    def launched_on(self) -> list[str]:
        """The hosts the agent has started Open MPI's daemon on, in order."""
        return self.agent_log.read_text().split() if self.agent_log.exists() else []


def write_agent(path: Path, hosts: MpiHosts) -> None:
    """The remote-launch agent: `agent HOST COMMAND...` runs `sh -c "COMMAND..."` on HOST (by its name or address)
    and notes HOST in the agent log."""
    lines = ["#!/bin/sh", "# mpirun's remote shell on the emulated hosts (benchmarks/mpi_hosts.py)", 'host=$1',
             "shift", f'printf "%s\\n" "$host" >> {shlex.quote(str(hosts.agent_log))}', 'case "$host" in']
    for index, (name, node) in enumerate(zip(hosts.names, hosts.network.nodes, strict=True)):
        entry = shlex.join(hosts.argv(index, []))  # ends with `--`: the command follows
        lines.append(f'  {shlex.quote(name)}|{node.address}) exec {entry} sh -c "$*" ;;')
    lines += ['  *) echo "mpi_hosts agent: no host $host here" >&2; exit 255 ;;', "esac", ""]
    path.write_text("\n".join(lines))
    path.chmod(0o755)


@contextmanager
def mpi_hosts(scratch: Path, count: int = 2, *, subnet: str = DEFAULT_SUBNET,
              rate: str | None = None) -> Iterator[MpiHosts]:
    """`count` hosts named mhhost1, mhhost2, ... on namespaces `mh<tag><i>`, joined by a bridge on `subnet`
    (the root namespace has `<subnet>.254` on it); everything in them is killed and removed on exit."""
    tag = uuid.uuid4().hex[:4]
    network = build_network(count, rate, subnet=subnet, names=[f"mh{tag}{i}" for i in range(count)],
                            bridge_address=f"{subnet}.254")
    try:
        names = [f"mhhost{i + 1}" for i in range(count)]
        hosts_file = scratch / "hosts"
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{node.address} {name}\n" for node, name in zip(network.nodes, names, strict=True)))
        hosts = MpiHosts(names, network, hosts_file, scratch / "mpi-agent", scratch / "mpi-agent.log", subnet)
        write_agent(hosts.agent, hosts)
        yield hosts
    finally:
        remove_network(network)  # kills mpirun, its daemons and the ranks: all run in the namespaces


def open_mpi_version() -> str | None:
    """The version line of the Open MPI `mpirun` on PATH, or None when there is none (or it is MPICH's)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    shown = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    return shown.splitlines()[0] if "Open MPI" in shown else None


def unavailable_reason() -> str | None:
    from cluster import unavailable_reason as namespaces_unavailable

    reason = namespaces_unavailable()
    if reason:
        return reason
    missing = [tool for tool in ("nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"the emulated hosts need {', '.join(missing)} (util-linux)"
    if open_mpi_version() is None:
        return ("no Open MPI mpirun on PATH (make setup installs Debian's openmpi-bin as root); the emulated hosts "
                "stand in for ssh through Open MPI's plm_rsh_agent")
    return None
