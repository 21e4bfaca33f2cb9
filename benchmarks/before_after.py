"""Issue 22's before/after table: each audited headline as committed before the audit, today's result read with
the old statistic, and today's result on the paired statistic.

"Before" is read from the result JSONs at the audited commit (`--before`, default b73d514) with `git show`;
"after" from `benchmarks/results/`. The old statistics are recomputed from today's rows: ratios of per-variant
medians (compression, demo, sync), the difference of two unpaired medians (diagnose), recipes picked on the test
set (large_batch). Benchmarks whose statistic did not change (stragglers, chaos, plan) show the same figure in both
"after" columns. Prints a Markdown table; nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
AUDITED_COMMIT = "b73d514"

Result = dict[str, Any]


def median_of(rows: Sequence[Result], variant: str, key: str, **match: Any) -> float:
    """Median of `key` over `variant`'s rows (rows that also match every `match` item)."""
    values = [float(r[key]) for r in rows
              if r.get("variant") == variant and all(r.get(k) == v for k, v in match.items())]
    if not values:
        raise ValueError(f"no rows of variant {variant!r} with {key!r} ({match})")
    return statistics.median(values)


def compression_old(result: Result, baseline: str = "bound") -> float:
    """Best compressor's median throughput over `baseline`'s (the bound or raw DDP): the ratio of medians."""
    speed = [r for r in result["rows"] if r.get("part") == "speed"]
    compressors = {r["variant"] for r in speed} - {"bound", "ddp"}
    best = max(median_of(speed, name, "samples_per_second") for name in compressors)
    return best / median_of(speed, baseline, "samples_per_second")


def demo_old(result: Result, baseline: str) -> float:
    """dtrain's median time to target over the hand-written loop's (`baseline` variant)."""
    rows = result["rows"]
    return median_of(rows, "dtrain", "time_to_target_s") / median_of(rows, baseline, "time_to_target_s")


def sync_old(result: Result) -> float:
    """The worst model's median dtrain throughput over median DDP throughput."""
    rows = result["rows"]
    return min(median_of(rows, "dtrain", "samples_per_second", model=m["model"])
               / median_of(rows, "ddp", "samples_per_second", model=m["model"]) for m in result["models"])


def diagnose_old(result: Result) -> float:
    """|median diagnosed - median direct| communication overhead over the rounds, unpaired (points)."""
    rows = [r for r in result["rows"] if r.get("part") == "communication"]
    return abs(statistics.median(r["diagnosed_percent"] for r in rows)
               - statistics.median(r["direct_percent"] for r in rows))


def diagnose_paired_max(result: Result) -> float:
    """The largest per-round |diagnosed - direct| (the target holds in every round)."""
    rows = [r for r in result["rows"] if r.get("part") == "communication"]
    return max(abs(r["diagnosed_percent"] - r["direct_percent"]) for r in rows)


def large_batch_on_test(result: Result, factor: int) -> float:
    """Gap in points between the best recipe at the base batch and at `factor` x, both picked on test accuracy."""
    table: dict[str, dict[str, float]] = result["headline"]["accuracy_percent"]
    base = int(result["headline"]["base_batch"])
    best = {batch: max(accuracies[str(batch)] for accuracies in table.values()) for batch in (base, base * factor)}
    return round(best[base] - best[base * factor], 2)


def headline(key: str) -> Callable[[Result], Any]:
    return lambda result: result["headline"].get(key)


def chaos_figure(result: Result) -> str:
    """Kills survived out of kills, and whether every final model was identical (the same statistic then and now)."""
    found = result["headline"]
    return f"{found['restarts_survived']}/{found['kills']}, {found['final_model_identical']}"


def plan_figure(result: Result) -> str:
    """Median and max absolute prediction error in percent (the same statistic then and now)."""
    found = result["headline"]
    return f"{100 * found['median_abs_error']:.1f} / {100 * found['max_abs_error']:.1f} %"


class Line(NamedTuple):
    """One headline: the result it reads, and how to read it before, after on the old statistic and after."""

    name: str
    label: str
    target: str
    before: Callable[[Result], Any]
    old: Callable[[Result], Any]
    paired: Callable[[Result], Any]
    before_name: str | None = None  # the result's name at the audited commit, when it has been renamed since


LINES: list[Line] = [
    Line("compression", "best fraction of the bound", ">= 0.83", headline("best_fraction_of_bound"),
         compression_old, headline("best_fraction_of_bound")),
    Line("compression", "best x DDP", ">= 2.3", headline("best_speedup_vs_ddp"),
         lambda r: compression_old(r, "ddp"), headline("best_speedup_vs_ddp")),
    Line("demo_vs_ddp", "framework-only ratio (same settings)", "<= 1.00", headline("framework_only_ratio"),
         lambda r: demo_old(r, "hand-written DDP, channels_last, dtrain's malloc"), headline("framework_only_ratio")),
    Line("demo_vs_ddp", "demo as shipped / hand-written default", "reported", headline("time_to_91_ratio"),
         lambda r: demo_old(r, "hand-written DDP, contiguous"), headline("default_config_ratio")),
    Line("sync_vs_ddp", "ratio_min", ">= 1.00", headline("ratio_min"), sync_old, headline("ratio_min")),
    Line("diagnose_check", "communication error, points (worst round when paired)", "<= 10 every round",
         headline("comm_overhead_error_points"), diagnose_old, diagnose_paired_max),
    Line("diagnose_check_27fc597", "the same in the one-pass make bench", "<= 10 every round",
         headline("comm_overhead_error_points"), diagnose_old, diagnose_paired_max, before_name="diagnose_check"),
    Line("stragglers", "speedup_to_88", ">= 1.5", headline("speedup_to_88"), headline("speedup_to_88"),
         headline("speedup_to_88")),
    Line("large_batch", "gap at 16x, points", "<= 1.0", headline("gap_points_16x"),
         lambda r: large_batch_on_test(r, 16), headline("gap_points_16x")),
    Line("large_batch", "gap at 64x, points", "<= 2.5", headline("gap_points_64x"),
         lambda r: large_batch_on_test(r, 64), headline("gap_points_64x")),
    Line("chaos", "kills survived, final model identical", "all, identical", chaos_figure, chaos_figure,
         chaos_figure),
    Line("plan_validation", "median / max abs error", "<= 15 % / 30 %", plan_figure, plan_figure, plan_figure),
]


def result_at(commit: str, name: str) -> Result:
    """benchmarks/results/<name>.json as committed at `commit`."""
    text = subprocess.run(["git", "show", f"{commit}:benchmarks/results/{name}.json"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
    result: Result = json.loads(text)
    return result


def shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def table(before_commit: str, results: Path) -> str:
    """The Markdown table, one line per audited headline."""
    lines = [f"| benchmark | headline (target) | before ({before_commit}, as committed) | after, old statistic "
             f"| after, paired | measured at |", "|---|---|---|---|---|---|"]
    for line in LINES:
        path = results / f"{line.name}.json"
        if not path.exists():
            lines.append(f"| {line.name} | {line.label} ({line.target}) | no result at {path} | | | |")
            continue
        then = result_at(before_commit, line.before_name or line.name)
        now: Result = json.loads(path.read_text())
        lines.append(f"| {line.name} | {line.label} ({line.target}) | {shown(line.before(then))} "
                     f"| {shown(line.old(now))} | {shown(line.paired(now))} | {now['commit'][:7]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=AUDITED_COMMIT, help="the audited commit (default %(default)s)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="today's results (default %(default)s)")
    args = parser.parse_args()
    print(table(args.before, args.results))


if __name__ == "__main__":
    main()
