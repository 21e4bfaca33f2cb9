"""Centralized data parallelism: workers push gradient shards to parameter servers and pull parameter shards.

Process layout: the launcher starts `servers` processes beside the workers; they are the last ranks of the job
(`dtrain run` does it; under torchrun or srun start slots + servers processes). Workers form the default process
group (the Trainer's collectives); workers and servers form an RPC group (torch.distributed.rpc). Each server
holds a byte-balanced shard of the parameters (`ps_shards`) and the optimizer for it (`ps_server`): a worker's
`step()` sends every server its gradient shard with the current param-group options (learning rate, momentum,
...) and gets the shard's new parameters back in the same round trip.

Workers in `async`/`ssp` mode (and `sync` with backup workers) do not move in lockstep: `steps_done()` reports
the servers' count of global batches trained, which the Trainer follows between its meeting points (reports,
validation, checkpoints), where `consolidate()` brings every worker to the same parameters. Besides the core
protocol the strategy implements the AsynchronousPacing and Consolidating extensions and `metrics`
(dtrain.sync.base); its pushes and pulls are reported by `metrics()`, not as all-reduce wire bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from dtrain.comm import Topology, barrier
from dtrain.comm.rpc import init_rpc_group, server_name, shutdown_rpc_group
from dtrain.config import ExperimentConfig, ParameterServer
from dtrain.errors import SyncError
from dtrain.sync.base import StrategyBase
from dtrain.sync.ps_server import Reply, ShardServer, ShardSpec
from dtrain.sync.ps_shards import Piece, TensorSize, shard_by_bytes, shard_bytes
from dtrain.sync.spec import StrategySpec

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------ the server process

_SERVER: list[ShardServer] = []


def serve(topology: Topology, settings: ParameterServer, *, timeout_seconds: float,
          on_joined: Callable[[], None] | None = None) -> None:
    """Run one server until every worker has left the RPC group; `on_joined` runs once all have joined it."""
    _SERVER[:] = [ShardServer(workers=topology.world_size, mode=settings.mode, staleness=settings.staleness,
                              backup_workers=settings.backup_workers, staleness_lr=settings.staleness_lr)]
    name = init_rpc_group(topology, timeout_seconds=timeout_seconds)
    if on_joined is not None:
        on_joined()
    log.info("%s serving %d workers (mode %s)", name, topology.world_size, settings.mode)
    shutdown_rpc_group()
    log.info("%s done: %s", name, _SERVER[0].stats.to_dict() if _SERVER[0].ready else "never set up")


def _server() -> ShardServer:
    return _SERVER[0]


def _rpc_setup(spec: ShardSpec, state: dict[str, Any] | None) -> None:
    _server().setup(spec)
    if state is not None:
        _server().load_state_dict(state)


@rpc.functions.async_execution
def _rpc_push(worker: int, grad: torch.Tensor, pulled_version: int, options: list[dict[str, Any]]) -> Future[Reply]:
    return _server().push(worker, grad, pulled_version, options)


def _rpc_pull() -> Reply:
    return _server().pull()


def _rpc_state() -> dict[str, Any]:
    return _server().state_dict()


def _rpc_stats() -> dict[str, Any]:
    server = _server()
    return {**server.stats.to_dict(), "version": server.version, "global_step": server._global_step()}


def _rpc_pause(worker: int) -> None:
    _server().pause(worker)


def _rpc_resume(worker: int) -> None:
    _server().resume(worker)


# ----------------------------------------------------------------------------------------- the workers


class ParameterServerStrategy(StrategyBase):
    """The workers' side: shards, push/pull each step, and the counters a run reports."""

    name = "parameter_server"

    def __init__(self, topology: Topology, settings: ParameterServer, *, timeout_seconds: float = 600.0) -> None:
        if topology.servers < 1:
            raise SyncError("distributed.strategy parameter_server needs server processes besides the workers; "
                            "start the run with `dtrain run`, or start slots_per_trial + servers processes under "
                            "torchrun/srun (docs/guide.md, 'Parameter servers')")
        self.topology = topology
        self.settings = settings
        self.lockstep = settings.mode == "sync" and settings.backup_workers == 0
        init_rpc_group(topology, timeout_seconds=timeout_seconds)
        self._model: nn.Module | None = None
        self._params: list[nn.Parameter] = []
        self._shards: list[list[Piece]] = []
        self._sizes: list[TensorSize] = []
        self._versions: list[int] = []
        self._global_step = 0
        self._restored: list[dict[str, Any] | None] | None = None
        self._ready = False
        self._snapshot: dict[str, Any] | None = None
        self.rpc_seconds = 0.0  # this worker's time in push/pull round trips (transfer + waiting)
        self.held_seconds = 0.0  # the part of it the servers held its pushes for other workers
        self.steps = 0

    # ------------------------------------------------------------------------------- core protocol

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._sizes = [TensorSize(p.numel(), p.element_size()) for p in self._params]
        return model

    def unwrap_model(self) -> nn.Module:
        assert self._model is not None, "wrap_model() first"
        return self._model

    def no_sync(self) -> AbstractContextManager[Any]:
        return nullcontext()  # gradients stay local until step() pushes them

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Push this worker's gradient shards with the optimizer's current options; take the new parameters."""
        if not self._ready:
            self._setup_servers(optimizer)
        options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        started = time.perf_counter()
        futures = {index: rpc.rpc_async(server_name(index), _rpc_push,
                                        args=(self.topology.rank, self._flat_grad(shard), self._versions[index],
                                              options))
                   for index, shard in self._active()}
        replies = {index: future.wait() for index, future in futures.items()}
        self.rpc_seconds += time.perf_counter() - started
        self.held_seconds += max(reply.held_seconds for reply in replies.values())
        self._take(replies)
        self.steps += 1
        optimizer._opt_called = True  # type: ignore[attr-defined]  # the servers stepped it: no scheduler warning

    def state_dict(self) -> dict[str, Any]:
        """The servers' parameters, optimizer state and counters, as of the last `consolidate(snapshot=True)`."""
        return dict(self._snapshot) if self._snapshot is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        servers = state.get("servers")
        if servers is None:
            return
        if len(servers) != self.topology.servers:
            raise SyncError(f"the checkpoint holds {len(servers)} parameter-server shard(s) and this run has "
                            f"{self.topology.servers} server(s); resume with distributed.parameter_server.servers: "
                            f"{len(servers)}")
        self._restored = servers
        self._global_step = int(state.get("global_step", 0))

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": self.name, "servers": self.topology.servers, "mode": self.settings.mode,
                                "staleness": self.settings.staleness, "backup_workers": self.settings.backup_workers,
                                "staleness_lr": self.settings.staleness_lr}
        if self._ready:
            info["shard_bytes"] = [shard_bytes(shard, self._sizes) for shard in self._shards]
            info["worker"] = {"rank": self.topology.rank, "steps": self.steps, "rpc_seconds": self.rpc_seconds,
                              "held_seconds": self.held_seconds}
            if self.topology.is_chief:
                info.update(self._report_servers())
        return info

    def close(self) -> None:
        shutdown_rpc_group()

    # ---------------------------------------------------------------------------------- extensions

    def steps_done(self, step: int) -> int:
        """The servers' count of global batches trained (this rank's `step` when workers move in lockstep)."""
        return step if self.lockstep else self._global_step

    def consolidate(self, *, snapshot: bool = False) -> None:
        """Bring every worker to the servers' current parameters (called by all workers together); with
        `snapshot`, rank 0 also keeps the servers' state for the checkpoint that follows."""
        if not self._ready:
            return
        ssp = self.settings.mode == "ssp"
        if ssp:
            self._on_servers(_rpc_pause, self.topology.rank)
        barrier()  # no push is in flight once every worker is here
        self._take({index: rpc.rpc_sync(server_name(index), _rpc_pull) for index, _ in self._active()})
        if snapshot and self.topology.is_chief:
            self._snapshot = {"servers": self._on_servers(_rpc_state), "global_step": self._global_step}
        barrier()  # nobody pushes before the state is read
        if ssp:
            self._on_servers(_rpc_resume, self.topology.rank)

    def metrics(self) -> dict[str, float]:
        """Scalars for the run store and TensorBoard at each report (rank 0 asks the servers)."""
        if not (self._ready and self.topology.is_chief):
            return {}
        report = self._report_servers()
        values: dict[str, float] = {"ps_staleness_mean": report["staleness_mean"],
                                    "ps_staleness_max": float(report["staleness_max"]),
                                    "ps_dropped_gradients": float(report["dropped_gradients"]),
                                    "ps_worker_wait_seconds": max(report["held_seconds_per_worker"], default=0.0)}
        for index, server in enumerate(report["per_server"]):
            values[f"ps{index}_bytes_pushed_per_step"] = server["bytes_pushed_per_step"]
            values[f"ps{index}_bytes_pulled_per_step"] = server["bytes_pulled_per_step"]
        return values

    # ------------------------------------------------------------------------------------------ internals

    def _active(self) -> list[tuple[int, list[Piece]]]:
        return [(index, shard) for index, shard in enumerate(self._shards) if shard]

    def _on_servers(self, function: Any, *args: Any) -> list[Any]:
        futures = [rpc.rpc_async(server_name(index), function, args=args) for index, _ in self._active()]
        return [future.wait() for future in futures]

    def _setup_servers(self, optimizer: torch.optim.Optimizer) -> None:
        """Shard the model and build every server's shard (rank 0; from the checkpoint when resuming)."""
        assert self._model is not None, "wrap_model() first"
        split = not getattr(optimizer, "needs_whole_tensors", False)
        self._shards = shard_by_bytes(self._sizes, self.topology.servers, split_tensors=split)
        empty = [index for index, shard in enumerate(self._shards) if not shard]
        if empty and self.topology.is_chief:
            log.warning("parameter servers %s hold nothing: the model has fewer tensors than servers and the "
                        "optimizer needs whole tensors; use fewer servers", empty)
        self._versions = [0] * len(self._shards)
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        if self.topology.is_chief:
            futures = []
            for index, shard in self._active():
                spec = ShardSpec(pieces=[self._piece(piece).detach().clone() for piece in shard],
                                 groups=[group_of.get(id(self._params[piece.param]), 0) for piece in shard],
                                 optimizer_class=type(optimizer), group_options=options,
                                 layout=[(piece.param, piece.start, piece.stop) for piece in shard])
                state = self._restored[index] if self._restored is not None else None
                futures.append(rpc.rpc_async(server_name(index), _rpc_setup, args=(spec, state)))
            for future in futures:
                future.wait()
        barrier()
        if self._restored is not None:
            self._take({index: rpc.rpc_sync(server_name(index), _rpc_pull) for index, _ in self._active()})
        self._ready = True

    def _piece(self, piece: Piece) -> torch.Tensor:
        return self._params[piece.param].data.reshape(-1)[piece.start:piece.stop]

    def _flat_grad(self, shard: list[Piece]) -> torch.Tensor:
        parts = []
        for piece in shard:
            grad = self._params[piece.param].grad
            parts.append(grad.reshape(-1)[piece.start:piece.stop] if grad is not None
                         else torch.zeros(piece.numel, dtype=self._params[piece.param].dtype))
        return torch.cat(parts).cpu()

    def _take(self, replies: dict[int, Reply]) -> None:
        """Copy the servers' parameter shards into the model and note their counters. Pieces index a parameter's
        elements in logical (row-major) order; a parameter stored otherwise (channels_last) is written back whole."""
        flats: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for index, reply in replies.items():
                offset = 0
                for piece in self._shards[index]:
                    if piece.param not in flats:
                        flats[piece.param] = self._params[piece.param].detach().reshape(-1)
                    target = flats[piece.param][piece.start:piece.stop]
                    target.copy_(reply.params[offset:offset + piece.numel].to(target.device))
                    offset += piece.numel
                self._versions[index] = reply.version
            for param_index, flat in flats.items():
                param = self._params[param_index]
                if not param.is_contiguous():  # reshape(-1) made a copy: write it back in the parameter's layout
                    param.copy_(flat.view(param.shape))
        self._global_step = max(self._global_step, min(reply.global_step for reply in replies.values()))

    def _report_servers(self) -> dict[str, Any]:
        stats = self._on_servers(_rpc_stats)
        histogram: dict[int, int] = {}
        per_server = []
        for server in stats:
            for key, count in server["staleness_histogram"].items():
                histogram[int(key)] = histogram.get(int(key), 0) + count
            steps = max(server["global_step"], 1)
            per_server.append({"bytes_pushed_per_step": server["bytes_pushed"] / steps,
                               "bytes_pulled_per_step": server["bytes_pulled"] / steps,
                               "bytes_pushed": server["bytes_pushed"], "bytes_pulled": server["bytes_pulled"],
                               "pushes": server["pushes"], "dropped_gradients": server["dropped_gradients"],
                               "held_seconds_per_worker": server["held_seconds_per_worker"],
                               "max_clock_gap": server["max_clock_gap"], "global_step": server["global_step"]})
        counted = sum(histogram.values())
        return {"staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
                "staleness_mean": sum(k * v for k, v in histogram.items()) / counted if counted else 0.0,
                "staleness_max": max(histogram, default=0),
                "dropped_gradients": sum(s["dropped_gradients"] for s in per_server),
                # servers hold a worker's pushes at the same time: its wait is the longest hold per server
                "held_seconds_per_worker": [max(column) for column in
                                            zip(*(s["held_seconds_per_worker"] for s in per_server), strict=True)],
                "per_server": per_server}


def build_parameter_server(config: ExperimentConfig, topology: Topology) -> ParameterServerStrategy:
    """The workers' side from the config's `distributed.parameter_server` section."""
    return ParameterServerStrategy(topology, config.distributed.parameter_server,
                                   timeout_seconds=config.distributed.timeout_seconds)


def parameter_server_summary(described: Mapping[str, Any]) -> str:
    return (f"parameter_server, {described.get('servers')} server(s), mode {described.get('mode')}, staleness mean "
            f"{described.get('staleness_mean', 0.0):.2f} max {described.get('staleness_max', 0)}, dropped gradients "
            f"{described.get('dropped_gradients', 0)}")


def _serve_config(topology: Topology, config: ExperimentConfig, on_joined: Callable[[], None]) -> None:
    serve(topology, config.distributed.parameter_server, timeout_seconds=config.distributed.timeout_seconds,
          on_joined=on_joined)


SPEC = StrategySpec("parameter_server", build_parameter_server, summary=parameter_server_summary,
                    servers=lambda config: config.distributed.parameter_server.servers, serve=_serve_config,
                    cannot_resize="the servers apply each worker's gradient as it arrives, and their shards and "
                    "staleness bounds are laid out for the workers there are: the trajectory depends on their number")
