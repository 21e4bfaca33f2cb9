"""Helpers of the fault tests: whole `dtrain run` processes on the digits fixture, and their final models.

(Not a conftest.py: spawn children import `conftest` by name, and a second one here would shadow
tests/distributed/conftest.py when the whole suite runs in one pytest session.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CONFIG = FIXTURES / "digits.yaml"  # 2 workers, 40 batches, validation and a checkpoint every 10


def dtrain(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 240,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the dtrain command to its end."""
    full_env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dtrain.cli", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


def summary(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "summary.json").read_text()))


def final_model(run_dir: Path) -> bytes:
    """The bytes of the final model of a completed run."""
    found = summary(run_dir)
    assert found["status"] == "completed", found
    return Path(found["checkpoint"]).read_bytes()


def uninterrupted_model(root: Path) -> bytes:
    """The final model of digits.yaml run to its end without a fault in `root` (the reference of the crash tests)."""
    result = dtrain("run", CONFIG, "--run-dir", root / "run", env={"DTRAIN_RUNS_ROOT": str(root / "runs")})
    assert result.returncode == 0, result.stderr
    return final_model(root / "run")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dtrain: error:")]


def fault_records(run_dir: Path) -> list[dict[str, Any]]:
    from dtrain.train.faults import FAULTS_FILE, read_fault_records

    return read_fault_records(run_dir / "logs" / FAULTS_FILE)
