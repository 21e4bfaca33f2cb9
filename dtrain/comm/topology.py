"""Who this process is (rank, local rank, node) and the process groups; the only place that creates groups.

Rank information comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), from Slurm's
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...; the master from MASTER_ADDR or the first host of the node list)
when a job step starts the workers directly, or defaults
to a single process.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dtrain.errors import LaunchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class LaunchEnv:
    """Ranks as the launcher (torchrun, Slurm or none) describes them."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    launcher: str
    master_addr: str | None
    master_port: int | None
    restart_count: int = 0


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the rank variables of torchrun or Slurm; a plain `python` start is one process."""
    env = os.environ if environ is None else environ

    def number(name: str, default: int | None = None) -> int:
        raw = env.get(name)
        if raw is None:
            if default is None:
                raise LaunchError(f"environment variable {name} is not set although the launcher's other "
                                  "rank variables are; start the workers with torchrun, srun or `dtrain run`")
            return default
        try:
            return int(raw.split("(")[0])
        except ValueError:
            raise LaunchError(f"environment variable {name}={raw!r} must be an integer") from None

    port = env.get("MASTER_PORT")
    addr = env.get("MASTER_ADDR")
    if "RANK" in env and "WORLD_SIZE" in env:
        local_world = number("LOCAL_WORLD_SIZE", number("WORLD_SIZE"))
        return LaunchEnv(rank=number("RANK"), world_size=number("WORLD_SIZE"), local_rank=number("LOCAL_RANK", 0),
                         local_world_size=local_world, node_rank=number("GROUP_RANK", number("RANK") // local_world),
                         launcher="torchrun", master_addr=addr, master_port=int(port) if port else None,
                         restart_count=number("TORCHELASTIC_RESTART_COUNT", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = number("SLURM_NTASKS")
        nodes = number("SLURM_NNODES", 1)
        local_world = number("SLURM_NTASKS_PER_NODE", world // max(nodes, 1)) if env.get(
            "SLURM_NTASKS_PER_NODE", "").split("(")[0].isdigit() else world // max(nodes, 1)
        if world > 1 or addr is not None:  # the master: exported, or the first host of the node list
            from dtrain.comm import slurm

            addr = addr or slurm.first_host(env)
            port = str(slurm.master_port(env))
        return LaunchEnv(rank=number("SLURM_PROCID"), world_size=world, local_rank=number("SLURM_LOCALID", 0),
                         local_world_size=local_world, node_rank=number("SLURM_NODEID", 0), launcher="slurm",
                         master_addr=addr, master_port=int(port) if port else None,
                         restart_count=number("SLURM_RESTART_COUNT", 0))
    return LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, launcher="none",
                     master_addr=None, master_port=None)


@dataclass(frozen=True)
class Topology:
    """Ranks, nodes, backend and device of this process once the default process group exists."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    backend: str
    device: torch.device
    launcher: str
    restart_count: int = 0
    servers: int = 0  # parameter-server processes beside the workers (ranks world_size .. world_size+servers-1)

    @property
    def is_server(self) -> bool:
        """True in a parameter-server process: it is outside the workers' process group."""
        return self.rank >= self.world_size

    @property
    def num_nodes(self) -> int:
        return max(self.world_size // max(self.local_world_size, 1), 1)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def choose_backend(requested: str, device: str = "auto") -> str:
    """nccl where CUDA is present (and the device is not the CPU), gloo otherwise; an explicit request wins if it
    can work."""
    check_devices(requested, device)
    if requested == "auto":
        return "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"
    return requested


def check_devices(backend: str, device: str) -> None:
    """LaunchError in one line where the run asks for CUDA (backend nccl, device cuda) on a machine without a GPU
    that torch can see: before any worker starts (`dtrain run`), and again in each worker."""
    if torch.cuda.is_available():
        return
    why = "torch.cuda.is_available() is False here: no GPU, no driver, or a CPU build of torch " \
          f"({torch.__version__})"
    if backend == "nccl":
        raise LaunchError(f"distributed.backend 'nccl' needs a CUDA GPU and {why}; set distributed.backend to gloo "
                          "or auto")
    if device == "cuda":
        raise LaunchError(f"distributed.device 'cuda' needs a CUDA GPU and {why}; set distributed.device to cpu or "
                          "auto")


def choose_device(backend: str, device: str, local_rank: int) -> torch.device:
    """The device a worker trains on (distributed.device): `auto` follows the backend (nccl: a GPU); a GPU is
    number local rank mod the GPUs visible, so that workers over gloo may share one."""
    if device == "cpu" or (device == "auto" and backend != "nccl"):
        return torch.device("cpu")
    return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))


def interface_addresses() -> dict[str, str]:
    """Every network interface of this machine (this network namespace) that has an IPv4 address: name -> address."""
    import fcntl
    import struct

    found: dict[str, str] = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def route_interface(master_addr: str) -> str | None:
    """The interface whose address this machine sends from to reach `master_addr` (`lo` for loopback), or None
    when no route is known (gloo then picks by the hostname)."""
    if master_addr in LOOPBACK_HOSTS:
        return "lo"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master_addr), 9))  # UDP: picks the route, sends nothing
            source = probe.getsockname()[0]
    except OSError:
        return None
    named = [name for name, address in interface_addresses().items() if address == source]
    return named[0] if named else None


_NO_ROUTE = {errno.EINVAL, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL}


def check_interface(name: str, master_addr: str | None, master_port: int | None, timeout_seconds: float) -> None:
    """Fail with one line naming the interface and the peer, instead of letting gloo hang until its timeout, when
    `name` has no address here or cannot reach the master's store (retried until the timeout while refused: the
    master may not listen yet; at once when the interface has no route there)."""
    addresses = interface_addresses()
    if name not in addresses:
        shown = ", ".join(f"{n} ({a})" for n, a in sorted(addresses.items()))
        raise LaunchError(f"network interface {name!r} has no IPv4 address on this machine (it has: {shown}); set "
                          "--network-interface / distributed.network_interface to the one that reaches the master, "
                          "or leave it out to pick it from the route")
    if master_addr is None or master_port is None or master_addr in LOOPBACK_HOSTS:
        return
    try:
        resolved = socket.gethostbyname(master_addr)  # a host name (Slurm's first host) or an address
    except OSError as exc:
        raise LaunchError(f"the master's name {master_addr!r} does not resolve on this machine "
                          f"({exc.strerror or exc}); give the master as an address, or a name every machine "
                          "resolves") from None
    if resolved in addresses.values():  # this machine is the master: its store may not listen yet
        return
    source = addresses[name]
    failure = probe_port(resolved, master_port, timeout_seconds, source)
    if failure is None:
        return
    right = route_interface(master_addr)
    hint = f" (the route to it goes through {right})" if right and right != name else ""
    raise LaunchError(f"network interface {name} ({source}) cannot reach the master {master_addr}:{master_port}"
                      f"{hint}: {failure.strerror or failure}; set --network-interface / distributed.network_interface"
                      " to the interface the machines share")


def probe_port(master_addr: str, master_port: int, timeout_seconds: float,
               source: str | None = None) -> OSError | None:
    """Connect to the master's port (from `source`'s address when given) until it accepts (None) or the timeout
    passes while refused; at once when there is no route. The last error otherwise."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.settimeout(max(min(5.0, deadline - time.monotonic()), 0.1))
                if source is not None:
                    probe.bind((source, 0))
                probe.connect((master_addr, master_port))
                return None
        except OSError as exc:
            if exc.errno in _NO_ROUTE or time.monotonic() >= deadline:
                return exc
        time.sleep(0.5)


def check_master_reachable(master_addr: str, master_port: int, timeout_seconds: float) -> None:
    """Before a node other than the chief starts its agent: one line when the master's name does not resolve here,
    or its rendezvous port cannot be reached (at once without a route; within `timeout_seconds` while refused, as
    the chief may not listen yet), instead of the agent's rendezvous timing out with a traceback."""
    if master_addr in LOOPBACK_HOSTS:
        return
    here = socket.gethostname()
    try:
        address = socket.gethostbyname(master_addr)
    except OSError as exc:
        raise LaunchError(f"this node ({here}) cannot resolve the master's name {master_addr!r} ({exc.strerror or exc}"
                          "); give --master-addr a name or address of node 0 that every node resolves (under Slurm: "
                          "export MASTER_ADDR before srun)") from None
    failure = probe_port(address, master_port, timeout_seconds)
    if failure is None:
        return
    shown = master_addr if address == master_addr else f"{master_addr} ({address})"
    raise LaunchError(f"this node ({here}) cannot reach the master {shown}:{master_port}: "
                      f"{failure.strerror or failure}; every node must reach node 0 at --master-addr/--master-port: "
                      "give an address of node 0 on the network the nodes share (under Slurm the default is the "
                      "first host of the node list), and check that no firewall blocks the port")


def choose_interface(requested: str | None, launch: LaunchEnv, timeout_seconds: float) -> None:
    """Export GLOO_SOCKET_IFNAME (and TP_SOCKET_IFNAME for RPC) for this worker: the requested interface, one the
    user exported already, or the one that routes to the master; checked before gloo would hang on it."""
    name = requested or os.environ.get("GLOO_SOCKET_IFNAME") or (
        route_interface(launch.master_addr) if launch.master_addr else None)
    if name is None:
        return
    check_interface(name, launch.master_addr, launch.master_port, timeout_seconds)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ.setdefault("TP_SOCKET_IFNAME", name)


def init_distributed(*, backend: str = "auto", timeout_seconds: float = 600.0,
                     environ: Mapping[str, str] | None = None, servers: int = 0,
                     network_interface: str | None = None, device: str = "auto") -> Topology:
    """Create the default process group from the launcher's environment and describe this process.

    With `servers` > 0 the launcher started that many parameter-server processes beside the workers: the
    last `servers` ranks. The default group then holds the workers only, and every process keeps the
    job's store for the RPC group that joins workers and servers (`dtrain.comm.rpc`). `device`: as
    distributed.device says (`choose_device`)."""
    launch = read_launch_env(environ)
    if choose_backend(backend, device) == "gloo" and (launch.world_size > 1 or launch.master_addr is not None):
        choose_interface(network_interface, launch, timeout_seconds)
    if servers:
        return _init_with_servers(launch, backend, timeout_seconds, environ, servers, device)
    chosen = choose_backend(backend, device)
    where = choose_device(chosen, device, launch.local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_seconds)
        if launch.world_size == 1 and launch.master_addr is None:
            dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            if chosen == "gloo" and launch.master_addr in LOOPBACK_HOSTS:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if launch.launcher == "slurm":
                _export_slurm_ranks(launch)
            store = _loopback_store(launch, timeout, environ) if _owns_loopback_store(launch, environ) else None
            dist.init_process_group(chosen, store=store, rank=launch.rank, world_size=launch.world_size,
                                    timeout=timeout)
    return Topology(rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank,
                    local_world_size=launch.local_world_size, node_rank=launch.node_rank, backend=chosen,
                    device=where, launcher=launch.launcher, restart_count=launch.restart_count)


def _init_with_servers(launch: LaunchEnv, backend: str, timeout_seconds: float,
                       environ: Mapping[str, str] | None, servers: int, device_setting: str = "auto") -> Topology:
    workers = launch.world_size - servers
    if workers < 1:
        raise LaunchError(f"the parameter-server strategy needs {servers} server process(es) besides at least one "
                          f"worker, but the launcher started {launch.world_size} process(es) in all; start "
                          f"slots_per_trial + {servers} processes (dtrain run does; with torchrun or srun raise "
                          "--nproc-per-node / --ntasks)")
    chosen = choose_backend(backend, device_setting)
    device = (choose_device(chosen, device_setting, launch.local_rank) if launch.rank < workers
              else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_seconds)
    if chosen == "gloo" and launch.master_addr in LOOPBACK_HOSTS:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if launch.master_addr in LOOPBACK_HOSTS:
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # the RPC agent's transport, on loopback as well
    if launch.launcher == "slurm":
        _export_slurm_ranks(launch)
    if _owns_loopback_store(launch, environ):
        store: dist.Store = _loopback_store(launch, timeout, environ)
    else:
        store, _, _ = next(dist.rendezvous("env://", rank=launch.rank, world_size=launch.world_size, timeout=timeout))
    JOB_STORE.clear()
    JOB_STORE.append(store)
    if launch.rank < workers and not dist.is_initialized():
        dist.init_process_group(chosen, store=dist.PrefixStore("workers", store), rank=launch.rank,
                                world_size=workers, timeout=timeout)
    return Topology(rank=launch.rank, world_size=workers, local_rank=launch.local_rank,
                    local_world_size=launch.local_world_size, node_rank=launch.node_rank, backend=chosen,
                    device=device, launcher=launch.launcher, restart_count=launch.restart_count, servers=servers)


def _export_slurm_ranks(launch: LaunchEnv) -> None:
    """What torch's env:// rendezvous and the Trial read, from Slurm's variables (the master possibly derived from
    the node list)."""
    os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
                      MASTER_ADDR=str(launch.master_addr), MASTER_PORT=str(launch.master_port))


# The store of a job with parameter servers (all processes), kept for the RPC group.
JOB_STORE: list[dist.Store] = []


def _owns_loopback_store(launch: LaunchEnv, environ: Mapping[str, str] | None) -> bool:
    """True when the workers' store is on a loopback master and not torch's shared agent store: `dtrain run`'s own
    store, or one that rank 0 hosts (see `_loopback_store`)."""
    env = os.environ if environ is None else environ
    return (launch.master_addr in LOOPBACK_HOSTS and launch.master_port is not None
            and env.get("TORCHELASTIC_USE_AGENT_STORE", "False") != "True")


def _loopback_store(launch: LaunchEnv, timeout: timedelta, environ: Mapping[str, str] | None = None) -> dist.Store:
    """The workers' key-value store on loopback.

    Under `dtrain run` on one machine it is the launcher's own store (JOB_STORE_ENV; it listens on 127.0.0.1 from
    before the agent starts until the run ends), under a prefix of this attempt. So no port is released between
    the agent choosing it and rank 0 binding it (the window of torch's get_free_port), and a restarted attempt
    never reads an earlier attempt's keys: one agent starts every worker of an attempt with the same restart
    count. Otherwise (plain torchrun with a loopback master) rank 0 hosts it, its server bound to 127.0.0.1 only
    (TCPStore binds to every interface)."""
    env = os.environ if environ is None else environ
    shared = env.get(JOB_STORE_ENV)
    if shared:
        host, port = shared.rsplit(":", 1)
        client = dist.TCPStore(host, int(port), launch.world_size, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"dtrain/workers/attempt-{launch.restart_count}", client)
    assert launch.master_port is not None
    if launch.rank != 0:
        return dist.TCPStore("127.0.0.1", launch.master_port, launch.world_size, is_master=False, timeout=timeout)
    listener = bind_loopback(launch.master_port)
    store = dist.TCPStore("127.0.0.1", launch.master_port, launch.world_size, is_master=True, timeout=timeout,
                          master_listen_fd=listener.fileno(), wait_for_workers=False)
    _KEEP_ALIVE.append(listener)
    return store


_KEEP_ALIVE: list[socket.socket] = []
JOB_STORE_ENV = "DTRAIN_JOB_STORE"  # 127.0.0.1:PORT of `dtrain run`'s own store, on one machine (dtrain/launch.py)


def bind_loopback(port: int = 0) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 (port 0 picks a free one)."""
    return bind_listener("127.0.0.1", port)


def bind_listener(address: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on an IPv4 `address` ('0.0.0.0': every interface; port 0 picks a free one)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(512)
    except OSError:
        listener.close()
        raise
    return listener


@dataclass(frozen=True)
class NodeGroups:
    """The two levels of a cluster of `nodes` x `local_size` ranks (rank r sits on node r // local_size):
    `local` holds this node's ranks, `cross` the ranks with this local rank on every node (one per node).
    `leader` is the global rank of this node's local rank 0, which stands for the node between nodes."""

    local: dist.ProcessGroup
    cross: dist.ProcessGroup
    nodes: int
    local_size: int
    local_rank: int
    leader: int

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0


_NODE_GROUPS: dict[tuple[int, int], NodeGroups] = {}


def node_groups(topology: Topology) -> NodeGroups:
    """This rank's node-local and cross-node process groups, created once per layout by every rank together
    (new_group is collective over the default group: all ranks create every group, in the same order)."""
    world, local = topology.world_size, max(topology.local_world_size, 1)
    if world % local:
        raise LaunchError(f"{world} ranks cannot be cut into nodes of {local} (LOCAL_WORLD_SIZE); every node must "
                          "run the same number of workers")
    key = (world, local)
    if key not in _NODE_GROUPS:
        nodes = world // local
        mine_local = mine_cross = None
        for node in range(nodes):
            group = dist.new_group(list(range(node * local, (node + 1) * local)))
            if topology.rank // local == node:
                mine_local = group
        for index in range(local):
            group = dist.new_group(list(range(index, world, local)))
            if topology.rank % local == index:
                mine_cross = group
        assert mine_local is not None and mine_cross is not None
        _NODE_GROUPS[key] = NodeGroups(local=mine_local, cross=mine_cross, nodes=nodes, local_size=local,
                                       local_rank=topology.rank % local, leader=topology.rank - topology.rank % local)
    return _NODE_GROUPS[key]


def shutdown_distributed() -> None:
    """Destroy the default process group (and the node groups made from it) if there is one."""
    _NODE_GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def device_mesh(topology: Topology, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The workers as a DeviceMesh of `shape` (row-major over the ranks: with shape (d, p), ranks i*p .. i*p+p-1
    form row i, e.g. one pipeline replica or one node's shard group); every rank calls this together, once per
    layout, since it creates a process group per mesh dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    total = 1
    for size in shape:
        total *= size
    if total != topology.world_size:
        raise LaunchError(f"a device mesh of shape {shape} needs {total} workers, the run has {topology.world_size}")
    return init_device_mesh(topology.device.type, shape, mesh_dim_names=names)
