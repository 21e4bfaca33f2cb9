"""`dtrain diagnose`'s short trials: which ones to run, and running one as a `dtrain run` of its own.

Seed 000's manual recipe, as one command: the same experiment as configured; with aggregation_frequency
1000 (communication almost never happens, so the difference is its cost); on synthetic data of the same
shapes (no input pipeline, so the difference is its cost); and on one slot with the same per-slot batch
(scaling efficiency).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.config import ExperimentConfig
from dtrain.errors import DiagnoseError, ExitCode
from dtrain.runs.rundir import read_summary

NO_COMMUNICATION_K = 1000


@dataclass(frozen=True)
class TrialPlan:
    """One short trial: its name, what it measures and its --set overrides on top of the common ones."""

    name: str
    title: str
    overrides: tuple[str, ...]


def trial_plans(config: ExperimentConfig, steps: int) -> list[TrialPlan]:
    """The four trials for `config`, each `steps` batches long, without validation or checkpoints on the way."""
    world = config.resources.world_size
    common = (f"searcher.max_length={{batches: {steps}}}", "min_validation_period={batches: 0}",
              "min_checkpoint_period={batches: 0}", "checkpoint_policy=none", "perform_initial_validation=false",
              f"scheduling_unit={steps}", "faults.stop_after_batch=null", "max_restarts=0",
              "profiling.phase_timers=true", "profiling.enabled=false")
    strategy = config.distributed.chosen
    # one slot holds the whole model and trains one data replica's batch (a pipeline's: the default strategy's)
    replicas = world // strategy.model_parallel_size()
    one_slot = ["resources.slots_per_trial=1", *strategy.single_slot_overrides(),
                f"hyperparameters.global_batch_size={config.global_batch_size // replicas}", *_rank_zero_only(config)]
    no_communication = [f"optimizations.aggregation_frequency={NO_COMMUNICATION_K}",
                        *strategy.accumulating_overrides()]
    stages = strategy.model_parallel_size() > 1
    plans = [TrialPlan("configured", "as configured", common)]
    if not stages:  # a pipeline's stages communicate every microbatch; its waits are its bubble phase instead
        plans.append(TrialPlan("no_communication", f"aggregation_frequency {NO_COMMUNICATION_K}",
                               (*common, *no_communication)))
    plans.append(TrialPlan("synthetic_data", "synthetic data of the same shapes",
                           (*common, "faults.synthetic_data=true")))
    if world > 1:
        plans.append(TrialPlan("one_slot", "1 slot, same per-slot batch", (*common, *one_slot)))
    return plans


def trial_runs(plans: list[TrialPlan], repeats: int) -> list[tuple[int, TrialPlan]]:
    """(repeat, plan) in running order: the plans forward in even repeats and backward in odd ones, so that over
    two repeats every trial has run as early and as late as the configured one it is compared with."""
    return [(repeat, plan) for repeat in range(repeats)
            for plan in (plans if repeat % 2 == 0 else list(reversed(plans)))]


def trial_dir(name: str, repeat: int, repeats: int) -> str:
    """A trial's run dir under the diagnosis dir: its name, with the repeat's number when there are several."""
    return name if repeats == 1 else f"{name}-{repeat + 1}"


def _rank_zero_only(config: ExperimentConfig) -> list[str]:
    """Overrides for a one-worker trial: its only worker is rank 0, so faults aimed at other ranks and parameter
    server backup workers go (a config that names a rank or a backup the trial lacks is refused)."""
    faults, dropped = config.faults, []
    for key in ("slow_rank", "hang_rank"):
        rank = getattr(faults, key)
        if rank is not None and rank >= 1:
            dropped.append(f"faults.{key}=null")
    if faults.nan_rank is not None and faults.nan_rank >= 1:
        dropped += ["faults.nan_rank=null", "faults.nan_batches=[]"]
    kept = [kill.model_dump() for kill in faults.kills if kill.rank == 0]
    if len(kept) < len(faults.kills):
        dropped.append(f"faults.kills={json.dumps(kept)}")
    if config.distributed.parameter_server.backup_workers:
        dropped.append("distributed.parameter_server.backup_workers=0")
    return dropped


def threads_per_slot(world_size: int) -> int:
    """CPU threads of one slot of the configured run; the 1-slot trial gets no more (one slot's compute)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(cores // world_size, 1)


def run_trial(config: Path, overrides: list[str], run_dir: Path, threads: int) -> dict[str, Any]:
    """One `dtrain run` in a subprocess (its own store under the diagnosis dir); its summary's profile."""
    command = [sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    env = {**os.environ, "DTRAIN_RUNS_ROOT": str(run_dir.parent / "runs"), "OMP_NUM_THREADS": str(threads)}
    env.pop("DTRAIN_LAUNCHER", None)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    summary = read_summary(run_dir) or {}
    if done.returncode != ExitCode.OK or summary.get("status") != "completed" or "profile" not in summary:
        errors = [line for line in done.stderr.splitlines() if line.startswith("dtrain: error")]
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        detail = errors[-1].removeprefix("dtrain: error: ") if errors else last
        raise DiagnoseError(f"the diagnosis trial in {run_dir} failed: {detail}")
    profile: dict[str, Any] = summary["profile"]
    return profile
