"""Memory per rank of the model state (parameters, gradients, optimizer state) under each data-parallel layout,
the pipeline bubble, and the least-sharded layout that fits a device.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 3):
with mixed-precision Adam each parameter costs 2 bytes (fp16 weight) + 2 (fp16 gradient) + K = 12 (fp32 master
weight, momentum, variance), 16 bytes in all; sharding the optimizer state over N ranks gives 4 + 12/N (stage 1),
the gradients too 2 + 14/N (stage 2), the parameters too 16/N (stage 3, FSDP). dtrain keeps weights and
gradients in fp32 (autocast casts inside the ops), so its bytes per parameter are 4 + 4 + K with K = 8 for Adam
(two fp32 moments), 4 for SGD with momentum, 0 for plain SGD: also 16 bytes with Adam.

GPipe (Huang et al. 2019): with p stages and m microbatches the idle fraction of a step is (p - 1) / (m + p - 1).

Hybrid sharding (HSDP, PyTorch FSDP's HYBRID_SHARD): the model state is sharded as FSDP's over the S ranks of a
shard group (one node) and replicated over the R = N / S groups, so a rank holds 16/S bytes per parameter with
Adam. Per step each rank all-gathers the parameters (twice with `reshard_after_forward`: forward and backward)
and reduce-scatters the gradients inside its group, (S - 1)/S of the model's bytes each on a ring, and
all-reduces its 1/S gradient shard across the groups, 2 (R - 1)/R of it. FSDP is HSDP with S = N, DDP one
all-reduce of the whole gradient, 2 (N - 1)/N of it.
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per parameter: (weights, gradients, optimizer state)
PRECISIONS = {
    "zero-paper": (2.0, 2.0, 12.0),  # mixed-precision Adam as in the ZeRO paper
    "adam": (4.0, 4.0, 8.0),  # dtrain, fp32 weights and gradients (fp32 or autocast), Adam/AdamW/LAMB
    "sgd-momentum": (4.0, 4.0, 4.0),  # SGD with momentum, LARS
    "sgd": (4.0, 4.0, 0.0),
}
# what each layout shards over the data-parallel ranks: (weights, gradients, optimizer state)
LAYOUTS = {
    "ddp": (False, False, False),  # ZeRO stage 0
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "fsdp": (True, True, True),  # ZeRO stage 3
    "hsdp": (True, True, True),  # ZeRO stage 3 inside a shard group (`shard_ranks`), replicated across the groups
}
RECOMMENDATION_ORDER = ("ddp", "zero1", "fsdp")  # the layouts dtrain builds, least communication first


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes one rank holds."""

    layout: str
    ranks: int
    weight_bytes: float
    gradient_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def model_state_bytes(parameters: float, layout: str, ranks: int, optimizer: str = "adam",
                      stages: int = 1, shard_ranks: int | None = None) -> MemoryEstimate:
    """Bytes of weights, gradients and optimizer state on one rank for `parameters` parameters. `stages` > 1:
    dtrain's pipeline, where a rank holds its own stage's weights, gradients and optimizer state (1/stages of the
    model, equal stages assumed) while it trains, on top of `layout` over the ranks = data replicas. Not counted:
    rank 0 holds the whole weights while it hands the stages out at construction, and every rank while a Trial
    without `pipeline_metrics` validates. `shard_ranks`: hsdp's shard group (default all `ranks`, FSDP)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if ranks < 1 or stages < 1:
        raise ValueError("ranks and stages must be at least 1")
    weight, grad, state = PRECISIONS[optimizer]
    shard_w, shard_g, shard_s = LAYOUTS[layout]
    per_stage = parameters / stages
    over = _shard_group(layout, ranks, shard_ranks)
    return MemoryEstimate(
        layout=layout, ranks=ranks,
        weight_bytes=weight * per_stage / (over if shard_w else 1),
        gradient_bytes=grad * per_stage / (over if shard_g else 1),
        optimizer_bytes=state * per_stage / (over if shard_s else 1))


def _shard_group(layout: str, ranks: int, shard_ranks: int | None) -> int:
    """The ranks the layout shards over: hsdp's shard group, else all of them."""
    if layout != "hsdp" or shard_ranks is None:
        return ranks
    if shard_ranks < 1 or ranks % shard_ranks:
        raise ValueError(f"shard_ranks {shard_ranks} must divide ranks {ranks}")
    return shard_ranks


@dataclass(frozen=True)
class TrafficEstimate:
    """Bytes one rank sends per step for the model state's collectives (ring algorithms), split by whether the
    collective's group stays inside a node or spans nodes."""

    layout: str
    within_node_bytes: float
    across_nodes_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.within_node_bytes + self.across_nodes_bytes


def step_traffic(model_bytes: float, layout: str, ranks: int, ranks_per_node: int,
                 reshard_after_forward: bool = True) -> TrafficEstimate:
    """Bytes a rank sends per step under `ddp` (one all-reduce), `fsdp` (all-gathers and a reduce-scatter over all
    ranks) or `hsdp` (those inside each node's shard group, then an all-reduce of the 1/S shard across the
    groups), for a model of `model_bytes` (fp32 parameters = gradient bytes). A group spans nodes when `ranks`
    exceeds `ranks_per_node`."""
    if ranks < 1 or ranks_per_node < 1:
        raise ValueError("ranks and ranks_per_node must be at least 1")
    gathers = 2 if reshard_after_forward else 1
    spans = ranks > ranks_per_node
    if layout == "ddp":
        sent = 2 * (ranks - 1) / ranks * model_bytes
        return TrafficEstimate(layout, 0.0 if spans else sent, sent if spans else 0.0)
    if layout == "fsdp":
        sent = (gathers + 1) * (ranks - 1) / ranks * model_bytes
        return TrafficEstimate(layout, 0.0 if spans else sent, sent if spans else 0.0)
    if layout == "hsdp":
        shard = min(ranks, ranks_per_node)
        replicas = ranks // _shard_group(layout, ranks, shard)
        return TrafficEstimate(layout, (gathers + 1) * (shard - 1) / shard * model_bytes,
                               2 * (replicas - 1) / replicas * model_bytes / shard)
    raise ValueError(f"layout {layout!r}: step traffic is modelled for ddp, fsdp and hsdp")


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a GPipe/1F1B step: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_efficiency(stages: int, microbatches: int) -> float:
    """Ideal time over pipelined time: 1 - bubble = m / (m + p - 1)."""
    return 1.0 - bubble_fraction(stages, microbatches)


def recommend_layout(parameters: float, ranks: int, device_bytes: float, optimizer: str = "adam",
                     activation_bytes: float = 0.0) -> tuple[str | None, list[MemoryEstimate]]:
    """The least-sharded layout dtrain builds whose model state plus `activation_bytes` fits `device_bytes` per
    rank (None when even FSDP over `ranks` does not fit), and every layout's estimate."""
    estimates = [model_state_bytes(parameters, layout, ranks, optimizer) for layout in RECOMMENDATION_ORDER]
    for estimate in estimates:
        if estimate.total_bytes + activation_bytes <= device_bytes:
            return estimate.layout, estimates
    return None, estimates
