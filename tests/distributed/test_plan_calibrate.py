"""`dtrain plan --calibrate` end to end: real gloo all-reduce between processes, concurrent compute timing, the
file it keeps, and a prediction for this machine made from it. Checks what the numbers are, not how fast."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from dtrain.calibrate.calibrate import Calibration, measure_allreduce

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_allreduce_calibration_measures_every_size() -> None:
    """A smoke test of the measuring path: real processes, one time per size. What the fit makes of the times is
    tested on given numbers in tests/unit/test_calibration_fit.py; the times themselves depend on the machine."""
    fit = measure_allreduce([4096, 1 << 20], dtype="float32", ranks=2, rounds=1)
    assert (fit.ranks, fit.dtype) == (2, "float32")
    assert [size for size, _ in fit.points] == [4096, 1 << 20]
    assert all(math.isfinite(seconds) and seconds > 0 for _, seconds in fit.points), fit.points
    assert fit.alpha_s >= 0 and fit.beta_s_per_byte >= 0 and math.isfinite(fit.alpha_s + fit.beta_s_per_byte)


def test_calibrate_then_plan_this_machine(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    run = subprocess.run([sys.executable, "-m", "dtrain.cli", "plan", "--calibrate", "--config",
                          str(FIXTURES / "digits.yaml"), "--devices", "2", "--calibration", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"saved       {path}" in run.stdout
    calibration = Calibration.load(path)
    assert set(calibration.compute) == {"reference-mlp", "reference-mlp x2", "digits_test", "digits_test x2"}
    assert set(calibration.allreduce) == {"float32", "float16"}
    assert calibration.compute["digits_test x2"].concurrent == 2 and calibration.compute["digits_test"].batch == 32
    plan = subprocess.run([sys.executable, "-m", "dtrain.cli", "plan", "--this-machine", "--calibration", str(path),
                           "--config", str(FIXTURES / "digits.yaml"), "--link-gbit", "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    prediction = json.loads(plan.stdout)["prediction"]
    measured = calibration.compute["digits_test x2"]
    assert prediction["devices"] == 2 and prediction["per_device_batch"] == 32
    assert abs(prediction["compute_s"] - (measured.forward_s + measured.backward_s + measured.optimizer_s)) < 1e-12
    assert prediction["step_s"] >= prediction["compute_s"]
