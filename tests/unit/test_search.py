"""Hyperparameter search without processes: Determined's adaptive ASHA arithmetic against tables computed by
hand below, its stop rule on hand-made rungs, the grid, sampling within bounds, seeds, bad input, preview."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.errors import ConfigError
from dtrain.search import asha
from dtrain.search.preview import preview
from dtrain.search.space import Space
from dtrain.search.spec import parse_searcher

# (max_trials, max_length, divisor, mode, max_concurrent) -> [(rungs, trials, concurrent, units per rung)], by hand:
CASES = [
    # rungs = min(5, 1 + floor(log4 4) = 2, 1 + floor(log4 16) = 3) = 2; standard: [2, 1];
    # weights 4/2 = 2 and 1/1 = 1: floor(2/3 * 16) = 10, floor(1/3 * 16) = 5, remainder 1 to the first -> 11, 5;
    # concurrency: max(5, 4) = 5 each; units: 4/4 = 1, 4
    ((16, 4, 4, "standard", 0), [(2, 11, 5, (1, 4)), (1, 5, 5, (4,))]),
    # rungs = min(5, 1 + 3 (4^3 = 64: exact, where float logs give 2.999...), 1 + 2) = 3; aggressive: [3];
    # all 16 trials; concurrency max(16, 4); units 64/16, 64/4, 64
    ((16, 64, 4, "aggressive", 0), [(3, 16, 16, (4, 16, 64))]),
    # rungs = min(5, 1 + 6 (3^6 = 729 <= 1000), 1 + 4 (81 <= 100)) = 5; conservative: [5, 4, 3, 2, 1];
    # weights 81/5 = 16.2, 27/4 = 6.75, 9/3 = 3, 3/2 = 1.5, 1 (sum 28.45): floors 56, 23, 10, 5, 3 (97),
    # remainder 3 -> 59; concurrency max(3, 3); units 1000/81 -> 12, 1000/27 -> 37, 111, 333, 1000
    ((100, 1000, 3, "conservative", 0), [(5, 59, 3, (12, 37, 111, 333, 1000)), (4, 23, 3, (37, 111, 333, 1000)),
                                         (3, 10, 3, (111, 333, 1000)), (2, 5, 3, (333, 1000)), (1, 3, 3, (1000,))]),
    # rungs = min(5, 1 + 2, 1 + floor(log4 13) = 2) = 2: max_trials caps them; standard: [2, 1];
    # floor(2/3 * 13) = 8, floor(1/3 * 13) = 4, remainder 1 -> 9, 4; concurrency 5 over 2 brackets: 3, 2;
    # units 16/4 = 4, 16
    ((13, 16, 4, "standard", 5), [(2, 9, 3, (4, 16)), (1, 4, 2, (16,))]),
]


@pytest.mark.parametrize(("args", "expected"), CASES)
def test_adaptive_asha_brackets_follow_determined_s_formulas(args: tuple, expected: list[tuple]) -> None:
    max_trials, max_length, divisor, mode, concurrent = args
    brackets = asha.plan(max_trials, max_length, divisor, 5, mode, concurrent)
    assert [(b.rungs, b.max_trials, b.max_concurrent_trials, b.units) for b in brackets] == expected
    assert sum(b.max_trials for b in brackets) == max_trials


def test_stop_rule_keeps_the_top_fraction_of_each_rung() -> None:
    rung = asha.Rung()
    # divisor 4: n results so far (new included) -> promote the best max(floor(n/4), 1)
    assert rung.continue_training(0.50, 4)  # n=1: keep 1, rank 0
    assert not rung.continue_training(0.60, 4)  # n=2: keep 1, rank 1
    assert rung.continue_training(0.40, 4)  # n=3: keep 1, rank 0 (best so far)
    assert not rung.continue_training(0.45, 4)  # n=4: keep 1, rank 1
    assert not rung.continue_training(0.48, 4)  # n=5: keep 1, rank 2
    assert not rung.continue_training(0.55, 4)  # n=6: keep 1
    assert not rung.continue_training(0.70, 4)  # n=7: keep 1
    assert rung.continue_training(0.42, 4)  # n=8: keep 2, rank 1
    larger = asha.Rung()
    assert larger.continue_training(0.9, 2, smaller_is_better=False)
    assert larger.continue_training(0.95, 2, smaller_is_better=False)  # n=2: keep 1, rank 0 when larger is better
    assert not larger.continue_training(0.1, 2, smaller_is_better=False)


def test_grid_enumerates_like_determined() -> None:
    space = Space.parse({"lr": {"type": "log", "minval": -3, "maxval": -1, "count": 3},
                         "width": {"type": "int", "minval": 1, "maxval": 4, "count": 3},
                         "act": {"type": "categorical", "vals": ["relu", "tanh"]},
                         "opt": {"momentum": {"type": "double", "minval": 0.0, "maxval": 0.9, "count": 1}},
                         "global_batch_size": 64})
    points = space.grid()
    assert len(points) == 3 * 3 * 2 * 1
    assert space.params[0].grid() == pytest.approx([1e-3, 1e-2, 1e-1])
    assert space.params[1].grid() == [1, 3, 4]  # 1 + i * 3/2 rounded half away from zero: 1, 2.5 -> 3, 4
    assert points[0] == {"lr": pytest.approx(1e-3), "width": 1, "act": "relu", "opt": {"momentum": 0.45},
                         "global_batch_size": 64}
    assert Space.parse({"n": {"type": "int", "minval": 2, "maxval": 3, "count": 5}}).params[0].grid() == [2, 3]


def test_samples_stay_within_bounds_and_a_seed_repeats_them() -> None:
    space = Space.parse({"lr": {"type": "log", "minval": -4, "maxval": -1, "base": 10},
                         "n": {"type": "int", "minval": 3, "maxval": 5}, "p": {"type": "double", "minval": 0.1,
                                                                               "maxval": 0.2},
                         "c": {"type": "categorical", "vals": [1, 2]}, "k": {"type": "const", "val": 7}})
    first = [space.sample(random.Random(42)) for _ in range(1)] + [space.sample(random.Random(42))]
    assert first[0] == first[1]
    rng = random.Random(1)
    for _ in range(200):
        s = space.sample(rng)
        assert 1e-4 <= s["lr"] <= 1e-1 and 3 <= s["n"] <= 5 and 0.1 <= s["p"] <= 0.2
        assert s["c"] in (1, 2) and s["k"] == 7


@pytest.mark.parametrize(("hparams", "searcher", "message"), [
    ({"x": {"type": "uniform", "minval": 0, "maxval": 1}}, {"name": "random", "max_trials": 2,
                                                             "max_length": {"batches": 5}}, "the types are"),
    ({"x": {"type": "double", "minval": 2, "maxval": 1}}, {"name": "random", "max_trials": 2,
                                                           "max_length": {"batches": 5}}, "greater than maxval"),
    ({"x": {"type": "double", "minval": 0, "maxval": 1}}, {"name": "grid", "max_length": {"batches": 5}},
     "needs `count`"),
    ({"x": 1}, {"name": "adaptive_asha", "max_trials": 4}, "max_time"),
    ({"x": 1}, {"name": "random", "max_length": {"batches": 5}}, "needs max_trials"),
])
def test_bad_search_input_is_one_clear_line(hparams: dict, searcher: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        preview({"hyperparameters": hparams, "searcher": searcher})
    assert "\n" not in str(error.value)


def test_preview_of_adaptive_asha_counts_its_budget() -> None:
    text = preview({"hyperparameters": {"lr": {"type": "log", "minval": -3, "maxval": -1}},
                    "searcher": {"name": "adaptive_asha", "max_trials": 16, "max_time": 4, "time_metric": "epochs",
                                 "divisor": 4, "mode": "standard", "metric": "accuracy", "smaller_is_better": False}})
    assert "bracket 1: 2 rung(s), 11 trials" in text and "bracket 2: 1 rung(s), 5 trials" in text
    # bracket 1: 11 trials x 1 epoch + 2 trials x 3 more; bracket 2: 5 x 4 -> 11 + 6 + 20 = 37 of 64
    assert "about 37 epochs in all" in text
    assert parse_searcher({"name": "adaptive_asha", "max_trials": 4, "max_length": {"epochs": 2}}).unit == "epochs"


def test_dtrain_preview_command(tmp_path: Path) -> None:
    config = tmp_path / "grid.yaml"
    config.write_text("name: g\nentrypoint: model_def:T\nhyperparameters:\n  global_batch_size: 32\n"
                      "  lr: {type: categorical, vals: [0.1, 0.01]}\nsearcher:\n  name: grid\n  metric: loss\n"
                      "  max_length: {batches: 10}\n")
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "preview", str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2 grid points, each trained for 10 batches: 20 batches in all" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "dtrain.cli", "preview", str(config), "--set", "searcher.name=random"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "needs max_trials" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(("change", "message"), [
    ("  x: {type: uniform, minval: 0, maxval: 1}\n", "has `type: uniform`; the types are"),
    ("  x: {type: double, minval: 2, maxval: 1}\n", "minval 2 is greater than maxval 1"),
    ("  x: {type: double, minval: 0, maxval: 1}\n", "needs `count` for a grid search"),
    ("  x: 1\n", "needs max_time (with time_metric) or max_length"),
])
def test_dtrain_run_refuses_bad_search_input_in_one_line_and_starts_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str, message: str) -> None:
    from dtrain.cli import main

    searcher = {"the types are": "random", "greater than maxval": "random", "needs `count`": "grid"}
    name = next((v for k, v in searcher.items() if k in message), "adaptive_asha")
    length = "" if name == "adaptive_asha" else "  max_length: {batches: 5}\n"
    config = tmp_path / "bad.yaml"
    config.write_text("name: bad\nentrypoint: model_def:T\nhyperparameters:\n  global_batch_size: 8\n" + change
                      + f"searcher:\n  name: {name}\n  max_trials: 2\n  metric: loss\n" + length)
    search_dir = tmp_path / "search"
    assert main(["run", str(config), "--search-dir", str(search_dir), "--slots", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0 and "Traceback" not in err
    assert not search_dir.exists()  # nothing started, nothing written


def test_a_trial_is_the_experiment_file_with_its_hyperparameters_global_batch_size_too() -> None:
    from dtrain.config import load_config
    from dtrain.search.runner import trial_settings
    from tests.conftest import FIXTURES

    spec = parse_searcher({"name": "adaptive_asha", "max_trials": 4, "max_time": 64, "time_metric": "batches",
                           "metric": "accuracy", "smaller_is_better": False})
    space = Space.parse({"global_batch_size": {"type": "categorical", "vals": [16, 64]},
                         "learning_rate": {"type": "log", "minval": -2, "maxval": -1},
                         "hidden": {"type": "categorical", "vals": [16, 32]}})
    params = {"global_batch_size": 64, "learning_rate": 0.05, "hidden": 32}
    assert {p.name for p in space.searchable} == set(params)
    config = load_config(FIXTURES / "digits_search.yaml", trial_settings(params, spec)).config
    assert config.global_batch_size == 64 and config.hyperparameters["learning_rate"] == 0.05
    assert config.searcher.name == "single" and config.searcher.metric == "accuracy"
    assert (config.searcher.max_length.value, config.searcher.max_length.unit) == (64, "batches")
