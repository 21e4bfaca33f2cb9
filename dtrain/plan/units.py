"""Unit conversions for the performance model. Inside dtrain.plan every quantity is SI (seconds, bytes,
bytes per second, FLOP per second) and carries its unit in its name; people's units (Gbit/s, microseconds,
MiB) are converted at the edges with these functions."""

from __future__ import annotations

BYTES_PER_FP32 = 4
MIB = 1024 * 1024


def gbit_per_s_to_bytes_per_s(gbit_per_s: float) -> float:
    """Network rates are quoted in decimal gigabits per second: 1 Gbit/s = 125,000,000 bytes/s."""
    return gbit_per_s * 1e9 / 8


def bytes_per_s_to_gbit_per_s(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1e9


def microseconds_to_seconds(microseconds: float) -> float:
    return microseconds * 1e-6


def mib_to_bytes(mib: float) -> int:
    """DDP's `bucket_cap_mb` is multiplied by 1024*1024 in torch, so it is really MiB."""
    return int(mib * MIB)
