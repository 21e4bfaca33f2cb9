"""`python3 -m determined.launch.torch_distributed CMD...` run by hand: dtrain's `dtrain run` already starts one
process per slot, so this runs CMD in this process (`python`/`python3` at its head: this interpreter)."""

from __future__ import annotations

import sys

from dtrain.determined.command import resolve_argv


def main() -> None:
    argv = sys.argv[1:]
    if "--trial" in argv:
        sys.exit("determined.launch.torch_distributed --trial: name the Trial class in the experiment file's "
                 "entrypoint and run `dtrain run experiment.yaml`")
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python3 -m determined.launch.torch_distributed [--] python3 train.py [ARGS...]")
    import os
    import shutil

    command = resolve_argv(argv)
    os.execv(shutil.which(command[0]) or command[0], command)


if __name__ == "__main__":
    main()
