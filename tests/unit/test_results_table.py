"""docs/benchmarks.md's first table, and the results tables of the subject pages (clusters, svm, sharding), are
generated from benchmarks/results/*.json by benchmarks/results_table.py: they must be current (as the config
reference is), and their verdicts must follow from the results and targets."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import benchmark_module

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "benchmarks.md"
PAGES_WITH_TABLES = sorted(page for page in DOCS.glob("*.md") if "<!-- Results of " in page.read_text())


def _table() -> ModuleType:
    return benchmark_module("results_table")


@pytest.mark.parametrize("page", PAGES_WITH_TABLES, ids=[page.name for page in PAGES_WITH_TABLES])
def test_the_pages_table_is_what_the_results_give(page: Path) -> None:
    table = _table()
    assert table.main(["--check", str(page)]) == 0, f"docs/{page.name}'s results table is stale: run " \
        f"`{table.COMMAND} --write docs/{page.name}`"


def test_the_benchmarks_page_holds_every_headline_and_a_subject_page_its_own() -> None:
    table = _table()
    assert PAGE in PAGES_WITH_TABLES
    assert table.generate().count("\n") == len(table.HEADLINES) + 2
    clusters = table.generate(("clusters",))
    assert clusters.count("](benchmarks.md#clusterspy)") == clusters.count("\n") - 2 > 0
    with pytest.raises(SystemExit, match="no headline of nothing"):
        table.generate(("nothing",))


def test_check_fails_on_a_stale_table_and_on_a_page_without_markers(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    table = _table()
    stale, bare = tmp_path / "stale.md", tmp_path / "bare.md"
    stale.write_text(PAGE.read_text().replace("| **missed** |", "| met |", 1))
    bare.write_text("# Benchmarks\n")
    assert table.main(["--check", str(stale)]) == 1
    assert table.main(["--check", str(bare)]) == 1
    assert table.main(["--write", str(stale)]) == 0 and table.main(["--check", str(stale)]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "stale" in lines[0] and "markers" in lines[1]


def test_targets_judge_by_their_operator() -> None:
    target = _table().Target
    assert target(">=", 1.5).met(1.5) and not target(">=", 1.5).met(1.49)
    assert target("<=", 0.08).met(0.08) and not target("<=", 0.08).met(0.121)
    assert target("within", 0.10).met(-0.097) and not target("within", 0.10).met(-0.11)
    assert target("==", True).met(True) and not target("==", True).met(False)
    assert target("within", 0.1).text(percent=True) == "within ±10 %" and target(">=", 50.0).text(False) == ">= 50"


def test_a_row_reads_value_spread_verdict_commit_and_links_from_the_json(tmp_path: Path) -> None:
    table = _table()
    headline = {"speedup": 1.25, "speedup_per_round": [1.4, 1.25, 0.9], "drop": {"topk": 0.3},
                "drop_per_seed": {"topk": [0.1, 0.5]}, "error": -0.12}
    (tmp_path / "x_big.json").write_text(json.dumps({"headline": headline, "commit": "a1b2c3d" + "0" * 33,
                                                     "dirty": True}))
    (tmp_path / "x_notes.md").write_text("# x: notes\n")
    rows = [table._row(table.Headline("x", "x_big", "speedup", "two / one", table.Target(">=", 1.3)), tmp_path),
            table._row(table.Headline("x", "x_big", "drop/topk", "lost", table.Target("<=", 1.0),
                                      spread="drop_per_seed/topk", digits=2), tmp_path),
            table._row(table.Headline("x", "x_big", "error", "bias", table.Target("within", 0.1), percent=True),
                       tmp_path)]
    assert rows[0] == ("| [`x.py`](#xpy) `x_big` | two / one | >= 1.3 | 1.250 (0.900 to 1.400) | **missed** | "
                       "a1b2c3d (dirty) | [json](../benchmarks/results/x_big.json), "
                       "[notes](../benchmarks/results/x_notes.md) |")
    assert "| 0.30 (0.10 to 0.50) | met |" in rows[1]
    assert "| within ±10 % | -12.0 % | **missed** |" in rows[2]
    with pytest.raises(SystemExit, match="has no headline `gone`"):
        table._row(table.Headline("x", "x_big", "gone", "?", None), tmp_path)
