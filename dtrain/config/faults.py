"""The `faults` section: faults to inject (crashes, stragglers, NaNs, hangs), an early stop, synthetic data.
It was `debug:` until Determined's boolean `debug` took that name.
`dtrain.train.faults` carries them out; the tests and `dtrain diagnose` use them to reproduce what goes wrong."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dtrain.config.base import Section


class Kill(Section):
    """One injected crash: SIGKILL `rank` at the start of `batch` (`during: step`), or in the middle of the first
    checkpoint write at or after `batch` (`during: checkpoint`; rank 0, the writer). Each fires once per run dir."""

    rank: int = Field(ge=0, description="the rank to kill")
    batch: int = Field(ge=1, description="the batch at whose start it is killed (checkpoint: the first checkpoint "
                                         "write at or after it)")
    during: Literal["step", "checkpoint"] = Field(default="step", description="kill at the start of the batch, or "
                                                  "inside a checkpoint write (rank 0 only)")

    @model_validator(mode="after")
    def _writer_only(self) -> Kill:
        if self.during == "checkpoint" and self.rank != 0:
            raise ValueError(f"a kill `during: checkpoint` hits the checkpoint writer, rank 0, not rank {self.rank}; "
                             "set `rank: 0` or use `during: step`")
        return self


class Faults(Section):
    """Faults and shortcuts for tests, benchmarks and diagnosis; none is meant for a real run."""

    stop_after_batch: int | None = Field(default=None, ge=1, description="checkpoint and stop after this batch, as "
                                         "a preemption would (exit code 3; resume by running again)")
    slow_rank: int | None = Field(default=None, ge=0, description="make this rank a straggler: before each step it "
                                  "sleeps so that its forward + backward take `slow_factor` times as long as in its "
                                  "previous step")
    slow_factor: float = Field(default=1.0, ge=1.0, description="how many times as long the straggler's forward + "
                                                                "backward take")
    kills: list[Kill] = Field(default_factory=list, description="crashes to inject (SIGKILL), each once per run dir")
    nan_rank: int | None = Field(default=None, ge=0, description="the rank whose gradient gets a NaN after the "
                                 "`nan_batches` (after the all-reduce, so only that rank sees it)")
    nan_batches: list[int] = Field(default_factory=list, description="batches after whose backward pass "
                                                                     "`nan_rank`'s gradient gets a NaN")
    hang_rank: int | None = Field(default=None, ge=0, description="make this rank hang at the start of "
                                  "`hang_at_step` (as a stuck data loader would) until the others time out; unlike a "
                                  "kill it fires again after every restart")
    hang_at_step: int = Field(default=1, ge=1, description="the batch before whose forward pass `hang_rank` hangs")
    synthetic_data: bool = Field(default=False, description="train on random data of the Trial's shapes from a "
                                 "small in-memory pool: no input-pipeline cost (what `dtrain diagnose` compares "
                                 "against)")

    @model_validator(mode="after")
    def _nan_pair(self) -> Faults:
        if (self.nan_rank is None) != (not self.nan_batches):
            raise ValueError("faults.nan_rank and faults.nan_batches go together (which rank, which batches); "
                             "give both, e.g. `nan_rank: 1` and `nan_batches: [7]`, or neither")
        if any(batch < 1 for batch in self.nan_batches):
            raise ValueError(f"faults.nan_batches {self.nan_batches} must be batch numbers >= 1")
        return self

    def ranks(self) -> dict[str, int]:
        """Every rank this section names, by the key that names it."""
        named = {"faults.slow_rank": self.slow_rank, "faults.nan_rank": self.nan_rank,
                 "faults.hang_rank": self.hang_rank}
        named.update({f"faults.kills[{i}].rank": kill.rank for i, kill in enumerate(self.kills)})
        return {key: rank for key, rank in named.items() if rank is not None}
