"""`dtrain horovodrun`'s engine: turn horovodrun's options into a torchrun elastic-agent launch of any command,
each process started through `dtrain.horovod.exec` (Horovod's variables, the `horovod` shim)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.errors import LaunchError
from dtrain.runs.processes import threads_per_process

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass
class HorovodRun:
    """What one `dtrain horovodrun` asks for."""

    command: list[str]
    np: int | None = None
    hosts: list[tuple[str, int]] = field(default_factory=list)
    node_rank: int | None = None
    master_port: int = 29411
    network_interface: str | None = None
    start_timeout: float = 30.0
    timeline_filename: str | None = None
    timeline_mark_cycles: bool = False
    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    cache_capacity: int | None = None
    hierarchical_allreduce: bool = False
    autotune: bool = False
    min_np: int | None = None
    max_np: int | None = None
    reset_limit: int | None = None
    host_discovery_script: str | None = None
    force: bool = False
    verbose: bool = False

    @property
    def elastic(self) -> bool:
        return self.min_np is not None or self.max_np is not None


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """`host1:2,host2:4` (or one per line, `host slots=4` as in a hostfile) -> [(host, slots), ...]."""
    hosts = []
    for item in text.replace("\n", ",").split(","):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        if "slots=" in item:
            name, _, slots = item.partition("slots=")
            name, count = name.strip(), slots.strip()
        else:
            name, _, count = item.partition(":")
        try:
            hosts.append((name.strip(), int(count) if count else 1))
        except ValueError:
            raise LaunchError(f"host {item!r}: the slot count must be a whole number, e.g. {name.strip()}:2") from None
    if not hosts:
        raise LaunchError(f"no hosts in {text!r}: give host:slots pairs such as localhost:2")
    return hosts


def is_local(host: str) -> bool:
    return host in LOCAL_NAMES or host == socket.gethostname() or host == socket.getfqdn()


def real_horovod_installed() -> bool:
    """Whether a real Horovod (not dtrain's shim) is importable by this interpreter."""
    spec = importlib.util.find_spec("horovod")
    return spec is not None and "dtrain" not in str(spec.origin or "")


def environment(run: HorovodRun, state_dir: Path) -> dict[str, str]:
    """The variables every process gets, from horovodrun's options (Horovod's names, so scripts see them), and the
    malloc settings dtrain run gives its workers."""
    from dtrain.config.distributed import DEFAULT_MALLOC_TRIM_THRESHOLD_MB
    from dtrain.launch import malloc_environment

    env = {"DTRAIN_HOROVOD_STATE_DIR": str(state_dir), **malloc_environment(DEFAULT_MALLOC_TRIM_THRESHOLD_MB)}
    env["DTRAIN_HOROVOD_SHIM"] = "1" if run.force or not real_horovod_installed() else "0"
    env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(run.start_timeout))
    if run.network_interface:
        env["GLOO_SOCKET_IFNAME"] = run.network_interface
    if run.timeline_filename:
        env["HOROVOD_TIMELINE"] = run.timeline_filename
    if run.timeline_mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if run.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(run.fusion_threshold_mb * 1024 * 1024))
    if run.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = str(run.cycle_time_ms)
    if run.cache_capacity is not None:
        env["HOROVOD_CACHE_CAPACITY"] = str(run.cache_capacity)
    if run.hierarchical_allreduce:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    if run.autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
    if run.elastic:
        env["HOROVOD_ELASTIC"] = "1"
    return env


def layout(run: HorovodRun) -> tuple[int, int, int, str]:
    """(nodes, processes on this node, this node's rank, master address) for the launch."""
    hosts = run.hosts or [("localhost", run.np or 1)]
    total = sum(slots for _, slots in hosts)
    np = run.np or total
    if run.elastic and run.min_np is not None and run.max_np is not None and run.min_np > run.max_np:
        raise LaunchError(f"--min-np {run.min_np} is above --max-np {run.max_np}")
    if all(is_local(name) for name, _ in hosts):
        if np > total and run.hosts:
            raise LaunchError(f"-np {np} is more than the {total} slot(s) the hosts offer ({hosts}); lower -np or "
                              "add slots")
        return 1, np, 0, "127.0.0.1"
    if run.node_rank is None:
        raise LaunchError("dtrain horovodrun does not start processes on other machines over ssh: run the same "
                          "command on each host listed in -H with --node-rank i (i = its position in the list)")
    if not 0 <= run.node_rank < len(hosts):
        raise LaunchError(f"--node-rank {run.node_rank} is not a position in -H's {len(hosts)} hosts")
    if np != total:
        raise LaunchError(f"-np {np} must equal the slots of the hosts in -H ({total}) on several machines")
    slots = {s for _, s in hosts}
    if len(slots) != 1:
        raise LaunchError(f"every host needs the same number of slots on several machines, got {hosts}")
    return len(hosts), hosts[run.node_rank][1], run.node_rank, hosts[0][0]


def discover_hosts(script: str) -> list[tuple[str, int]]:
    """Run a host discovery script (horovodrun --host-discovery-script): one `host:slots` (or `host`, 1 slot)
    per line; anything else is refused with the line it printed."""
    if not os.path.isfile(script):
        raise LaunchError(f"--host-discovery-script {script}: no such file; give the path of an executable that "
                          "prints host:slots lines")
    if not os.access(script, os.X_OK):
        raise LaunchError(f"--host-discovery-script {script} is not executable: chmod +x {script}")
    try:
        output = subprocess.run([os.path.abspath(script)], capture_output=True, text=True, check=True,
                                timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise LaunchError(f"--host-discovery-script {script} failed: {error}") from None
    hosts = []
    for line in output.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, count = line.rpartition(":") if ":" in line else (line, "", "1")
        if not name or any(c.isspace() for c in name) or not count.isdigit() or int(count) < 1:
            raise LaunchError(f"--host-discovery-script {script} printed {line!r}: each line must be host:slots "
                              "with slots >= 1, e.g. localhost:2")
        hosts.append((name, int(count)))
    if not hosts:
        raise LaunchError(f"--host-discovery-script {script} printed no hosts: it must print host:slots lines")
    return hosts


def launch(run: HorovodRun) -> int:
    """Run the command on every slot through torchrun's agent; the exit code of the job. (An elastic run,
    `run.elastic`, goes to `elastic_driver.launch_elastic` instead: the job follows its members, not torchrun's
    restarts.)"""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from dtrain.launch import _loopback_rendezvous, _quiet_torch_elastic_loggers

    nodes, nproc, node_rank, master = layout(run)
    keep_alive: list[object] = []
    rdzv_configs: dict[str, object]
    local_addr: str | None = "127.0.0.1"
    if nodes == 1:
        endpoint, backend, rdzv_configs = _loopback_rendezvous(None, keep_alive), "c10d", {"is_host": True}
    else:  # torch's c10d rendezvous keeping --node-rank: a failure on one host restarts every host's processes
        from dtrain.comm.rendezvous import NODE_RANK_KEY, local_address, register

        endpoint, backend = f"{master}:{run.master_port}", register()
        rdzv_configs = {"is_host": node_rank == 0, NODE_RANK_KEY: node_rank}
        from dtrain.comm.topology import interface_addresses

        chosen = interface_addresses().get(run.network_interface) if run.network_interface else None
        local_addr = local_address(master, chosen)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # never the agent's shared store (docs/clusters.md)
    rdzv_configs["join_timeout"] = int(run.start_timeout)
    state_dir = Path(tempfile.mkdtemp(prefix="dtrain-horovodrun-"))
    os.environ.update(environment(run, state_dir))
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_process(nproc, os.environ))
    restarts = run.reset_limit if run.reset_limit is not None else 0
    run_id = state_dir.name if nodes == 1 else f"dtrain-horovodrun-{master}-{run.master_port}"  # the same on every host
    config = LaunchConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=nproc, run_id=run_id,
                          rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs,
                          max_restarts=restarts, monitor_interval=0.2,
                          local_addr=local_addr)
    if not run.verbose:
        _quiet_torch_elastic_loggers()
    try:
        elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "dtrain.horovod.exec", "--", *run.command)
    except ChildFailedError as error:
        failures = getattr(error, "failures", {}) or {}
        codes = ", ".join(f"rank {rank}: exit code {f.exitcode}" for rank, f in sorted(failures.items()))
        print(f"dtrain horovodrun: {' '.join(run.command)} failed ({codes or error})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
