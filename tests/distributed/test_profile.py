"""The profiler in a real 2-process run: every step's phases are timed and lie within the step, the exposed
communication wait is recorded, and the timeline is valid Chrome-trace JSON with a span per phase and per gradient
bucket. Nothing here compares two measured times: how the phases split a step is tested on a fake clock in
tests/unit/test_profile_timers.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtrain.comm import Topology
from dtrain.config import load_config
from dtrain.profile import PHASES
from tests.distributed.conftest import fixture_trainer

STEPS, BEGIN, END = 16, 4, 7
STEP_PHASES = ("data", "forward", "backward", "optimizer")  # timed in every step

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
    trainer = fixture_trainer(topology, load_config(None, raw=RAW).config, run_dir)
    summary = trainer.fit()
    records = trainer.profiler.timer.records
    return {"summary": summary, "steps": [r.step for r in records], "phases": [set(r.phases) for r in records],
            "overrun": [sum(r.phases.values()) - r.seconds for r in records],
            "comm_wait": [r.phases.get("comm_wait", 0.0) for r in records],
            "checkpoint_steps": [r.step for r in records if "checkpoint" in r.phases]}


def test_phase_timers_add_up_and_the_timeline_is_a_chrome_trace(spawn: Any, tmp_path: Path) -> None:
    results = spawn(_profiled_run, 2, str(tmp_path / "run"))
    for rank, result in enumerate(results):
        assert result["steps"] == list(range(1, STEPS + 1))
        assert all(set(STEP_PHASES) <= phases for phases in result["phases"]), (rank, result["phases"])
        assert all(overrun <= 1e-6 for overrun in result["overrun"]), (rank, result["overrun"])  # within the step
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


def _timed_run(topology: Topology, run_dir: str) -> dict[str, Any]:
    """Phase timers only (no timeline): DDP keeps its own all-reduce (no comm hook)."""
    raw = {**RAW, "name": "timers", "profiling": {"enabled": False},
           "min_validation_period": {"batches": 0}, "min_checkpoint_period": {"batches": 0}}
    trainer = fixture_trainer(topology, load_config(None, raw=raw).config, run_dir)
    trainer.fit()
    records = trainer.profiler.timer.records
    ddp = trainer.wrapped.ddp  # the Replica the Trainer ran
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]

    def hooks_per_parameter() -> list[int]:  # torch's own record of post-accumulate-grad hooks
        return [len(p._post_accumulate_grad_hooks or {}) for p in trainable]

    observed = hooks_per_parameter()
    trainer.strategy.observe_buckets(None)  # type: ignore[attr-defined]
    return {"comm_hooks": len(ddp._comm_hooks), "hooks_observed": observed, "hooks_after_stop": hooks_per_parameter(),
            "phases": [set(r.phases) for r in records],
            "overrun": [sum(r.phases.values()) - r.seconds for r in records],
            "comm_wait": [r.phases.get("comm_wait", 0.0) for r in records]}


def test_timers_without_a_timeline_keep_ddps_allreduce_and_record_the_communication_wait(
        spawn: Any, tmp_path: Path) -> None:
    for result in spawn(_timed_run, 2, str(tmp_path / "run")):
        assert result["comm_hooks"] == 0, "the phase timers alone registered a Python comm hook"
        assert result["hooks_observed"] == [1] * 4, result["hooks_observed"]  # one per weight and bias of 2 layers
        assert result["hooks_after_stop"] == [0] * 4, "observe_buckets(None) left gradient hooks behind"
        assert all(set(STEP_PHASES) <= phases for phases in result["phases"]), result["phases"]
        assert all(overrun <= 1e-6 for overrun in result["overrun"]), result["overrun"]
        # the wait after the last gradient, until DDP's all-reduce finished: recorded, never negative
        assert all(wait >= 0 for wait in result["comm_wait"]) and sum(result["comm_wait"]) > 0, result["comm_wait"]
