"""The digits Trial reading Fashion-MNIST from the config's `data.directory` (bad-input corpus: data files)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))

from digits_trial import DigitsTrial  # noqa: E402

from dtrain.data import load_fashion_mnist  # noqa: E402


class FashionFromDirectory(DigitsTrial):
    def build_training_data(self):  # type: ignore[no-untyped-def]
        return load_fashion_mnist("train", self.context.data_config["directory"])

    def build_validation_data(self):  # type: ignore[no-untyped-def]
        return load_fashion_mnist("test", self.context.data_config["directory"])
