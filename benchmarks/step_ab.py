"""Where does dtrain's training step lose time against a hand-written DDP step? A paired A/B inside one job.

One torchrun job of 2 workers builds, side by side, the demo's hand-written DDP loop (the one in
benchmarks/demo_vs_ddp.py: DataLoader + DistributedSampler, DDP with its defaults, SGD + Nesterov, OneCycleLR,
channels_last) and one or more dtrain Trainers on the same model and data (examples/fashion_mnist's Trial and
distributed.yaml). They take turns in blocks of `--block` training steps (A B C, C B A, ...), so that the
machine's load drifts over all of them alike; each block's wall time is measured between two barriers. The
figure for a variant is the median over rounds of its block time / the hand-written block time of the same
round (`<variant>_per_round` beside it).

Trainers run their real `_step` (batch stream, guard, timers, reports, metric rows, progress); validation and
checkpoints are left out (they are per-epoch costs, compared by demo_vs_ddp). Variants switch one dtrain piece
off or back to the hand-written loop's choice, to find what costs:

    trainer           dtrain as configured by the demo
    no-timers         profiling.phase_timers: false
    no-guard          the update guard's all-reduce and finiteness check replaced by "apply"
    no-report         no training report (scheduling_unit larger than the run)

    python benchmarks/step_ab.py                      # 12 rounds of 50-step blocks, trainer and hand only
    python benchmarks/step_ab.py --variants trainer no-guard no-timers
    python benchmarks/step_ab.py --quick              # 3 rounds of 20-step blocks
"""

from __future__ import annotations

import argparse
import json
import os
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

CONFIG = REPO / "examples" / "fashion_mnist" / "distributed.yaml"
VARIANTS = ("trainer", "no-timers", "no-guard", "no-report")
# Config overrides of each Trainer variant (all: no validation, no checkpoint inside the measured steps).
COMMON = ["min_validation_period={epochs: 1000}", "min_checkpoint_period={epochs: 1000}", "checkpoint_policy=none",
          "searcher.max_length={epochs: 40}"]
OVERRIDES = {"trainer": [], "no-timers": ["profiling.phase_timers=false"], "no-guard": [],
             "no-report": ["scheduling_unit=1000000"]}


class HandWritten:
    """The hand-written DDP loop of demo_vs_ddp, one step at a time."""

    def __init__(self, epochs: int) -> None:
        import torch
        import yaml
        from model_def import build_cnn  # type: ignore[attr-defined]
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader, TensorDataset
        from torch.utils.data.distributed import DistributedSampler

        from dtrain.data import load_fashion_mnist

        hp = yaml.safe_load(CONFIG.read_text())["hyperparameters"]
        torch.manual_seed(0)
        images, labels = load_fashion_mnist("train").tensors
        self.sampler: DistributedSampler[Any] = DistributedSampler(TensorDataset(images, labels), shuffle=True,
                                                                    seed=0, drop_last=True)
        self.loader = DataLoader(TensorDataset(images, labels), batch_size=hp["global_batch_size"] // 2,
                                 sampler=self.sampler, drop_last=True)
        self.layout = torch.channels_last
        self.model = DistributedDataParallel(build_cnn().to(memory_format=self.layout))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=hp["learning_rate"], momentum=hp["momentum"],
                                         nesterov=True, weight_decay=hp["weight_decay"])
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, max_lr=hp["learning_rate"],
                                                             total_steps=len(self.loader) * epochs,
                                                             pct_start=hp["warmup_fraction"])
        self.batches = self._batches()

    def _batches(self) -> Any:
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def steps(self, count: int) -> None:
        import torch.nn.functional as F

        self.model.train()
        for _ in range(count):
            images, labels = next(self.batches)
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(images.contiguous(memory_format=self.layout)), labels).backward()
            self.optimizer.step()
            self.scheduler.step()


def build_trainer(variant: str, scratch: Path, topology: Any) -> Any:
    """A dtrain Trainer of the demo with `variant`'s changes, ready to step."""
    from model_def import FashionMNISTTrial  # type: ignore[attr-defined]

    from dtrain.comm import barrier, read_launch_env
    from dtrain.config import load_config
    from dtrain.runs.rundir import load_run_info, prepare_run_dir
    from dtrain.train.guard import Verdict
    from dtrain.train.trainer import Trainer

    config = load_config(CONFIG, [*COMMON, *OVERRIDES[variant]]).config
    run_dir = scratch / variant
    if read_launch_env().local_rank == 0:
        prepare_run_dir(config, run_dir, CONFIG.parent, register=True)
    barrier()
    trainer = Trainer(config=config, trial_class=FashionMNISTTrial, topology=topology,
                      run_info=load_run_info(run_dir))
    if variant == "no-guard":
        trainer.guard.decide = lambda step, parameters, overflow=None: Verdict(apply=True, stop=False)  # type: ignore[method-assign]
    trainer.clock.start(trainer.state)
    return trainer


def worker(args: argparse.Namespace) -> None:
    """Runs in each torchrun process: build every variant, then time them in turns."""
    import torch
    import torch.distributed as dist

    from dtrain.comm import init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    topology = init_distributed(backend="gloo")
    hand = HandWritten(epochs=40)
    runners: list[tuple[str, Callable[[int], None]]] = [("hand", hand.steps)]
    for variant in args.variants:
        trainer = build_trainer(variant, args.scratch, topology)

        def steps(count: int, trainer: Any = trainer) -> None:
            for _ in range(count):
                trainer._step()

        runners.append((variant, steps))
    for _, run in runners:  # warm-up: caches, buckets, allocator
        run(args.block)
    rows = []
    for repeat in range(args.rounds):
        for label, run in (runners if repeat % 2 == 0 else list(reversed(runners))):
            dist.barrier()
            began, cpu = time.perf_counter(), time.process_time()
            run(args.block)
            cpu = time.process_time() - cpu
            dist.barrier()
            wall = time.perf_counter() - began
            cpus = [0.0] * dist.get_world_size()
            dist.all_gather_object(cpus, cpu)
            rows.append({"variant": label, "repeat": repeat, "ms_per_step": wall / args.block * 1e3,
                         **{f"cpu_ms_per_step_rank{r}": c / args.block * 1e3 for r, c in enumerate(cpus)}})
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 20-step blocks")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of all variants (default 12)")
    parser.add_argument("--block", type=int, default=50, help="training steps per block (default 50)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["trainer"],
                        help="dtrain variants beside the hand-written loop (default: trainer)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.block = 3, 20
    if args.worker:
        worker(args)
        return
    from common import machine_info, markdown_table, ratio_headline, rounds_of, write_results

    with tempfile.TemporaryDirectory(prefix="step_ab-") as tmp:
        scratch = Path(tmp)
        out = scratch / "rows.json"
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
             "--worker", "--out", str(out), "--scratch", str(scratch), "--rounds", str(args.rounds),
             "--block", str(args.block), "--variants", *args.variants],
            capture_output=True, text=True, env={**os.environ, "DTRAIN_RUNS_ROOT": str(scratch / "runs"),
                                                 "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            raise SystemExit(f"step_ab workers failed: {result.stderr[-3000:]}")
        rows = json.loads(out.read_text())
    headline: dict[str, Any] = {"rounds": args.rounds, "block_steps": args.block}
    hand = rounds_of(rows, "hand", "ms_per_step")
    lines = []
    for variant in args.variants:
        key = f"{variant.replace('-', '_')}_ratio"
        headline.update(ratio_headline(key, rounds_of(rows, variant, "ms_per_step"), hand))
        for rank in (0, 1):
            cpu = f"cpu_ms_per_step_rank{rank}"
            headline.update(ratio_headline(f"{variant.replace('-', '_')}_cpu_rank{rank}_ratio",
                                           rounds_of(rows, variant, cpu), rounds_of(rows, "hand", cpu)))
        cpu0, cpu1 = (headline[f"{key[:-6]}_cpu_rank{rank}_ratio"] for rank in (0, 1))
        lines.append(f"- {variant} / hand-written: **{headline[key]:.3f}** (per round "
                     + ", ".join(f"{v:.3f}" for v in headline[f"{key}_per_round"])
                     + f"); CPU time per step, rank 0 {cpu0:.3f}, rank 1 {cpu1:.3f}")
    table = markdown_table(["variant", "round", "ms per step", "CPU ms per step, rank 0", "CPU ms per step, rank 1"],
                           [[r["variant"], r["repeat"], r["ms_per_step"], r["cpu_ms_per_step_rank0"],
                             r["cpu_ms_per_step_rank1"]] for r in rows])
    markdown = (f"# step_ab\n\nTraining-step time of dtrain's Trainer against the demo's hand-written DDP loop, in one "
                f"2-worker job, blocks of {args.block} steps alternated over {args.rounds} rounds (median of "
                "ratios paired within a round):\n\n" + "\n".join(lines) + f"\n\n{table}\n\nReproduce: "
                f"`python benchmarks/step_ab.py --rounds {args.rounds} --block {args.block} --variants "
                f"{' '.join(args.variants)}`\n")
    path = write_results("step_ab", headline, rows, markdown, machine_info())
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
