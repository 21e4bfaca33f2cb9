"""`dtrain preview CONFIG`: the plan of a hyperparameter search (trials, rungs, brackets, the units they train),
like Determined's `det preview-search`; nothing is trained."""

from __future__ import annotations

import argparse
from typing import Any

from dtrain.errors import ExitCode


def register(subcommands: Any) -> argparse.ArgumentParser:
    """Add `dtrain preview`."""
    parser = subcommands.add_parser(
        "preview", help="show what a hyperparameter search would run (no training)",
        description="Print the plan of the search an experiment file describes (searcher random, grid or "
                    "adaptive_asha): trials, the grid, adaptive ASHA's brackets and rungs and the training units "
                    "they need. `dtrain run` runs random and grid searches; running adaptive ASHA is not built "
                    "yet (docs/search.md).")
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, as for dtrain run (repeatable)")
    parser.set_defaults(handler=preview)
    return parser


def preview(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dtrain.config.loading import apply_override, parse_override, read_yaml
    from dtrain.search.preview import preview as plan

    raw = read_yaml(Path(args.config))
    for text in args.overrides:
        apply_override(raw, *parse_override(text))
    print(plan(raw))
    return ExitCode.OK
