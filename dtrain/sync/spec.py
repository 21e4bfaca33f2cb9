"""What a strategy registers beside its code: a `StrategySpec` (its name, its builder, the server processes it
needs beside the workers and how they serve, and the line it adds to the run summary). The worker, the launcher,
`dtrain run`'s summary and the Trainer ask the registry (`dtrain.sync.REGISTRY`) for these instead of testing
names; the strategy's config section and cross-field rules are `distributed.<name>` (dtrain/config/strategies.py,
a layer below, where the config loader can reach them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dtrain.comm import Topology
from dtrain.config import ExperimentConfig, StrategySection
from dtrain.sync.base import SyncStrategy

StrategyBuilder = Callable[[ExperimentConfig, Topology], SyncStrategy]
# a server process's whole life: serve the workers until they leave; the callable runs once all have joined
Serve = Callable[[Topology, ExperimentConfig, Callable[[], None]], None]


def data_parallel_summary(described: Mapping[str, Any]) -> str:
    """`allreduce, op average, buckets 1.6 MB (auto-tuned, median step ms: 0.4 MB 79, 1.6 MB 71)` from a
    strategy's `describe()`: the name, the op, and the gradient buckets when it has them."""
    text = f"{described.get('name')}, op {described.get('op')}"
    if "bucket_cap_mb" in described:
        text += f", buckets {described['bucket_cap_mb']:.3g} MB"
    visits = (described.get("fusion_tuning") or {}).get("visits") or []
    if visits:
        times: dict[float, list[float]] = {}
        for size, seconds in visits:
            times.setdefault(size, []).append(seconds)
        shown = ", ".join(f"{size:.3g} MB {sum(t) / len(t) * 1e3:.0f}" for size, t in sorted(times.items()))
        text += f" (auto-tuned, median step ms: {shown})"
    return text


def no_servers(config: ExperimentConfig) -> int:
    return 0


@dataclass(frozen=True)
class StrategySpec:
    """One strategy as the rest of dtrain sees it. `name` is its `distributed.strategy` value and the name of its
    config section; `build` makes it on each worker; `servers` counts the processes it needs beside the workers
    (started as the last ranks) and `serve` is what each of them runs; `summary` turns its `describe()` into the
    run summary's `sync` line. `cannot_resize` is None when a run resumed at another world size keeps its math (the
    full-batch update, its state replicated or resharded); otherwise why it cannot (its trajectory depends on the
    worker count by design), and such a resume is refused with that reason (docs/checkpoints.md)."""

    name: str
    build: StrategyBuilder
    summary: Callable[[Mapping[str, Any]], str] = data_parallel_summary
    servers: Callable[[ExperimentConfig], int] = no_servers
    serve: Serve | None = None
    cannot_resize: str | None = None

    def section(self, config: ExperimentConfig) -> StrategySection:
        """The strategy's settings and rules in `config` (`distributed.<name>`)."""
        return config.distributed.section_of(self.name)
