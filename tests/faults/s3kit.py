"""A real S3-compatible server for the tests: moto's server (`python -m moto.server`) on loopback, started as a
process and stopped by its pid; dtrain talks to it through s3fs exactly as to AWS (nothing inside dtrain is
mocked). Tests that need it skip, saying why, when moto, flask, flask-cors or s3fs is not installed
(`pip install -e '.[dev,s3]'` installs them).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Credentials moto accepts (it checks none unless told to); dtrain gets them like any AWS credentials.
KEY, SECRET = "AKIADTRAINTESTKEY0001", "dtrain-test-secret-value-0001"
PACKAGES = ("moto", "flask", "flask_cors", "s3fs")


def missing_packages() -> str | None:
    """Why the S3 tests cannot run here, or None."""
    absent = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if absent:
        return f"needs {', '.join(absent)} (pip install -e '.[dev,s3]')"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def moto_server(*, require_auth: bool = False) -> Iterator[str]:
    """Start moto's S3 server on a free loopback port and yield its endpoint URL; stop it by its pid. With
    `require_auth` the server checks credentials (moto's INITIAL_NO_AUTH_ACTION_COUNT=0), so any key is wrong. It
    runs in a session of its own: where the kernel groups CPU time by session (autogroup), it takes a share of its
    own, as another user's process would, not a share of the caller's (a server on other machines takes none)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if require_auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                               start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start on port {port}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def client_env(endpoint: str) -> dict[str, str]:
    """The usual AWS environment pointing at the local server."""
    return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint}


def filesystem(endpoint: str) -> Any:
    """An s3fs filesystem on the local server (the test's own view of the bucket)."""
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, key=KEY, secret=SECRET, use_listings_cache=False,
                             skip_instance_cache=True)


def make_bucket(endpoint: str, name: str) -> None:
    filesystem(endpoint).mkdir(name)
