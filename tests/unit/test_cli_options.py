"""Every option of every command, held against a checked-in snapshot (tests/unit/snapshots/cli_options.json).

A flag that disappears, or whose default, type, nargs, choices or help changes, fails here until the snapshot
is refreshed on purpose:

    DTRAIN_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/unit/test_cli_options.py

then review `git diff tests/unit/snapshots/` and say what changed for users (README, --help) in the commit.
The commands are `dtrain` with every subcommand and sub-subcommand, and the worker's `python -m dtrain.worker`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from dtrain import cli, worker

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "cli_options.json"
UPDATE_ENV = "DTRAIN_UPDATE_SNAPSHOTS"


def _plain(value: Any) -> Any:
    """A default or type as JSON can hold it: paths as text, classes and functions by name."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return getattr(value, "__name__", repr(value))


def describe(parser: argparse.ArgumentParser, name: str) -> dict[str, dict[str, Any]]:
    """`name` and every command below it: their texts and, per option, everything --help and parsing use."""
    groups = {id(action): group.title for group in parser._action_groups for action in group._group_actions}
    command: dict[str, Any] = {"description": parser.description, "epilog": parser.epilog,
                               "formatter": _plain(parser.formatter_class), "options": {}}
    found = {name: command}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            command["subcommands"] = {sub: helps.get(sub) for sub in action.choices}
            command["subcommand_metavar"] = action.metavar
            for sub, subparser in action.choices.items():
                found.update(describe(subparser, f"{name} {sub}"))
            continue
        key = max(action.option_strings, key=len) if action.option_strings else action.dest
        command["options"][key] = {
            "flags": list(action.option_strings), "dest": action.dest, "action": type(action).__name__,
            "default": _plain(action.default), "type": _plain(action.type), "nargs": action.nargs,
            "choices": _plain(action.choices), "required": action.required, "metavar": action.metavar,
            "help": action.help, "group": groups.get(id(action))}
    return found


def current() -> dict[str, dict[str, Any]]:
    return {**describe(cli.build_parser(), "dtrain"), **describe(worker.build_parser(), "python -m dtrain.worker")}


def differences(old: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per change, in words: a command or option gone or new, a field from its old value to its new."""
    lines = []
    for name in sorted(set(old) | set(new)):
        if name not in new or name not in old:
            lines.append(f"{name}: command {'gone' if name not in new else 'new'}")
            continue
        was, now = old[name], new[name]
        lines += [f"{name}: {field} {was.get(field)!r} -> {now.get(field)!r}" for field in sorted(set(was) | set(now))
                  if field != "options" and was.get(field) != now.get(field)]
        for option in sorted(set(was["options"]) | set(now["options"])):
            before, after = was["options"].get(option), now["options"].get(option)
            if before is None or after is None:
                lines.append(f"{name} {option}: option {'gone' if after is None else 'new'}")
                continue
            lines += [f"{name} {option}: {field} {before.get(field)!r} -> {after.get(field)!r}"
                      for field in sorted(set(before) | set(after)) if before.get(field) != after.get(field)]
    return lines


def render(commands: Mapping[str, Mapping[str, Any]]) -> str:
    """The snapshot as JSON with one line per option, so that a change reads as a one-line diff."""

    def line(indent: int, key: str, value: Any) -> str:
        return f"{' ' * indent}{json.dumps(key)}: {json.dumps(value, sort_keys=True)}"

    blocks = []
    for name, command in sorted(commands.items()):
        fields = [line(2, key, value) for key, value in sorted(command.items()) if key != "options"]
        options = ",\n".join(line(3, key, value) for key, value in sorted(command["options"].items()))
        blocks.append(f" {json.dumps(name)}: {{\n" + ",\n".join([*fields, f'  "options": {{\n{options}\n  }}'])
                      + "\n }")
    return "{\n" + ",\n".join(blocks) + "\n}\n"


def test_every_command_option_matches_the_snapshot() -> None:
    options = current()
    if os.environ.get(UPDATE_ENV):
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(render(options))
        pytest.skip(f"{SNAPSHOT} rewritten ({UPDATE_ENV} is set): review it with git diff")
    changed = differences(json.loads(SNAPSHOT.read_text()), options)
    assert changed == [], (f"the command line changed; if on purpose, refresh with {UPDATE_ENV}=1 (see this "
                           "file's docstring):\n" + "\n".join(changed))


def test_the_snapshot_walks_every_subcommand() -> None:
    assert set(current()) == {"dtrain", "dtrain run", "dtrain experiments", "dtrain experiments list",
                              "dtrain experiments show", "dtrain plan", "dtrain diagnose", "dtrain horovodrun",
                              "dtrain preview", "dtrain export", "dtrain dashboard", "dtrain rendezvous",
                              "python -m dtrain.worker"}


def test_a_lost_flag_and_a_changed_default_are_named() -> None:
    old = current()
    new = json.loads(json.dumps(old))
    del new["dtrain run"]["options"]["--rdzv-id"]
    new["dtrain diagnose"]["options"]["--steps"]["default"] = 40
    new["dtrain experiments"]["subcommands"]["show"] = "another help"
    assert differences(old, new) == [
        "dtrain diagnose --steps: default 30 -> 40",
        "dtrain experiments: subcommands {'list': 'one line per experiment', 'show': 'config, status, summary and "
        "metrics of one experiment'} -> {'list': 'one line per experiment', 'show': 'another help'}",
        "dtrain run --rdzv-id: option gone"]
