"""Resuming a run at another world size with the same training (docs/checkpoints.md, "Resuming at another size").

A checkpoint records the per-replica split of its global batch (`TrainerState.batch_split`, and the global batch in
`meta.json`). A run that resumes on a different number of data replicas keeps that global batch and cuts it over
the new replicas: evenly where it divides, else uneven by one record, each replica's gradient weighted by its
share (the contract of dtrain.sync.base), so every update is still the full-batch one. The sampler cuts each global
batch out of the same shuffled order whatever the split, so a record is trained at the same step at any size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dtrain.config import ExperimentConfig, model_parallel_size
from dtrain.data.sharding import BatchSplit, split_by_sizes
from dtrain.errors import ConfigError
from dtrain.runs.rundir import CONFIG_FILE, load_run_info
from dtrain.runs.storage import with_secrets
from dtrain.sync import strategy_spec
from dtrain.train.balance import initial_split, proportional_split
from dtrain.train.checkpoint import find_resume_checkpoint, missing_shard_files, read_latest_meta


def split_over(global_batch: int, config: ExperimentConfig, replicas: int, *, was: int) -> BatchSplit:
    """`global_batch` records cut over `replicas` data replicas: by `distributed.heterogeneous`'s explicit shares,
    else evenly where it divides and uneven by one record where it does not; `was` (the replicas the checkpoint was
    written by) only for the error line."""
    if global_batch < replicas:
        raise ConfigError(f"this run's global batch is {global_batch} records (written by {was} data replica(s)); "
                          f"{replicas} data replicas cannot each train a share of it (a resumed run keeps its global "
                          f"batch); resume on at most {global_batch} replicas, or start a new --run-dir")
    het = config.distributed.heterogeneous
    shares = het.split if het is not None and isinstance(het.split, list) else [1.0] * replicas
    return proportional_split(global_batch, shares)


def resumed_split(config: ExperimentConfig, replicas: int, state: Mapping[str, Any] | None) -> BatchSplit | None:
    """The split a run resuming from a checkpoint's `state` (its `state.pt`) trains with on `replicas` data replicas:
    the recorded one at the same size, the recorded global batch cut over the new replicas at another size; None when
    the checkpoint records no split and was written at this size (the config's own split is the run's)."""
    if state is None:
        return None
    recorded = (state.get("trainer") or {}).get("batch_split")
    if recorded and len(recorded) == replicas:
        return split_by_sizes([int(size) for size in recorded])
    stages = model_parallel_size(config.distributed)
    written_by = max(len(state.get("rng") or ()) // stages, 1)  # every rank's RNG state: the old world size
    if not recorded and written_by == replicas:
        return None
    was = len(recorded) if recorded else written_by
    refuse_fixed_size(config, was * stages)
    if recorded:
        global_batch = sum(int(size) for size in recorded)
    else:  # a checkpoint from before splits were recorded, never resized: the config's split at its own size
        global_batch = initial_split(config, written_by).global_batch_size
    return split_over(global_batch, config, replicas, was=was)


def refuse_fixed_size(config: ExperimentConfig, was: int) -> None:
    """ConfigError (one line) when the strategy's trajectory depends on the worker count by design (its
    `StrategySpec.cannot_resize`), so that a run of it written by `was` workers cannot go on at another size."""
    reason = strategy_spec(config.distributed.strategy).cannot_resize
    if reason is not None:
        raise ConfigError(f"resources.slots_per_trial {config.resources.world_size}: this run was written by {was} "
                          f"worker(s) with strategy {config.distributed.strategy}, which cannot resume at another "
                          f"size ({reason}); resume it with slots_per_trial {was}, or `dtrain export` its model and "
                          "start a new run from it")


def check_resize(config: ExperimentConfig, meta: Mapping[str, Any] | None) -> None:
    """Before workers start: ConfigError (one line) when the latest checkpoint's global batch (its `meta.json`)
    cannot be cut over the data replicas of `config`."""
    if not meta or not isinstance(meta.get("global_batch"), int):
        return
    stages = model_parallel_size(config.distributed)
    replicas = config.resources.world_size // stages
    was = int(meta.get("data_replicas") or 0)
    if was != replicas:
        refuse_fixed_size(config, was * stages)
        split_over(int(meta["global_batch"]), config, replicas, was=was)


def check_resume(config: ExperimentConfig, run_dir: Path | None) -> None:
    """Before any worker starts (`dtrain run` on a run dir that holds a run): CheckpointError (one line) when the
    latest checkpoint's shards lack a rank's file and no older complete checkpoint is left to resume from; at another
    world size, ConfigError (one line) where the strategy cannot change size or the latest checkpoint's global batch
    cannot be cut over the new data replicas. Nothing is written."""
    if run_dir is None or not (run_dir / CONFIG_FILE).is_file():
        return
    try:
        store = with_secrets(load_run_info(run_dir).checkpoints)
        meta = read_latest_meta(store)
    except Exception:  # unreachable storage: the workers read the checkpoint and check the same again
        return
    if meta is None:
        return
    sharded = meta.get("sharded")
    if isinstance(sharded, str) and missing_shard_files(store, sharded):
        find_resume_checkpoint(store)  # an older complete checkpoint (the workers resume from it), or one line
    old = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
    was = max(int(((old.get("resources") or {}).get("slots_per_trial")) or 1), 1)
    if was != config.resources.world_size:
        check_resize(config, meta)
