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

Accuracy and time to accuracy. `dtrain run examples/fashion_mnist/distributed.yaml` for the same number of
epochs with each compressor and each of `--seeds` seeds (default 3), on `--workers` workers (default 4, the
global batch of 256 split over them), inside the namespace shaped to `--rate` when there is one (so a run's
speed and its accuracy are measured together: `time_to_accuracy_s` is the training wall time to the first
validation at or above `--target`); final test accuracy against `none` with the same seed, and accuracy against
the bytes each worker sent (table + PNG). Headline: `accuracy_drop_points` per compressor, the mean over seeds
of (none - compressor) paired by seed, sign included, with its per-seed values, min and max (target <= 1.0 for
topk 1 %, powersgd rank 4, fp16, qsgd 8-bit), and `time_to_accuracy_ratio` per compressor (median over seeds of
compressor / none, paired by seed).

Needs root for the namespace (the speed part is skipped with the reason otherwise).

    flock /tmp/dtrain-bench.lock python benchmarks/compression.py            # about 30 minutes on 2 cores
    flock /tmp/dtrain-bench.lock python benchmarks/compression.py --quick    # a check: 2 rounds, 1 epoch
"""

from __future__ import annotations

import argparse
import contextlib
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


def paired_speed(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per variant, its samples/s against DDP's and the bound's measured in the same round: the median of the
    per-round ratios (`value`) and both sides round by round (`sides`, for ratio_headline)."""
    from common import paired_ratio

    def per_round(label: str) -> list[float]:
        return [r["samples_per_second"] for r in sorted((r for r in rows if r["variant"] == label),
                                                        key=lambda r: int(r["round"]))]

    result = {}
    for label in {r["variant"] for r in rows}:
        mine = per_round(label)
        result[label] = {name: {**paired_ratio(mine, per_round(other)), "sides": (mine, per_round(other))}
                         for name, other in (("speedup_vs_ddp", "ddp"), ("fraction_of_bound", "bound"))}
    return result


# ----------------------------------------------------------------------------------------- accuracy


def run_accuracy(label: str, epochs: int, workdir: Path, *, seed: int = 0, workers: int = 2,
                 wrap: list[str] | None = None, target: float = 0.88) -> dict[str, Any]:
    from common import time_to

    options = json.dumps(COMPRESSORS[label])
    run_dir = workdir / f"{label.replace(' ', '_').replace('%', 'pct')}-seed{seed}"
    env = {**os.environ, "DTRAIN_RUNS_ROOT": str(workdir / "runs")}
    started = time.perf_counter()
    result = subprocess.run(
        [*(wrap or []), sys.executable, "-m", "dtrain.cli", "run",
         str(REPO / "examples" / "fashion_mnist" / "distributed.yaml"),
         "--run-dir", str(run_dir), "--set", f"distributed.compression={options}",
         "--set", f"resources.slots_per_trial={workers}", "--set", f"reproducibility.experiment_seed={seed}",
         "--set", f"searcher.max_length={{epochs: {epochs}}}", "--set", "min_checkpoint_period={epochs: 100}"],
        capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"accuracy run {label} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    wire = summary["communication"]
    history = [{"accuracy": h["metrics"]["accuracy"], "wall_seconds": h["wall_seconds"]}
               for h in summary["validation_history"]]
    return {"variant": label, "seed": seed, "workers": workers, "target": target,
            "time_to_accuracy_s": time_to(history, target),
            "accuracy": summary["validation"]["accuracy"], "loss": summary["validation"]["loss"],
            "epochs": summary["epochs_completed"], "bytes_per_step": wire["bytes_per_step"],
            "total_bytes": wire["total_bytes"], "compression_ratio": wire["compression_ratio"],
            "samples_per_second": summary["samples_per_second"], "seconds": time.perf_counter() - started,
            "history": [(h["epoch"], h["metrics"]["accuracy"]) for h in summary["validation_history"]]}


def accuracy_figures(rows: list[dict[str, Any]], labels: list[str], seeds: int
                     ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any] | None]]:
    """Per compressor: the accuracy drop against `none` paired by seed (mean, per seed, min, max; in points) and
    the time to accuracy over `none`'s paired by seed (None where some run never reached the target)."""
    from common import paired_ratio

    def of(label: str, key: str) -> list[Any]:
        return [next(r[key] for r in rows if r["variant"] == label and r["seed"] == seed) for seed in range(seeds)]

    drops, times = {}, {}
    for label in labels[1:]:
        per_seed = [round((a - b) * 100, 3) for a, b in zip(of("none", "accuracy"), of(label, "accuracy"), strict=True)]
        drops[label] = {"mean": round(statistics.fmean(per_seed), 3), "per_seed": per_seed, "min": min(per_seed),
                        "max": max(per_seed)}
        mine, base = of(label, "time_to_accuracy_s"), of("none", "time_to_accuracy_s")
        times[label] = None if None in mine or None in base else paired_ratio(mine, base)
    return drops, times


def plot_accuracy(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import save_figure

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == label]
        sent = statistics.fmean(r["total_bytes"] for r in mine) / 1e9
        accuracies = [r["accuracy"] * 100 for r in mine]
        axis.scatter([sent] * len(mine), accuracies, s=12, alpha=0.5)
        axis.scatter(sent, statistics.fmean(accuracies), s=40)
        axis.annotate(label, (sent, statistics.fmean(accuracies)), textcoords="offset points", xytext=(5, 4),
                      fontsize=8)
    axis.set_xscale("log")
    axis.set_xlabel("GB sent per worker over the run (log scale)")
    axis.set_ylabel("final test accuracy (%)")
    axis.set_title(f"Fashion-MNIST, {rows[0]['workers']} workers, {rows[0]['epochs']:.0f} epochs: accuracy vs bytes "
                   "sent (large: mean over seeds)")
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
    parser.add_argument("--seeds", type=int, help="accuracy: seeds per compressor (default 3; 1 with --quick)")
    parser.add_argument("--workers", type=int, default=4, help="accuracy: workers per run (default 4)")
    parser.add_argument("--target", type=float, default=0.88,
                        help="accuracy: the accuracy time_to_accuracy_s is measured to (default 0.88)")
    parser.add_argument("--compressors", type=lambda text: text.split(","),
                        help="accuracy: comma-separated subset of the compressors (`none` is always run)")
    parser.add_argument("--unshaped-accuracy", action="store_true",
                        help="accuracy: run on the plain loopback even where a shaped namespace is available")
    parser.add_argument("--skip-accuracy", action="store_true", help="only the speed measurement")
    parser.add_argument("--results-name",
                        help="results file name (default compression, with _quick or _batch<N> when those are set)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 6)
    steps = args.steps or (5 if args.quick else 10)
    if args.worker:
        speed_worker(rounds, steps, args.per_rank_batch, args.out)
        return
    from common import machine_info, markdown_table, median, ratio_headline, write_results
    from netem import shaped_namespace, unavailable_reason

    epochs = args.epochs or (1 if args.quick else 3)
    name = args.results_name or "compression" + ("_quick" if args.quick else "") + (
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
            paired = paired_speed(job["rows"])
            compressed = [s for s in speed if s["variant"] in COMPRESSORS and s["variant"] != "none"]
            best = max(compressed, key=lambda s: paired[s["variant"]]["fraction_of_bound"]["value"])
            for entry in speed:  # the table shows the paired figures (medians of per-round ratios)
                if entry["variant"] in paired:
                    entry["speedup_vs_ddp"] = paired[entry["variant"]]["speedup_vs_ddp"]["value"]
                    entry["fraction_of_bound"] = paired[entry["variant"]]["fraction_of_bound"]["value"]
            mine = paired[best["variant"]]
            headline.update(best_compressor=best["variant"],
                            **ratio_headline("best_fraction_of_bound", *mine["fraction_of_bound"]["sides"]),
                            **ratio_headline("best_speedup_vs_ddp", *mine["speedup_vs_ddp"]["sides"]),
                            best_fraction_of_bound_ratio_of_medians=round(
                                median(mine["fraction_of_bound"]["sides"][0])
                                / median(mine["fraction_of_bound"]["sides"][1]), 3),
                            bound_speedup_vs_ddp=round(paired["bound"]["speedup_vs_ddp"]["value"], 3),
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
                f"alternated; x DDP and of bound are medians of ratios paired within a round (each side measured "
                f"back to back), the other columns medians. MB sent per step: what each worker transmits (ring "
                f"all-reduce 2(n-1)/n of "
                f"the payload, all-gather (n-1) times it).\n\n**best: {best['variant']}, "
                f"{best['speedup_vs_ddp']:.2f}x DDP, {best['fraction_of_bound']:.3f} of the no-communication bound** "
                f"(per round " + ", ".join(f"{v:.3f}" for v in headline["best_fraction_of_bound_per_round"])
                + "; target >= 0.83, >= 2.3x)\n\n"
                f"{table}")
        if not args.skip_accuracy:
            seeds = args.seeds or (1 if args.quick else 3)
            labels = ["none", *[c for c in COMPRESSORS if c != "none" and (args.compressors is None
                                                                          or c in args.compressors)]]
            shaped = reason is None and not args.unshaped_accuracy
            with (shaped_namespace(args.rate) if shaped else contextlib.nullcontext()) as ns:
                wrap = ns.wrap([]) if ns is not None else []
                accuracy_network = ns.describe() if ns is not None else "plain loopback (unshaped)"
                accuracy = []
                for seed in range(seeds):  # seed by seed: every compressor beside `none` of the same seed
                    for label in labels:
                        print(f"accuracy: {label}, seed {seed}, {args.workers} workers, {epochs} epoch(s) ...",
                              flush=True)
                        result = run_accuracy(label, epochs, Path(tmp), seed=seed, workers=args.workers, wrap=wrap,
                                              target=args.target)
                        print(f"  accuracy {result['accuracy']:.4f}, time to {args.target:.0%} "
                              f"{result['time_to_accuracy_s']}, {result['total_bytes'] / 1e9:.3f} GB sent, "
                              f"{result['seconds']:.0f} s", flush=True)
                        accuracy.append(result)
            drops, times = accuracy_figures(accuracy, labels, seeds)
            reference = statistics.fmean(r["accuracy"] for r in accuracy if r["variant"] == "none")
            headline.update(accuracy_drop_points={k: v["mean"] for k, v in drops.items()},
                            accuracy_drop_points_per_seed={k: v["per_seed"] for k, v in drops.items()},
                            accuracy_drop_points_min={k: v["min"] for k, v in drops.items()},
                            accuracy_drop_points_max={k: v["max"] for k, v in drops.items()},
                            time_to_accuracy_ratio={k: v["value"] if v else None for k, v in times.items()},
                            time_to_accuracy_ratio_per_round={k: v["per_round"] if v else None
                                                              for k, v in times.items()},
                            accuracy_none=reference, epochs=epochs, seeds=seeds, accuracy_workers=args.workers,
                            accuracy_network=accuracy_network, time_to_accuracy_target=args.target,
                            accuracy_target="<= 1.0 point (mean over seeds) for " + ", ".join(TARGETS),
                            accuracy_targets_met={t: drops[t]["mean"] <= 1.0 for t in TARGETS if t in drops})
            rows += [{"part": "accuracy", **row} for row in accuracy]
            plot = f"{name}_accuracy.png"
            from common import RESULTS

            RESULTS.mkdir(parents=True, exist_ok=True)
            plot_accuracy(accuracy, RESULTS / plot)
            def cell(label: str) -> list[Any]:
                mine = [r for r in accuracy if r["variant"] == label]
                drop = drops.get(label)
                tta = times.get(label)
                return [label, f"{statistics.fmean(r['accuracy'] for r in mine):.4f}",
                        "-" if drop is None else f"{drop['mean']:+.2f} ({drop['min']:+.2f} .. {drop['max']:+.2f})",
                        "-" if label == "none" else ("not reached" if tta is None else f"{tta['value']:.3f}"),
                        f"{mine[0]['bytes_per_step'] / 1e6:.3f}", f"{mine[0]['total_bytes'] / 1e9:.3f}",
                        f"{mine[0]['compression_ratio']:.1f}x",
                        statistics.median(r["samples_per_second"] for r in mine)]

            table = markdown_table(
                ["compressor", "test accuracy (mean)", "drop, points: mean (min .. max)",
                 f"time to {args.target:.0%} / none's", "MB sent per update", "GB sent in all", "ratio",
                 "samples/s"], [cell(label) for label in labels])
            sections.append(
                f"## Accuracy and time to accuracy\n\n`dtrain run examples/fashion_mnist/distributed.yaml` for "
                f"{epochs} epoch(s) with each compressor, {args.workers} workers, {seeds} seed(s), on "
                f"{accuracy_network}; drop = accuracy of `none` minus the compressor's with the same seed, in points, "
                f"mean over seeds (target <= 1.0 for {', '.join(TARGETS)}); time to accuracy: the median over seeds of "
                f"the compressor's training wall time to {args.target:.0%} over `none`'s with the same seed."
                f"\n\n{table}\n\n![accuracy vs bytes]({plot})")
    flags = "".join(f" {flag}" for flag, used in (("--quick", args.quick), ("--skip-speed", args.skip_speed),
                                                   ("--skip-accuracy", args.skip_accuracy)) if used)
    if args.per_rank_batch != PER_RANK_BATCH:
        flags += f" --per-rank-batch {args.per_rank_batch}"
    for flag, value in (("--epochs", args.epochs), ("--seeds", args.seeds), ("--results-name", args.results_name),
                        ("--compressors", ",".join(args.compressors) if args.compressors else None)):
        if value is not None:
            flags += f" {flag} '{value}'" if " " in str(value) else f" {flag} {value}"
    reproduce = f"flock /tmp/dtrain-bench.lock python benchmarks/compression.py{flags}"
    markdown = (f"# {name}\n\nGradient compression with 2 workers; see the docstring of `benchmarks/compression.py`."
                f"\n\n" + "\n\n".join(sections) + f"\n\nReproduce (as root): `{reproduce}`\n")
    path = write_results(name, headline, rows, markdown, machine_info(network))
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
