"""dtrain/comm/rendezvous.py: the c10d rendezvous of several nodes keeps the node ranks given by --node-rank.

In-process: torch's handler is replaced by a stand-in that numbers the nodes its own way (as the dynamic rendezvous
does, by address), two nodes meet on one store in two threads; then one real round of torch's c10d rendezvous,
through the registry, on loopback."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from dtrain.comm.rendezvous import BACKEND, NODE_RANK_KEY, NodeRankRendezvous, local_address, register
from dtrain.comm.stall import store_attempt
from dtrain.comm.topology import JOB_STORE_ENV, LaunchEnv, _loopback_store, bind_loopback
from dtrain.errors import LaunchError
from dtrain.launch import _loopback_rendezvous


@dataclass
class Inner:
    """A rendezvous handler that gives this node `rank` (the order torch's rendezvous chose) on a shared store."""

    store: dist.Store
    rank: int
    world: int = 2
    waiting: int = 0
    closed: bool = False

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(self.store, self.rank, self.world, RendezvousStoreInfo("torch-chose-this", 1))

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def is_closed(self) -> bool:
        return self.closed

    def set_closed(self) -> None:
        self.closed = True

    def get_run_id(self) -> str:
        return "job"

    def shutdown(self) -> bool:
        return True


def meet(node_ranks: list[int], torch_order: list[int]) -> list[RendezvousInfo | Exception]:
    """Node i (with --node-rank node_ranks[i], torch's rank torch_order[i], address 10.0.0.<i+1>) joins a round;
    what each got, or the error it raised."""
    store = dist.HashStore()
    results: list[RendezvousInfo | Exception] = [LaunchError("did not finish")] * len(node_ranks)

    def join(i: int) -> None:
        handler = NodeRankRendezvous(Inner(store, torch_order[i], len(node_ranks)), node_ranks[i], f"10.0.0.{i + 1}")
        try:
            results[i] = handler.next_rendezvous()
        except LaunchError as exc:
            results[i] = exc

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(node_ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_each_node_gets_the_rank_it_was_given_whatever_order_torch_chose() -> None:
    first, second = meet(node_ranks=[0, 1], torch_order=[1, 0])  # torch numbered them the other way round
    assert isinstance(first, RendezvousInfo) and isinstance(second, RendezvousInfo)
    assert (first.rank, second.rank) == (0, 1) and first.world_size == second.world_size == 2
    # the workers' master is the node given rank 0, at its own address, on one port both nodes read
    assert first.bootstrap_store_info.master_addr == second.bootstrap_store_info.master_addr == "10.0.0.1"
    assert first.bootstrap_store_info.master_port == second.bootstrap_store_info.master_port > 0


def test_two_nodes_with_one_node_rank_fail_on_every_node_with_one_line() -> None:
    results = meet(node_ranks=[1, 1], torch_order=[0, 1])
    for result in results:
        assert isinstance(result, LaunchError)
        assert str(result) == ("the 2 nodes that met gave --node-rank 1, 1; every node needs its own rank in 0..1 "
                               "(the chief, which hosts the rendezvous, is 0)")


def test_the_wrapper_passes_on_what_the_agent_asks_and_never_shares_the_agents_store() -> None:
    inner = Inner(dist.HashStore(), 0, waiting=1)
    handler = NodeRankRendezvous(inner, 0, "10.0.0.1")
    assert handler.num_nodes_waiting() == 1  # how the agents of healthy nodes learn that they must restart
    assert handler.get_run_id() == "job" and handler.get_backend() == BACKEND and handler.shutdown()
    handler.set_closed()
    assert handler.is_closed() and handler.use_agent_store is False


def test_one_real_round_of_torchs_c10d_rendezvous_through_the_registry() -> None:
    """What `dtrain run --nnodes N` hands torch's launcher, with one node: the registered backend builds torch's
    dynamic handler on a c10d store hosted here, and the round gives the node its --node-rank."""
    with bind_loopback() as probe:
        port = probe.getsockname()[1]
    params = RendezvousParameters(backend=register(), endpoint=f"127.0.0.1:{port}", run_id="probe", min_nodes=1,
                                  max_nodes=1, local_addr="127.0.0.1", **{"is_host": True, NODE_RANK_KEY: 0})
    handler = get_rendezvous_handler(params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert handler.num_nodes_waiting() == 0 and not handler.use_agent_store
        # a restart is a new round, whose store is apart from the last one's: the node ranks and the workers'
        # master address and port that a round publishes are never read from an earlier round
        again = handler.next_rendezvous()
        assert again.rank == 0 and again.store.check(["dtrain/node_rank/0"])
        info.store.set("only-in-round-0", "x")
        assert not again.store.check(["only-in-round-0"])
    finally:
        handler.shutdown()
    assert register() == BACKEND  # registering again is harmless


def test_this_nodes_address_is_the_one_the_route_to_the_master_leaves_from() -> None:
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("127.0.0.1", "10.0.0.7") == "10.0.0.7"  # the address of --network-interface wins
    with pytest.raises(LaunchError, match="no-such-host.invalid cannot be reached from this node"):
        local_address("no-such-host.invalid")


def test_heartbeat_keys_carry_the_attempt_only_in_a_store_that_outlives_restarts() -> None:
    """comm/stall.py store_attempt: torch's agent store keeps earlier attempts' keys; the workers' own store (dtrain
    run) is new in every round, where the nodes' agents count restarts differently (0 on a node restarted because
    another node failed), so every rank must use the same prefix."""
    assert store_attempt(2, {"TORCHELASTIC_USE_AGENT_STORE": "True"}) == 2
    assert store_attempt(1, {"TORCHELASTIC_USE_AGENT_STORE": "False"}) == store_attempt(0, {}) == 0


def test_on_one_machine_the_workers_use_the_launchers_store_with_a_prefix_per_attempt() -> None:
    """comm/topology.py _loopback_store under `dtrain run` on one machine: the store the launcher holds open on
    127.0.0.1 for the whole run (no port released for rank 0 to bind), and a restarted attempt's keys apart from the
    last attempt's (the stale keys of torch's shared agent store, pytorch/pytorch#135712)."""
    keep: list[object] = []
    env = {JOB_STORE_ENV: _loopback_rendezvous(None, keep)}

    def attempt(count: int, rank: int) -> dist.Store:
        launch = LaunchEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0,
                           launcher="torchrun", master_addr="127.0.0.1", master_port=1, restart_count=count)
        return _loopback_store(launch, timedelta(seconds=10), env)

    first = attempt(0, rank=1)
    first.set("address", "of attempt 0")
    second = attempt(1, rank=0)
    assert not second.check(["address"])  # the restarted attempt does not see the last one's key
    second.set("address", "of attempt 1")
    assert attempt(1, rank=1).get("address") == b"of attempt 1" and first.get("address") == b"of attempt 0"
    assert keep[1].get("dtrain/workers/attempt-1/address") == b"of attempt 1"  # type: ignore[attr-defined]
