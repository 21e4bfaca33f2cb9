"""`dtrain dashboard`: a search's Optuna study in the browser, served by optuna-dashboard (`pip install
'dtrain[dashboard]'`): trials, their metric history, intermediate values, hyperparameter importances.

A search keeps its study in `<search dir>/study.db` (or the `--storage` URL it was given); this reads it where it is
and serves it until Ctrl-C. Nothing is copied or changed.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from dtrain.errors import ConfigError, ExitCode


def register(subcommands: Any) -> argparse.ArgumentParser:
    dashboard = subcommands.add_parser(
        "dashboard", help="serve a search's Optuna study in the browser (optuna-dashboard)",
        description="Serve the Optuna study of a search with optuna-dashboard until Ctrl-C: its trials, metric "
                    "history and hyperparameter importances in the browser.")
    dashboard.add_argument("search", help="a search dir (its study.db), or the study's storage URL (sqlite:///..., "
                                          "postgresql://...) given to the search as --storage")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this "
                                                               "machine only; 0.0.0.0 for every interface)")
    dashboard.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    dashboard.set_defaults(handler=run_dashboard)
    return dashboard


def storage_of(search: str) -> str:
    """The study's storage URL: the URL as given, or a search dir's study.db."""
    from dtrain.search.runner import STUDY_FILE

    if "://" in search:
        return search
    study = Path(search) / STUDY_FILE
    if not study.is_file():
        raise ConfigError(f"{search} holds no {STUDY_FILE}: give a search dir (`dtrain run SEARCH.yaml "
                          "--search-dir DIR` makes one) or the study's storage URL")
    return f"sqlite:///{study.resolve()}"


def run_dashboard(args: argparse.Namespace) -> int:
    storage = storage_of(args.search)
    if importlib.util.find_spec("optuna_dashboard") is None:
        raise ConfigError("dtrain dashboard needs the optuna-dashboard package, which is not installed; "
                          "pip install 'dtrain[dashboard]' (optuna-dashboard)")
    from optuna_dashboard import wsgi

    try:
        server = _server(args.host, args.port, wsgi(storage))
    except OSError as exc:
        raise ConfigError(f"dtrain dashboard cannot listen on {args.host}:{args.port} ({exc.strerror}); give "
                          "another --port") from None
    print(f"dtrain dashboard: {storage} at http://{args.host}:{args.port}/dashboard/ (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    _serve_until_stopped(server)
    return ExitCode.OK


def _server(host: str, port: int, app: Any) -> WSGIServer:
    """optuna-dashboard's WSGI app on the standard library's WSGI server (what its own `run_server` uses)."""
    return make_server(host, port, app, server_class=_WSGIServer6 if ":" in host else WSGIServer)


class _WSGIServer6(WSGIServer):
    """The WSGI server on an IPv6 address (`--host ::`)."""

    address_family = socket.AF_INET6


def _serve_until_stopped(server: WSGIServer) -> None:
    """Serve in a thread until Ctrl-C or SIGTERM, then close the socket. The server thread handles the requests
    and this one only waits for the signal: a Ctrl-C that lands while a request is handled in the main thread is
    swallowed by wsgiref's error handler (the dashboard's page polls, so that happens), and a process started
    with SIGINT ignored (a background job of a script) would never see Ctrl-C at all."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                              name="dtrain-dashboard")
    thread.start()
    try:
        while not stop.wait(0.2):
            pass
    finally:
        server.shutdown()
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
