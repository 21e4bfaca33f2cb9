"""The one spawn fixture for multi-process tests: real gloo process groups on loopback.

`spawn(fn, world_size, *args)` starts `world_size` processes, initialises torch.distributed in each
through dtrain.comm (as torchrun would, via RANK/WORLD_SIZE/MASTER_* variables), calls
`fn(topology, *args)` and returns the results in rank order; an exception in any rank fails the test
with that rank's traceback. With `servers=S` it starts S more processes, the parameter servers, as the
launcher does (the last ranks; `fn` runs there too and sees `topology.is_server`). `fixture_trainer` builds a
Trainer inside such a rank.

The ranks are forked from multiprocessing's fork server, which imports torch and dtrain's training stack once
per pytest session (`SPAWN_PRELOAD`): a fresh interpreter per rank, as spawn gives, but without its seconds of
imports and interpreter teardown per process (on 2 cores most of a small test's time). Each rank still starts
from the state right after those imports, with the test's environment, working directory and sys.path.
"""

from __future__ import annotations

import atexit
import importlib
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


# Imported once by the fork server that every rank is forked from (the heavy part of a rank's start).
SPAWN_PRELOAD = ["torch", "torch.distributed", "dtrain.comm", "dtrain.config", "dtrain.runs.rundir",
                 "dtrain.train.trainer"]


def _spawn_context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(SPAWN_PRELOAD)  # read when the fork server starts (the session's first spawn)
    return context


def _entry(rank: int, world_size: int, port: int, payload: bytes, results: Any, env: dict[str, str],
           servers: int, parent: tuple[dict[str, str], str, list[str]], finished: Any, timeout: float) -> None:
    environ, cwd, sys_path = parent  # the test's own, not those the fork server started with
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.chdir(cwd)
    sys.path[:] = sys_path
    try:
        import torch

        torch.set_num_threads(1)
        from dtrain.comm import init_distributed, shutdown_distributed

        fn, args = pickle.loads(payload)  # with the test's sys.path: the test module imports here
        topology = init_distributed(backend="gloo", timeout_seconds=120, servers=servers)
        value = fn(topology, *args)
        shutdown_distributed()
        results.put((rank, True, pickle.dumps(value)))  # plain bytes: no shared-memory handles
    except BaseException:  # report every failure to the parent, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        # stay up (rank 0 hosts the store) until every rank has reported, as torchrun's agents wait for each other:
        # a rank that outlived this one may still need its notices (an injected hang waits for the abort notice)
        finished.wait(timeout)
        atexit._run_exitfuncs()  # a forked child ends by os._exit: run what a normal exit would (metrics drains)


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                env: dict[str, str] | None = None, servers: int = 0) -> list[Any]:
    """Results in rank order: the `world_size` workers', then the servers'."""
    context = _spawn_context()
    results = context.Queue()
    finished = context.Event()  # set once every rank has reported (or one failed): then they may exit
    port = _free_port()
    world_size += servers
    payload = pickle.dumps((fn, args))
    parent = (dict(os.environ), os.getcwd(), list(sys.path))
    # by its package path: pytest loads this file as plain `conftest` too, a name the fork server may not resolve
    target = importlib.import_module("tests.distributed.conftest")._entry
    processes = [context.Process(target=target, args=(rank, world_size, port, payload, results, env or {}, servers,
                                                      parent, finished, timeout))
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
        finished.set()
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
