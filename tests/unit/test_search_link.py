"""A trial's link to its search, without processes: adaptive ASHA's stop rule taken on Optuna's bookkeeping (rung
values of the trials of one bracket, InvalidHP trials left out), an Optuna pruner through the same call, and a
fixed seed drawing the same trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from dtrain.search.link import BRACKET, INVALID, STOPPED, LinkRecord, SearchLink
from dtrain.search.space import Space
from dtrain.search.spec import parse_searcher
from dtrain.search.study import ask, open_study

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(tmp_path: Path, direction: str = "minimize") -> tuple[str, Any]:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    return url, optuna.create_study(storage=url, study_name="s", direction=direction)


def _link(url: str, trial: Any, rule: dict[str, Any], tmp_path: Path, smaller: bool = True) -> SearchLink:
    record = LinkRecord(storage=url, study_name="s", trial_id=trial._trial_id, trial_number=trial.number,
                        metric="loss", smaller_is_better=smaller, time_metric="batches", max_time=8, rule=rule)
    run_dir = tmp_path / f"trial-{trial.number}"
    record.write(run_dir)
    link = SearchLink.from_run_dir(run_dir)
    assert link is not None and link.max_length == (8, "batches")
    return link


def _units(batches: int) -> dict[str, float]:
    return {"batches": float(batches), "records": 32.0 * batches, "epochs": batches / 10}


def test_asha_stops_a_trial_outside_the_top_fraction_of_its_bracket_s_rung(tmp_path: Path) -> None:
    url, study = _study(tmp_path)
    rule = {"kind": "asha", "bracket": 0, "divisor": 2, "rungs": [2, 4, 8]}
    trials = [study.ask() for _ in range(6)]
    for t in trials:
        t.set_user_attr(BRACKET, 0)
    trials[4].set_user_attr(BRACKET, 1)  # another bracket: never in bracket 0's tables
    trials[5].set_user_attr(INVALID, "rejected")  # InvalidHP: out of every table
    trials[4].set_user_attr("rung_0", 0.01)
    trials[5].set_user_attr("rung_0", 0.01)
    a, b, c, d = (_link(url, t, rule, tmp_path) for t in trials[:4])
    assert a.report(_units(1), 0.9) is None  # below the first rung: nothing to decide
    assert a.report(_units(2), 0.5) is None  # rung 1: n=1, keep max(floor(1/2), 1) = 1, rank 0
    reason = b.report(_units(2), 0.6)  # n=2: keep 1, rank 1 -> stop
    assert reason is not None and "not in the top 1 of 2 at rung 1" in reason and b.stopped
    # c's first validation is past rungs 1 and 2: it is recorded at both; rung 1: n=3, keep 1, rank 0 (0.4 best);
    # rung 2: n=1 -> goes on
    assert c.report(_units(4), 0.4) is None
    # d: rung 1 n=4, keep 2: 0.45 ranks 1 (0.4, 0.45, 0.5, 0.6) -> goes on; rung 2: n=2 (0.4, 0.45), keep 1, rank 1
    assert "at rung 2" in str(d.report(_units(4), 0.45))
    assert a.report(_units(8), 0.3) is None  # rung 2 (n=3, keep 1, 0.3 best), then the top rung: it completes
    frozen = {t.number: t for t in study.get_trials()}
    assert frozen[1].user_attrs[STOPPED] and frozen[3].user_attrs[STOPPED] and STOPPED not in frozen[0].user_attrs
    assert frozen[2].user_attrs["rung_0"] == frozen[2].user_attrs["rung_1"] == pytest.approx(0.4)
    assert frozen[0].intermediate_values == {1: 0.9, 2: 0.5, 8: 0.3}  # Optuna's steps: time_metric units
    assert frozen[0].user_attrs["best_metric"] == pytest.approx(0.3)


def test_asha_ranks_larger_is_better_metrics_the_other_way(tmp_path: Path) -> None:
    url, study = _study(tmp_path, "maximize")
    rule = {"kind": "asha", "bracket": 0, "divisor": 2, "rungs": [2, 8]}
    low, high = (_link(url, study.ask(), rule, tmp_path, smaller=False) for _ in range(2))
    assert low.report(_units(2), 0.50) is None
    assert high.report(_units(2), 0.90) is None  # n=2, keep 1: 0.9 is the best when larger is better
    third = _link(url, study.ask(), rule, tmp_path, smaller=False)
    assert third.report(_units(2), 0.70) is not None  # n=3, keep 1: 0.9 is ahead


def test_an_optuna_pruner_decides_through_the_same_call(tmp_path: Path) -> None:
    url, study = _study(tmp_path)
    rule = {"kind": "optuna", "pruner": "median", "min_time": 2, "max_time": 8, "divisor": 4}
    for value in (0.1, 0.2, 0.3, 0.4, 0.5):  # five finished trials: MedianPruner's startup trials
        trial = study.ask()
        trial.report(value, 2)
        study.tell(trial, value)
    good, bad = (_link(url, study.ask(), rule, tmp_path) for _ in range(2))
    assert good.report(_units(2), 0.15) is None  # better than the median 0.3 at step 2
    assert "median pruner" in str(bad.report(_units(2), 0.9))


def test_a_fixed_seed_draws_the_same_trials_straight_through_or_resumed(tmp_path: Path) -> None:
    space = Space.parse({"lr": {"type": "log", "minval": -4, "maxval": -1}, "n": {"type": "int", "minval": 1,
                         "maxval": 9}, "act": {"type": "categorical", "vals": ["relu", "tanh"]}})
    for name in ("random", "optuna"):
        spec = parse_searcher({"name": name, "max_trials": 4, "max_time": 8, "time_metric": "batches"})

        def draw(url: str, count: int, spec: Any = spec) -> list[dict[str, Any]]:
            study = open_study(url, "s", spec, space, 7, optuna.pruners.NopPruner())  # a new process's view
            drawn = []
            for _ in range(count):
                trial, params = ask(study, spec, space, 7)
                study.tell(trial, float(params["n"]))
                drawn.append(params)
            return drawn

        straight = draw(f"sqlite:///{tmp_path / f'{name}-a.db'}", 4)
        resumed_url = f"sqlite:///{tmp_path / f'{name}-b.db'}"
        resumed = draw(resumed_url, 2) + draw(resumed_url, 2)  # stopped after two trials, then resumed
        assert straight == resumed and len({str(s) for s in straight}) == 4
        for point in straight:
            assert 1e-4 <= point["lr"] <= 1e-1 and 1 <= point["n"] <= 9 and point["act"] in ("relu", "tanh")


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "grid"])
def test_every_optuna_sampler_draws_the_space_and_grid_covers_it(tmp_path: Path, sampler: str) -> None:
    from dtrain.search.link import make_pruner
    from dtrain.search.study import total_trials

    space = Space.parse({"lr": {"type": "log", "minval": -3, "maxval": -1, "count": 2},
                         "m": {"type": "double", "minval": 0.0, "maxval": 0.9, "count": 2},
                         "w": {"type": "categorical", "vals": [8, 16]}})
    spec = parse_searcher({"name": "optuna", "sampler": sampler, "pruner": "hyperband", "max_trials": 3,
                           "max_time": 16, "time_metric": "batches"})
    pruner = make_pruner({"kind": "optuna", "pruner": "hyperband", "min_time": 4, "max_time": 16, "divisor": 4})
    study = open_study(f"sqlite:///{tmp_path / 's.db'}", "s", spec, space, 0, pruner)
    count = total_trials(spec, space)
    assert count == (8 if sampler == "grid" else 3)
    drawn = []
    for _ in range(count):
        trial, params = ask(study, spec, space, 0)
        study.tell(trial, params["m"])
        assert 1e-3 <= params["lr"] <= 1e-1 and 0.0 <= params["m"] <= 0.9 and params["w"] in (8, 16)
        drawn.append((round(params["lr"], 6), params["m"], params["w"]))
    if sampler == "grid":  # Optuna's GridSampler over Determined's grid points, each once
        assert sorted(drawn) == sorted((lr, m, w) for lr in (0.001, 0.1) for m in (0.0, 0.9) for w in (8, 16))
    for name, kind in (("successive_halving", "SuccessiveHalvingPruner"), ("median", "MedianPruner"),
                       ("none", "NopPruner")):
        rule = {"kind": "optuna", "pruner": name, "min_time": 4, "max_time": 16, "divisor": 4}
        assert type(make_pruner(rule)).__name__ == kind
