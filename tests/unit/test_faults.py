"""Fault injection (straggler, kills, NaNs), the nan_policy guard and the graceful stop, in one process."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from dtrain.config import Faults, load_config
from dtrain.errors import ConfigError, StallError, TrainingDiverged
from dtrain.train import checkpoint as ckpt
from dtrain.train import faults
from dtrain.train import guard as guard_module
from dtrain.train.faults import FaultInjector
from dtrain.train.guard import GracefulStop, UpdateGuard, Verdict, gradients_finite


def test_straggler_sleeps_factor_minus_one_times_its_last_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    injector = FaultInjector(Faults(slow_rank=1, slow_factor=3.0), rank=1)
    assert injector.before_compute() == 0.0  # nothing measured yet
    injector.after_compute(0.2)
    assert injector.before_compute() == pytest.approx(0.4)
    injector.after_compute(0.1)
    assert injector.before_compute() == pytest.approx(0.2)
    assert slept == pytest.approx([0.4, 0.2])


def test_other_ranks_and_factor_one_are_never_slowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults.time, "sleep", lambda seconds: pytest.fail("slept"))
    for injector in (FaultInjector(Faults(slow_rank=1, slow_factor=3.0), rank=0),
                     FaultInjector(Faults(slow_rank=0, slow_factor=1.0), rank=0)):
        injector.after_compute(0.5)
        assert injector.before_compute() == 0.0


def test_slow_rank_outside_the_world_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"faults.slow_rank \(2\) must name a worker rank"):
        load_config(None, raw={"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
                               "resources": {"slots_per_trial": 2}, "searcher": {"max_length": {"batches": 1}},
                               "faults": {"slow_rank": 2, "slow_factor": 2}})


def _kills(*kills: dict[str, object]) -> Faults:
    return Faults.model_validate({"kills": list(kills)})


def test_a_kill_fires_once_per_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    record = tmp_path / "logs" / faults.FAULTS_FILE
    planned = _kills({"rank": 1, "batch": 3}, {"rank": 0, "batch": 3})
    injector = FaultInjector(planned, rank=1, record_path=record, restart_count=0)
    injector.before_step(2)
    assert killed == []
    injector.before_step(3)
    assert killed == [(os.getpid(), signal.SIGKILL)]
    [fired] = faults.read_fault_records(record)
    assert fired | {"time": 0} == {"event": "kill", "index": 0, "rank": 1, "batch": 3, "during": "step",
                                   "steps_done": 2, "restart": 0, "time": 0, "thread": "MainThread"}
    restarted = FaultInjector(planned, rank=1, record_path=record, restart_count=1)
    restarted.before_step(3)  # the restarted rank passes batch 3 again: the kill is not repeated
    assert len(killed) == 1


def test_a_checkpoint_kill_hits_the_first_write_at_or_after_its_batch(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    injector = FaultInjector(_kills({"rank": 0, "batch": 15, "during": "checkpoint"}), rank=0,
                             record_path=tmp_path / "faults.jsonl")
    injector.before_step(15)
    injector.during_checkpoint(10)
    assert killed == []
    injector.during_checkpoint(20)
    assert killed == [signal.SIGKILL]
    assert faults.read_fault_records(tmp_path / "faults.jsonl")[0]["steps_done"] == 20


def test_a_kill_in_a_checkpoint_write_leaves_latest_at_the_previous_one(tmp_path: Path) -> None:
    def die() -> None:
        raise SystemExit("killed")  # stands in for SIGKILL: the write stops between the files

    ckpt.write_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {"trainer": {}})
    with pytest.raises(SystemExit):
        ckpt.write_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {"trainer": {}}, after_model_file=die)
    assert ckpt.find_resume_checkpoint(tmp_path) == ckpt.CheckpointRef(tmp_path / "step-1", 1)
    [partial] = [p for p in tmp_path.iterdir() if p.name.startswith(".partial-step-2")]
    assert sorted(f.name for f in partial.iterdir()) == [ckpt.MODEL_FILE]


def test_nan_goes_into_one_gradient_of_the_named_rank_at_the_named_batches() -> None:
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    injector = FaultInjector(Faults(nan_rank=1, nan_batches=[4]), rank=1)
    assert not injector.corrupt_gradients(3, model)
    assert not FaultInjector(Faults(nan_rank=1, nan_batches=[4]), rank=0).corrupt_gradients(4, model)
    assert injector.corrupt_gradients(4, model)
    assert not gradients_finite(model.parameters())


def _before_step_in_a_thread(injector: FaultInjector, step: int) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            injector.before_step(step)
        except StallError as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def test_a_hang_blocks_until_released_then_raises() -> None:
    injector = FaultInjector(Faults(hang_rank=1, hang_at_step=3), rank=1)
    thread, raised = _before_step_in_a_thread(injector, 3)
    thread.join(0.15)
    assert thread.is_alive() and raised == []  # hung
    injector.release.set()  # the run gave up on this rank
    thread.join(2.0)
    assert not thread.is_alive()
    [error] = raised
    assert str(error).startswith("rank 1 hung before batch 3 (faults.hang_rank) and was stopped")
    assert "\n" not in str(error)


@pytest.mark.parametrize(("faults", "rank", "step"), [
    (Faults(hang_rank=1, hang_at_step=3), 0, 3),  # another rank
    (Faults(hang_rank=1, hang_at_step=3), 1, 2),  # another step
    (Faults(hang_rank=1, hang_at_step=3), 1, 4),
    (Faults(), 0, 1),  # no hang configured
])
def test_a_hang_blocks_no_other_rank_or_step(faults: Faults, rank: int, step: int) -> None:
    thread, raised = _before_step_in_a_thread(FaultInjector(faults, rank=rank), step)
    thread.join(2.0)
    assert not thread.is_alive() and raised == []


@pytest.mark.parametrize(("faults", "message"), [
    ({"kills": [{"rank": 1, "batch": 5, "during": "checkpoint"}]}, "hits the checkpoint writer, rank 0"),
    ({"kills": [{"rank": 2, "batch": 5}]}, r"faults.kills\[0\].rank \(2\) must name a worker rank"),
    ({"nan_rank": 1}, "faults.nan_rank and faults.nan_batches go together"),
    ({"nan_rank": 3, "nan_batches": [1]}, r"faults.nan_rank \(3\) must name a worker rank"),
    ({"kills": [{"rank": 0, "batch": 0}]}, r"faults.kills.0.batch` = 0 must be >= 1"),
    ({"kills": [{"rank": 0, "batch": 5, "during": "save"}]}, "must be one of step, checkpoint"),
])
def test_bad_fault_settings_are_one_clear_error(faults: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, raw={"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
                               "resources": {"slots_per_trial": 2}, "searcher": {"max_length": {"batches": 1}},
                               "faults": faults})


# ------------------------------------------------------------------------------- nan_policy and stops


def _params(*values: float) -> list[torch.nn.Parameter]:
    parameter = torch.nn.Parameter(torch.zeros(len(values)))
    parameter.grad = torch.tensor(values)
    return [parameter]


def test_gradients_finite_tells_nan_and_inf_from_large_values() -> None:
    assert gradients_finite(_params(1e38, -1e38))  # a 2-norm would overflow here
    assert gradients_finite(_params(3e38, 3e38, 3e38))  # the sum overflows to inf; the values are finite
    assert gradients_finite(_params(3e38) + _params(3e38))  # also across tensors
    assert not gradients_finite(_params(float("inf"), float("-inf")))  # their sum is NaN
    assert not gradients_finite(_params(1.0) + _params(2.0, float("nan")))
    assert not gradients_finite(_params(1.0, float("nan")))
    assert not gradients_finite(_params(float("-inf"), 0.0))
    assert gradients_finite([torch.nn.Parameter(torch.zeros(2))])  # no gradient at all


def test_skip_counts_and_stops_after_the_limit_in_a_row() -> None:
    guard = UpdateGuard("skip", max_consecutive=2, stop=GracefulStop())
    assert guard.decide(1, _params(float("nan"))) == Verdict(apply=False, stop=False, nonfinite_ranks=(0,))
    assert guard.decide(2, _params(float("nan"))).apply is False
    assert guard.decide(3, _params(1.0)).apply is True  # a good update resets the run of skips
    assert guard.decide(4, _params(float("nan"))).apply is False
    assert guard.decide(5, _params(float("inf"))).apply is False
    with pytest.raises(TrainingDiverged, match=r"batch 6: .* rank 0 .* 3 updates in a row, more than "
                                               r"max_consecutive_nan_skips \(2\)"):
        guard.decide(6, _params(float("nan")))
    assert guard.skipped == 5


def test_abort_stops_at_the_first_nonfinite_gradient() -> None:
    guard = UpdateGuard("abort", max_consecutive=5, stop=GracefulStop())
    assert guard.decide(1, _params(0.5)) == Verdict(apply=True, stop=False)
    with pytest.raises(TrainingDiverged, match=r"batch 2: the gradient on rank 0 is not finite .*nan_policy abort"):
        guard.decide(2, _params(float("nan")))


def test_a_signal_becomes_a_stop_request_and_a_late_second_one_interrupts(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(guard_module.time, "monotonic", lambda: clock[0])
    with GracefulStop() as stop:
        guard = UpdateGuard("abort", max_consecutive=1, stop=stop)
        assert guard.decide(1, _params(0.0)).stop is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        assert guard.decide(2, _params(0.0)) == Verdict(apply=True, stop=True)
        os.kill(os.getpid(), signal.SIGINT)  # a duplicate within a second is the same request
        clock[0] += 5
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigusr1_is_a_stop_request_that_a_repeat_never_escalates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's checkpoint-and-requeue signal: scancel's copy and the agent's may come seconds apart; only a SIGTERM
    (grace time over) or a second Ctrl-C still interrupts at once."""
    clock = [100.0]
    monkeypatch.setattr(guard_module.time, "monotonic", lambda: clock[0])
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.received_at is not None
        assert abs(stop.received_at - time.time()) < 60
        clock[0] += 5
        os.kill(os.getpid(), signal.SIGUSR1)  # the same request again: no KeyboardInterrupt
        assert stop.received == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_config_nan_policy_is_checked_and_resumable() -> None:
    from dtrain.runs.rundir import RESUMABLE_CHANGES

    with pytest.raises(ConfigError, match="`nan_policy` = 'skipp' must be one of abort, skip; did you mean `skip`"):
        load_config(None, raw={"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
                               "searcher": {"max_length": {"batches": 1}}, "nan_policy": "skipp"})
    assert {"nan_policy", "max_consecutive_nan_skips"} <= set(RESUMABLE_CHANGES)


def test_replica_digest_covers_parameters_not_batch_norm_statistics() -> None:
    import torch

    from dtrain.train.guard import model_digest

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))

    a, b = model(), model()
    b.train()(torch.randn(8, 4))  # another rank's last forward: its running statistics differ
    assert model_digest(a) == model_digest(b)
    with torch.no_grad():
        b[0].weight[0, 0] += 1e-6  # a weight that differs is caught
    assert model_digest(a) != model_digest(b)


@pytest.mark.parametrize(("raw_debug", "overrides"), [({"slow_rank": 1}, []), (False, ["debug.slow_rank=1"])])
def test_the_old_debug_section_is_one_line_naming_faults(raw_debug: object, overrides: list[str]) -> None:
    raw = {"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 4},
           "resources": {"slots_per_trial": 2}, "searcher": {"max_length": {"batches": 2}}, "debug": raw_debug}
    with pytest.raises(ConfigError, match=r"the `debug:` section.* is now called `faults:`") as caught:
        load_config(None, overrides, raw=raw)
    assert "\n" not in str(caught.value)


def test_determined_debug_boolean_is_accepted() -> None:
    raw = {"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 4},
           "searcher": {"max_length": {"batches": 2}}, "debug": True}
    config = load_config(None, raw=raw).config
    assert config.debug is True and config.faults.slow_rank is None
