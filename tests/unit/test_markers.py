"""The pytest markers pyproject.toml declares are the ones the tests use, and `make test-fast` (a developer's inner
loop) leaves out the tests marked slow."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def declared_markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {line.split(":")[0].strip() for line in config["tool"]["pytest"]["ini_options"]["markers"]}


def used_markers() -> dict[str, set[str]]:
    """Marker name -> the test files that use it (built-in markers such as parametrize left out)."""
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout"}
    used: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for name in re.findall(r"pytest\.mark\.([a-z_]+)", path.read_text()):
            if name not in builtin:
                used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return used


def test_every_declared_marker_is_used_and_every_used_one_declared() -> None:
    used = used_markers()
    assert declared_markers() == set(used), (declared_markers(), used)


def test_the_slow_tests_are_in_the_multi_process_suites_and_test_fast_leaves_them_out() -> None:
    assert all(path.startswith(("tests/distributed/", "tests/faults/")) for path in used_markers()["slow"])
    target = re.search(r"^test-fast:.*?(?=^\S|\Z)", (ROOT / "Makefile").read_text(), re.M | re.S)
    assert target is not None, "Makefile has no test-fast target"
    assert "tests/unit" in target.group(0) and '-m "not slow"' in target.group(0)
