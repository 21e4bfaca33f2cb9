"""`dtrain plan --calibrate`: measure this machine so that predictions about it use its own numbers.

- compute: seconds of forward, backward and optimizer step per sample of a model (the experiment's Trial,
  or a reference MLP), on `threads` threads: one worker of this machine is one "device";
- gloo all-reduce on loopback between `ranks` processes for payloads from 4 KiB to 16 MiB, done as DDP does it
  to a gradient bucket (divide by the world size and all-reduce; for fp16, fp16_compress_hook's cast, divide,
  all-reduce and cast back), fitted to the ring's form T = 2(n-1)*alpha + 2(n-1)/n * S * beta (least squares
  on relative error) with S the bytes sent, for fp32 and fp16 payloads.

On a machine whose workers are its cores, the loopback all-reduce is CPU work (copies, socket calls, sums):
those alpha and beta become the host cost of communication (`HostCost`) and the speed of the unshaped
loopback link. The result is kept as JSON (`default_calibration_path()`) and read by later predictions.

It imports torch and starts processes, which is why it lives apart from the pure model in dtrain.plan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import CalibrationError

CALIBRATION_ENV = "DTRAIN_CALIBRATION"
DEFAULT_ALLREDUCE_SIZES_BYTES = tuple(4096 * 4 ** k for k in range(7))  # 4 KiB ... 16 MiB
CALIBRATION_VERSION = 2


def default_calibration_path() -> Path:
    """$DTRAIN_CALIBRATION, else ~/.cache/dtrain/calibration.json."""
    override = os.environ.get(CALIBRATION_ENV)
    return Path(override) if override else Path.home() / ".cache" / "dtrain" / "calibration.json"


# ------------------------------------------------------------------------------------------- all-reduce


@dataclass(frozen=True)
class AllReduceFit:
    """alpha (s per message step) and beta (s per byte) of a ring fitted to measured all-reduce times."""

    ranks: int
    dtype: str
    alpha_s: float
    beta_s_per_byte: float
    points: list[tuple[int, float]] = field(default_factory=list)  # (bytes, median seconds)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")


def fit_ring_alpha_beta(points: Sequence[tuple[float, float]], ranks: int) -> tuple[float, float]:
    """Fit T(S) = 2(n-1)*alpha + 2(n-1)/n * S * beta to (bytes, seconds) points by least squares on the
    relative error (weights 1/T^2), so that small messages pin alpha and large ones beta; both >= 0."""
    if len(points) < 2:
        raise ValueError("need at least two (bytes, seconds) points")
    rows = [(2 * (ranks - 1), 2 * (ranks - 1) / ranks * size, seconds) for size, seconds in points]
    # normal equations of sum(((a*x0 + b*x1) - y) / y)^2
    s00 = sum((x0 / y) ** 2 for x0, _, y in rows)
    s01 = sum(x0 * x1 / y ** 2 for x0, x1, y in rows)
    s11 = sum((x1 / y) ** 2 for _, x1, y in rows)
    t0 = sum(x0 / y for x0, _, y in rows)
    t1 = sum(x1 / y for _, x1, y in rows)
    det = s00 * s11 - s01 * s01
    if det <= 0:
        raise ValueError("all-reduce points do not determine alpha and beta; use several message sizes")
    alpha = (t0 * s11 - t1 * s01) / det
    beta = (s00 * t1 - s01 * t0) / det
    if alpha < 0:  # refit beta alone through the origin
        alpha, beta = 0.0, t1 / s11
    if beta < 0:
        alpha, beta = t0 / s00, 0.0
    return alpha, beta


def _allreduce_worker(rank: int, world: int, port: int, sizes: Sequence[int], dtype_name: str, rounds: int,
                      out_path: str) -> None:
    """One rank of the all-reduce timing: a fresh process on 1 thread, gloo over 127.0.0.1."""
    import torch

    from dtrain.comm import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    environ = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    init_distributed(backend="gloo", timeout_seconds=300, environ=environ)
    import torch.distributed as dist

    element = 2 if dtype_name == "float16" else 4

    def averaged_allreduce(gradient: torch.Tensor) -> None:
        """What DDP does with a bucket: divide by the world size and all-reduce (the default hook), or cast to fp16,
        divide, all-reduce and cast back (fp16_compress_hook)."""
        if dtype_name == "float16":
            half = gradient.to(torch.float16).div_(world)
            dist.all_reduce(half)
            gradient.copy_(half)
        else:
            gradient.div_(world)
            dist.all_reduce(gradient)

    results = []
    for size in sizes:
        gradient = torch.randn(max(size // element, 1)) * 1e-3  # gradient-like fp32 values
        repeats = max(2, min(50, int(2e7 // max(size, 1))))
        averaged_allreduce(gradient)  # warm-up: connections and buffers
        samples = []
        for _ in range(rounds):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(repeats):
                averaged_allreduce(gradient)
            samples.append((time.perf_counter() - started) / repeats)
        slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank decides
        results.append((int(gradient.numel() * element), float(slowest)))
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    shutdown_distributed()


def measure_allreduce(sizes_bytes: Sequence[int] = DEFAULT_ALLREDUCE_SIZES_BYTES, *, dtype: str = "float32",
                      ranks: int = 2, rounds: int = 5, wrap: Sequence[str] = ()) -> AllReduceFit:
    """Time gloo all-reduce between `ranks` fresh processes on 127.0.0.1 and fit alpha, beta. `wrap` prefixes
    the worker command lines (e.g. `ip netns exec NS` to measure inside a shaped network namespace)."""
    import subprocess

    from dtrain.comm.topology import bind_loopback

    with tempfile.TemporaryDirectory(prefix="dtrain-calibrate-") as tmp:
        out = Path(tmp) / "allreduce.json"
        probe = bind_loopback(0)
        port = probe.getsockname()[1]
        probe.close()
        sizes = ",".join(str(int(size)) for size in sizes_bytes)
        procs = [subprocess.Popen([*wrap, sys.executable, "-m", "dtrain.calibrate.calibrate", "worker", "--rank",
                                   str(rank), "--ranks", str(ranks), "--port", str(port), "--sizes", sizes, "--dtype",
                                   dtype, "--rounds", str(rounds), "--out", str(out)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for rank in range(ranks)]
        errors = [proc.communicate()[1] for proc in procs]
        if any(proc.returncode for proc in procs) or not out.is_file():
            detail = next((e.strip().splitlines()[-1] for e in errors if e.strip()), "no output")
            raise CalibrationError(f"the all-reduce calibration workers failed: {detail}")
        points = [(int(size), float(seconds)) for size, seconds in json.loads(out.read_text())]
    alpha, beta = fit_ring_alpha_beta(points, ranks)
    return AllReduceFit(ranks=ranks, dtype=dtype, alpha_s=alpha, beta_s_per_byte=beta, points=points)


# ---------------------------------------------------------------------------------------------- compute


@dataclass(frozen=True)
class ComputeMeasurement:
    """Median times of one training step's phases on one device, at `batch` samples."""

    name: str
    batch: int
    threads: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    parameters: int
    training_flops_per_sample: float | None = None
    concurrent: int = 1  # processes that ran the same step at the same time (1: alone)

    @property
    def key(self) -> str:
        return compute_key(self.name, self.concurrent)

    @property
    def seconds_per_sample(self) -> float:
        return (self.forward_s + self.backward_s) / self.batch

    @property
    def backward_fraction(self) -> float:
        return self.backward_s / (self.forward_s + self.backward_s)

    @property
    def achieved_flops_per_s(self) -> float | None:
        if not self.training_flops_per_sample:
            return None
        return self.training_flops_per_sample / self.seconds_per_sample


def compute_key(name: str, concurrent: int) -> str:
    """Where a measurement lives in `Calibration.compute`: the model's name, with ` x N` when N ran at once."""
    return name if concurrent == 1 else f"{name} x{concurrent}"


def time_training_step(model: Any, batch: Any, loss_of: Callable[[Any, Any], Any], optimizer: Any, *,
                       repeats: int = 10, warmup: int = 3) -> tuple[float, float, float]:
    """Median seconds of forward (to the loss), backward and optimizer step over `repeats` steps."""
    forward, backward, step = [], [], []
    for index in range(warmup + repeats):
        t0 = time.perf_counter()
        loss = loss_of(batch, model)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if index >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            step.append(t3 - t2)
    return statistics.median(forward), statistics.median(backward), statistics.median(step)


def measure_compute(workload: Any, *, threads: int = 1, repeats: int = 10) -> ComputeMeasurement:
    """Time a `dtrain.calibrate.measure.Workload` on `threads` threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = workload.build_model()
        optimizer = workload.build_optimizer(model)
        forward_s, backward_s, optimizer_s = time_training_step(model, workload.batch, workload.loss_of, optimizer,
                                                                repeats=repeats)
    finally:
        torch.set_num_threads(previous)
    return ComputeMeasurement(name=workload.name, batch=workload.batch_size, threads=threads,
                              forward_s=forward_s, backward_s=backward_s, optimizer_s=optimizer_s,
                              parameters=workload.parameters,
                              training_flops_per_sample=workload.training_flops_per_sample)


def _workload(config: str | None, overrides: Sequence[str], batch: int | None) -> Any:
    from dtrain.calibrate.measure import reference_workload, trial_workload

    return trial_workload(Path(config), list(overrides), batch) if config else reference_workload(batch or 64)


def _compute_worker(args: argparse.Namespace) -> None:
    """One of several processes timing the same step at once: build, say ready, wait for the others, time."""
    workload = _workload(args.config, args.overrides, args.batch)
    Path(args.out + ".ready").touch()
    deadline = time.monotonic() + 600
    while not Path(args.go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("calibration: the other compute processes never became ready")
        time.sleep(0.01)
    measurement = measure_compute(workload, threads=args.threads, repeats=args.repeats)
    Path(args.out).write_text(json.dumps(asdict(measurement)))


def _worker_malloc_environment(config: Path | None, overrides: Sequence[str]) -> dict[str, str]:
    """The malloc variables `dtrain run` starts the workers of `config` with (the default config's without one)."""
    from dtrain.config import load_config
    from dtrain.config.distributed import DEFAULT_MALLOC_TRIM_THRESHOLD_MB
    from dtrain.launch import malloc_environment

    trim_mb = (load_config(config, overrides).config.optimizations.malloc_trim_threshold_mb if config is not None
               else DEFAULT_MALLOC_TRIM_THRESHOLD_MB)
    return malloc_environment(trim_mb)


def measure_compute_concurrently(config: Path | None, overrides: Sequence[str] = (), *, batch: int | None = None,
                                 processes: int = 2, threads: int = 1, repeats: int = 10) -> ComputeMeasurement:
    """Time the step in `processes` fresh processes at once, as a node's workers run when all are busy (they
    share caches, memory bandwidth and whatever else runs on the machine); the median of their medians. The
    processes get the malloc settings `dtrain run` would give the config's workers."""
    import subprocess

    environment = {**os.environ, **_worker_malloc_environment(config, overrides)}
    with tempfile.TemporaryDirectory(prefix="dtrain-calibrate-") as tmp:
        go = Path(tmp) / "go"
        outs = [Path(tmp) / f"compute-{i}.json" for i in range(processes)]
        command = [sys.executable, "-m", "dtrain.calibrate.calibrate", "compute", "--threads", str(threads),
                   "--repeats", str(repeats), "--go", str(go)]
        if config is not None:
            command += ["--config", str(config), *[f"--set={item}" for item in overrides]]
        if batch is not None:
            command += ["--batch", str(batch)]
        procs = [subprocess.Popen([*command, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, env=environment) for out in outs]
        deadline = time.monotonic() + 600
        while not all(Path(str(out) + ".ready").exists() for out in outs):
            if any(proc.poll() not in (None, 0) for proc in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        go.touch()
        errors = [proc.communicate()[1] for proc in procs]
        if any(proc.returncode for proc in procs) or not all(out.is_file() for out in outs):
            detail = next((e.strip().splitlines()[-1] for e in errors if e.strip()), "no output")
            raise CalibrationError(f"the compute calibration processes failed: {detail}")
        found = [ComputeMeasurement(**json.loads(out.read_text())) for out in outs]
    return ComputeMeasurement(
        name=found[0].name, batch=found[0].batch, threads=threads,
        forward_s=statistics.median(m.forward_s for m in found),
        backward_s=statistics.median(m.backward_s for m in found),
        optimizer_s=statistics.median(m.optimizer_s for m in found), parameters=found[0].parameters,
        training_flops_per_sample=found[0].training_flops_per_sample, concurrent=processes)


# ------------------------------------------------------------------------------------------- the record


@dataclass
class Calibration:
    """What `dtrain plan --calibrate` measured on one machine."""

    machine: dict[str, Any]
    compute: dict[str, ComputeMeasurement]
    allreduce: dict[str, AllReduceFit]
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    version: int = CALIBRATION_VERSION

    def compute_for(self, name: str, workers: int) -> ComputeMeasurement | None:
        """The measurement of `name` taken with `workers` processes at once, else the one taken alone."""
        return self.compute.get(compute_key(name, workers)) or self.compute.get(name)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "created": self.created, "machine": self.machine,
                "compute": {name: {**asdict(m), "key": m.key, "seconds_per_sample": m.seconds_per_sample,
                                   "backward_fraction": m.backward_fraction,
                                   "achieved_flops_per_s": m.achieved_flops_per_s}
                            for name, m in self.compute.items()},
                "allreduce": {name: {**asdict(fit), "bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s}
                              for name, fit in self.allreduce.items()}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Calibration:
        derived = ("seconds_per_sample", "backward_fraction", "achieved_flops_per_s", "bandwidth_bytes_per_s", "key")
        compute = {name: ComputeMeasurement(**{k: v for k, v in m.items() if k not in derived})
                   for name, m in raw["compute"].items()}
        allreduce = {name: AllReduceFit(**{**{k: v for k, v in f.items() if k not in derived},
                                           "points": [tuple(p) for p in f.get("points", [])]})
                     for name, f in raw["allreduce"].items()}
        return cls(machine=raw["machine"], compute=compute, allreduce=allreduce, created=raw.get("created", ""),
                   version=int(raw.get("version", 0)))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        if not path.is_file():
            raise CalibrationError(f"no calibration at {path}; run `dtrain plan --calibrate` first (or point "
                                   f"--calibration / ${CALIBRATION_ENV} at one)")
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != CALIBRATION_VERSION:
                raise ValueError(f"format version {raw.get('version')}, expected {CALIBRATION_VERSION}")
            return cls.from_json(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise CalibrationError(f"calibration {path} cannot be read ({exc}); run `dtrain plan --calibrate` "
                                   "again to replace it") from None


def machine_facts() -> dict[str, Any]:
    import platform

    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "hostname": platform.node()}


def _main(argv: list[str] | None = None) -> int:
    """`python -m dtrain.calibrate.calibrate allreduce ...` prints one all-reduce calibration as JSON (benchmarks run
    it inside shaped network namespaces); `worker` is one rank of it, `compute` one of several concurrent
    compute timings."""
    parser = argparse.ArgumentParser(prog="python -m dtrain.calibrate.calibrate", description=_main.__doc__)
    parser.add_argument("what", choices=["allreduce", "worker", "compute"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(DEFAULT_ALLREDUCE_SIZES_BYTES), help="message sizes in bytes, comma-separated")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=10, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.what == "compute":
        _compute_worker(args)
        return 0
    if args.what == "worker":
        _allreduce_worker(args.rank, args.ranks, args.port, args.sizes, args.dtype, args.rounds, args.out)
        return 0
    fit = measure_allreduce(args.sizes, dtype=args.dtype, ranks=args.ranks, rounds=args.rounds)
    print(json.dumps({**asdict(fit), "bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
