"""What checkpoints in object storage cost: write and read time of one checkpoint of the wide MLP
(examples/wide_mlp, Adam) to a local folder and to a local S3-compatible server (moto's, on loopback, as the
tests use it), and the training time a checkpoint every `period` steps takes from each step, with the upload
blocking training and with dtrain's background upload (object storage's default).

Part 1, write and read: each round writes and reads one checkpoint on each storage, back to back, in alternating
order (A B, B A, ...), through dtrain's own checkpoint code (`dtrain.train.checkpoint`: torch.save to a staging
folder, SHA-256, upload, `meta.json` last; reading verifies the checksums and loads). The headline is the median
over rounds of the paired ratio S3 / local.

Part 2, training time lost: each round trains the model for a window of `--window` steps three times, in
alternating order: without a checkpoint, with an S3 checkpoint written blocking at the window's first step, and
with one uploaded in the background (dtrain's Checkpointer as rank 0 runs it: a snapshot in host memory, then a
thread at the lowest CPU priority uploads; the window ends once the upload is committed, as the next checkpoint
would wait for it). The window is the checkpoint period (100 steps by default), so a checkpoint's cost is the
window's time minus the same round's window without one, and the share of training time lost is that cost over
the round's window without one; at another period P it is the cost over P x the round's step time. The target:
under 2 % at P = 100. moto's server runs on the same cores as training, in a session of its own (a real S3 would
take no CPU here). Not measured: a real network (loopback only), a real S3 (moto keeps objects in memory), and the
FSDP-sharded checkpoint (several processes).

    python benchmarks/checkpoint_storage.py                   # width 1024 (17 M parameters), 5 + 3 rounds
    python benchmarks/checkpoint_storage.py --quick           # width 512, 3 + 2 rounds, a window of 20 steps
    python benchmarks/checkpoint_storage.py --width 2560      # the 106 M model of model_scale.py (1.3 GB per write)
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples" / "wide_mlp"))
sys.path.insert(0, str(REPO / "tests" / "faults"))  # s3kit: the moto server the tests start

from common import alternate, machine_info, markdown_table, median, ratio_headline, rounds_of, write_results  # noqa: E402

BUCKET = "bench-ckpts"
PERIODS = (100, 1000)  # checkpoint every this many steps


def _state(width: int, blocks: int) -> tuple[Any, dict[str, Any], dict[str, Any], float]:
    """The wide MLP after two Adam steps: its state_dict, a resume state with the optimizer's, and the median
    time of a training step (batch 64) in seconds."""
    import torch
    import torch.nn.functional as F
    wide_mlp = importlib.import_module("model_def")  # examples/wide_mlp, first on sys.path above

    torch.manual_seed(0)
    model = wide_mlp.build_wide_mlp(256, width, blocks, 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs, labels = torch.randn(64, 256), torch.randint(0, 10, (64,))
    times = []
    for _ in range(7):
        started = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    state = {"optimizer": optimizer.state_dict(), "trainer": {"steps_completed": 7}, "rng": [torch.get_rng_state()]}
    return model, model.state_dict(), state, median(times[2:])


def _round(store: Any, model_state: dict[str, Any], state: dict[str, Any], step: int) -> dict[str, Any]:
    from dtrain.train import checkpoint as ckpt

    started = time.perf_counter()
    ckpt.write_checkpoint(store, step, model_state, state)
    written = time.perf_counter() - started
    started = time.perf_counter()
    ref = ckpt.find_resume_checkpoint(store)
    assert ref is not None and ref.step == step
    ckpt.load_checkpoint(ref)
    read = time.perf_counter() - started
    ckpt.prune_checkpoints(store, keep_latest=1, keep_steps=set())
    return {"write_s": written, "read_s": read}


class _Training:
    """The model trained step by step, with dtrain's Checkpointer of rank 0 writing its checkpoints to `store`."""

    def __init__(self, model: Any, store: Any) -> None:
        from types import SimpleNamespace

        import torch

        from dtrain.comm import Topology
        from dtrain.train.callbacks import StepCallbacks
        from dtrain.train.checkpointing import Checkpointer, PlainCheckpointState

        self.model, self.store = model, store
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.inputs, self.labels = torch.randn(64, 256), torch.randint(0, 10, (64,))
        topology = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                            device=torch.device("cpu"), launcher="benchmark")
        # stand-ins for what rank 0's Checkpointer asks of a plain strategy, the policy and the optimization
        strategy: Any = SimpleNamespace(unwrap_model=lambda: model, state_dict=lambda: {})
        policy: Any = SimpleNamespace(keep_latest=1, best_steps=lambda metrics: set())
        optimization = SimpleNamespace(optimizer=self.optimizer, schedule_state=lambda: {})
        self.parts: dict[str, Any] = {"optimization": optimization, "strategy": strategy, "epoch": 0.0}
        self.checkpointers = {background: Checkpointer(store, topology, PlainCheckpointState(strategy), policy,
                                                       StepCallbacks(), background=background)
                              for background in (False, True)}
        self.step = 0

    def window(self, steps: int, checkpoint: str) -> dict[str, Any]:
        """`steps` training steps, the first one followed by a checkpoint (`none`, `blocking`, `background`)."""
        import torch.nn.functional as F

        from dtrain.train.state import TrainerState

        started = time.perf_counter()
        snapshot_s, in_flight_at_end = 0.0, False
        for index in range(steps):
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(self.inputs), self.labels).backward()
            self.optimizer.step()
            self.step += 1
            if index == 0 and checkpoint != "none":
                checkpointer = self.checkpointers[checkpoint == "background"]
                begun = time.perf_counter()
                checkpointer.write(self.step, None, state=TrainerState(steps_completed=self.step), **self.parts)
                snapshot_s = time.perf_counter() - begun
        if checkpoint == "background":
            checkpointer = self.checkpointers[True]
            in_flight_at_end = checkpointer.uploads is not None and checkpointer.uploads.in_flight
            checkpointer.finish_uploads()
        if checkpoint != "none":
            assert [ref.step for ref in checkpointer.take_committed()] == [self.step - steps + 1]
        return {"window_s": time.perf_counter() - started, "checkpoint_call_s": snapshot_s,
                "upload_in_flight_at_window_end": in_flight_at_end}


def _lost(rows: list[dict[str, Any]], variant: str, period: int, window: int) -> dict[str, Any]:
    """Per round: (the variant's window - the same round's window without a checkpoint) / (period x step time)."""
    costs = [a - b for a, b in zip(rounds_of(rows, variant, "window_s"), rounds_of(rows, "none", "window_s"),
                                   strict=True)]
    periods = [period * value / window for value in rounds_of(rows, "none", "window_s")]
    return ratio_headline(f"s3_{variant}_lost_per_step_every_{period}", costs, periods)


def _sharded_rank(rank: int, world: int, port: int, args: argparse.Namespace, endpoint: str, tmp: str,
                  results: Any) -> None:
    """One rank of part 3: the wide MLP sharded by FSDP2 over `world` gloo ranks, its shards written and read back
    through torch.distributed.checkpoint with dtrain's writer and reader (`ShardFolder`), to a local folder and to
    S3 in alternating order; every rank's time is the slowest rank's (barriers around each)."""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from s3kit import KEY, SECRET
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dtrain.runs.storage import CheckpointStore, ShardFolder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    wide_mlp = importlib.import_module("model_def")
    torch.manual_seed(0)
    model = wide_mlp.build_wide_mlp(256, args.width, args.blocks, 10)
    mesh = init_device_mesh("cpu", (world,))
    for block in list(model)[1:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    F.cross_entropy(model(torch.randn(64, 256)), torch.randint(0, 10, (64,))).backward()
    optimizer.step()
    stores = {"local": CheckpointStore(url=str(Path(tmp) / "local")),
              "s3": CheckpointStore(url=f"s3://{BUCKET}/sharded", options={
                  "endpoint_url": endpoint, "key": KEY, "secret": SECRET})}
    rows, size = [], 0
    for repeat in range(args.rounds):
        for name in (("local", "s3") if repeat % 2 == 0 else ("s3", "local")):
            folder = ShardFolder(stores[name], f"sharded/step-{repeat + 1}")
            dist.barrier()
            started = time.perf_counter()
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                     storage_writer=folder.writer())
            dist.barrier()
            written = time.perf_counter() - started
            started = time.perf_counter()
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, storage_reader=folder.reader())
            dist.barrier()
            read = time.perf_counter() - started
            rows.append({"variant": name, "repeat": repeat, "write_s": written, "read_s": read})
            if rank == 0:
                if name == "local":
                    size = int(stores[name].fs.du(stores[name].path(folder.name)))
                stores[name].remove(folder.name, recursive=True)
            dist.barrier()
    if rank == 0:
        results.put({"rows": rows, "bytes": size})
    dist.destroy_process_group()


def sharded_main(args: argparse.Namespace) -> None:
    """Part 3 alone: the FSDP-sharded checkpoint's write and read times, local folder vs S3, paired rounds; writes
    results/checkpoint_storage_sharded.{json,md}."""
    import torch.multiprocessing as mp
    from s3kit import free_port, make_bucket, moto_server

    context = mp.get_context("spawn")
    results = context.Queue()
    with moto_server() as endpoint, \
            tempfile.TemporaryDirectory(prefix="bench-ckpt-sharded-") as tmp:
        make_bucket(endpoint, BUCKET)
        mp.start_processes(_sharded_rank, args=(args.ranks, free_port(), args, endpoint, tmp, results),
                           nprocs=args.ranks, start_method="spawn")
        found = results.get(timeout=60)
    rows = found["rows"]
    headline: dict[str, Any] = {
        **ratio_headline("s3_over_local_write", rounds_of(rows, "s3", "write_s"), rounds_of(rows, "local", "write_s")),
        **ratio_headline("s3_over_local_read", rounds_of(rows, "s3", "read_s"), rounds_of(rows, "local", "read_s")),
        "ranks": args.ranks, "checkpoint_bytes": found["bytes"]}
    for name in ("local", "s3"):
        for key in ("write_s", "read_s"):
            headline[f"{name}_{key}"] = median(rounds_of(rows, name, key))
    machine = machine_info()
    table = markdown_table(["storage", "write (s, median)", "read (s, median)"],
                           [[name, f"{headline[f'{name}_write_s']:.3f}", f"{headline[f'{name}_read_s']:.3f}"]
                            for name in ("local", "s3")])
    markdown = (
        f"# Checkpoint storage, FSDP-sharded: local folder vs local S3 server\n\n"
        f"Wide MLP width {args.width}, {args.blocks} blocks with Adam, sharded by FSDP2 over {args.ranks} gloo ranks "
        f"on CPU: {found['bytes'] / 1e6:.0f} MB of shards per checkpoint, written and read back by every rank through "
        f"torch.distributed.checkpoint with dtrain's writer and reader (DCP's `.metadata` last); a time is the "
        f"slowest rank's. {args.rounds} paired rounds in alternating order. S3 is moto's server on loopback, in a "
        f"session of its own. {machine['cores']} cores shared with other users (load {machine_info_load()}). "
        f"Sharded checkpoints are written blocking (no background upload).\n\n{table}\n\n"
        f"S3 / local, median of paired rounds: write {headline['s3_over_local_write']:.2f}x "
        f"({headline['s3_over_local_write_min']:.2f}-{headline['s3_over_local_write_max']:.2f}), read "
        f"{headline['s3_over_local_read']:.2f}x ({headline['s3_over_local_read_min']:.2f}-"
        f"{headline['s3_over_local_read_max']:.2f}).\n\n"
        f"Reproduce: `python benchmarks/checkpoint_storage.py --sharded --width {args.width} --blocks {args.blocks} "
        f"--rounds {args.rounds} --ranks {args.ranks}`\n")
    path = write_results("checkpoint_storage_sharded", headline, rows, markdown, machine, extra={"settings": {
        "width": args.width, "blocks": args.blocks, "rounds": args.rounds, "ranks": args.ranks}})
    print(markdown)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of part 1 (write and read)")
    parser.add_argument("--train-rounds", type=int, default=3, help="rounds of part 2 (training time lost)")
    parser.add_argument("--window", type=int, default=100, help="training steps per window in part 2 (the "
                        "checkpoint period it measures; another period is scaled from it)")
    parser.add_argument("--quick", action="store_true", help="width 512, 3 + 2 rounds, a window of 20 steps")
    parser.add_argument("--sharded", action="store_true", help="part 3 alone: the FSDP-sharded checkpoint "
                        "(results/checkpoint_storage_sharded)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of part 3")
    args = parser.parse_args()
    if args.quick:
        args.width, args.rounds, args.train_rounds, args.window = 512, 3, 2, 20
    if args.sharded:
        sharded_main(args)
        return
    import torch
    from s3kit import KEY, SECRET, make_bucket, missing_packages, moto_server

    from dtrain.runs.storage import CheckpointStore

    if missing_packages():
        raise SystemExit(f"benchmarks/checkpoint_storage.py {missing_packages()}")
    torch.set_num_threads(1)
    model, model_state, state, step_s = _state(args.width, args.blocks)
    parameters = sum(p.numel() for p in model.parameters())
    with moto_server() as endpoint, \
            tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        make_bucket(endpoint, BUCKET)
        stores = {"local": CheckpointStore(url=str(Path(tmp) / "local")),
                  "s3": CheckpointStore(url=f"s3://{BUCKET}/bench", options={
                      "endpoint_url": endpoint, "key": KEY, "secret": SECRET})}
        def one_round(store: Any) -> Callable[[int], dict[str, Any]]:
            return lambda repeat: _round(store, model_state, state, repeat + 1)

        rows = alternate([(name, one_round(store)) for name, store in stores.items()], args.rounds)
        sizes = {name: stores["local"].size(f"step-{args.rounds}/{name}") for name in ("model.pt", "state.pt")}
        training = _Training(model, CheckpointStore(url=f"s3://{BUCKET}/training", options=stores["s3"].options))
        training.window(3, "none")  # warm up
        def windows(checkpoint: str) -> Callable[[int], dict[str, Any]]:
            return lambda repeat: training.window(args.window, checkpoint)

        train_rows = alternate([(name, windows(name)) for name in ("none", "background", "blocking")],
                               args.train_rounds)
    headline: dict[str, Any] = {
        **ratio_headline("s3_over_local_write", rounds_of(rows, "s3", "write_s"), rounds_of(rows, "local", "write_s")),
        **ratio_headline("s3_over_local_read", rounds_of(rows, "s3", "read_s"), rounds_of(rows, "local", "read_s")),
        "parameters": parameters, "checkpoint_bytes": sum(sizes.values()), "step_seconds": step_s}
    for name in stores:
        for key in ("write_s", "read_s"):
            headline[f"{name}_{key}"] = median(rounds_of(rows, name, key))
        for period in PERIODS:
            headline[f"{name}_share_of_step_every_{period}"] = headline[f"{name}_write_s"] / (period * step_s)
    for variant in ("background", "blocking"):
        for period in PERIODS:
            headline.update(_lost(train_rows, variant, period, args.window))
        headline[f"s3_{variant}_checkpoint_call_s"] = median(rounds_of(train_rows, variant, "checkpoint_call_s"))
    headline["window_step_seconds"] = median([t / args.window for t in rounds_of(train_rows, "none", "window_s")])
    headline["uploads_in_flight_at_window_end"] = sum(
        bool(row["upload_in_flight_at_window_end"]) for row in train_rows if row["variant"] == "background")
    machine = machine_info()
    table = markdown_table(
        ["storage", "write (s, median)", "read (s, median)"] + [f"write / {p} steps" for p in PERIODS],
        [[name, f"{headline[f'{name}_write_s']:.3f}", f"{headline[f'{name}_read_s']:.3f}",
          *(f"{headline[f'{name}_share_of_step_every_{p}']:.2%}" for p in PERIODS)] for name in stores])
    lost_table = markdown_table(
        ["S3 checkpoint", "training blocked (s, median)", *(f"lost per step, every {p} steps" for p in PERIODS),
         "per round, every 100 steps"],
        [[variant, f"{headline[f's3_{variant}_checkpoint_call_s']:.3f}",
          *(f"{headline[f's3_{variant}_lost_per_step_every_{p}']:.2%}" for p in PERIODS),
          ", ".join(f"{value:.2%}" for value in headline[f"s3_{variant}_lost_per_step_every_100_per_round"])]
         for variant in ("background", "blocking")])
    met = headline["s3_background_lost_per_step_every_100"] < 0.02
    markdown = (
        f"# Checkpoint storage: local folder vs local S3 server\n\n"
        f"Wide MLP width {args.width}, {args.blocks} blocks ({parameters / 1e6:.1f} M parameters, Adam): "
        f"{sum(sizes.values()) / 1e6:.0f} MB per checkpoint; a training step (batch 64, 1 thread) "
        f"{step_s * 1e3:.0f} ms before part 1, {headline['window_step_seconds'] * 1e3:.0f} ms in part 2's windows "
        f"(median). S3 is moto's server on loopback (objects in memory, in Python), on the same cores in a session "
        f"of its own (it stands in for a server on other machines, which would take no CPU here). "
        f"{machine['cores']} cores shared with other users (load {machine_info_load()}).\n\n"
        f"## Write and read ({args.rounds} paired rounds)\n\n{table}\n\n"
        f"S3 / local, median of paired rounds: write {headline['s3_over_local_write']:.2f}x "
        f"({headline['s3_over_local_write_min']:.2f}-{headline['s3_over_local_write_max']:.2f}), read "
        f"{headline['s3_over_local_read']:.2f}x ({headline['s3_over_local_read_min']:.2f}-"
        f"{headline['s3_over_local_read_max']:.2f}).\n\n"
        f"## Training time lost to an S3 checkpoint ({args.train_rounds} paired rounds of {args.window}-step "
        f"windows)\n\n{lost_table}\n\n"
        f"Background upload every 100 steps: {headline['s3_background_lost_per_step_every_100']:.2%} of training "
        f"time (target under 2 %: {'met' if met else 'missed'}); blocking: "
        f"{headline['s3_blocking_lost_per_step_every_100']:.2%}. Uploads still in flight at a window's end (their "
        f"wait counted whole): {headline['uploads_in_flight_at_window_end']} of {args.train_rounds}.\n\n"
        f"Reproduce: `python benchmarks/checkpoint_storage.py --width {args.width} --blocks {args.blocks} "
        f"--rounds {args.rounds} --train-rounds {args.train_rounds} --window {args.window}`\n")
    path = write_results("checkpoint_storage", headline, rows + [{**row, "part": "training"} for row in train_rows],
                         markdown, machine, extra={"settings": {
                             "width": args.width, "blocks": args.blocks, "rounds": args.rounds,
                             "train_rounds": args.train_rounds, "window": args.window}})
    print(markdown)
    print(f"wrote {path}")


def machine_info_load() -> str:
    from common import STARTED, load_average

    return f"{STARTED['load_average']:.1f} at the start, {load_average():.1f} at the end"


if __name__ == "__main__":
    main()
