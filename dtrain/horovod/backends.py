"""Which torch.distributed backend carries which tensors under dtrain's `horovod.torch`, and the type each dtype is
reduced or moved in on that backend.

CPU tensors (the negotiation's own control collectives among them) always go through gloo. CUDA tensors go through
NCCL where every rank on the host can have a GPU of its own, by torch's device-keyed backend string
(`"cpu:gloo,cuda:nccl"`: one process group, a gloo and an NCCL backend under it, picked by the tensor's device);
elsewhere through gloo too (gloo takes CUDA tensors and copies them through the host). `HOROVOD_GPU_OPERATIONS`
(Horovod's install-time choice of the GPU library) is read at run time: `NCCL` insists on NCCL, `GLOO` keeps CUDA
tensors on gloo; Horovod's other values (MPI, DDL, CCL) have no backend here and stop `hvd.init()` with one line.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

GLOO = "gloo"
NCCL_FOR_CUDA = "cpu:gloo,cuda:nccl"
GPU_OPERATIONS = "HOROVOD_GPU_OPERATIONS"
CPU_OPERATIONS = "HOROVOD_CPU_OPERATIONS"
# What a backend cannot reduce travels in a wider type and is narrowed back exactly. gloo: fp16 and bf16 are reduced
# in fp32 (as Horovod does on CPU), int16 (gloo: "Invalid scalar type") in int64. NCCL reduces fp16 and bf16 itself
# (as Horovod's NCCL path does) and has no 16-bit integer type: int16 goes as int64 there too.
GLOO_REDUCE_WIRE = {torch.int16: torch.int64, torch.float16: torch.float32, torch.bfloat16: torch.float32}
NCCL_REDUCE_WIRE = {torch.int16: torch.int64}
# For allgather, broadcast and alltoall int16 moves as int32 on both (every value fits); bool moves as itself (torch
# hands NCCL a bool tensor as uint8).
MOVE_WIRE = {torch.int16: torch.int32}


class BackendChoiceError(ValueError):
    """HOROVOD_GPU_OPERATIONS asks for what this machine or dtrain cannot give; the message is the one line (value,
    rule, fix)."""


def choose_backend(environ: Mapping[str, str], local_size: int | None, gpus: int | None = None,
                   nccl_available: bool | None = None) -> str:
    """The backend string for `init_process_group`: `NCCL_FOR_CUDA` when CUDA tensors can go through NCCL (a GPU
    for each of the `local_size` ranks on this host, NCCL built into torch) and `HOROVOD_GPU_OPERATIONS` does not
    say GLOO; plain gloo otherwise. `gpus` and `nccl_available` default to what torch sees."""
    value = environ.get(GPU_OPERATIONS, "").strip()
    asked = value.upper()
    if asked not in ("", "NCCL", "GLOO"):
        raise BackendChoiceError(
            f"{GPU_OPERATIONS}={value} has no backend on dtrain; set NCCL (CUDA tensors over "
            "NCCL) or GLOO (CUDA tensors over gloo), or leave it unset (NCCL where each local rank has a GPU)")
    if asked == "GLOO":
        return GLOO
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nccl_available is None:
        nccl_available = dist.is_nccl_available()
    fits = local_size is None or local_size <= gpus
    if asked == "NCCL":
        if gpus == 0 or not nccl_available:
            raise BackendChoiceError(
                f"{GPU_OPERATIONS}=NCCL but torch {torch.__version__} "
                + ("sees no CUDA GPU" if gpus == 0 else "was built without NCCL")
                + f"; unset {GPU_OPERATIONS} (CPU tensors go through gloo) or set it to GLOO")
        if not fits:
            raise BackendChoiceError(
                f"{GPU_OPERATIONS}=NCCL needs a GPU per rank and this host runs {local_size} "
                f"ranks on {gpus} GPU(s) (NCCL refuses two ranks on one GPU); start at most {gpus} rank(s) per host "
                f"or set {GPU_OPERATIONS}=GLOO")
        return NCCL_FOR_CUDA
    return NCCL_FOR_CUDA if gpus > 0 and nccl_available and fits else GLOO


def check_before_launch(environ: Mapping[str, str], local_size: int | None, elastic: bool) -> None:
    """What `dtrain horovodrun` refuses before any worker starts: a HOROVOD_GPU_OPERATIONS this host cannot give its
    `local_size` ranks, and NCCL asked for in an elastic job (whose groups are gloo: under NCCL a lost peer ends the
    survivors' processes through torch's watchdog instead of raising the error `hvd.elastic.run` recovers from)."""
    if elastic and environ.get(GPU_OPERATIONS, "").strip().upper() == "NCCL":
        raise BackendChoiceError(f"{GPU_OPERATIONS}=NCCL: an elastic job's process groups are gloo (CUDA tensors "
                                 "go through gloo); unset it for --min-np/--max-np jobs")
    if not elastic:
        choose_backend(environ, local_size)


def cpu_operations_ignored(environ: Mapping[str, str]) -> str | None:
    """The warning for a HOROVOD_CPU_OPERATIONS other than gloo (Horovod's MPI or CCL): CPU tensors go through
    gloo here whatever it says. None when it is unset or gloo."""
    value = environ.get(CPU_OPERATIONS, "").strip()
    if value.upper() in ("", "GLOO"):
        return None
    return f"dtrain.horovod: {CPU_OPERATIONS}={value} is ignored (CPU tensors go through gloo)"


def device_backends(config: str) -> dict[str, str]:
    """Device type -> backend name from a backend string (`"gloo"`, `"nccl"`, `"cpu:gloo,cuda:nccl"`, or what
    `dist.get_backend_config()` answers)."""
    config = config.lower()
    if ":" not in config:
        if config == "nccl":
            return {"cuda": "nccl"}
        return {"cpu": config, "cuda": config}
    pairs = (part.split(":", 1) for part in config.split(",") if part.strip())
    return {device.strip(): backend.strip() for device, backend in pairs}


def reduce_wire(dtype: torch.dtype, device: torch.device, backends: Mapping[str, str]) -> torch.dtype:
    """The type `dtype` is reduced in for a tensor on `device` under `backends` (device type -> backend)."""
    table = NCCL_REDUCE_WIRE if backends.get(device.type) == "nccl" else GLOO_REDUCE_WIRE
    return table.get(dtype, dtype)


def local_size_from(environ: Mapping[str, str]) -> int | None:
    """This host's rank count from the launcher's variables, before the process group exists (None: not said)."""
    for name in ("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        value = environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return None


def use_local_gpu(local_rank: int) -> int | None:
    """`torch.cuda.set_device(local_rank)`, as Horovod's GPU scripts do themselves, when that GPU exists; returns
    the current CUDA device of this thread afterwards (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    if local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
    return int(torch.cuda.current_device())

