"""Fault injection for tests and benchmarks, driven by the config's `faults:` section.

The injector is a step callback (`dtrain.train.callbacks`): each injection point is a hook that runs at a
fixed place in a step, so that a fault happens at the same step and on the same rank in every run
(reproducible straggler, crash and NaN scenarios):
- `before_compute` / `after_compute`: the straggler (`slow_rank`, `slow_factor`);
- `before_step`: SIGKILL at the start of a batch (`kills` with `during: step`), or a hang there (`hang_rank`,
  `hang_at_step`) until the run gives up on the rank;
- `during_checkpoint`: SIGKILL between the files of a checkpoint write (`kills` with `during: checkpoint`);
- `before_update` (`corrupt_gradients`): a NaN in a gradient after the backward pass (`nan_rank`, `nan_batches`).

A kill fires once per run dir: before dying, the rank appends it to `logs/faults.jsonl`, and the restarted
rank skips the kills recorded there, so a run with kills ends like a clean one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.config import Faults, Kill
from dtrain.errors import StallError
from dtrain.train.callbacks import StepCallback

log = logging.getLogger(__name__)

FAULTS_FILE = "faults.jsonl"


def read_fault_records(path: Path) -> list[dict[str, Any]]:
    """The faults a run dir's `logs/faults.jsonl` records, oldest first (a line cut by a kill is ignored)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


@dataclass
class FaultInjector(StepCallback):
    """Applies the faults `faults` asks for on this rank; `record_path` is where fired kills are remembered."""

    faults: Faults
    rank: int
    record_path: Path | None = None
    restart_count: int = 0
    _last_compute_seconds: float | None = field(default=None, init=False)
    _pending: list[tuple[int, Kill]] = field(default_factory=list, init=False)
    release: threading.Event = field(default_factory=threading.Event)  # set when the hang may end (run aborted)

    def __post_init__(self) -> None:
        fired = {record["index"] for record in read_fault_records(self.record_path)
                 if record.get("event") == "kill"} if self.record_path else set()
        self._pending = [(i, kill) for i, kill in enumerate(self.faults.kills)
                         if kill.rank == self.rank and i not in fired]

    @property
    def armed(self) -> bool:
        """True when `faults` asks for a fault on this rank (otherwise the Trainer need not call it at all)."""
        return bool(self.slowed or self._pending or self.rank in (self.faults.hang_rank, self.faults.nan_rank))

    # ------------------------------------------------------------------------------------- straggler

    @property
    def slowed(self) -> bool:
        """True when this rank is the configured straggler."""
        return self.faults.slow_rank == self.rank and self.faults.slow_factor > 1.0

    def _hang_if_asked(self, step: int) -> None:
        """Hang before batch `faults.hang_at_step` on `faults.hang_rank`, as a stuck data loader or device would,
        until `release` is set (the run gave up on this rank); then raise StallError."""
        if self.faults.hang_rank != self.rank or step != self.faults.hang_at_step:
            return
        while not self.release.wait(0.05):
            pass
        raise StallError(f"rank {self.rank} hung before batch {step} (faults.hang_rank) and was stopped because "
                         "the other ranks timed out waiting for it")

    def before_compute(self) -> float:
        """Sleep so that this rank's forward + backward take `slow_factor` times as long as they did in the
        previous step (a straggler's slower device); return the seconds slept. The first step is not slowed:
        there is no measurement yet."""
        if not self.slowed or self._last_compute_seconds is None:
            return 0.0
        delay = (self.faults.slow_factor - 1.0) * self._last_compute_seconds
        time.sleep(delay)
        return delay

    def after_compute(self, compute_seconds: float) -> None:
        """Record how long this step's own forward + backward took (without the injected delay)."""
        self._last_compute_seconds = compute_seconds

    # ------------------------------------------------------------------------------------------ kills

    def before_step(self, step: int) -> None:
        """SIGKILL this rank at the start of batch `step` if a pending kill asks for it; hang there if
        `faults.hang_rank` asks for it."""
        self._hang_if_asked(step)
        for index, kill in self._pending:
            if kill.during == "step" and kill.batch == step:
                self._die(index, kill, steps_done=step - 1)

    def during_checkpoint(self, step: int) -> None:
        """SIGKILL this rank in the middle of the checkpoint write after batch `step` (some files written,
        `meta.json` not) if a pending kill asks for the first write at or after its batch."""
        for index, kill in self._pending:
            if kill.during == "checkpoint" and kill.batch <= step:
                self._die(index, kill, steps_done=step)

    def _die(self, index: int, kill: Kill, steps_done: int) -> None:
        record = {"event": "kill", "index": index, "rank": self.rank, "batch": kill.batch, "during": kill.during,
                  "steps_done": steps_done, "restart": self.restart_count, "time": time.time(),
                  "thread": threading.current_thread().name}  # a checkpoint's background upload has a thread of its own
        log.warning("faults.kills[%d]: killing rank %d with SIGKILL %s batch %d", index, self.rank,
                    "in the checkpoint write after" if kill.during == "checkpoint" else "at the start of", kill.batch)
        if self.record_path is not None:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            with self.record_path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    # -------------------------------------------------------------------------------------------- NaN

    def before_update(self, step: int, model: nn.Module) -> None:
        self.corrupt_gradients(step, model)

    def corrupt_gradients(self, step: int, model: nn.Module) -> bool:
        """Put a NaN into the first gradient of this rank after batch `step`'s backward pass (after the
        gradients were synchronized, so only this rank sees it) if `faults` asks; True when it did."""
        if self.faults.nan_rank != self.rank or step not in self.faults.nan_batches:
            return False
        for parameter in model.parameters():
            if parameter.grad is not None:
                with torch.no_grad():
                    parameter.grad.view(-1)[0] = float("nan")
                log.info("faults.nan_batches: NaN put into a gradient of rank %d at batch %d", self.rank, step)
                return True
        return False
