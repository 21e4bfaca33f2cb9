"""Cost of one collective in the alpha-beta model: `latency_s` (alpha) per message step plus
`message_bytes / bandwidth_bytes_per_s` (beta per byte) for the bytes each rank moves over its link.

Sources: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication Operations in
MPICH", IJHPCA 19(1), 2005 (the alpha-beta costs of ring, recursive halving/doubling and binomial trees);
P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2),
2009 (the ring moves the minimum 2(n-1)/n of the message per rank); P. Goyal et al., "Accurate, Large
Minibatch SGD", arXiv:1706.02677, §4.1 (intra-server reduce, inter-server halving/doubling, broadcast);
S.-X. Zou et al., "Distributed Training Large-Scale Deep Architectures", arXiv:1709.06622 (parameter-server
load). The reduction arithmetic (Thakur's gamma) is left out: on accelerators it is negligible, and on CPU
workers it is part of the host cost that `dtrain.plan.step` charges separately.

Every function is pure and returns seconds; one rank (or one node) costs nothing.
"""

from __future__ import annotations

import math


def _check(message_bytes: float, ranks: int, bandwidth_bytes_per_s: float) -> None:
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if message_bytes < 0:
        raise ValueError(f"message_bytes must be >= 0, got {message_bytes}")
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s}")


def ring_allreduce_seconds(message_bytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float
                           ) -> float:
    """Ring all-reduce (reduce-scatter then all-gather): 2(n-1)/n * S/B + 2(n-1) * alpha (Thakur et al. 2005)."""
    _check(message_bytes, ranks, bandwidth_bytes_per_s)
    n = ranks
    return 2 * (n - 1) / n * message_bytes / bandwidth_bytes_per_s + 2 * (n - 1) * latency_s


def halving_doubling_allreduce_seconds(message_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                                       latency_s: float) -> float:
    """Recursive halving/doubling (Rabenseifner): the ring's bytes in 2*ceil(log2 n) steps,
    2(n-1)/n * S/B + 2*ceil(log2 n) * alpha; Goyal et al. used it between servers."""
    _check(message_bytes, ranks, bandwidth_bytes_per_s)
    n = ranks
    return 2 * (n - 1) / n * message_bytes / bandwidth_bytes_per_s + 2 * math.ceil(math.log2(n)) * latency_s


def tree_allreduce_seconds(message_bytes: float, ranks: int, bandwidth_bytes_per_s: float, latency_s: float
                           ) -> float:
    """Binomial-tree reduce then broadcast: every one of the 2*ceil(log2 n) steps sends the whole message,
    2*ceil(log2 n) * (alpha + S/B) (Thakur et al. 2005). Few steps, so it wins for small messages."""
    _check(message_bytes, ranks, bandwidth_bytes_per_s)
    steps = 2 * math.ceil(math.log2(ranks))
    return steps * (latency_s + message_bytes / bandwidth_bytes_per_s)


def allreduce_latency_steps(algorithm: str, ranks: int) -> int:
    """Message steps on the critical path of one all-reduce; each costs one alpha."""
    if ranks <= 1:
        return 0
    if algorithm == "ring":
        return 2 * (ranks - 1)
    if algorithm in ("tree", "halving_doubling"):
        return 2 * math.ceil(math.log2(ranks))
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")


def shared_medium_allreduce_seconds(message_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                                    latency_s: float, algorithm: str = "ring") -> float:
    """All-reduce over ONE queue that every rank and both directions share (a hub, or a rate-limited
    loopback): ring, halving/doubling and tree all put 2(n-1) * S bytes on the wire in total, and a shared
    medium carries them one after another, so the time is 2(n-1) * S/B plus the algorithm's latency steps.
    For 2 ranks that is 2*S/B, twice the full-duplex ring's S/B."""
    _check(message_bytes, ranks, bandwidth_bytes_per_s)
    wire_bytes = 2 * (ranks - 1) * message_bytes
    return wire_bytes / bandwidth_bytes_per_s + allreduce_latency_steps(algorithm, ranks) * latency_s


def allreduce_seconds(algorithm: str, message_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                      latency_s: float) -> float:
    """One flat all-reduce by name: `ring`, `tree` or `halving_doubling`."""
    if algorithm == "ring":
        return ring_allreduce_seconds(message_bytes, ranks, bandwidth_bytes_per_s, latency_s)
    if algorithm == "tree":
        return tree_allreduce_seconds(message_bytes, ranks, bandwidth_bytes_per_s, latency_s)
    if algorithm == "halving_doubling":
        return halving_doubling_allreduce_seconds(message_bytes, ranks, bandwidth_bytes_per_s, latency_s)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; use ring, tree or halving_doubling")


def hierarchical_allreduce_seconds(message_bytes: float, nodes: int, devices_per_node: int,
                                   intra_bandwidth_bytes_per_s: float, intra_latency_s: float,
                                   inter_bandwidth_bytes_per_s: float, inter_latency_s: float,
                                   inter_algorithm: str = "ring") -> float:
    """Reduce-scatter inside each node, all-reduce between nodes, all-gather inside each node (Horovod's
    hierarchical all-reduce; Goyal et al. §4.1 reduce to one buffer per server and broadcast back, which moves
    the same bytes when pipelined). The L local ranks each all-reduce S/L between nodes at the same time
    through the node's one NIC, which therefore carries the bytes of a whole-message all-reduce between nodes.

    intra: 2 * [(L-1)/L * S/B_intra + (L-1) * alpha_intra]; inter: all-reduce of S over `nodes` ranks."""
    local = devices_per_node
    intra = 0.0
    if local > 1:
        intra = 2 * ((local - 1) / local * message_bytes / intra_bandwidth_bytes_per_s
                     + (local - 1) * intra_latency_s)
    inter = 0.0
    if nodes > 1:
        inter = allreduce_seconds(inter_algorithm, message_bytes, nodes, inter_bandwidth_bytes_per_s,
                                  inter_latency_s)
    return intra + inter


def parameter_server_bytes_per_server(message_bytes: float, workers: int, servers: int) -> float:
    """Bytes one server's NIC carries per step when the model is sharded evenly over `servers`: every worker
    pushes its gradient shard in and pulls the parameter shard out, 2 * S * W / P (Zou et al. 2017)."""
    if servers < 1 or workers < 1:
        raise ValueError(f"workers and servers must be >= 1, got {workers} and {servers}")
    return 2 * message_bytes * workers / servers


def parameter_server_seconds(message_bytes: float, workers: int, servers: int,
                             server_bandwidth_bytes_per_s: float, worker_bandwidth_bytes_per_s: float,
                             latency_s: float) -> float:
    """Synchronous push then pull through `servers` dedicated servers: the busiest NIC decides, either a
    server's (2*S*W/P bytes) or a worker's (its whole gradient out and the whole model in, 2*S bytes), plus one
    latency for the push and one for the pull."""
    server_s = parameter_server_bytes_per_server(message_bytes, workers, servers) / server_bandwidth_bytes_per_s
    worker_s = 2 * message_bytes / worker_bandwidth_bytes_per_s
    return max(server_s, worker_s) + 2 * latency_s


def fewest_servers_to_carry(message_bytes: float, workers: int, server_bandwidth_bytes_per_s: float,
                            window_s: float) -> int:
    """Zou et al.'s lemma: the server NICs move 2*S*W bytes per step in `window_s` (the compute they may hide
    behind) when P >= 2*S*W / (B * window). At least one server."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return max(1, math.ceil(2 * message_bytes * workers / (server_bandwidth_bytes_per_s * window_s) - 1e-9))


__all__ = ["allreduce_latency_steps", "allreduce_seconds", "fewest_servers_to_carry",
           "halving_doubling_allreduce_seconds", "hierarchical_allreduce_seconds",
           "parameter_server_bytes_per_server", "parameter_server_seconds", "ring_allreduce_seconds",
           "shared_medium_allreduce_seconds", "tree_allreduce_seconds"]
