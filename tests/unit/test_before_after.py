"""Issue 22's before/after table: the old statistics recomputed from today's rows, checked against hand-worked
figures."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.conftest import benchmark_module


def _before_after() -> ModuleType:
    return benchmark_module("before_after")


def test_compression_old_statistic_is_the_best_ratio_of_medians() -> None:
    rows = [{"part": "speed", "variant": v, "round": i, "samples_per_second": s}
            for i, (bound, topk, fp16, ddp) in enumerate([(100, 90, 50, 80), (200, 60, 60, 80), (150, 70, 55, 80)])
            for v, s in (("bound", bound), ("topk", topk), ("fp16", fp16), ("ddp", ddp))]
    rows.append({"part": "accuracy", "variant": "topk", "seed": 0})
    # medians: bound 150, topk 70, fp16 55 (ddp is the baseline, not a compressor): 70 / 150
    assert _before_after().compression_old({"rows": rows}) == pytest.approx(70 / 150)


def test_sync_old_statistic_takes_the_worst_model() -> None:
    rows = [{"model": m, "variant": v, "round": r, "samples_per_second": s}
            for m, per_round in (("a", [(10, 11), (10, 9), (10, 12)]), ("b", [(10, 9), (10, 9.5), (10, 8)]))
            for r, (ddp, dtrain) in enumerate(per_round) for v, s in (("ddp", ddp), ("dtrain", dtrain))]
    result = {"rows": rows, "models": [{"model": "a"}, {"model": "b"}]}
    assert _before_after().sync_old(result) == pytest.approx(0.9)  # b: median 9 / median 10


def test_diagnose_old_statistic_is_unpaired_and_the_paired_one_the_worst_round() -> None:
    rows = [{"part": "communication", "diagnosed_percent": d, "direct_percent": x}
            for d, x in ((30.0, 20.0), (20.0, 30.0), (25.0, 26.0))]
    rows.append({"part": "input", "diagnosed_percent": None})
    module = _before_after()
    assert module.diagnose_old({"rows": rows}) == pytest.approx(1.0)  # medians 25 and 26
    assert module.diagnose_paired_max({"rows": rows}) == pytest.approx(10.0)


def test_large_batch_on_test_picks_the_best_recipe_at_each_batch() -> None:
    result = {"headline": {"base_batch": 128, "accuracy_percent": {
        "sgd": {"128": 92.0, "2048": 85.0}, "lamb": {"128": 92.5, "2048": 91.0}}}}
    assert _before_after().large_batch_on_test(result, 16) == pytest.approx(1.5)


def test_a_missing_variant_is_an_error_not_a_silent_zero() -> None:
    with pytest.raises(ValueError, match="bound"):
        _before_after().median_of([{"variant": "ddp", "samples_per_second": 1.0}], "bound", "samples_per_second")
