"""The Optuna side of a search: the study (RDB storage: SQLite in the search dir by default, any SQLAlchemy URL with
`--storage`, so several machines share one study), the sampler a searcher uses, and how a searcher's trials are
drawn from it (suggest, grid points, ASHA brackets).

Determined's random and adaptive ASHA searchers draw with Optuna's `RandomSampler` (a `log` hyperparameter
log-uniformly, which is Determined's `base ** uniform(minval, maxval)` for any base); Determined's grid is queued in
the study (`enqueue_trial`) so that every process sharing the study takes the next point; `searcher.name: optuna`
uses the sampler it names.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError
from dtrain.search.space import Space
from dtrain.search.spec import SearchSpec

GRID_QUEUED = "grid_queued"


def suggest(space: Space, trial: Any) -> dict[str, Any]:
    """A trial's values for the searchable hyperparameters (dotted names), through Optuna's suggest API."""
    values: dict[str, Any] = {}
    for p in space.searchable:
        if p.kind == "int":
            values[p.name] = trial.suggest_int(p.name, int(p.minval), int(p.maxval))
        elif p.kind == "double":
            values[p.name] = trial.suggest_float(p.name, p.minval, p.maxval)
        elif p.kind == "log":
            values[p.name] = trial.suggest_float(p.name, p.base ** p.minval, p.base ** p.maxval, log=True)
        else:
            values[p.name] = trial.suggest_categorical(p.name, list(p.vals))
    return values


def grid_points(space: Space) -> list[dict[str, Any]]:
    """Every point of Determined's grid over the searchable hyperparameters (dotted names), first varying slowest."""
    searchable = list(space.searchable)
    return [dict(zip((p.name for p in searchable), values, strict=True))
            for values in itertools.product(*(p.grid() for p in searchable))]


def _ask_tell_grid(space: Space, seed: int) -> Any:
    """Optuna's GridSampler over Determined's grid points, for an ask-and-tell loop: GridSampler ends a study
    from `after_trial` with `study.stop()`, which only an `optimize` loop accepts; the runner counts the grid's
    points itself."""
    import optuna

    class AskTellGridSampler(optuna.samplers.GridSampler):
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    grid = {p.name: p.grid() for p in space.searchable}
    return AskTellGridSampler(grid, seed=seed)


def make_sampler(spec: SearchSpec, space: Space, seed: int) -> Any:
    import optuna

    if spec.name != "optuna" or spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if spec.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    return _ask_tell_grid(space, seed)


def ask(study: Any, spec: SearchSpec, space: Space, seed: int) -> tuple[Any, dict[str, Any]]:
    """A new trial and its hyperparameters (dotted names). The sampler is seeded by the number of trials in the
    study, so the n-th trial of a seed is the same whether the search ran straight through or was stopped and
    resumed by another process (a sampler seeded once per process would draw the first trials again)."""
    gridded = spec.name == "optuna" and spec.sampler == "grid"  # GridSampler: trial n takes grid point n of its
    # seed's shuffle, so its seed stays the same
    drawn = 0 if gridded else len(study.get_trials(deepcopy=False))
    study.sampler = make_sampler(spec, space, seed * 1_000_003 + drawn)
    trial = study.ask()
    return trial, suggest(space, trial)


def total_trials(spec: SearchSpec, space: Space) -> int:
    """How many trials the search runs: max_trials, or the grid's points."""
    if spec.name == "grid" or (spec.name == "optuna" and spec.sampler == "grid"):
        return len(grid_points(space))
    return spec.max_trials


def rdb_storage(url: str) -> Any:
    """Optuna's RDB storage at `url`. Processes that start on a new SQLite file at the same moment race to create
    its tables (one of them meets a UNIQUE constraint in alembic's version table): try again, the tables exist
    by then."""
    import optuna
    import sqlalchemy.exc

    for attempt in range(6):
        try:
            return optuna.storages.RDBStorage(url)
        except sqlalchemy.exc.SQLAlchemyError:
            if attempt == 5:
                raise
            time.sleep(0.3 * (attempt + 1))
    raise AssertionError("unreachable")


@contextlib.contextmanager
def storage_lock(url: str) -> Iterator[None]:
    """Serialize a read-decide-write on the study among processes on one SQLite file (a lock file beside it);
    other storages are not locked."""
    if not url.startswith("sqlite:///"):
        yield
        return
    import fcntl

    path = Path(url.removeprefix("sqlite:///") + ".lock")
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_study(storage_url: str, study_name: str, spec: SearchSpec, space: Space, seed: int, pruner: Any) -> Any:
    """Create the study, or load it when it exists (a resumed search, or another machine's share of it)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    options = {"storage": rdb_storage(storage_url), "study_name": study_name,
               "sampler": make_sampler(spec, space, seed), "pruner": pruner}
    try:  # creating the study is the one atomic step: only its creator queues a grid
        study = optuna.create_study(direction="minimize" if spec.smaller_is_better else "maximize", **options)
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        study, created = optuna.load_study(**options), False
    if spec.name == "grid":
        if created:
            for point in grid_points(space):  # every process sharing the study takes the next one
                study.enqueue_trial(point)
            study.set_user_attr(GRID_QUEUED, True)
        else:
            deadline = time.monotonic() + 60
            while not study.user_attrs.get(GRID_QUEUED) and time.monotonic() < deadline:
                time.sleep(0.2)  # another process created the study and is queueing the grid
            if not study.user_attrs.get(GRID_QUEUED):
                raise ConfigError(f"study {study_name!r} in {storage_url} has no grid queued: it was created by "
                                  "another kind of search, or its creator stopped; give another --study name")
    return study


def params_of(trial: Any) -> Mapping[str, Any]:
    return dict(trial.params)
