"""`dtrain rendezvous`: serve the c10d rendezvous store of multi-node jobs from a host that outlives the training
nodes, so that a job started with `dtrain run --rdzv-endpoint HOST:PORT` on every node survives losing any node,
node 0 included (dtrain.comm.rendezvous_store)."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from typing import Any

from dtrain.errors import ExitCode


def register(subcommands: Any) -> argparse.ArgumentParser:
    rendezvous = subcommands.add_parser(
        "rendezvous", help="serve the rendezvous store of multi-node jobs from a host that stays (login/head node)",
        description="Serve torch's c10d rendezvous store (a TCPStore) until Ctrl-C or SIGTERM, for jobs whose "
                    "nodes run `dtrain run --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`: every node's agent is a "
                    "client, so the job goes on when any node is lost, node 0 included. Run it on a host that "
                    "outlives the training nodes; one store serves many jobs (each its own --rdzv-id), and a job "
                    "that ended may be started again with the same id.",
        epilog="Example: `dtrain rendezvous --port 29400` on login1, then `dtrain run exp.yaml --nnodes 1:4 "
               "--rdzv-endpoint login1:29400 --run-dir /shared/runs/exp1` on each node (docs/clusters.md, "
               "Losing node 0).")
    rendezvous.add_argument("--host", default="0.0.0.0",
                            help="IPv4 address to listen on (default 0.0.0.0: every interface of this machine)")
    rendezvous.add_argument("--port", type=int, default=29400, help="port to listen on (default 29400, torchrun's)")
    rendezvous.set_defaults(handler=run_rendezvous)
    return rendezvous


def run_rendezvous(args: argparse.Namespace) -> int:
    from dtrain.comm.rendezvous_store import serve_store

    store = serve_store(args.host, args.port)
    shown = socket.gethostname() if args.host == "0.0.0.0" else args.host
    print(f"dtrain rendezvous: serving on {args.host}:{args.port} (Ctrl-C to stop); on every node run `dtrain run "
          f"CONFIG --nnodes MIN:MAX --rdzv-endpoint {shown}:{args.port}`", file=sys.stderr, flush=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del store  # closes the listening socket
    print("dtrain rendezvous: stopped", file=sys.stderr, flush=True)
    return ExitCode.OK
