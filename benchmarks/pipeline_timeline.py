"""Where a pipelined step's time goes: a per-rank timeline of the schedule's actions for dtrain's pipeline strategy
(p = 2, GPipe and 1F1B, m = 2, 4, 8) on the wide MLP of benchmarks/model_scale.py part 3, with the same settings
(width 1024, batch 256, 1 thread per process, `dtrain run`'s malloc settings), and the reference times beside it.

Per rank and step: forward and backward compute (the stage's `forward_one_chunk`/`backward_one_chunk`), waits for
receives and sends (`_wait_batch_p2p`), posting them (`_sorted_batch_p2p`, `_batch_p2p`), the rest, and how long
both ranks computed at once. Beside it: each stage alone and the whole model alone per microbatch size (rank 0
computing, rank 1 idle), the whole model on both ranks at once (how much 2 busy cores slow each other), and a
send/recv ping-pong of one activation. Timing, so run it under the bench lock:

    flock /tmp/dtrain-bench.lock python benchmarks/pipeline_timeline.py --out /tmp/timeline.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import dtrain_run_malloc  # noqa: E402
from model_scale import BLOCKS, CLASSES, INPUTS, PIPELINE_BATCH, PIPELINE_WIDTH, spawn, variant_name  # noqa: E402

MICROBATCHES = (2, 4, 8)
SCHEDULE_ACTIONS = {"forward": ("_PipelineStageBase", "forward_one_chunk"),
                    "backward": ("_PipelineStageBase", "backward_one_chunk"),
                    "wait": (None, "_wait_batch_p2p"), "post": (None, "_sorted_batch_p2p")}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _timeline(topology: Any, repeats: int, batch: int, width: int, receives: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stages
    import torch.nn.functional as F
    from model_def import build_wide_mlp  # type: ignore[attr-defined]  # examples/wide_mlp's, on sys.path

    from dtrain.sync import pipeline
    from dtrain.sync.pipeline import PipelineStrategy, cut_model

    torch.manual_seed(0)
    inputs, labels = torch.randn(batch, INPUTS), torch.randint(0, CLASSES, (batch,))
    reference = build_wide_mlp(INPUTS, width, BLOCKS, CLASSES)
    first, last = cut_model(reference, 2, [])

    def timed(run: Any) -> float:
        run()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return _median(times)

    def fb(module: Any, x: Any, y: Any, loss: bool) -> Any:
        def run() -> None:
            out = module(x)
            (F.cross_entropy(out, y) if loss else out.sum()).backward()
            reference.zero_grad(set_to_none=True)
        return run

    out: dict[str, Any] = {"threads": torch.get_num_threads(), "alone": {}, "together": {}, "pingpong": {}}
    for rows in sorted({batch} | {batch // m for m in MICROBATCHES}, reverse=True):
        x, y = inputs[:rows], labels[:rows]
        with torch.no_grad():
            hidden = first(x)
        hidden.requires_grad_(True)
        if topology.rank == 0:
            out["alone"][rows] = {"stage0_forward": timed(lambda x=x: first(x).detach()),
                                  "stage0": timed(fb(first, x, y, False)), "stage1": timed(fb(last, hidden, y, True)),
                                  "whole": timed(fb(reference, x, y, True))}
        dist.barrier()
        out["together"][rows] = timed(fb(reference, x, y, True))  # both ranks at once
        buffer = torch.zeros(rows, width)
        rounds = []
        for _ in range(20):
            started = time.perf_counter()
            if topology.rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            else:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            rounds.append(time.perf_counter() - started)
        out["pingpong"][rows] = _median(rounds)

    events: list[tuple[str, float, float, float]] = []

    def record(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                events.append((label, started, time.perf_counter(), time.thread_time() - cpu))
        setattr(owner, name, wrapper)

    for label, (owner, name) in SCHEDULE_ACTIONS.items():
        record(getattr(stages, owner) if owner else schedules, name, label)
    record(schedules, "_batch_p2p", "post")  # 1F1B posts through it directly (GPipe through _sorted_batch_p2p)
    record(pipeline._TimedStage, "_post_step_receives", "post")  # receives: ahead
    record(pipeline._TimedStage, "_wait_posted", "wait")

    class Trial:
        def pipeline_loss(self, outputs: Any, targets: Any) -> Any:
            return F.cross_entropy(outputs, targets)

        def train_batch(self, batch: Any, model: Any) -> Any:
            raise NotImplementedError

    phases = type("Phases", (), {"forward": lambda self: nullcontext(), "backward": lambda self: nullcontext()})()
    out["steps"] = {}
    for schedule, receive in ((schedule, receive) for receive in receives for schedule in ("gpipe", "1f1b")):
        for m in MICROBATCHES:
            strategy = PipelineStrategy(topology, stages=2, microbatches=m, schedule=schedule, receives=receive)
            model = strategy.wrap_model(build_wide_mlp(INPUTS, width, BLOCKS, CLASSES))

            def step(strategy: Any = strategy, model: Any = model) -> None:
                strategy.forward_backward(model, (inputs, labels), Trial().train_batch, loss_scale=1.0,
                                          communicate=True, phases=phases)
                model.zero_grad(set_to_none=True)
            step()
            steps = []
            for _ in range(repeats):
                dist.barrier()
                events.clear()
                started = time.perf_counter()
                step()
                steps.append({"start": started, "end": time.perf_counter(), "events": list(events)})
            out["steps"][f"{variant_name(schedule, receive)}_m{m}"] = steps
    return out


def _nested(events: list[Any]) -> list[Any]:
    """Drop the posts that ran inside another post (_sorted_batch_p2p calls _batch_p2p)."""
    posts = [(s, e) for label, s, e, _ in events if label == "post"]
    return [ev for ev in events if ev[0] != "post" or not any(s < ev[1] and ev[2] <= e and (s, e) != (ev[1], ev[2])
                                                              for s, e in posts)]


def account(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per schedule and m, the median step (by rank 0's time) split per rank into its actions, in ms."""
    rows = []
    for key, steps0 in ranks[0]["steps"].items():
        durations = [s["end"] - s["start"] for s in steps0]
        index = durations.index(_median(durations))
        row: dict[str, Any] = {"case": key, "step_ms": 1e3 * durations[index]}
        busy = []
        for rank, result in enumerate(ranks):
            step = result["steps"][key][index]
            events = _nested(step["events"])
            totals = {label: 1e3 * sum(e - s for lab, s, e, _ in events if lab == label) for label in SCHEDULE_ACTIONS}
            totals["other"] = 1e3 * (step["end"] - step["start"]) - sum(totals.values())
            totals["cpu_in_compute"] = 1e3 * sum(c for lab, _, _, c in events if lab in ("forward", "backward"))
            row[f"stage{rank}"] = totals
            busy.append([(s, e) for lab, s, e, _ in events if lab in ("forward", "backward")])
        row["both_computing_ms"] = 1e3 * sum(max(0.0, min(e0, e1) - max(s0, s1))
                                             for s0, e0 in busy[0] for s1, e1 in busy[1])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="steps per case (the median is shown; default 5)")
    parser.add_argument("--batch", type=int, default=PIPELINE_BATCH, help=f"default {PIPELINE_BATCH} (model_scale's)")
    parser.add_argument("--width", type=int, default=PIPELINE_WIDTH, help=f"default {PIPELINE_WIDTH} (model_scale's)")
    parser.add_argument("--out", type=Path, help="also write the raw timelines and the accounting as JSON")
    parser.add_argument("--receives", type=lambda text: text.split(","), default=["on_demand"],
                        help="comma-separated distributed.pipeline.receives settings to time (on_demand, ahead; "
                             "default on_demand); cases with ahead are named <schedule>_ahead_m<m>")
    args = parser.parse_args()
    if not args.receives or any(r not in ("on_demand", "ahead") for r in args.receives):
        parser.error(f"--receives {','.join(args.receives)}: on_demand and/or ahead, comma-separated")
    ranks = spawn(_timeline, 2, args.repeats, args.batch, args.width, args.receives, timeout=1500,
                  env=dtrain_run_malloc())
    if any("error" in r for r in ranks):
        raise SystemExit(f"pipeline_timeline: {ranks}")
    rows = account(ranks)
    print(f"threads per process: {[r['threads'] for r in ranks]}")
    print("rows | alone (rank 0): stage 0 forward, stage 0 f+b, stage 1 f+b, whole f+b | whole f+b on both ranks "
          "at once | ping-pong (ms)")
    for rows_, alone in ranks[0]["alone"].items():
        print(f"{rows_:>4} | {1e3 * alone['stage0_forward']:.1f}, {1e3 * alone['stage0']:.1f}, "
              f"{1e3 * alone['stage1']:.1f}, {1e3 * alone['whole']:.1f} | "
              f"{1e3 * ranks[0]['together'][rows_]:.1f} / {1e3 * ranks[1]['together'][rows_]:.1f} | "
              f"{1e3 * ranks[0]['pingpong'][rows_]:.2f}")
    print("case | step | per stage: forward + backward + wait + post + other (CPU in compute) | both computing")
    for row in rows:
        parts = [f"{t['forward']:.0f} + {t['backward']:.0f} + {t['wait']:.0f} + {t['post']:.0f} + {t['other']:.0f} "
                 f"({t['cpu_in_compute']:.0f})" for t in (row["stage0"], row["stage1"])]
        print(f"{row['case']} | {row['step_ms']:.0f} | {' ; '.join(parts)} | {row['both_computing_ms']:.0f}")
    if args.out:
        args.out.write_text(json.dumps({"ranks": ranks, "accounting": rows}) + "\n")


if __name__ == "__main__":
    main()
