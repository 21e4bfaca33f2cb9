"""The benchmarks' network emulation (needs root, `ip` and `tc`; skipped with the reason otherwise): a shaped
namespace has its own loopback, up, with a tbf qdisc at the asked rate that the namespace's traffic passes
through, and the namespace is removed on exit. Whether the rate is met is measured in benchmarks, not here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from netem import Namespace, NetemUnavailable, shaped_namespace, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

SEND_BYTES = 1 << 20
SEND = ("import socket\n"
        "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)\n"
        "out = socket.create_connection(srv.getsockname()); got, _ = srv.accept()\n"
        f"out.sendall(b'x' * {SEND_BYTES}); out.close(); n = 0\n"
        "while (chunk := got.recv(1 << 16)): n += len(chunk)\n"
        f"assert n == {SEND_BYTES}, n\n")


def _in(ns: Namespace, *argv: str) -> str:
    return ns.run(list(argv), capture_output=True, check=True).stdout  # type: ignore[no-any-return]


def _sent_bytes(ns: Namespace) -> int:
    found = re.search(r"Sent (\d+) bytes", _in(ns, "tc", "-s", "qdisc", "show", "dev", "lo"))
    assert found, "no qdisc statistics"
    return int(found.group(1))


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_shaped_namespace_sends_its_loopback_traffic_through_tbf() -> None:
    try:
        with shaped_namespace("200mbit") as shaped:
            assert _in(shaped, "ip", "netns", "identify").strip() == shaped.name  # wrapped commands run inside
            assert re.search(r"<[^>]*\bUP\b", _in(shaped, "ip", "link", "show", "lo"))  # its loopback is up
            qdisc = _in(shaped, "tc", "qdisc", "show", "dev", "lo")
            assert re.search(r"qdisc tbf \S+ root .*rate 200Mbit", qdisc), qdisc
            before = _sent_bytes(shaped)
            _in(shaped, sys.executable, "-c", SEND)
            assert _sent_bytes(shaped) - before >= SEND_BYTES  # the transfer went through the token bucket
            name = shaped.name
            assert name in _namespaces()
    except NetemUnavailable as exc:  # root, but namespaces are forbidden here (e.g. in a container)
        pytest.skip(str(exc))
    assert name not in _namespaces()  # removed on exit


def test_an_unshaped_namespace_has_no_tbf() -> None:
    try:
        with shaped_namespace(None) as free:
            assert "tbf" not in _in(free, "tc", "qdisc", "show", "dev", "lo")
            _in(free, sys.executable, "-c", SEND)  # its loopback is up and carries traffic
            assert free.describe() == "unshaped"
    except NetemUnavailable as exc:
        pytest.skip(str(exc))
