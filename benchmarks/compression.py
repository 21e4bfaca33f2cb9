"""Gradient compression under a real network bottleneck: 2 workers over a loopback shaped to 1 Gbit/s.

Speed. Two workers (torchrun, gloo, one thread each) run inside a network namespace whose loopback is
shaped by tbf (`benchmarks/netem.py`) and train a communication-heavy CNN (2.5M parameters: wide 3x3
convolutions on 4x4 inputs and a wide dense layer) with every variant in one process group, alternated in
blocks of steps (A B C ..., ... C B A), so that drift in machine load hits all alike:
- `ddp`: raw `DistributedDataParallel(model)` with its defaults (the uncompressed baseline);
- one dtrain `AllReduceStrategy` per compressor (`none`, `fp16`, `bf16`, `qsgd` 8-bit, `topk` 1 % with error
  feedback, `powersgd` rank 4, `sign`, `bounded_loss` epsilon 0.05);
- `bound`: backward passes under `no_sync` (aggregation_frequency 1000): no communication at all.
Each compressor's bytes per step come from its own count (`strategy.take_wire_stats()`). Headline:
`best_speedup_vs_ddp` and `best_fraction_of_bound` (target: >= 0.83 of the bound, >= 2.3x DDP).

Accuracy. `dtrain run examples/fashion_mnist/distributed.yaml` (2 workers, unshaped loopback: accuracy
does not depend on the link) for the same number of epochs with each compressor; final test accuracy
against `none`, and accuracy against the bytes each worker sent (table + PNG). Headline:
`accuracy_drop_points` per compressor (target <= 1.0 for topk 1 %, powersgd rank 4, fp16, qsgd 8-bit).

Needs root for the namespace (the speed part is skipped with the reason otherwise).

    flock /tmp/dtrain-bench.lock python benchmarks/compression.py            # about 30 minutes on 2 cores
    flock /tmp/dtrain-bench.lock python benchmarks/compression.py --quick    # a check: 2 rounds, 1 epoch
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

# label: distributed.compression options (the speed and the accuracy parts use the same settings)
COMPRESSORS: dict[str, dict[str, Any]] = {
    "none": {"name": "none"},
    "fp16": {"name": "fp16"},
    "bf16": {"name": "bf16"},
    "qsgd 8-bit": {"name": "qsgd", "levels": 127},
    "topk 1%": {"name": "topk", "ratio": 0.01, "error_feedback": True},
    "powersgd r4": {"name": "powersgd", "rank": 4, "start_iter": 10},
    "sign": {"name": "sign", "error_feedback": True},
    "bounded_loss 5%": {"name": "bounded_loss", "epsilon": 0.05},
}
TARGETS = ("topk 1%", "powersgd r4", "fp16", "qsgd 8-bit")  # the accuracy targets
PER_RANK_BATCH = 64  # default: compute shorter than DDP's communication at 1 Gbit/s, as in the measurement


def communication_heavy_cnn() -> Any:
    from sync_vs_ddp import communication_heavy_cnn as build

    return build()


# ------------------------------------------------------------------------------------------- speed


def speed_worker(rounds: int, steps: int, per_rank_batch: int, out: Path) -> None:
    """Runs in each of the 2 torchrun processes: every variant on the same model, alternated in blocks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from dtrain.comm import init_distributed
    from dtrain.compress import build_compressor
    from dtrain.sync.allreduce import AllReduceStrategy

    torch.set_num_threads(1)
    topology = init_distributed(backend="gloo")
    torch.manual_seed(0)
    base = communication_heavy_cnn()
    generator = torch.Generator().manual_seed(1000 + topology.rank)
    data = [(torch.randn(per_rank_batch, 3, 4, 4, generator=generator),
             torch.randint(0, 10, (per_rank_batch,), generator=generator)) for _ in range(4)]
    counter = {"step": 0}

    def next_batch() -> Any:
        counter["step"] += 1
        return data[counter["step"] % len(data)]

    steps_of: dict[str, Callable[[], None]] = {}
    strategies: dict[str, AllReduceStrategy] = {}
    ddp_model = copy.deepcopy(base)
    ddp = DistributedDataParallel(ddp_model)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)

    def ddp_step() -> None:
        images, labels = next_batch()
        F.cross_entropy(ddp(images), labels).backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad(set_to_none=True)

    steps_of["ddp"] = ddp_step
    for label, options in COMPRESSORS.items():
        model = copy.deepcopy(base)
        settings = {k: v for k, v in options.items() if k != "name"}
        strategy = AllReduceStrategy(topology, compressor=build_compressor(options["name"], **settings))
        wrapped = strategy.wrap_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        strategies[label] = strategy

        def step(wrapped: Any = wrapped, strategy: AllReduceStrategy = strategy, optimizer: Any = optimizer) -> None:
            images, labels = next_batch()
            F.cross_entropy(wrapped(images), labels).backward()
            strategy.step(optimizer)
            optimizer.zero_grad(set_to_none=True)

        steps_of[label] = step
    bound_model = copy.deepcopy(base)
    bound_strategy = AllReduceStrategy(topology)
    bound_wrapped = bound_strategy.wrap_model(bound_model)

    def bound_step() -> None:  # aggregation_frequency 1000: backward without communication or update
        images, labels = next_batch()
        with bound_strategy.no_sync():
            F.cross_entropy(bound_wrapped(images), labels).backward()

    steps_of["bound"] = bound_step

    def block(label: str, count: int) -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            steps_of[label]()
        dist.barrier()
        return (time.perf_counter() - started) / count

    for label in steps_of:  # warm-up: buckets rebuilt, PowerSGD past start_iter, caches warm
        block(label, 12)
        if label in strategies:
            strategies[label].take_wire_stats()
    bound_model.zero_grad(set_to_none=True)
    labels = list(steps_of)
    rows = []
    for round_index in range(rounds):
        for label in (labels if round_index % 2 == 0 else list(reversed(labels))):
            seconds = block(label, steps)
            row = {"variant": label, "round": round_index, "step_seconds": seconds,
                   "samples_per_second": per_rank_batch * topology.world_size / seconds}
            if label in strategies:
                wire = strategies[label].take_wire_stats()
                assert wire is not None
                row.update(bytes_per_step=wire.wire_bytes / steps, payload_bytes_per_step=wire.payload_bytes / steps,
                           compression_ratio=wire.compression_ratio)
            if label == "bound":
                bound_model.zero_grad(set_to_none=True)
            rows.append(row)
    if topology.is_chief:
        out.write_text(json.dumps({"rows": rows, "parameters": sum(p.numel() for p in base.parameters()),
                                   "compressors": {k: s.compressor.describe() for k, s in strategies.items()}}))
    dist.destroy_process_group()


def run_speed(rate: str, rounds: int, steps: int, per_rank_batch: int, workdir: Path) -> tuple[dict[str, Any], str]:
    from netem import measure_loopback_gbit_per_s, shaped_namespace

    out = workdir / "speed.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with shaped_namespace(rate) as ns:
        measured = measure_loopback_gbit_per_s(ns, megabytes=32)
        print(f"namespace {ns.name}: {ns.describe()}; TCP measured {measured:.2f} Gbit/s", flush=True)
        result = ns.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         __file__, "--worker", "--rounds", str(rounds), "--steps", str(steps),
                         "--per-rank-batch", str(per_rank_batch), "--out", str(out)],
                        capture_output=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"speed workers failed:\n{result.stderr[-3000:]}")
    network = f"tbf {rate} on a namespace's loopback (TCP measured {measured:.2f} Gbit/s)"
    return dict(json.loads(out.read_text())), network


def summarize_speed(job: dict[str, Any]) -> list[dict[str, Any]]:
    rows = job["rows"]

    def median_of(label: str, key: str) -> float:
        return float(statistics.median(r[key] for r in rows if r["variant"] == label))

    ddp, bound = median_of("ddp", "samples_per_second"), median_of("bound", "samples_per_second")
    table = []
    for label in ["ddp", *COMPRESSORS, "bound"]:
        speed = median_of(label, "samples_per_second")
        entry = {"variant": label, "samples_per_second": speed, "step_ms": median_of(label, "step_seconds") * 1e3,
                 "speedup_vs_ddp": speed / ddp, "fraction_of_bound": speed / bound}
        if label in COMPRESSORS:
            entry.update(bytes_per_step=median_of(label, "bytes_per_step"),
                         compression_ratio=median_of(label, "compression_ratio"))
        table.append(entry)
    return table


# ----------------------------------------------------------------------------------------- accuracy


def run_accuracy(label: str, epochs: int, workdir: Path) -> dict[str, Any]:
    options = json.dumps(COMPRESSORS[label])
    run_dir = workdir / label.replace(" ", "_").replace("%", "pct")
    env = {**os.environ, "DTRAIN_RUNS_ROOT": str(workdir / "runs")}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", str(REPO / "examples" / "fashion_mnist" / "distributed.yaml"),
         "--run-dir", str(run_dir), "--set", f"distributed.compression={options}",
         "--set", f"searcher.max_length={{epochs: {epochs}}}", "--set", "min_checkpoint_period={epochs: 100}"],
        capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"accuracy run {label} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    wire = summary["communication"]
    return {"variant": label, "accuracy": summary["validation"]["accuracy"], "loss": summary["validation"]["loss"],
            "epochs": summary["epochs_completed"], "bytes_per_step": wire["bytes_per_step"],
            "total_bytes": wire["total_bytes"], "compression_ratio": wire["compression_ratio"],
            "samples_per_second": summary["samples_per_second"], "seconds": time.perf_counter() - started,
            "history": [(h["epoch"], h["metrics"]["accuracy"]) for h in summary["validation_history"]]}


def plot_accuracy(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import save_figure

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        axis.scatter(row["total_bytes"] / 1e9, row["accuracy"] * 100, s=40)
        axis.annotate(row["variant"], (row["total_bytes"] / 1e9, row["accuracy"] * 100), textcoords="offset points",
                      xytext=(5, 4), fontsize=8)
    axis.set_xscale("log")
    axis.set_xlabel("GB sent per worker over the run (log scale)")
    axis.set_ylabel("final test accuracy (%)")
    axis.set_title(f"Fashion-MNIST, 2 workers, {rows[0]['epochs']:.0f} epochs: accuracy vs bytes sent")
    axis.grid(True, which="both", alpha=0.3)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5-step blocks; 1 epoch per accuracy run")
    parser.add_argument("--rounds", type=int, help="speed: rounds over all variants (default 6; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="speed: steps per block (default 10; 5 with --quick)")
    parser.add_argument("--epochs", type=int, help="accuracy: epochs per run (default 3; 1 with --quick)")
    parser.add_argument("--per-rank-batch", type=int, default=PER_RANK_BATCH,
                        help=f"speed: samples per worker per step (default {PER_RANK_BATCH}; another value writes "
                             "results/compression_batch<N>.*)")
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the shaped loopback (default 1gbit)")
    parser.add_argument("--skip-speed", action="store_true", help="only the accuracy runs")
    parser.add_argument("--skip-accuracy", action="store_true", help="only the speed measurement")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 6)
    steps = args.steps or (5 if args.quick else 10)
    if args.worker:
        speed_worker(rounds, steps, args.per_rank_batch, args.out)
        return
    from common import machine_info, markdown_table, write_results
    from netem import unavailable_reason

    epochs = args.epochs or (1 if args.quick else 3)
    name = "compression" + ("_quick" if args.quick else "") + (
        f"_batch{args.per_rank_batch}" if args.per_rank_batch != PER_RANK_BATCH else "")
    headline: dict[str, Any] = {"workers": 2}
    rows: list[dict[str, Any]] = []
    sections = []
    network = "none"
    speed: list[dict[str, Any]] = []
    reason = unavailable_reason()
    with tempfile.TemporaryDirectory(prefix="compression-") as tmp:
        if args.skip_speed:
            pass
        elif reason:
            print(f"speed part skipped: {reason}", flush=True)
            sections.append(f"Speed part skipped: {reason}.")
        else:
            print(f"speed: {rounds} rounds of {steps}-step blocks over {len(COMPRESSORS) + 2} variants at "
                  f"{args.rate} ...", flush=True)
            job, network = run_speed(args.rate, rounds, steps, args.per_rank_batch, Path(tmp))
            speed = summarize_speed(job)
            rows += [{"part": "speed", **row} for row in job["rows"]]
            compressed = [s for s in speed if s["variant"] in COMPRESSORS and s["variant"] != "none"]
            best = max(compressed, key=lambda s: s["samples_per_second"])
            headline.update(best_compressor=best["variant"], best_speedup_vs_ddp=round(best["speedup_vs_ddp"], 3),
                            best_fraction_of_bound=round(best["fraction_of_bound"], 3),
                            bound_speedup_vs_ddp=round(speed[-1]["speedup_vs_ddp"], 3),
                            speedup_vs_ddp={s["variant"]: round(s["speedup_vs_ddp"], 3) for s in speed},
                            fraction_of_bound={s["variant"]: round(s["fraction_of_bound"], 3) for s in speed},
                            speed_target=">= 0.83 of the bound (>= 2.3x DDP) for the best compressor",
                            rate=args.rate, rounds=rounds, steps_per_block=steps, parameters=job["parameters"],
                            per_rank_batch=args.per_rank_batch)
            table = markdown_table(
                ["variant", "samples/s", "step ms", "x DDP", "of bound", "MB sent per step", "compression"],
                [[s["variant"], s["samples_per_second"], s["step_ms"], f"{s['speedup_vs_ddp']:.2f}",
                  f"{s['fraction_of_bound']:.2f}",
                  f"{s['bytes_per_step'] / 1e6:.3f}" if "bytes_per_step" in s else "-",
                  f"{s['compression_ratio']:.1f}x" if "compression_ratio" in s else "-"] for s in speed])
            sections.append(
                f"## Speed at {args.rate}\n\n{network}; 2 workers, the communication-heavy CNN "
                f"({job['parameters']:,} parameters, {job['parameters'] * 4 / 1e6:.1f} MB of fp32 gradient), "
                f"{args.per_rank_batch} samples per worker per step, {rounds} rounds of {steps}-step blocks "
                f"alternated; medians. MB sent per step: what each worker transmits (ring all-reduce 2(n-1)/n of "
                f"the payload, all-gather (n-1) times it).\n\n**best: {best['variant']}, "
                f"{best['speedup_vs_ddp']:.2f}x DDP, {best['fraction_of_bound']:.2f} of the no-communication bound** "
                f"(target >= 0.83, >= 2.3x)\n\n"
                f"{table}")
        if not args.skip_accuracy:
            accuracy = []
            for label in COMPRESSORS:
                print(f"accuracy: {label}, {epochs} epoch(s) ...", flush=True)
                result = run_accuracy(label, epochs, Path(tmp))
                print(f"  accuracy {result['accuracy']:.4f}, {result['total_bytes'] / 1e9:.3f} GB sent, "
                      f"{result['seconds']:.0f} s", flush=True)
                accuracy.append(result)
            reference = accuracy[0]["accuracy"]
            drops = {r["variant"]: round((reference - r["accuracy"]) * 100, 2) for r in accuracy[1:]}
            headline.update(accuracy_drop_points=drops, accuracy_none=reference, epochs=epochs,
                            accuracy_target="<= 1.0 point for " + ", ".join(TARGETS),
                            accuracy_targets_met={t: drops[t] <= 1.0 for t in TARGETS})
            rows += [{"part": "accuracy", **row} for row in accuracy]
            plot = f"{name}_accuracy.png"
            from common import RESULTS

            RESULTS.mkdir(parents=True, exist_ok=True)
            plot_accuracy(accuracy, RESULTS / plot)
            table = markdown_table(
                ["compressor", "test accuracy", "drop (points)", "MB sent per update", "GB sent in all", "ratio",
                 "samples/s (unshaped)"],
                [[r["variant"], f"{r['accuracy']:.4f}", f"{(reference - r['accuracy']) * 100:+.2f}",
                  f"{r['bytes_per_step'] / 1e6:.3f}", f"{r['total_bytes'] / 1e9:.3f}",
                  f"{r['compression_ratio']:.1f}x", r["samples_per_second"]] for r in accuracy])
            sections.append(
                f"## Accuracy\n\n`dtrain run examples/fashion_mnist/distributed.yaml` for {epochs} epoch(s) with each "
                f"compressor (2 workers, unshaped loopback, the same seed); drop = accuracy of `none` minus the "
                f"compressor's, in points (target <= 1.0 for {', '.join(TARGETS)}).\n\n{table}\n\n![accuracy vs bytes]"
                f"({plot})")
    flags = "".join(f" {flag}" for flag, used in (("--quick", args.quick), ("--skip-speed", args.skip_speed),
                                                   ("--skip-accuracy", args.skip_accuracy)) if used)
    if args.per_rank_batch != PER_RANK_BATCH:
        flags += f" --per-rank-batch {args.per_rank_batch}"
    reproduce = f"flock /tmp/dtrain-bench.lock python benchmarks/compression.py{flags}"
    markdown = (f"# {name}\n\nGradient compression with 2 workers; see the docstring of `benchmarks/compression.py`."
                f"\n\n" + "\n\n".join(sections) + f"\n\nReproduce (as root): `{reproduce}`\n")
    path = write_results(name, headline, rows, markdown, machine_info(network))
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
