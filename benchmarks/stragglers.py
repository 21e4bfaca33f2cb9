"""Stragglers: Fashion-MNIST on 3 workers, one of them 3x slower, under allreduce and the parameter-server modes.

Five variants (1 server unless stated), all with the demo CNN, global batch 192 (64 per worker), SGD with Nesterov
momentum and a one-cycle rate over the run, rank 2 made about 3x slower (`--straggler`): by default for real, its
process put in a cgroup whose CPU quota leaves it 2/7 of a core while the other two share the rest
(benchmarks/cpu_quota.py; root and the cgroup v1 cpu controller), else by `faults.slow_rank: 2` /
`faults.slow_factor: 3` (a sleep, whose freed CPU helps the others on a 2-core machine; the result says which):
allreduce sync, PS sync, PS sync with 1 backup worker, PS async, PS ssp (staleness 4). They run alternately
(A B C D E, E D C B A, ...). Reported: time to the target accuracy (training wall time from the start of the
loop, validations included, to the first validation at or above the target) and final accuracy; the headline
`speedup_to_88` is allreduce's time over the best of the non-waiting variants (backup, async, ssp), and
`async_accuracy_gap_points` is PS sync's final accuracy minus async's, in points. A second table runs PS sync
briefly with 1 and with 2 servers and shows the bytes each server receives and sends per step.

    flock /tmp/dtrain-bench.lock python benchmarks/stragglers.py            # 3 epochs, 1 round (~15 min)
    flock /tmp/dtrain-bench.lock python benchmarks/stragglers.py --quick    # 1 epoch, target 80%
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "fashion_mnist" / "distributed.yaml"
WORKERS, GLOBAL_BATCH, SLOW_RANK, SLOW_FACTOR = 3, 192, 2, 3

PS = ["distributed.strategy=parameter_server"]
VARIANTS: list[tuple[str, list[str]]] = [
    ("allreduce sync", []),
    ("PS sync", PS + ["distributed.parameter_server.mode=sync"]),
    ("PS sync, 1 backup worker", PS + ["distributed.parameter_server.mode=sync",
                                       "distributed.parameter_server.backup_workers=1"]),
    ("PS async", PS + ["distributed.parameter_server.mode=async"]),
    ("PS ssp (s=4)", PS + ["distributed.parameter_server.mode=ssp", "distributed.parameter_server.staleness=4"]),
]
NON_WAITING = ("PS sync, 1 backup worker", "PS async", "PS ssp (s=4)")


STRAGGLER = {"how": "sleep"}  # set by main(): "cgroup" or "sleep"


def run(overrides: list[str], run_dir: Path, epochs: float, validations_per_epoch: int, workdir: Path,
        straggler: bool = True) -> dict[str, Any]:
    """One `dtrain run` of the Fashion-MNIST example; the summary's figures."""
    batches_per_epoch = 60000 // GLOBAL_BATCH
    settings = [f"resources.slots_per_trial={WORKERS}", f"hyperparameters.global_batch_size={GLOBAL_BATCH}",
                f"searcher.max_length={{batches: {int(epochs * batches_per_epoch)}}}",
                f"min_validation_period={{batches: {batches_per_epoch // validations_per_epoch}}}",
                f"scheduling_unit={batches_per_epoch // validations_per_epoch}",
                "min_checkpoint_period={batches: 0}", "checkpoint_policy=none", *overrides]
    if straggler and STRAGGLER["how"] == "sleep":
        settings += [f"faults.slow_rank={SLOW_RANK}", f"faults.slow_factor={SLOW_FACTOR}"]
    from common import dtrain_run
    from cpu_quota import share_for_slowdown, slowed_rank

    began = time.perf_counter()
    if straggler and STRAGGLER["how"] == "cgroup":
        with slowed_rank(SLOW_RANK, share_for_slowdown(SLOW_FACTOR, WORKERS, 2)):
            summary = dtrain_run(CONFIG, run_dir, settings, workdir)
    else:
        summary = dtrain_run(CONFIG, run_dir, settings, workdir)
    history = [{"step": e["step"], "accuracy": e["metrics"]["accuracy"], "wall_seconds": e["wall_seconds"]}
               for e in summary["validation_history"]]
    return {"final_accuracy": history[-1]["accuracy"], "training_wall_s": summary["wall_seconds"],
            "process_wall_s": time.perf_counter() - began, "history": history, "strategy": summary["strategy"]}


def strategy_figures(strategy: dict[str, Any]) -> dict[str, Any]:
    if strategy.get("name") != "parameter_server":
        return {}
    return {"staleness_mean": strategy["staleness_mean"], "staleness_max": strategy["staleness_max"],
            "staleness_histogram": strategy["staleness_histogram"], "dropped_gradients": strategy["dropped_gradients"],
            "worker_wait_s": strategy["held_seconds_per_worker"],
            "bytes_pushed_per_step_per_server": [s["bytes_pushed_per_step"] for s in strategy["per_server"]],
            "bytes_pulled_per_step_per_server": [s["bytes_pulled_per_step"] for s in strategy["per_server"]]}


def plot(rows: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if row.get("table") != "stragglers" or row["repeat"] != 0:
            continue
        ax.plot([e["wall_seconds"] for e in row["history"]], [100 * e["accuracy"] for e in row["history"]],
                marker="o", markersize=3, label=row["variant"])
    ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(bottom=max(0, 100 * target - 25))
    ax.set_title(f"Fashion-MNIST, {WORKERS} workers, rank {SLOW_RANK} {SLOW_FACTOR}x slower")
    ax.grid(alpha=0.3)
    ax.legend()
    from common import save_figure

    save_figure(fig, path)  # also closes the figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 epoch, target 80%%, short bytes table")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the five variants (default 1)")
    parser.add_argument("--epochs", type=float, help="epochs per run (default 3; 1 with --quick)")
    parser.add_argument("--target", type=float, help="accuracy target (default 0.88; 0.80 with --quick)")
    parser.add_argument("--validations-per-epoch", type=int, default=6, help="default 6")
    parser.add_argument("--straggler", choices=("cgroup", "sleep"), default="cgroup",
                        help="how rank 2 is slowed: a CPU quota (default; falls back to the sleep without root) or "
                             "faults.slow_factor's sleep")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_quota import unavailable_reason

    fallback = unavailable_reason() if args.straggler == "cgroup" else None
    STRAGGLER["how"] = "sleep" if fallback else args.straggler
    straggler_note = (f"a CPU quota of {SLOW_FACTOR}x less than the others' share (cgroup v1 cpu controller)"
                      if STRAGGLER["how"] == "cgroup" else
                      "`faults.slow_factor` (a sleep)" + (f"; the CPU quota was not available: {fallback}"
                                                          if fallback else ""))
    print(f"straggler: rank {SLOW_RANK}, {straggler_note}", flush=True)
    from common import alternate, machine_info, markdown_table, median, time_to, write_results

    epochs = args.epochs or (1.0 if args.quick else 3.0)
    target = args.target or (0.80 if args.quick else 0.88)
    pct = f"{100 * target:g}%"
    with tempfile.TemporaryDirectory(prefix="dtrain-stragglers-") as tmp:
        workdir = Path(tmp)

        def runner(label: str, overrides: list[str]) -> Any:
            def go(repeat: int) -> dict[str, Any]:
                name = label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("=", "")
                try:
                    out = run(overrides, workdir / f"{name}-{repeat}", epochs, args.validations_per_epoch, workdir)
                except RuntimeError as exc:  # e.g. training diverged: a result too, not a reason to lose the others
                    return {"table": "stragglers", "time_to_target_s": None, "final_accuracy": float("nan"),
                            "failed": str(exc).strip().splitlines()[-1][:300], "history": []}
                return {"table": "stragglers", "time_to_target_s": time_to(out["history"], target),
                        "final_accuracy": out["final_accuracy"], "training_wall_s": out["training_wall_s"],
                        "process_wall_s": out["process_wall_s"], **strategy_figures(out["strategy"]),
                        "history": out["history"]}
            return go

        rows = alternate([(label, runner(label, overrides)) for label, overrides in VARIANTS], args.repeats)
        bytes_rows = []
        for servers in (1, 2):
            out = run(PS + [f"distributed.parameter_server.servers={servers}"], workdir / f"bytes-{servers}",
                      0.1 if args.quick else 0.25, 1, workdir, straggler=False)
            figures = strategy_figures(out["strategy"])
            bytes_rows.append({"table": "bytes", "variant": f"PS sync, {servers} server(s)", "servers": servers,
                               "shard_bytes": out["strategy"]["shard_bytes"], **figures})
            print(f"bytes, {servers} server(s): pushed/step {figures['bytes_pushed_per_step_per_server']}")

    def times(label: str) -> list[float]:
        return [r["time_to_target_s"] for r in rows if r["variant"] == label and r["time_to_target_s"] is not None]

    def reached(label: str) -> float | None:
        found = times(label)
        return median(found) if len(found) == args.repeats else None

    def final(label: str) -> float:
        return median([r["final_accuracy"] for r in rows if r["variant"] == label])

    baseline = reached("allreduce sync")
    candidates = {label: reached(label) for label in NON_WAITING if reached(label) is not None}
    best = min(candidates, key=lambda label: candidates[label]) if candidates else None  # type: ignore[arg-type,return-value]
    speedup = baseline / candidates[best] if baseline and best else None  # type: ignore[operator]
    gap = 100 * (final("PS sync") - final("PS async"))
    one, two = bytes_rows
    halving = [two_b / one["bytes_pushed_per_step_per_server"][0] for two_b in two["bytes_pushed_per_step_per_server"]]
    headline = {"speedup_to_88" if target == 0.88 else f"speedup_to_{100 * target:g}": speedup,
                "best_non_waiting_variant": best, "async_accuracy_gap_points": gap,
                "target_accuracy": target, "epochs": epochs,
                "time_to_target_s": {label: reached(label) for label, _ in VARIANTS},
                "final_accuracy": {label: final(label) for label, _ in VARIANTS},
                "bytes_per_server_2_over_1": halving, "straggler": STRAGGLER["how"],
                "straggler_note": straggler_note, "rounds": args.repeats,
                "targets": {"speedup_to_88": ">= 1.5", "async_accuracy_gap_points": "<= 1.5"}}
    table = markdown_table(
        ["variant", "repeat", f"time to {pct} (s)", "final accuracy", "training wall (s)", "staleness mean / max",
         "dropped gradients", "worker wait (s, per worker)"],
        [[r["variant"], r["repeat"], r["time_to_target_s"] if r["time_to_target_s"] is not None else "not reached",
          r["final_accuracy"] if "failed" not in r else f"failed: {r['failed']}", r.get("training_wall_s", "-"),
          f"{r['staleness_mean']:.2f} / {r['staleness_max']}" if "staleness_mean" in r else "-",
          r.get("dropped_gradients", "-"),
          ", ".join(f"{w:.1f}" for w in r["worker_wait_s"]) if "worker_wait_s" in r else "-"] for r in rows])
    bytes_table = markdown_table(
        ["servers", "shard bytes per server", "bytes pushed per step, per server", "bytes pulled per step, per server"],
        [[r["servers"], ", ".join(str(b) for b in r["shard_bytes"]),
          ", ".join(f"{b / 1e6:.3f} MB" for b in r["bytes_pushed_per_step_per_server"]),
          ", ".join(f"{b / 1e6:.3f} MB" for b in r["bytes_pulled_per_step_per_server"])] for r in bytes_rows])
    name = "stragglers_quick" if args.quick else "stragglers"
    speed = f"{speedup:.2f}x ({best})" if speedup else "not measurable (a variant missed the target)"
    markdown = (f"# {name}\n\nFashion-MNIST, {WORKERS} workers (global batch {GLOBAL_BATCH}), rank {SLOW_RANK} "
                f"{SLOW_FACTOR}x slower ({straggler_note}), 1 parameter server, {epochs:g} epochs, "
                f"{args.repeats} round(s) alternated.\n\n**speedup to {pct} of the best non-waiting variant over "
                f"allreduce sync: {speed}** (target >= 1.5); **async accuracy gap: {gap:.2f} points** below PS sync "
                f"(target <= 1.5).\n\n{table}\n\nTimes are training wall time from the start of the training loop "
                "to the first validation at or above the target (validations included). Worker wait is the time "
                "the servers held each worker's pushes for the others.\n\n![accuracy against wall time]"
                f"({name}.png)\n\n## Bytes per server per step, 1 and 2 servers (PS sync, no straggler)\n\n"
                f"{bytes_table}\n\nWith 2 servers each holds half the parameters (by bytes; the big dense layer is "
                "split), so each receives and sends half as much per step: 2-server/1-server ratio of bytes pushed "
                f"{', '.join(f'{h:.3f}' for h in halving)}. Bytes pulled include the consolidating pulls before "
                f"validations.\n\nReproduce: `flock /tmp/dtrain-bench.lock python benchmarks/stragglers.py"
                f"{' --quick' if args.quick else ''}`\n")
    path = write_results(name, headline, rows + bytes_rows, markdown, machine_info())
    plot(rows, target, path.with_suffix(".png"))
    print(f"{path}: speedup {speed}, async gap {gap:.2f} points, bytes 2/1 {halving}")


if __name__ == "__main__":
    main()
