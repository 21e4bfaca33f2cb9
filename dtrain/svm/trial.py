"""`SVMTrial`: the built-in Trial an experiment file names (`entrypoint: dtrain.svm.trial:SVMTrial`) to train an
SVM with `dtrain run` on N slots.

Its hyperparameters are the estimator's (`C`, `gamma`, `kernel`, `shrinking`, ...; see `HPARAMS`), ordinary
values that a search can vary, and `global_batch_size`, which for an SVM is the number of SMO iterations in one
"batch" (the unit of `searcher.max_length`, `min_checkpoint_period` and the training metrics). The data comes
from the config's `data:` section (`dataset: fashion_mnist` with `classes`, `train_samples`, `test_samples`,
`dataset: digits` with optional `classes`, or `dataset: files` with `train` and `validation`, one's own `.npz` or
`.csv` files); a subclass may build any other data set by overriding `build_training_data` /
`build_validation_data` (an `ArrayDataset` of (features, labels)).

The SMO loop is not a gradient step, so the Trial names its own runner (`dtrain_runner`, `runner.py`), which
the worker uses instead of the Trainer; the Trainer's loop is untouched.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dtrain.data import ArrayDataset
from dtrain.errors import TrialError
from dtrain.svm.datasets import digits, fashion_pair, from_file
from dtrain.svm.estimator import SVC
from dtrain.svm.runner import SVMRunner
from dtrain.train.trial import Trial

HPARAMS = ("C", "kernel", "degree", "gamma", "coef0", "shrinking", "tol", "cache_size", "class_weight", "max_iter",
           "multi_class", "shrink_every", "shrink_patience", "shrink_gap", "shrink_margin", "working_set",
           "blas_threads", "exchange")
DATA_KEYS = ("dataset", "classes", "train_samples", "test_samples", "directory", "train", "validation")


class SVMTrial(Trial):
    """An SVM on Fashion-MNIST (a pair of classes), digits or one's own files, trained by the distributed SMO."""

    dtrain_runner = SVMRunner

    def _split(self, part: int) -> ArrayDataset:
        data = dict(self.context.data_config)
        unknown = sorted(set(data) - set(DATA_KEYS))
        if unknown:
            raise TrialError(f"data.{unknown[0]} is not a key the SVM trial reads; its keys: {', '.join(DATA_KEYS)}")
        name = data.get("dataset", "digits")
        classes = data.get("classes")
        if name == "fashion_mnist":
            directory = data.get("directory")
            splits = fashion_pair(tuple(classes) if classes else (6, 0), data.get("train_samples", 10000),
                                  data.get("test_samples", 2000),
                                  self.context.resolve_path(directory) if directory else None)
        elif name == "digits":
            splits = digits(classes)
        elif name == "files":
            key = ("train", "validation")[part]
            if not data.get(key):
                raise TrialError(f"data.dataset files needs data.train and data.validation (a .npz with arrays X and "
                                 f"y, or a .csv with the label last); data.{key} is missing")
            return _dataset(from_file(self.context.resolve_path(str(data[key]))))
        else:
            raise TrialError(f"data.dataset {name!r} is not one the SVM trial knows; use fashion_mnist, digits, or "
                             "files (your own .npz or .csv: data.train and data.validation)")
        return _dataset(splits[part])

    def build_training_data(self) -> ArrayDataset:
        return self._split(0)

    def build_validation_data(self) -> ArrayDataset:
        return self._split(1)

    @classmethod
    def check_hyperparameters(cls, hparams: Mapping[str, Any]) -> None:
        """Every name but global_batch_size one of HPARAMS, and the estimator's rules that need no data."""
        estimator_from(hparams).check_params()

    def build_estimator(self) -> SVC:
        """The estimator from the hyperparameters (every name but global_batch_size must be one of HPARAMS)."""
        return estimator_from(self.context.hparams)


def _dataset(split: tuple[np.ndarray, np.ndarray]) -> ArrayDataset:
    features, labels = split
    return ArrayDataset(torch.from_numpy(np.ascontiguousarray(features)), torch.from_numpy(labels))


def estimator_from(hparams: Mapping[str, Any]) -> SVC:
    """The SVC the hyperparameters describe; a name that is not one of HPARAMS is one line suggesting the nearest."""
    given = {k: v for k, v in hparams.items() if k != "global_batch_size"}
    for name in given:
        if name not in HPARAMS:
            near = difflib.get_close_matches(name, HPARAMS, n=1)
            hint = f"did you mean `{near[0]}`?" if near else f"the SVM trial's: {', '.join(HPARAMS)}"
            raise TrialError(f"hyperparameter `{name}` is not one the SVM trial takes; {hint}")
    return SVC(**given)

