"""The rendezvous of a job on several nodes: torch's c10d dynamic rendezvous, keeping the node ranks the user gave.

With a static rendezvous every node's elastic agent restarts only its own workers, and counts its own attempts:
after a worker dies on one node, the other node's workers learn of it only when a collective fails, and the two
nodes come back at different times (seen: the restarted workers could not reconnect). The c10d (dynamic)
rendezvous makes the agents agree: a node whose workers failed joins the next round, every other agent sees a
node waiting (`num_nodes_waiting`) and restarts its own workers into the same round.

The dynamic rendezvous numbers the nodes by their address, so `--node-rank` would no longer say which node is the
chief (whose run dir gets the checkpoints). `NodeRankRendezvous` wraps torch's handler: after each round every
node publishes the node rank it was given, the ranks must be 0..N-1 once each, and the workers' master is the
node of rank 0. Its store is hosted by the agent of node 0 (`is_host`); the workers host their own store (the
agent's shared store keeps the keys of an earlier attempt: pytorch/pytorch#135712).
"""

from __future__ import annotations

import errno
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from dtrain.errors import LaunchError

BACKEND = "dtrain-c10d"
NODE_RANK_KEY = "dtrain_node_rank"  # in rdzv_configs: the --node-rank of this node
ELASTIC_KEY = "dtrain_elastic"  # in rdzv_configs: nodes may be missing (--nnodes MIN:MAX)


def local_address(master_addr: str, interface_address: str | None = None) -> str:
    """This node's address as the others see it: the given interface's, else the one the route to the master
    leaves from (the master's own address on the master)."""
    if interface_address:
        return interface_address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master_addr), 9))  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError as exc:
        reason = "no route" if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH) else (exc.strerror or str(exc))
        raise LaunchError(f"--master-addr {master_addr} cannot be reached from this node ({reason}); give the "
                          "chief's address on the network the nodes share") from None


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    node_rank = params.get_as_int(NODE_RANK_KEY)
    if node_rank is None:
        raise LaunchError(f"the {BACKEND} rendezvous needs {NODE_RANK_KEY} in rdzv_configs")
    backend, store = create_backend(params)
    return NodeRankRendezvous(create_handler(store, backend, params), node_rank, params.local_addr,
                              elastic=bool(params.get_as_bool(ELASTIC_KEY, False)))


def register() -> str:
    """Make the backend known to torch's rendezvous registry (idempotent); its name, for LaunchConfig."""
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND


class NodeRankRendezvous(RendezvousHandler):
    """torch's dynamic rendezvous handler whose rounds give this node `node_rank` (see the module docstring)."""

    def __init__(self, inner: RendezvousHandler, node_rank: int, local_addr: str | None, *,
                 elastic: bool = False) -> None:
        self._inner = inner
        self._node_rank = node_rank
        self._local_addr = local_addr
        self._elastic = elastic

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers' store is theirs, new in every round

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        store, world = info.store, info.world_size  # the store is this round's (prefixed by the round)
        store.set(f"dtrain/node_rank/{info.rank}", str(self._node_rank))
        given = [int(store.get(f"dtrain/node_rank/{rank}")) for rank in range(world)]
        if self._elastic:  # the nodes present, numbered in the order of their --node-rank; the chief (0) among them
            if len(set(given)) != world or 0 not in given:
                raise LaunchError(f"the {world} nodes that met gave --node-rank {', '.join(map(str, given))}; every "
                                  "node needs its own rank, and the chief (0, which hosts the rendezvous) must be one")
            rank = sorted(given).index(self._node_rank)
        elif sorted(given) != list(range(world)):
            raise LaunchError(f"the {world} nodes that met gave --node-rank {', '.join(map(str, given))}; every node "
                              f"needs its own rank in 0..{world - 1} (the chief, which hosts the rendezvous, is 0)")
        else:
            rank = self._node_rank
        bootstrap = RendezvousStoreInfo.build(rank, dist.PrefixStore("dtrain", store), local_addr=self._local_addr)
        return RendezvousInfo(store, rank, world, bootstrap)

    def is_closed(self) -> bool:
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return int(self._inner.num_nodes_waiting())

    def get_run_id(self) -> str:
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        return bool(self._inner.shutdown())
