"""One prepared check of dtrain on a GPU (issue 44): correctness against plain torch loops, then speed against a
hand-written loop, in at most 8 minutes on one H200; `--device cpu` runs the same code at small sizes in seconds
(the dry run CI runs, so that the script is never broken when a GPU is at hand).

Correctness: the demo CNN (float32) and a float64 MLP trained by dtrain equal a plain torch loop (one rank; the
MLP within 1e-9); 2 worker processes sharing the one GPU over gloo with CUDA tensors equal one process; NCCL at
world size 1 for strategies allreduce, zero1 and fsdp; bf16 autocast and fp16 with a GradScaler end within 0.5
accuracy points of fp32; Horovod's collectives and DistributedOptimizer through `dtrain horovodrun -np 1` on CUDA
tensors over NCCL (`tests/horovod_scripts/device_collectives.py`; gloo on the CPU in the dry run). Each run's global
batch is its whole data set, so the sampler's shuffle changes only the
order of a sum, not which records a step sees.

Speed, in paired rounds (dtrain and the hand-written loop back to back, the order alternating): the demo CNN (small:
shows per-step overhead) and a GPT-2-small-sized transformer on synthetic tokens in bf16:
`headline.step_time_ratio_vs_handwritten` per model (goal <= 1.02), model FLOPs utilization of both (nanoGPT's
`estimate_mfu` way, divided by the bf16 matrix-product rate measured first), and the phase timers' overhead (dtrain
with `profiling.phase_timers` on against off; goal <= 1 %).

    python benchmarks/gpu_check.py                 # on the GPU machine: writes $OUT/gpu_check.json
    python benchmarks/gpu_check.py --device cpu    # the dry run (small sizes)
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from common import git_commit, paired_ratio  # noqa: E402

import dtrain  # noqa: E402
from dtrain.comm import init_distributed  # noqa: E402
from dtrain.comm.topology import shutdown_distributed  # noqa: E402
from dtrain.config import load_config  # noqa: E402
from dtrain.data.arrays import ArrayDataset  # noqa: E402
from dtrain.data.synthetic import synthetic_classification  # noqa: E402
from dtrain.runs.rundir import load_run_info, prepare_run_dir  # noqa: E402
from dtrain.train.callbacks import StepCallback  # noqa: E402
from dtrain.train.trainer import Trainer  # noqa: E402

# sizes: (on a GPU, the dry run on the CPU)
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {"equal_records": 512, "equal_steps": 6, "precision_records": 16384, "precision_epochs": 15,
             "precision_batch": 512, "cnn_batch": 256, "cnn_steps": 300, "gpt": (12, 12, 768, 1024, 50304),
             "gpt_batch": 8, "gpt_steps": 40, "rounds": 3, "matmul": 8192},
    "cpu": {"equal_records": 64, "equal_steps": 3, "precision_records": 256, "precision_epochs": 1,
            "precision_batch": 64, "cnn_batch": 16, "cnn_steps": 6, "gpt": (2, 2, 64, 32, 256),
            "gpt_batch": 2, "gpt_steps": 5, "rounds": 1, "matmul": 256},
}
WARMUP = 2  # steps left out of every timing: the first steps build buckets, caches and cuBLAS handles
SEED = 7


# ------------------------------------------------------------------------------------------ models and data


def build_cnn() -> nn.Module:
    """The demo CNN (examples/fashion_mnist/model_def.py build_cnn, without batch norm)."""
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def build_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """GPT-2's shape (token and position embeddings, `layers` blocks, a head tied to the token embedding)."""

    def __init__(self, layers: int, heads: int, width: int, context: int, vocab: int) -> None:
        super().__init__()
        self.shape = (layers, heads, width, context, vocab)
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def flops_per_token(self) -> float:
        """nanoGPT's estimate_mfu count: 6 N (N without the position embeddings) + 12 L H Q T."""
        layers, heads, width, context, _ = self.shape
        parameters = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        return 6 * parameters + 12 * layers * heads * (width // heads) * context


def build_model(hp: Mapping[str, Any]) -> nn.Module:
    kind = hp["model"]
    return build_cnn() if kind == "cnn" else build_mlp() if kind == "mlp" else TinyGPT(*hp["gpt"])


def make_data(hp: Mapping[str, Any], split: str) -> ArrayDataset:
    """Learnable synthetic records (a fixed random teacher labels them), the same on every call and rank."""
    records, seed = hp["records"], SEED + (0 if split == "train" else 1000)
    if hp["model"] == "gpt":
        _, _, _, context, vocab = hp["gpt"]
        tokens = torch.randint(vocab, (records, context + 1), generator=torch.Generator().manual_seed(seed))
        return ArrayDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if hp["model"] == "mlp":
        return synthetic_classification(records, (32,), 10, seed=seed, dtype=torch.float64)
    return synthetic_classification(records, (1, 28, 28), 10, seed=seed)


def build_optimizer(hp: Mapping[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    if hp["model"] == "gpt":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=hp.get("learning_rate", 0.05), momentum=0.9)


def batch_loss(hp: Mapping[str, Any], model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, -2) if hp["model"] == "gpt" else logits, targets.flatten())


class CheckTrial(dtrain.Trial):
    """The check's models as a dtrain Trial; its hyperparameters say which (`model`) and how much data."""

    def build_model(self) -> nn.Module:
        return build_model(self.context.hparams)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(self.context.hparams, model)

    def build_training_data(self) -> ArrayDataset:
        return make_data(self.context.hparams, "train")

    def build_validation_data(self) -> ArrayDataset:
        return make_data(self.context.hparams, "validation")

    def train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        return {"loss": batch_loss(self.context.hparams, model, *batch)}

    def evaluate_batch(self, batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module
                       ) -> dict[str, torch.Tensor | float]:
        inputs, targets = batch
        logits = model(inputs)
        if self.context.hparams["model"] == "gpt":
            logits, targets = logits.flatten(0, -2), targets.flatten()
        return {"loss": F.cross_entropy(logits, targets), "accuracy": (logits.argmax(-1) == targets).double().mean()}


# ------------------------------------------------------------------------------------------- running dtrain


def raw_config(hp: dict[str, Any], batches: int, global_batch: int, **settings: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": f"gpu-check-{hp['model']}", "entrypoint": "gpu_check:CheckTrial",
        "hyperparameters": {**hp, "global_batch_size": global_batch},
        "searcher": {"metric": "loss", "smaller_is_better": True, "max_length": {"batches": batches}},
        "scheduling_unit": batches, "min_validation_period": {"batches": batches},
        "reproducibility": {"experiment_seed": SEED},
        "distributed": {"backend": settings.pop("backend", "auto"), "device": settings.pop("device", "auto"),
                        "strategy": settings.pop("strategy", "allreduce")},
        "optimizations": {"precision": settings.pop("precision", "fp32")},
        "profiling": {"phase_timers": settings.pop("phase_timers", True)},
    }
    assert not settings, settings
    return raw


class StepStarts(StepCallback):
    """When each step began (perf_counter), whether or not the phase timers run."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def before_step(self, step: int) -> None:
        self.starts.append(time.perf_counter())


def cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's tensors, whole (a sharded DTensor gathered: a collective) and on the CPU."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()}


def one_process_env() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}


def train_dtrain(raw: dict[str, Any], run_dir: Path, *, environ: dict[str, str] | None = None,
                 ) -> dict[str, Any]:
    """Train one run in this process (a process group of its own unless one exists); the final weights (CPU
    copies), the summary and the step records."""
    own_group = environ is None
    config = load_config(None, raw=copy.deepcopy(raw)).config
    topology = init_distributed(backend=config.distributed.backend, device=config.distributed.device,
                                environ=environ or one_process_env())
    try:
        if topology.rank == 0:
            prepare_run_dir(config, run_dir, REPO / "benchmarks")
        if topology.is_distributed:
            torch.distributed.barrier()
        trainer = Trainer(config=config, trial_class=CheckTrial, topology=topology, run_info=load_run_info(run_dir))
        initial = cpu_copy(trainer.model.state_dict())
        starts = StepStarts()
        trainer.callbacks.register(starts)
        summary = trainer.fit()
        weights = cpu_copy(trainer.strategy.unwrap_model().state_dict())
        del trainer
        return {"initial": initial, "weights": weights, "summary": summary, "starts": starts.starts,
                "device": str(topology.device), "backend": topology.backend}
    finally:
        if own_group:
            shutdown_distributed()


def train_plain(hp: dict[str, Any], initial: dict[str, torch.Tensor], steps: int, device: torch.device
                ) -> dict[str, torch.Tensor]:
    """A plain torch loop: the whole data set as every step's batch, from the same initial weights."""
    model = build_model(hp)
    model.load_state_dict(initial)
    model.to(device)
    optimizer = build_optimizer(hp, model)
    inputs, targets = (t.to(device) for t in make_data(hp, "train").tensors)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batch_loss(hp, model, inputs, targets).backward()
        optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest absolute difference of any weight, and relative to the largest weight."""
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    scale = max(float(b[k].double().abs().max()) for k in b)
    return {"max_abs_difference": worst, "max_relative_difference": worst / scale if scale else worst}


# ---------------------------------------------------------------------------------------------- correctness


def check_against_plain(model: str, sizes: dict[str, Any], work: Path, device: torch.device) -> dict[str, Any]:
    hp = {"model": model, "records": sizes["equal_records"], "gpt": sizes["gpt"]}
    steps = sizes["equal_steps"]
    run = train_dtrain(raw_config(hp, steps, hp["records"]), work / f"plain-{model}")
    plain = train_plain(hp, run["initial"], steps, device)
    difference = largest_difference(run["weights"], plain)
    tolerance = 1e-9 if model == "mlp" else 1e-4  # float64 to rounding; float32 kernels may sum in other orders
    key = "max_abs_difference" if model == "mlp" else "max_relative_difference"
    return {"check": f"{model} dtrain = plain torch loop", "device": run["device"], "backend": run["backend"],
            "steps": steps, **difference, "tolerance": tolerance, "passed": difference[key] <= tolerance}


def _two_process_worker(rank: int, port: int, raw: dict[str, Any], work: str, queue: Any) -> None:
    environ = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        torch.set_num_threads(1)
        run = train_dtrain(raw, Path(work), environ=environ)
        shutdown_distributed()
        weights = io.BytesIO()
        torch.save(run["weights"], weights)  # bytes through the queue: no shared-memory handles to outlive us
        queue.put((rank, {"weights": weights.getvalue(), "device": run["device"], "backend": run["backend"]}))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def check_two_processes(sizes: dict[str, Any], work: Path, device: torch.device) -> dict[str, Any]:
    """2 workers over gloo, both on the one GPU (distributed.device cuda), against one process."""
    hp = {"model": "mlp", "records": sizes["equal_records"], "gpt": sizes["gpt"]}
    steps = sizes["equal_steps"]
    one = train_dtrain(raw_config(hp, steps, hp["records"]), work / "one-process")
    raw = raw_config(hp, steps, hp["records"], backend="gloo", device=device.type)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_two_process_worker, args=(rank, port, raw, str(work / "two"), queue))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    results = dict(queue.get(timeout=300) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    failures = [value for value in results.values() if isinstance(value, str)]
    if failures:
        return {"check": "2 processes over gloo = 1 process", "passed": False, "error": failures[0][-2000:]}
    weights = [torch.load(io.BytesIO(results[rank]["weights"])) for rank in (0, 1)]
    difference = largest_difference(weights[0], one["weights"])
    replicas = largest_difference(weights[0], weights[1])
    return {"check": "2 processes over gloo = 1 process", "devices": [results[r]["device"] for r in (0, 1)],
            "backend": results[0]["backend"], **difference, "replicas_max_abs_difference":
            replicas["max_abs_difference"], "tolerance": 1e-9,
            "passed": difference["max_abs_difference"] <= 1e-9 and replicas["max_abs_difference"] == 0.0}


def check_strategy(strategy: str, sizes: dict[str, Any], work: Path, device: torch.device) -> dict[str, Any]:
    """A strategy at world size 1 under NCCL (gloo in the dry run) against the plain loop, float64."""
    hp = {"model": "mlp", "records": sizes["equal_records"], "gpt": sizes["gpt"]}
    steps = sizes["equal_steps"]
    backend = "nccl" if device.type == "cuda" else "gloo"
    run = train_dtrain(raw_config(hp, steps, hp["records"], backend=backend, strategy=strategy),
                       work / f"strategy-{strategy}")
    difference = largest_difference(run["weights"], train_plain(hp, run["initial"], steps, device))
    return {"check": f"{strategy} at world size 1 = plain torch loop", "backend": run["backend"],
            "device": run["device"], **difference, "tolerance": 1e-9,
            "passed": difference["max_abs_difference"] <= 1e-9}


def check_precisions(sizes: dict[str, Any], work: Path, judged: bool) -> dict[str, Any]:
    """The CNN trained in fp32, bf16 (autocast) and fp16 (autocast and a GradScaler): final validation accuracy.
    Not `judged` in the dry run: its few hundred records cannot resolve half a point."""
    hp = {"model": "cnn", "records": sizes["precision_records"], "gpt": sizes["gpt"], "learning_rate": 0.02}
    batch = sizes["precision_batch"]
    batches = sizes["precision_epochs"] * (hp["records"] // batch)
    accuracy = {}
    for precision in ("fp32", "bf16", "fp16"):
        run = train_dtrain(raw_config(hp, batches, batch, precision=precision), work / f"precision-{precision}")
        accuracy[precision] = 100.0 * run["summary"]["validation_history"][-1]["metrics"]["accuracy"]
    gaps = {p: accuracy[p] - accuracy["fp32"] for p in ("bf16", "fp16")}
    return {"check": "bf16 and fp16 within 0.5 points of fp32", "accuracy_percent": accuracy, "gap_points": gaps,
            "batches": batches, "judged": judged,
            "passed": all(abs(gap) <= 0.5 for gap in gaps.values()) or not judged}


HOROVOD_SCRIPT = REPO / "tests" / "horovod_scripts" / "device_collectives.py"
HOROVOD_BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "cpu": "cpu:gloo,cuda:gloo"}


def check_horovod(work: Path, device: torch.device) -> dict[str, Any]:
    """dtrain's horovod.torch at one rank under `dtrain horovodrun -np 1`: every collective and the
    DistributedOptimizer against the script's own references, each result left on the device, and the process
    group it made (NCCL for CUDA tensors on a GPU; two ranks cannot share one GPU under NCCL). HOROVOD_ELASTIC=1
    makes the optimizer reduce at one rank, as Horovod's does."""
    results = work / "horovod-collectives.json"
    command = [sys.executable, "-m", "dtrain.cli", "horovodrun", "-np", "1", "python", str(HOROVOD_SCRIPT),
               "--device", device.type, "--results", str(results)]
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HOROVOD_ELASTIC": "1"})
    name = "horovod.torch collectives and DistributedOptimizer through dtrain horovodrun -np 1"
    if not results.is_file():
        return {"check": name, "passed": False, "exit_code": done.returncode,
                "error": (done.stdout[-1000:] + done.stderr[-2000:])}
    found = json.loads(results.read_text())
    failed = {key: check for key, check in found["checks"].items() if not check["passed"]}
    expected = HOROVOD_BACKENDS[device.type]
    return {"check": name, "backend": found["backend"], "expected_backend": expected, "device": found["device"],
            "checks_run": len(found["checks"]), "failed": failed, "exit_code": done.returncode,
            "passed": done.returncode == 0 and not failed and found["backend"] == expected
            and found["device"].startswith(device.type)}


# --------------------------------------------------------------------------------------------------- speed


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, size: int) -> float:
    """The bf16 matrix-product rate (FLOP/s) of this device on random data: mean of 10 after 3 warm-ups."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize(device)
    return 10 * 2 * size**3 / (time.perf_counter() - started)


def handwritten_step_seconds(hp: dict[str, Any], steps: int, batch: int, device: torch.device,
                             precision: str) -> float:
    """A hand-written loop with dtrain's settings: random batches gathered on the CPU, pinned and copied without
    blocking, autocast where asked; mean seconds per step after the warm-up."""
    torch.manual_seed(SEED)
    model = build_model(hp).to(device)
    optimizer = build_optimizer(hp, model)
    inputs, targets = make_data(hp, "train").tensors
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    started = 0.0
    for step in range(steps):
        if step == WARMUP:
            synchronize(device)
            started = time.perf_counter()
        rows = torch.randint(len(inputs), (batch,))
        x, y = inputs[rows], targets[rows]
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = batch_loss(hp, model, x, y)
        loss.backward()
        optimizer.step()
    synchronize(device)
    return (time.perf_counter() - started) / (steps - WARMUP)


def dtrain_step_seconds(run: dict[str, Any]) -> float:
    """Wall time per step from the start of the first step after the warm-up to the start of the last (which also
    validates and checkpoints)."""
    starts = run["starts"]
    return (starts[-1] - starts[WARMUP]) / (len(starts) - 1 - WARMUP)


def flops_per_step(hp: dict[str, Any], batch: int, device: torch.device) -> float:
    """Forward and backward FLOPs of one step: nanoGPT's formula for the transformer, torch's FLOP counter for
    the CNN."""
    model = build_model(hp)
    if isinstance(model, TinyGPT):
        return model.flops_per_token() * batch * model.shape[3]
    from torch.utils.flop_counter import FlopCounterMode

    inputs, targets = make_data({**hp, "records": batch}, "train").tensors
    with FlopCounterMode(display=False) as counter:
        batch_loss(hp, model, inputs, targets).backward()
    return float(counter.get_total_flops())


def measure_speed(model: str, sizes: dict[str, Any], work: Path, device: torch.device, peak: float,
                  timers_too: bool) -> dict[str, Any]:
    batch = sizes["gpt_batch"] if model == "gpt" else sizes["cnn_batch"]
    steps = sizes["gpt_steps"] if model == "gpt" else sizes["cnn_steps"]
    precision = "bf16" if model == "gpt" else "fp32"
    hp = {"model": model, "records": max(batch * 8, 64), "gpt": sizes["gpt"]}
    variants: list[tuple[str, Callable[[int], float]]] = [
        ("dtrain", lambda r: dtrain_step_seconds(train_dtrain(raw_config(hp, steps, batch, precision=precision),
                                                              work / f"speed-{model}-dtrain-{r}"))),
        ("handwritten", lambda r: handwritten_step_seconds(hp, steps, batch, device, precision))]
    if timers_too:
        variants.append(("dtrain_no_timers", lambda r: dtrain_step_seconds(train_dtrain(
            raw_config(hp, steps, batch, precision=precision, phase_timers=False),
            work / f"speed-{model}-notimers-{r}"))))
    seconds: dict[str, list[float]] = {label: [] for label, _ in variants}
    for round_number in range(sizes["rounds"]):
        order = variants if round_number % 2 == 0 else variants[::-1]
        for label, run in order:
            seconds[label].append(run(round_number))
            print(f"gpu_check: {model} round {round_number + 1} {label}: {seconds[label][-1] * 1e3:.3f} ms/step",
                  flush=True)
    flops = flops_per_step(hp, batch, device)
    ratio = paired_ratio(seconds["dtrain"], seconds["handwritten"])
    result: dict[str, Any] = {
        "model": model, "batch": batch, "steps_per_round": steps, "precision": precision,
        "seconds_per_step": seconds, "step_time_ratio_vs_handwritten": ratio,
        "flops_per_step": flops,
        "mfu": {label: flops / statistics.median(values) / peak for label, values in seconds.items()}}
    if timers_too:
        result["phase_timer_overhead"] = paired_ratio(seconds["dtrain"], seconds["dtrain_no_timers"])
    return result


# ----------------------------------------------------------------------------------------------------- main


def environment(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                             "device": str(device), "load_average": os.getloadavg()[0]}
    if device.type == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(device), cudnn=torch.backends.cudnn.version(),
                     nccl=str(torch.cuda.nccl.version()))
    return facts


def run_check(device_name: str, out: Path, commit: str | None = None) -> dict[str, Any]:
    device = torch.device(device_name)
    sizes = SIZES[device.type]
    started = time.perf_counter()
    provenance = git_commit() if commit is None else {"commit": commit, "dirty": None}
    result: dict[str, Any] = {"benchmark": "gpu_check", **provenance, "dry_run": device.type != "cuda",
                              "environment": environment(device), "sizes": sizes, "checks": [], "speed": {}}
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False  # the equality checks compare float32 with float32
        torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        work = Path(scratch)
        checks: list[Callable[[], dict[str, Any]]] = [
            lambda: check_against_plain("cnn", sizes, work, device),
            lambda: check_against_plain("mlp", sizes, work, device),
            lambda: check_two_processes(sizes, work, device),
            *(lambda s=s: check_strategy(s, sizes, work, device) for s in ("allreduce", "zero1", "fsdp")),
            lambda: check_precisions(sizes, work, judged=device.type == "cuda"),
            lambda: check_horovod(work, device)]
        for check in checks:
            try:
                outcome = check()
            except Exception:  # one broken check must not hide the others' figures
                outcome = {"check": "failed to run", "passed": False, "error": traceback.format_exc()[-3000:]}
            outcome["seconds"] = time.perf_counter() - started
            result["checks"].append(outcome)
            print(f"gpu_check: {outcome['check']}: {'passed' if outcome['passed'] else 'FAILED'}", flush=True)
        if device.type == "cuda":  # the speed figures: TF32 as a user would have it
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        peak = matmul_rate(device, sizes["matmul"])
        result["bf16_matmul_flops_per_second"] = peak
        for model in ("cnn", "gpt"):
            try:
                result["speed"][model] = measure_speed(model, sizes, work, device, peak, timers_too=model == "cnn")
            except Exception:
                result["speed"][model] = {"error": traceback.format_exc()[-3000:]}
    result["headline"] = {
        "correctness_passed": all(c["passed"] for c in result["checks"]),
        "step_time_ratio_vs_handwritten": {m: s.get("step_time_ratio_vs_handwritten", {}).get("value")
                                           for m, s in result["speed"].items()},
        "mfu": {m: s.get("mfu") for m, s in result["speed"].items()},
        "phase_timer_overhead": result["speed"].get("cnn", {}).get("phase_timer_overhead", {}).get("value"),
    }
    result["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=_plain) + "\n")
    return result


def _plain(value: Any) -> Any:
    return float(value) if isinstance(value, float | int) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: the check (default where a GPU is visible); cpu: the dry run at small sizes")
    parser.add_argument("--out", type=Path, default=None,
                        help="where gpu_check.json goes (default: $OUT where set, else a new temporary folder)")
    parser.add_argument("--commit", help="the commit measured, where the tree has no git history (the GPU machine's "
                                         "copy); default: git's")
    args = parser.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-check-out-"))
    result = run_check(args.device, out, args.commit)
    print(f"gpu_check: {out / 'gpu_check.json'} in {result['seconds']:.0f} s; headline "
          f"{json.dumps(result['headline'], default=_plain)}", flush=True)
    return 0 if result["headline"]["correctness_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
