"""Adaptive ASHA against random search (and Optuna's TPE + Hyperband) on Fashion-MNIST: how much training ASHA saves
and how close its best trial comes.

Three searches of the same space (learning rate (log), momentum, width, weight decay) for the MLP of
benchmarks/search_mlp.py, each `dtrain run` of one experiment file on 2 slots, trials of 1 slot, 2 at once:

- `random`: 16 trials, each trained for 4 epochs;
- `adaptive_asha`: 16 trials, max_time 4 epochs counted in batches (`time_metric: batches`), divisor 4, Determined's
  defaults otherwise (mode standard, max_rungs 5): brackets of 3 and 2 rungs;
- `optuna` with `sampler: tpe`, `pruner: hyperband`: 16 trials, the same max_time and divisor.

Random search and ASHA use the same seed, so they draw the same 16 hyperparameter sets; the comparison is about the
stopping, not the luck of the draw. An "epoch" here is `--records-per-epoch` records (a part of Fashion-MNIST's
60,000, to keep the run short on a shared 2-core machine); validation uses the whole 10,000-image test set, every
1/16 of max_time (ASHA's first rung). Batches are counted exactly from each trial's summary.

Headline: `asha_budget_fraction` = ASHA's training batches / random's (target <= 0.40);
`asha_best_gap_points` = (random's best accuracy - ASHA's best) in percentage points (target <= 0.5);
the same two figures for TPE + Hyperband.

`--threads-ab` measures instead how the compute threads of a search's concurrent trials affect its time: one search
(adaptive ASHA by default) run twice per round, order alternating, "before" with OMP_NUM_THREADS exported as the
old rule set it (cores // a trial's slots, whatever the trials running beside it: 2 threads per worker, 2 workers at
once on 2 cores) and "after" with none exported (dtrain shares the cores among all the trials at once). A sampler
reads OMP_NUM_THREADS from every running worker's /proc environment, to show each variant ran as it says.
Headline: `threads_after_over_before` = wall seconds after / before (median of paired rounds; target <= 1.0) and
whether both variants drew the same hyperparameters and found the same best trial.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, machine_info, markdown_table, ratio_headline, rounds_of, save_figure, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
BATCH = 128


def experiment(name: str, searcher: dict[str, Any], records_per_epoch: int, validate_every: int) -> dict[str, Any]:
    return {
        "name": name,
        "entrypoint": f"{HERE / 'search_mlp.py'}:FashionMLPTrial",
        "hyperparameters": {
            "global_batch_size": BATCH,
            "learning_rate": {"type": "log", "minval": -3.0, "maxval": -0.5, "base": 10},
            "momentum": {"type": "double", "minval": 0.0, "maxval": 0.95},
            "width": {"type": "int", "minval": 16, "maxval": 256},
            "weight_decay": {"type": "log", "minval": -6.0, "maxval": -2.5, "base": 10},
        },
        "resources": {"slots_per_trial": 1},
        "records_per_epoch": records_per_epoch,
        "searcher": {"metric": "accuracy", "smaller_is_better": False, "max_concurrent_trials": 2, **searcher},
        "min_validation_period": {"batches": validate_every},
        "min_checkpoint_period": {"batches": validate_every * 4},
        "data_loader": {"validation_batch_size": 1000},
        "reproducibility": {"experiment_seed": 0},
    }


def worker_threads(search_dir: Path) -> list[int]:
    """OMP_NUM_THREADS of every worker process now training a trial of the search in `search_dir` (from each
    one's /proc environment; Linux only, empty elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            if b"dtrain.worker" not in command or not any(str(search_dir).encode() in part for part in command):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        found += [int(e.split(b"=", 1)[1]) for e in environ if e.startswith(b"OMP_NUM_THREADS=")]
    return found


class ThreadSampler:
    """Polls the workers' OMP_NUM_THREADS while a search runs: the values seen, the most workers and the most
    threads (summed over the workers) at one moment."""

    def __init__(self, search_dir: Path, every_seconds: float = 0.2) -> None:
        self.search_dir, self.every = search_dir, every_seconds
        self.values: set[int] = set()
        self.most_workers = self.most_threads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.every):
            threads = worker_threads(self.search_dir)
            self.values.update(threads)
            self.most_workers = max(self.most_workers, len(threads))
            self.most_threads = max(self.most_threads, sum(threads))

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def run_search(work: Path, label: str, config: dict[str, Any], slots: int,
               omp_threads: int | None = None) -> dict[str, Any]:
    """One `dtrain run` of a search; `omp_threads` exports OMP_NUM_THREADS to it (None: none exported, dtrain
    decides). The row counts the workers' threads as sampled while it ran."""
    path = work / f"{label}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    search_dir = work / f"{label}-search"
    env = {**os.environ, "DTRAIN_RUNS_ROOT": str(work / "runs")}
    env.pop("OMP_NUM_THREADS", None)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    started = time.perf_counter()
    with ThreadSampler(search_dir) as sampler:
        done = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(path), "--slots", str(slots),
                               "--search-dir", str(search_dir)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    (work / f"{label}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"the {label} search failed (exit code {done.returncode}): {done.stdout[-1500:]}"
                           f"{done.stderr[-1500:]}")
    results = json.loads((search_dir / "results.json").read_text())
    trials = results["trials"]
    best = max((t for t in trials if t["best_metric"] is not None), key=lambda t: t["best_metric"])
    states = [t["state"] for t in trials]
    return {"search": label, "trials": len(trials), "completed": states.count("completed"),
            "stopped_early": states.count("stopped early"), "errored": states.count("errored"),
            "batches_trained": sum(int(t["batches_trained"] or 0) for t in trials),
            "best_accuracy": best["best_metric"], "best_trial": best["trial"],
            "best_hyperparameters": best["hyperparameters"], "wall_seconds": wall,
            "worker_omp_threads_seen": sorted(sampler.values), "most_workers_at_once": sampler.most_workers,
            "most_threads_at_once": sampler.most_threads,
            "per_trial": [{k: t[k] for k in ("trial", "state", "best_metric", "batches_trained", "hyperparameters",
                                             "bracket")} for t in trials],
            "curve": spent(trials)}


def spent(trials: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(batches spent by the trials ended so far, best accuracy so far), in the order trials ended."""
    points, total, best = [], 0, 0.0
    for t in sorted((t for t in trials if t["ended"]), key=lambda t: t["ended"]):
        total += int(t["batches_trained"] or 0)
        best = max(best, float(t["best_metric"] or 0.0))
        points.append((total, best))
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 trials per search, 2,048-record epochs (minutes)")
    parser.add_argument("--trials", type=int, help="trials per search (default 16; 8 with --quick)")
    parser.add_argument("--epochs", type=int, default=4, help="max length of a trial in epochs (default 4)")
    parser.add_argument("--records-per-epoch", type=int,
                        help="records in an epoch (default 4,096; 2,048 with --quick); a multiple of 512")
    parser.add_argument("--slots", type=int, default=2, help="slots for each search (default 2)")
    parser.add_argument("--searches", default="random,adaptive_asha,tpe_hyperband",
                        help="which searches to run, comma-separated (default all three)")
    parser.add_argument("--threads-ab", action="store_true",
                        help="time one search (the first of --searches) with the old thread rule (OMP_NUM_THREADS = "
                             "cores // a trial's slots, exported) against dtrain's own (none exported), paired rounds")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds for --threads-ab (default 3)")
    parser.add_argument("--results-name", help="name of the result files (default search, search_quick, or "
                                               "search_threads with --threads-ab)")
    args = parser.parse_args(argv)
    trials = args.trials or (8 if args.quick else 16)
    records = args.records_per_epoch or (2048 if args.quick else 4096)
    max_batches = args.epochs * records // BATCH
    first_rung = max_batches // 16
    searchers = {
        "random": {"name": "random", "max_trials": trials, "max_length": {"batches": max_batches}},
        "adaptive_asha": {"name": "adaptive_asha", "max_trials": trials, "max_time": max_batches,
                          "time_metric": "batches", "divisor": 4},
        "tpe_hyperband": {"name": "optuna", "sampler": "tpe", "pruner": "hyperband", "max_trials": trials,
                          "max_time": max_batches, "time_metric": "batches", "divisor": 4},
    }
    wanted = [s for s in args.searches.split(",") if s]
    if args.threads_ab:
        label = wanted[0] if args.searches != parser.get_default("searches") else "adaptive_asha"
        return threads_ab(args, label, searchers[label], trials, records, max_batches, first_rung)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtrain-search-bench-") as tmp:
        work = Path(tmp)
        for label in wanted:
            print(f"{label}: {trials} trials of at most {max_batches} batches ...", flush=True)
            row = run_search(work, label, experiment(f"bench_{label}", searchers[label], records, first_rung),
                             args.slots)
            print(f"{label}: {row['batches_trained']} batches, best accuracy {row['best_accuracy']:.4f}, "
                  f"{row['wall_seconds']:.0f} s", flush=True)
            rows.append(row)
    by = {r["search"]: r for r in rows}
    headline: dict[str, Any] = {}
    if "random" in by:
        base = by["random"]
        for label, key in (("adaptive_asha", "asha"), ("tpe_hyperband", "tpe_hyperband")):
            if label in by:
                headline[f"{key}_budget_fraction"] = by[label]["batches_trained"] / base["batches_trained"]
                headline[f"{key}_best_gap_points"] = 100 * (base["best_accuracy"] - by[label]["best_accuracy"])
        headline["targets"] = {"asha_budget_fraction": "<= 0.40", "asha_best_gap_points": "<= 0.5"}
        if "asha_budget_fraction" in headline:
            headline["asha_pass"] = bool(headline["asha_budget_fraction"] <= 0.40
                                         and headline["asha_best_gap_points"] <= 0.5)
    setup = {"trials_per_search": trials, "epochs": args.epochs, "records_per_epoch": records,
             "global_batch_size": BATCH, "max_batches_per_trial": max_batches, "validation_every_batches": first_rung,
             "validation_set": "Fashion-MNIST test, 10,000 images", "slots": args.slots, "concurrent_trials": 2,
             "quick": args.quick, "seed": 0, "searchers": {k: searchers[k] for k in wanted}}
    table = markdown_table(["search", "trials", "completed", "stopped early", "batches", "fraction of random",
                            "best accuracy", "gap (points)", "wall s"],
                           [[r["search"], r["trials"], r["completed"], r["stopped_early"], r["batches_trained"],
                             r["batches_trained"] / by["random"]["batches_trained"] if "random" in by else "-",
                             r["best_accuracy"],
                             100 * (by["random"]["best_accuracy"] - r["best_accuracy"]) if "random" in by else "-",
                             r["wall_seconds"]] for r in rows])
    markdown = (f"# search\n\n{trials} trials per search, at most {args.epochs} epochs of {records} records "
                f"({max_batches} batches of {BATCH}), validation every {first_rung} batches, 2 trials at once on "
                f"{args.slots} slots.\n\n{table}\n\nHeadline: {json.dumps({k: v for k, v in headline.items()})}\n")
    path = write_results(args.results_name or ("search" if not args.quick else "search_quick"), headline,
                         [{k: v for k, v in r.items() if k != "curve"} for r in rows], markdown, machine_info(),
                         {"setup": setup, "curves": {r["search"]: r["curve"] for r in rows}})
    plot(rows, path.with_suffix(".png"))
    print(markdown)
    return 0


def threads_ab(args: argparse.Namespace, label: str, searcher: dict[str, Any], trials: int, records: int,
               max_batches: int, first_rung: int) -> int:
    """Paired rounds of one search: the old thread rule (exported) against dtrain's own; see the module doc."""
    from dtrain.runs.processes import host_cores

    cores, slots_per_trial, concurrent = host_cores(), 1, 2
    old_rule = max(cores // slots_per_trial, 1)  # what each worker got before: cores // its trial's slots
    config = experiment(f"bench_{label}", searcher, records, first_rung)
    with tempfile.TemporaryDirectory(prefix="dtrain-search-threads-") as tmp:
        work = Path(tmp)

        def variant(name: str, omp: int | None) -> tuple[str, Any]:
            def run(repeat: int) -> dict[str, Any]:
                row = run_search(work, f"{label}-{name}-{repeat}", config, args.slots, omp)
                row["draws"] = [t["hyperparameters"] for t in sorted(row.pop("per_trial"), key=lambda t: t["trial"])]
                row.pop("curve")
                return row
            return name, run

        rows = alternate([variant("before", old_rule), variant("after", None)], args.rounds,
                         log=lambda line: print(line, flush=True))
    before, after = rounds_of(rows, "before", "wall_seconds"), rounds_of(rows, "after", "wall_seconds")
    headline: dict[str, Any] = ratio_headline("threads_after_over_before", after, before)
    pairs = [[r for r in rows if r["repeat"] == n] for n in sorted({r["repeat"] for r in rows})]
    headline["same_draws"] = all(p[0]["draws"] == p[1]["draws"] for p in pairs)
    headline["same_best_trial"] = all(p[0]["best_trial"] == p[1]["best_trial"] for p in pairs)
    headline["before_worker_threads_seen"] = sorted({t for r in rows if r["variant"] == "before"
                                                     for t in r["worker_omp_threads_seen"]})
    headline["after_worker_threads_seen"] = sorted({t for r in rows if r["variant"] == "after"
                                                    for t in r["worker_omp_threads_seen"]})
    headline["targets"] = {"threads_after_over_before": "<= 1.0"}
    setup = {"search": label, "searcher": searcher, "trials": trials, "records_per_epoch": records,
             "max_batches_per_trial": max_batches, "validation_every_batches": first_rung, "slots": args.slots,
             "slots_per_trial": slots_per_trial, "concurrent_trials": concurrent, "cores": cores,
             "before": f"OMP_NUM_THREADS={old_rule} exported (cores // slots per trial)",
             "after": "no OMP_NUM_THREADS (dtrain: cores // (processes per run x runs at once))", "rounds": args.rounds}
    table = markdown_table(["round", "variant", "wall s", "batches", "best trial", "best accuracy",
                            "worker threads seen", "most threads at once"],
                           [[r["repeat"] + 1, r["variant"], r["wall_seconds"], r["batches_trained"], r["best_trial"],
                             r["best_accuracy"], r["worker_omp_threads_seen"], r["most_threads_at_once"]]
                            for r in rows])
    markdown = (f"# search threads\n\n{label}, {trials} trials of at most {max_batches} batches, {concurrent} trials "
                f"of {slots_per_trial} slot at once on {cores} cores; before: OMP_NUM_THREADS={old_rule} exported "
                f"(the old rule), after: dtrain's rule.\n\n{table}\n\nHeadline: {json.dumps(headline)}\n")
    write_results(args.results_name or "search_threads", headline, rows, markdown, machine_info(), {"setup": setup})
    print(markdown)
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        curve = r["curve"]
        axes.step([x for x, _ in curve], [100 * y for _, y in curve], where="post", marker="o", label=r["search"])
    axes.set_xlabel("training batches spent by the trials ended so far")
    axes.set_ylabel("best validation accuracy so far (%)")
    axes.legend()
    save_figure(figure, path)


if __name__ == "__main__":
    sys.exit(main())
