"""What checkpoints in object storage cost: write and read time of one checkpoint of the wide MLP
(examples/wide_mlp, Adam) to a local folder and to a local S3-compatible server (moto's, on loopback, as the
tests use it), and the training time a checkpoint takes from every step at a given checkpoint period.

Each round writes and reads one checkpoint on each storage, back to back, in alternating order (A B, B A, ...),
through dtrain's own checkpoint code (`dtrain.train.checkpoint`: torch.save to a staging folder, SHA-256, upload,
`meta.json` last; reading verifies the checksums and loads). The headline is the median over rounds of the paired
ratio S3 / local. The cost per step is the median write time divided by (period x the model's median training step
time, measured in this process): the share of training time lost when the writer blocks training, as dtrain's
does (rank 0 writes between steps). Not measured: the FSDP-sharded checkpoint (it needs several processes), a real
network (loopback only) and a real S3 (moto keeps objects in memory).

    python benchmarks/checkpoint_storage.py                   # width 1024 (17 M parameters), 8 rounds
    python benchmarks/checkpoint_storage.py --quick           # width 512, 3 rounds
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="width 512, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.width, args.rounds = 512, 3
    import torch
    from s3kit import KEY, SECRET, make_bucket, missing_packages, moto_server

    from dtrain.runs.storage import CheckpointStore

    if missing_packages():
        raise SystemExit(f"benchmarks/checkpoint_storage.py {missing_packages()}")
    torch.set_num_threads(1)
    model, model_state, state, step_s = _state(args.width, args.blocks)
    parameters = sum(p.numel() for p in model.parameters())
    with moto_server() as endpoint, tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        make_bucket(endpoint, BUCKET)
        stores = {"local": CheckpointStore(url=str(Path(tmp) / "local")),
                  "s3": CheckpointStore(url=f"s3://{BUCKET}/bench", options={
                      "endpoint_url": endpoint, "key": KEY, "secret": SECRET})}
        def one_round(store: Any) -> Callable[[int], dict[str, Any]]:
            return lambda repeat: _round(store, model_state, state, repeat + 1)

        rows = alternate([(name, one_round(store)) for name, store in stores.items()], args.rounds)
        sizes = {name: stores["local"].size(f"step-{args.rounds}/{name}") for name in ("model.pt", "state.pt")}
    headline: dict[str, Any] = {
        **ratio_headline("s3_over_local_write", rounds_of(rows, "s3", "write_s"), rounds_of(rows, "local", "write_s")),
        **ratio_headline("s3_over_local_read", rounds_of(rows, "s3", "read_s"), rounds_of(rows, "local", "read_s")),
        "parameters": parameters, "checkpoint_bytes": sum(sizes.values()), "step_seconds": step_s}
    for name in stores:
        for key in ("write_s", "read_s"):
            headline[f"{name}_{key}"] = median(rounds_of(rows, name, key))
        for period in PERIODS:
            headline[f"{name}_share_of_step_every_{period}"] = headline[f"{name}_write_s"] / (period * step_s)
    machine = machine_info()
    table = markdown_table(
        ["storage", "write (s, median)", "read (s, median)"] + [f"lost per step, every {p} steps" for p in PERIODS],
        [[name, f"{headline[f'{name}_write_s']:.3f}", f"{headline[f'{name}_read_s']:.3f}",
          *(f"{headline[f'{name}_share_of_step_every_{p}']:.2%}" for p in PERIODS)] for name in stores])
    markdown = (
        f"# Checkpoint storage: local folder vs local S3 server\n\n"
        f"Wide MLP width {args.width}, {args.blocks} blocks ({parameters / 1e6:.1f} M parameters, Adam): "
        f"{sum(sizes.values()) / 1e6:.0f} MB per checkpoint; {args.rounds} paired rounds; a training step "
        f"(batch 64, 1 thread) {step_s * 1e3:.0f} ms. S3 is moto's server on loopback (objects in memory). "
        f"{machine['cores']} cores shared with other users (load {machine_info_load()}).\n\n{table}\n\n"
        f"S3 / local, median of paired rounds: write {headline['s3_over_local_write']:.2f}x "
        f"({headline['s3_over_local_write_min']:.2f}-{headline['s3_over_local_write_max']:.2f}), read "
        f"{headline['s3_over_local_read']:.2f}x ({headline['s3_over_local_read_min']:.2f}-"
        f"{headline['s3_over_local_read_max']:.2f}).\n\nReproduce: `python benchmarks/checkpoint_storage.py "
        f"--width {args.width} --rounds {args.rounds}`\n")
    path = write_results("checkpoint_storage", headline, rows, markdown, machine,
                         extra={"settings": {"width": args.width, "blocks": args.blocks, "rounds": args.rounds}})
    print(markdown)
    print(f"wrote {path}")


def machine_info_load() -> str:
    from common import STARTED, load_average

    return f"{STARTED['load_average']:.1f} at the start, {load_average():.1f} at the end"


if __name__ == "__main__":
    main()
