"""`dtrain diagnose` end to end with repeated trials: every trial runs as a `dtrain run` of its own, twice, in
alternating order; diagnosis.json holds each repeat's figures beside their medians. Checks what is written and how
the figures are combined, not how large they are (that depends on the machine)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TRIALS = ["configured", "no_communication", "synthetic_data", "one_slot"]


def test_diagnose_with_two_repeats_runs_every_trial_twice_and_reports_medians(tmp_path: Path) -> None:
    out = tmp_path / "diagnosis"
    run = subprocess.run([sys.executable, "-m", "dtrain.cli", "diagnose", str(FIXTURES / "digits.yaml"), "--steps",
                          "6", "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    progress = [line for line in run.stderr.splitlines() if line.startswith("dtrain diagnose: trial ")]
    assert [line.split(": ", 2)[2] for line in progress] == [
        *[f"{title}, repeat 1/2" for title in ("as configured", "aggregation_frequency 1000",
                                               "synthetic data of the same shapes", "1 slot, same per-slot batch")],
        *[f"{title}, repeat 2/2" for title in ("1 slot, same per-slot batch", "synthetic data of the same shapes",
                                               "aggregation_frequency 1000", "as configured")]]
    diagnosis = json.loads((out / "diagnosis.json").read_text())
    assert diagnosis["repeats"] == 2
    for key in ("communication_overhead_percent", "input_overhead_percent", "scaling_efficiency_percent", "step_ms"):
        values = diagnosis[f"{key}_per_repeat"]
        assert len(values) == 2 and diagnosis[key] == statistics.median(values), key
    assert list(diagnosis["trials"]) == TRIALS
    for name, trial in diagnosis["trials"].items():
        dirs = [Path(repeat["run_dir"]) for repeat in trial["repeats"]]
        assert dirs == [out / f"{name}-1", out / f"{name}-2"]
        assert all((d / "summary.json").exists() for d in dirs), name
        assert trial["profile"] == trial["repeats"][0]["profile"]
    assert "2 repeats" in run.stdout and "medians of 2 repeats of the trials" in run.stdout
    assert (out / "diagnosis.png").exists()
