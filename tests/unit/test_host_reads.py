"""No host read of a tensor in the training step: on a GPU each one (`.item()`, `float(t)`, `bool(t)`,
`.tolist()`, `.cpu()`, `.numpy()`) makes the CPU wait until the device has caught up, so the CPU can no longer
queue work ahead of it. A one-process run of 20 batches counts every such read by where it came from: the update
guard's finite check (one per update, the one read the step keeps: docs/architecture.md) and what a report,
validation or checkpoint reads at a meeting point are allowed; nothing else may read per batch."""

from __future__ import annotations

import copy
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.comm import Topology
from dtrain.config import load_config
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.train.trainer import Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ONE_PROCESS = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                       device=torch.device("cpu"), launcher="none")
BATCHES = 20
RAW: dict[str, Any] = {
    "name": "host-reads", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 16, "learning_rate": 0.1, "float64": True, "hidden": 8},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": BATCHES}},
    "scheduling_unit": BATCHES, "min_validation_period": {"batches": BATCHES},
    "reproducibility": {"experiment_seed": 5},
}
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__")
# where a read is allowed: the guard's finite flag (per update), a meeting point (report, validation, checkpoint,
# the end of the run), the progress line (every scheduling_unit batches: here once), the sampler's index permutation
# (a CPU tensor by construction, never on the device)
ALLOWED = {"gradients_finite": "guard", "update_flags": "guard", "_meet": "meeting point", "_finish": "end of run",
           "__iter__": "sampler (CPU indices)", "_show": "progress line"}


@pytest.fixture()
def counted_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Every host read of a tensor while the fixture is active, counted by the allowed place it came from, or by
    'hot path: <file>:<line> <function>' where it is none of them."""
    counts: Counter[str] = Counter()

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frames = traceback.extract_stack()[:-1]
            place = next((ALLOWED[f.name] for f in reversed(frames) if f.name in ALLOWED), None)
            if place is None:
                caller = next((f for f in reversed(frames) if "/dtrain/" in f.filename), frames[-1])
                place = f"hot path: {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno} {caller.name} ({name})"
            counts[place] += 1
            return original(self, *args, **kwargs)
        return counted

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    yield counts


def test_a_20_batch_run_reads_no_tensor_per_batch_but_the_guards_flag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_reads: Counter[str]) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    from digits_trial import DigitsTrial

    config = load_config(None, raw=copy.deepcopy(RAW)).config
    prepare_run_dir(config, tmp_path, FIXTURES)
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=ONE_PROCESS, run_info=load_run_info(tmp_path))
    counted_reads.clear()  # building the Trainer may read (seeds, data checks): not the step
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["steps_completed"] == BATCHES
    hot = {place: count for place, count in counted_reads.items() if place.startswith("hot path")}
    assert hot == {}
    assert counted_reads["guard"] == BATCHES  # one finite flag per update: the counter sees reads
    assert counted_reads["progress line"] == 1  # the loss shown after batch 20, the one report boundary


def test_fp16_loss_scaling_adds_no_read_the_verdict_rides_with_the_guards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_reads: Counter[str]) -> None:
    """fp16 with its GradScaler: the scale multiplies the loss as a tensor and the overflow verdict is read in the
    guard's one read per update, so the step reads exactly as often as in fp32."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    from digits_trial import DigitsTrial

    raw = copy.deepcopy(RAW)
    raw["hyperparameters"]["float64"] = False
    raw["optimizations"] = {"precision": "fp16"}
    config = load_config(None, raw=raw).config
    prepare_run_dir(config, tmp_path, FIXTURES)
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=ONE_PROCESS, run_info=load_run_info(tmp_path))
    counted_reads.clear()
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["precision"]["loss_scaling"]
    hot = {place: count for place, count in counted_reads.items() if place.startswith("hot path")}
    assert hot == {}
    assert counted_reads["guard"] == BATCHES
