"""An injected hang (`faults.hang_rank`) in a real 2-process run becomes, once the collective times out, one
error that names the stuck rank, the step and what it was doing; the stall warning names it earlier. (How long
the wait took is not checked: on a loaded machine any figure is right.)"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from dtrain.comm import Topology
from dtrain.config import load_config
from dtrain.errors import StallError
from tests.distributed.conftest import fixture_trainer, run_spawned  # the one spawn fixture's (no second conftest)

TIMEOUT_SECONDS = 4.0
WARNING_SECONDS = 1.0
HANG_AT_STEP = 3

RAW: dict[str, Any] = {
    "name": "hang", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 16, "learning_rate": 0.1, "hidden": 8},
    "resources": {"slots_per_trial": 2},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": 8}},
    "distributed": {"timeout_seconds": TIMEOUT_SECONDS, "stall_warning_seconds": WARNING_SECONDS},
    "faults": {"hang_rank": 1, "hang_at_step": HANG_AT_STEP},
}


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run_until_the_hang_is_caught(topology: Topology, run_dir: str) -> dict[str, Any]:
    warnings = _Collect()
    logging.getLogger("dtrain.comm.stall").addHandler(warnings)
    trainer = fixture_trainer(topology, load_config(None, raw=RAW).config, run_dir)
    try:
        trainer.fit()
    except StallError as exc:
        # the phase the rank was in when the collective gave up began when it started waiting
        return {"error": str(exc), "warnings": warnings.lines, "steps": trainer.state.steps_completed}
    return {"error": None, "warnings": warnings.lines}


def test_injected_hang_becomes_an_error_naming_the_rank_when_the_collective_times_out(tmp_path: Path) -> None:
    waiting, hung = run_spawned(_run_until_the_hang_is_caught, 2, str(tmp_path / "run"))
    assert waiting["error"] is not None, "rank 0 trained on although rank 1 hung"
    assert waiting["steps"] == HANG_AT_STEP - 1
    error = waiting["error"]
    assert re.search(rf"waited {TIMEOUT_SECONDS:g} s \(distributed.timeout_seconds\) in backward of "
                     rf"step {HANG_AT_STEP} for rank\(s\) 1 that did not arrive: rank 1 is in data of step "
                     rf"{HANG_AT_STEP} for \d+\.\d s", error), error  # for how long: any figure
    assert "\n" not in error
    stall_warnings = [line for line in waiting["warnings"] if "for rank(s) 1" in line]
    assert stall_warnings and f"rank 1 is in data of step {HANG_AT_STEP}" in stall_warnings[0]
    assert hung["error"] is not None and f"rank 1 hung before batch {HANG_AT_STEP}" in hung["error"]
