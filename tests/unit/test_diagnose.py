"""`dtrain diagnose` without running trials: the trials it plans (every override accepted by the config loader, as
`dtrain run --set` applies them) and the analysis of hand-built profiles, checked against figures computed here."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.config import ExperimentConfig, check_buildable, load_config
from dtrain.diagnose.analysis import BOTTLENECK_PERCENT, analyse, combine, verdict_lines
from dtrain.diagnose.trials import NO_COMMUNICATION_K, trial_dir, trial_plans, trial_runs
from tests.conftest import FIXTURES

CONFIG = FIXTURES / "digits.yaml"  # 2 slots, global batch 64


def load(*overrides: str) -> ExperimentConfig:
    config = load_config(CONFIG, overrides).config
    check_buildable(config)
    return config


# ------------------------------------------------------------------------------------------ trial plans


def test_two_slots_get_four_trials_with_the_promised_overrides() -> None:
    config = load()
    plans = trial_plans(config, steps=12)
    assert [plan.name for plan in plans] == ["configured", "no_communication", "synthetic_data", "one_slot"]
    trials = {plan.name: load(*plan.overrides) for plan in plans}
    for trial in trials.values():  # the common part: a short run that only trains and times its phases
        assert trial.searcher.max_length.batches == 12 and trial.scheduling_unit == 12
        assert trial.min_validation_period.batches == 0 and trial.min_checkpoint_period.batches == 0
        assert trial.checkpoint_policy == "none" and trial.perform_initial_validation is False
        assert trial.max_restarts == 0 and trial.faults.stop_after_batch is None
        assert trial.profiling.phase_timers is True and trial.profiling.enabled is False
    configured = trials["configured"]
    assert (configured.resources.world_size, configured.global_batch_size) == (2, 64)
    assert configured.optimizations.aggregation_frequency == 1 and not configured.faults.synthetic_data
    assert trials["no_communication"].optimizations.aggregation_frequency == NO_COMMUNICATION_K == 1000
    assert trials["synthetic_data"].faults.synthetic_data is True
    one_slot = trials["one_slot"]
    assert one_slot.resources.world_size == 1 and one_slot.global_batch_size == 64 // 2  # same per-slot batch
    # each trial changes one thing against the configured one
    for name, changed in [("no_communication", "optimizations"), ("synthetic_data", "faults"),
                          ("one_slot", "resources")]:
        differ = {key for key, value in trials[name].model_dump().items() if configured.model_dump()[key] != value}
        assert differ == ({changed, "hyperparameters"} if name == "one_slot" else {changed}), name


def test_one_slot_gets_three_trials_and_an_uneven_batch_keeps_its_per_slot_size() -> None:
    assert [p.name for p in trial_plans(load("resources.slots_per_trial=1"), 8)] == [
        "configured", "no_communication", "synthetic_data"]
    [one_slot] = [p for p in trial_plans(load("hyperparameters.global_batch_size=65"), 8) if p.name == "one_slot"]
    assert load(*one_slot.overrides).global_batch_size == 32  # each of the 2 slots trains on 65 // 2 = 32


def test_a_pipeline_gets_no_aggregation_trial_and_its_one_slot_trial_trains_one_replicas_batch() -> None:
    """aggregation_frequency > 1 is refused with a pipeline, and 1 slot cannot hold 2 stages: the one-slot trial runs
    the whole model (allreduce) on one pipeline replica's batch."""
    config = load("resources.slots_per_trial=4", "distributed.strategy=pipeline", "distributed.pipeline.stages=2")
    plans = {plan.name: plan for plan in trial_plans(config, 8)}
    assert list(plans) == ["configured", "synthetic_data", "one_slot"]
    one_slot = load("resources.slots_per_trial=4", "distributed.strategy=pipeline", "distributed.pipeline.stages=2",
                    *plans["one_slot"].overrides)
    assert (one_slot.resources.world_size, one_slot.distributed.strategy, one_slot.global_batch_size) == (
        1, "allreduce", 64 // 2)


@pytest.mark.parametrize("faults", [
    ("faults.slow_rank=1", "faults.slow_factor=2"),
    ("faults.hang_rank=1", "faults.hang_at_step=3"),
    ("faults.nan_rank=1", "faults.nan_batches=[3]"),
    ("faults.kills=[{rank: 1, batch: 5}, {rank: 0, batch: 7}]",),
])
def test_faults_aimed_at_other_ranks_are_dropped_from_the_one_slot_trial(faults: tuple[str, ...]) -> None:
    config = load(*faults)
    plans = {plan.name: plan for plan in trial_plans(config, 10)}
    for name, plan in plans.items():
        trial = load(*faults, *plan.overrides)  # what `dtrain run --set` gets for this trial
        ranks = trial.faults.ranks()
        if name == "one_slot":
            assert all(rank == 0 for rank in ranks.values()), ranks
        else:
            assert ranks == config.faults.ranks(), name  # the two-slot trials keep every fault
    one_slot = load(*faults, *plans["one_slot"].overrides)
    assert [(kill.rank, kill.batch) for kill in one_slot.faults.kills] == [
        (kill.rank, kill.batch) for kill in config.faults.kills if kill.rank == 0]


def test_faults_on_rank_zero_stay_in_the_one_slot_trial() -> None:
    faults = ("faults.slow_rank=0", "faults.slow_factor=3", "faults.hang_rank=0")
    [one_slot] = [p for p in trial_plans(load(*faults), 10) if p.name == "one_slot"]
    trial = load(*faults, *one_slot.overrides)
    assert (trial.faults.slow_rank, trial.faults.slow_factor, trial.faults.hang_rank) == (0, 3.0, 0)


@pytest.mark.parametrize("strategy", [
    ("distributed.parameter_server.backup_workers=1",),
    ("distributed.parameter_server.mode=async",),
    ("distributed.parameter_server.mode=ssp", "distributed.parameter_server.staleness=2"),
])
def test_every_trial_of_a_parameter_server_run_is_a_valid_config(strategy: tuple[str, ...]) -> None:
    overrides = ("distributed.strategy=parameter_server", *strategy)
    configured = load(*overrides).distributed.parameter_server
    for plan in trial_plans(load(*overrides), 10):
        trial = load(*overrides, *plan.overrides)
        assert trial.distributed.strategy == "parameter_server", plan.name
        server = trial.distributed.parameter_server
        if plan.name == "no_communication":  # k > 1 needs sync mode without backups; the mode hardly matters then
            assert trial.optimizations.aggregation_frequency == NO_COMMUNICATION_K
            assert (server.mode, server.backup_workers) == ("sync", 0)
        elif plan.name == "one_slot":  # one worker cannot have a backup
            assert (server.mode, server.backup_workers) == (configured.mode, 0)
        else:
            assert server == configured, plan.name


# ---------------------------------------------------------------------------------------------- analyse


def rank(data: float, forward: float, backward: float, comm_wait: float = 0.0, optimizer: float = 0.0,
         steps: int = 10) -> dict[str, Any]:
    """One rank's part of summary.json's `profile`, as the Profiler writes it (only what analyse reads)."""
    return {"steps": steps, "median_seconds": {"data": data, "forward": forward, "backward": backward,
                                               "comm_wait": comm_wait, "optimizer": optimizer, "report": 0.0}}


def profiles(configured: list[dict[str, Any]], no_communication: list[dict[str, Any]],
             synthetic_data: list[dict[str, Any]], one_slot: list[dict[str, Any]] | None = None
             ) -> dict[str, dict[str, Any]]:
    found = {"configured": {"ranks": configured}, "no_communication": {"ranks": no_communication},
             "synthetic_data": {"ranks": synthetic_data}}
    if one_slot is not None:
        found["one_slot"] = {"ranks": one_slot}
    return found


def test_a_communication_bound_run() -> None:
    same = rank(0.01, 0.02, 0.03, comm_wait=0.04, optimizer=0.01)
    result = analyse(load(), profiles(
        configured=[same, same],
        no_communication=[rank(0.01, 0.02, 0.03, optimizer=0.01)] * 2,
        synthetic_data=[rank(0.001, 0.02, 0.03, comm_wait=0.04, optimizer=0.01)] * 2,
        one_slot=[rank(0.01, 0.02, 0.03, optimizer=0.01)]))
    pace, step = 0.10, 0.11  # data+forward+backward+comm_wait; plus the optimizer
    assert result["communication_overhead_percent"] == pytest.approx(100 * (pace - 0.06) / pace, abs=1e-9)  # 40 %
    assert result["exposed_communication_wait_percent"] == pytest.approx(100 * 0.04 / pace, abs=1e-9)
    assert result["input_overhead_percent"] == pytest.approx(100 * 0.009 / pace, abs=1e-9)  # 9 %: below the bar
    assert result["step_ms"] == pytest.approx(step * 1e3, abs=1e-9)
    assert result["samples_per_second"] == pytest.approx(64 / step, rel=1e-12)
    assert result["scaling_efficiency_percent"] == pytest.approx(100 * 0.07 / step, abs=1e-9)  # 63.6 %
    assert result["one_slot_samples_per_second"] == pytest.approx(32 / 0.07, rel=1e-12)
    assert result["rank_compute_ms"] == pytest.approx([70.0, 70.0], abs=1e-9)
    assert result["bottleneck"] == "communication"
    assert [f["name"] for f in result["findings"]] == ["communication"]
    [advice] = result["advice"]
    assert advice.startswith("communication: ") and "optimizations.aggregation_frequency (now 1)" in advice
    assert result["verdict"] == verdict_lines(result)
    assert result["verdict"][:4] == [
        "bottleneck: communication (40% of the step)",
        "communication overhead 40.0% of the step (exposed wait 40.0%)",
        "input-pipeline overhead 9.0%",
        "scaling efficiency 64% (582 samples/s on 2 slots vs 457 on 1)"]


def test_an_input_bound_run() -> None:
    slow_input = rank(0.05, 0.02, 0.02, comm_wait=0.001)
    result = analyse(load(), profiles(
        configured=[slow_input, slow_input],
        no_communication=[rank(0.05, 0.02, 0.02)] * 2,
        synthetic_data=[rank(0.002, 0.02, 0.02, comm_wait=0.001)] * 2))
    pace = 0.091
    assert result["input_overhead_percent"] == pytest.approx(100 * 0.048 / pace, abs=1e-9)  # 52.7 %
    assert result["communication_overhead_percent"] == pytest.approx(100 * 0.001 / pace, abs=1e-9)
    assert "scaling_efficiency_percent" not in result  # no one-slot trial
    assert result["bottleneck"] == "input pipeline"
    assert [a.split(":")[0] for a in result["advice"]] == ["input pipeline"]
    assert "data_loader.num_workers (now 0)" in result["advice"][0]
    assert "input-pipeline overhead 52.7%" in result["verdict"]
    assert result["verdict"][0] == "bottleneck: input pipeline (53% of the step)"


def test_a_straggler_run_names_the_slowest_rank() -> None:
    result = analyse(load(), profiles(
        configured=[rank(0.01, 0.02, 0.02, comm_wait=0.03), rank(0.01, 0.02, 0.05)],  # rank 0 waits for rank 1
        no_communication=[rank(0.01, 0.02, 0.02), rank(0.01, 0.02, 0.05)],  # each at its own pace, the job at 1's
        synthetic_data=[rank(0.01, 0.02, 0.02, comm_wait=0.03), rank(0.01, 0.02, 0.05)]))
    pace = 0.08
    assert result["communication_overhead_percent"] == pytest.approx(0.0, abs=1e-9)
    slowest = result["slowest_rank"]
    assert slowest["rank"] == 1 and slowest["compute_ms"] == pytest.approx(80.0, abs=1e-9)
    assert slowest["slower_than_others_percent"] == pytest.approx(100 * (0.08 - 0.05) / 0.05, abs=1e-9)  # 60 %
    assert slowest["others_wait_percent"] == pytest.approx(100 * 0.03 / pace, abs=1e-9)  # 37.5 %
    assert result["bottleneck"] == "slowest rank 1"
    [advice] = result["advice"]
    assert advice.startswith("slowest rank 1: rank 1 computes 60% slower") and "logs/rank-1.log" in advice
    assert "`distributed.heterogeneous: {split: auto}`" in advice  # the fix dtrain has for it
    assert result["verdict"][0] == "bottleneck: slowest rank 1 (38% of the step)"
    assert result["verdict"][-1] == "slowest rank 1: compute 80.0 ms per step, 60% slower than the others"
    assert slowest["confirmed"] is True  # as slow in the synthetic-data trial


def test_a_rank_slow_in_one_trial_only_is_reported_but_not_named_the_bottleneck() -> None:
    result = analyse(load(), profiles(
        configured=[rank(0.01, 0.02, 0.02, comm_wait=0.03), rank(0.01, 0.02, 0.05)],  # rank 1 lags 30 ms here
        no_communication=[rank(0.01, 0.02, 0.02), rank(0.01, 0.02, 0.05)],
        synthetic_data=[rank(0.01, 0.02, 0.022), rank(0.01, 0.02, 0.02, comm_wait=0.002)]))  # and not here
    slowest = result["slowest_rank"]
    assert slowest["rank"] == 1 and slowest["others_wait_percent"] == pytest.approx(100 * 0.03 / 0.08, abs=1e-9)
    assert slowest["repeated_slower_percent"] == pytest.approx(100 * -0.002 / 0.05, abs=1e-9)
    assert slowest["confirmed"] is False
    assert result["findings"] == [] and result["bottleneck"] == "compute"
    assert result["verdict"][-1] == ("slowest rank 1: compute 80.0 ms per step, 60% slower than the others, but only "
                                     "0% in the synthetic-data trial: load that came and went, not the rank itself")


def test_a_slow_data_phase_on_one_rank_counts_although_synthetic_data_cannot_repeat_it() -> None:
    result = analyse(load(), profiles(
        configured=[rank(0.01, 0.02, 0.02, comm_wait=0.03), rank(0.04, 0.02, 0.02)],  # rank 1's loader lags 30 ms
        no_communication=[rank(0.01, 0.02, 0.02), rank(0.04, 0.02, 0.02)],
        synthetic_data=[rank(0.0, 0.02, 0.02), rank(0.0, 0.02, 0.02)]))
    slowest = result["slowest_rank"]
    assert slowest["rank"] == 1 and slowest["confirmed"] is True
    assert slowest["repeated_slower_percent"] == pytest.approx(slowest["slower_than_others_percent"], abs=1e-9)
    assert result["bottleneck"] == "slowest rank 1"


def test_findings_come_largest_first_each_with_its_advice() -> None:
    configured = rank(0.02, 0.03, 0.03, comm_wait=0.02)  # pace 0.10
    result = analyse(load(), profiles(
        configured=[configured, configured],
        no_communication=[rank(0.02, 0.03, 0.03)] * 2,  # 20 % communication
        synthetic_data=[rank(0.005, 0.03, 0.03, comm_wait=0.02)] * 2))  # 15 % input
    assert [(f["name"], round(f["percent_of_step"], 6)) for f in result["findings"]] == [
        ("communication", 20.0), ("input pipeline", 15.0)]
    assert [a.split(":")[0] for a in result["advice"]] == ["communication", "input pipeline"]
    assert result["bottleneck"] == "communication"


def test_a_compute_bound_run_has_no_finding_and_negative_overheads_read_as_zero() -> None:
    configured = rank(0.001, 0.04, 0.05, comm_wait=0.002, optimizer=0.005)  # pace 0.093
    result = analyse(load(), profiles(
        configured=[configured, rank(0.001, 0.04, 0.049, comm_wait=0.003, optimizer=0.005)],
        no_communication=[rank(0.001, 0.041, 0.06)] * 2,  # noise made it slower: no negative overhead
        synthetic_data=[rank(0.002, 0.04, 0.05, comm_wait=0.002)] * 2))
    overheads = [result["communication_overhead_percent"], result["input_overhead_percent"],
                 result["slowest_rank"]["others_wait_percent"]]
    assert overheads[:2] == [0.0, 0.0] and all(share < BOTTLENECK_PERCENT for share in overheads)
    assert result["findings"] == [] and result["advice"] == [] and result["bottleneck"] == "compute"
    assert result["verdict"][0] == "no bottleneck above 10% of the step: the run is compute-bound"


def test_one_slot_runs_name_no_communication_or_straggler_bottleneck() -> None:
    config = load("resources.slots_per_trial=1")
    result = analyse(config, profiles(configured=[rank(0.01, 0.02, 0.03, comm_wait=0.04)],
                                      no_communication=[rank(0.01, 0.02, 0.03)],
                                      synthetic_data=[rank(0.01, 0.02, 0.03, comm_wait=0.04)]))
    assert result["communication_overhead_percent"] == pytest.approx(40.0, abs=1e-9)  # measured, but not a finding
    assert result["bottleneck"] == "compute" and result["findings"] == []
    assert not any(line.startswith(("scaling efficiency", "slowest rank")) for line in result["verdict"])


def test_a_pipeline_run_reports_its_bubble_and_fsdp_its_collectives_from_the_measured_waits() -> None:
    """No aggregation trial for a pipeline: its communication is the bubble its stages measured (here 60 of 100 ms
    on the median rank), and the advice is the pipeline's own; FSDP's all-gather and reduce-scatter waits are
    reported beside the trial-based communication overhead."""
    config = load("resources.slots_per_trial=4", "distributed.strategy=pipeline", "distributed.pipeline.stages=2",
                  "distributed.pipeline.microbatches=4")
    ranks = []
    for bubble in (0.05, 0.06, 0.06, 0.07):
        one = rank(0.0, 0.1 - bubble, 0.0)
        one["median_seconds"]["bubble"] = bubble
        ranks.append(one)
    found = analyse(config, {"configured": {"ranks": ranks}, "synthetic_data": {"ranks": ranks}})
    assert found["pipeline_bubble_percent"] == pytest.approx(60.0)
    assert found["communication_overhead_percent"] == pytest.approx(60.0)
    assert found["bottleneck"] == "pipeline bubble"
    assert "microbatches (now 4: the bubble by formula is (p - 1)/(m + p - 1) = 20%)" in found["advice"][0]
    assert "waits inside forward and backward: pipeline bubble 60.0% of the step" in verdict_lines(found)
    assert "all_gather_wait_percent" not in found

    fsdp = load("distributed.strategy=fsdp")
    sharded = [rank(0.0, 0.04, 0.04) for _ in range(2)]
    for one in sharded:
        one["median_seconds"].update(all_gather=0.015, reduce_scatter=0.005)
    plain = [rank(0.0, 0.04, 0.04) for _ in range(2)]
    found = analyse(fsdp, profiles(sharded, plain, sharded))
    assert found["all_gather_wait_percent"] == pytest.approx(15.0)
    assert found["reduce_scatter_wait_percent"] == pytest.approx(5.0)
    assert "pipeline_bubble_percent" not in found


# ---------------------------------------------------------------------------------------------- repeats


def test_repeats_run_the_trials_forward_then_backward_each_in_its_own_dir() -> None:
    plans = trial_plans(load(), steps=8)
    names = [plan.name for plan in plans]
    assert [(repeat, plan.name) for repeat, plan in trial_runs(plans, 1)] == [(0, name) for name in names]
    assert [(repeat, plan.name) for repeat, plan in trial_runs(plans, 3)] == [
        *[(0, name) for name in names], *[(1, name) for name in reversed(names)], *[(2, name) for name in names]]
    assert trial_dir("configured", 0, 1) == "configured"  # one repeat: the dirs of a plain diagnosis
    assert [trial_dir("one_slot", repeat, 2) for repeat in range(2)] == ["one_slot-1", "one_slot-2"]


def comm_bound(comm_wait: float, slow_rank: int | None = None, slow_in_synthetic: bool = True) -> dict[str, Any]:
    """One repeat's analysis: 0.06 s of compute per step plus `comm_wait`; `slow_rank` computes 0.03 s longer."""
    def ranks(slow: bool) -> list[dict[str, Any]]:
        return [rank(0.01, 0.02, 0.03 + (0.03 if slow and r == slow_rank else 0.0), comm_wait=comm_wait)
                for r in range(2)]
    return analyse(load(), profiles(configured=ranks(True), no_communication=[rank(0.01, 0.02, 0.03)] * 2,
                                    synthetic_data=ranks(slow_in_synthetic),
                                    one_slot=[rank(0.01, 0.02, 0.03)]))


def test_a_single_repeat_is_the_diagnosis_itself() -> None:
    alone = comm_bound(0.04)
    assert combine(load(), [alone]) is alone
    with pytest.raises(ValueError):
        combine(load(), [])


def test_repeats_combine_into_medians_with_every_repeat_beside_them() -> None:
    repeats = [comm_bound(wait) for wait in (0.04, 0.01, 0.09)]
    result = combine(load(), repeats)
    # figures computed here from the waits: pace = 0.06 + wait, communication overhead = wait / pace
    per_repeat = [100 * wait / (0.06 + wait) for wait in (0.04, 0.01, 0.09)]
    assert result["communication_overhead_percent_per_repeat"] == pytest.approx(per_repeat, abs=1e-9)
    assert result["communication_overhead_percent"] == pytest.approx(100 * 0.04 / 0.10, abs=1e-9)  # the median
    assert result["step_ms"] == pytest.approx(100.0, abs=1e-9)
    assert result["samples_per_second_per_repeat"] == pytest.approx([64 / 0.10, 64 / 0.07, 64 / 0.15], rel=1e-12)
    assert result["scaling_efficiency_percent"] == pytest.approx(100 * 0.06 / 0.10, abs=1e-9)
    assert result["repeats"] == 3 and result["bottleneck"] == "communication"
    assert result["verdict"][0] == "bottleneck: communication (40% of the step)"
    assert result["verdict"][3] == "medians of 3 repeats of the trials (communication overhead per repeat: " \
                                   "40.0, 14.3, 60.0%)"
    assert "pipeline_bubble_percent" not in result  # only figures every repeat has


def test_the_slowest_rank_is_the_one_most_repeats_name_and_confirmed_by_a_majority() -> None:
    named_twice = [comm_bound(0.02, slow_rank=1), comm_bound(0.02, slow_rank=0), comm_bound(0.02, slow_rank=1)]
    slow = combine(load(), named_twice)["slowest_rank"]
    assert (slow["rank"], slow["named_in_repeats"], slow["confirmed"]) == (1, 2, True)
    assert slow["compute_ms"] == pytest.approx(90.0, abs=1e-9)  # 0.06 + 0.03 s, in both repeats naming rank 1
    # rank 1 named and confirmed in one repeat of three, slow in the configured trial only in another
    once = [comm_bound(0.02, slow_rank=1), comm_bound(0.02, slow_rank=1, slow_in_synthetic=False),
            comm_bound(0.02, slow_rank=0, slow_in_synthetic=False)]
    slow = combine(load(), once)["slowest_rank"]
    assert (slow["rank"], slow["named_in_repeats"], slow["confirmed"]) == (1, 2, False)
