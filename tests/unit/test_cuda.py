"""What only a GPU can show (marked `cuda`: skipped with the reason on CI's CPU machine, run by `make gpu-check` on
the GPU machine): the phase timers' CUDA events measure the device's time and the step never synchronizes; metrics
stay on the device; the training loader pins its batches; dtrain's horovod.torch runs CUDA tensors over NCCL."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.comm import Topology
from dtrain.config import load_config
from dtrain.profile.device_clock import CudaClock
from dtrain.profile.timers import StepTimer
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.reporting import TrainingMetrics
from dtrain.train.trainer import Trainer

pytestmark = pytest.mark.cuda
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_cuda_events_time_the_device_work_of_a_phase_without_waiting() -> None:
    device = torch.device("cuda", 0)
    clock = CudaClock(device)
    timer = StepTimer(device_clock=clock)
    a = torch.randn(4096, 4096, device=device)
    timer.begin_step(1)
    with timer.phase("forward"):
        for _ in range(20):
            a = a @ a / 64.0
    record = timer.end_step(1)
    assert record is not None
    host = record.phases["forward"]
    timer.settle(wait=True)
    assert record.phases["forward"] > host  # the device's time of 20 products, not the time to queue them


def test_a_cuda_run_never_synchronizes_in_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    original = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (calls.append(a), original(*a))[1])
    monkeypatch.syspath_prepend(str(FIXTURES))
    from digits_trial import DigitsTrial

    raw = {"name": "cuda", "entrypoint": "digits_trial:DigitsTrial",
           "hyperparameters": {"global_batch_size": 16, "learning_rate": 0.1, "hidden": 8},
           "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": 20}},
           "scheduling_unit": 20, "min_validation_period": {"batches": 20}}
    config = load_config(None, raw=copy.deepcopy(raw)).config
    prepare_run_dir(config, tmp_path, FIXTURES)
    topology = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                        device=torch.device("cuda", 0), launcher="none")
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=topology, run_info=load_run_info(tmp_path))
    assert trainer.batches.pin_memory
    summary = trainer.fit()
    assert summary["status"] == "completed" and calls == []
    phases = summary["profile"]
    assert phases  # the device's phase times reached the summary


def test_training_metrics_stay_on_the_device_until_the_report() -> None:
    metrics = TrainingMetrics()
    metrics.add_batch({"loss": torch.tensor(2.0, device="cuda")}, 4)
    metrics.end_update(applied=True)
    assert metrics.since_report["loss"].device.type == "cuda"
    assert metrics.take_report() == {"loss": 8.0, "__records": 4.0}


def test_horovod_collectives_and_optimizer_run_over_nccl_on_cuda_tensors(tmp_path: Path) -> None:
    """`dtrain horovodrun -np 1` (NCCL at one rank; two ranks cannot share one GPU under NCCL): the process group is
    gloo for CPU tensors and NCCL for CUDA ones, every collective and the DistributedOptimizer equal the script's
    local references, and every result stays on the GPU."""
    from tests.conftest import benchmark_module

    outcome = benchmark_module("gpu_check").check_horovod(tmp_path, torch.device("cuda"))
    assert outcome["backend"] == "cpu:gloo,cuda:nccl", outcome
    assert outcome["passed"] and outcome["checks_run"] >= 39, outcome
