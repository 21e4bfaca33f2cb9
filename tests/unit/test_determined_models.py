"""A PyTorchTrial with several models and optimizers (tests/determined_trials/gan_def.py), in one process: it trains
like a plain torch loop written with Determined's semantics (gan_reference.py) with and without gradient
aggregation and averaging, its checkpoints hold every model, optimizer and scheduler, a run resumed from one ends
where an uninterrupted run does, settings that need dtrain to own the step are one line, and a non-finite gradient
goes through dtrain's guard (`nan_policy`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.errors import ConfigError, TrainingDiverged
from dtrain.train.checkpoint import find_resume_checkpoint, load_checkpoint
from dtrain.train.trainer import Trainer
from tests.unit.determined_support import train, trials_on_path

RAW: dict[str, Any] = {
    "name": "det-gan", "entrypoint": "gan_def:AdversarialTrial",
    "hyperparameters": {"global_batch_size": 32, "learning_rate": 0.05},
    "searcher": {"name": "single", "metric": "validation_loss", "max_length": {"batches": 8}},
    "min_validation_period": {"batches": 4}, "min_checkpoint_period": {"batches": 4}, "scheduling_unit": 2,
}


@pytest.fixture(autouse=True)
def _trials_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from trials_on_path(monkeypatch, ("gan_def", "gan_reference", "data"))


def _recording_trial() -> tuple[type, list[Any], dict[str, torch.Tensor]]:
    """The GAN trial's adapter, recording the initial weights and every batch it trains on."""
    from gan_def import AdversarialTrial

    batches: list[Any] = []
    initial: dict[str, torch.Tensor] = {}

    class Recording(AdversarialTrial):
        def __init__(self, context: Any) -> None:
            super().__init__(context)
            initial.update({f"model_0.{k}": v.clone() for k, v in self.generator.state_dict().items()})
            initial.update({f"model_1.{k}": v.clone() for k, v in self.critic.state_dict().items()})

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
            batches.append(tuple(t.clone() for t in batch))
            return super().train_batch(batch, epoch_idx, batch_idx)

    return Recording.__dtrain_trial__(), batches, initial


def _train(run_dir: Path, trial_class: type, **changes: Any) -> tuple[Trainer, dict[str, Any]]:
    return train(RAW, run_dir, trial_class, **changes)


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and all(t.dtype == torch.float64 for t in a.values())
    return max(float((a[key] - b[key]).abs().max()) for key in a)


@pytest.mark.parametrize("aggregation,average", [(1, True), (2, True), (2, False)])
def test_two_models_and_optimizers_train_like_determined_s_loop(tmp_path: Path, aggregation: int,
                                                                average: bool) -> None:
    from gan_reference import train_reference

    trial_class, batches, initial = _recording_trial()
    trainer, summary = _train(tmp_path / "run", trial_class, optimizations={
        "aggregation_frequency": aggregation, "average_aggregated_gradients": average})
    assert summary["status"] == "completed" and summary["steps_completed"] == 8 and len(batches) == 8
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    expected = train_reference(initial, batches, learning_rate=0.05, aggregation_frequency=aggregation,
                               average=average)
    assert _max_difference(trained, expected) <= 1e-12
    assert _max_difference(trained, initial) > 1e-3  # it trained: the comparison can fail
    metrics = trainer.state.validation_history[-1]["metrics"]
    assert metrics["records"] == 64 and metrics["rank"] == 0  # evaluate_full_dataset, over the whole loader


def test_checkpoints_hold_every_model_optimizer_and_scheduler_and_resume_exactly(tmp_path: Path) -> None:
    from gan_def import AdversarialTrial

    trial_class = AdversarialTrial.__dtrain_trial__()
    whole, _ = _train(tmp_path / "whole", trial_class)
    _train(tmp_path / "resumed", trial_class, faults={"stop_after_batch": 4})
    ref = find_resume_checkpoint(tmp_path / "resumed" / "checkpoints")
    assert ref is not None and ref.step == 4
    model_state, state = load_checkpoint(ref)
    assert {key.split(".")[0] for key in model_state} == {"model_0", "model_1"}
    optimizers = state["optimizer"]["optimizers"]
    assert [len(o["param_groups"]) for o in optimizers] == [1, 1] and "exp_avg" in optimizers[1]["state"][0]
    assert [s["last_epoch"] for s in state["scheduler"]["schedulers"]] == [4, 4]
    resumed, summary = _train(tmp_path / "resumed", trial_class)
    assert summary["status"] == "completed" and summary["resumes"] == 1
    assert _max_difference(resumed.model.state_dict(), whole.model.state_dict()) == 0.0


@pytest.mark.parametrize("changes,named", [
    ({"distributed": {"strategy": "local_sgd"}}, "distributed.strategy local_sgd"),
    ({"large_batch": {"optimizer": "lars", "base_lr": 0.05}}, "large_batch"),
])
def test_settings_that_need_dtrain_to_own_the_step_are_one_line(tmp_path: Path, changes: dict[str, Any],
                                                                named: str) -> None:
    from gan_def import AdversarialTrial

    with pytest.raises(ConfigError, match=named) as caught:
        _train(tmp_path / "run", AdversarialTrial.__dtrain_trial__(), **changes)
    assert "\n" not in str(caught.value) and "2 model(s) and 2 optimizer(s)" in str(caught.value)


def test_a_grad_scaler_with_two_optimizers_is_exact(tmp_path: Path) -> None:
    """backward(scaler.scale(loss)) for both losses: each optimizer's gradients are unscaled before its clip and
    step, the scale is updated once per update; scaling by a power of two is exact, so the weights equal the
    unscaled trial's."""
    from gan_def import AdversarialTrial, adversarial_losses, clip, generator_loss

    class Scaled(AdversarialTrial):
        def __init__(self, context: Any) -> None:
            super().__init__(context)
            self.scaler = context.wrap_scaler(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))

        def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
            inputs, targets = batch
            critic_loss, generated = adversarial_losses(self.generator, self.critic, inputs, targets)
            self.context.backward(self.scaler.scale(critic_loss))
            self.context.step_optimizer(self.d_opt, scaler=self.scaler)
            self.critic.requires_grad_(False)
            g_loss = generator_loss(self.critic, inputs, generated, targets)
            self.context.backward(self.scaler.scale(g_loss))
            self.critic.requires_grad_(True)
            self.context.step_optimizer(self.g_opt, clip_grads=clip, scaler=self.scaler)
            return {"critic_loss": critic_loss, "generator_loss": g_loss}

    plain, _ = _train(tmp_path / "plain", AdversarialTrial.__dtrain_trial__())
    scaled, summary = _train(tmp_path / "scaled", Scaled.__dtrain_trial__())
    assert summary["status"] == "completed"
    assert _max_difference(scaled.model.state_dict(), plain.model.state_dict()) == 0.0
    assert scaled.trial.det_trial.scaler._get_growth_tracker() == 8  # one update per batch, none overflowed


def _generator_trial(at_batch: int, *, poisoned: bool) -> type:
    """The GAN trial whose generator loss at `at_batch` is NaN (`poisoned`), or whose generator is simply not
    stepped at that batch (the reference: what skipping that step means)."""
    from gan_def import AdversarialTrial

    class Generator(AdversarialTrial):
        def generator_objective(self, g_loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return g_loss * float("nan") if batch_idx == at_batch and poisoned else g_loss

        def steps_generator(self, batch_idx: int) -> bool:
            return batch_idx != at_batch or poisoned

    return Generator.__dtrain_trial__()


def test_a_non_finite_gradient_with_nan_policy_skip_skips_that_optimizer_s_step(tmp_path: Path) -> None:
    """The generator's NaN gradient at batch 5 is held back, dtrain's guard skips it (counted once) and drops it:
    the run ends exactly where a run that never stepped the generator at batch 5 ends; the critic stepped at batch
    5 in both."""
    poisoned, summary = _train(tmp_path / "nan", _generator_trial(4, poisoned=True), nan_policy="skip")
    assert summary["status"] == "completed" and summary["nan_steps_skipped"] == 1
    reference, _ = _train(tmp_path / "reference", _generator_trial(4, poisoned=False))
    trained = {k: v.clone() for k, v in poisoned.model.state_dict().items()}
    assert all(bool(torch.isfinite(v).all()) for v in trained.values())
    assert _max_difference(trained, reference.model.state_dict()) == 0.0
    plain, _ = _train(tmp_path / "plain", _recording_trial()[0])
    assert _max_difference(trained, plain.model.state_dict()) > 1e-6  # the skip changed something: this can fail


def test_a_non_finite_gradient_with_nan_policy_abort_stops_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(TrainingDiverged, match=r"batch 5: the gradient on rank 0 is not finite .*nan_policy abort"):
        _train(tmp_path / "nan", _generator_trial(4, poisoned=True))
