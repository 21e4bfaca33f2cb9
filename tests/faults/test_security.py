"""Safe defaults: on one machine the rendezvous store and the workers' store listen on loopback only."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from dtrain.comm.topology import LaunchEnv, _loopback_store
from dtrain.launch import _loopback_rendezvous

LISTEN = "0A"


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.is_file():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == LISTEN:
                found.add(address)
    return found


LOOPBACK_V4 = socket.inet_aton("127.0.0.1")[::-1].hex().upper()  # /proc/net/tcp prints little-endian words


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="needs Linux /proc/net/tcp")
def test_the_agents_rendezvous_store_listens_on_loopback_only() -> None:
    keep: list[object] = []
    endpoint = _loopback_rendezvous(None, keep)
    port = int(endpoint.rsplit(":", 1)[1])
    assert endpoint.startswith("127.0.0.1:")
    assert listening_addresses(port) == {LOOPBACK_V4}
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")  # it is a working store
    assert keep[1].get("k") == b"v"  # type: ignore[attr-defined]


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="needs Linux /proc/net/tcp")
def test_the_workers_store_listens_on_loopback_only() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launch = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, launcher="torchrun",
                       master_addr="127.0.0.1", master_port=port)
    store = _loopback_store(launch, timedelta(seconds=10))
    store.set("ready", "1")
    assert listening_addresses(port) == {LOOPBACK_V4}
