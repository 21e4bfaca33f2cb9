"""A real MLflow tracking server for tests: `mlflow server` on loopback with a SQLite backend and an artifact folder
in a temporary directory, started in a session of its own and stopped by its process group id (it runs uvicorn
and a job runner as children)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import free_port

START_SECONDS = 240.0  # `mlflow server` answers /health after ~25 s on an idle 2-core machine; more when busy


class MlflowServer:
    """`with MlflowServer(folder) as server:` ... `server.uri`; `server.stop()` ends it early (a server gone)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MlflowServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "server.log", "wb")  # noqa: SIM115 - the server holds it until it stops
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.folder)
        log.close()
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.folder / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mlflow server did not come up on {self.uri}:\n{tail}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group (SIGKILL after 5 s: its job runner may not stop); waits for it."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        except ProcessLookupError:
            pass
        try:  # the job runner child, should it outlive the server
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc: object) -> None:
        self.stop()
