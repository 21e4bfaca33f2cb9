"""A model as the planner needs it, measured from a torch module or from an experiment's Trial: parameter
count and training FLOPs per sample (forward + backward, counted by torch.utils.flop_counter.FlopCounterMode),
plus what calibration needs to time a step. Imports torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import TrialError
from dtrain.plan.spec import ModelSpec

REFERENCE_WORKLOAD = "reference-mlp"


@dataclass
class Workload:
    """One device's training step: a model factory, an optimizer factory, a batch and its loss."""

    name: str
    build_model: Callable[[], Any]
    build_optimizer: Callable[[Any], Any]
    batch: Any
    batch_size: int
    loss_of: Callable[[Any, Any], Any]  # (batch, model) -> scalar loss
    parameters: int = 0
    training_flops_per_sample: float | None = None
    parameter_bytes_in_backward_order: list[int] | None = None

    def model_spec(self) -> ModelSpec:
        order = tuple(self.parameter_bytes_in_backward_order) if self.parameter_bytes_in_backward_order else None
        return ModelSpec(name=self.name, parameters=self.parameters,
                         training_flops_per_sample=self.training_flops_per_sample, source="measured",
                         parameter_bytes_in_backward_order=order)


def count_training_flops(model: Any, batch: Any, loss_of: Callable[[Any, Any], Any]) -> float:
    """FLOPs of one forward + backward of `batch` (torch's counter: 2 per multiply-accumulate)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss_of(batch, model).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def _finish(workload: Workload) -> Workload:
    model = workload.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    workload.parameters = sum(p.numel() for p in params)
    workload.parameter_bytes_in_backward_order = [p.numel() * p.element_size() for p in reversed(params)]
    workload.training_flops_per_sample = count_training_flops(model, workload.batch, workload.loss_of) / max(
        workload.batch_size, 1)
    return workload


def reference_workload(batch_size: int = 64) -> Workload:
    """A fixed MLP (512 -> 1024 x 4 -> 10, 3.7 M parameters) on random data: the machine's compute yardstick
    when no experiment is named."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def build() -> nn.Module:
        torch.manual_seed(0)
        sizes = [512, 1024, 1024, 1024, 1024]
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:], strict=False):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(sizes[-1], 10))

    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(batch_size, 512, generator=generator),
             torch.randint(0, 10, (batch_size,), generator=generator))
    return _finish(Workload(
        name=REFERENCE_WORKLOAD, build_model=build,
        build_optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        batch=batch, batch_size=batch_size, loss_of=lambda b, m: F.cross_entropy(m(b[0]), b[1])))


def trial_workload(config_path: Path, overrides: list[str] | None = None, batch_size: int | None = None
                   ) -> Workload:
    """The experiment's Trial as one device sees it: its model and optimizer, one batch of its training data
    of the per-slot size (or `batch_size`), and its `train_batch` loss."""
    import torch

    from dtrain.config import load_config
    from dtrain.data.sharding import split_global_batch
    from dtrain.determined.entrypoint import load_trial
    from dtrain.train.trial import TrialContext

    loaded = load_config(config_path, overrides or [])
    config = loaded.config
    split = split_global_batch(config.global_batch_size, config.resources.world_size)
    per_device = batch_size or split.per_rank[0]
    trial_class = load_trial(config, loaded.base_dir)
    context = TrialContext(hparams=config.hyperparameters, rank=0, world_size=config.resources.world_size,
                           local_rank=0, batch_split=split, device=torch.device("cpu"),
                           seed=config.reproducibility.experiment_seed, data_config=config.data,
                           config_dir=loaded.base_dir, total_batches=1000, batches_per_epoch=1000,
                           aggregation_frequency=config.optimizations.aggregation_frequency,
                           experiment_config=config)
    trial = trial_class(context)
    data: Any = trial.build_training_data()
    if len(data) < per_device:
        raise TrialError(f"the training data has {len(data)} records, fewer than one device's batch of "
                         f"{per_device}; give a smaller --batch-per-device")
    indices = list(range(per_device))
    if getattr(data, "returns_batches", False):  # dtrain's ArrayDataset gathers a whole batch itself
        batch = data.__getitems__(indices)
    else:
        batch = torch.utils.data.default_collate([data[i] for i in indices])

    def loss_of(b: Any, model: Any) -> Any:
        outputs = trial.train_batch(b, model)
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        if loss is None:
            raise TrialError("train_batch() must return a dict with a scalar `loss`")
        return loss

    def build_model() -> Any:
        torch.manual_seed(config.reproducibility.experiment_seed)
        return trial.build_model()

    return _finish(Workload(name=config.name, build_model=build_model, build_optimizer=trial.build_optimizer,
                            batch=batch, batch_size=per_device, loss_of=loss_of))


def module_model_spec(module: Any, batch: Any, loss_of: Callable[[Any, Any], Any], batch_size: int,
                      name: str = "module") -> ModelSpec:
    """Parameter count and training FLOPs per sample of any torch module."""
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    flops = count_training_flops(module, batch, loss_of) / batch_size
    return ModelSpec(name=name, parameters=params, training_flops_per_sample=flops, source="measured")


__all__ = ["REFERENCE_WORKLOAD", "Workload", "count_training_flops", "module_model_spec", "reference_workload",
           "trial_workload"]
