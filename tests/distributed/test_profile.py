"""The profiler in a real 2-process run: the phase timers add up to the step time, the exposed communication
wait is measured, and the timeline is valid Chrome-trace JSON with a span per phase and per gradient bucket."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dtrain.comm import Topology, barrier
from dtrain.config import load_config
from dtrain.profile import PHASES
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.trainer import Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STEPS, BEGIN, END = 16, 4, 7

RAW: dict[str, Any] = {
    "name": "profile", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 64, "learning_rate": 0.1, "hidden": 8192},
    "resources": {"slots_per_trial": 2}, "scheduling_unit": 5,
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": STEPS}},
    "min_validation_period": {"batches": 8}, "min_checkpoint_period": {"batches": 8},
    "optimizations": {"tensor_fusion_threshold": 0.3},  # 2 buckets: [8192x10 weight], [the 64x8192 one]
    "profiling": {"enabled": True, "begin_on_batch": BEGIN, "end_after_batch": END},
}


def _profiled_run(topology: Topology, run_dir: str) -> dict[str, Any]:
    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    config = load_config(None, raw=RAW).config
    if topology.rank == 0:
        prepare_run_dir(config, Path(run_dir), FIXTURES)
    barrier()
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=topology, run_info=load_run_info(Path(run_dir)))
    summary = trainer.fit()
    records = trainer.profiler.timer.records
    return {"summary": summary, "phase_sum": sum(sum(r.phases.values()) for r in records),
            "step_sum": sum(r.seconds for r in records), "steps": [r.step for r in records],
            "comm_wait": [r.phases.get("comm_wait", 0.0) for r in records],
            "checkpoint_steps": [r.step for r in records if "checkpoint" in r.phases]}


def test_phase_timers_add_up_and_the_timeline_is_a_chrome_trace(spawn: Any, tmp_path: Path) -> None:
    results = spawn(_profiled_run, 2, str(tmp_path / "run"))
    for rank, result in enumerate(results):
        assert result["steps"] == list(range(1, STEPS + 1))
        assert abs(result["phase_sum"] - result["step_sum"]) <= 0.05 * result["step_sum"], (rank, result)
        assert result["checkpoint_steps"] == [8, 16]
        assert all(wait >= 0 for wait in result["comm_wait"]) and sum(result["comm_wait"]) > 0
    profile = results[0]["summary"]["profile"]
    assert [entry["rank"] for entry in profile["ranks"]] == [0, 1]
    assert all(set(PHASES) <= set(entry["mean_seconds"]) and entry["samples_per_second"] > 0
               for entry in profile["ranks"])

    for rank in (0, 1):
        path = tmp_path / "run" / "timeline" / f"rank-{rank}.trace.json"
        assert str(path) in profile["timelines"]
        trace = json.loads(path.read_text())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] == rank for e in spans)
        assert {e["args"]["step"] for e in spans} == set(range(BEGIN, END + 1))
        names = {e["name"] for e in spans}
        assert {"data", "forward", "backward", "comm_wait", "optimizer", "report"} <= names
        assert {f"step {s}" for s in range(BEGIN, END + 1)} <= names
        buckets = [e for e in spans if e["name"].startswith("allreduce bucket ")]
        assert buckets and all(e["tid"] == 1 for e in buckets)
        assert len({e["args"]["bucket"] for e in buckets}) >= 2
        for step in range(BEGIN, END + 1):  # every phase span lies inside its step's span
            outer = next(e for e in spans if e["name"] == f"step {step}")
            for inner in (e for e in spans if e["args"]["step"] == step and e is not outer and e["tid"] == 0):
                assert outer["ts"] - 1 <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1


def _timed_run_with_a_straggler(topology: Topology, run_dir: str) -> dict[str, Any]:
    """Phase timers only (no timeline), rank 1 slowed down: DDP keeps its own all-reduce (no comm hook)."""
    sys.path.insert(0, str(FIXTURES))
    from digits_trial import DigitsTrial

    raw = {**RAW, "name": "timers", "profiling": {"enabled": False}, "debug": {"slow_rank": 1, "slow_factor": 4.0},
           "min_validation_period": {"batches": 0}, "min_checkpoint_period": {"batches": 0}}
    config = load_config(None, raw=raw).config
    if topology.rank == 0:
        prepare_run_dir(config, Path(run_dir), FIXTURES)
    barrier()
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=topology, run_info=load_run_info(Path(run_dir)))
    trainer.fit()
    records = trainer.profiler.timer.records[2:]  # past the warm-up steps (the straggler starts in step 2)
    ddp = trainer.wrapped.ddp  # the Replica the Trainer ran
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]

    def hooks_per_parameter() -> list[int]:  # torch's own record of post-accumulate-grad hooks
        return [len(p._post_accumulate_grad_hooks or {}) for p in trainable]

    observed = hooks_per_parameter()
    trainer.strategy.observe_buckets(None)  # type: ignore[attr-defined]
    return {"comm_hooks": len(ddp._comm_hooks), "hooks_observed": observed, "hooks_after_stop": hooks_per_parameter(),
            "phase_sum": sum(sum(r.phases.values()) for r in records), "step_sum": sum(r.seconds for r in records),
            "comm_wait": sum(r.phases.get("comm_wait", 0.0) for r in records) / len(records),
            "forward": sum(r.phases.get("forward", 0.0) for r in records) / len(records)}


def test_timers_without_a_timeline_keep_ddps_allreduce_and_see_the_wait_for_a_straggler(
        spawn: Any, tmp_path: Path) -> None:
    fast, slow = spawn(_timed_run_with_a_straggler, 2, str(tmp_path / "run"))
    for result in (fast, slow):
        assert result["comm_hooks"] == 0, "the phase timers alone registered a Python comm hook"
        assert result["hooks_observed"] == [1] * 4, result["hooks_observed"]  # one per weight and bias of 2 layers
        assert result["hooks_after_stop"] == [0] * 4, "observe_buckets(None) left gradient hooks behind"
        assert abs(result["phase_sum"] - result["step_sum"]) <= 0.05 * result["step_sum"], result
    delay = slow["forward"] - fast["forward"]  # the straggler's injected delay is part of its forward phase
    assert delay > 0.5 * slow["forward"], (fast, slow)
    # the fast rank waits for the straggler in its backward pass's all-reduce, after its own last gradient
    assert fast["comm_wait"] >= 0.5 * delay, (fast, slow)
    assert slow["comm_wait"] < 0.25 * fast["comm_wait"], (fast, slow)
