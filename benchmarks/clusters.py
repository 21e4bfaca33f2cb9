"""Uneven clusters, side by side in one run, paired round by round (A B, B A, ...):

- `hetero_speedup`: Fashion-MNIST on 2 workers, rank 1 at half speed (its process in a cgroup with half a core,
  benchmarks/cpu_quota.py; a sleep-based `faults.slow_rank` without root): samples/s of
  `distributed.heterogeneous: {split: auto}` over the even split (ideal 1.5, target >= 1.35), and the final
  accuracy gap in points (target within 0.5);
- `local_sgd_time_to_target_speedup`: the 2 x 2 emulated cluster (benchmarks/cluster.py, link capped by tbf),
  post-local SGD (H = 8 after a warm-up) against synchronous all-reduce: time to the synchronous run's final
  accuracy minus 0.5 points (target >= 1.5);
- `diloco_allreduce_reduction` / `diloco_accuracy_gap_points`: DiLoCo (H = 50, outer Nesterov lr 0.7 momentum
  0.9) against synchronous all-reduce, on the same cluster: averaging rounds against all-reduced updates (target
  >= 50x; DiLoCo validates on its own round boundaries, so every round counted is one its period causes), final
  accuracy gap (target within 1 point);
- `hierarchical_speedup`: a 32 MB all-reduce on the 2 x 2 cluster, hierarchical (dtrain.sync.hierarchical) over
  flat gloo (ideal 1.5, target >= 1.3), with `dtrain plan`'s prediction of both from the measured link.

    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/clusters.py            # ~25 min
    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/clusters.py --quick    # ~10 min, 1 round each
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
CONFIG = ROOT / "examples" / "fashion_mnist" / "distributed.yaml"
PORTS = iter(range(29700, 29800))


def log(message: str) -> None:
    print(f"[clusters {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def history_of(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"step": e["step"], "accuracy": e["metrics"]["accuracy"], "wall_seconds": e["wall_seconds"]}
            for e in summary["validation_history"]]


# ------------------------------------------------------------------------------------------ heterogeneous


def hetero(rounds: int, epochs: float, workdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from common import alternate, dtrain_run, rounds_of
    from cpu_quota import share_for_slowdown, slowed_rank, unavailable_reason

    real = unavailable_reason() is None
    batches = int(epochs * 60000 // 256)
    base = ["resources.slots_per_trial=2", f"searcher.max_length={{batches: {batches}}}",
            f"min_validation_period={{batches: {batches}}}", "min_checkpoint_period={batches: 0}",
            "checkpoint_policy=none", "reproducibility.experiment_seed=0", "hyperparameters.learning_rate=0.05"]
    if not real:
        base += ["faults.slow_rank=1", "faults.slow_factor=2"]

    def runner(label: str, extra: list[str]) -> Any:
        def run(repeat: int) -> dict[str, Any]:
            settings = [*base, *extra]
            run_dir = workdir / f"hetero-{label}-{repeat}"
            if real:
                with slowed_rank(1, share_for_slowdown(2.0, 2, 2)):
                    summary = dtrain_run(CONFIG, run_dir, settings, workdir)
            else:
                summary = dtrain_run(CONFIG, run_dir, settings, workdir)
            return {"samples_per_second": summary["samples_per_second"],
                    "final_accuracy": summary["validation"]["accuracy"],
                    "per_rank": summary.get("per_rank_batch_sizes")}
        return run

    rows = alternate([("even", runner("even", [])),
                      ("auto", runner("auto", ["distributed.heterogeneous={split: auto, calibrate_steps: 10, "
                                               "rebalance_every: 50}"]))], rounds, log)
    from common import paired_ratio

    speed = paired_ratio(rounds_of(rows, "auto", "samples_per_second"), rounds_of(rows, "even", "samples_per_second"))
    gaps = [100 * (a - e) for a, e in zip(rounds_of(rows, "auto", "final_accuracy"),
                                          rounds_of(rows, "even", "final_accuracy"), strict=True)]
    head = {"hetero_speedup": speed["value"], "hetero_speedup_per_round": speed["per_round"],
            "hetero_accuracy_gap_points": sorted(gaps)[len(gaps) // 2], "hetero_accuracy_gap_points_per_round": gaps,
            "hetero_straggler": "cgroup cpu quota: rank 1 at 0.5 core" if real else "sleep: faults.slow_factor 2"}
    return head, [{**r, "part": "hetero"} for r in rows]


# ------------------------------------------------------------------------------------- cluster training


def cluster_run(cluster: Any, settings: list[str], run_dir: Path) -> dict[str, Any]:
    """One 2 x 2 `dtrain run` on the emulated cluster; node 0's summary."""
    summary: dict[str, Any] = cluster.train(CONFIG, settings, run_dir, next(PORTS))
    return summary


DILOCO_PERIOD = 50


def cluster_training(rounds: int, epochs: float, rate: str, workdir: Path
                     ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from cluster import emulated_cluster
    from common import alternate, time_to

    per_epoch = 60000 // 256
    # a whole number of DiLoCo periods, so that its last round is a periodic one, not one forced by the end
    batches = max(int(epochs * per_epoch) // DILOCO_PERIOD, 1) * DILOCO_PERIOD
    validations = max(int(epochs * 4), 2)
    base = ["resources.slots_per_trial=4", "hyperparameters.hidden=512", f"searcher.max_length={{batches: {batches}}}",
            f"min_validation_period={{batches: {batches // validations}}}", "min_checkpoint_period={batches: 0}",
            "checkpoint_policy=none", "reproducibility.experiment_seed=0", f"scheduling_unit={batches // validations}",
            "hyperparameters.learning_rate=0.05"]
    # A validation is an averaging round for local SGD unless it falls on one; DiLoCo validates on its own round
    # boundaries, so that the all-reduces counted are the ones its period causes (4 validations per epoch at
    # other points would add rounds and cap the reduction below H).
    diloco_validation = max(batches // validations // DILOCO_PERIOD, 1) * DILOCO_PERIOD
    variants = {
        "sync": [],
        "post_local_h8": ["distributed.strategy=local_sgd", "distributed.local_sgd.period=8",
                          f"distributed.local_sgd.warmup_steps={per_epoch // 4}"],
        "diloco_h50": ["distributed.strategy=local_sgd", f"distributed.local_sgd.period={DILOCO_PERIOD}",
                       "distributed.local_sgd.outer_optimizer=nesterov",
                       f"min_validation_period={{batches: {diloco_validation}}}"],
    }
    rows: list[dict[str, Any]] = []
    with emulated_cluster(nodes=2, rate=rate) as cluster:
        def runner(label: str) -> Any:
            def run(repeat: int) -> dict[str, Any]:
                summary = cluster_run(cluster, [*base, *variants[label]], workdir / f"{label}-{repeat}")
                strategy = summary["strategy"]
                syncs = (strategy.get("averaging_rounds", 0) + strategy.get("synchronous_updates", 0)
                         if label != "sync" else summary["steps_completed"])
                return {"final_accuracy": summary["validation"]["accuracy"], "wall_s": summary["wall_seconds"],
                        "history": history_of(summary), "all_reduces": syncs}
            return run

        rows = alternate([(label, runner(label)) for label in variants], rounds, log)
    heads: dict[str, Any] = {}
    from common import rounds_of

    speedups, reductions, gaps = [], [], []
    for repeat in sorted({r["repeat"] for r in rows}):
        got = {r["variant"]: r for r in rows if r["repeat"] == repeat}
        target = got["sync"]["final_accuracy"] - 0.005
        sync_time, local_time = time_to(got["sync"]["history"], target), time_to(got["post_local_h8"]["history"],
                                                                                   target)
        speedups.append(sync_time / local_time if sync_time and local_time else 0.0)
        reductions.append(got["sync"]["all_reduces"] / max(got["diloco_h50"]["all_reduces"], 1))
        gaps.append(100 * (got["sync"]["final_accuracy"] - got["diloco_h50"]["final_accuracy"]))
    heads["local_sgd_time_to_target_speedup"] = sorted(speedups)[len(speedups) // 2]
    heads["local_sgd_time_to_target_speedup_per_round"] = speedups
    heads["post_local_final_accuracy_per_round"] = rounds_of(rows, "post_local_h8", "final_accuracy")
    heads["sync_final_accuracy_per_round"] = rounds_of(rows, "sync", "final_accuracy")
    heads["diloco_allreduce_reduction"] = sorted(reductions)[len(reductions) // 2]
    heads["diloco_accuracy_gap_points"] = sorted(gaps)[len(gaps) // 2]
    heads["diloco_accuracy_gap_points_per_round"] = gaps
    return heads, [{**r, "part": "cluster"} for r in rows]


# -------------------------------------------------------------------------------- hierarchical all-reduce

WORKER = """
import json, os, sys, time, torch, torch.distributed as dist
from dtrain.comm import init_distributed
from dtrain.comm.topology import node_groups
from dtrain.sync.hierarchical import hierarchical_allreduce_
megabytes, reps = float(sys.argv[1]), int(sys.argv[2])
topology = init_distributed(backend="gloo", timeout_seconds=600)
groups = node_groups(topology)
buffer = torch.ones(int(megabytes * 2**20 / 4))
local = torch.ones(int(megabytes * 2**20 / 4))
def flat():
    dist.all_reduce(buffer)
def hier():
    hierarchical_allreduce_(buffer, groups, topology.world_size).wait()
def intra():
    dist.all_reduce(local, group=groups.local)
rows = []
for kind, fn in [("flat", flat), ("hierarchical", hier)] * 1:
    fn()  # warm-up
for rep in range(reps):
    order = [("flat", flat), ("hierarchical", hier)]
    for kind, fn in (order if rep % 2 == 0 else order[::-1]):
        dist.barrier(); t = time.perf_counter(); fn(); dist.barrier(); rows.append((rep, kind, time.perf_counter() - t))
dist.barrier(); t = time.perf_counter(); intra(); dist.barrier(); intra_s = time.perf_counter() - t
if topology.rank == 0:
    print(json.dumps({"rows": rows, "intra_s": intra_s}))
"""


def hierarchical(reps: int, megabytes: float, rate: str, workdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from cluster import emulated_cluster, measure_link_mbit_per_s
    from common import paired_ratio

    from dtrain.plan.spec import StrategySpec, TopologySpec
    from dtrain.plan.step import collective_parts_s

    script = workdir / "allreduce_worker.py"
    script.write_text(WORKER)
    with emulated_cluster(nodes=2, rate=rate) as cluster:
        link_mbit = measure_link_mbit_per_s(cluster, 8)
        port = next(PORTS)
        processes = []
        for rank in range(4):
            node = rank // 2
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
                   "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(node), "MASTER_ADDR": cluster.master.address,
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
            processes.append(cluster.start(node, [sys.executable, str(script), str(megabytes), str(reps)], env=env,
                                           stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
        out, _ = processes[0].communicate(timeout=3600)
        for process in processes[1:]:
            process.wait(timeout=600)
    result = json.loads(out.strip().splitlines()[-1])
    flat = [s for _, kind, s in sorted(result["rows"]) if kind == "flat"]
    hier = [s for _, kind, s in sorted(result["rows"]) if kind == "hierarchical"]
    ratio = paired_ratio(flat, hier)
    size = megabytes * 2**20
    intra_bw = size / result["intra_s"]  # a 2-rank all-reduce moves S each way: S / t
    topology = TopologySpec(devices_per_node=2, intra_bandwidth_bytes_per_s=intra_bw,
                            inter_bandwidth_bytes_per_s=link_mbit * 1e6 / 8, source="measured tbf link")
    predicted = {name: sum(collective_parts_s(size, 4, topology, StrategySpec(algorithm=algorithm)).values())
                 for name, algorithm in (("flat", "ring"), ("hierarchical", "hierarchical"))}
    measured = {"flat": sorted(flat)[len(flat) // 2], "hierarchical": sorted(hier)[len(hier) // 2]}
    head = {"hierarchical_speedup": ratio["value"], "hierarchical_speedup_per_round": ratio["per_round"],
            "hierarchical_message_mb": megabytes, "link_mbit_per_s_measured": link_mbit,
            "flat_seconds": measured["flat"], "hierarchical_seconds": measured["hierarchical"],
            "plan_flat_seconds": predicted["flat"], "plan_hierarchical_seconds": predicted["hierarchical"],
            "plan_error_flat": predicted["flat"] / measured["flat"] - 1,
            "plan_error_hierarchical": predicted["hierarchical"] / measured["hierarchical"] - 1}
    rows = [{"part": "hierarchical", "repeat": rep, "variant": kind, "seconds": s} for rep, kind, s in result["rows"]]
    return head, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round of each, shorter training")
    parser.add_argument("--rate", default="200mbit", help="the inter-node link (tbf rate, default 200mbit)")
    parser.add_argument("--only", choices=["hetero", "cluster", "hierarchical"], action="append",
                        help="run only these parts (default: all)")
    args = parser.parse_args()
    from cluster import unavailable_reason

    parts = args.only or ["hetero", "cluster", "hierarchical"]
    rounds = 1 if args.quick else 2
    headline: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    reason = unavailable_reason()
    if reason is not None:
        headline["cluster_parts_skipped"] = reason
    with tempfile.TemporaryDirectory(prefix="dtrain-clusters-") as tmp:
        workdir = Path(tmp)
        jobs = [("hierarchical", reason is None,
                 lambda: hierarchical(4 if args.quick else 8, 32.0, args.rate, workdir)),
                ("hetero", True, lambda: hetero(rounds, 0.5 if args.quick else 1.0, workdir)),
                ("cluster", reason is None,
                 lambda: cluster_training(rounds, 1.0 if args.quick else 2.0, args.rate, workdir))]
        for name, possible, job in jobs:
            if name not in parts or not possible:
                continue
            try:
                head, part_rows = job()
            except Exception as exc:  # a failed part is reported; the parts measured so far are kept
                headline[f"{name}_failed"] = str(exc)[-500:]
                log(f"{name} failed: {exc}")
                continue
            headline.update(head)
            rows += part_rows
            log(f"{name}: {head}")
            _write(args, headline, rows)  # after every part: a later failure cannot lose what was measured
    _write(args, headline, rows)


def _write(args: argparse.Namespace, headline: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    from common import machine_info, markdown_table, write_results

    targets = [("hetero_speedup", ">= 1.35"), ("hetero_accuracy_gap_points", "within 0.5"),
               ("local_sgd_time_to_target_speedup", ">= 1.5"), ("diloco_allreduce_reduction", ">= 50"),
               ("diloco_accuracy_gap_points", "<= 1"), ("hierarchical_speedup", ">= 1.3"),
               ("plan_error_flat", "within 0.2"), ("plan_error_hierarchical", "within 0.2")]
    table = markdown_table(["figure", "value", "per round", "target"],
                           [(key, headline.get(key, "not run"), headline.get(f"{key}_per_round", ""), target)
                            for key, target in targets])
    markdown = f"# clusters\n\nUneven clusters (benchmarks/clusters.py; inter-node link tbf {args.rate}).\n\n{table}\n"
    path = write_results("clusters" if not args.quick else "clusters_quick", headline,
                         [{k: v for k, v in r.items() if k != "history"} for r in rows], markdown,
                         machine_info(f"2 network namespaces x 2 workers, veth tbf {args.rate}"))
    print(markdown)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
