"""The `profiling` section: the step-phase timers (always on unless switched off) and the per-rank timeline.
`dtrain.profile` reads it."""

from __future__ import annotations

from pydantic import Field, model_validator

from dtrain.config.base import Section


class Profiling(Section):
    """Step-phase timers are always on (`phase_timers`); `enabled` also writes a Chrome-trace timeline per rank
    for the batches from `begin_on_batch` to `end_after_batch`."""

    enabled: bool = Field(
        default=False, description="also write a Chrome-trace timeline per rank (`timeline/rank-<r>.trace.json`, "
        "opens in Perfetto), with a span per gradient bucket (through dtrain's comm hook for the whole run)")
    begin_on_batch: int = Field(default=0, ge=0, description="the first batch the timeline covers")
    end_after_batch: int | None = Field(default=None, ge=0, description="the last batch the timeline covers; unset: "
                                                                        "the end")
    sync_timings: bool = Field(
        default=False, description="on GPUs, wait for the device at the end of each phase (the CPU can then no "
        "longer queue work ahead of the GPU: slower steps); off: each phase is timed by CUDA events on the device, "
        "read a step or more later, and nothing in the step waits for the GPU")
    phase_timers: bool = Field(
        default=True, description="time every step's phases on every rank (data wait, forward, backward, exposed "
        "communication wait, optimizer, report, validation, checkpoint): TensorBoard `profile/*` and "
        "`throughput/*`, summary.json `profile`; a hook per parameter marks when its gradient is ready, DDP's C++ "
        "all-reduce keeps running (cost 0.5-1.4 % of a step in two runs of benchmarks/diagnose_check.py)")

    @model_validator(mode="after")
    def _window(self) -> Profiling:
        if self.end_after_batch is not None and self.end_after_batch < self.begin_on_batch:
            raise ValueError(f"profiling.end_after_batch ({self.end_after_batch}) must be >= "
                             f"profiling.begin_on_batch ({self.begin_on_batch}); raise it or leave it out to profile "
                             "to the end")
        return self
