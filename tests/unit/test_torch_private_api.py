"""The private (or undocumented) torch APIs dtrain relies on, checked against the installed torch: each exists and
takes what dtrain passes, and where cheap, still does what dtrain relies on. A torch release that renames one of
them fails here, by name, instead of quietly switching a feature off. Each check says where dtrain uses the API.

A one-process gloo group (no other processes) stands in for a real one where the API needs a process group; the
behaviour under real failures is in tests/distributed/test_failures.py.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dtrain.comm.shm import _group_timeout
from dtrain.comm.stall import TESTED_TORCH, TESTED_TORCHES, default_store, set_collective_timeout
from dtrain.data.arrays import ArrayDataset, keep_batch
from dtrain.sync import allreduce
from dtrain.sync.allreduce import ddp_version_arguments

RELEASE = torch.__version__.split("+")[0]


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    """The default process group, of this process alone, on loopback."""
    assert not dist.is_initialized()
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        yield distributed_c10d._get_default_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


def _takes(function: object, *args: object, **kwargs: object) -> None:
    """Fail, naming `function`, unless its signature accepts these arguments."""
    try:
        inspect.signature(function).bind(*args, **kwargs)  # type: ignore[arg-type]
    except TypeError as exc:
        pytest.fail(f"{function} no longer takes {args} {kwargs} ({exc}); dtrain is tested with torch {TESTED_TORCH}")


def test_the_installed_release_is_one_dtrain_lists_as_tested() -> None:
    """A release these tests pass on is added to TESTED_TORCHES (with where), and docs/gpu.md says so."""
    assert RELEASE in TESTED_TORCHES, f"torch {RELEASE} is not in TESTED_TORCHES {sorted(TESTED_TORCHES)}"


# ------------------------------------------------------------------------------- comm/stall.py


def test_get_default_store_returns_the_groups_store(one_rank_group: dist.ProcessGroup) -> None:
    """comm/stall.py default_store(): the heartbeats of the stall monitor go through this store."""
    getter = distributed_c10d._get_default_store
    _takes(getter)
    store = default_store()
    assert isinstance(store, dist.Store)
    store.set("dtrain/probe", "1")
    assert getter().get("dtrain/probe") == b"1"


def test_set_pg_timeout_sets_the_gloo_timeout(one_rank_group: dist.ProcessGroup) -> None:
    """comm/stall.py set_collective_timeout(): distributed.timeout_seconds for a group created with another one
    (torch 2.14's public dist.set_timeout, else the private setter, which 2.14 deprecates);
    comm/shm.py reads it back from the same private field (a shared-memory wait gives up after it)."""
    setter = getattr(dist, "set_timeout", None) or distributed_c10d._set_pg_timeout  # public from torch 2.14
    _takes(setter, timedelta(seconds=1))
    backend = one_rank_group._get_backend(torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it has no backend to set the timeout on
        set_collective_timeout(7.0)
    assert backend.options._timeout == timedelta(seconds=7)
    assert _group_timeout() == 7.0
    set_collective_timeout(60.0)
    assert backend.options._timeout == timedelta(seconds=60)
    assert _group_timeout() == 60.0


# ------------------------------------------------------------------------------- sync/allreduce.py


# The recent DistributedDataParallel arguments sync/allreduce.py passes where torch takes them, by release: per-bucket
# caps (torch PR 169026, Nov 2025), batched gradient copies (PR 176638, Mar 2026; listed in 2.12's release notes)
# and init_sync (PR 142824, Dec 2024). Every release tested here takes all three; an older one gets the fallbacks.
DDP_ARGUMENTS_BY_RELEASE = {"2.13.0": {"bucket_cap_mb_list", "batched_grad_copy", "init_sync"},
                            "2.14.1": {"bucket_cap_mb_list", "batched_grad_copy", "init_sync"}}


def test_ddp_takes_the_arguments_dtrain_passes() -> None:
    """sync/allreduce.py _build_ddp(): what ddp_version_arguments picks binds to the installed DDP, and on a tested
    release it is every recent argument (none quietly dropped)."""
    arguments = ddp_version_arguments([1.0, 25.0], init_sync=False)
    _takes(DistributedDataParallel.__init__, object(), nn.Linear(1, 1), device_ids=None,
           find_unused_parameters=False, gradient_as_bucket_view=True, **arguments)
    expected = DDP_ARGUMENTS_BY_RELEASE.get(RELEASE)
    if expected is not None:
        assert set(arguments) == expected


def test_an_older_ddp_gets_the_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without the recent arguments (2.11 has no batched_grad_copy) gets one bucket size for all buckets,
    per-gradient copies and DDP's initial broadcast."""
    monkeypatch.setattr(allreduce, "_ddp_parameters", lambda: frozenset({"self", "module", "bucket_cap_mb"}))
    assert ddp_version_arguments([1.0, 25.0], init_sync=False) == {"bucket_cap_mb": 25.0}
    monkeypatch.setattr(allreduce, "_ddp_parameters",
                        lambda: frozenset({"bucket_cap_mb", "bucket_cap_mb_list", "init_sync"}))
    assert ddp_version_arguments([1.0, 4.0], init_sync=True) == {"bucket_cap_mb_list": [1.0, 4.0], "init_sync": True}


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def test_ddp_private_members_dtrain_uses(one_rank_group: dist.ProcessGroup) -> None:
    """sync/allreduce.py: Replica.check_reduction_finished() calls `_check_reducer_finalized`; the gradient
    observer reads `require_backward_grad_sync` (False under no_sync) to skip backward passes that do not
    communicate."""
    ddp = DistributedDataParallel(_two_layers(), gradient_as_bucket_view=True,
                                  **ddp_version_arguments([1.0, 25.0], init_sync=True))
    _takes(ddp._check_reducer_finalized)
    assert ddp.require_backward_grad_sync is True
    ddp(torch.ones(2, 4)).sum().backward()
    ddp._check_reducer_finalized()  # a finished reduction: no error
    with ddp.no_sync():
        assert ddp.require_backward_grad_sync is False
    assert ddp.require_backward_grad_sync is True


def test_private_members_the_tests_read(one_rank_group: dist.ProcessGroup) -> None:
    """tests/distributed/test_profile.py and test_sync_allreduce.py read `DDP._comm_hooks`,
    `Tensor._post_accumulate_grad_hooks` and `Reducer._get_zeros_like_grad_buckets()` to see what dtrain set up."""
    model = _two_layers()
    ddp = DistributedDataParallel(model)
    assert ddp._comm_hooks == []
    ddp.register_comm_hook(None, lambda _, bucket: torch.futures.Future())  # type: ignore[arg-type,return-value]
    assert len(ddp._comm_hooks) == 1
    weight = next(model.parameters())
    handle = weight.register_post_accumulate_grad_hook(lambda _: None)
    assert len(weight._post_accumulate_grad_hooks or {}) == 1
    handle.remove()
    assert len(weight._post_accumulate_grad_hooks or {}) == 0
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    assert sum(bucket.buffer().numel() for bucket in buckets) == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------- sync/parameter_server.py


def test_lr_scheduler_reads_opt_called() -> None:
    """sync/parameter_server.py step(): the servers step the optimizer, so dtrain sets `optimizer._opt_called` to
    tell the LR scheduler that the step happened (else it warns that the scheduler stepped first)."""
    def scheduler_step_warnings(mark: bool) -> list[str]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        if mark:
            optimizer._opt_called = True  # type: ignore[attr-defined]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler.step()
        return [str(w.message) for w in caught]

    assert any("lr_scheduler.step()" in text for text in scheduler_step_warnings(mark=False))
    assert scheduler_step_warnings(mark=True) == []


# ------------------------------------------------------------------------------- data/arrays.py


def test_dataloader_fetches_a_batch_with_getitems() -> None:
    """data/arrays.py ArrayDataset: the DataLoader hands a whole batch's indices to `__getitems__` (a protocol of
    torch's fetcher, not documented), and the Trainer's `keep_batch` collate keeps that batch as it is."""
    dataset = ArrayDataset(torch.arange(6.0).unsqueeze(1), torch.arange(6))
    asked: list[list[int]] = []
    original = dataset.__getitems__

    def recording(indices: list[int]) -> tuple[torch.Tensor, ...]:
        asked.append(list(indices))
        return original(indices)

    dataset.__getitems__ = recording  # type: ignore[method-assign]
    batches = list(DataLoader(dataset, batch_sampler=[[4, 1], [0, 5]], collate_fn=keep_batch))  # type: ignore[arg-type]
    assert asked == [[4, 1], [0, 5]]
    assert [batch[1].tolist() for batch in batches] == [[4, 1], [0, 5]]


# ------------------------------------------------------------------------------- launch.py, comm/topology.py


def test_child_failure_fields_launch_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.py _describe_failure(): `ChildFailedError.failures`, and each ProcessFailure's `exitcode`,
    `signal_name()` and `error_file_data["message"]["message"]` as `record` writes it."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("the worker's own error")
    except RuntimeError as exc:
        ErrorHandler().record_exception(exc)  # what @record does in the worker
    killed = ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    failed = ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=str(error_file))
    error = ChildFailedError("dtrain.worker", {0: killed, 1: failed})
    assert set(error.failures) == {0, 1}
    assert killed.exitcode == -signal.SIGKILL and killed.signal_name() == "SIGKILL"
    message = failed.error_file_data["message"]
    assert isinstance(message, dict) and "the worker's own error" in message["message"]
    assert json.loads(error_file.read_text())["message"]["message"] == message["message"]


def test_launch_config_takes_what_launch_passes(tmp_path: Path) -> None:
    """launch.py launch(): torch's launcher API (what torchrun uses; not in torch's documentation)."""
    logs = DefaultLogsSpecs(log_dir=str(tmp_path))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="probe", rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:29400", rdzv_configs={"is_host": True}, max_restarts=0,
                          monitor_interval=0.2, local_addr="127.0.0.1", logs_specs=logs)
    _takes(elastic_launch, config, entrypoint="python")
    _takes(elastic_launch(config, entrypoint="python"), "-u", "-m", "dtrain.worker")


def test_the_launcher_builds_its_agent_by_a_name_launch_py_can_replace() -> None:
    """launch.py _stopping_on_user_errors(): elastic_launch's launch_agent builds `LocalElasticAgent` by its name in
    torch.distributed.launcher.api, so StopOnUserError takes its place there; the agent's loop restarts a failed
    group only while `_remaining_restarts > 0`, right after `_monitor_workers(group)` (the same field torch's own
    agent zeroes for a worker stuck in the kernel); and a failure's `exitcode` is the worker's exit status."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.launcher import api

    assert api.LocalElasticAgent is local_elastic_agent.LocalElasticAgent
    assert "agent = LocalElasticAgent(" in inspect.getsource(api.launch_agent)
    loop = inspect.getsource(SimpleElasticAgent._invoke_run)
    assert "self._monitor_workers(self._worker_group)" in loop and "if self._remaining_restarts > 0:" in loop
    assert loop.index("self._monitor_workers(") < loop.index("if self._remaining_restarts > 0:")
    _takes(local_elastic_agent.LocalElasticAgent._monitor_workers, object(), object())
    assert "self._remaining_restarts = self._worker_group.spec.max_restarts" in inspect.getsource(SimpleElasticAgent)
    assert ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file="").exitcode == 2


def test_the_error_handler_records_a_caught_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """worker.py _user_exception(): get_error_handler().record_exception(exc) writes torch's error file for an
    exception the worker caught (what @record writes for one it did not), which _describe_failure reads."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise KeyError("cooldown")
    except KeyError as exc:
        get_error_handler().record_exception(exc)
    assert "KeyError" in json.loads(error_file.read_text())["message"]["message"]


def test_signal_exception_names_its_signal() -> None:
    """launch.py: a SignalException's `sigval.name` says which signal stopped the agent."""
    assert SignalException("stop", sigval=signal.SIGTERM).sigval.name == "SIGTERM"


def test_elastic_environment_variables_dtrain_reads_or_sets() -> None:
    """comm/topology.py reads TORCHELASTIC_USE_AGENT_STORE (set by torch's agent) to know whose store the workers
    use; launch.py sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE (read by torch's c10d rendezvous) so that the
    workers never use the agent's shared store (docs/clusters.md, "The workers' store"). Both are torch-internal
    names. comm/rendezvous.py's use of torch's dynamic handler is checked in tests/unit/test_rendezvous.py."""
    assert "TORCHELASTIC_USE_AGENT_STORE" in inspect.getsource(local_elastic_agent)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in inspect.getsource(dynamic_rendezvous)


def test_grad_scaler_keeps_its_scale_and_found_inf_where_mixed_precision_reads_them() -> None:
    """dtrain/train/precision.py: `_scale` (None until scale() first runs) and
    `_per_optimizer_states[id(opt)]["found_inf_per_device"]`, which update() reads after unscale_."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert scaler._scale is None
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    for flag in found.values():
        flag.fill_(1.0)  # what the all-reduced verdict does
    scaler.update()
    assert scaler.get_scale() == 4.0
