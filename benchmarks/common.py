"""What every benchmark shares: machine facts, result files (JSON + markdown), A/B alternation, and the one
statistics path for ratio headlines (the median of ratios paired within a round, with the per-round values)."""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]


def load_average() -> float:
    """The 1-minute load average (0.0 where the OS has none): how busy the shared machine was."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def git_commit(repo: Path = REPO) -> dict[str, Any]:
    """The commit the benchmark measured and whether the tree had uncommitted changes (None outside git).
    Result files (benchmarks/results/) do not count: benchmarks run one after another write them there."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


# Taken when the benchmark starts: the commit it measures is the one checked out then, not at the end.
STARTED = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": load_average(), **git_commit()}


def descendants(parents: dict[int, int], root: int) -> list[int]:
    """Every process below `root` in a pid -> parent pid table, parents before their children."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        below = [child for pid in frontier for child in sorted(children.get(pid, []))]
        found += below
        frontier = below
    return found


def process_parents() -> dict[int, int]:
    """pid -> parent pid of every live process this user can see (Linux /proc; empty elsewhere). Zombies are left
    out: they have ended, only their parent has not collected them yet."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, parent = stat[stat.rindex(")") + 2:].split()[:2]  # after the name, which may hold spaces
        if state != "Z":
            parents[int(entry.name)] = int(parent)
    return parents


def terminate_descendants(grace_seconds: float = 10.0) -> None:
    """SIGTERM to every process below this one (a `dtrain run` child and its workers, torchrun's workers, spawned
    ranks), SIGKILL to those still there after `grace_seconds`."""
    pids = descendants(process_parents(), os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_seconds
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            alive = set(descendants(process_parents(), os.getpid())) & set(pids)
            if not alive:
                return
            time.sleep(0.2)


def _end_with_children(signum: int, _frame: Any) -> None:
    signal.signal(signum, signal.SIG_DFL)
    terminate_descendants()
    sys.exit(128 + signum)


# A benchmark stopped with SIGTERM or SIGHUP (a kill, a closed session) takes its processes with it: by default its
# `dtrain run` children and their workers outlived it, kept loading the shared machine and spoiled the next
# benchmark's timing. Only in the benchmark's own process (imported as `common`), not in ranks it spawns.
if __name__ == "common" and multiprocessing.parent_process() is None:
    for _signal in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(_signal, _end_with_children)


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """Ratios paired round by round (both sides measured back to back in the same round): their median as
    `value`, the per-round ratios, their min and max. Unpaired medians would hide drift in the machine's load."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"paired ratios need as many numerators as denominators, at least one: "
                         f"{len(numerators)} vs {len(denominators)}")
    per_round = [float(a) / float(b) for a, b in zip(numerators, denominators, strict=True)]
    return {"value": median(per_round), "per_round": per_round, "min": min(per_round), "max": max(per_round)}


def ratio_headline(key: str, numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """`{key: median of paired ratios, key_per_round: [...], key_min, key_max}` for a result's headline."""
    ratio = paired_ratio(numerators, denominators)
    return {key: ratio["value"], f"{key}_per_round": ratio["per_round"], f"{key}_min": ratio["min"],
            f"{key}_max": ratio["max"]}


def rounds_of(rows: Sequence[dict[str, Any]], variant: str, key: str, round_key: str = "repeat") -> list[float]:
    """`key` of `variant`'s rows in round order (rows as `alternate` returns them, or numbered by `round_key`)."""
    return [float(row[key]) for row in sorted((r for r in rows if r["variant"] == variant),
                                              key=lambda r: int(r[round_key]))]


def machine_info(network: str = "none (loopback, unshaped)") -> dict[str, Any]:
    """The facts a reader needs to judge the numbers: cores, torch version, network emulation."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "network_emulation": network,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_results(name: str, headline: dict[str, Any], rows: list[dict[str, Any]], markdown: str,
                  machine: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """Write benchmarks/results/<name>.json and <name>.md; return the JSON path. Every result records the commit
    it measured (and whether the tree was dirty), when it started and ended, and the load at both ends."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    provenance = {"commit": STARTED["commit"], "dirty": STARTED["dirty"], "started": STARTED["date"],
                  "ended": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "load_average_start": STARTED["load_average"], "load_average_end": load_average()}
    payload = {"benchmark": name, **provenance, "headline": headline, "machine": machine, "rows": rows,
               **(extra or {})}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown.rstrip() + "\n")
    return path


def alternate(variants: Sequence[tuple[str, Callable[[int], dict[str, Any]]]], repeats: int,
              log: Callable[[str], None] = print, first: int = 0,
              on_round: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Run A, B, (C...), C, B, A, ... `repeats` times, so that drift in machine load hits every variant alike
    (rounds numbered from `first`: a benchmark run in pieces continues the order). `on_round` gets each finished
    round's rows, for example to keep them (`KeptRounds.add`)."""
    rows = []
    for repeat in range(first, first + repeats):
        order = variants if repeat % 2 == 0 else list(reversed(variants))
        round_rows = []
        for label, run in order:
            log(f"[{repeat + 1}/{first + repeats}] {label} ...")
            row = run(repeat)
            row.update(variant=label, repeat=repeat)
            round_rows.append(row)
            log(f"[{repeat + 1}/{first + repeats}] {label}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                if k not in ("variant", "repeat", "history")))
        rows.extend(round_rows)
        if on_round is not None:
            on_round(round_rows)
    return rows


class KeptRounds:
    """The rows of a benchmark's finished rounds, kept in `workdir/rows.json` after every round, so that a run
    that stops part-way (a crash, a kill, a machine needed for something else) continues with its next round
    instead of starting again. Rows are only continued by the same commit with the same settings; without a
    workdir nothing is kept. Every row says when, and under what load, its piece of the run started."""

    def __init__(self, workdir: Path | None, settings: dict[str, Any]) -> None:
        self.path = Path(workdir) / "rows.json" if workdir is not None else None
        self.identity = {"commit": STARTED["commit"], "dirty": STARTED["dirty"], **settings}
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        if self.path is not None and self.path.is_file():
            try:
                earlier = json.loads(self.path.read_text())
                kept_identity, rows, extra = earlier["identity"], earlier["rows"], earlier.get("extra", {})
            except (ValueError, KeyError, TypeError) as error:
                raise SystemExit(f"{self.path} is not a file of kept rounds ({error}): remove it or use another "
                                 "--workdir") from None
            if kept_identity != self.identity:
                raise SystemExit(f"{self.path} holds rounds of {kept_identity}; this run is {self.identity}: "
                                 "use another --workdir (rounds of different code or settings do not pair)")
            self.rows, self.extra = rows, extra

    @property
    def rounds(self) -> int:
        """How many rounds are finished (kept or added)."""
        return len({row["repeat"] for row in self.rows})

    def add(self, round_rows: Sequence[dict[str, Any]], **extra: Any) -> None:
        """Add a finished round's rows (and any facts to keep beside them) and write the file at once."""
        for row in round_rows:
            row.setdefault("piece_started", STARTED["date"])
            row.setdefault("piece_load_average", STARTED["load_average"])
        self.rows.extend(round_rows)
        self.extra.update(extra)
        if self.path is not None:
            from dtrain.runs.rundir import write_json_atomic  # here: ranks that import common need no config models

            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, {"identity": self.identity, "rows": self.rows, "extra": self.extra})


def save_figure(figure: Any, path: Path) -> None:
    """Lay out, write (120 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def dtrain_run(config: Path, run_dir: Path, settings: Sequence[str], runs_root: Path) -> dict[str, Any]:
    """`dtrain run CONFIG --set ...` in a subprocess (its store under `runs_root`); the run's summary.json."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(config), "--run-dir", str(run_dir),
                             *[arg for setting in settings for arg in ("--set", setting)]],
                            capture_output=True, text=True, env={**os.environ, "DTRAIN_RUNS_ROOT": str(runs_root)})
    if result.returncode != 0:
        raise RuntimeError(f"dtrain run failed ({' '.join(settings)}): {result.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def dtrain_run_malloc() -> dict[str, str]:
    """The glibc malloc settings `dtrain run` starts its workers with (dtrain.launch), for a hand-written loop that
    should train as dtrain's workers do: with glibc's adaptive defaults a step's freed tensors go back to the OS and
    are page-faulted in again, a cost dtrain's workers do not pay."""
    from dtrain.config.distributed import DEFAULT_MALLOC_TRIM_THRESHOLD_MB
    from dtrain.launch import malloc_environment

    return malloc_environment(DEFAULT_MALLOC_TRIM_THRESHOLD_MB)


def time_to(history: Sequence[dict[str, Any]], target: float) -> float | None:
    """Wall seconds of the first validation entry (`accuracy`, `wall_seconds`) at or above `target`."""
    return next((float(e["wall_seconds"]) for e in history if e["accuracy"] >= target), None)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
