"""Which backend dtrain's horovod.torch asks torch for (gloo for CPU tensors; NCCL for CUDA tensors where each local
rank has a GPU, unless HOROVOD_GPU_OPERATIONS says GLOO), the GPU it makes current, the type each dtype is reduced in
per backend, and the device column of the negotiation's metadata. No GPU here: torch.cuda and NCCL's availability are
faked, the group itself is gloo (this torch has no NCCL), and the backend string asked for is what is checked."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtrain.horovod import backends
from dtrain.horovod.backends import GLOO, NCCL_FOR_CUDA, BackendChoiceError, choose_backend

CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


def test_cuda_tensors_go_through_nccl_only_where_each_local_rank_has_a_gpu() -> None:
    assert choose_backend({}, local_size=1, gpus=0, nccl_available=True) == GLOO  # CPU-only: as before
    assert choose_backend({}, local_size=2, gpus=2, nccl_available=True) == NCCL_FOR_CUDA
    assert choose_backend({}, local_size=None, gpus=1, nccl_available=True) == NCCL_FOR_CUDA
    assert choose_backend({}, local_size=3, gpus=2, nccl_available=True) == GLOO  # NCCL refuses 2 ranks on a GPU
    assert choose_backend({}, local_size=1, gpus=1, nccl_available=False) == GLOO  # torch built without NCCL
    assert choose_backend({"HOROVOD_GPU_OPERATIONS": "gloo"}, local_size=1, gpus=8, nccl_available=True) == GLOO
    assert choose_backend({"HOROVOD_GPU_OPERATIONS": "NCCL"}, local_size=8, gpus=8,
                          nccl_available=True) == NCCL_FOR_CUDA


@pytest.mark.parametrize(("environ", "local_size", "gpus", "nccl", "says"), [
    ({"HOROVOD_GPU_OPERATIONS": "MPI"}, 1, 1, True, "HOROVOD_GPU_OPERATIONS=MPI has no backend on dtrain"),
    ({"HOROVOD_GPU_OPERATIONS": "NCCL"}, 1, 0, True, "sees no CUDA GPU"),
    ({"HOROVOD_GPU_OPERATIONS": "NCCL"}, 1, 1, False, "was built without NCCL"),
    ({"HOROVOD_GPU_OPERATIONS": "NCCL"}, 4, 2, True, "runs 4 ranks on 2 GPU(s)"),
])
def test_a_gpu_library_this_machine_cannot_give_is_one_line(environ: dict[str, str], local_size: int, gpus: int,
                                                            nccl: bool, says: str) -> None:
    with pytest.raises(BackendChoiceError, match=r"^HOROVOD_GPU_OPERATIONS=") as raised:
        choose_backend(environ, local_size, gpus=gpus, nccl_available=nccl)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_each_backend_reduces_what_it_carries_and_widens_only_what_it_lacks() -> None:
    mixed = backends.device_backends(NCCL_FOR_CUDA)
    assert mixed == {"cpu": "gloo", "cuda": "nccl"}
    assert backends.device_backends("cpu:gloo,cuda:gloo") == backends.device_backends("gloo")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int8, torch.int32):
        assert backends.reduce_wire(dtype, CUDA, mixed) == dtype  # NCCL carries them as they are
    assert backends.reduce_wire(torch.int16, CUDA, mixed) == torch.int64  # NCCL has no 16-bit integers
    for where, table in ((CPU, mixed), (CUDA, backends.device_backends("gloo"))):  # gloo, whatever the device
        assert backends.reduce_wire(torch.float16, where, table) == torch.float32
        assert backends.reduce_wire(torch.bfloat16, where, table) == torch.float32
        assert backends.reduce_wire(torch.int16, where, table) == torch.int64


def test_the_device_is_part_of_what_ranks_must_agree_on_and_of_the_fusion_key() -> None:
    from dtrain.horovod.negotiation import DEVICE, describe, fusion_key, metadata_row, rows_differ, shape_of

    on_cpu = metadata_row("ALLREDUCE", torch.ones(2, 3))
    on_gpu = on_cpu.clone()
    on_gpu[DEVICE] = 1  # what a CUDA tensor of the same shape gives
    assert shape_of(on_cpu) == [2, 3] and not rows_differ("ALLREDUCE", on_cpu, on_cpu.clone())
    assert rows_differ("ALLREDUCE", on_gpu, on_cpu)
    assert describe(on_cpu).endswith("(2, 3) on cpu op Sum") and " on cuda " in describe(on_gpu)
    assert fusion_key(0, torch.float32, 0, CPU) != fusion_key(0, torch.float32, 0, CUDA)


@pytest.fixture
def fake_gpu_host(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """torch sees `gpus` GPUs and NCCL; init_process_group records the backend asked for and makes a gloo group
    (this torch has no NCCL), and get_backend_config answers what was asked for."""
    seen: dict[str, list[Any]] = {"asked": [], "set_device": []}
    real_init, real_config = dist.init_process_group, dist.get_backend_config

    def init_process_group(backend: str, **kwargs: Any) -> None:
        seen["asked"].append(backend)
        real_init("gloo", **kwargs)

    for name in ("MASTER_ADDR", "HOROVOD_GPU_OPERATIONS", "HOROVOD_CPU_OPERATIONS", "HOROVOD_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "get_backend_config",
                        lambda group=None: seen["asked"][-1] if group is None else real_config(group))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen["set_device"].append(index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: seen["set_device"][-1])
    return seen


def test_init_on_a_gpu_host_asks_for_gloo_and_nccl_by_device_and_uses_the_local_gpu(
        fake_gpu_host: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    import dtrain.horovod.torch as hvd
    from dtrain.horovod import basics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    hvd.init()
    try:
        assert fake_gpu_host["asked"] == [NCCL_FOR_CUDA] and fake_gpu_host["set_device"] == [hvd.local_rank()]
        assert basics.STATE.backends == {"cpu": "gloo", "cuda": "nccl"} and basics.STATE.cuda_device == 0
        reduced = hvd.allreduce(torch.tensor([1.5, -2.0], dtype=torch.float16), op=hvd.Sum, name="cpu")
        assert reduced.dtype == torch.float16 and torch.equal(reduced, torch.tensor([1.5, -2.0]).half())
    finally:
        hvd.shutdown()


def test_init_without_a_gpu_asks_for_gloo_as_before(fake_gpu_host: dict[str, list[Any]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import dtrain.horovod.torch as hvd
    from dtrain.horovod import basics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "MPI")
    with pytest.warns(UserWarning, match="HOROVOD_CPU_OPERATIONS=MPI is ignored"):
        hvd.init()
    try:
        assert fake_gpu_host["asked"] == [GLOO] and fake_gpu_host["set_device"] == []
        assert basics.STATE.backends == {"cpu": "gloo", "cuda": "gloo"} and basics.STATE.cuda_device is None
    finally:
        hvd.shutdown()


def test_a_gpu_library_asked_for_and_missing_stops_init_with_one_line(
        fake_gpu_host: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dtrain.horovod.torch as hvd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HOROVOD_GPU_OPERATIONS", "NCCL")
    with pytest.raises(SystemExit) as stopped:
        hvd.init()
    assert stopped.value.code == 2 and not hvd.is_initialized() and fake_gpu_host["asked"] == []
    assert capsys.readouterr().err.strip().startswith("dtrain.horovod: error: HOROVOD_GPU_OPERATIONS=NCCL but torch")


def test_horovodrun_refuses_a_gpu_library_this_host_cannot_give_before_any_worker_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.commands.horovodrun import _check_gpu_operations
    from dtrain.errors import LaunchError
    from dtrain.horovod.launcher import HorovodRun

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HOROVOD_GPU_OPERATIONS", "NCCL")
    with pytest.raises(LaunchError, match="HOROVOD_GPU_OPERATIONS=NCCL but torch .* sees no CUDA GPU"):
        _check_gpu_operations(HorovodRun(command=["true"], np=2))
    with pytest.raises(LaunchError, match="elastic job's process groups are gloo"):
        _check_gpu_operations(HorovodRun(command=["true"], np=2, min_np=1, max_np=2))
    _check_gpu_operations(HorovodRun(command=["true"], np=2, hosts=[("a", 1), ("b", 1)]))  # other hosts' GPUs
    monkeypatch.setenv("HOROVOD_GPU_OPERATIONS", "GLOO")
    _check_gpu_operations(HorovodRun(command=["true"], np=2))
