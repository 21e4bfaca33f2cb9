"""A run resumed at other world sizes keeps its training (float64, 1e-9 relative): it trains batches 1-2 on 2 slots,
stops with a checkpoint, resumes on 1 slot for batches 3-4, stops again and ends on 3 slots, and its model equals an
uninterrupted 2-slot run's. The global batch of 16 is 8/8, then 16, then 6/5/5 (uneven: Determined's even split
would drop a record at 3 slots); SGD with momentum and a one-cycle LR schedule, so the optimizer state and the
schedule must carry over too. Each phase is its own spawn, through `prepare_run_dir` as `dtrain run` resumes.
`hierarchical` and `hsdp` go 4 -> 1 -> 3 slots, their node groups and meshes changing with the size, and are held
to one uninterrupted 1-slot run."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dtrain.comm import Topology
from dtrain.config import load_config
from tests.distributed.conftest import fixture_trainer, run_spawned
from tests.distributed.test_sharded import _relative, _whole

STEPS = 6
RAW: dict[str, Any] = {
    "name": "resize", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 16, "learning_rate": 0.3, "momentum": 0.9, "float64": True,
                        "hidden": 16, "one_cycle": True},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": STEPS}},
    "reproducibility": {"experiment_seed": 11},
    "resources": {"slots_per_trial": 2},
    "min_validation_period": {"batches": 3},
}
# (slots, the batch after which this phase stops with a checkpoint; None: to the end)
PHASES: tuple[tuple[int, int | None], ...] = ((2, 2), (1, 4), (3, None))


def with_slots(raw: dict[str, Any], slots: int, stop_after: int | None) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    out["resources"] = {**out.get("resources", {}), "slots_per_trial": slots}
    if stop_after is not None:
        out["faults"] = {"stop_after_batch": stop_after}
    return out


def _phase(topology: Topology, raw: dict[str, Any], run_dir: str, ranks_per_node: int | None = None
           ) -> dict[str, Any]:
    """One phase on `topology`, its ranks cut into emulated nodes of `ranks_per_node` when given (the layout
    hierarchical's node groups and hsdp's default shard groups follow)."""
    if ranks_per_node is not None:
        topology = dataclasses.replace(topology, local_world_size=ranks_per_node,
                                       local_rank=topology.rank % ranks_per_node,
                                       node_rank=topology.rank // ranks_per_node)
    config = load_config(None, raw=raw).config
    trainer = fixture_trainer(topology, config, run_dir)
    start = trainer.state.steps_completed
    summary = trainer.fit()
    return {"status": summary["status"], "start": start, "steps": trainer.state.steps_completed,
            "samples": trainer.state.samples_trained, "split": list(trainer.sizes.base.per_rank),
            "lr": float(trainer.optimization.optimizer.param_groups[0]["lr"]),
            "passes": list(trainer.sizes.pass_records), "described": trainer.strategy.describe(),
            "state": _whole(trainer.strategy.unwrap_model()),
            "sharded": (Path(run_dir) / "checkpoints" / "sharded" / f"step-{trainer.state.steps_completed}").is_dir()}


def resized_runs(spawn: Callable[..., list[Any]], raw: dict[str, Any], root: Path,
                 phases: tuple[tuple[int, int | None], ...] = PHASES, middle: dict[str, Any] | None = None,
                 layouts: tuple[int | None, ...] | None = None, sections: tuple[dict[str, Any], ...] | None = None,
                 reference: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every phase's rank results (the last phase's ranks last), and rank 0 of an uninterrupted run at the first
    phase's size and layout (or `reference`, an uninterrupted run already trained); `middle`: optimizations of the
    middle phase only; `layouts`: each phase's ranks per emulated node (None: one node); `sections`: each phase's
    `distributed` section (default: `raw`'s)."""
    layouts = layouts or (None,) * len(phases)
    sections = sections or (raw.get("distributed", {}),) * len(phases)
    results = []
    for index, (slots, stop_after) in enumerate(phases):
        phase_raw = {**with_slots(raw, slots, stop_after), "distributed": sections[index]}
        if middle is not None and index == 1:
            phase_raw["optimizations"] = middle
        ranks = spawn(_phase, slots, phase_raw, str(root / "resized"), layouts[index], timeout=300)
        results.append(ranks)
    if reference is not None:
        return results, reference
    whole_raw = {**with_slots(raw, phases[0][0], None), "distributed": sections[0]}
    uninterrupted = spawn(_phase, phases[0][0], whole_raw, str(root / "whole"), layouts[0], timeout=300)
    return results, uninterrupted[0]


# strategy -> its distributed section: replicated state (allreduce), ZeRO-1's optimizer state consolidated on save and
# partitioned again on load, FSDP2's parameters and optimizer state resharded by distributed checkpoint on load
STRATEGIES: dict[str, dict[str, Any]] = {"allreduce": {}, "zero1": {"strategy": "zero1"}, "fsdp": {"strategy": "fsdp"}}


def check_same_training(phases: list[list[dict[str, Any]]], whole: dict[str, Any], splits: list[list[int]],
                        replicated: int = 1) -> None:
    """Each phase began where the last stopped, cut the same global batch as `splits` says, and the end equals the
    uninterrupted run within 1e-9 (and it moved the weights); `replicated`: ranks per data replica (pipeline stages),
    which share their replica's split."""
    starts = [0] + [stop for _, stop in PHASES[:-1] if stop is not None]
    for ranks, start, split in zip(phases, starts, splits, strict=True):
        assert len(ranks) == len(split) * replicated
        assert all(rank["start"] == start and rank["split"] == split for rank in ranks), (start, split, ranks[0])
    last = phases[-1]
    assert whole["status"] == "completed" and whole["steps"] == STEPS
    first = phases[0][0]["state"]
    assert _relative(first, whole["state"]) > 1e-3  # the later phases moved the weights
    for rank in last:
        assert rank["status"] == "completed" and rank["steps"] == STEPS
        assert rank["samples"] == whole["samples"] == STEPS * sum(splits[0])
        assert rank["lr"] == pytest.approx(whole["lr"], rel=1e-12)  # the schedule carried over
        assert _relative(rank["state"], whole["state"]) < 1e-9


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_run_resumed_at_other_sizes_equals_the_uninterrupted_run(spawn: Callable[..., list[Any]], tmp_path: Path,
                                                                   name: str) -> None:
    phases, whole = resized_runs(spawn, {**RAW, "distributed": STRATEGIES[name]}, tmp_path)
    check_same_training(phases, whole, [[8, 8], [16], [6, 5, 5]])
    if name == "fsdp":  # the phases read and wrote shards (DCP), not a plain model.pt
        assert all(rank["sharded"] for ranks in phases for rank in ranks)


@pytest.mark.parametrize("name", ["allreduce", "fsdp"])
def test_the_middle_phase_may_train_its_larger_batch_in_several_passes(spawn: Callable[..., list[Any]],
                                                                       tmp_path: Path, name: str) -> None:
    """On 1 slot the 16 records of a batch are more than `optimizations.max_per_slot_batch: 8`: two passes of 8
    whose gradients accumulate (aggregation inside the batch, FSDP's no_sync), and the run still ends within 1e-9."""
    phases, whole = resized_runs(spawn, {**RAW, "distributed": STRATEGIES[name]}, tmp_path,
                                 middle={"max_per_slot_batch": 8})
    check_same_training(phases, whole, [[8, 8], [16], [6, 5, 5]])
    assert [ranks[0]["passes"] for ranks in phases] == [[8], [8, 8], [6]]


def test_pipeline_x_data_keeps_its_stages_and_changes_its_data_parallel_degree(spawn: Callable[..., list[Any]],
                                                                               tmp_path: Path) -> None:
    """2 stages x 2, then 1, then 3 data replicas (4, 2, 6 processes), 4 microbatches of each replica's share."""
    raw = {**RAW, "hyperparameters": {**RAW["hyperparameters"], "global_batch_size": 24},
           "distributed": {"strategy": "pipeline", "pipeline": {"stages": 2, "microbatches": 4, "schedule": "1f1b"}}}
    phases = tuple((slots * 2, stop) for slots, stop in PHASES)
    results, whole = resized_runs(spawn, raw, tmp_path, phases)
    check_same_training(results, whole, [[12, 12], [24], [8, 8, 8]], replicated=2)


# 4 slots (two emulated nodes of 2 for hierarchical, a 2 x 2 mesh for hsdp), then 1, then 3
TWO_LEVEL_PHASES: tuple[tuple[int, int | None], ...] = ((4, 2), (1, 4), (3, None))


@pytest.fixture(scope="module")
def one_slot_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run the two-level strategies are held to: the 6 batches of 16 on one slot (the full-batch
    update every size equals), trained once for both tests."""
    return run_spawned(_phase, 1, with_slots(RAW, 1, None), str(tmp_path_factory.mktemp("one_slot")), timeout=300)[0]


def test_hierarchical_changes_its_nodes_and_keeps_its_training(spawn: Callable[..., list[Any]], tmp_path: Path,
                                                                one_slot_run: dict[str, Any]) -> None:
    """Two nodes of 2 (reduce inside each node, all-reduce between the leaders, broadcast back), then 1 slot, then
    three nodes of 1 (between the leaders only): DDP's replicated state carries over and the uneven 6/5/5 split
    goes through the two levels' sum."""
    raw = {**RAW, "distributed": {"strategy": "hierarchical"}}
    phases, whole = resized_runs(spawn, raw, tmp_path, TWO_LEVEL_PHASES, layouts=(2, None, 1),
                                 reference=one_slot_run)
    check_same_training(phases, whole, [[4, 4, 4, 4], [16], [6, 5, 5]])
    assert [(ranks[0]["described"].get("nodes"), ranks[0]["described"].get("ranks_per_node"))
            for ranks in (phases[0], phases[2])] == [(2, 2), (3, 1)]


def test_hsdp_changes_its_mesh_and_keeps_its_training(spawn: Callable[..., list[Any]], tmp_path: Path,
                                                      one_slot_run: dict[str, Any]) -> None:
    """2 replicas x 2 shards (`distributed.hsdp.shard_size: 2`), then one rank, then one replica sharded over 3
    (shard_size unset: the ranks of the one node): distributed checkpoint reshards the parameters and the optimizer
    state from each mesh to the next, and `shard_size` may change at the resume with the size."""
    hsdp = {"strategy": "hsdp"}
    sections = ({**hsdp, "hsdp": {"shard_size": 2}}, hsdp, hsdp)
    phases, whole = resized_runs(spawn, {**RAW, "distributed": hsdp}, tmp_path, TWO_LEVEL_PHASES,
                                 sections=sections, reference=one_slot_run)
    check_same_training(phases, whole, [[4, 4, 4, 4], [16], [6, 5, 5]])
    assert all(rank["sharded"] for ranks in phases for rank in ranks)
    assert [(ranks[0]["described"].get("replicas"), ranks[0]["described"].get("shards"))
            for ranks in phases] == [(2, 2), (1, 1), (1, 3)]
