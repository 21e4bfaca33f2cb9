"""Trials whose errors are found inside the workers (bad-input corpus): each fails the same way on every
attempt, so a restart cannot help and `dtrain run` must stop after the first (or, for an exception in the
user's own code, the second identical) failure."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))

from digits_trial import DigitsTrial  # noqa: E402

from dtrain.data import load_fashion_mnist  # noqa: E402


class RenamedHyperparameter(DigitsTrial):
    """Reads `lr`, a key the experiment file calls `learning_rate`."""

    def build_optimizer(self, model):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(model.parameters(), lr=self.context.get_hparam("lr"))


class DictBatches(DigitsTrial):
    """Batches of {"image", "label"} dicts: fine for allreduce, not for strategy pipeline's (inputs, targets)."""

    def build_training_data(self):  # type: ignore[no-untyped-def]
        return _AsDicts(super().build_training_data())

    def train_batch(self, batch, model):  # type: ignore[no-untyped-def]
        return super().train_batch((batch["image"], batch["label"]), model)


class _AsDicts(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, data):  # type: ignore[no-untyped-def]
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        image, label = self.data[index]
        return {"image": image, "label": label}


class FailsAtBatch3(DigitsTrial):
    """A bug in the user's own code, met at batch 3 on every attempt."""

    def train_batch(self, batch, model):  # type: ignore[no-untyped-def]
        if self.context.batches_trained == 2:  # in batch 3
            scale = {"warmup": 1.0}["cooldown"]  # the bug: a key this dict never had
            del scale
        return super().train_batch(batch, model)


class DataOnEachNode(DigitsTrial):
    """Fashion-MNIST from `data.directory` with `{rank}` in it: a node-local copy, missing on one rank."""

    def build_training_data(self):  # type: ignore[no-untyped-def]
        return load_fashion_mnist("train", self.context.data_config["directory"].format(rank=self.context.rank))
