"""The benchmarks' one statistics path: paired per-round ratios and the provenance every result records."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import benchmark_module

REPO = Path(__file__).resolve().parents[2]


def _common() -> ModuleType:
    return benchmark_module("common")


def test_paired_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians() -> None:
    common = _common()
    a, b = [10.0, 30.0, 20.0], [20.0, 10.0, 40.0]  # per round 0.5, 3.0, 0.5; ratio of medians would be 1.0
    ratio = common.paired_ratio(a, b)
    assert ratio["per_round"] == pytest.approx([0.5, 3.0, 0.5])
    assert ratio["value"] == pytest.approx(0.5)
    assert statistics.median(a) / statistics.median(b) == pytest.approx(1.0)
    assert (ratio["min"], ratio["max"]) == (pytest.approx(0.5), pytest.approx(3.0))


def test_ratio_headline_puts_per_round_values_beside_the_key() -> None:
    headline = _common().ratio_headline("speedup", [2.0, 3.0], [1.0, 2.0])
    assert headline == {"speedup": pytest.approx(1.75), "speedup_per_round": pytest.approx([2.0, 1.5]),
                        "speedup_min": pytest.approx(1.5), "speedup_max": pytest.approx(2.0)}


def test_unpaired_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="as many numerators as denominators"):
        _common().paired_ratio([1.0, 2.0], [1.0])


def test_rounds_of_orders_a_variants_rows_by_round() -> None:
    rows = [{"variant": "a", "repeat": 1, "t": 3.0}, {"variant": "b", "repeat": 0, "t": 9.0},
            {"variant": "a", "repeat": 0, "t": 1.0}]
    assert _common().rounds_of(rows, "a", "t") == [1.0, 3.0]


def test_every_result_records_its_commit_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = _common()
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    path = common.write_results("x", {"k": 1.0}, [], "text", {"cores": 2})
    payload = json.loads(path.read_text())
    head = common.git_commit()["commit"]
    assert payload["commit"] == head and len(head) == 40
    assert isinstance(payload["dirty"], bool)
    for key in ("started", "ended", "load_average_start", "load_average_end"):
        assert key in payload


def test_a_tree_is_dirty_for_changed_code_but_not_for_changed_result_files(tmp_path: Path) -> None:
    """Benchmarks run one after another write benchmarks/results/; that must not mark the next one's tree dirty,
    while any other uncommitted change must."""
    import subprocess

    common = _common()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "empty")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "files")
    assert common.git_commit(tmp_path)["dirty"] is False
    (tmp_path / "benchmarks" / "results" / "x.json").write_text('{"k": 1}')
    assert common.git_commit(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert common.git_commit(tmp_path)["dirty"] is True


# Results known to predate the rule, each with why; strict, so the mark must go when the file is rerun.
NOT_YET_RERUN: dict[str, str] = {}  # result file -> why it has no provenance yet (a strict xfail until it is rerun)


def _committed_results() -> list[Any]:
    return [pytest.param(path, marks=pytest.mark.xfail(reason=NOT_YET_RERUN[path.name], strict=True))
            if path.name in NOT_YET_RERUN else path
            for path in sorted((REPO / "benchmarks" / "results").glob("*.json"))]


@pytest.mark.parametrize("path", _committed_results(), ids=lambda path: getattr(path, "name", str(path)))
def test_every_committed_result_names_a_commit_of_this_history(path: Path) -> None:
    """Issue 22: a figure is only worth citing with the code it measured, so every committed result names a commit
    that is in this checkout's history and whether the tree was dirty; a headline with a spread carries the values
    it spans (per round, or per seed for accuracy over seeds)."""
    import subprocess

    payload = json.loads(path.read_text())
    commit = payload.get("commit")
    assert isinstance(commit, str) and len(commit) == 40, f"{path.name} records no commit"
    assert isinstance(payload.get("dirty"), bool), f"{path.name} does not say whether its tree was dirty"
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a git checkout with its whole history: the commit's ancestry cannot be checked")
    ancestor = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", commit, "HEAD"],
                              capture_output=True)
    assert ancestor.returncode == 0, f"{path.name} names {commit}, which is not an ancestor of HEAD"
    headline = payload.get("headline", {})
    for key in headline:
        name = key[:-4]
        if key.endswith("_min") and f"{name}_max" in headline and name in headline:
            assert f"{name}_per_round" in headline or f"{name}_per_seed" in headline, \
                f"{path.name}: {name} has a min and max but no {name}_per_round"


def test_descendants_walk_the_whole_tree_below_a_process() -> None:
    """What a benchmark stopped by SIGTERM takes with it: its children, theirs, and nothing above or beside."""
    parents = {1: 0, 10: 1, 20: 10, 21: 10, 30: 20, 31: 21, 40: 1, 41: 40}
    assert _common().descendants(parents, 10) == [20, 21, 30, 31]
    assert _common().descendants(parents, 30) == []


def test_process_parents_sees_this_process() -> None:
    import os

    parents = _common().process_parents()
    assert parents[os.getpid()] == os.getppid()


def test_kept_rounds_survive_a_run_that_stops_part_way(tmp_path: Path) -> None:
    common = _common()
    kept = common.KeptRounds(tmp_path, {"epochs": 8})

    def run(repeat: int) -> dict[str, Any]:
        if repeat == 1:
            raise RuntimeError("the machine went away")
        return {"seconds": 1.0 + repeat}

    with pytest.raises(RuntimeError):
        common.alternate([("a", run), ("b", run)], 3, log=lambda _: None, on_round=kept.add)
    again = common.KeptRounds(tmp_path, {"epochs": 8})
    assert again.rounds == 1
    assert sorted(r["variant"] for r in again.rows) == ["a", "b"]
    assert all(r["piece_started"] == common.STARTED["date"] for r in again.rows)
    rows = common.alternate([("a", lambda r: {"seconds": 2.0}), ("b", lambda r: {"seconds": 2.0})], 2,
                            log=lambda _: None, first=again.rounds, on_round=again.add)
    assert [r["repeat"] for r in rows] == [1, 1, 2, 2]
    assert common.KeptRounds(tmp_path, {"epochs": 8}).rounds == 3


def test_kept_rounds_of_other_settings_are_refused(tmp_path: Path) -> None:
    common = _common()
    common.KeptRounds(tmp_path, {"epochs": 8}).add([{"repeat": 0, "variant": "a"}], link_checks=[1])
    assert common.KeptRounds(tmp_path, {"epochs": 8}).extra == {"link_checks": [1]}
    with pytest.raises(SystemExit, match="use another --workdir"):
        common.KeptRounds(tmp_path, {"epochs": 3})
    (tmp_path / "rows.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not a file of kept rounds"):
        common.KeptRounds(tmp_path, {"epochs": 8})


def test_without_a_workdir_nothing_is_written(tmp_path: Path) -> None:
    kept = _common().KeptRounds(None, {})
    kept.add([{"repeat": 0}, {"repeat": 0}])
    assert kept.rounds == 1 and kept.path is None
