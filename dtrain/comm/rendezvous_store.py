"""A rendezvous store that outlives the training nodes: `dtrain rendezvous` serves torch's c10d TCPStore on a host
that stays (a login or head node), and `dtrain run --rdzv-endpoint HOST:PORT` on every node joins torch's c10d
rendezvous there as a client. No agent hosts the store, so any node can be lost, node 0 included: torchrun's c10d
backend otherwise hosts it inside the agent of the node whose address the endpoint names, and it dies with that node.

Three things a store that outlives one job must mind. A node decides whether to host the store itself: it does not
when something already answers at the endpoint (`is_host: false` in the rendezvous configs), and hosts it, as
torchrun's users know it, only where the endpoint is one of its own addresses and nothing answers yet. An endpoint
that nobody serves is one line before the agent starts. And a job that ends closes its rendezvous for good (torch's
launcher calls `shutdown()`, which marks the rendezvous state `closed`): the next job with the same id on the same
store would fail at once, so `reopen_if_closed` starts a closed rendezvous again, at the round after its last, so
that no key of the ended job's rounds is read by the new one.
"""

from __future__ import annotations

import pickle
import socket
from datetime import timedelta

import torch.distributed as dist

from dtrain.comm.topology import bind_listener, interface_addresses, probe_port
from dtrain.errors import LaunchError

DEFAULT_PORT = 29400  # torchrun's default c10d rendezvous port
SERVED_WAIT_SECONDS = 60.0  # how long a node waits for a store that does not answer yet (started at the same time):
# torch's own read timeout of the c10d store, after which its agent would fail with a traceback


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); anything else one line: the value, the rule, the fix."""
    host, colon, port = endpoint.strip().rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT with a TCP port 1..65535, e.g. "
                          f"login1:{DEFAULT_PORT}, where `dtrain rendezvous --port PORT` serves the store")
    return host.strip("[]"), int(port)


def serve_store(host: str, port: int) -> dist.TCPStore:
    """A c10d TCPStore listening on `host:port` ('0.0.0.0': every interface), multi-tenant as torch's c10d
    rendezvous backend creates its own; it serves while the returned store lives. One line when the address cannot
    be bound."""
    try:
        listener = bind_listener(host, port)
    except OSError as exc:
        raise LaunchError(f"dtrain rendezvous cannot listen on {host}:{port} ({exc.strerror or exc}); give a free "
                          "--port, and a --host that is one of this machine's addresses (or 0.0.0.0)") from None
    own = "127.0.0.1" if host in ("0.0.0.0", "") else host
    try:
        store = dist.TCPStore(own, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it when it goes
    return store


def served(host: str, port: int, wait_seconds: float = 0.0) -> OSError | None:
    """None when something accepts connections at host:port (within `wait_seconds` while refused, at once when
    there is no route), else the last error."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        return exc
    return probe_port(address, port, wait_seconds)


def is_own_address(host: str) -> bool:
    """Whether `host` names this machine (one of its interface addresses, or its host name)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address in interface_addresses().values() or host in (socket.gethostname(), socket.getfqdn())


def check_endpoint(endpoint: str, wait_seconds: float = SERVED_WAIT_SECONDS) -> None:
    """Before the agent starts: one line when nothing serves the rendezvous at `endpoint` and this node would not
    host it either (the endpoint is not one of its addresses), after waiting up to `wait_seconds` while refused
    (the store may be starting too), at once when the host does not resolve or has no route."""
    host, port = parse_endpoint(endpoint)
    if is_own_address(host):
        return  # served here already, or this node's agent hosts it (torchrun's form; the node must then stay)
    here = socket.gethostname()
    failure = served(host, port, wait_seconds)
    if failure is None:
        return
    reason = failure.strerror or str(failure) or type(failure).__name__
    waited = f", waited {wait_seconds:.0f} s" if wait_seconds >= 1 else ""
    raise LaunchError(f"nothing serves the rendezvous at --rdzv-endpoint {endpoint} ({reason}{waited}, seen from "
                      f"{here}); "
                      f"start the store there first with `dtrain rendezvous --port {port}` on {host} (a host that "
                      "outlives the training nodes), or give the endpoint of one that runs")


def rendezvous_configs(endpoint: str) -> dict[str, object]:
    """The c10d rendezvous configs of a node that joins at `endpoint`: a client (`is_host: false`) when a store
    answers there already or the endpoint is another machine's; the host where it names one of this machine's
    addresses and nothing answers yet (said outright: torch's own guess compares the endpoint with the addresses
    the host name resolves to, which need not be the interface the nodes share)."""
    host, port = parse_endpoint(endpoint)
    return {"is_host": served(host, port) is not None and is_own_address(host)}


def reopen_if_closed(endpoint: str, run_id: str, timeout_seconds: float = 60.0) -> int | None:
    """When the rendezvous `run_id` in the store at `endpoint` was closed by a job that ended, start it again at the
    round after its last (a compare-and-set: of nodes that start together, one reopens and the others find it
    open); the new round, or None when it was not closed (or nothing serves there)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    host, port = parse_endpoint(endpoint)
    if served(host, port) is not None:
        return None  # nothing there yet: this node's agent hosts a new store
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_seconds))
    except (RuntimeError, ValueError, TimeoutError):
        return None  # the agent's own connection says what is wrong
    backend = C10dRendezvousBackend(store, run_id)
    found = backend.get_state()
    if found is None:
        return None
    state = pickle.loads(found[0])  # noqa: S301 (torch's own rendezvous state, as its state holder reads it)
    if not getattr(state, "closed", False):
        return None
    fresh = _RendezvousState()
    fresh.round = int(state.round) + 1
    written = backend.set_state(pickle.dumps(fresh), found[1])
    if written is None or not written[2]:  # another node reopened it first: fine
        return None
    return fresh.round
