"""Start the workers of a run through torchrun's elastic agent (torch.distributed.launcher), on one node or many.

On one machine the rendezvous runs on 127.0.0.1 with a free port. Across machines every node runs
`dtrain run` with `--nnodes`, its `--node-rank` and the chief's `--master-addr/--master-port`, or with a
shared `--rdzv-endpoint` (no node ranks needed); both use torch's c10d rendezvous (`dtrain.comm.rendezvous`).
After a failure on any node every node's agent restarts its workers together, up to `max_restarts` times;
they resume from the latest checkpoint. A failure that a restart cannot mend ends the run at once instead
(`StopOnUserError`): a worker's user error (exit code 2 or 4, `fatal-error.json`), which includes an exception
in user code met again at the same batch after a restart (`runs/repeats.py`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.comm.topology import JOB_STORE_ENV, bind_loopback
from dtrain.config import ExperimentConfig
from dtrain.errors import ExitCode, LaunchError
from dtrain.runs.fatal import FATAL_FILE, read_fatal
from dtrain.runs.membership import NODE_NAME_ENV, NODE_RANGE_ENV, record_restart
from dtrain.runs.processes import threads_per_process
from dtrain.runs.repeats import recorded


def parse_nnodes(text: str) -> tuple[int, int | None]:
    """`--nnodes N` -> (N, None); `--nnodes MIN:MAX` -> (MAX, MIN); anything else one line: the value, the rule,
    the fix."""
    low, colon, high = text.strip().partition(":")
    try:
        numbers = [int(low), int(high)] if colon else [int(low)]
    except ValueError:
        raise LaunchError(f"--nnodes {text!r}: give a number of nodes N or a range MIN:MAX of whole numbers, e.g. "
                          "--nnodes 2 or --nnodes 1:2") from None
    if not colon and numbers[0] < 1:
        raise LaunchError(f"--nnodes {text} must be >= 1 (a job needs a node)")
    if colon and numbers[0] < 1:
        raise LaunchError(f"--nnodes {text}: MIN must be >= 1 (a job needs a node); write --nnodes "
                          f"1:{max(numbers[1], 1)}")
    if not colon:
        return numbers[0], None
    if numbers[0] > numbers[1]:
        raise LaunchError(f"--nnodes {text}: MIN ({numbers[0]}) must not exceed MAX ({numbers[1]}): the job runs on "
                          f"MIN to MAX nodes; write --nnodes {numbers[1]}:{numbers[0]}")
    return numbers[1], numbers[0]


@dataclass(frozen=True)
class NodeSpec:
    """Where this node stands in the job."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    network_interface: str | None = None  # this node's interface to the others (--network-interface)
    min_nodes: int | None = None  # --nnodes MIN:MAX: the job goes on with MIN..nnodes nodes (None: exactly nnodes)

    @property
    def elastic(self) -> bool:
        """Whether nodes may leave and join while the job runs (`--nnodes MIN:MAX` with MIN < MAX)."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def nnodes_text(self) -> str:
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)

    def validate(self, world_size: int) -> None:
        if self.nnodes < 1:
            raise LaunchError(f"--nnodes {self.nnodes} must be >= 1")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchError(f"--master-port {self.master_port} must be a TCP port, 1..65535; pick a free one "
                              "(or leave it out on one machine)")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes - 1}] for --nnodes "
                              f"{self.nnodes_text}")
        if world_size % self.nnodes and self.elastic:
            raise LaunchError(f"resources.slots_per_trial ({world_size}) must be a multiple of MAX in --nnodes "
                              f"{self.nnodes_text}: every node runs slots_per_trial / MAX workers, and the job runs "
                              "at MAX nodes with slots_per_trial; make it "
                              f"{(world_size // self.nnodes + 1) * self.nnodes}")
        if world_size % self.nnodes:
            raise LaunchError(f"resources.slots_per_trial (plus parameter servers: {world_size} processes) must be a "
                              f"multiple of --nnodes ({self.nnodes}) so that every node runs the same number of "
                              f"processes; make it {(world_size // self.nnodes + 1) * self.nnodes}")
        if self.nnodes > 1 and self.rdzv_endpoint is None and self.master_port is None:
            raise LaunchError("with --nnodes > 1 give the chief's --master-addr and --master-port (the same on "
                              "every node), or a shared --rdzv-endpoint HOST:PORT")


# The c10d rendezvous under --nnodes MIN:MAX: a lost node's heartbeat is missed for 3 x 2 s before the others re-form
# without it (torch's default 3 x 5 s), and a round that has MIN nodes waits 5 s for more before it closes (default
# 30 s): a node that leaves or joins costs about 10 s of rendezvous, besides the workers' restart.
ELASTIC_RENDEZVOUS: dict[str, object] = {"keep_alive_interval": 2, "keep_alive_max_attempt": 3,
                                         "last_call_timeout": 5}


def check_elastic_range(config: ExperimentConfig, node: NodeSpec) -> None:
    """Under `--nnodes MIN:MAX`: LaunchError (one line) when the job could not go on at some size in the range: a
    strategy whose trajectory depends on the worker count, a size whose workers cannot hold the pipeline's stages,
    or one that breaks another of the strategy's rules there (hsdp's shard_size must divide it)."""
    from dtrain.config import model_parallel_size
    from dtrain.sync import strategy_spec

    if not node.elastic or node.min_nodes is None:
        return
    spec = strategy_spec(config.distributed.strategy)
    if spec.cannot_resize is not None:
        raise LaunchError(f"--nnodes {node.nnodes_text}: strategy {spec.name} cannot change size while it runs "
                          f"({spec.cannot_resize}); give a fixed --nnodes, or a strategy that keeps its math at any "
                          "size (allreduce, zero, fsdp, ...)")
    per_node = config.resources.world_size // node.nnodes
    stages = model_parallel_size(config.distributed)
    for nodes in range(node.min_nodes, node.nnodes + 1):
        if (nodes * per_node) % stages:
            raise LaunchError(f"--nnodes {node.nnodes_text}: at {nodes} node(s) the {nodes * per_node} workers cannot "
                              f"hold the pipeline's {stages} stages; give a range whose every size runs a multiple "
                              f"of {stages} workers (slots_per_trial / MAX = {per_node} a node)")
        try:
            spec.section(config).check(config.run_shape(nodes * per_node))
        except ValueError as error:
            raise LaunchError(f"--nnodes {node.nnodes_text}: at {nodes} node(s) the job runs {nodes * per_node} "
                              f"workers, and {error}") from None


@dataclass(frozen=True)
class LaunchResult:
    """How the workers ended: OK (finished or stopped), FAILED, USER_ERROR or INTERRUPTED; `chief` says whether this
    node ran rank 0 (with --rdzv-endpoint the rendezvous decides which node does)."""

    exit_code: ExitCode
    message: str | None = None
    chief: bool = True
    traceback: str | None = None  # the user's frames of an exception in user code, printed before the message
    signal: str | None = None  # INTERRUPTED: the signal the agent received (SIGTERM, SIGINT, SIGUSR1, ...)


def ran_rank_zero(returned: object) -> bool:
    """Whether the workers whose results the elastic agent returned (global rank -> value) include rank 0."""
    return isinstance(returned, dict) and 0 in returned


MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its adaptive threshold
_MALLOC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_USER_MALLOC_SETTINGS = {name: os.environ[name] for name in _MALLOC_SETTINGS if name in os.environ}
# The signals the agent passes on to the workers, which checkpoint and stop: torch's default list and SIGUSR1 (the
# checkpoint-and-requeue request under Slurm), which would otherwise kill the agent and leave the workers running
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def malloc_environment(trim_threshold_mb: int | None, user_settings: dict[str, str] | None = None) -> dict[str, str]:
    """The glibc malloc variables a worker is started with, so that the activations a training step frees stay in
    the process for the next step: with glibc's adaptive defaults each step's tens of MB are trimmed back to the OS
    and page-faulted in again (measured on the demo: 10-25 thousand page faults and about a fifth of the CPU time
    per step). Nothing when `trim_threshold_mb` is None or the user set any malloc variable of their own."""
    if trim_threshold_mb is None or (_USER_MALLOC_SETTINGS if user_settings is None else user_settings):
        return {}
    return {"MALLOC_TRIM_THRESHOLD_": str(trim_threshold_mb << 20),
            "MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_THRESHOLD_BYTES)}


def _worker_environment(nproc_per_node: int, network_interface: str | None = None,
                        malloc_trim_threshold_mb: int | None = None) -> None:
    """Variables every worker inherits: thread count (the host's cores shared by every process dtrain runs here,
    a search's concurrent trials included), malloc settings, this node's network interface, and a marker for the
    worker."""
    os.environ["DTRAIN_LAUNCHER"] = "1"
    for name in _MALLOC_SETTINGS:  # a previous run of this process (a search's trials) may have set them
        if name not in _USER_MALLOC_SETTINGS:
            os.environ.pop(name, None)
    os.environ.update(malloc_environment(malloc_trim_threshold_mb))
    if network_interface:
        os.environ["DTRAIN_NETWORK_INTERFACE"] = network_interface
    if "OMP_NUM_THREADS" not in os.environ:  # the user's own setting wins
        os.environ["OMP_NUM_THREADS"] = str(threads_per_process(nproc_per_node, os.environ))


def launch_workers(run_dir: Path, config: ExperimentConfig, node: NodeSpec) -> LaunchResult:
    """Run the workers of this node to the end; restarts and failure reports come from the elastic agent."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = config.resources.world_size
    from dtrain.sync import strategy_spec

    world += strategy_spec(config.distributed.strategy).servers(config)  # servers: the last ranks, beside the workers
    node.validate(world)
    nproc = world // node.nnodes
    local = node.nnodes == 1 and node.rdzv_endpoint is None
    keep_alive: list[object] = []
    local_addr: str | None = "127.0.0.1"
    if local:  # the workers use the rendezvous store too, from start to end on 127.0.0.1, a prefix per attempt
        endpoint = _loopback_rendezvous(node.master_port, keep_alive)
        backend, rdzv_configs = "c10d", dict[str, object](is_host=True)
        os.environ[JOB_STORE_ENV] = endpoint
    else:  # every round's rank 0 hosts the workers' store, on the chief
        backend, endpoint, rdzv_configs, local_addr = _cluster_rendezvous(node)
        os.environ.pop(JOB_STORE_ENV, None)
    # Never torch's shared agent store: it keeps an earlier attempt's keys, and on several nodes the agents count
    # attempts differently (pytorch/pytorch#135712; docs/clusters.md, "The workers' store").
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    run_id = node.rdzv_id or (uuid.uuid4().hex if local else f"dtrain-{config.name}")
    _worker_environment(nproc, node.network_interface, config.optimizations.malloc_trim_threshold_mb)
    os.environ[NODE_NAME_ENV] = f"{local_addr or socket.gethostname()}:{os.getpid()}"
    os.environ.pop(NODE_RANGE_ENV, None)
    if node.elastic:
        rdzv_configs.update(ELASTIC_RENDEZVOUS)
        os.environ[NODE_RANGE_ENV] = node.nnodes_text
    if node.rdzv_endpoint is not None:
        _reopen_rendezvous(node.rdzv_endpoint, run_id)
    (run_dir / FATAL_FILE).unlink(missing_ok=True)
    launch_config = LaunchConfig(
        min_nodes=node.min_nodes or node.nnodes, max_nodes=node.nnodes, nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs, max_restarts=config.max_restarts,
        monitor_interval=0.2, local_addr=local_addr, signals_to_handle=AGENT_SIGNALS,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "agent")))
    args = ("-u", "-m", "dtrain.worker", "--run-dir", str(run_dir))
    try:
        with _agent_lines_to(run_dir / "logs" / "agent.log"), _stopping_on_user_errors(run_dir, run_id):
            returned = elastic_launch(launch_config, entrypoint=sys.executable)(*args)
    except (SignalException, KeyboardInterrupt) as exc:
        signal_name = getattr(getattr(exc, "sigval", None), "name", "SIGINT")
        kept = _latest_checkpoint(run_dir)
        what = f"training up to {kept} is kept" if kept else "no checkpoint was written yet"
        return LaunchResult(ExitCode.INTERRUPTED, f"interrupted by {signal_name}; the workers stopped at the next "
                            f"update with a checkpoint where they could, and {what}: run the same command with "
                            f"--run-dir {run_dir} to resume", signal=signal_name)
    except RendezvousConnectionError as exc:  # its store is gone (its host was lost) or was never reachable
        return LaunchResult(ExitCode.FAILED, _lost_store(endpoint, node, exc, _latest_checkpoint(run_dir), run_dir))
    except ChildFailedError as exc:
        fatal = read_fatal(run_dir, run_id)
        if fatal is not None:
            code = fatal.get("exit_code", ExitCode.USER_ERROR)
            shown = fatal.get("traceback")
            return LaunchResult(ExitCode.INVALID_HP if code == ExitCode.INVALID_HP else ExitCode.USER_ERROR,
                                str(fatal["message"]), traceback=str(shown) if shown else None)
        raised = recorded(run_dir, run_id, config.max_restarts) if config.max_restarts >= 0 else []
        return LaunchResult(ExitCode.FAILED, _describe_failure(exc, run_dir),
                            traceback=raised[0].traceback if raised else None)
    return LaunchResult(ExitCode.OK, chief=ran_rank_zero(returned))


def _lost_store(endpoint: str, node: NodeSpec, exc: BaseException, kept: str | None, run_dir: Path) -> str:
    """One line for an agent that lost its connection to the rendezvous store (torch raises it with a traceback)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    reason = " ".join(str(cause).split())[:200] or type(cause).__name__
    where = ("it lives in the agent of node 0 (--master-addr) and goes with that node" if node.rdzv_endpoint is None
             else "one hosted by a node's agent goes with that node, and one served by `dtrain rendezvous` must keep "
             "running")
    what = f"training up to {kept} is kept" if kept else "no checkpoint was written yet"
    return (f"this node lost the rendezvous store at {endpoint} ({reason}); {where}: to survive losing any node, "
            "serve it with `dtrain rendezvous` on a host that stays and start every node with --rdzv-endpoint "
            f"(docs/clusters.md, Losing node 0); {what}: run the same command with --run-dir {run_dir} to resume")


def _latest_checkpoint(run_dir: Path) -> str | None:
    """`checkpoints/step-<N>` (or its URL where checkpoints go to object storage) that `latest` names, if any."""
    from dtrain.runs.rundir import load_run_info
    from dtrain.runs.storage import with_secrets
    from dtrain.train.checkpoint import read_latest_name

    store = with_secrets(load_run_info(run_dir).checkpoints)
    try:
        name = read_latest_name(store)
    except OSError:  # storage unreachable now: the message says nothing about it
        return None
    if name is None:
        return None
    return f"checkpoints/{name}" if store.url == str((run_dir / "checkpoints").resolve()) else store.describe(name)


def _reopen_rendezvous(endpoint: str, run_id: str) -> None:
    """A store that outlived an earlier job with this rendezvous id holds it closed: start it again, and say so."""
    from dtrain.comm.rendezvous_store import reopen_if_closed

    reopened = reopen_if_closed(endpoint, run_id)
    if reopened is not None:
        print(f"dtrain: rendezvous {run_id} at {endpoint} was closed by a job that ended; starting it again (round "
              f"{reopened})", file=sys.stderr, flush=True)


def _cluster_rendezvous(node: NodeSpec) -> tuple[str, str, dict[str, object], str | None]:
    """Backend, endpoint, configs and this node's address for a job on several nodes.

    With --master-addr/--master-port: torch's c10d rendezvous, hosted by node 0's agent at that address, through
    `dtrain.comm.rendezvous` so that --node-rank stays the node's rank; a failure on any node makes every node's
    agent restart its workers into the same round. With --rdzv-endpoint: plain c10d (the rendezvous numbers the
    nodes), every node a client of the store that serves there (`dtrain rendezvous`), or, where nothing serves it
    yet, hosted by the node that owns the endpoint's address (dtrain.comm.rendezvous_store)."""
    from dtrain.comm.rendezvous import ELASTIC_KEY, NODE_RANK_KEY, local_address, register
    from dtrain.comm.rendezvous_store import parse_endpoint, rendezvous_configs
    from dtrain.comm.topology import interface_addresses

    addresses = interface_addresses()
    chosen = addresses.get(node.network_interface) if node.network_interface else None
    if node.rdzv_endpoint is not None:
        host, _ = parse_endpoint(node.rdzv_endpoint)
        return "c10d", node.rdzv_endpoint, rendezvous_configs(node.rdzv_endpoint), local_address(host, chosen)
    configs: dict[str, object] = {"is_host": node.node_rank == 0, NODE_RANK_KEY: node.node_rank,
                                  ELASTIC_KEY: node.elastic}
    return register(), f"{node.master_addr}:{node.master_port}", configs, local_address(node.master_addr, chosen)


_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


def _quiet_torch_elastic_loggers() -> None:
    """The agent's own INFO/WARNING lines (e.g. "Received 2 death signal") would repeat what dtrain says."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith(_AGENT_LOGGERS) and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)


@contextmanager
def _agent_lines_to(log: Path) -> Iterator[None]:
    """The elastic agent's lines (`failed (exitcode: 2) local_rank: 0 ...`, its error summary, its restarts) go to
    the run's `logs/agent.log`, not the console: dtrain says what happened in its own words."""
    log.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    children = [logger for name, logger in list(logging.Logger.manager.loggerDict.items())
                if name.startswith(_AGENT_LOGGERS) and isinstance(logger, logging.Logger)]
    before = [(logger, logger.level, logger.propagate) for logger in loggers + children]
    for logger in children:  # torch's get_logger() gives each module a level of its own (WARNING)
        logger.setLevel(logging.NOTSET)
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        for logger, level, propagate in before:
            logger.setLevel(level)
            logger.propagate = propagate
        handler.close()


@contextmanager
def _stopping_on_user_errors(run_dir: Path, run_id: str) -> Iterator[None]:
    """Have `elastic_launch` use `StopOnUserError` as its agent (it builds torch's LocalElasticAgent by that name
    in torch.distributed.launcher.api; pinned by tests/unit/test_torch_private_api.py)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    api.LocalElasticAgent = _stop_on_user_error_class(original, run_dir, run_id)  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        api.LocalElasticAgent = original  # type: ignore[misc]


def is_user_error(run_dir: Path, run_id: str, exit_codes: list[int]) -> bool:
    """Whether a failure of the workers is one a restart cannot mend: a worker of this launch recorded a user
    error (`fatal-error.json`), or exited with dtrain's code for one (2, or 4 for InvalidHP)."""
    return read_fatal(run_dir, run_id) is not None or any(
        code in (ExitCode.USER_ERROR, ExitCode.INVALID_HP) for code in exit_codes)


def _stop_on_user_error_class(base: type, run_dir: Path, run_id: str) -> type:
    """torchrun's local agent, except that a user error ends the run instead of a restart: after each look at the
    workers that finds them failed, no restarts are left when `is_user_error` (torch's own agent does the same
    for a worker stuck in the kernel). Before a restart after an exception in user code it says which."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    class StopOnUserError(base):
        _remaining_restarts: int  # torch's agent sets it to max_restarts and counts it down
        _last_state: Any = None

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            self._last_state = result.state
            if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or self._remaining_restarts <= 0:
                return result
            codes = [failure.exitcode for failure in (result.failures or {}).values()]
            if is_user_error(run_dir, run_id, codes):
                self._remaining_restarts = 0
            else:
                limit = worker_group.spec.max_restarts
                _announce_restart(run_dir, run_id, limit - self._remaining_restarts, limit)
            return result

        def _restart_workers(self, worker_group: Any) -> None:
            # torch restarts after a failure, or, with workers healthy, for nodes waiting to join (membership.py)
            healthy = self._last_state == WorkerState.HEALTHY
            record_restart(run_dir, "nodes_waiting" if healthy else "failure")
            super()._restart_workers(worker_group)

    return StopOnUserError


def _announce_restart(run_dir: Path, run_id: str, attempt: int, limit: int) -> None:
    """One line per distinct exception in user code that failed attempt `attempt` (a crash or a lost peer says
    nothing here: the workers say it)."""
    shown: list[Any] = []
    for found in recorded(run_dir, run_id, attempt):
        if not any(found.same_as(seen) for seen in shown):
            shown.append(found)
            print(f"dtrain: rank {found.rank}: {found.describe()}; restarting the workers from the latest checkpoint "
                  f"(restart {attempt + 1} of {limit}; traceback in {run_dir / 'logs' / f'rank-{found.rank}.log'})",
                  file=sys.stderr, flush=True)


def _loopback_rendezvous(port: int | None, keep_alive: list[object]) -> str:
    """Host the rendezvous store on 127.0.0.1 before the agent asks for it.

    TCPStore cannot be told which address to bind, but it accepts a listening socket, and a multi-tenant
    store on the same port in the same process reuses that server; so the agent's own store ends up
    listening on loopback only.
    """
    import torch.distributed as dist

    listener = bind_loopback(port or 0)
    chosen = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", chosen, is_master=True, multi_tenant=True, wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    keep_alive += [listener, store]
    return f"127.0.0.1:{chosen}"


def _describe_failure(exc: Exception, run_dir: Path) -> str:
    failures = getattr(exc, "failures", {}) or {}
    parts = []
    for rank, failure in sorted(failures.items()):
        detail = ""
        data = getattr(failure, "error_file_data", None) or {}
        message = data.get("message") if isinstance(data, dict) else None
        if isinstance(message, dict):
            text = str(message.get("message", ""))
            detail = ": " + text.strip().splitlines()[-1] if text.strip() else ""
        code = getattr(failure, "exitcode", None)
        signal = getattr(failure, "signal_name", lambda: "")()
        killed = isinstance(code, int) and code < 0 and signal
        how = f"killed by {signal}" if killed else f"exit code {code}"
        log = run_dir / "logs" / f"rank-{rank}.log"
        if killed and not detail:  # a native crash (SIGABRT, SIGSEGV) leaves its reason only in the rank's log
            last = last_log_line(log)
            detail = f" after: {last}" if last else ""
        parts.append(f"rank {rank} {how}{detail} (log: {log})")
    return "; ".join(parts) or str(exc).strip().splitlines()[0]


def last_log_line(log: Path, limit: int = 300) -> str:
    """The last non-blank line of a rank's log, cut to `limit` characters ('' when there is none): what a
    process that died by a signal printed last, e.g. C++'s `terminate called after throwing ...`."""
    try:
        with log.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - 8192, 0))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""
