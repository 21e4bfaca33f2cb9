"""What a stop on Slurm's checkpoint-and-requeue signal leaves: the interrupted summary's `stop_signal` (when rank 0
got it), the preemption record `requeue_after_stop` writes before it requeues, and, once resumed, the preemption
count and cost in the progress line and in `summary.json` (one process, the digits fixture; scontrol replaced)."""

from __future__ import annotations

import copy
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.comm import Topology, slurm
from dtrain.config import load_config
from dtrain.runs.preemptions import read_preemptions
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.trainer import Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ONE_PROCESS = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                       device=torch.device("cpu"), launcher="none")
RAW: dict[str, Any] = {
    "name": "preempted", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 16, "learning_rate": 0.1, "float64": True, "hidden": 8},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": 6}},
    "scheduling_unit": 2, "min_validation_period": {"batches": 6}, "reproducibility": {"experiment_seed": 5},
}
IN_A_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}


@pytest.fixture
def signals_kept() -> Iterator[None]:
    """requeue_after_stop ignores SIGTERM and SIGUSR1 from then on (this process ends by itself): restored after."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in kept.items():
        signal.signal(sig, handler)


def _trainer(run_dir: Path) -> Trainer:
    from digits_trial import DigitsTrial

    return Trainer(config=load_config(None, raw=copy.deepcopy(RAW)).config, trial_class=DigitsTrial,
                   topology=ONE_PROCESS, run_info=load_run_info(run_dir))


def test_a_usr1_stop_is_recorded_requeued_and_counted_when_resumed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        signals_kept: None) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    prepare_run_dir(load_config(None, raw=copy.deepcopy(RAW)).config, tmp_path, FIXTURES)
    first = _trainer(tmp_path)
    first.stop.received, first.stop.received_at = signal.SIGUSR1, time.time()  # as if it came before batch 1 ended
    stopped = first.fit()
    assert stopped["status"] == "interrupted" and stopped["steps_completed"] == 1
    assert stopped["stop_signal"]["name"] == "SIGUSR1"
    assert "preemptions" not in stopped

    requeued: list[str] = []
    monkeypatch.setattr(slurm, "preempt_time", lambda environ: None)  # a user's scancel: no PreemptTime
    monkeypatch.setattr(slurm, "requeue", lambda environ: requeued.append(environ["SLURM_JOB_ID"]))
    assert slurm.requeue_after_stop(tmp_path, IN_A_STEP, "SIGTERM", time.time()) is None  # scancel: just ends
    assert slurm.requeue_after_stop(tmp_path, {"SLURM_JOB_ID": "7"}, "SIGUSR1", 0.0) is None  # the batch shell
    assert requeued == [] and read_preemptions(tmp_path) == []
    line = slurm.requeue_after_stop(tmp_path, IN_A_STEP, "SIGUSR1", stopped["stop_signal"]["received_at"])
    assert line is not None and line.startswith("dtrain: SIGUSR1 (checkpoint and requeue): job 7 requeued")
    assert requeued == ["7"]
    [record] = read_preemptions(tmp_path)
    assert (record["signal"], record["checkpoint"], record["batches_redone"]) == ("SIGUSR1", "step-1", 0)
    assert record["seconds_to_checkpoint"] >= 0  # recorded, not timed (benchmarks/slurm.py times it)

    capsys.readouterr()
    resumed = _trainer(tmp_path).fit()
    shown = capsys.readouterr().err
    assert "preempted: resuming at batch 1, preemptions survived: 1 (" in shown, shown
    assert "; 0 batches redone)" in shown
    assert resumed["status"] == "completed" and resumed["preemptions"] == [record]
    assert "stop_signal" not in resumed


def test_slurms_preemption_requeues_on_sigterm_from_its_preempt_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signals_kept: None) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-40")
    monkeypatch.setattr(slurm, "preempt_time", lambda environ: time.time() - 3)
    monkeypatch.setattr(slurm, "requeue", lambda environ: "Invalid job id specified")
    line = slurm.requeue_after_stop(tmp_path, IN_A_STEP, "SIGTERM", None)
    assert line is not None and line.startswith(
        "dtrain: error: preempted by Slurm, but `scontrol requeue 7` failed: Invalid job id specified; resubmit")
    [record] = read_preemptions(tmp_path)
    assert record["signal"] == "SIGTERM" and record["batches_redone"] == 0 and record["seconds_to_checkpoint"] >= 2
