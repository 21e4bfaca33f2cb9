"""What the in-process Determined tests share: the test trials' directory on sys.path (with Determined's module
names dropped from sys.modules, since other tests import their own), one process's topology, and a short
training run of a trial class from a raw experiment config."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.comm import Topology
from dtrain.config import load_config
from dtrain.determined import install_import_path
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.trainer import Trainer

TRIALS = Path(__file__).resolve().parents[1] / "determined_trials"
ONE_PROCESS = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                       device=torch.device("cpu"), launcher="none")


def trials_on_path(monkeypatch: pytest.MonkeyPatch, module_names: Sequence[str]) -> Iterator[None]:
    """Body of an autouse fixture: the shim and TRIALS importable, `module_names` imported afresh, one thread."""
    install_import_path()
    monkeypatch.syspath_prepend(str(TRIALS))
    for name in module_names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(raw: dict[str, Any], run_dir: Path, trial_class: Any, **changes: Any) -> tuple[Trainer, dict[str, Any]]:
    """Train `trial_class` in this process on `raw` with top-level `changes`; the Trainer and its summary."""
    raw = copy.deepcopy(raw)
    raw.update(changes)
    config = load_config(None, raw=raw).config
    prepare_run_dir(config, run_dir, TRIALS)
    trainer = Trainer(config=config, trial_class=trial_class, topology=ONE_PROCESS, run_info=load_run_info(run_dir))
    return trainer, trainer.fit()
