"""A command entrypoint (`python3 train.py --epochs 1`): checked before any worker starts, then run on each slot.

Each worker process dtrain's launcher starts becomes the command (exec, so the elastic agent watches and restarts
the command itself): in the experiment file's directory (Determined runs it in the context directory), with
torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), `DTRAIN_RUN_DIR` for `det.get_cluster_info()` (the
hyperparameters, the latest checkpoint), and the `determined` shim on PYTHONPATH when the real package is not
installed. `python`/`python3` at the head of the command is the interpreter dtrain runs in, so a user who calls
`.venv/bin/dtrain` without activating the environment gets the same packages in the script.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from dtrain.determined import pythonpath_with_shim
from dtrain.determined.cluster import RUN_DIR_ENV
from dtrain.errors import ConfigError

_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")


def resolve_argv(argv: Sequence[str]) -> list[str]:
    """The command with `python`/`python3`/`python3.X` at its head replaced by this interpreter."""
    command = list(argv)
    if command and _PYTHON.match(command[0]):
        command[0] = sys.executable
    return command


def check_command(argv: Sequence[str], config_dir: Path) -> None:
    """ConfigError (one line) when the command's program or script cannot be found from the experiment file's
    directory, before any worker starts."""
    shown = " ".join(argv)
    head = argv[0]
    if _PYTHON.match(head):
        rest = list(argv[1:])
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest.pop(0)  # interpreter options such as -u
        if not rest or rest[0] in ("-m", "-c"):
            return  # a module or inline code: the interpreter reports it
        script = Path(rest[0])
        where = script if script.is_absolute() else config_dir / script
        if not where.is_file():
            raise ConfigError(f"entrypoint command `{shown}`: script {rest[0]} does not exist in {config_dir} "
                              "(commands run in the experiment file's directory); fix the path in `entrypoint`")
        return
    program = Path(head)
    if "/" in head:
        found = (program if program.is_absolute() else config_dir / program)
        if not found.is_file() or not os.access(found, os.X_OK):
            raise ConfigError(f"entrypoint command `{shown}`: {head} is not an executable file in {config_dir}; fix "
                              "the path or start it with `python3`")
    elif shutil.which(head) is None and not (config_dir / head).is_file():
        raise ConfigError(f"entrypoint command `{shown}`: program {head} is not found on PATH or in {config_dir}; "
                          "fix `entrypoint` (e.g. `python3 train.py`)")


def command_environment(environ: Mapping[str, str], run_dir: Path) -> dict[str, str]:
    """The command's variables: the worker's, the run dir, and the `determined` shim on PYTHONPATH."""
    env = dict(environ)
    env[RUN_DIR_ENV] = str(run_dir.resolve())
    path = pythonpath_with_shim(env.get("PYTHONPATH"))
    if path:
        env["PYTHONPATH"] = path
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def exec_command(argv: Sequence[str], run_dir: Path, config_dir: Path, rank: int) -> NoReturn:
    """Replace this worker process with the command (ranks other than 0 write to `logs/rank-<r>.log`)."""
    command = resolve_argv(argv)
    env = command_environment(os.environ, run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if rank != 0:
        fd = os.open(logs / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.chdir(config_dir)
    executable = command[0] if "/" in command[0] else (shutil.which(command[0], path=env.get("PATH"))
                                                      or str(config_dir / command[0]))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(executable, command, env)
    except OSError as error:
        raise ConfigError(f"entrypoint command `{' '.join(argv)}`: cannot run {command[0]!r}: "
                          f"{error.strerror}") from None
