"""Sections on what one trial runs with: resources, searcher, seed and data loading (checkpoint storage: storage.py).

All but `data_loader` come from Determined's classic experiment file; keys that dtrain accepts from it but
does not use say so in their description.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dtrain.config.base import DETERMINED_ONLY, Length, Section


class Resources(Section):
    """How many worker processes the trial runs on."""

    slots_per_trial: int = Field(
        default=1, ge=0, description="worker processes (one per slot); per-slot batch = `global_batch_size // slots` "
        "(a remainder is dropped with a warning; a global batch below the slot count is an error); Determined's 0 "
        "(a CPU-only trial) means one process")

    @property
    def world_size(self) -> int:
        """Processes to start; Determined's 0 (a CPU-only trial) means one process."""
        return max(self.slots_per_trial, 1)


SearcherName = Literal["single", "random", "grid", "adaptive_asha", "optuna", "async_halving"]
SearchUnit = Literal["batches", "records", "epochs"]
SearchMode = Literal["aggressive", "standard", "conservative"]
SearchSampler = Literal["tpe", "random", "cmaes", "grid"]
SearchPruner = Literal["hyperband", "successive_halving", "median", "none"]
SEARCH_ONLY = "search only (docs/search.md): "


class Searcher(Section):
    """How long to train and which metric picks the best checkpoint. Searcher `single` trains one trial; `random`,
    `grid`, `adaptive_asha` and `optuna` run a search, each trial an ordinary run (`dtrain run`, docs/search.md),
    and read the search keys below (dtrain.search.spec checks them)."""

    name: SearcherName = Field(
        default="single", description="how trials are chosen (Determined's searcher names, plus `optuna`); "
        "`single` trains one trial")
    metric: str = Field(default="validation_loss", description="the validation metric that picks the best "
                        "checkpoint (`validation_` prefix optional)")
    smaller_is_better: bool = Field(default=True, description="whether a smaller `metric` is better")
    max_length: Length | None = Field(
        default=None, description="training length: `{batches: N}`, `{records: N}`, `{epochs: N}` or a bare number "
        "(batches; Determined's Core API lengths have no unit); required for a Trial class, optional for a command, "
        "which sets its own length")
    max_trials: int | None = Field(default=None, ge=0, description=SEARCH_ONLY + "trials to run in all (required "
                                   "except for a grid, whose points are the trials)")
    max_concurrent_trials: int = Field(default=16, ge=0, description=SEARCH_ONLY + "trials at once, also bounded by "
                                       "`--slots` / `resources.slots_per_trial`; 0: as many as the slots allow")
    max_time: int | None = Field(default=None, ge=1, description=SEARCH_ONLY + "`adaptive_asha`, `optuna`: a trial's "
                                 "longest training in `time_metric` units (instead of `max_length`)")
    time_metric: SearchUnit = Field(default="batches", description=SEARCH_ONLY + "the unit of `max_time`")
    divisor: float = Field(default=4, gt=1, description=SEARCH_ONLY + "`adaptive_asha`, `optuna`'s pruners: the "
                           "fraction 1/divisor of trials promoted at each rung")
    max_rungs: int = Field(default=5, ge=1, description=SEARCH_ONLY + "`adaptive_asha`: the most rungs a bracket has")
    mode: SearchMode = Field(default="standard", description=SEARCH_ONLY + "`adaptive_asha`: how many brackets, "
                             "from `aggressive` (one, the most early stopping) to `conservative`")
    bracket_rungs: list[int] = Field(default_factory=list, description=SEARCH_ONLY + "`adaptive_asha`: the rungs "
                                     "of each bracket, instead of those `mode` gives")
    sampler: SearchSampler = Field(default="tpe", description=SEARCH_ONLY + "`optuna`: Optuna's sampler")
    pruner: SearchPruner = Field(default="none", description=SEARCH_ONLY + "`optuna`: Optuna's pruner, stopping "
                                 "trials at rungs as `divisor` sets them")
    source_trial_id: int | None = Field(default=None, description=DETERMINED_ONLY)
    source_checkpoint_uuid: str | None = Field(default=None, description=DETERMINED_ONLY)


class Reproducibility(Section):
    """The seed behind every random choice of a run."""

    experiment_seed: int = Field(default=0, ge=0, description="seeds weights, shuffles and per-rank RNG streams; "
                                                              "the same seed gives the same bits")


class DataLoaderConfig(Section):
    """How each worker loads its batches."""

    num_workers: int = Field(default=0, ge=0, description="loader processes per worker")
    validation_batch_size: int | None = Field(default=None, ge=1, description="evaluation batch size; default "
                                                                               "the per-slot batch")
