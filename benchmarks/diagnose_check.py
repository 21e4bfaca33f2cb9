"""Does `dtrain diagnose` tell the truth? Its numbers against direct measurements of the same workload.

Workload: benchmarks/diagnose/ (2 workers x 64 in-memory 28x28 images, a 0.8M-parameter CNN whose dense layer
makes it communication-heavy on a 1 Gbit/s link; `load_delay_ms` makes its data set slow), one thread per
worker.

1. Communication (needs root: a network namespace whose loopback tbf shapes to 1 Gbit/s, benchmarks/netem.py).
   Alternating, `--rounds` times: `dtrain diagnose --repeats N` (its communication overhead comes from the phase
   timers of a trial as configured against one with aggregation_frequency 1000; each trial runs N times, in
   alternating order, and the median of the repeats is its figure; `--diagnose-repeats`, default 2), then a
   direct measurement that shares no code with dtrain: a plain DDP loop under torchrun on the same model and
   batches, alternating blocks of steps with and without `no_sync()`; overhead = 1 - (median unsynced step) /
   (median synced step), the median over the pairs of neighbouring blocks (`--comm-blocks`, 12), so that a slow
   spell of the machine is shared by both sides; the diagnosis runs `--comm-steps` (80) batches per trial. The
   plain loop (like the timers' loop of part 3) starts with the malloc settings dtrain's workers get
   (`common.dtrain_run_malloc`; recorded in each round's `direct`), so that both sides pay the same for memory;
   it also times its optimizer update, to give the overhead on the diagnosis's own basis (a batch's work without
   the update), and each round keeps the diagnosis's trials' phases (configured and no-communication, per rank),
   to show where a difference comes from.
   Headline `comm_overhead_error_points`: |diagnosed - direct| in percentage points, paired within each round;
   the median of the rounds, with `comm_overhead_error_points_per_round` and `_max` (target: every round <= 10).
2. Input pipeline (loopback): `dtrain diagnose` on the same workload with `load_delay_ms` per batch, swept
   over 0, 5, 10, 20 and 40 ms (`--load-delays-ms`). Headline `io_bottleneck_named`: the verdict names the
   input pipeline at every delay >= 10 ms and does not at 0 (`io_named_per_delay_ms` beside it); a check that
   could not fail (a large delay only) would say nothing about false alarms.
3. Cost of the phase timers (loopback), measured two ways:
   - interleaved, in one pair of processes under torchrun: one DDP replica of the workload built by dtrain's
     AllReduceStrategy, its Profiler's timers switched on (timer enabled, the strategy's gradient hooks
     reporting to it) and off (what the Trainer does with `profiling.phase_timers: false`) between
     alternating blocks of 10 steps; overhead = the median over block pairs of (median step on) / (median
     step off) - 1, then the median of `--rounds` rounds. Same model, same processes, same moment: noise of
     about one percent. Headline `timer_overhead_percent` (target < 2), `timer_overhead_cpu_percent` (the
     same in the training thread's CPU time).
   - whole `dtrain run`s with `profiling.phase_timers` on and off, alternating; overhead = 1 - (samples/s
     on) / (samples/s off), the median of the per-round ratios (`timer_overhead_whole_run_percent`: run-to-run
     noise on a shared 2-core machine is several percent, so it confirms, it cannot resolve 2%).
   Plus the timers' own bookkeeping per step, timed in-process, as a share of the step.

    flock /tmp/dtrain-bench.lock python benchmarks/diagnose_check.py   # 18 minutes at 759df6b on 2 idle cores
    flock /tmp/dtrain-bench.lock python benchmarks/diagnose_check.py --quick    # 1 round, short trials

Writes benchmarks/results/diagnose_check.{json,md} and copies the 1 Gbit/s diagnosis chart to
benchmarks/results/diagnose_chart.png (docs/tools.md shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "benchmarks" / "diagnose" / "cnn.yaml"
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(WORKLOAD.parent))

PER_RANK_BATCH = 64  # cnn.yaml's global batch 128 on 2 workers
TARGET_ERROR_POINTS = 10.0
TARGET_TIMER_OVERHEAD = 2.0
WARMUP_STEPS = 5  # steps with the timers on before the interleaved blocks


# ------------------------------------------------------------------------------ direct measurement


def worker_batches(rank: int) -> list[Any]:
    """The 4 per-rank batches of random 28x28 images both torchrun workers cycle through."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(PER_RANK_BATCH, 1, 28, 28, generator=generator),
             torch.randint(0, 10, (PER_RANK_BATCH,), generator=generator)) for _ in range(4)]


ATTEMPTS = 2  # a worker pair that crashes is run once more, and the retry is recorded


def run_worker(flag: str, blocks: int, block_steps: int, workdir: Path, wrap: Any = None) -> dict[str, Any]:
    """Run this file's `flag` worker in 2 torchrun processes (inside a namespace when `wrap` is its `wrap`) and
    return the JSON its rank 0 wrote, with `attempts`: a pair that crashed (a gloo worker once aborted near the
    end of its run on this machine, losing the rounds before it) is started again, at most `ATTEMPTS` times."""
    from common import dtrain_run_malloc

    # dtrain's workers start with its malloc settings (no page faults for the gradients each step); these loops get
    # the same, or their steps would carry a cost that dtrain's do not (in the plain loop: hidden under the
    # transfers when synced, exposed when not, so counted as communication).
    env = {**os.environ, "OMP_NUM_THREADS": "1", **dtrain_run_malloc()}
    for attempt in range(1, ATTEMPTS + 1):
        out = workdir / f"{flag.strip('-')}-{time.monotonic_ns()}.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   __file__, flag, "--blocks", str(blocks), "--block-steps", str(block_steps), "--out", str(out)]
        result = subprocess.run(wrap(command) if wrap else command, capture_output=True, text=True, env=env)
        if result.returncode == 0:
            found: dict[str, Any] = json.loads(out.read_text())
            return {**found, "attempts": attempt}
        failure = f"{flag} measurement failed (attempt {attempt} of {ATTEMPTS}):\n{result.stderr[-3000:]}"
        if attempt == ATTEMPTS:
            raise RuntimeError(failure)
        print(failure.splitlines()[0] + "; last lines of its output:\n" + "\n".join(
            result.stderr.strip().splitlines()[-5:]) + "\nstarting it again", flush=True)
    raise AssertionError("unreachable")


def direct_worker(blocks: int, block_steps: int, out: Path) -> None:
    """Runs in each of the 2 torchrun processes: plain DDP, blocks of synced and unsynced (no_sync) steps."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from model_def import build_model
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = worker_batches(rank)
    times: dict[str, list[float]] = {"synced": [], "unsynced": [], "synced_update": [], "unsynced_update": []}

    def step(index: int, synced: bool) -> tuple[float, float]:
        """One step's seconds, and the part of them the optimizer update took."""
        images, labels = batches[index % len(batches)]
        start = time.perf_counter()
        if synced:
            F.cross_entropy(model(images), labels).backward()
        else:
            with model.no_sync():
                F.cross_entropy(model(images), labels).backward()
        update_start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return end - start, end - update_start

    for index in range(5):  # warm-up: bucket rebuild, allocator, caches
        step(index, synced=True)
    for block in range(blocks):
        for synced in ((True, False) if block % 2 == 0 else (False, True)):
            dist.barrier()  # both ranks start the block together
            side = "synced" if synced else "unsynced"
            for index in range(block_steps):
                seconds, update = step(index, synced)
                times[side].append(seconds)
                times[f"{side}_update"].append(update)
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.barrier()  # neither rank tears down while the other still has DDP work in flight
    dist.destroy_process_group()


def direct_overhead(ns: Any, blocks: int, block_steps: int, workdir: Path) -> dict[str, Any]:
    """Communication overhead % of the plain DDP loop inside namespace `ns`."""
    from common import dtrain_run_malloc

    times = run_worker("--direct-worker", blocks, block_steps, workdir, wrap=ns.wrap)
    synced, unsynced = statistics.median(times["synced"]), statistics.median(times["unsynced"])
    # Paired block by block (each synced block beside the unsynced block run next to it), so that a slow spell of
    # the shared machine in part of the run does not land on one side only.
    unsynced_over_synced = paired_block_ratio(times["unsynced"], times["synced"], block_steps)
    # The diagnosis compares a batch's work without the optimizer update (its no-communication trial updates once
    # in 1000 batches); the same basis here, so that the two can be compared on it too.
    without_update = {side: [t - u for t, u in zip(times[side], times[f"{side}_update"], strict=True)]
                      for side in ("synced", "unsynced")}
    return {"synced_ms": synced * 1e3, "unsynced_ms": unsynced * 1e3, "attempts": times["attempts"],
            "malloc_environment": dtrain_run_malloc(),
            "update_ms": statistics.median(times["synced_update"] + times["unsynced_update"]) * 1e3,
            "overhead_percent": 100.0 * (1.0 - unsynced_over_synced),
            "overhead_percent_of_medians": 100.0 * (synced - unsynced) / synced,
            "overhead_percent_without_update": 100.0 * (1.0 - paired_block_ratio(
                without_update["unsynced"], without_update["synced"], block_steps))}


# ------------------------------------------------------------------------------------ diagnose


def diagnose(wrap: Any, steps: int, out: Path, overrides: list[str], repeats: int = 1) -> dict[str, Any]:
    """`dtrain diagnose` on the workload (inside the namespace when `wrap` is one); its diagnosis.json."""
    command = [sys.executable, "-m", "dtrain.cli", "diagnose", str(WORKLOAD), "--steps", str(steps),
               "--repeats", str(repeats), "--out", str(out), "--json"]
    for override in overrides:
        command += ["--set", override]
    env = {**os.environ, "DTRAIN_RUNS_ROOT": str(out / "runs")}
    env.pop("OMP_NUM_THREADS", None)  # diagnose gives each slot its share of the cores
    result = subprocess.run(wrap(command) if wrap else command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"dtrain diagnose failed:\n{result.stderr[-3000:]}")
    diagnosis: dict[str, Any] = json.loads((out / "diagnosis.json").read_text())
    return diagnosis


TRIAL_PHASES = ("data", "forward", "backward", "comm_wait", "optimizer")


def trial_phase_ms(diagnosis: dict[str, Any]) -> dict[str, list[list[dict[str, float]]]]:
    """Per trial that bears on communication, per repeat, per rank: the median ms of each phase of a step (to
    see which phases the diagnosed overhead comes from, beside the direct loop's steps)."""
    found: dict[str, list[list[dict[str, float]]]] = {}
    for name in ("configured", "no_communication"):
        trial = diagnosis["trials"].get(name)
        if trial is None:
            continue
        repeats = [r["profile"] for r in trial.get("repeats", [])] or [trial["profile"]]
        found[name] = [[{phase: 1e3 * rank["median_seconds"].get(phase, 0.0) for phase in TRIAL_PHASES}
                        for rank in profile["ranks"] if rank.get("steps")] for profile in repeats]
    return found


def communication_part(rounds: int, steps: int, blocks: int, block_steps: int, workdir: Path,
                       repeats: int) -> tuple[list[dict[str, Any]], str, Path | None]:
    from netem import measure_loopback_gbit_per_s, shaped_namespace

    rows: list[dict[str, Any]] = []
    chart: Path | None = None
    with shaped_namespace("1gbit") as ns:
        tcp = measure_loopback_gbit_per_s(ns, megabytes=32)
        network = f"tbf 1gbit on a namespace's loopback (TCP measured {tcp:.2f} Gbit/s)"
        print(f"namespace {ns.name}: {network}", flush=True)
        for repeat in range(rounds):
            order = ("diagnose", "direct") if repeat % 2 == 0 else ("direct", "diagnose")
            row: dict[str, Any] = {"part": "communication", "repeat": repeat}
            for what in order:
                print(f"[{repeat + 1}/{rounds}] {what} at 1 Gbit/s ...", flush=True)
                if what == "direct":
                    row["direct"] = direct_overhead(ns, blocks, block_steps, workdir)
                else:
                    found = diagnose(ns.wrap, steps, workdir / f"comm-{repeat}", [], repeats)
                    row["diagnosed_percent"] = found["communication_overhead_percent"]
                    row["diagnose_repeats"] = repeats
                    row["diagnosed_percent_per_repeat"] = found.get("communication_overhead_percent_per_repeat",
                                                                    [found["communication_overhead_percent"]])
                    row["exposed_wait_percent"] = found["exposed_communication_wait_percent"]
                    row["scaling_efficiency_percent"] = found.get("scaling_efficiency_percent")
                    row["bottleneck"] = found["bottleneck"]
                    row["verdict"] = found["verdict"]
                    row["advice"] = found["advice"]
                    row["step_ms"] = found["step_ms"]
                    row["trial_phase_ms"] = trial_phase_ms(found)
                    chart = Path(found["chart"])
            row["direct_percent"] = row["direct"]["overhead_percent"]
            print(f"[{repeat + 1}/{rounds}] diagnosed {row['diagnosed_percent']:.1f}% vs direct "
                  f"{row['direct_percent']:.1f}% (synced {row['direct']['synced_ms']:.1f} ms, unsynced "
                  f"{row['direct']['unsynced_ms']:.1f} ms, update {row['direct']['update_ms']:.1f} ms; without the "
                  f"update {row['direct']['overhead_percent_without_update']:.1f}%)", flush=True)
            rows.append(row)
    return rows, network, chart


def input_part(steps: int, delay_ms: float, workdir: Path) -> dict[str, Any]:
    print(f"input pipeline: diagnose with load_delay_ms={delay_ms:g} on loopback ...", flush=True)
    found = diagnose(None, steps, workdir / f"slow-input-{delay_ms:g}",
                     [f"hyperparameters.load_delay_ms={delay_ms:g}"])
    row = {"part": "input", "load_delay_ms": delay_ms, "bottleneck": found["bottleneck"],
           "input_overhead_percent": found["input_overhead_percent"], "verdict": found["verdict"],
           "advice": found["advice"]}
    print(f"  bottleneck: {row['bottleneck']}; input overhead {row['input_overhead_percent']:.1f}%", flush=True)
    return row


# ------------------------------------------------------------------------------------ timer cost


def timers_part(rounds: int, batches: int, workdir: Path) -> list[dict[str, Any]]:
    from common import dtrain_run

    rows = []
    for repeat in range(rounds):
        order = (True, False) if repeat % 2 == 0 else (False, True)
        speeds: dict[bool, float] = {}
        for timers in order:
            run_dir = workdir / f"timers-{repeat}-{'on' if timers else 'off'}"
            summary = dtrain_run(WORKLOAD, run_dir, [f"profiling.phase_timers={str(timers).lower()}",
                                                     f"searcher.max_length={{batches: {batches}}}",
                                                     "min_checkpoint_period={batches: 0}",
                                                     "min_validation_period={batches: 0}"],
                                 workdir / "runs")
            speeds[timers] = float(summary["samples_per_second"])
        ratio = speeds[True] / speeds[False]
        rows.append({"part": "timers", "repeat": repeat, "on_samples_per_second": speeds[True],
                     "off_samples_per_second": speeds[False], "overhead_percent": 100.0 * (1.0 - ratio)})
        print(f"[{repeat + 1}/{rounds}] timers on {speeds[True]:.0f} samples/s, off {speeds[False]:.0f}: overhead "
              f"{rows[-1]['overhead_percent']:.2f}%", flush=True)
    return rows


def interleaved_worker(blocks: int, block_steps: int, out: Path) -> None:
    """Runs in each of the 2 torchrun processes: dtrain's step on one DDP replica, in alternating blocks with
    the phase timers on (the profiler's timer enabled, the strategy's gradient hooks reporting to it) and off
    (timer disabled, hooks removed: what the Trainer does with `profiling.phase_timers: false`)."""
    import torch
    import torch.nn.functional as F
    from model_def import build_model

    from dtrain.comm import barrier as comm_barrier
    from dtrain.comm import init_distributed, shutdown_distributed
    from dtrain.config import Profiling
    from dtrain.profile.profiler import Profiler
    from dtrain.sync.allreduce import AllReduceStrategy

    torch.set_num_threads(1)
    topology = init_distributed(backend="gloo")
    torch.manual_seed(0)
    model = build_model(256)
    profiler = Profiler(Profiling(), rank=topology.rank, run_dir=out.parent / f"interleaved-rank{topology.rank}")
    strategy = AllReduceStrategy(topology)
    wrapped = strategy.wrap_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = worker_batches(topology.rank)
    wall: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}

    def timers(on: bool) -> None:
        profiler.timer.enabled = on
        strategy.observe_buckets(profiler.timer.buckets if on else None)

    def step(index: int, on: bool) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        with profiler.step(index, records=PER_RANK_BATCH):  # the Trainer's phases, in its order
            with profiler.phase("data"):
                images, labels = batches[index % len(batches)]
            with profiler.phase("forward"):
                loss = F.cross_entropy(wrapped(images), labels)
            with profiler.phase("backward"):
                loss.backward()
            with profiler.phase("optimizer"):
                strategy.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
        wall["on" if on else "off"].append(time.perf_counter() - start)
        cpu["on" if on else "off"].append(time.thread_time() - start_cpu)

    timers(True)
    for index in range(WARMUP_STEPS):  # warm-up: bucket rebuild, allocator, caches
        step(index, True)
    wall, cpu = {"on": [], "off": []}, {"on": [], "off": []}
    for block in range(blocks):
        for on in ((True, False) if block % 2 == 0 else (False, True)):
            timers(on)
            comm_barrier()
            for index in range(block_steps):
                step(index, on)
    if topology.rank == 0:
        waits = [r.phases.get("comm_wait", 0.0) for r in profiler.timer.records]
        out.write_text(json.dumps({"wall": wall, "cpu": cpu, "timed_steps_recorded": len(waits),
                                   "comm_wait_ms": statistics.median(waits) * 1e3}))
    shutdown_distributed()


def paired_block_ratio(on: list[float], off: list[float], block_steps: int) -> float:
    """Median over the alternating blocks of (median step on) / (median step off) of the same block pair: the
    machine's drift over the run cancels within each pair."""
    pairs = min(len(on), len(off)) // block_steps
    return statistics.median(statistics.median(on[i * block_steps:(i + 1) * block_steps])
                             / statistics.median(off[i * block_steps:(i + 1) * block_steps]) for i in range(pairs))


def interleaved_overhead(blocks: int, block_steps: int, workdir: Path) -> dict[str, float]:
    """One interleaved measurement (loopback, 2 processes): median step times and the timers' overhead % from
    the paired blocks, in wall time and in the training thread's CPU time."""
    times = run_worker("--interleaved-worker", blocks, block_steps, workdir)
    wall, cpu = times["wall"], times["cpu"]
    if times["timed_steps_recorded"] != WARMUP_STEPS + len(wall["on"]):  # the off blocks must record nothing
        raise RuntimeError(f"the profiler recorded {times['timed_steps_recorded']} steps, not the "
                           f"{WARMUP_STEPS + len(wall['on'])} steps with the timers on: the on/off switch failed")
    return {"on_ms": statistics.median(wall["on"]) * 1e3, "off_ms": statistics.median(wall["off"]) * 1e3,
            "attempts": times["attempts"],
            "overhead_percent": 100.0 * (paired_block_ratio(wall["on"], wall["off"], block_steps) - 1.0),
            "cpu_on_ms": statistics.median(cpu["on"]) * 1e3, "cpu_off_ms": statistics.median(cpu["off"]) * 1e3,
            "cpu_overhead_percent": 100.0 * (paired_block_ratio(cpu["on"], cpu["off"], block_steps) - 1.0),
            "steps_each": len(wall["on"]), "timed_steps_recorded": times["timed_steps_recorded"],
            "comm_wait_ms": times["comm_wait_ms"]}


def bookkeeping_seconds_per_step(repeats: int = 2000) -> float:
    """The StepTimer's own cost for one step of the Trainer's phases (no work inside them)."""
    from dtrain.profile.timers import StepTimer

    timer = StepTimer()
    phases = ("data", "forward", "backward", "optimizer", "report")
    start = time.perf_counter()
    for step in range(repeats):
        timer.begin_step(step)
        for name in phases:
            with timer.phase(name):
                pass
        for _ in range(8):  # the workload's 8 parameters report their gradients
            timer.buckets.gradient_ready()
        timer.split_backward()
        timer.end_step(64)
    return (time.perf_counter() - start) / repeats


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, short trials (a check, not a result)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each part (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="batches per input-pipeline diagnosis (default 40)")
    parser.add_argument("--comm-steps", type=int, default=80,
                        help="batches per communication diagnosis at 1 Gbit/s (default 80)")
    parser.add_argument("--diagnose-repeats", type=int, default=2,
                        help="`dtrain diagnose --repeats` in the communication part: its trials run this many times "
                             "in alternating order, as the direct measurement alternates its blocks (default 2; 1, "
                             "a single run of each trial, is what results up to 90c4ff7 measured)")
    parser.add_argument("--comm-blocks", type=int, default=12,
                        help="pairs of 10-step synced/unsynced blocks of the direct measurement (default 12)")
    parser.add_argument("--timer-rounds", type=int, default=4,
                        help="alternating pairs of whole runs with the timers on and off (default 4)")
    parser.add_argument("--load-delays-ms", default="0,5,10,20,40",
                        help="the slow data set's extra times per batch to sweep (default 0,5,10,20,40 ms; "
                             "--quick: 0,40)")
    parser.add_argument("--direct-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--block-steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.diagnose_repeats < 1:
        parser.error(f"--diagnose-repeats {args.diagnose_repeats}: each trial runs at least once; use 1 or more")
    if args.direct_worker:
        direct_worker(args.blocks, args.block_steps, args.out)
        return
    if args.interleaved_worker:
        interleaved_worker(args.blocks, args.block_steps, args.out)
        return

    from common import RESULTS, machine_info, markdown_table, write_results
    from netem import unavailable_reason

    rounds = 1 if args.quick else args.rounds
    steps = 12 if args.quick else args.steps
    timer_batches = 60 if args.quick else 300
    rows: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    network = "none (loopback, unshaped)"
    with tempfile.TemporaryDirectory(prefix="diagnose_check-") as tmp:
        workdir = Path(tmp)
        reason = unavailable_reason()
        if reason:
            print(f"communication part skipped: {reason}", flush=True)
            headline["comm_overhead_error_points"] = None
            headline["comm_skipped_because"] = reason
        else:
            comm_rows, network, chart = communication_part(rounds, 12 if args.quick else args.comm_steps,
                                                          2 if args.quick else args.comm_blocks, 10, workdir,
                                                          args.diagnose_repeats)
            rows += comm_rows
            errors = [abs(r["diagnosed_percent"] - r["direct_percent"]) for r in comm_rows]
            headline.update(comm_overhead_error_points=statistics.median(errors),
                            comm_overhead_error_points_per_round=errors,
                            comm_overhead_error_points_max=max(errors),
                            comm_overhead_diagnosed_per_round=[r["diagnosed_percent"] for r in comm_rows],
                            comm_overhead_direct_per_round=[r["direct_percent"] for r in comm_rows],
                            diagnose_repeats=args.diagnose_repeats)
            if chart is not None and chart.is_file():
                RESULTS.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(chart, RESULTS / "diagnose_chart.png")
        delays = [0.0, 40.0] if args.quick and args.load_delays_ms == "0,5,10,20,40" else \
            [float(d) for d in args.load_delays_ms.split(",") if d.strip()]
        io_rows = [input_part(steps, delay, workdir) for delay in delays]
        rows += io_rows
        named = {f"{r['load_delay_ms']:g}": r["bottleneck"] == "input pipeline" for r in io_rows}
        headline["io_named_per_delay_ms"] = named
        headline["io_bottleneck_named"] = all(
            hit == (float(delay) >= 10) for delay, hit in named.items() if float(delay) >= 10 or float(delay) == 0)
        interleaved_rows: list[dict[str, Any]] = []
        for repeat in range(rounds):
            print(f"[{repeat + 1}/{rounds}] phase timers: interleaved on/off blocks in one pair of processes ...",
                  flush=True)
            found = interleaved_overhead(8 if args.quick else 40, 10, workdir)
            interleaved_rows.append({"part": "timers_interleaved", "repeat": repeat, **found})
            print(f"  on {found['on_ms']:.2f} ms, off {found['off_ms']:.2f} ms per step: overhead "
                  f"{found['overhead_percent']:.2f}% (CPU {found['cpu_overhead_percent']:.2f}%)", flush=True)
        rows += interleaved_rows
        timer_rows = timers_part(args.timer_rounds if not args.quick else 1, timer_batches, workdir)
        rows += timer_rows
    interleaved = {key: statistics.median(r[key] for r in interleaved_rows)
                   for key in ("on_ms", "off_ms", "overhead_percent", "cpu_on_ms", "cpu_off_ms", "cpu_overhead_percent",
                               "comm_wait_ms", "steps_each")}
    whole_run = statistics.median(r["overhead_percent"] for r in timer_rows)
    per_step = bookkeeping_seconds_per_step()
    off_step = interleaved["off_ms"] / 1e3
    headline.update(timer_overhead_percent=interleaved["overhead_percent"],
                    timer_overhead_cpu_percent=interleaved["cpu_overhead_percent"],
                    timer_overhead_whole_run_percent=whole_run,
                    timer_bookkeeping_percent=100.0 * per_step / off_step,
                    timer_bookkeeping_us_per_step=per_step * 1e6)
    print(f"headline: {json.dumps(headline)}", flush=True)

    comm = [r for r in rows if r["part"] == "communication"]
    lines = ["# dtrain diagnose against direct measurements", "",
             f"Network for part 1: {network}. Command: `python benchmarks/diagnose_check.py`"
             f"{' --quick' if args.quick else ''}.", "",
             "## Headline", "", markdown_table(["key", "value"], [[k, v] for k, v in headline.items()]), ""]
    if comm:
        lines += ["## Communication overhead at 1 Gbit/s (percent of the step)", "",
                  markdown_table(["round", "diagnosed", "diagnosed per repeat", "direct (plain DDP)",
                                  "direct without the update", "DDP synced ms", "DDP unsynced ms", "DDP update ms",
                                  "exposed wait", "scaling efficiency"],
                                 [[r["repeat"], r["diagnosed_percent"],
                                   ", ".join(f"{v:.1f}" for v in r["diagnosed_percent_per_repeat"]),
                                   r["direct_percent"], r["direct"]["overhead_percent_without_update"],
                                   r["direct"]["synced_ms"], r["direct"]["unsynced_ms"], r["direct"]["update_ms"],
                                   r["exposed_wait_percent"], r["scaling_efficiency_percent"]] for r in comm]),
                  "", "The diagnosis's trials, median ms per phase (rank 0 / rank 1, first repeat):", "",
                  markdown_table(["round", "trial", *TRIAL_PHASES],
                                 [[r["repeat"], name, *[" / ".join(f"{rank[p]:.1f}" for rank in repeats[0])
                                                        for p in TRIAL_PHASES]]
                                  for r in comm for name, repeats in r.get("trial_phase_ms", {}).items()]),
                  "", f"The last round's diagnosis (its chart is `diagnose_chart.png`; step "
                      f"{comm[-1]['step_ms']:.1f} ms):",
                  "", *[f"    {line}" for line in comm[-1]["verdict"]],
                  *[f"    advice: {line}" for line in comm[-1]["advice"]], ""]
    lines += ["## Slow input pipeline", "", "The verdict's bottleneck against the delay added to every batch "
              "(the input pipeline must be named at >= 10 ms and not at 0):", "",
              markdown_table(["load_delay_ms", "bottleneck", "input overhead % of the step"],
                             [[r["load_delay_ms"], r["bottleneck"], r["input_overhead_percent"]] for r in io_rows]),
              "", f"The verdict at {io_rows[-1]['load_delay_ms']:g} ms:", "",
              *[f"    {line}" for line in io_rows[-1]["verdict"]], "",
              "## Phase timers' cost", "",
              f"Interleaved in one pair of processes, one DDP replica, the timers switched on and off between "
              f"alternating blocks of 10 steps ({interleaved['steps_each']:.0f} steps each per round, "
              f"{len(interleaved_rows)} round(s); overhead = median over block pairs of on/off, then the median of "
              f"the rounds): median step "
              f"{interleaved['on_ms']:.2f} ms with the timers, {interleaved['off_ms']:.2f} ms without: **overhead "
              f"{interleaved['overhead_percent']:.2f}%** (target < {TARGET_TIMER_OVERHEAD:g}%); in the training "
              f"thread's CPU time {interleaved['cpu_overhead_percent']:.2f}%. Median exposed communication wait the "
              f"timers measured: {interleaved['comm_wait_ms']:.2f} ms per step.", "",
              markdown_table(["round", "on ms", "off ms", "overhead % (wall)", "overhead % (CPU)"],
                             [[r["repeat"], r["on_ms"], r["off_ms"], r["overhead_percent"], r["cpu_overhead_percent"]]
                              for r in interleaved_rows]),
              "", "Whole runs, alternating (run-to-run noise is several percent here):", "",
              markdown_table(["round", "samples/s timers on", "samples/s timers off", "overhead %"],
                             [[r["repeat"], r["on_samples_per_second"], r["off_samples_per_second"],
                               r["overhead_percent"]] for r in timer_rows]), "",
              f"Median of the whole-run rounds: {whole_run:.2f}%. Bookkeeping alone: {per_step * 1e6:.1f} us per "
              f"step ({100 * per_step / off_step:.3f}% of a {off_step * 1e3:.1f} ms step)."]
    path = write_results("diagnose_check", headline, rows, "\n".join(lines), machine_info(network))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
