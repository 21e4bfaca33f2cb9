"""The `dtrain` command: its parser, built from the subcommands in dtrain.commands, and main().

Errors the user can fix are printed as one line (`dtrain: error: ...`) with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from dtrain import __version__
from dtrain.commands import COMMANDS
from dtrain.errors import DtrainError, ExitCode


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in our one-line style with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USER_ERROR, f"dtrain: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    """`dtrain` and every subcommand; a command that has subcommands of its own prints its help without one."""
    parser = _Parser(prog="dtrain", description="Distributed training of PyTorch models on torch.distributed.",
                     epilog="Start with `dtrain run examples/fashion_mnist/distributed.yaml`.")
    parser.add_argument("--version", action="version", version=f"dtrain {__version__}")
    parser.set_defaults(handler=_help_of(parser))
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in COMMANDS:
        command = register(subcommands)
        if command.get_default("handler") is None:
            command.set_defaults(handler=_help_of(command))
    return parser


def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """The handler of an incomplete command line: print the help of the command given so far."""

    def show_help(_: argparse.Namespace) -> int:
        parser.print_help()
        return ExitCode.USER_ERROR

    return show_help


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        print("dtrain: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
