"""Does the framework cost anything? The demo through dtrain against a plain hand-written torch DDP loop.

Both train the demo's CNN with the demo's schedule (examples/fashion_mnist/distributed.yaml: 2 workers,
global batch 256, SGD + Nesterov, one-cycle over 8 epochs, validation every epoch, a checkpoint every 2
epochs) and are run alternately (A B C C B A ...) in one session, after one untimed warm-up run of each.
The figure is the training wall time until the first validation at or above the target accuracy (91%),
measured by each from the start of its training loop.

The demo config turns on `optimizations.memory_format: channels_last`, and dtrain's launcher starts its workers
with glibc malloc settings that keep freed memory for the next step (`optimizations.malloc_trim_threshold_mb`).
So that both sides get the same settings, the hand-written loop runs twice per round: with channels_last (model
and image batches laid out NHWC, as dtrain does) and the same malloc variables, and as usually written (PyTorch's
default contiguous layout, glibc's defaults). The headline `framework_only_ratio` is dtrain / hand-written with
the same settings, the framework's own cost; `default_config_ratio` is the demo as
shipped against a DDP loop as usually written (contiguous). Each ratio is the median of the ratios paired
within a round (`*_per_round` beside it), not a ratio of medians, so drift in the machine's load between
rounds cancels.

The hand-written loop is what a DDP user writes today: TensorDataset + DistributedSampler + DataLoader,
DDP with its defaults, OneCycleLR, evaluation sharded over the ranks with an all-reduce of the counts,
torch.save of model and optimizer on rank 0.

    python benchmarks/demo_vs_ddp.py            # 3 rounds of 3 variants, about 25 minutes
    python benchmarks/demo_vs_ddp.py --quick    # 1 round of 3-epoch runs, target 88%

On a shared machine the rounds can be run in pieces, each under its own benchmark lock, so that others can
benchmark in between: `--workdir DIR --rounds-now 1` runs one more round and keeps its rows in DIR; the call that
completes `--repeats` rounds writes the results. Every piece must measure the same commit. With --workdir each round's
rows are kept as soon as it ends, so a run that stops part-way continues from its next round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples" / "fashion_mnist"))

CONFIG = REPO / "examples" / "fashion_mnist" / "distributed.yaml"


# ------------------------------------------------------------------------------ the hand-written loop


def hand_written_worker(epochs: int, out: Path, checkpoint_dir: Path, channels_last: bool) -> None:
    """Runs in each torchrun process: the plain DDP training loop."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import yaml
    from model_def import build_cnn  # type: ignore[attr-defined]  # examples/fashion_mnist's, not diagnose's
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from dtrain.data import load_fashion_mnist

    hp = yaml.safe_load(CONFIG.read_text())["hyperparameters"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    train_images, train_labels = load_fashion_mnist("train").tensors
    test_images, test_labels = load_fashion_mnist("test").tensors
    per_rank = hp["global_batch_size"] // world
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        TensorDataset(train_images, train_labels), shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(train_images, train_labels), batch_size=per_rank, sampler=sampler,
                        drop_last=True)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = DistributedDataParallel(build_cnn().to(memory_format=layout))
    optimizer = torch.optim.SGD(model.parameters(), lr=hp["learning_rate"], momentum=hp["momentum"], nesterov=True,
                                weight_decay=hp["weight_decay"])
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=hp["learning_rate"],
                                                    total_steps=len(loader) * epochs,
                                                    pct_start=hp["warmup_fraction"])
    history = []
    start = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(images.contiguous(memory_format=layout)), labels).backward()
            optimizer.step()
            scheduler.step()
        model.eval()
        shard = len(test_images) // world
        counts = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for first in range(rank * shard, (rank + 1) * shard, per_rank):
                last = min(first + per_rank, (rank + 1) * shard)
                logits = model.module(test_images[first:last].contiguous(memory_format=layout))
                counts += torch.tensor([(logits.argmax(1) == test_labels[first:last]).sum().item(), last - first])
        dist.all_reduce(counts)
        history.append({"epoch": epoch + 1, "accuracy": float(counts[0] / counts[1]),
                        "wall_seconds": time.perf_counter() - start})
        if rank == 0 and (epoch + 1) % 2 == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       checkpoint_dir / f"epoch-{epoch + 1}.pt")
    if rank == 0:
        out.write_text(json.dumps(history))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ the two variants


def run_dtrain(epochs: int, target: float, workdir: Path, repeat: int, memory_format: str | None = None
               ) -> dict[str, Any]:
    run_dir = workdir / f"dtrain-{memory_format or 'demo'}-{repeat}"
    began = time.perf_counter()
    settings = [f"searcher.max_length={{epochs: {epochs}}}"]
    if memory_format:
        settings += [f"optimizations.memory_format={memory_format}"]
    from common import dtrain_run, time_to

    summary = dtrain_run(CONFIG, run_dir, settings, workdir)
    history = [{"epoch": e["epoch"], "accuracy": e["metrics"]["accuracy"], "wall_seconds": e["wall_seconds"]}
               for e in summary["validation_history"]]
    return {"time_to_target_s": time_to(history, target), "final_accuracy": history[-1]["accuracy"],
            "training_wall_s": summary["wall_seconds"], "process_wall_s": time.perf_counter() - began,
            "history": history, "phase_median_ms": phase_medians(summary)}


def phase_medians(summary: dict[str, Any]) -> list[dict[str, float]]:
    """Each rank's median milliseconds per step of every phase that ran (the run's own phase timers; `optimizer`
    holds the update guard's exchange of per-rank flags), so that a gap can be traced to a phase."""
    return [{name: round(seconds * 1e3, 3) for name, seconds in rank.get("median_seconds", {}).items() if seconds > 0}
            for rank in summary.get("profile", {}).get("ranks", [])]


def hand_malloc_environment(same_as_dtrain: bool) -> dict[str, str]:
    """The malloc variables dtrain's launcher gives its workers for the demo config, for the hand-written loop that
    gets dtrain's settings (the channels_last one); the contiguous loop runs as usually written, with glibc's
    defaults."""
    from dtrain.config import load_config
    from dtrain.launch import malloc_environment

    trim_mb = load_config(CONFIG).config.optimizations.malloc_trim_threshold_mb
    return malloc_environment(trim_mb) if same_as_dtrain else {}


def run_hand_written(epochs: int, target: float, workdir: Path, repeat: int, channels_last: bool) -> dict[str, Any]:
    from common import time_to

    layout = "channels_last" if channels_last else "contiguous"
    out = workdir / f"hand-{layout}-{repeat}.json"
    checkpoints = workdir / f"hand-{layout}-{repeat}-ckpt"
    checkpoints.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             __file__, "--worker", "--epochs", str(epochs), "--out", str(out),
                             "--checkpoint-dir", str(checkpoints), *(["--channels-last"] if channels_last else [])],
                            capture_output=True, text=True,
                            env={**os.environ, **hand_malloc_environment(channels_last)})
    if result.returncode != 0:
        raise RuntimeError(f"hand-written DDP failed: {result.stderr[-2000:]}")
    history = json.loads(out.read_text())
    return {"time_to_target_s": time_to(history, target), "final_accuracy": history[-1]["accuracy"],
            "training_wall_s": history[-1]["wall_seconds"], "process_wall_s": time.perf_counter() - began,
            "history": history}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one pair of 3-epoch runs, target 88%%")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three variants (default 3)")
    parser.add_argument("--epochs", type=int, help="epochs per run (default: the demo's 8; 3 with --quick)")
    parser.add_argument("--target", type=float, help="accuracy target (default 0.91; 0.88 with --quick)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    parser.add_argument("--workdir", type=Path, help="keep the rows of finished rounds here, to run in pieces")
    parser.add_argument("--rounds-now", type=int,
                        help="with --workdir: run at most this many more rounds now (default: all that remain)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--channels-last", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds_now is not None and args.workdir is None:
        parser.error("--rounds-now keeps the finished rounds for a later call: give --workdir DIR as well")
    epochs = args.epochs or (3 if args.quick else 8)
    if args.worker:
        hand_written_worker(epochs, args.out, args.checkpoint_dir, args.channels_last)
        return
    from common import (
        KeptRounds,
        alternate,
        machine_info,
        markdown_table,
        median,
        ratio_headline,
        rounds_of,
        write_results,
    )

    target = args.target or (0.88 if args.quick else 0.91)
    repeats = 1 if args.quick else args.repeats
    labels = ("dtrain", "hand-written DDP, channels_last, dtrain's malloc", "hand-written DDP, contiguous")
    kept = KeptRounds(args.workdir, {"epochs": epochs, "target": target})
    first = kept.rounds
    now = min(repeats - first, args.rounds_now if args.rounds_now is not None else repeats)
    with tempfile.TemporaryDirectory(prefix="demo_vs_ddp-") as tmp:
        workdir = Path(tmp)
        variants = [(labels[0], lambda r: run_dtrain(epochs, target, workdir, r)),
                    (labels[1], lambda r: run_hand_written(epochs, target, workdir, r, channels_last=True)),
                    (labels[2], lambda r: run_hand_written(epochs, target, workdir, r, channels_last=False))]
        if not args.no_warmup and now > 0:
            print("warm-up (untimed): one epoch of each")
            run_dtrain(1, 0.0, workdir, -1)
            run_hand_written(1, 0.0, workdir, -1, channels_last=True)
        alternate(variants, now, first=first, on_round=kept.add)
    rows = kept.rows
    if kept.rounds < repeats:
        print(f"{kept.rounds} of {repeats} rounds done; run again with --workdir {args.workdir}")
        return
    reached = all(r["time_to_target_s"] is not None for r in rows)
    pct = f"{target:.0%}"
    headline: dict[str, Any] = {"target_accuracy": target, "epochs": epochs, "repeats": repeats,
                                "framework_only_ratio": None, "default_config_ratio": None,
                                "malloc_environment": hand_malloc_environment(True)}
    if reached:
        ours = rounds_of(rows, labels[0], "time_to_target_s")
        headline.update(ratio_headline("framework_only_ratio", ours, rounds_of(rows, labels[1], "time_to_target_s")))
        headline.update(ratio_headline("default_config_ratio", ours, rounds_of(rows, labels[2], "time_to_target_s")))
        headline["dtrain_time_to_target_s"] = median(ours)
    headline["dtrain_final_accuracy"] = median([r["final_accuracy"] for r in rows if r["variant"] == labels[0]])
    table = markdown_table(
        ["variant", "repeat", f"time to {pct} (s)", "final accuracy", "training wall (s)", "process wall (s)"],
        [[r["variant"], r["repeat"], r["time_to_target_s"] if r["time_to_target_s"] is not None else "not reached",
          r["final_accuracy"], r["training_wall_s"], r["process_wall_s"]] for r in rows])

    def described(key: str) -> str:
        if headline[key] is None:
            return "n/a (target not reached)"
        rounds = ", ".join(f"{v:.3f}" for v in headline[f"{key}_per_round"])
        return f"{headline[key]:.3f} (per round {rounds})"

    markdown = (f"# demo_vs_ddp\n\nThe Fashion-MNIST demo ({epochs} epochs, 2 workers) through dtrain and through a "
                f"hand-written DDP loop, alternated in one session.\n\n**time to {pct}, dtrain / hand-written with "
                f"the same settings (channels_last, dtrain's malloc variables "
                f"{hand_malloc_environment(True) or 'none'}): "
                f"{described('framework_only_ratio')}** (target <= 1.00); the demo as shipped / a hand-written loop "
                f"as usually written (contiguous layout, glibc's malloc defaults): "
                f"{described('default_config_ratio')}. Each is the median of ratios paired within a round.\n\n"
                f"{table}\n\nTimes are training wall time from the start of each training loop (after process "
                "start and data loading) to the first validation at or above the target; both include their "
                "validations and checkpoints.\n\nReproduce: "
                f"`python benchmarks/demo_vs_ddp.py{' --quick' if args.quick else ''}`\n")
    path = write_results("demo_vs_ddp", headline, rows, markdown, machine_info())
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
