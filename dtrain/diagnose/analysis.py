"""`dtrain diagnose`'s analysis: what the phase profiles of its short trials (`trials`) say.

Each trial changes one thing, so its difference to the configured trial is that thing's cost: aggregation
1000 (almost no communication), synthetic data (no input pipeline), one slot (scaling efficiency). The
slowest rank comes from the configured trial's per-rank compute phases.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from dtrain.config import ExperimentConfig, is_built

BOTTLENECK_PERCENT = 10.0  # a cost at least this share of the step is named as a bottleneck


def _median_of(rank: Mapping[str, Any], phases: tuple[str, ...]) -> float:
    """Median seconds per step of the sum of `phases` on one rank (from the per-step medians of each phase:
    the summary keeps medians per phase, and the phases of a lockstep step vary together little)."""
    medians = rank["median_seconds"]
    return float(sum(medians.get(name, 0.0) for name in phases))


WAIT_PHASES = ("comm_wait", "all_gather", "reduce_scatter", "bubble")  # waits for the other ranks
PACE_PHASES = ("data", "forward", "backward", *WAIT_PHASES)  # one batch's work without the optimizer update
STEP_PHASES = (*PACE_PHASES, "optimizer")
COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")
MODEL_PHASES = ("forward", "backward", "optimizer")  # the compute the synthetic-data trial repeats as it was
CONFIRMED_SHARE = 0.5  # a straggler is the rank's own when a second trial shows at least this share of its lag


def pace_seconds(profile: Mapping[str, Any], phases: tuple[str, ...] = PACE_PHASES) -> float:
    """The job's seconds per batch: the slowest rank's median (ranks that communicate move in lockstep; ranks
    that do not, move at their own pace and the job at the slowest one's)."""
    return max(_median_of(rank, phases) for rank in profile["ranks"] if rank.get("steps"))


def percent(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def analyse(config: ExperimentConfig, profiles: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The diagnosis from the trials' summary `profile`s: overheads in percent of the configured step, the
    slowest rank, the bottleneck and advice."""
    world = config.resources.world_size
    configured = profiles["configured"]
    pace = pace_seconds(configured)
    if "no_communication" in profiles:
        comm = percent(pace - pace_seconds(profiles["no_communication"], ("data", "forward", "backward")), pace)
    else:  # a pipeline (no such trial): the waits its strategy measured
        comm = percent(statistics.median(_median_of(r, WAIT_PHASES) for r in configured["ranks"]), pace)
    # synthetic data changes only the data phase, so its difference there is the input pipeline's cost
    io = percent(statistics.median(_median_of(real, ("data",)) - _median_of(fake, ("data",)) for real, fake
                                   in zip(configured["ranks"], profiles["synthetic_data"]["ranks"], strict=True)), pace)
    result: dict[str, Any] = {
        "world_size": world, "global_batch_size": config.global_batch_size,
        "step_ms": pace_seconds(configured, STEP_PHASES) * 1e3,
        "samples_per_second": config.global_batch_size / pace_seconds(configured, STEP_PHASES),
        "communication_overhead_percent": max(comm, 0.0),
        "exposed_communication_wait_percent": percent(
            statistics.median(_median_of(r, ("comm_wait",)) for r in configured["ranks"]), pace),
        "input_overhead_percent": max(io, 0.0),
    }
    for phase, key in (("all_gather", "all_gather_wait_percent"), ("reduce_scatter", "reduce_scatter_wait_percent"),
                       ("bubble", "pipeline_bubble_percent")):  # only strategies that time these waits report them
        if any(rank.get("median_seconds", {}).get(phase, 0.0) > 0 for rank in configured["ranks"]):
            result[key] = percent(statistics.median(_median_of(r, (phase,)) for r in configured["ranks"]), pace)
    if "one_slot" in profiles:
        single = pace_seconds(profiles["one_slot"], STEP_PHASES)
        result["scaling_efficiency_percent"] = percent(single, pace_seconds(configured, STEP_PHASES))
        result["one_slot_samples_per_second"] = (config.global_batch_size // world) / single
    computes = [_median_of(rank, COMPUTE_PHASES) for rank in configured["ranks"]]
    slowest = max(range(len(computes)), key=computes.__getitem__)
    lag = _lag_behind_others(configured["ranks"], slowest, COMPUTE_PHASES)
    typical = computes[slowest] - lag  # the other ranks' median compute
    repeated = _repeated_lag(configured, profiles.get("synthetic_data"), slowest)
    result["rank_compute_ms"] = [c * 1e3 for c in computes]
    result["slowest_rank"] = {"rank": slowest, "compute_ms": computes[slowest] * 1e3,
                              "slower_than_others_percent": percent(lag, typical),
                              "others_wait_percent": percent(lag, pace),
                              "repeated_slower_percent": percent(repeated, typical),
                              "confirmed": world > 1 and repeated >= CONFIRMED_SHARE * lag}
    return _conclude(config, result)


def _conclude(config: ExperimentConfig, result: dict[str, Any]) -> dict[str, Any]:
    """Add the findings, advice, bottleneck and verdict that `result`'s figures lead to."""
    result["findings"], result["advice"] = _findings(config, result)
    result["bottleneck"] = result["findings"][0]["name"] if result["findings"] else "compute"
    result["verdict"] = verdict_lines(result)
    return result


COMBINED_FIGURES = ("step_ms", "samples_per_second", "communication_overhead_percent",
                    "exposed_communication_wait_percent", "input_overhead_percent", "all_gather_wait_percent",
                    "reduce_scatter_wait_percent", "pipeline_bubble_percent", "scaling_efficiency_percent",
                    "one_slot_samples_per_second")
SLOWEST_RANK_FIGURES = ("compute_ms", "slower_than_others_percent", "others_wait_percent", "repeated_slower_percent")


def combine(config: ExperimentConfig, repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One diagnosis from several repeats of the trials (each an `analyse` result): every figure is the median of
    its per-repeat values, which stand beside it as `<figure>_per_repeat`. Each repeat compares trials run one
    after the other, so a slow spell of a shared machine falls on both sides of that comparison; the median over
    repeats is the house statistic for paired measurements. The slowest rank is the one most repeats name (ties
    to the lower rank), with the medians of its figures over the repeats that name it, confirmed when a majority
    of all repeats confirms it."""
    if not repeats:
        raise ValueError("combine needs at least one repeat")
    if len(repeats) == 1:
        return repeats[0]
    result: dict[str, Any] = {"world_size": repeats[0]["world_size"],
                              "global_batch_size": repeats[0]["global_batch_size"], "repeats": len(repeats)}
    for key in COMBINED_FIGURES:
        values = [float(r[key]) for r in repeats if key in r]
        if len(values) == len(repeats):
            result[key] = statistics.median(values)
            result[f"{key}_per_repeat"] = values
    result["rank_compute_ms"] = [statistics.median(r["rank_compute_ms"][i] for r in repeats)
                                 for i in range(len(repeats[0]["rank_compute_ms"]))]
    named = [r["slowest_rank"]["rank"] for r in repeats]
    slowest = max(sorted(set(named)), key=named.count)  # max keeps the first (lowest) rank among equal counts
    naming = [r["slowest_rank"] for r in repeats if r["slowest_rank"]["rank"] == slowest]
    result["slowest_rank"] = {"rank": slowest,
                              **{key: statistics.median(s[key] for s in naming) for key in SLOWEST_RANK_FIGURES},
                              "confirmed": 2 * sum(bool(s["confirmed"]) for s in naming) > len(repeats),
                              "named_in_repeats": len(naming)}
    return _conclude(config, result)


def _lag_behind_others(ranks: list[Mapping[str, Any]], who: int, phases: tuple[str, ...]) -> float:
    """How many seconds per step rank `who` spends in `phases` beyond the median of the other ranks."""
    values = [_median_of(rank, phases) for rank in ranks]
    others = [v for i, v in enumerate(values) if i != who] or values
    return values[who] - statistics.median(others)


def _repeated_lag(configured: Mapping[str, Any], repeat: Mapping[str, Any] | None, who: int) -> float:
    """The slowest rank's lag as a second trial on the same ranks shows it: its model compute there (the
    synthetic-data trial changes only the data) plus its data-phase lag in the configured trial (which that
    trial cannot repeat). A lag of the rank's own (a slower device, a busier machine) shows in both trials;
    load that came and went during one trial does not. Without a second trial the lag stands as measured."""
    ranks = configured["ranks"]
    if repeat is None or len(repeat["ranks"]) != len(ranks):
        return _lag_behind_others(ranks, who, COMPUTE_PHASES)
    return _lag_behind_others(ranks, who, ("data",)) + _lag_behind_others(repeat["ranks"], who, MODEL_PHASES)


def _findings(config: ExperimentConfig, d: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Costs of at least BOTTLENECK_PERCENT of the step, largest first, and what to do about each."""
    found: list[tuple[float, str, str]] = []
    comm = d["communication_overhead_percent"]
    stages = config.distributed.chosen.model_parallel_size() > 1
    if stages and comm >= BOTTLENECK_PERCENT:
        p, m = config.distributed.pipeline.stages, config.distributed.pipeline.microbatches
        found.append((comm, "pipeline bubble",
                      f"raise distributed.pipeline.microbatches (now {m}: the bubble by formula is (p - 1)/(m + p - 1) "
                      f"= {(p - 1) / (m + p - 1):.0%}), and move split_points so that the stages take equal time"))
    elif comm >= BOTTLENECK_PERCENT and d["world_size"] > 1:
        k = config.optimizations.aggregation_frequency
        fixes = [f"raise optimizations.aggregation_frequency (now {k}) to communicate every k-th batch",
                 f"use a larger per-slot batch (global_batch_size now {config.global_batch_size})",
                 "set optimizations.auto_tune_tensor_fusion: true"]
        if is_built("distributed.compression.name", "fp16"):
            fixes.append("compress gradients (distributed.compression: {name: fp16} or powersgd)")
        found.append((comm, "communication", "; ".join(fixes)))
    io = d["input_overhead_percent"]
    if io >= BOTTLENECK_PERCENT:
        found.append((io, "input pipeline",
                      f"raise data_loader.num_workers (now {config.data_loader.num_workers}); keep decoded data in "
                      "memory (ArrayDataset hands out whole batches); move per-record work out of __getitem__"))
    slow = d["slowest_rank"]
    if (d["world_size"] > 1 and slow["confirmed"] and slow["others_wait_percent"] >= BOTTLENECK_PERCENT
            and not stages):  # a pipeline's stages compute different parts: the bubble above covers them
        found.append((slow["others_wait_percent"], f"slowest rank {slow['rank']}",
                      f"rank {slow['rank']} computes {slow['slower_than_others_percent']:.0f}% slower than the others "
                      "and they wait for it: give ranks batches in proportion to their speed with "
                      "`distributed.heterogeneous: {split: auto}`, or look for other load on its machine or device "
                      f"(logs/rank-{slow['rank']}.log)"))
    found.sort(reverse=True)
    return ([{"name": name, "percent_of_step": share} for share, name, _ in found],
            [f"{name}: {fix}" for _, name, fix in found])


def verdict_lines(d: Mapping[str, Any]) -> list[str]:
    """The printed verdict: the bottleneck first, then every number."""
    if d["findings"]:
        top = d["findings"][0]
        head = f"bottleneck: {top['name']} ({top['percent_of_step']:.0f}% of the step)"
    else:
        head = f"no bottleneck above {BOTTLENECK_PERCENT:.0f}% of the step: the run is compute-bound"
    lines = [head,
             f"communication overhead {d['communication_overhead_percent']:.1f}% of the step "
             f"(exposed wait {d['exposed_communication_wait_percent']:.1f}%)",
             f"input-pipeline overhead {d['input_overhead_percent']:.1f}%"]
    if d.get("repeats", 1) > 1:
        per_repeat = ", ".join(f"{value:.1f}" for value in d["communication_overhead_percent_per_repeat"])
        lines.append(f"medians of {d['repeats']} repeats of the trials (communication overhead per repeat: "
                     f"{per_repeat}%)")
    waits = [f"{label} {d[key]:.1f}%" for key, label in (("all_gather_wait_percent", "FSDP all-gather"),
                                                          ("reduce_scatter_wait_percent", "FSDP reduce-scatter"),
                                                          ("pipeline_bubble_percent", "pipeline bubble")) if key in d]
    if waits:
        lines.append("waits inside forward and backward: " + ", ".join(waits) + " of the step")
    if "scaling_efficiency_percent" in d:
        lines.append(f"scaling efficiency {d['scaling_efficiency_percent']:.0f}% ({d['samples_per_second']:,.0f} "
                     f"samples/s on {d['world_size']} slots vs {d['one_slot_samples_per_second']:,.0f} on 1)")
    slow = d["slowest_rank"]
    if d["world_size"] > 1:
        line = (f"slowest rank {slow['rank']}: compute {slow['compute_ms']:.1f} ms per step, "
                f"{slow['slower_than_others_percent']:.0f}% slower than the others")
        if not slow["confirmed"] and slow["others_wait_percent"] >= BOTTLENECK_PERCENT:
            line += (f", but only {max(slow['repeated_slower_percent'], 0.0):.0f}% in the synthetic-data trial: load "
                     "that came and went, not the rank itself")
        lines.append(line)
    return lines
