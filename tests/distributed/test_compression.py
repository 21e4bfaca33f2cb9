"""Compressors inside DDP's backward pass on real gloo processes: the hook's collectives give what the
one-process reference gives, PowerSGD agrees with torch's own powerSGD_hook, bounded loss at epsilon 0 is
bit for bit DDP's own all-reduce, and a whole `dtrain run` reports the bytes it sent."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from dtrain.comm import Topology, all_gather_object
from dtrain.compress import REGISTRY, BucketInfo, Compressor, WireStats, build_compressor
from dtrain.compress.local import reduce_locally
from dtrain.compress.powersgd import PowerSGD
from dtrain.sync.allreduce import AllReduceStrategy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OPTIONS: dict[str, dict[str, Any]] = {"topk": {"ratio": 0.05}, "powersgd": {"rank": 2, "start_iter": 2},
                                      "qsgd": {"levels": 15}, "bounded_loss": {"epsilon": 0.2, "chunk_size": 16}}


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 12, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def record(compressor: Compressor, inputs: list[tuple[torch.Tensor, BucketInfo]], outputs: list[torch.Tensor]) -> None:
    """Keep copies of every bucket the hook hands to the compressor and of every final result it returns."""
    compress, decompress = compressor.compress, compressor.decompress

    def recording_compress(tensor: torch.Tensor, info: BucketInfo) -> Any:
        inputs.append((tensor.detach().clone(), info))
        return compress(tensor, info)

    def recording_decompress(received: Any, ctx: Any) -> Any:
        result = decompress(received, ctx)
        if result.gradient is not None:
            outputs.append(result.gradient.detach().clone())
        return result

    compressor.compress = recording_compress  # type: ignore[method-assign]
    compressor.decompress = recording_decompress  # type: ignore[method-assign]


def _hook_against_reference(topology: Topology) -> dict[str, Any]:
    """For every compressor: 4 SGD steps through DDP + dtrain's hook. At each step the hook's result must equal
    what `reduce_locally` computes from all ranks' buckets with fresh reference compressors, the gradients the
    optimizer sees must be that result, and the replicas must stay identical."""
    report = {}
    for name in sorted(set(REGISTRY) - {"none"}):  # `none` runs DDP's own C++ all-reduce, not the hook
        model = small_model()
        compressor = build_compressor(name, **OPTIONS.get(name, {}))
        inputs: list[tuple[torch.Tensor, BucketInfo]] = []
        outputs: list[torch.Tensor] = []
        record(compressor, inputs, outputs)
        strategy = AllReduceStrategy(topology, compressor=compressor)
        wrapped = strategy.wrap_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        references = [build_compressor(name, **OPTIONS.get(name, {})) for _ in range(topology.world_size)]
        meters = [WireStats() for _ in references]
        worst, wire = 0.0, []
        for step in range(4):
            inputs.clear()
            outputs.clear()
            x, y = batch(topology.rank, step)
            nn.functional.cross_entropy(wrapped(x), y).backward()
            strategy.step(optimizer)
            assert len(inputs) == 1 and len(outputs) == 1, "the small model is one bucket"
            shared = all_gather_object((inputs[0][0], dataclasses.asdict(inputs[0][1])))
            infos = [BucketInfo(**{**info, "spans": tuple(info["spans"]), "positions": tuple(info["positions"])})
                     for _, info in shared]
            expected = reduce_locally(references, [tensor for tensor, _ in shared], infos=infos,
                                      meters=meters)[topology.rank]
            worst = max(worst, float((outputs[0] - expected).abs().max()))
            grads = sorted(float(v) for p in model.parameters() for v in p.grad.reshape(-1))  # type: ignore[union-attr]
            assert grads == sorted(float(v) for v in outputs[0]), f"{name}: the optimizer saw other gradients"
            stats = strategy.take_wire_stats()
            reference_stats = meters[topology.rank].take()
            assert stats is not None
            wire.append((stats.payload_bytes, reference_stats.payload_bytes, stats.wire_bytes))
            optimizer.zero_grad(set_to_none=True)
        finals = all_gather_object([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(finals[0], finals[1], strict=True)), f"{name}: replicas differ"
        report[name] = (worst, wire)
        strategy.close()
    return report


class DelayedBackward(nn.Module):
    """Identity whose backward pass waits `seconds` first: it makes one rank reach its next bucket late."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds and x.requires_grad:
            x.register_hook(lambda grad: time.sleep(self.seconds))
        return x


def _powersgd_over_several_buckets(topology: Topology) -> float:
    """PowerSGD over a bucket per layer, rank 0 slowed in its backward pass before and after the middle layer:
    rank 1 reaches the first layer's bucket while the middle one's P all-reduce still waits for rank 0, and
    rank 0 has the P all-reduce done (and the Q round started from its callback) long before it gets there.
    Every rank must still issue the same collectives in the same order, and each bucket's result must be what
    the one-process reference computes from all ranks' buckets. Returns the largest difference over 5 steps
    (3 of them compressed)."""
    delay = 0.2 if topology.rank == 0 else 0.0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), DelayedBackward(delay), nn.ReLU(), nn.Linear(32, 24),
                          DelayedBackward(delay), nn.ReLU(), nn.Linear(24, 3))
    compressor = PowerSGD(rank=2, start_iter=2)
    inputs: list[tuple[torch.Tensor, BucketInfo]] = []
    buffers: list[torch.Tensor] = []
    compress = compressor.compress

    def recording_compress(tensor: torch.Tensor, info: BucketInfo) -> Any:
        inputs.append((tensor.detach().clone(), info))
        buffers.append(tensor)  # the bucket itself: it holds the combined gradient once backward is done
        return compress(tensor, info)

    compressor.compress = recording_compress  # type: ignore[method-assign]
    strategy = AllReduceStrategy(topology, bucket_cap_mb=1e-4, first_bucket_mb=1e-4, compressor=compressor)
    wrapped = strategy.wrap_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    references = [PowerSGD(rank=2, start_iter=2) for _ in range(topology.world_size)]
    worst = 0.0
    for step in range(5):
        inputs.clear()
        buffers.clear()
        x, y = batch(topology.rank, step)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        assert len(inputs) >= 3, "a bucket per layer"
        shared = all_gather_object([(tensor, dataclasses.asdict(info)) for tensor, info in inputs])
        for index, buffer in enumerate(buffers):
            infos = [BucketInfo(**{**info, "spans": tuple(info["spans"]), "positions": tuple(info["positions"])})
                     for _, info in (rank[index] for rank in shared)]
            expected = reduce_locally(references, [rank[index][0] for rank in shared], infos=infos)[topology.rank]
            worst = max(worst, float((buffer - expected).abs().max()))
        strategy.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    strategy.close()
    return worst


def _all_checks(topology: Topology) -> dict[str, Any]:
    """Every multi-process check of this module in one pair of processes (starting processes is the slow part)."""
    return {"hook": _hook_against_reference(topology),
            "powersgd": {rank: _powersgd_against_torch(topology, rank) for rank in (1, 4)},  # Gram-Schmidt, QR
            "powersgd_buckets": _powersgd_over_several_buckets(topology),
            "bounded_loss_zero": _bounded_loss_zero_against_ddp(topology)}


@pytest.fixture(scope="module")
def checks(spawn: Any) -> list[dict[str, Any]]:
    return list(spawn(_all_checks, 2))


def test_hook_collectives_match_the_one_process_reference(checks: list[dict[str, Any]]) -> None:
    for report in (rank["hook"] for rank in checks):
        for name, (error, wire) in report.items():
            assert error <= 1e-6, (name, error)
            assert all(real == reference > 0 for real, reference, _ in wire), (name, wire)


# --------------------------------------------------------------------------------- torch's PowerSGD


def _powersgd_against_torch(topology: Topology, rank: int) -> float:
    """The same model, data and seeds through torch's powerSGD_hook and through dtrain's PowerSGD; the largest
    difference of the synchronized gradients over 6 steps (2 uncompressed, 4 compressed)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
    from torch.nn.parallel import DistributedDataParallel

    theirs_model, ours_model = small_model(), small_model()
    theirs = DistributedDataParallel(theirs_model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                         min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                         random_seed=0)
    theirs.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    strategy = AllReduceStrategy(topology, first_bucket_mb=25,  # one bucket, as torch's DDP with bucket_cap_mb=25
                                 compressor=PowerSGD(rank=rank, start_iter=2, seed=0))
    ours = strategy.wrap_model(ours_model)
    opt_theirs = torch.optim.SGD(theirs_model.parameters(), lr=0.05)
    opt_ours = torch.optim.SGD(ours_model.parameters(), lr=0.05)
    worst = 0.0
    for step in range(6):
        x, y = batch(topology.rank, step)
        nn.functional.cross_entropy(theirs(x), y).backward()
        nn.functional.cross_entropy(ours(x), y).backward()
        for a, b in zip(theirs_model.parameters(), ours_model.parameters(), strict=True):
            worst = max(worst, float((a.grad - b.grad).abs().max()))  # type: ignore[operator]
        opt_theirs.step()
        strategy.step(opt_ours)
        opt_theirs.zero_grad(set_to_none=True)
        opt_ours.zero_grad(set_to_none=True)
    strategy.close()
    return worst


def test_powersgd_agrees_with_torch_powersgd_hook(checks: list[dict[str, Any]]) -> None:
    for per_rank in (rank["powersgd"] for rank in checks):
        assert set(per_rank) == {1, 4} and max(per_rank.values()) <= 1e-6, per_rank


def test_powersgd_over_several_buckets_issues_its_rounds_in_one_order_on_every_rank(
        checks: list[dict[str, Any]]) -> None:
    assert all(rank["powersgd_buckets"] <= 1e-6 for rank in checks), [rank["powersgd_buckets"] for rank in checks]


# ------------------------------------------------------------------------------- bounded loss, eps 0


def _bounded_loss_zero_against_ddp(topology: Topology) -> bool:
    finals = []
    for compressor in (None, build_compressor("bounded_loss", epsilon=0.0)):
        model = small_model()
        strategy = AllReduceStrategy(topology, compressor=compressor)
        wrapped = strategy.wrap_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(5):
            x, y = batch(topology.rank, step)
            nn.functional.cross_entropy(wrapped(x), y).backward()
            strategy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        finals.append([p.detach().clone() for p in model.parameters()])
        strategy.close()
    return all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_bounded_loss_at_epsilon_zero_is_bit_identical_to_ddp(checks: list[dict[str, Any]]) -> None:
    assert all(rank["bounded_loss_zero"] for rank in checks)


# ------------------------------------------------------------------------------------ a whole run


def test_run_with_topk_logs_bytes_per_step(tmp_path: Path) -> None:
    """`dtrain run` with top-k: summary.json, the store and TensorBoard's metrics carry the bytes sent, which
    equal the formula (2 workers: each sends 8 bytes per kept entry of its one bucket per update)."""
    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", str(FIXTURES / "digits.yaml"), "--run-dir", str(tmp_path / "run"),
         "--set", "distributed.compression={name: topk, ratio: 0.1}", "--set", "searcher.max_length={batches: 12}"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "DTRAIN_RUNS_ROOT": str(runs)})
    assert result.returncode == 0, result.stderr
    assert "wire         topk:" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    state = torch.load(summary["checkpoint"], weights_only=True)
    parameters = sum(t.numel() for t in state.values())
    wire = summary["communication"]
    assert wire["communicating_steps"] == 12 and wire["compression"] == "topk"
    assert wire["bytes_per_step"] == 8 * round(0.1 * parameters)
    assert wire["dense_bytes_per_step"] == 4 * parameters
    assert wire["compression_ratio"] == wire["dense_bytes_per_step"] / wire["bytes_per_step"]
    assert summary["strategy"]["compression"]["name"] == "topk"
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["distributed"]["compression"]["ratio"] == 0.1
    with sqlite3.connect(runs / "metrics.db") as db:
        names = {row[0] for row in db.execute("SELECT name FROM metrics")}
    assert {"bytes_per_step", "compression_ratio"} <= names
