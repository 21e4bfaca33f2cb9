"""Does a Horovod script lose speed on dtrain? The synthetic-data benchmark of tests/horovod_scripts, unchanged
under `dtrain horovodrun -np 2`, against the same model and batches in a plain DDP loop under torchrun and as a
dtrain Trial under `dtrain run`, 2 workers each, alternated round by round (A B C, C B A, ...).

Each side trains the script's convnet on random 64x64 images, 32 per worker per step, one thread per worker,
SGD: the script and the DDP loop time `--iters` iterations of `--batches-per-iter` steps after `--warmup`
steps and report images/s per worker; `dtrain run` reports its summary's samples/s over the same number of
steps (warm-up included: it has no separate warm-up, so it is reported, not the headline).

Headline `img_per_sec_ratio_vs_ddp`: horovodrun / DDP, the median of the ratios paired within each round, with
`img_per_sec_ratio_vs_ddp_per_round` beside it (target >= 0.97). Real Horovod 0.28.1 does not build against
torch 2.13 here (docs/horovod.md), so it is not a variant.

`--baseline-tree DIR` adds a fourth variant, run beside horovodrun in each round: the same horovodrun with another
checkout of dtrain first on PYTHONPATH (for the negotiation by name, the order-matched code it replaced). Its
headline `negotiation_img_per_sec_ratio` is this tree's horovodrun / the baseline's, median of paired rounds
(target >= 0.97: the negotiation costs at most 3 %), with the baseline's commit beside it.

    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_compat.py            # 5 rounds, ~5 min
    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_compat.py --quick    # 2 short rounds
    git worktree add /tmp/baseline <commit>; flock /tmp/dtrain-bench.lock .venv/bin/python \
        benchmarks/horovod_compat.py --baseline-tree /tmp/baseline --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "horovod"))
SCRIPT = REPO / "tests" / "horovod_scripts" / "synthetic_benchmark.py"
CONFIG = REPO / "benchmarks" / "horovod" / "synthetic.yaml"
BATCH, IMAGE = 32, 64


def ddp_worker(args: argparse.Namespace) -> None:
    """One torchrun process: the script's model and steps in a plain DDP loop, timed the script's way."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from scripts import load_script
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DistributedDataParallel(load_script("synthetic_benchmark").convnet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * dist.get_world_size())
    data = torch.randn(BATCH, 3, IMAGE, IMAGE)
    target = torch.LongTensor(BATCH).random_() % 1000

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    timeit.timeit(step, number=args.warmup)
    rates = [BATCH * args.batches_per_iter / timeit.timeit(step, number=args.batches_per_iter)
             for _ in range(args.iters)]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"img_sec_per_worker": sum(rates) / len(rates), "iterations": rates}))
    dist.destroy_process_group()


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}


def run_horovodrun(args: argparse.Namespace, workdir: Path, repeat: int, tree: Path = REPO) -> dict[str, Any]:
    """The script under `dtrain horovodrun -np 2`, with the dtrain of `tree` (this checkout by default)."""
    out = workdir / f"horovodrun-{tree.name}-{repeat}.json"
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "horovodrun", "-np", "2", "python", str(SCRIPT),
                           "--batch-size", str(BATCH), "--image-size", str(IMAGE), "--num-warmup-batches",
                           str(args.warmup), "--num-batches-per-iter", str(args.batches_per_iter), "--num-iters",
                           str(args.iters), "--results", str(out)], capture_output=True, text=True,
                          env={**env(), "PYTHONPATH": str(tree)}, cwd=workdir)
    if done.returncode != 0:
        raise RuntimeError(f"dtrain horovodrun failed: {done.stderr[-2000:]}")
    return {"img_sec_per_worker": json.loads(out.read_text())["img_sec_per_worker"]}


def run_ddp(args: argparse.Namespace, workdir: Path, repeat: int) -> dict[str, Any]:
    out = workdir / f"ddp-{repeat}.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, "--ddp-worker", "--warmup", str(args.warmup), "--batches-per-iter",
                           str(args.batches_per_iter), "--iters", str(args.iters), "--out", str(out)],
                          capture_output=True, text=True, env={**env(), "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"DDP under torchrun failed: {done.stderr[-2000:]}")
    return {"img_sec_per_worker": json.loads(out.read_text())["img_sec_per_worker"]}


def run_dtrain(args: argparse.Namespace, workdir: Path, repeat: int) -> dict[str, Any]:
    from common import dtrain_run

    steps = args.warmup + args.iters * args.batches_per_iter
    summary = dtrain_run(CONFIG, workdir / f"dtrain-{repeat}", [
        f"hyperparameters.global_batch_size={2 * BATCH}", f"hyperparameters.image_size={IMAGE}",
        f"searcher.max_length={{batches: {steps}}}"], workdir)
    return {"img_sec_per_worker": float(summary["samples_per_second"]) / 2}


def retried(run: Any, args: argparse.Namespace, workdir: Path, repeat: int) -> dict[str, Any]:
    """One variant's run; a crash (seen here once per few dozen runs: SIGABRT in gloo's teardown after the
    figures were taken, on the DDP side as well as dtrain's) is retried once and counted in the row."""
    try:
        return {**run(args, workdir, repeat), "attempts": 1}
    except RuntimeError as error:
        print(f"  failed, retrying once: {str(error).strip().splitlines()[-1][:200]}", flush=True)
        return {**run(args, workdir, repeat), "attempts": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of short runs (a check, not a result)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of the three variants (default 5)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--batches-per-iter", type=int, default=5, help="steps per timed iteration (default 5)")
    parser.add_argument("--iters", type=int, default=6, help="timed iterations (default 6)")
    parser.add_argument("--baseline-tree", type=Path, help="another dtrain checkout run as a fourth variant, "
                        "beside horovodrun (headline negotiation_img_per_sec_ratio)")
    parser.add_argument("--no-dtrain-run", action="store_true", help="leave out the dtrain run variant (a shorter "
                        "run; its ratio is then absent)")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        ddp_worker(args)
        return
    if args.quick:
        args.rounds, args.warmup, args.batches_per_iter, args.iters = 2, 2, 2, 3
    from common import alternate, git_commit, machine_info, markdown_table, ratio_headline, rounds_of, write_results

    labels = ("dtrain horovodrun (Horovod script)", "DDP under torchrun", "dtrain run (Trial)",
              "dtrain horovodrun, baseline tree")
    baseline = args.baseline_tree.resolve() if args.baseline_tree else None
    with tempfile.TemporaryDirectory(prefix="horovod_compat-") as tmp:
        workdir = Path(tmp)
        variants = [(labels[0], lambda r: retried(run_horovodrun, args, workdir, r))]
        if baseline is not None:
            tree: Path = baseline

            def run_baseline(args: argparse.Namespace, workdir: Path, repeat: int) -> dict[str, Any]:
                return run_horovodrun(args, workdir, repeat, tree)

            variants.append((labels[3], lambda r: retried(run_baseline, args, workdir, r)))
        variants.append((labels[1], lambda r: retried(run_ddp, args, workdir, r)))
        if not args.no_dtrain_run:
            variants.append((labels[2], lambda r: retried(run_dtrain, args, workdir, r)))
        rows = alternate(variants, args.rounds)
    ours = rounds_of(rows, labels[0], "img_sec_per_worker")
    negotiation: dict[str, Any] = {}
    if baseline is not None:
        negotiation = {**ratio_headline("negotiation_img_per_sec_ratio", ours,
                                        rounds_of(rows, labels[3], "img_sec_per_worker")),
                       "negotiation_target": "negotiation_img_per_sec_ratio >= 0.97",
                       "baseline_commit": git_commit(baseline)}
    headline: dict[str, Any] = {
        **ratio_headline("img_per_sec_ratio_vs_ddp", ours, rounds_of(rows, labels[1], "img_sec_per_worker")),
        **({} if args.no_dtrain_run else ratio_headline("img_per_sec_ratio_vs_dtrain_run", ours, rounds_of(
            rows, labels[2], "img_sec_per_worker"))),
        "target": "img_per_sec_ratio_vs_ddp >= 0.97", "workers": 2, "batch_per_worker": BATCH,
        "image_size": IMAGE, "rounds": args.rounds,
        "real_horovod": "does not build against torch 2.13 (docs/horovod.md)",
        "retried_runs": sum(1 for r in rows if r["attempts"] > 1), **negotiation}
    per_round = ", ".join(f"{v:.3f}" for v in headline["img_per_sec_ratio_vs_ddp_per_round"])
    markdown = "\n\n".join([
        "# horovod_compat",
        f"The synthetic benchmark of tests/horovod_scripts under `dtrain horovodrun -np 2`, against the same model "
        f"in a plain DDP loop under torchrun and as a Trial under `dtrain run`; {args.rounds} alternated rounds, "
        f"{BATCH} images of {IMAGE}x{IMAGE} per worker per step, one thread per worker.",
        f"**img/s per worker, horovodrun / DDP: {headline['img_per_sec_ratio_vs_ddp']:.3f}** (median of paired "
        f"rounds: {per_round}; target >= 0.97)" + ("" if args.no_dtrain_run else
                                                   f"; horovodrun / dtrain run: "
                                                   f"{headline['img_per_sec_ratio_vs_dtrain_run']:.3f} (dtrain run's "
                                                   "figure includes its warm-up steps)") + ".",
        *([f"**horovodrun / the same under the baseline tree ({str(negotiation['baseline_commit']['commit'])[:7]}): "
           f"{negotiation['negotiation_img_per_sec_ratio']:.3f}** (median of paired rounds: "
           + ", ".join(f"{v:.3f}" for v in negotiation["negotiation_img_per_sec_ratio_per_round"])
           + "; target >= 0.97)"] if negotiation else []),
        markdown_table(["variant", "round", "img/s per worker"],
                       [[r["variant"], r["repeat"], r["img_sec_per_worker"]] for r in rows]),
        f"Reproduce: `flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/horovod_compat.py"
        f"{' --quick' if args.quick else ''}"
        f"{' --baseline-tree <checkout of the baseline commit>' if baseline else ''}"
        f"{' --no-dtrain-run' if args.no_dtrain_run else ''} --rounds {args.rounds}`"])
    path = write_results("horovod_compat_quick" if args.quick else "horovod_compat", headline, rows, markdown,
                         machine_info())
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
