"""hvd.init() after hvd.shutdown(), as Horovod's gloo controller allows, at 2 real ranks whose group hvd.init() makes
itself from the launcher's variables: one rank re-joins while rank 0 still holds the last group, and every
generation's allreduce is right (a quick rank must not read the last group's addresses from rank 0's store)."""

from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any

import pytest
import torch.multiprocessing as mp

GENERATIONS = 3


def _worker(rank: int, size: int, port: int, results: Any) -> None:
    os.environ.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(size), HOROVOD_LOCAL_RANK=str(rank),
                      HOROVOD_LOCAL_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    try:
        import torch

        import dtrain.horovod.torch as hvd

        sums = []
        for _ in range(GENERATIONS):
            hvd.init()
            sums.append(hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum).item())
            sums.append(float(hvd.size() == size and hvd.rank() == rank and hvd.is_initialized()))
            if rank == 0:
                time.sleep(2.0)  # rank 0 still holds this group (and its store) while the other re-initialises
            hvd.shutdown()
            sums.append(float(not hvd.is_initialized()))
        results.put((rank, True, sums))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def test_init_after_shutdown_makes_a_fresh_group_on_every_rank() -> None:
    size = 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, size, port, results)) for rank in range(size)]
    for process in processes:
        process.start()
    try:
        collected = [results.get(timeout=240) for _ in range(size)]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    failures = [value for _, ok, value in collected if not ok]
    assert not failures, "\n".join(failures)
    expected = [float(size * (size + 1) // 2), 1.0, 1.0] * GENERATIONS
    for _, _, sums in collected:
        assert sums == pytest.approx(expected)
