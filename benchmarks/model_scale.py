"""Models that do not fit one worker: memory per rank of DDP, ZeRO-1 and FSDP2, a memory cap that DDP breaks and
FSDP2 trains under, pipeline efficiency against the bubble formula, mixed-precision step time, and bf16/fp16
accuracy against fp32 on the Fashion-MNIST demo.

1. Memory (2 and 4 processes, gloo): the wide MLP of examples/wide_mlp (106 M parameters) with Adam, 2 steps
   through dtrain's strategies (allreduce = DDP, zero1, fsdp, and pipeline: 2 stages, 1F1B, 4 microbatches, at 4
   processes 2 replicas of it). Per rank: model-state bytes (local parameters, gradients, optimizer state tensors;
   DTensor shards by their local size, a pipeline's parameters by the storage they hold), peak RSS, and `dtrain
   plan`'s prediction (dtrain.plan.memory) with its error. Headline `pipeline_memory_fraction_2` = pipeline / DDP
   at 2 ranks (ideal 0.5 with equal stages). Headline `fsdp_memory_fraction_4` = FSDP2 / DDP model-state
   bytes at 4 ranks (target <= 0.30, ideal 0.25), `plan_memory_error_max`.
2. Memory cap (2 processes, root): each worker joins its own cgroup v1 memory group (a child of this process's
   group) after start-up, limited to `--cap-gb` between FSDP2's need and DDP's; the kernel's OOM killer ends a
   worker past it. DDP must fail to train, FSDP2 must train; the pipeline's result is reported. Without root the
   part is skipped with the reason.
3. Pipeline (2 processes, p = 2, wide MLP width 1024, batch 256 or `--pipeline-batch`, 1 thread each, `dtrain
   run`'s malloc settings):
   measured T = dtrain's pipeline strategy (GPipe and 1F1B) on the batch; ideal T_ideal = m x the time per stage
   of one microbatch from a 1-stage run, as the reference defines it: the whole model in one of the same
   processes through the same schedule's order over the m microbatches (gradients accumulating), run by both
   processes at the same moment (a bubble-free pipeline keeps every core busy, and on this VM two busy cores slow
   each other), / p; efficiency = T_ideal / T for m = 2, 4, 8 against m / (m + p - 1). Reported beside it: the
   same 1-stage run with the other process idle, m x one microbatch alone (no accumulation) / p, and the first
   ideal, the whole batch / p (it ignores that a microbatch runs slower per row than the whole batch). Rounds
   alternate the 1-stage runs (alone, both at once) and the pipelines; the headline
   `pipeline_efficiency_error_max` is the largest |median GPipe efficiency - formula| (target <= 0.08).
4. Precision (1 process): step time of the wide MLP in bf16 and fp16 autocast over fp32, paired per round.
5. Accuracy (full run only): `dtrain run examples/fashion_mnist/distributed.yaml` for 3 epochs on 2 workers in
   fp32, bf16 and fp16; the difference in validation accuracy (target: within 0.5 points).

    python benchmarks/model_scale.py            # all five, 3 rounds (about 15 minutes on 2 busy cores)
    python benchmarks/model_scale.py --quick    # 1 to 4 with fewer rounds, no accuracy runs
    python benchmarks/model_scale.py --skip accuracy && python benchmarks/model_scale.py --accuracy-only
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples" / "wide_mlp"))

from common import dtrain_run, dtrain_run_malloc, machine_info, markdown_table, median, ratio_headline, write_results  # noqa: E402

WIDTH, BLOCKS, INPUTS, CLASSES = 2560, 8, 256, 10
PIPELINE_BATCH, PIPELINE_WIDTH = 256, 1024
GB = 1e9


# ------------------------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Any, args: tuple[Any, ...], queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    import torch

    torch.set_num_threads(1)
    from dtrain.comm import init_distributed, shutdown_distributed

    try:
        topology = init_distributed(backend="gloo", timeout_seconds=300)
        queue.put((rank, fn(topology, *args)))
        shutdown_distributed()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}))


def spawn(fn: Any, world: int, *args: Any, timeout: float = 900, env: dict[str, str] | None = None
          ) -> list[dict[str, Any]]:
    """Run `fn(topology, *args)` on `world` processes (started with `env` added to this process's environment:
    what glibc reads at start-up must be there before); a process that dies without answering (the OOM killer of
    a memory cap) ends the run at once and is reported with its exit code."""
    import queue as queues

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_entry, args=(rank, world, port, fn, args, queue)) for rank in range(world)]
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        for proc in procs:
            proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, value = queue.get(timeout=1)
            except queues.Empty:
                dead = [r for r, proc in enumerate(procs) if r not in results and proc.exitcode not in (None, 0)]
                if dead:
                    for r in dead:
                        results[r] = {"error": f"died with exit code {procs[r].exitcode}",
                                      "exitcode": procs[r].exitcode}
                    break
                continue
            results[rank] = value
            if "error" in value:
                break
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=20)
    return [results.get(rank, {"error": "no answer (killed or hung)"}) for rank in range(world)]


# ------------------------------------------------------------------------------------------- 1. memory


def _local_bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _strategy(layout: str, topology: Any) -> Any:
    from dtrain.sync.allreduce import AllReduceStrategy
    from dtrain.sync.fsdp import FsdpStrategy
    from dtrain.sync.pipeline import PipelineStrategy
    from dtrain.sync.zero import Zero1Strategy

    if layout == "pipeline":  # 2 stages; at 4 ranks 2 replicas of them (pipeline x data)
        return PipelineStrategy(topology, stages=2, microbatches=4, schedule="1f1b")
    return {"ddp": AllReduceStrategy, "zero1": Zero1Strategy, "fsdp": FsdpStrategy}[layout](topology)


class _PipelineTrial:
    """What the pipeline strategy asks of a Trial: the loss of the last stage's outputs."""

    def pipeline_loss(self, outputs: Any, targets: Any) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(outputs, targets)

    def train_batch(self, batch: Any, model: Any) -> Any:
        raise NotImplementedError  # the pipeline runs its schedule instead


class _NoPhases:
    """The Trainer's phase timers, switched off."""

    def forward(self) -> Any:
        return nullcontext()

    def backward(self) -> Any:
        return nullcontext()


def return_freed_blocks() -> None:
    """Make glibc give freed blocks of 1 MiB or more back to the system at once (M_MMAP_THRESHOLD, as the
    environment variable MALLOC_MMAP_THRESHOLD_=1048576 would). By default glibc raises that threshold up to 32 MiB
    after the first large free, so FSDP2's per-block all-gather and gradient buffers (26 MB for a 2560 x 2560
    layer) stay in the heap after use: FSDP2's peak RSS at 2 ranks was 2.0 GB over start-up instead of 1.15 GB.
    Applied to every layout alike."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).mallopt(-3, 1 << 20)  # -3 = M_MMAP_THRESHOLD


def _train_steps(topology: Any, layout: str, steps: int, batch: int) -> dict[str, Any]:
    """Build the wide MLP under `layout`, train `steps` Adam steps; model-state bytes and peak RSS."""
    import torch
    import torch.nn.functional as F
    from model_def import build_wide_mlp  # type: ignore[attr-defined]  # examples/wide_mlp's, on sys.path here

    return_freed_blocks()
    torch.manual_seed(0)
    strategy = _strategy(layout, topology)
    # FSDP2 and the pipeline as the Trainer builds them: on the meta device on every rank but rank 0
    # (ShardedConstruction)
    with strategy.model_construction() if hasattr(strategy, "model_construction") else nullcontext():
        model = build_wide_mlp(INPUTS, WIDTH, BLOCKS, CLASSES)
    parameters = sum(p.numel() for p in model.parameters())
    wrapped = strategy.wrap_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if hasattr(strategy, "wrap_optimizer"):
        optimizer = strategy.wrap_optimizer(optimizer)
    inputs, labels = torch.randn(batch, INPUTS), torch.randint(0, CLASSES, (batch,))
    for _ in range(steps):
        if layout == "pipeline":
            strategy.forward_backward(wrapped, (inputs, labels), _PipelineTrial().train_batch, loss_scale=1.0,
                                      communicate=True, phases=_NoPhases())
        else:
            F.cross_entropy(wrapped(inputs), labels).backward()
        strategy.step(optimizer)
    if layout == "pipeline":  # the other stages' parameters keep their shapes but hold no storage
        weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    else:
        weights = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    state = sum(_local_bytes(v) for s in local_optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1)
    return {"parameters": parameters, "weight_bytes": weights, "gradient_bytes": grads, "optimizer_bytes": state,
            "model_state_bytes": weights + grads + state,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def memory_rows(worlds: list[int], log: Any) -> list[dict[str, Any]]:
    from dtrain.plan.memory import model_state_bytes

    rows = []
    for world in worlds:
        for layout in ("ddp", "zero1", "fsdp", "pipeline"):
            log(f"memory: {layout} on {world} processes ...")
            ranks = spawn(_train_steps, world, layout, 2, 8)
            if any("error" in r for r in ranks):
                raise RuntimeError(f"{layout} x{world}: {ranks}")
            measured = max(r["model_state_bytes"] for r in ranks)
            predicted = (model_state_bytes(ranks[0]["parameters"], "ddp", world // 2, "adam", stages=2)
                         if layout == "pipeline" else model_state_bytes(ranks[0]["parameters"], layout, world, "adam")
                         ).total_bytes
            rows.append({"part": "memory", "layout": layout, "ranks": world, "parameters": ranks[0]["parameters"],
                         "model_state_bytes_max_rank": measured,
                         "model_state_bytes_per_rank": [r["model_state_bytes"] for r in ranks],
                         "optimizer_bytes_per_rank": [r["optimizer_bytes"] for r in ranks],
                         "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
                         "plan_bytes": predicted, "plan_error": abs(predicted - measured) / measured})
            log(f"  model state {measured / GB:.3f} GB per rank (plan {predicted / GB:.3f}), peak RSS "
                f"{max(r['peak_rss_bytes'] for r in ranks) / GB:.2f} GB")
    return rows


# ---------------------------------------------------------------------------------------- 2. memory cap


def memory_cgroup_parent() -> tuple[Path | None, str]:
    """This process's own cgroup v1 memory group, under which the capped workers get child groups (so they stay
    inside whatever limits this process already has); None and the reason when that is not possible."""
    if os.geteuid() != 0:
        return None, "needs root (a cgroup v1 memory group per worker); run as root, or --skip cap"
    relative = next((line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                     if line.split(":", 2)[1] == "memory"), None)
    root = Path("/sys/fs/cgroup/memory")
    if relative is None or not (root / relative.lstrip("/") / "memory.limit_in_bytes").exists():
        return None, "no cgroup v1 memory controller at /sys/fs/cgroup/memory (cgroup v2 hosts: not supported here)"
    return root / relative.lstrip("/"), ""


def _capped(topology: Any, layout: str, groups: list[str]) -> dict[str, Any]:
    """Join this rank's capped memory group (after start-up: what it allocates from now on is charged to it and the
    kernel's OOM killer ends it past the limit), then train 2 Adam steps."""
    group = Path(groups[topology.rank])
    (group / "cgroup.procs").write_text(str(os.getpid()))
    result = _train_steps(topology, layout, 2, 8)
    return {"trained": True, "model_state_bytes": result["model_state_bytes"],
            "peak_rss_bytes": result["peak_rss_bytes"]}


def cap_rows(cap_gb: float, log: Any, ranks: int = 2) -> list[dict[str, Any]]:
    """DDP, FSDP2 and a 2-stage pipeline on `ranks` processes, each worker in its own memory cgroup limited to
    `cap_gb` over its size at start-up. Per worker: whether it trained, the group's peak usage
    (`memory.max_usage_in_bytes`) and the OOM kills the kernel counted."""
    parent, reason = memory_cgroup_parent()
    if parent is None:
        log(f"memory cap: skipped: {reason}")
        return [{"part": "memory_cap", "skipped": reason}]
    rows = []
    for layout in ("ddp", "fsdp", "pipeline"):
        log(f"memory cap: {layout} on {ranks} processes, each limited to {cap_gb:g} GB over start-up (cgroup) ...")
        groups = [parent / f"dtrain-model-scale-{os.getpid()}-{layout}-{rank}" for rank in range(ranks)]
        for group in groups:
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(int(cap_gb * GB)))
        try:
            results = spawn(_capped, ranks, layout, [str(g) for g in groups], timeout=900)
            usage = [int((g / "memory.max_usage_in_bytes").read_text()) for g in groups]
            kills = [_oom_kills(g) for g in groups]
        finally:
            for group in groups:
                group.rmdir()
        trained = all(r.get("trained") for r in results)
        rows.append({"part": "memory_cap", "layout": layout, "ranks": ranks, "cap_bytes": cap_gb * GB,
                     "trained": trained, "max_usage_bytes_per_rank": usage, "oom_kills_per_rank": kills,
                     "details": results})
        log(f"  {layout}: {'trained' if trained else 'failed'}; peak usage per rank "
            f"{', '.join(f'{u / GB:.2f}' for u in usage)} GB; OOM kills {kills}; "
            f"{[r.get('error') for r in results if 'error' in r]}")
    return rows


def _oom_kills(group: Path) -> int | None:
    """The group's `oom_kill` count (kernels from 4.13), else None."""
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return None


# ------------------------------------------------------------------------------------------- 3. pipeline


def variant_name(schedule: str, receives: str) -> str:
    """The name of a pipeline variant: the schedule, with `_ahead` for receives posted ahead (`_variant` reads it)."""
    return schedule if receives == "on_demand" else f"{schedule}_{receives}"


def _variant(name: str) -> tuple[str, str]:
    """A pipeline variant's schedule and receives: `gpipe`, `1f1b` (torch's order: receives on demand) or the same
    with `_ahead` (distributed.pipeline.receives: ahead)."""
    schedule, _, ahead = name.partition("_")
    return schedule, "ahead" if ahead else "on_demand"


def _pipeline(topology: Any, microbatches: list[int], variants: list[str], rounds: int, batch: int,
              width: int) -> dict[str, Any]:
    """Per round, in alternating order: the 1-stage run (rank 0 alone, rank 1 waiting in a barrier: the whole
    model's forward+backward in one process on the whole batch and on one microbatch of each size, and each stage
    alone on a microbatch), and the pipeline strategy on both ranks for each schedule and m. Every time is the
    median of 3 after a warm-up, in the same worker processes (same threads, allocator, model and batch)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from model_def import build_wide_mlp  # type: ignore[attr-defined]  # examples/wide_mlp's, on sys.path here

    from dtrain.sync.pipeline import PipelineStrategy, cut_model

    torch.manual_seed(0)
    inputs, labels = torch.randn(batch, INPUTS), torch.randint(0, CLASSES, (batch,))
    trial, phases = _PipelineTrial(), _NoPhases()
    strategies = {}
    for variant in variants:
        schedule, receives = _variant(variant)
        for m in microbatches:
            model = build_wide_mlp(INPUTS, width, BLOCKS, CLASSES)
            strategy = PipelineStrategy(topology, stages=2, microbatches=m, schedule=schedule, receives=receives)
            strategies[f"{variant}_m{m}"] = (strategy, strategy.wrap_model(model))
    schedules = sorted({_variant(variant)[0] for variant in variants})
    reference = build_wide_mlp(INPUTS, width, BLOCKS, CLASSES)
    first, last = cut_model(reference, 2, [])  # the same cut as the strategy's (equal runs of children)

    def median_of_3(run: Any, synchronized: bool) -> float:
        run()
        times = []
        for _ in range(3):
            if synchronized:
                dist.barrier()
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return sorted(times)[1]

    def one_stage(rows: int, part: str) -> Any:
        x, y = inputs[:rows], labels[:rows]
        if part == "stage1":
            with torch.no_grad():
                x = first(x)
            x.requires_grad_(True)  # as the pipeline's second stage receives it: its input gradient is sent back

        def run() -> None:
            if part == "whole":
                F.cross_entropy(reference(x), y).backward()
            elif part == "stage0":
                first(x).backward(torch.ones(rows, width))
            else:
                F.cross_entropy(last(x), y).backward()
            reference.zero_grad(set_to_none=True)
        return run

    def one_stage_schedule(m: int, schedule: str) -> Any:
        """The whole model as one stage through the schedule's order over m microbatches (GPipe: every forward,
        then every backward; 1F1B with one stage: forward and backward in turn), gradients accumulating."""
        rows = batch // m
        chunks = [(inputs[i * rows:(i + 1) * rows], labels[i * rows:(i + 1) * rows]) for i in range(m)]

        def run() -> None:
            if schedule == "gpipe":
                losses = [F.cross_entropy(reference(x), y) for x, y in chunks]
                for loss in losses:
                    loss.backward()
            else:
                for x, y in chunks:
                    F.cross_entropy(reference(x), y).backward()
            reference.zero_grad(set_to_none=True)
        return run

    sizes = sorted({batch} | {batch // m for m in microbatches}, reverse=True)
    out: dict[str, list[float]] = {}

    def alone() -> None:
        if topology.rank == 0:
            for rows in sizes:
                for part in ("whole", "stage0", "stage1"):
                    out.setdefault(f"{part}_b{rows}", []).append(median_of_3(one_stage(rows, part), False))
            for schedule in schedules:
                for m in microbatches:
                    out.setdefault(f"one_stage_{schedule}_m{m}", []).append(
                        median_of_3(one_stage_schedule(m, schedule), False))
        dist.barrier()

    def together() -> None:
        # Both processes run the 1-stage schedule at the same moment: the machine as busy as in a bubble-free
        # pipeline, whose p stages all compute all the time (on this VM two busy cores slow each other).
        for schedule in schedules:
            for m in microbatches:
                out.setdefault(f"one_stage_both_{schedule}_m{m}", []).append(
                    median_of_3(one_stage_schedule(m, schedule), True))

    def piped(backwards: bool) -> None:
        for key, (strategy, model) in reversed(strategies.items()) if backwards else strategies.items():
            def step(strategy: Any = strategy, model: Any = model) -> None:
                strategy.forward_backward(model, (inputs, labels), trial.train_batch, loss_scale=1.0,
                                          communicate=True, phases=phases)
                model.zero_grad(set_to_none=True)
            out.setdefault(key, []).append(median_of_3(step, True))

    for round_ in range(rounds):
        forward = round_ % 2 == 0  # odd rounds run everything in the reverse order
        for run in ((alone, together, lambda: piped(False)) if forward else (lambda: piped(True), together, alone)):
            run()
    return {"threads": torch.get_num_threads(), "times": out}


IDEALS = {  # name -> (what T_ideal is, for the results)
    "": "the 1-stage run of the same schedule over the m microbatches (the whole model in one process, gradients "
        "accumulating), run by both processes at once, / p: m x the time per stage of one microbatch from a 1-stage "
        "run with every core as busy as in a bubble-free pipeline (headline)",
    "alone_ideal": "the same 1-stage run with the other process idle / p (the headline of 05caa59 to a1846aa)",
    "isolated_microbatch_ideal": "m x one microbatch's forward+backward alone (no accumulation) / p",
    "whole_batch_ideal": "the whole batch's forward+backward in one process / p (this benchmark's earlier ideal)",
}


def pipeline_rows(microbatches: list[int], variants: list[str], rounds: int, batch: int, width: int,
                  log: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Efficiency = T_ideal / T per round, for the four ideals of IDEALS. The headline's is the reference's "time
    per stage from a 1-stage run", measured with both processes computing at once: what the pipeline's stages do
    without the bubble and the sends, on a machine as busy as theirs. The others leave out that the other core is
    busy (alone), gradient accumulation over the microbatches (isolated microbatch), or also that a microbatch runs
    slower per row than the whole batch (whole batch)."""
    from dtrain.plan.memory import pipeline_efficiency

    stages = 2
    log(f"pipeline: p={stages}, m={microbatches}, {'/'.join(variants)}, batch {batch}, width {width}, "
        f"{rounds} rounds ...")
    ranks = spawn(_pipeline, 2, microbatches, variants, rounds, batch, width, timeout=1200, env=dtrain_run_malloc())
    if any("error" in r for r in ranks):
        raise RuntimeError(f"pipeline: {ranks}")
    times = ranks[0]["times"]
    rows: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    errors: dict[str, list[float]] = {}
    for variant in variants:
        schedule, receives = _variant(variant)
        for m in microbatches:
            rows_per_micro = batch // m
            measured = times[f"{variant}_m{m}"]
            ideals = {"": [t / stages for t in times[f"one_stage_both_{schedule}_m{m}"]],
                      "alone_ideal": [t / stages for t in times[f"one_stage_{schedule}_m{m}"]],
                      "isolated_microbatch_ideal": [m * t / stages for t in times[f"whole_b{rows_per_micro}"]],
                      "whole_batch_ideal": [t / stages for t in times[f"whole_b{batch}"]]}
            formula = pipeline_efficiency(stages, m)
            row: dict[str, Any] = {"part": "pipeline", "schedule": schedule, "receives": receives,
                                   "microbatches": m, "stages": stages,
                                   "microbatch_rows": rows_per_micro, "formula": formula,
                                   "pipeline_seconds": measured}
            for ideal, seconds in ideals.items():
                key = "_".join(part for part in ("pipeline_efficiency", ideal,
                                                 variant.removeprefix("gpipe").lstrip("_"), f"m{m}") if part)
                ratio = ratio_headline(key, seconds, measured)
                headline[key] = ratio[key]
                headline[f"{key}_per_round"] = ratio[f"{key}_per_round"]
                if not ideal:
                    headline[f"{key}_min"], headline[f"{key}_max"] = ratio[f"{key}_min"], ratio[f"{key}_max"]
                name = ideal or "efficiency"
                row[name if not ideal else f"efficiency_{ideal}"] = ratio[key]
                row[f"{name}_per_round" if not ideal else f"efficiency_{ideal}_per_round"] = ratio[f"{key}_per_round"]
                row["ideal_seconds" if not ideal else f"{ideal}_seconds"] = seconds
                row["error" if not ideal else f"error_{ideal}"] = abs(ratio[key] - formula)
                errors.setdefault("_".join(part for part in (variant, ideal) if part), []).append(
                    abs(ratio[key] - formula))
            stage0, stage1 = times[f"stage0_b{rows_per_micro}"], times[f"stage1_b{rows_per_micro}"]
            row.update(stage0_seconds=stage0, stage1_seconds=stage1,
                       stage_balance=median([b / a for a, b in zip(stage0, stage1, strict=True)]))
            if receives == "ahead" and f"{schedule}_m{m}" in times:  # paired with torch's order, round by round
                key = f"receives_ahead_speedup_{schedule}_m{m}"
                speedup = ratio_headline(key, times[f"{schedule}_m{m}"], measured)
                headline.update(speedup)
                row["speedup_over_on_demand"] = speedup[key]
            rows.append(row)
            log(f"  {variant} m={m}: efficiency {row['efficiency']:.3f} (formula {formula:.3f}); with the 1-stage "
                f"run alone {row['efficiency_alone_ideal']:.3f}, the isolated "
                f"microbatch ideal {row['efficiency_isolated_microbatch_ideal']:.3f}, the whole-batch ideal "
                f"{row['efficiency_whole_batch_ideal']:.3f}; stage 1 / stage 0 time {row['stage_balance']:.2f}")
    if "gpipe" in errors:  # torch's GPipe order (receives on demand), the headline
        headline["pipeline_efficiency_error_max"] = max(errors["gpipe"])
        headline["pipeline_efficiency_error_max_per_round"] = [
            max(abs(headline[f"pipeline_efficiency_m{m}_per_round"][r] - pipeline_efficiency(stages, m))
                for m in microbatches) for r in range(rounds)]
    for key, values in errors.items():
        if key != "gpipe":
            headline[f"pipeline_efficiency_error_max_{key}"] = max(values)
    headline["pipeline_threads_per_process"] = [r["threads"] for r in ranks]
    return rows, headline


# ------------------------------------------------------------------------------------------ 4. precision


def precision_rows(rounds: int, log: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from model_def import build_wide_mlp  # type: ignore[attr-defined]  # examples/wide_mlp's, on sys.path here

    from dtrain.train.precision import cpu_has_native_bf16

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_wide_mlp(INPUTS, 1024, BLOCKS, CLASSES)
    inputs, labels = torch.randn(128, INPUTS), torch.randint(0, CLASSES, (128,))

    def step(dtype: Any) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"fp32": [], "bf16": [], "fp16": []}
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name in times:
        step(dtypes[name])  # warm-up
    for _ in range(rounds):
        for name, dtype in dtypes.items():
            times[name].append(median([step(dtype) for _ in range(5)]))
    headline = {**ratio_headline("bf16_step_time_over_fp32", times["bf16"], times["fp32"]),
                **ratio_headline("fp16_step_time_over_fp32", times["fp16"], times["fp32"]),
                "cpu_has_native_bf16": cpu_has_native_bf16()}
    log(f"precision: bf16/fp32 {headline['bf16_step_time_over_fp32']:.3f}, fp16/fp32 "
        f"{headline['fp16_step_time_over_fp32']:.3f}")
    return [{"part": "precision", "seconds": times}], headline


# ------------------------------------------------------------------------------------------- 5. accuracy


def accuracy_rows(epochs: int, log: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    config = REPO / "examples" / "fashion_mnist" / "distributed.yaml"
    rows, accuracy = [], {}
    with tempfile.TemporaryDirectory(prefix="dtrain-model-scale-") as tmp:
        for precision in ("fp32", "bf16", "fp16"):
            log(f"accuracy: Fashion-MNIST {epochs} epochs, 2 workers, {precision} ...")
            started = time.perf_counter()
            summary = dtrain_run(config, Path(tmp) / precision, [f"searcher.max_length={{epochs: {epochs}}}",
                                                                 f"optimizations.precision={precision}"], Path(tmp))
            accuracy[precision] = float(summary["validation"]["accuracy"])
            rows.append({"part": "accuracy", "precision": precision, "accuracy": accuracy[precision],
                         "seconds": time.perf_counter() - started})
            log(f"  {precision}: accuracy {accuracy[precision]:.4f}")
    headline = {f"accuracy_{p}": a for p, a in accuracy.items()}
    headline["bf16_accuracy_gap_points"] = 100 * (accuracy["fp32"] - accuracy["bf16"])
    headline["fp16_accuracy_gap_points"] = 100 * (accuracy["fp32"] - accuracy["fp16"])
    return rows, headline


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, no accuracy runs")
    parser.add_argument("--rounds", type=int, help="pipeline and precision rounds (default 3, quick 2)")
    parser.add_argument("--cap-gb", type=float, default=1.45,
                        help="memory cap part: what each of the 2 workers may allocate after start-up, enforced by "
                             "a cgroup v1 memory group per worker (needs root; default 1.45: DDP peaks at ~1.8 GB "
                             "over start-up for the 106 M-parameter MLP with Adam, FSDP2 on 2 ranks at ~1.15)")
    parser.add_argument("--epochs", type=int, default=3, help="accuracy runs' length (default 3)")
    parser.add_argument("--accuracy-only", action="store_true",
                        help="only part 5, into results/model_scale_accuracy.json/.md (so the long accuracy runs "
                             "can take the benchmark lock on their own)")
    parser.add_argument("--results-name", help="results file name (default model_scale, or model_scale_accuracy)")
    parser.add_argument("--pipeline-batch", type=int, default=PIPELINE_BATCH,
                        help=f"pipeline part: rows per step, split into m = 2, 4, 8 microbatches (default "
                             f"{PIPELINE_BATCH}; a multiple of 8)")
    parser.add_argument("--pipeline-receives", type=lambda text: text.split(","), default=["on_demand"],
                        help="pipeline part: comma-separated distributed.pipeline.receives settings to measure, "
                             "each with both schedules in the same rounds: on_demand (torch's order, the default), "
                             "ahead (every receive of a step posted when it starts); with both, "
                             "receives_ahead_speedup_<schedule>_m<m> is T(on_demand) / T(ahead) paired per round")
    parser.add_argument("--skip", action="append", default=[], choices=["memory", "cap", "pipeline", "precision",
                                                                         "accuracy"], help="leave a part out")
    args = parser.parse_args()
    unknown = [r for r in args.pipeline_receives if r not in ("on_demand", "ahead")]
    if unknown or len(set(args.pipeline_receives)) != len(args.pipeline_receives):
        parser.error(f"--pipeline-receives {','.join(args.pipeline_receives)}: each of on_demand and ahead at most "
                     "once, comma-separated; try on_demand,ahead")
    if args.pipeline_batch <= 0 or args.pipeline_batch % 8:
        parser.error(f"--pipeline-batch {args.pipeline_batch}: must be a positive multiple of 8 (it is split into "
                     "2, 4 and 8 equal microbatches); try 256 or 1024")
    rounds = args.rounds or (2 if args.quick else 3)
    log = lambda text: print(f"model_scale: {text}", flush=True)  # noqa: E731
    rows: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    failures: dict[str, str] = {}

    def part(name: str, run: Any) -> None:
        """Run one part; a failure is recorded in the results (and the next part still runs)."""
        if name in args.skip:
            return
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - reported in the results, not hidden
            failures[name] = f"{type(exc).__name__}: {str(exc)[:400]}"
            log(f"{name} FAILED: {failures[name]}")

    def memory() -> None:
        found = memory_rows([2, 4], log)
        rows.extend(found)
        by = {(r["layout"], r["ranks"]): r["model_state_bytes_max_rank"] for r in found}
        headline["fsdp_memory_fraction_4"] = by[("fsdp", 4)] / by[("ddp", 4)]
        headline["zero1_memory_fraction_4"] = by[("zero1", 4)] / by[("ddp", 4)]
        headline["fsdp_memory_fraction_2"] = by[("fsdp", 2)] / by[("ddp", 2)]
        headline["pipeline_memory_fraction_2"] = by[("pipeline", 2)] / by[("ddp", 2)]
        headline["plan_memory_error_max"] = max(r["plan_error"] for r in found)

    def cap() -> None:
        found = cap_rows(args.cap_gb, log)
        rows.extend(found)
        if "skipped" in found[0]:
            headline["memory_cap_skipped"] = found[0]["skipped"]
            return
        headline["memory_cap_gb"] = args.cap_gb
        headline["memory_cap_ddp_trained"] = found[0]["trained"]
        headline["memory_cap_fsdp_trained"] = found[1]["trained"]
        headline["memory_cap_ddp_oom_kills"] = sum(k or 0 for k in found[0]["oom_kills_per_rank"])
        headline["memory_cap_fsdp_peak_gb"] = max(found[1]["max_usage_bytes_per_rank"]) / GB
        headline["memory_cap_pipeline_trained"] = found[2]["trained"]
        headline["memory_cap_pipeline_peak_gb"] = max(found[2]["max_usage_bytes_per_rank"]) / GB

    def pipeline() -> None:
        variants = [variant_name(schedule, receives) for receives in args.pipeline_receives
                    for schedule in ("gpipe", "1f1b")]
        found, found_headline = pipeline_rows([2, 4, 8], variants, rounds, args.pipeline_batch, PIPELINE_WIDTH, log)
        rows.extend(found)
        headline.update(found_headline)

    def precision() -> None:
        found, found_headline = precision_rows(rounds * 2, log)
        rows.extend(found)
        headline.update(found_headline)

    def accuracy() -> None:
        found, found_headline = accuracy_rows(args.epochs, log)
        rows.extend(found)
        headline.update(found_headline)

    if args.accuracy_only:
        part("accuracy", accuracy)
    else:
        part("memory", memory)
        part("cap", cap)
        part("pipeline", pipeline)
        part("precision", precision)
        if not args.quick and "accuracy" not in args.skip:
            part("accuracy", accuracy)
    if failures:
        headline["failed_parts"] = failures
    markdown = _markdown(headline, rows, args)
    name = args.results_name or ("model_scale_accuracy" if args.accuracy_only else "model_scale")
    path = write_results(name, headline, rows, markdown, machine_info(),
                         extra={"settings": {"quick": args.quick, "rounds": rounds, "width": WIDTH, "blocks": BLOCKS,
                                             "cap_gb": args.cap_gb, "pipeline_batch": args.pipeline_batch,
                                             "pipeline_width": PIPELINE_WIDTH, "pipeline_malloc": dtrain_run_malloc()}})
    print(markdown)
    print(f"model_scale: wrote {path}")


def _markdown(headline: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["# model_scale", "", "Headline:", ""]
    lines += [f"- `{k}`: {v:.4g}" if isinstance(v, float) else f"- `{k}`: {v}" for k, v in headline.items()
              if not k.endswith("_per_round")]
    memory = [r for r in rows if r["part"] == "memory"]
    if memory:
        lines += ["", "Model-state bytes per rank (largest rank) against `dtrain plan`:", "",
                  markdown_table(["layout", "ranks", "measured GB", "plan GB", "plan error", "peak RSS GB (max)"],
                                 [[r["layout"], r["ranks"], f"{r['model_state_bytes_max_rank'] / GB:.3f}",
                                   f"{r['plan_bytes'] / GB:.3f}", f"{r['plan_error']:.1%}",
                                   f"{max(r['peak_rss_bytes_per_rank']) / GB:.2f}"] for r in memory])]
    capped = [r for r in rows if r["part"] == "memory_cap" and "skipped" not in r]
    if capped:
        lines += ["", f"Memory cap (each worker's cgroup v1 memory group limited to {args.cap_gb:g} GB over "
                  "start-up, no swap):", "",
                  markdown_table(["layout", "ranks", "trained", "peak usage per rank GB", "OOM kills", "errors"],
                                 [[r["layout"], r["ranks"], r["trained"],
                                   ", ".join(f"{u / GB:.2f}" for u in r["max_usage_bytes_per_rank"]),
                                   r["oom_kills_per_rank"],
                                   "; ".join(d["error"] for d in r["details"] if "error" in d) or "-"]
                                  for r in capped])]
    pipe = [r for r in rows if r["part"] == "pipeline"]
    if pipe:
        lines += ["", f"Pipeline efficiency T_ideal / T (p = 2, wide MLP width {PIPELINE_WIDTH}, "
                  f"batch {args.pipeline_batch}, 1 thread per process, "
                  "dtrain run's malloc settings), medians of the per-round ratios. Headline T_ideal: "
                  f"{IDEALS['']}. Beside it: alone = {IDEALS['alone_ideal']}; "
                  f"isolated microbatch = {IDEALS['isolated_microbatch_ideal']}; "
                  f"whole batch = {IDEALS['whole_batch_ideal']}.", "",
                  markdown_table(["schedule", "receives", "m", "efficiency", "per round", "formula m/(m+p-1)", "error",
                                  "1-stage alone ideal (error)", "isolated-microbatch ideal (error)",
                                  "whole-batch ideal (error)",
                                  "stage 1 / stage 0 time"],
                                 [[r["schedule"], r.get("receives", "on_demand"), r["microbatches"],
                                   f"{r['efficiency']:.3f}",
                                   ", ".join(f"{e:.3f}" for e in r["efficiency_per_round"]), f"{r['formula']:.3f}",
                                   f"{r['error']:.3f}",
                                   f"{r['efficiency_alone_ideal']:.3f} ({r['error_alone_ideal']:.3f})",
                                   f"{r['efficiency_isolated_microbatch_ideal']:.3f} "
                                   f"({r['error_isolated_microbatch_ideal']:.3f})",
                                   f"{r['efficiency_whole_batch_ideal']:.3f} ({r['error_whole_batch_ideal']:.3f})",
                                   f"{r['stage_balance']:.2f}"] for r in pipe])]
    lines += ["", f"Settings: quick={args.quick}. The load averages at the start and the end are in the JSON: they say "
              "whether other work shared the machine's cores."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
