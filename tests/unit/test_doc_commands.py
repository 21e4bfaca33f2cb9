"""Every `dtrain ...` command a page of the docs shows parses with dtrain's real argparse tree, and every file of
this repository it names exists: command lines in code blocks (the lines after a `$ ` prompt where a block has
prompts, else every line that starts with `dtrain `), parsed whole; commands in code spans of the prose (often a
command's name, or a form like `dtrain experiments list|show`), checked for their subcommands and option names.
The cheap ones (`dtrain preview`, `dtrain plan` without a calibration, a plot or a file of the reader's) also run."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from dtrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`(dtrain [^`\n]*)`")
REPO_DIRS = ("examples/", "benchmarks/", "tests/", "docs/", "dtrain/")
SHELL_ENDS = ("|", "||", "&&", ";", ">", ">>", "2>&1", "&")


def block_commands(text: str) -> list[str]:
    """The `dtrain` command lines of the page's code blocks (continuation lines joined, `$ ` dropped)."""
    found = []
    for match in FENCED.finditer(text):
        lines = match.group(2).replace("\\\n", " ").splitlines()
        prompted = [line.strip()[2:] for line in lines if line.strip().startswith("$ ")]
        for line in prompted or [line.strip() for line in lines]:
            if line.startswith("dtrain "):
                found.append(line)
    return found


def span_commands(text: str) -> list[str]:
    return [span.rstrip("\\") for span in SPAN.findall(FENCED.sub("", text))]  # a span inside \`...\` escapes


def tokens_of(line: str) -> list[str]:
    """The command's arguments after `dtrain`, without a trailing comment or what follows a shell operator."""
    tokens = shlex.split(line, comments=True)[1:]
    for index, token in enumerate(tokens):
        if token in SHELL_ENDS:
            return tokens[:index]
    return tokens


def parse_error(arguments: list[str]) -> str | None:
    """argparse's complaint about `dtrain ARGUMENTS` (None when they parse)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(arguments)
    except SystemExit as exc:
        if exc.code:
            return stderr.getvalue().strip().splitlines()[-1]
    return None


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def span_error(line: str) -> str | None:
    """For a command in prose: its subcommands exist (a `list|show` or `list/show` form: each of them), and every
    `--option` it names is one of the innermost command's options."""
    parser: argparse.ArgumentParser = build_parser()
    words = line.split()[1:]
    while words and not words[0].startswith("-") and subparsers_of(parser):
        choices = subparsers_of(parser)
        names = re.split(r"[|/]", words[0])
        if not all(name in choices for name in names):
            return f"{words[0]!r} is not a subcommand of {parser.prog} ({', '.join(choices)})"
        parser, words = choices[names[0]], words[1:]
    options = {option for action in parser._actions for option in action.option_strings}
    unknown = [word for word in words if word.startswith("-") and word.split("=")[0] not in options]
    return f"{parser.prog} has no option {', '.join(unknown)}" if unknown else None


def repo_paths(arguments: list[str]) -> list[str]:
    """The arguments that name a file or folder of this repository (they start with one of its top folders)."""
    return [a.split("=", 1)[-1] for a in arguments if a.split("=", 1)[-1].startswith(REPO_DIRS)]


BLOCKS = [(page.name, line) for page in PAGES for line in block_commands(page.read_text())]
SPANS = [(page.name, line) for page in PAGES for line in span_commands(page.read_text())]


def test_the_pages_show_commands() -> None:
    assert len(BLOCKS) >= 20 and len(SPANS) >= 50
    assert ("search.md", "dtrain preview examples/fashion_mnist/adaptive.yaml") in BLOCKS


@pytest.mark.parametrize(("page", "line"), BLOCKS, ids=[f"{p}:{line[:60]}" for p, line in BLOCKS])
def test_a_command_line_in_a_code_block_parses_and_names_files_that_exist(page: str, line: str) -> None:
    arguments = tokens_of(line)
    assert parse_error(arguments) is None, f"{page}: `{line}`: {parse_error(arguments)}"
    for path in repo_paths(arguments):
        assert (ROOT / path).exists(), f"{page}: `{line}` names {path}, which does not exist"


@pytest.mark.parametrize(("page", "line"), SPANS, ids=[f"{p}:{line[:60]}" for p, line in SPANS])
def test_a_command_in_the_prose_names_real_subcommands_and_options(page: str, line: str) -> None:
    assert span_error(line) is None, f"{page}: `{line}`: {span_error(line)}"
    for path in repo_paths(line.split()):
        assert (ROOT / path).exists(), f"{page}: `{line}` names {path}, which does not exist"


def test_the_checks_see_a_wrong_option_a_wrong_subcommand_and_a_missing_file() -> None:
    assert parse_error(tokens_of("dtrain run x.yaml --slotz 2")) is not None
    assert parse_error(tokens_of("dtrain run x.yaml --slots 2   # a comment")) is None
    assert span_error("dtrain experiments list|shows") is not None
    assert span_error("dtrain plan --no-such-option") is not None
    assert span_error("dtrain experiments list/show") is None
    assert repo_paths(["examples/none.yaml", "--set", "x=1"]) == ["examples/none.yaml"]
    assert block_commands("```\n$ dtrain run a.yaml\ndtrain diagnose: output\n```\n") == ["dtrain run a.yaml"]


RUNNABLE = [(page, line) for page, line in BLOCKS
            if tokens_of(line)[0] in ("preview", "plan") and not {"--calibrate", "--this-machine", "--plot"}
            & set(tokens_of(line)) and all((ROOT / p).exists() for p in repo_paths(tokens_of(line)))
            and "my_experiment.yaml" not in line]


@pytest.mark.parametrize(("page", "line"), RUNNABLE, ids=[f"{p}:{line[:60]}" for p, line in RUNNABLE])
def test_a_cheap_command_runs(page: str, line: str, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    assert main(tokens_of(line)) == 0, f"{page}: `{line}`: {capsys.readouterr().err[-500:]}"
