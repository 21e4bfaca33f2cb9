"""The RPC group of a job with parameter servers: workers and servers over torch.distributed.rpc.

The group meets through the job's store that `init_distributed(servers=...)` kept (no second rendezvous,
no other port), via a rendezvous handler registered under the `dtrain-job://` scheme.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as rpc

from dtrain.comm.topology import JOB_STORE, Topology

_SCHEME = "dtrain-job"
TRANSPORTS = ["uv"]  # TCP; TensorPipe's shared-memory transport makes every process linger ~10 s at exit
_registered = False


def _job_store_handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    if not JOB_STORE:
        raise RuntimeError("no job store: call dtrain.comm.init_distributed(servers=...) before init_rpc_group()")
    query = dict(part.split("=", 1) for part in url.partition("?")[2].split("&") if "=" in part)
    yield JOB_STORE[0], int(query["rank"]), int(query["world_size"])


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def server_name(index: int) -> str:
    return f"ps{index}"


def init_rpc_group(topology: Topology, *, timeout_seconds: float, threads: int = 16) -> str:
    """Join this process to the RPC group of all workers and servers; return its RPC name."""
    global _registered
    if not _registered:
        dist.register_rendezvous_handler(_SCHEME, _job_store_handler)
        _registered = True
    name = server_name(topology.rank - topology.world_size) if topology.is_server else worker_name(topology.rank)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"{_SCHEME}://", num_worker_threads=threads,
                                              rpc_timeout=timeout_seconds, _transports=TRANSPORTS, _channels=["basic"])
    with warnings.catch_warnings():  # the agent's own gloo group uses an API torch itself deprecates
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(name, rank=topology.rank, world_size=topology.world_size + topology.servers,
                     rpc_backend_options=options)
    return name


def shutdown_rpc_group() -> None:
    """Leave the RPC group once every member has called this (servers return from serving then)."""
    rpc.shutdown(graceful=True)
