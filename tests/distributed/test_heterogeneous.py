"""Heterogeneous workers on 2 gloo processes (float64): 3:1 batches weighted by their shares give exactly the
gradient of one process on the union batch, and the plain unweighted average does not; a run with
`distributed.heterogeneous.split: [3, 1]` equals one process training on the whole global batch; a run with
`split: auto` and a straggler re-balances while keeping the global batch and identical replicas; the Trainer with
`local_sgd` (H = 1) on the same 3:1 split equals it too. One spawn."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dtrain.comm import Topology, barrier
from dtrain.config import load_config
from dtrain.data.sharding import ShardedBatchSampler, split_by_sizes, split_global_batch
from dtrain.runs.rundir import load_run_info, prepare_run_dir
from dtrain.sync.allreduce import AllReduceStrategy
from dtrain.train.rng import seed_everything
from dtrain.train.trainer import Trainer
from dtrain.train.trial import TrialContext

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from digits_trial import DigitsTrial  # noqa: E402

RAW: dict[str, Any] = {
    "name": "heterogeneous", "entrypoint": "digits_trial:DigitsTrial",
    "hyperparameters": {"global_batch_size": 24, "learning_rate": 0.5, "momentum": 0.0, "float64": True,
                        "hidden": 16},
    "resources": {"slots_per_trial": 2},
    "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_length": {"batches": 5}},
    "reproducibility": {"experiment_seed": 11},
    "distributed": {"heterogeneous": {"split": [3, 1]}},
}


def union_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 10, generator=generator, dtype=torch.float64), torch.randint(0, 3, (16,),
                                                                                       generator=generator)


def probe_gradient(weights: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model = torch.nn.Linear(10, 3).double()
    with torch.no_grad():
        model.weight.copy_(weights)
        model.bias.zero_()
    F.cross_entropy(model(x), y).backward()
    assert model.weight.grad is not None
    return model.weight.grad


def _gradients(topology: Topology) -> dict[str, torch.Tensor]:
    """Rank 0 takes 12 records of the union batch, rank 1 the other 4; the loss scaled by world * share (the
    Trainer's BatchSizes) or not at all."""
    split = split_by_sizes([12, 4])
    x, y = union_batch(1)
    start = split.offsets()[topology.rank]
    mine = slice(start, start + split.per_rank[topology.rank])
    weights = torch.randn(3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out = {}
    for name, scale in {"weighted": 2 * split.weight(topology.rank), "unweighted": 1.0}.items():  # as BatchSizes
        model = torch.nn.Linear(10, 3).double()
        with torch.no_grad():
            model.weight.copy_(weights)
            model.bias.zero_()
        strategy = AllReduceStrategy(topology)
        wrapped = strategy.wrap_model(model)
        (F.cross_entropy(wrapped(x[mine]), y[mine]) * scale).backward()
        assert model.weight.grad is not None
        out[name] = model.weight.grad.clone()
        strategy.close()
    return out


def _run(topology: Topology, run_dir: str, raw: dict[str, Any]) -> dict[str, Any]:
    config = load_config(None, raw=raw).config
    if topology.rank == 0:
        prepare_run_dir(config, Path(run_dir), FIXTURES)
    barrier()
    trainer = Trainer(config=config, trial_class=DigitsTrial, topology=topology,
                      run_info=load_run_info(Path(run_dir)))
    summary = trainer.fit()
    return {"status": summary["status"], "state": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "split": list(trainer.sizes.base.per_rank), "records": trainer.sizes.records,
            "samples": trainer.state.samples_trained, "rebalances": trainer.balancing.rebalances}


def _all(topology: Topology, tmp: str) -> dict[str, Any]:
    explicit = _run(topology, f"{tmp}/explicit", RAW)
    auto = copy.deepcopy(RAW)
    auto["distributed"]["heterogeneous"] = {"split": "auto", "calibrate_steps": 2, "rebalance_every": 2,
                                            "tolerance": 0.0}
    auto["faults"] = {"slow_rank": 1, "slow_factor": 3.0}
    auto["searcher"]["max_length"] = {"batches": 8}
    local = copy.deepcopy(RAW)  # the Trainer with local SGD (H = 1, no momentum): averaging == synchronous SGD
    local["distributed"].update(strategy="local_sgd", local_sgd={"period": 1})
    return {"gradients": _gradients(topology), "explicit": explicit, "auto": _run(topology, f"{tmp}/auto", auto),
            "local_sgd": _run(topology, f"{tmp}/local", local)}


def one_process_sgd(raw: dict[str, Any], steps: int) -> dict[str, torch.Tensor]:
    """Plain SGD on the whole global batch in this process, written without the Trainer."""
    hp, seed = raw["hyperparameters"], raw["reproducibility"]["experiment_seed"]
    split = split_global_batch(hp["global_batch_size"], 1)
    trial = DigitsTrial(TrialContext(hparams=hp, rank=0, world_size=1, local_rank=0, batch_split=split,
                                     device=torch.device("cpu"), seed=seed))
    data = trial.build_training_data()
    seed_everything(seed)
    model = trial.build_model()
    images, labels = data.tensors
    order = list(ShardedBatchSampler(len(data), split, 0, seed, epoch=0))
    for step in range(steps):
        index = torch.tensor(order[step])
        model.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= hp["learning_rate"] * p.grad
    return model.state_dict()


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def test_uneven_workers(spawn: Any, tmp_path: Path) -> None:
    ranks = spawn(_all, 2, str(tmp_path))
    x, y = union_batch(1)
    weights = torch.randn(3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    union = probe_gradient(weights, x, y)
    for r in ranks:
        assert float((r["gradients"]["weighted"] - union).abs().max()) <= 1e-12 * float(union.abs().max())
        # the unweighted average over-weights the rank with 4 records: it fails the same check
        assert float((r["gradients"]["unweighted"] - union).abs().max()) > 1e-3 * float(union.abs().max())
    # split [3, 1] of a global batch of 24: 18 and 6 records, equal to one process on all 24
    assert [r["explicit"]["records"] for r in ranks] == [18, 6]
    expected = one_process_sgd(RAW, steps=5)
    for r in ranks:
        assert r["explicit"]["status"] == "completed"
        assert relative(r["explicit"]["state"], expected) < 1e-9
    for r in ranks:  # through the Trainer, with checkpoints and validation (consolidation) and 18/6 batches
        assert r["local_sgd"]["status"] == "completed"
        assert relative(r["local_sgd"]["state"], expected) < 1e-9
    # auto: whatever split the measured speeds chose, the global batch stayed 24 and the replicas identical
    for r in ranks:
        assert r["auto"]["status"] == "completed" and r["auto"]["samples"] == 8 * 24
        assert sum(r["auto"]["split"]) == 24 and min(r["auto"]["split"]) >= 1
        assert r["auto"]["split"] == ranks[0]["auto"]["split"]
        assert all(torch.equal(r["auto"]["state"][k], ranks[0]["auto"]["state"][k]) for k in r["auto"]["state"])
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["replicas_identical"] is True
