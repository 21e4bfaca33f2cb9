"""Parameter-server pieces in one process: byte-balanced sharding, the server's sync/async/ssp rules driven from
threads (the SSP clock-gap property under random delays), backup workers, staleness-scaled rates, config rules."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.sync.ps_server import ShardServer, ShardSpec
from dtrain.sync.ps_shards import TensorSize, shard_by_bytes, shard_bytes

# ------------------------------------------------------------------------------------------------ sharding


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(1, 5000), min_size=1, max_size=12), servers=st.integers(1, 5),
       element_size=st.sampled_from([2, 4, 8]))
def test_split_shards_cover_every_element_once_and_balance_bytes(numels: list[int], servers: int,
                                                                 element_size: int) -> None:
    sizes = [TensorSize(n, element_size) for n in numels]
    shards = shard_by_bytes(sizes, servers)
    covered: dict[int, list[tuple[int, int]]] = {}
    for shard in shards:
        for piece in shard:
            covered.setdefault(piece.param, []).append((piece.start, piece.stop))
    for index, numel in enumerate(numels):
        ranges = sorted(covered[index])
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous, no overlap
    loads = [shard_bytes(shard, sizes) for shard in shards]
    total = sum(n * element_size for n in numels)
    assert max(loads) - total / servers <= element_size  # balanced to within one element


def test_whole_tensor_shards_go_largest_first_to_the_least_loaded_server() -> None:
    sizes = [TensorSize(n, 4) for n in (10, 400, 30, 300, 20)]
    shards = shard_by_bytes(sizes, 2, split_tensors=False)
    assert [[p.param for p in shard] for shard in shards] == [[1], [0, 2, 3, 4]]  # 400 | 300+30+20+10
    assert all(p.start == 0 and p.stop == sizes[p.param].numel for shard in shards for p in shard)


def test_two_servers_each_hold_half_of_a_model_dominated_by_one_tensor() -> None:
    sizes = [TensorSize(n, 4) for n in (288, 32, 18432, 64, 401408, 128, 1280, 10)]  # the Fashion-MNIST CNN
    assert [shard_bytes(s, sizes) for s in shard_by_bytes(sizes, 2)] == [843284, 843284]


# ------------------------------------------------------------------------------------------------- servers


def make_server(workers: int, numel: int = 3, lr: float = 0.1, **kwargs: Any) -> ShardServer:
    server = ShardServer(workers=workers, **kwargs)
    server.setup(ShardSpec(pieces=[torch.zeros(numel, dtype=torch.float64)], groups=[0],
                           optimizer_class=torch.optim.SGD, group_options=[{"lr": lr}], layout=[(0, 0, numel)]))
    return server


def options(lr: float = 0.1) -> list[dict[str, Any]]:
    return [{"lr": lr}]


def test_sync_applies_the_mean_once_every_worker_has_pushed() -> None:
    server = make_server(2)
    first = server.push(0, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), 0, options())
    assert not first.done()  # waits for worker 1
    second = server.push(1, torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64), 0, options())
    for future in (first, second):
        reply = future.wait()
        assert torch.allclose(reply.params, torch.full((3,), -0.2, dtype=torch.float64))
        assert reply.version == 1 and reply.global_step == 1
    assert server.stats.staleness == {0: 2}


def test_backup_workers_use_the_first_arrivals_and_drop_late_gradients() -> None:
    server = make_server(3, backup_workers=1)
    a = server.push(0, torch.ones(3, dtype=torch.float64), 0, options())
    b = server.push(2, 3 * torch.ones(3, dtype=torch.float64), 0, options())
    assert a.done() and b.done()  # two of three were enough
    assert torch.allclose(a.wait().params, torch.full((3,), -0.2, dtype=torch.float64))
    late = server.push(1, 100 * torch.ones(3, dtype=torch.float64), 0, options())  # computed on version 0
    assert late.done() and late.wait().version == 1  # dropped: it continues from the current parameters
    assert torch.allclose(late.wait().params, torch.full((3,), -0.2, dtype=torch.float64))
    assert server.stats.dropped == 1


def test_async_staleness_counts_updates_since_the_pull_and_staleness_lr_divides_the_rate() -> None:
    server = make_server(2, mode="async", staleness_lr=True, lr=1.0)  # each gradient counts 1/2 (two workers)
    server.push(0, torch.ones(3, dtype=torch.float64), 0, options(1.0)).wait()  # staleness 0: -1/2
    server.push(0, torch.ones(3, dtype=torch.float64), 1, options(1.0)).wait()  # staleness 0: -1/2
    reply = server.push(1, torch.ones(3, dtype=torch.float64), 0, options(1.0)).wait()  # staleness 2: -1/2 / 2
    assert torch.allclose(reply.params, torch.full((3,), -1.25, dtype=torch.float64))
    assert server.stats.staleness == {0: 2, 2: 1}
    assert reply.global_step == 3 // 2


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), workers=st.integers(2, 4), bound=st.integers(0, 3))
def test_ssp_clock_gap_never_exceeds_the_bound_under_random_delays(seed: int, workers: int, bound: int) -> None:
    """Worker threads with random compute times (one of them much slower) push 12 gradients each; whenever a worker
    is allowed to start a step, its clock is at most `bound` ahead of the slowest worker's."""
    server = make_server(workers, mode="ssp", staleness=bound)
    rng = random.Random(seed)
    delays = [[rng.uniform(0, 0.002) * (5 if w == 0 else 1) for _ in range(12)] for w in range(workers)]
    gaps: list[int] = []
    lock = threading.Lock()

    def work(worker: int) -> None:
        version = 0
        for delay in delays[worker]:
            time.sleep(delay)
            version = server.push(worker, torch.ones(3, dtype=torch.float64), version, options()).wait().version
            with server.lock:  # the clocks as this worker starts its next step
                gap = server.clocks[worker] - min(server.clocks)
            with lock:
                gaps.append(gap)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert len(gaps) == 12 * workers
    assert max(gaps) <= bound
    assert server.stats.max_clock_gap <= bound
    assert server.clocks == [12] * workers


def test_ssp_without_the_bound_would_be_violated() -> None:
    """The property above is not vacuous: with a slow worker, plain async lets clocks drift far apart."""
    server = make_server(2, mode="async")
    for _ in range(6):
        server.push(1, torch.ones(3, dtype=torch.float64), 0, options()).wait()
    assert server.clocks[1] - server.clocks[0] == 6
    ssp = make_server(2, mode="ssp", staleness=2)
    held = [ssp.push(1, torch.ones(3, dtype=torch.float64), 0, options()) for _ in range(3)]
    assert [f.done() for f in held] == [True, True, False]  # the third would be 3 ahead: held
    ssp.push(0, torch.ones(3, dtype=torch.float64), 0, options())
    assert held[2].done()


def test_a_paused_worker_does_not_hold_the_others_back() -> None:
    ssp = make_server(2, mode="ssp", staleness=1)
    ssp.push(0, torch.ones(3, dtype=torch.float64), 0, options()).wait()
    waiting = ssp.push(0, torch.ones(3, dtype=torch.float64), 1, options())  # 2 ahead of worker 1: held
    assert not waiting.done()
    ssp.pause(1)  # worker 1 waits at a validation meeting: worker 0 must be able to get there too
    assert waiting.done()


def test_server_state_round_trips_and_refuses_another_layout() -> None:
    server = make_server(1, mode="async")
    server.push(0, torch.ones(3, dtype=torch.float64), 0, options()).wait()
    state = server.state_dict()
    restored = make_server(1, mode="async")
    restored.load_state_dict(state)
    assert restored.version == 1 and torch.equal(restored.pull().params, server.pull().params)
    other = make_server(1, numel=4, mode="async")
    with pytest.raises(ValueError, match="do not match"):
        other.load_state_dict(state)


# -------------------------------------------------------------------------------------------------- config

BASE = {"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 12}, "resources": {"slots_per_trial": 3},
        "searcher": {"max_length": {"batches": 1}}}


@pytest.mark.parametrize(("ps", "extra", "message"), [
    ({"backup_workers": 3}, {}, r"backup_workers \(3\) must be below resources.slots_per_trial \(3\)"),
    ({"mode": "async", "backup_workers": 1}, {}, "applies to mode `sync` only"),
    ({"mode": "ssp"}, {"optimizations": {"aggregation_frequency": 2}}, "do not apply; remove them"),
    ({"backup_workers": 1}, {"optimizations": {"aggregation_frequency": 2}}, "backup_workers lets workers run"),
    ({"mode": "asink"}, {}, "did you mean `async`"),
    ({"server": 2}, {}, "did you mean `distributed.parameter_server.servers`"),
])
def test_parameter_server_config_errors_are_one_line(ps: dict[str, Any], extra: dict[str, Any], message: str) -> None:
    raw = {**BASE, "distributed": {"strategy": "parameter_server", "parameter_server": ps}, **extra}
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, raw=raw)
    assert "\n" not in str(info.value)



def test_the_compression_error_asks_only_to_remove_the_compression() -> None:
    """`op: average` is the parameter server's own op: the compressor's error must not forbid it too."""
    raw = {**BASE, "distributed": {"strategy": "parameter_server", "op": "average",
                                   "compression": {"name": "topk", "ratio": 0.1}}}
    with pytest.raises(ConfigError) as info:
        load_config(None, raw=raw)
    message = str(info.value)
    assert "remove distributed.compression" in message and "distributed.op" not in message and "op " not in message
    load_config(None, raw={**BASE, "distributed": {"strategy": "parameter_server", "op": "average"}})

# ---------------------------------------------------------------- async shares with adaptive optimizers


OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 0.01}),
              "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              "rmsprop": (torch.optim.RMSprop, {"lr": 0.01})}


def _async_against_sync(name: str, spread: float, workers: int = 2, batches: int = 4) -> float:
    """Largest distance, in float64, between the parameters of an async server fed `batches` global batches of W
    gradients (g_t + spread * d_t,i, the d_t,i summing to zero over the workers) and those of the same optimizer
    stepped once per global batch with the mean g_t, as synchronous training does."""
    optimizer_class, settings = OPTIMIZERS[name]
    start = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    server = ShardServer(workers=workers, mode="async")
    server.setup(ShardSpec(pieces=[start.clone()], groups=[0], optimizer_class=optimizer_class,
                           group_options=[settings], layout=[(0, 0, 3)]))
    reference = torch.nn.Parameter(start.clone())
    synchronous = optimizer_class([reference], **settings)
    generator = torch.Generator().manual_seed(0)
    for _ in range(batches):
        mean = torch.randn(3, dtype=torch.float64, generator=generator)
        offsets = torch.randn(workers, 3, dtype=torch.float64, generator=generator)
        offsets -= offsets.mean(dim=0)
        for worker in range(workers):
            server.push(worker, mean + spread * offsets[worker], server.version, [settings]).wait()
        reference.grad = mean.clone()
        synchronous.step()
    return float((server.params[0].detach() - reference.detach()).abs().max())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_global_batchs_async_pushes_move_the_parameters_as_one_synchronous_update(name: str) -> None:
    """Equal gradients: the W shares are the synchronous update (to rounding); spread gradients: the distance is
    second order in the spread (a tenth of the spread, about a hundredth of the distance), so the first-order terms
    agree. Before the shares, Adam made W full steps a global batch: a distance of about (W - 1) x lr x batches."""
    assert _async_against_sync(name, 0.0) < 1e-12
    wide, narrow = _async_against_sync(name, 0.1), _async_against_sync(name, 0.01)
    if name == "sgd_momentum":  # an update linear in the gradient: the shares are exact at any spread
        assert wide < 1e-12
    else:
        assert narrow < 1e-4 and 30 < wide / narrow < 300, (wide, narrow)


def test_async_shares_survive_a_checkpoint_between_the_pushes_of_a_global_batch() -> None:
    def fed(server: ShardServer, pushes: list[int]) -> None:
        for worker in pushes:
            server.push(worker, torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) * (worker + 1), server.version,
                        [{"lr": 0.01}]).wait()

    def adam_server() -> ShardServer:
        server = ShardServer(workers=2, mode="async")
        server.setup(ShardSpec(pieces=[torch.zeros(3, dtype=torch.float64)], groups=[0],
                               optimizer_class=torch.optim.Adam, group_options=[{"lr": 0.01}], layout=[(0, 0, 3)]))
        return server

    whole, first = adam_server(), adam_server()
    fed(whole, [0, 1, 0, 1])
    fed(first, [0, 1, 0])  # a checkpoint in the middle of the second global batch
    resumed = adam_server()
    resumed.load_state_dict(first.state_dict())
    fed(resumed, [1])
    assert torch.equal(resumed.params[0], whole.params[0])
