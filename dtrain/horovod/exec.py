"""What each process of `dtrain horovodrun` runs first (`python -m dtrain.horovod.exec CMD ...`): translate
torchrun's variables into the ones Horovod's gloo launcher sets, put the `horovod` shim first on PYTHONPATH
(unless the real Horovod is wanted), and exec the user's command in place of this process."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "shim"
PYTHONS = {"python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}"}


def horovod_environment(environ: dict[str, str]) -> dict[str, str]:
    """HOROVOD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE, _HOSTNAME and the gloo
    rendezvous variables, from torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
    GROUP_WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    values = {
        "HOROVOD_RANK": environ["RANK"], "HOROVOD_SIZE": environ["WORLD_SIZE"],
        "HOROVOD_LOCAL_RANK": environ["LOCAL_RANK"], "HOROVOD_LOCAL_SIZE": environ["LOCAL_WORLD_SIZE"],
        "HOROVOD_CROSS_RANK": environ.get("GROUP_RANK", "0"),
        "HOROVOD_CROSS_SIZE": environ.get("GROUP_WORLD_SIZE", str(int(environ["WORLD_SIZE"]) // max(
            int(environ["LOCAL_WORLD_SIZE"]), 1))),
        "HOROVOD_HOSTNAME": socket.gethostname(), "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": environ.get("MASTER_ADDR", "127.0.0.1"),
        "HOROVOD_GLOO_RENDEZVOUS_PORT": environ.get("MASTER_PORT", ""),
    }
    if "GLOO_SOCKET_IFNAME" in environ:
        values["HOROVOD_GLOO_IFACE"] = environ["GLOO_SOCKET_IFNAME"]
    return values


def main() -> None:
    command = sys.argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        sys.exit("dtrain.horovod.exec: no command to run")
    environ = dict(os.environ)
    environ.update(horovod_environment(environ))
    if environ.get("DTRAIN_HOROVOD_SHIM") == "1":
        environ["PYTHONPATH"] = os.pathsep.join([str(SHIM), *filter(None, [environ.get("PYTHONPATH")])])
    if environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost"):
        environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if command[0] in PYTHONS:  # the interpreter dtrain runs in, even when the venv is not activated
        command = [sys.executable, *command[1:]]
    executable = shutil.which(command[0]) or command[0]
    try:
        os.execve(executable, command, environ)
    except OSError as error:
        sys.exit(f"dtrain horovodrun: cannot run {command[0]!r}: {error.strerror}")


if __name__ == "__main__":
    main()
