"""The one spawn fixture for multi-process tests: real gloo process groups on loopback.

`spawn(fn, world_size, *args)` starts `world_size` processes, initialises torch.distributed in each
through dtrain.comm (as torchrun would, via RANK/WORLD_SIZE/MASTER_* variables), calls
`fn(topology, *args)` and returns the results in rank order; an exception in any rank fails the test
with that rank's traceback. With `servers=S` it starts S more processes, the parameter servers, as the
launcher does (the last ranks; `fn` runs there too and sees `topology.is_server`). `fixture_trainer` builds a
Trainer inside such a rank.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from dtrain.comm import Topology, barrier
from dtrain.config import ExperimentConfig
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.trainer import Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


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


def fixture_trainer(topology: Topology, config: ExperimentConfig, run_dir: str, trial_class: Any = None) -> Trainer:
    """A Trainer for `config` in a spawned rank, with the digits fixture's Trial unless another is given: rank 0
    prepares the run dir while the others wait for it."""
    if trial_class is None:
        sys.path.insert(0, str(FIXTURES))
        from digits_trial import DigitsTrial

        trial_class = DigitsTrial
    if topology.rank == 0:
        prepare_run_dir(config, Path(run_dir), FIXTURES)
    barrier()
    return Trainer(config=config, trial_class=trial_class, topology=topology, run_info=load_run_info(Path(run_dir)))


@pytest.fixture(scope="session")  # a plain function: module-scoped fixtures may spawn once for many tests
def spawn() -> Callable[..., list[Any]]:
    return run_spawned
