"""The subcommands of `dtrain`, one module each.

Each module has `register(subcommands)`: it adds its parser to `dtrain`'s, with `handler` (args -> exit code)
as a default of the parser, or of each of its own subcommands. `COMMANDS` lists them in the order
`dtrain --help` shows them; a new subcommand is one module and one entry here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from dtrain.commands import dashboard, diagnose, experiments, export, horovodrun, plan, preview, rendezvous, run

Register = Callable[[Any], argparse.ArgumentParser]  # takes argparse's subparsers action

COMMANDS: tuple[Register, ...] = (run.register, preview.register, experiments.register, plan.register,
                                  diagnose.register, horovodrun.register, export.register,
                                  dashboard.register, rendezvous.register)
