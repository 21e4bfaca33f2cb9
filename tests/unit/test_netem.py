"""The benchmarks' network emulation: a shaped namespace really limits loopback throughput."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from netem import measure_loopback_gbit_per_s, shaped_namespace, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


def test_tbf_limits_the_namespace_loopback() -> None:
    with shaped_namespace("200mbit") as shaped:
        limited = measure_loopback_gbit_per_s(shaped, megabytes=12)
        name = shaped.name
    with shaped_namespace(None) as free:
        unlimited = measure_loopback_gbit_per_s(free, megabytes=12)
    assert 0.1 < limited < 0.26, limited  # 200 Mbit/s, with the token bucket's initial burst
    assert unlimited > 4 * limited
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed  # removed on exit
