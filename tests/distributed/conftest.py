"""The one spawn fixture for multi-process tests: real gloo process groups on loopback.

`spawn(fn, world_size, *args)` starts `world_size` processes, initialises torch.distributed in each
through dtrain.comm (as torchrun would, via RANK/WORLD_SIZE/MASTER_* variables), calls
`fn(topology, *args)` and returns the results in rank order; an exception in any rank fails the test
with that rank's traceback. With `servers=S` it starts S more processes, the parameter servers, as the
launcher does (the last ranks; `fn` runs there too and sees `topology.is_server`).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           results: Any, env: dict[str, str], servers: int) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        from dtrain.comm import init_distributed, shutdown_distributed

        topology = init_distributed(backend="gloo", timeout_seconds=120, servers=servers)
        value = fn(topology, *args)
        shutdown_distributed()
        results.put((rank, True, pickle.dumps(value)))  # plain bytes: no shared-memory handles
    except BaseException:  # report every failure to the parent, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                env: dict[str, str] | None = None, servers: int = 0) -> list[Any]:
    """Results in rank order: the `world_size` workers', then the servers'."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    world_size += servers
    processes = [context.Process(target=_entry, args=(rank, world_size, port, fn, args, results, env or {}, servers))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    failures = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                collected[rank] = pickle.loads(value)
            else:
                failures.append(f"rank {rank}:\n{value}")
                break
    finally:
        for process in processes:
            process.join(timeout=5 if failures else 30)
            if process.is_alive():
                process.kill()
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [collected[rank] for rank in range(world_size)]


@pytest.fixture(scope="session")  # a plain function: module-scoped fixtures may spawn once for many tests
def spawn() -> Callable[..., list[Any]]:
    return run_spawned
