"""A PyTorchTrial with two models and two optimizers, in the style of a GAN: a generator predicts the regression
target and a discriminator tells real (inputs, target) pairs from generated ones. The discriminator is stepped
first, then the generator through the updated discriminator (its parameters frozen meanwhile, so each parameter gets
its gradient from one loss per batch, as Determined asks), with a clipped step; each optimizer has its own
scheduler. It evaluates with evaluate_full_dataset (the chief alone, over the whole loader). The trial does not know
about dtrain."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from data import FEATURES, network, regression
from determined import pytorch


def discriminator() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES + 1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def clip(parameters: Any) -> None:
    torch.nn.utils.clip_grad_norm_(parameters, 0.5)


def adversarial_losses(generator: torch.nn.Module, critic: torch.nn.Module, inputs: torch.Tensor,
                       targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The discriminator's loss on real and generated pairs, and the generated values (for the generator's loss)."""
    generated = generator(inputs)
    real = critic(torch.cat([inputs, targets], dim=1))
    fake = critic(torch.cat([inputs, generated.detach()], dim=1))
    critic_loss = F.binary_cross_entropy_with_logits(real, torch.ones_like(real)) + \
        F.binary_cross_entropy_with_logits(fake, torch.zeros_like(fake))
    return critic_loss, generated


def generator_loss(critic: torch.nn.Module, inputs: torch.Tensor, generated: torch.Tensor,
                   targets: torch.Tensor) -> torch.Tensor:
    judged = critic(torch.cat([inputs, generated], dim=1))
    return 0.1 * F.binary_cross_entropy_with_logits(judged, torch.ones_like(judged)) + F.mse_loss(generated, targets)


class AdversarialTrial(pytorch.PyTorchTrial):
    def __init__(self, context: pytorch.PyTorchTrialContext) -> None:
        self.context = context
        self.generator = context.wrap_model(network())
        self.critic = context.wrap_model(discriminator())
        lr = context.get_hparam("learning_rate")
        g_opt = torch.optim.SGD(self.generator.parameters(), lr=lr, momentum=0.9)
        d_opt = torch.optim.Adam(self.critic.parameters(), lr=lr / 10)
        self.g_opt = context.wrap_optimizer(g_opt)
        self.d_opt = context.wrap_optimizer(d_opt)
        context.wrap_lr_scheduler(torch.optim.lr_scheduler.StepLR(g_opt, step_size=3, gamma=0.5),
                                  step_mode=pytorch.LRScheduler.StepMode.STEP_EVERY_BATCH)
        context.wrap_lr_scheduler(torch.optim.lr_scheduler.StepLR(d_opt, step_size=2, gamma=0.7),
                                  step_mode=pytorch.LRScheduler.StepMode.STEP_EVERY_OPTIMIZER_STEP)

    def build_training_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(regression(256, seed=1), batch_size=self.context.get_per_slot_batch_size())

    def build_validation_data_loader(self) -> pytorch.DataLoader:
        return pytorch.DataLoader(regression(64, seed=2), batch_size=self.context.get_per_slot_batch_size())

    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        inputs, targets = batch
        critic_loss, generated = adversarial_losses(self.generator, self.critic, inputs, targets)
        self.context.backward(critic_loss)
        self.context.step_optimizer(self.d_opt)
        self.critic.requires_grad_(False)
        g_loss = self.generator_objective(generator_loss(self.critic, inputs, generated, targets), batch_idx)
        if self.steps_generator(batch_idx):
            self.context.backward(g_loss)
        self.critic.requires_grad_(True)
        if self.steps_generator(batch_idx):
            self.context.step_optimizer(self.g_opt, clip_grads=clip)
        return {"critic_loss": critic_loss, "generator_loss": g_loss}

    def generator_objective(self, g_loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The loss the generator is trained on at `batch_idx` (subclasses change it)."""
        del batch_idx
        return g_loss

    def steps_generator(self, batch_idx: int) -> bool:
        """Whether the generator learns from `batch_idx` at all (subclasses leave some out)."""
        del batch_idx
        return True

    def evaluate_full_dataset(self, data_loader: torch.utils.data.DataLoader) -> dict[str, Any]:
        errors = torch.cat([self.generator(inputs) - targets for inputs, targets in data_loader])
        return {"validation_loss": float(errors.pow(2).mean()), "records": len(errors),
                "rank": self.context.distributed.get_rank()}


class PoisonedOnRankOneTrial(AdversarialTrial):
    """The same trial whose generator loss is NaN at batch 4 on slot 1 only: the averaged gradient is then NaN on
    every slot, and a framework that checks only its own slot's gradient would step one replica with NaN."""

    def generator_objective(self, g_loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 4 and self.context.distributed.get_rank() == 1:
            return g_loss * float("nan")
        return g_loss
