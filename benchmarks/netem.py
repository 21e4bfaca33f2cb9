"""Network emulation for benchmarks: run workers inside a network namespace whose loopback is rate-limited.

    with shaped_namespace("1gbit") as ns:
        subprocess.run(ns.wrap(["dtrain", "run", "exp.yaml"]))

The namespace gets its own loopback with a `tbf` qdisc (token bucket) at the given rate; every process
started through `ns.wrap(...)` talks to the others over that loopback, so gloo traffic between workers
crosses the shaped queue. (This kernel has no `netem`, so delay cannot be added; tbf's queue adds
latency only when the link is busy.) Note that a loopback has one queue: all traffic in the namespace,
both directions included, shares `rate`, unlike a full-duplex Ethernet link that carries `rate` each way.

Creating a namespace needs root and iproute2 (`ip`, `tc`); `unavailable_reason()` says why it cannot run,
so that a benchmark can skip cleanly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


class NetemUnavailable(RuntimeError):
    """Network emulation cannot run here (not root, no iproute2, or namespaces are forbidden)."""


def unavailable_reason() -> str | None:
    """None when shaped namespaces can be created; otherwise why not, in one line."""
    if os.geteuid() != 0:
        return "network emulation needs root (ip netns and tc); run the benchmark as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network emulation needs `{tool}` from iproute2 (apt-get install iproute2)"
    return None


@dataclass(frozen=True)
class Namespace:
    """A network namespace with a shaped loopback; `rate` is None for an unshaped one."""

    name: str
    rate: str | None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.wrap(argv), text=True, **kwargs)  # type: ignore[call-overload, no-any-return]

    def describe(self) -> str:
        return f"tbf {self.rate} on the loopback of network namespace {self.name}" if self.rate else "unshaped"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NetemUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


@contextmanager
def shaped_namespace(rate: str | None, *, burst: str = "512kb", latency: str = "200ms",
                     name: str | None = None) -> Iterator[Namespace]:
    """Create a namespace with loopback up and (if `rate`, e.g. '1gbit') a tbf qdisc; remove it afterwards."""
    reason = unavailable_reason()
    if reason:
        raise NetemUnavailable(reason)
    ns = Namespace(name=name or f"dtrain-{uuid.uuid4().hex[:8]}", rate=rate)
    _ip("netns", "add", ns.name)
    try:
        _ip("netns", "exec", ns.name, "ip", "link", "set", "lo", "up")
        if rate:
            result = subprocess.run(["ip", "netns", "exec", ns.name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                                     "rate", rate, "burst", burst, "latency", latency], capture_output=True, text=True)
            if result.returncode != 0:
                raise NetemUnavailable(f"tc cannot shape the loopback: {result.stderr.strip()}")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)


def measure_loopback_gbit_per_s(ns: Namespace, megabytes: int = 64) -> float:
    """Send `megabytes` over the namespace's loopback with plain TCP and return the achieved Gbit/s."""
    script = (
        "import socket,threading,time\n"
        "srv=socket.socket();srv.bind(('127.0.0.1',0));srv.listen(1);port=srv.getsockname()[1]\n"
        f"size={megabytes}*1024*1024\n"
        "def sink():\n"
        "    c,_=srv.accept();n=0\n"
        "    while n<size:\n"
        "        b=c.recv(1<<20)\n"
        "        if not b: break\n"
        "        n+=len(b)\n"
        "t=threading.Thread(target=sink);t.start()\n"
        "s=socket.create_connection(('127.0.0.1',port));chunk=b'x'*(1<<20);t0=time.perf_counter()\n"
        f"for _ in range({megabytes}): s.sendall(chunk)\n"
        "s.close();t.join();print(size*8/(time.perf_counter()-t0)/1e9)\n")
    result = ns.run(["python3", "-c", script], capture_output=True, check=True)
    return float(result.stdout.strip())


__all__ = ["Namespace", "NetemUnavailable", "measure_loopback_gbit_per_s", "shaped_namespace", "unavailable_reason"]
