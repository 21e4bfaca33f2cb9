"""`make gpu-check`'s script stays runnable where no GPU is: its dry run (`--device cpu`, small sizes) trains every
correctness check and every speed variant on the CPU, and its exact checks hold there too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env


@pytest.mark.slow  # trains about 15 short runs in-process and in two spawned workers (a minute or more on 2 cores)
def test_the_gpu_check_dry_run_passes_and_writes_every_figure(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["environment"]["device"] == "cpu"
    checks = {check["check"]: check for check in result["checks"]}
    assert len(checks) == 8 and all(check["passed"] for check in checks.values()), checks
    assert checks["mlp dtrain = plain torch loop"]["max_abs_difference"] <= 1e-9
    assert checks["2 processes over gloo = 1 process"]["replicas_max_abs_difference"] == 0.0
    assert checks["bf16 and fp16 within 0.5 points of fp32"]["judged"] is False  # too few records on the CPU
    horovod = checks["horovod.torch collectives and DistributedOptimizer through dtrain horovodrun -np 1"]
    assert horovod["backend"] == "cpu:gloo,cuda:gloo" and horovod["checks_run"] >= 39 and horovod["failed"] == {}
    headline = result["headline"]
    for model in ("cnn", "gpt"):
        assert headline["step_time_ratio_vs_handwritten"][model] > 0
        assert set(headline["mfu"][model]) >= {"dtrain", "handwritten"}
        assert len(result["speed"][model]["seconds_per_step"]["dtrain"]) == result["sizes"]["rounds"]
    assert headline["phase_timer_overhead"] > 0 and result["bf16_matmul_flops_per_second"] > 0
