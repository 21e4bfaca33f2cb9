"""The reference AdversarialTrial (gan_def.py) must match: the same two models trained by a plain torch loop in one
process, on the same global batches, with Determined's semantics written out: backward at once, each optimizer
stepped (gradients divided by the aggregation frequency, clipped) and zeroed on the batch that ends an update, the
schedulers stepped after each batch by their step mode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from data import network
from gan_def import adversarial_losses, clip, discriminator, generator_loss


def train_reference(initial: dict[str, torch.Tensor], batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                    learning_rate: float, aggregation_frequency: int = 1, average: bool = True
                    ) -> dict[str, Any]:
    """Weights (keys as in dtrain's checkpoint: `model_0.*` generator, `model_1.*` critic) after `batches`."""
    generator, critic = network(), discriminator()
    generator.load_state_dict({k.removeprefix("model_0."): v for k, v in initial.items() if k.startswith("model_0.")})
    critic.load_state_dict({k.removeprefix("model_1."): v for k, v in initial.items() if k.startswith("model_1.")})
    g_opt = torch.optim.SGD(generator.parameters(), lr=learning_rate, momentum=0.9)
    d_opt = torch.optim.Adam(critic.parameters(), lr=learning_rate / 10)
    g_sched = torch.optim.lr_scheduler.StepLR(g_opt, step_size=3, gamma=0.5)
    d_sched = torch.optim.lr_scheduler.StepLR(d_opt, step_size=2, gamma=0.7)
    k = aggregation_frequency

    def step(optimizer: torch.optim.Optimizer, ends_update: bool, clipped: bool) -> None:
        if not ends_update:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if average and k > 1:
            for p in params:
                if p.grad is not None:
                    p.grad /= k
        if clipped:
            clip(iter(params))
        optimizer.step()
        optimizer.zero_grad()

    for index, (inputs, targets) in enumerate(batches):
        ends_update = (index + 1) % k == 0 or index + 1 == len(batches)
        critic_loss, generated = adversarial_losses(generator, critic, inputs, targets)
        critic_loss.backward()
        step(d_opt, ends_update, clipped=False)
        critic.requires_grad_(False)
        generator_loss(critic, inputs, generated, targets).backward()
        critic.requires_grad_(True)
        step(g_opt, ends_update, clipped=True)
        g_sched.step()
        if (index + 1) % k == 0:
            d_sched.step()
    weights = {f"model_0.{k}": v for k, v in generator.state_dict().items()}
    weights.update({f"model_1.{k}": v for k, v in critic.state_dict().items()})
    return weights
