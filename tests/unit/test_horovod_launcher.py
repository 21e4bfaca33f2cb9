"""`dtrain horovodrun`'s pieces without processes: hosts, the layout of a launch, the variables each process
gets, and one-line errors for what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.errors import LaunchError
from dtrain.horovod.exec import horovod_environment
from dtrain.horovod.launcher import HorovodRun, environment, layout, parse_hosts


def test_hosts_from_flags_and_hostfiles() -> None:
    assert parse_hosts("localhost:2,node-b:4") == [("localhost", 2), ("node-b", 4)]
    assert parse_hosts("# two hosts\nnode-a slots=2\nnode-b slots=2\n") == [("node-a", 2), ("node-b", 2)]
    assert parse_hosts("solo") == [("solo", 1)]
    with pytest.raises(LaunchError, match="whole number"):
        parse_hosts("node-a:two")


def test_local_hosts_run_here_with_np_processes() -> None:
    assert layout(HorovodRun(command=["true"], np=2)) == (1, 2, 0, "127.0.0.1")
    assert layout(HorovodRun(command=["true"], hosts=[("localhost", 3)])) == (1, 3, 0, "127.0.0.1")
    with pytest.raises(LaunchError, match="more than the 2 slot"):
        layout(HorovodRun(command=["true"], np=4, hosts=[("localhost", 2)]))


def test_remote_hosts_need_a_node_rank_and_even_slots() -> None:
    hosts = [("node-a", 2), ("node-b", 2)]
    with pytest.raises(LaunchError, match="--node-rank"):
        layout(HorovodRun(command=["true"], np=4, hosts=hosts))
    assert layout(HorovodRun(command=["true"], np=4, hosts=hosts, node_rank=1)) == (2, 2, 1, "node-a")
    with pytest.raises(LaunchError, match="same number of slots"):
        layout(HorovodRun(command=["true"], np=3, hosts=[("node-a", 2), ("node-b", 1)], node_rank=0))
    with pytest.raises(LaunchError, match="above --max-np"):
        layout(HorovodRun(command=["true"], np=2, min_np=3, max_np=2))


def test_horovod_variables_come_from_torchrun_s() -> None:
    env = horovod_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                               "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                               "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "eth1"})
    assert {k: env[k] for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                                "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")} == {
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1" and env["HOROVOD_GLOO_IFACE"] == "eth1"
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_HOSTNAME"]


def test_horovodrun_flags_become_horovod_knobs(tmp_path: Path) -> None:
    env = environment(HorovodRun(command=["true"], fusion_threshold_mb=2, timeline_filename="t.json",
                                 network_interface="eth0", min_np=1, max_np=2, autotune=True, force=True), tmp_path)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
    assert env["HOROVOD_TIMELINE"] == "t.json" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["HOROVOD_ELASTIC"] == "1" and env["HOROVOD_AUTOTUNE"] == "1" and env["DTRAIN_HOROVOD_SHIM"] == "1"


def test_the_shim_steps_aside_for_a_real_horovod_unless_forced(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import dtrain.horovod.launcher as launcher

    monkeypatch.setattr(launcher, "real_horovod_installed", lambda: True)
    assert environment(HorovodRun(command=["true"]), tmp_path)["DTRAIN_HOROVOD_SHIM"] == "0"
    assert environment(HorovodRun(command=["true"], force=True), tmp_path)["DTRAIN_HOROVOD_SHIM"] == "1"
    monkeypatch.setattr(launcher, "real_horovod_installed", lambda: False)
    assert environment(HorovodRun(command=["true"]), tmp_path)["DTRAIN_HOROVOD_SHIM"] == "1"


def test_elastic_state_commits_restores_and_survives_a_restart(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import dtrain.horovod.torch as hvd

    monkeypatch.setenv("DTRAIN_HOROVOD_STATE_DIR", str(tmp_path))
    hvd.init()
    try:
        model = torch.nn.Linear(2, 1)
        sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
        state = hvd.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler,
                                       epoch=3, batch=0)
        sampler.record_batch(0, 4)
        state.batch = 1
        state.commit()
        with torch.no_grad():
            model.weight.fill_(7.0)
        state.batch = 5
        state.restore()
        assert state.batch == 1 and float(model.weight.detach()[0, 0]) != 7.0 and list(sampler) == list(range(4, 10))
        fresh = torch.nn.Linear(2, 1)
        again = hvd.elastic.TorchState(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1),
                                       sampler=hvd.elastic.ElasticSampler(list(range(10)), shuffle=False),
                                       epoch=0, batch=0)
        seen = []

        @hvd.elastic.run
        def train(s: hvd.elastic.TorchState) -> None:
            seen.append((s.epoch, s.batch, len(list(s.sampler))))

        train(again)  # a restarted process: it loads the commit written above before syncing
        assert seen == [(3, 1, 6)] and torch.equal(fresh.weight, model.weight)
    finally:
        hvd.shutdown()


def test_single_process_api_before_and_after_init() -> None:
    import torch

    import dtrain.horovod.torch as hvd

    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()
    hvd.init()
    try:
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_size()) == (0, 1, 0, 1)
        assert hvd.gloo_built() and not hvd.mpi_built()
        with pytest.raises(ValueError, match="op and average"):
            hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
        with pytest.raises(ValueError, match="not reducible"):
            hvd.allreduce(torch.ones(1, dtype=torch.bool))
        with pytest.raises(ValueError, match="adding up to dim 0"):
            hvd.alltoall(torch.ones(3), splits=[2])
        with pytest.raises(RuntimeError, match="Average and hvd.Sum"):  # Horovod's core answers RuntimeError
            hvd.reducescatter(torch.ones(2), op=hvd.Max)
        model = torch.nn.Linear(2, 1)
        with pytest.raises(ValueError, match="unique"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=[("w", model.weight), ("w", model.bias)])
        with pytest.raises(ValueError, match="backward_passes_per_step"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
        with pytest.raises(ValueError, match="LBFGS"):
            hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)
        handle = hvd.allreduce_async(torch.ones(2), name="x")  # a name pending twice: test_horovod_negotiation.py
        assert torch.equal(hvd.synchronize(handle), torch.ones(2))
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()
