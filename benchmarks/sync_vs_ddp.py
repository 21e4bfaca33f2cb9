"""Is dtrain's synchronous engine at least as fast as torch DDP? Raw DDP against dtrain's allreduce strategy.

For each of three models, 2 workers (torchrun, gloo on loopback, one thread each) train the same model on
the same data with the same loop (forward, backward, SGD step, zero_grad) in three variants, alternated in
blocks of steps (A B C, C B A, ...) inside one process group, so that drift in machine load hits all alike:

- `ddp`: `DistributedDataParallel(model)` with its defaults (25 MB buckets, 1 MB first bucket);
- `dtrain`: `AllReduceStrategy` with `auto_tune_tensor_fusion` (its tuning steps run before timing starts
  and are reported with their timings);
- `dtrain k=1000`: the same with `aggregation_frequency: 1000`, i.e. backward passes without any
  communication - the seeds' way to measure communication overhead (1 - time(k=1000) / time(k=1)).

Models: (a) the Fashion-MNIST CNN of the demo (real images when the data is installed), (b) a synthetic
communication-heavy CNN of 2.5M parameters on 4x4 inputs, (c) an MLP of 106 parameter tensors. The headline
is `ratio_min`: per model, the median of the dtrain/DDP samples-per-second ratios paired within each round (both
measured back to back), and of those the smallest; `ratio_per_model` and the per-round values stand beside it.

    python benchmarks/sync_vs_ddp.py            # 8 rounds per model, about 10 minutes
    python benchmarks/sync_vs_ddp.py --quick    # 3 rounds of shorter blocks, about 3 minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples" / "fashion_mnist"))

VARIANTS = ("ddp", "dtrain", "dtrain k=1000")


# ---------------------------------------------------------------------------------------------- models


def fashion_mnist_cnn() -> Any:
    from model_def import build_cnn  # type: ignore[attr-defined]  # examples/fashion_mnist's, not diagnose's

    return build_cnn()


def communication_heavy_cnn() -> Any:
    """2.5M parameters, little compute per sample: wide 3x3 convolutions on 4x4 inputs and a wide dense layer."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(256 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


def many_tensors_mlp() -> Any:
    """53 dense layers with biases: 106 parameter tensors, 0.87M parameters."""
    from torch import nn

    layers: list[Any] = [nn.Flatten()]
    for index in range(52):
        layers += [nn.Linear(192 if index == 0 else 128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


# name: (builder, input shape, per-rank batch, steps per block, steps per block with --quick)
MODELS: dict[str, tuple[Callable[[], Any], tuple[int, ...], int, int, int]] = {
    "fashion_mnist_cnn": (fashion_mnist_cnn, (1, 28, 28), 128, 30, 15),
    "comm_heavy_cnn": (communication_heavy_cnn, (3, 4, 4), 16, 60, 30),
    "many_tensors_mlp": (many_tensors_mlp, (3, 8, 8), 64, 100, 50),
}


def batches(name: str, shape: tuple[int, ...], per_rank: int, rank: int, count: int = 8) -> tuple[list[Any], str]:
    """`count` batches of this rank: Fashion-MNIST images for the CNN when installed, random data otherwise."""
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    if name == "fashion_mnist_cnn":
        from dtrain.data import load_fashion_mnist
        from dtrain.data.fashion_mnist import find_data_dir

        if find_data_dir() is not None:
            images, labels = load_fashion_mnist("train").tensors
            index = torch.randperm(len(images), generator=generator)[:count * per_rank].view(count, per_rank)
            return [(images[i], labels[i]) for i in index], "Fashion-MNIST"
    return [(torch.randn(per_rank, *shape, generator=generator), torch.randint(0, 10, (per_rank,), generator=generator))
            for _ in range(count)], "synthetic"


# ------------------------------------------------------------------------------------ one torchrun job


def worker(name: str, rounds: int, steps: int, out: Path) -> None:
    """Runs in each of the 2 torchrun processes: the three variants on one model, alternated in blocks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from dtrain.comm import init_distributed
    from dtrain.sync.allreduce import AllReduceStrategy

    torch.set_num_threads(1)
    topology = init_distributed(backend="gloo")
    builder, shape, per_rank, _, _ = MODELS[name]
    torch.manual_seed(0)
    base = builder()
    data, source = batches(name, shape, per_rank, topology.rank)

    ddp_model = copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    dtrain_model = copy.deepcopy(base)
    strategy = AllReduceStrategy(topology, auto_tune_fusion=True)
    wrapped = strategy.wrap_model(dtrain_model)
    dtrain_optimizer = torch.optim.SGD(dtrain_model.parameters(), lr=0.01, momentum=0.9)
    counter = {"step": 0}

    def ddp_step() -> None:
        images, labels = data[counter["step"] % len(data)]
        ddp_optimizer.zero_grad()
        F.cross_entropy(ddp(images), labels).backward()
        ddp_optimizer.step()
        counter["step"] += 1

    def dtrain_step() -> None:
        images, labels = data[counter["step"] % len(data)]
        F.cross_entropy(wrapped(images), labels).backward()
        strategy.step(dtrain_optimizer)
        dtrain_optimizer.zero_grad(set_to_none=True)
        counter["step"] += 1

    def dtrain_local_step() -> None:  # aggregation_frequency 1000: no communication, no optimizer step
        images, labels = data[counter["step"] % len(data)]
        with strategy.no_sync():
            F.cross_entropy(wrapped(images), labels).backward()
        counter["step"] += 1

    def block(step: Callable[[], None], count: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            step()
        dist.barrier()
        return (time.perf_counter() - started) / count

    tuning_started = time.perf_counter()
    tuning_steps = 0
    while strategy.tuner is not None and not strategy.tuner.done:
        dtrain_step()
        tuning_steps += 1
    tuning_seconds = time.perf_counter() - tuning_started
    for step in (ddp_step, dtrain_step, dtrain_local_step):  # warm-up
        block(step, max(steps // 5, 3))
    dtrain_optimizer.zero_grad(set_to_none=True)
    variants = dict(zip(VARIANTS, (ddp_step, dtrain_step, dtrain_local_step), strict=True))
    rows = []
    for round_index in range(rounds):
        order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            seconds = block(variants[variant], steps)
            if variant == "dtrain k=1000":
                dtrain_optimizer.zero_grad(set_to_none=True)  # drop the accumulated local gradients
            rows.append({"model": name, "variant": variant, "round": round_index, "step_seconds": seconds,
                         "samples_per_second": per_rank * topology.world_size / seconds})
    if topology.is_chief:
        params = sum(p.numel() for p in base.parameters())
        out.write_text(json.dumps({
            "rows": rows, "parameters": params, "parameter_tensors": len(list(base.parameters())),
            "model_mb": params * 4 / 2**20, "data": source, "global_batch": per_rank * topology.world_size,
            "steps_per_block": steps, "tuned_bucket_mb": strategy.bucket_cap_mb,
            "tuning": strategy.describe().get("fusion_tuning"), "tuning_steps": tuning_steps,
            "tuning_seconds": tuning_seconds}))
    dist.destroy_process_group()


def run_model(name: str, rounds: int, steps: int, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             __file__, "--worker", name, "--rounds", str(rounds), "--steps", str(steps),
                             "--out", str(out)], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


# ------------------------------------------------------------------------------------------ reporting


def summarize(name: str, job: dict[str, Any]) -> dict[str, Any]:
    def median_of(variant: str, key: str) -> float:
        return float(statistics.median(r[key] for r in job["rows"] if r["variant"] == variant))

    ddp, dtrain = median_of("ddp", "samples_per_second"), median_of("dtrain", "samples_per_second")
    step_k1, step_k1000 = median_of("dtrain", "step_seconds"), median_of("dtrain k=1000", "step_seconds")
    from common import paired_ratio, rounds_of

    paired = paired_ratio(rounds_of(job["rows"], "dtrain", "samples_per_second", "round"),
                          rounds_of(job["rows"], "ddp", "samples_per_second", "round"))
    return {"model": name, "parameters": job["parameters"], "parameter_tensors": job["parameter_tensors"],
            "model_mb": job["model_mb"], "data": job["data"], "global_batch": job["global_batch"],
            "ddp_samples_per_second": ddp, "dtrain_samples_per_second": dtrain, "ratio": paired["value"],
            "ratio_per_round": paired["per_round"], "ratio_per_round_min": paired["min"],
            "ratio_per_round_max": paired["max"],
            "step_ms_k1": step_k1 * 1e3, "step_ms_k1000": step_k1000 * 1e3,
            "communication_overhead": 1 - step_k1000 / step_k1,
            "tuned_bucket_mb": job["tuned_bucket_mb"], "tuning_steps": job["tuning_steps"],
            "tuning_seconds": job["tuning_seconds"], "tuning": job["tuning"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of half-length blocks per model")
    parser.add_argument("--rounds", type=int, help="rounds of the three variants per model (default 8; 3 with --quick)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.steps, args.out)
        return
    from common import machine_info, markdown_table, write_results

    rounds = args.rounds or (3 if args.quick else 8)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    rows, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="sync_vs_ddp-") as tmp:
        for name in names:
            steps = MODELS[name][4] if args.quick else MODELS[name][3]
            print(f"{name}: {rounds} rounds of {steps}-step blocks ...", flush=True)
            job = run_model(name, rounds, steps, Path(tmp))
            rows += job["rows"]
            summary = summarize(name, job)
            summaries.append(summary)
            print(f"  ratio dtrain/DDP {summary['ratio']:.3f}, buckets {summary['tuned_bucket_mb']:g} MB, "
                  f"communication overhead {summary['communication_overhead']:.0%}", flush=True)
    ratios = {s["model"]: round(s["ratio"], 4) for s in summaries}
    per_round = [min(rounds) for rounds in zip(*(s["ratio_per_round"] for s in summaries), strict=True)]
    headline = {"ratio_min": min(ratios.values()), "ratio_min_per_round": per_round, "ratio_per_model": ratios,
                "ratio_per_model_per_round": {s["model"]: s["ratio_per_round"] for s in summaries},
                "communication_overhead_per_model": {s["model"]: round(s["communication_overhead"], 4)
                                                     for s in summaries},
                "tuned_bucket_mb_per_model": {s["model"]: s["tuned_bucket_mb"] for s in summaries},
                "target": "ratio_min >= 1.00, never below 0.97", "workers": 2, "rounds": rounds}
    table = markdown_table(
        ["model", "params", "tensors", "DDP samples/s", "dtrain samples/s", "ratio", "per-round range",
         "step ms (k=1)", "step ms (k=1000)", "comm overhead", "tuned buckets (MB)"],
        [[s["model"], s["parameters"], s["parameter_tensors"], s["ddp_samples_per_second"],
          s["dtrain_samples_per_second"], f"{s['ratio']:.3f}",
          f"{s['ratio_per_round_min']:.2f}-{s['ratio_per_round_max']:.2f}", s["step_ms_k1"], s["step_ms_k1000"],
          f"{s['communication_overhead']:.0%}", s["tuned_bucket_mb"]] for s in summaries])
    tuning_lines = []
    for s in summaries:
        visits = (s["tuning"] or {}).get("visits", [])
        means: dict[float, list[float]] = {}
        for size, seconds in visits:
            means.setdefault(size, []).append(seconds * 1e3)
        shown = ", ".join(f"{size:g} MB: {statistics.mean(v):.1f} ms" for size, v in sorted(means.items()))
        tuning_lines.append(f"- {s['model']}: {s['tuning_steps']} tuning steps ({s['tuning_seconds']:.1f} s); "
                            f"median step time per candidate: {shown or 'one candidate, nothing to tune'}")
    markdown = (f"# sync_vs_ddp\n\nRaw torch DDP (defaults) against dtrain's allreduce strategy with auto-tuned "
                f"tensor fusion, 2 workers on loopback gloo, alternated in blocks, {rounds} rounds; each ratio is "
                f"the median of ratios paired within a round.\n\n"
                f"**ratio_min (dtrain / DDP samples/s): {headline['ratio_min']:.3f}** (target >= 1.00, never "
                f"below 0.97)\n\n{table}\n\nCommunication overhead is 1 - step time with aggregation_frequency "
                f"1000 / step time with 1 (dtrain). Fusion tuning (before timing):\n\n" + "\n".join(tuning_lines)
                + f"\n\nReproduce: `python benchmarks/sync_vs_ddp.py{' --quick' if args.quick else ''}`\n")
    path = write_results("sync_vs_ddp", headline, rows, markdown, machine_info(), extra={"models": summaries})
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
