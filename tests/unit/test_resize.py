"""Resuming at another world size (dtrain.train.resize): the split a resumed run cuts its recorded global batch
into, and the one-line refusals (a global batch the new size cannot split, a strategy whose trajectory depends on
the worker count)."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.config import ExperimentConfig, load_config
from dtrain.errors import ConfigError
from dtrain.train.resize import check_resize, resumed_split

RAW: dict[str, Any] = {"name": "r", "entrypoint": "m:T", "hyperparameters": {"global_batch_size": 16},
                       "searcher": {"max_length": {"batches": 3}}}


def config(*overrides: str) -> ExperimentConfig:
    return load_config(None, list(overrides), raw=RAW).config


def state(split: list[int] | None, ranks: int) -> dict[str, Any]:
    return {"trainer": {"batch_split": split}, "rng": [{}] * ranks}


def test_the_recorded_global_batch_is_cut_over_the_new_replicas() -> None:
    three = config("resources.slots_per_trial=3")
    assert resumed_split(three, 3, state([8, 8], 2)).per_rank == (6, 5, 5)
    assert resumed_split(config(), 1, state([8, 8], 2)).per_rank == (16,)
    assert resumed_split(three, 3, state([6, 5, 5], 3)).per_rank == (6, 5, 5)
    # a global batch the old size had cut with Determined's rule (15 of 16 on 3) stays 15 at any size
    assert resumed_split(config(), 2, state([5, 5, 5], 3)).per_rank == (8, 7)
    # a checkpoint that records no split: the config's split at the size that wrote it (15 on 3 ranks)
    assert resumed_split(config(), 1, state(None, 3)).per_rank == (15,)
    assert resumed_split(three, 3, state(None, 3)) is None and resumed_split(three, 3, None) is None


def test_explicit_heterogeneous_shares_cut_the_recorded_batch() -> None:
    shares = config("resources.slots_per_trial=2", "distributed.heterogeneous.split=[3, 1]")
    assert resumed_split(shares, 2, state([16], 1)).per_rank == (12, 4)


def test_a_size_that_cannot_split_the_global_batch_is_one_line() -> None:
    eight = config("resources.slots_per_trial=8")
    with pytest.raises(ConfigError, match=r"^this run's global batch is 6 records \(written by 3 data replica\(s\)\); "
                       r"8 data replicas cannot each train a share of it .*resume on at most 6 replicas"):
        resumed_split(eight, 8, state([2, 2, 2], 3))
    with pytest.raises(ConfigError, match="global batch is 6 records"):
        check_resize(eight, {"global_batch": 6, "data_replicas": 3})
    check_resize(eight, {"global_batch": 8, "data_replicas": 2})  # 8 over 8 is fine


def test_a_strategy_whose_trajectory_depends_on_the_worker_count_refuses_another_size() -> None:
    local = config("resources.slots_per_trial=3", "distributed.strategy=local_sgd")
    with pytest.raises(ConfigError, match=r"resources.slots_per_trial 3: this run was written by 2 worker\(s\) with "
                       r"strategy local_sgd, which cannot resume at another size \(local SGD .*resume it with "
                       "slots_per_trial 2"):
        resumed_split(local, 3, state([8, 8], 2))
    assert resumed_split(config("resources.slots_per_trial=2", "distributed.strategy=local_sgd"), 2,
                         state([8, 8], 2)).per_rank == (8, 8)


def test_a_batch_above_max_per_slot_batch_is_trained_in_near_equal_passes_in_the_global_order() -> None:
    """`optimizations.max_per_slot_batch`: 16 records with at most 8 per pass are 2 passes of 8, 15 are 8 and 7; the
    parts are this rank's records of the batch in order, so the update's records are the same."""
    from dtrain.data.sharding import ShardedBatchSampler, pass_sizes, split_by_sizes
    from dtrain.optim.batch_schedule import BatchPhase
    from dtrain.train.batches import BatchSizes

    assert pass_sizes(16, 2) == (8, 8) and pass_sizes(15, 2) == (8, 7) and pass_sizes(5, 1) == (5,)
    sizes = BatchSizes(split_by_sizes([15, 1]), rank=0, world_size=2, average_aggregated=True, max_per_pass=8)
    sizes.enter(BatchPhase(0, 1, 16, 1, 0, 0, 0))
    assert sizes.pass_records == (8, 7)
    whole = list(ShardedBatchSampler(64, split_by_sizes([15, 1]), 0, seed=3, epoch=0))
    parts = list(ShardedBatchSampler(64, split_by_sizes([15, 1]), 0, seed=3, epoch=0, passes=2))
    assert len(parts) == 2 * len(whole) and [len(p) for p in parts[:2]] == [8, 7]
    assert [parts[2 * i] + parts[2 * i + 1] for i in range(len(whole))] == whole


def test_max_per_slot_batch_with_a_pipeline_is_one_line() -> None:
    with pytest.raises(ConfigError, match="optimizations.max_per_slot_batch with strategy pipeline: raise "
                       "distributed.pipeline.microbatches instead"):
        config("resources.slots_per_trial=2", "distributed.strategy=pipeline", "optimizations.max_per_slot_batch=4")
