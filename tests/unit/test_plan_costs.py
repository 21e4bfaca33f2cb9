"""The performance model's cost formulas against values computed by hand (independent of the code)."""

from __future__ import annotations

import math

import pytest

from dtrain.plan import collectives as cc
from dtrain.plan.overlap import (
    BucketCost,
    bucket_sizes_bytes,
    ddp_bucket_sizes_bytes,
    exposed_after_backward_s,
    uniform_ready_times_s,
)
from dtrain.plan.spec import ComputeSpec, HostCost, ModelSpec, StrategySpec, TopologySpec
from dtrain.plan.step import predict_step
from dtrain.plan.units import MIB, gbit_per_s_to_bytes_per_s

TOL = 1e-12


# ------------------------------------------------------------------------------------------- collectives


def test_ring_allreduce_by_hand() -> None:
    # S = 100 MB, n = 4, B = 10 GB/s, alpha = 10 us: 2*3/4 * 0.01 s + 2*3 * 10 us = 0.015 + 0.00006
    assert cc.ring_allreduce_seconds(100e6, 4, 10e9, 10e-6) == pytest.approx(0.01506, abs=TOL)
    # n = 2: each rank sends and receives S/2 twice: S/B + 2 alpha = 0.001 + 0.00002
    assert cc.ring_allreduce_seconds(1e6, 2, 1e9, 10e-6) == pytest.approx(0.00102, abs=TOL)
    assert cc.ring_allreduce_seconds(1e9, 1, 1e9, 1.0) == 0.0


def test_ring_approaches_twice_the_message_over_the_bandwidth() -> None:
    # the bandwidth-optimal bound 2(n-1)/n * S/B tends to 2 S/B (Patarasuk and Yuan 2009)
    assert cc.ring_allreduce_seconds(1e9, 10_000, 1e9, 0.0) == pytest.approx(2 * 9_999 / 10_000, abs=TOL)


def test_tree_allreduce_by_hand() -> None:
    # n = 8: 2 * log2(8) = 6 steps, each alpha + S/B = 5 us + 1 ms
    assert cc.tree_allreduce_seconds(1e6, 8, 1e9, 5e-6) == pytest.approx(6 * 1.005e-3, abs=TOL)
    # n = 5 rounds up to 3 levels: 6 steps
    assert cc.tree_allreduce_seconds(1e6, 5, 1e9, 5e-6) == pytest.approx(6 * 1.005e-3, abs=TOL)
    # small messages: the tree's 6 steps beat the ring's 14 when latency dominates
    assert cc.tree_allreduce_seconds(8, 8, 1e9, 5e-6) < cc.ring_allreduce_seconds(8, 8, 1e9, 5e-6)
    # large messages: the tree sends the whole message 6 times, the ring 2*7/8 of it
    assert cc.tree_allreduce_seconds(1e9, 8, 1e9, 5e-6) > cc.ring_allreduce_seconds(1e9, 8, 1e9, 5e-6)


def test_halving_doubling_by_hand() -> None:
    # n = 32 servers (Goyal et al.): ring bytes, 2*5 = 10 latency steps
    expected = 2 * 31 / 32 * 100e6 / 6.25e9 + 10 * 25e-6
    assert cc.halving_doubling_allreduce_seconds(100e6, 32, 6.25e9, 25e-6) == pytest.approx(expected, abs=TOL)


def test_shared_medium_carries_every_ranks_bytes_one_after_another() -> None:
    # 2 ranks on one queue: 2 * S on the wire -> 2 S / B, twice the full-duplex ring's S / B
    assert cc.shared_medium_allreduce_seconds(16e6, 2, 125e6, 0.0) == pytest.approx(0.256, abs=TOL)
    assert cc.shared_medium_allreduce_seconds(16e6, 2, 125e6, 0.0) == pytest.approx(
        2 * cc.ring_allreduce_seconds(16e6, 2, 125e6, 0.0), abs=TOL)
    # 4 ranks, ring: 2*3 * S / B + 6 alpha
    assert cc.shared_medium_allreduce_seconds(1e6, 4, 1e9, 1e-6) == pytest.approx(6e-3 + 6e-6, abs=TOL)


def test_hierarchical_allreduce_by_hand() -> None:
    # 4 nodes x 8 devices, S = 80 MB; intra 20 GB/s, 5 us; inter 12.5 GB/s, 10 us, ring between nodes
    intra = 2 * (7 / 8 * 80e6 / 20e9 + 7 * 5e-6)  # reduce-scatter + all-gather inside the node
    inter = 2 * 3 / 4 * 80e6 / 12.5e9 + 2 * 3 * 10e-6
    got = cc.hierarchical_allreduce_seconds(80e6, 4, 8, 20e9, 5e-6, 12.5e9, 10e-6)
    assert got == pytest.approx(intra + inter, abs=TOL)
    assert cc.hierarchical_allreduce_seconds(80e6, 1, 1, 20e9, 5e-6, 12.5e9, 10e-6) == 0.0


def test_parameter_server_load_per_server_by_hand() -> None:
    # S = 100 MB, W = 16 workers, P = 4 servers: each server takes 16 * 25 MB in and sends 16 * 25 MB out
    assert cc.parameter_server_bytes_per_server(100e6, 16, 4) == pytest.approx(800e6, abs=TOL)
    # servers on 10 Gbit/s (1.25 GB/s): 0.64 s; a worker on 100 Gbit/s moves 200 MB in 0.016 s
    assert cc.parameter_server_seconds(100e6, 16, 4, 1.25e9, 12.5e9, 1e-5) == pytest.approx(0.64 + 2e-5, abs=TOL)
    # enough servers: the worker's own NIC decides
    assert cc.parameter_server_seconds(100e6, 16, 400, 1.25e9, 12.5e9, 0.0) == pytest.approx(0.016, abs=TOL)


def test_fewest_servers_lemma_by_hand() -> None:
    # P >= 2 S W / (B T) = 2 * 100 MB * 16 / (1.25 GB/s * 0.2 s) = 12.8 -> 13
    assert cc.fewest_servers_to_carry(100e6, 16, 1.25e9, 0.2) == 13
    assert cc.fewest_servers_to_carry(1e3, 2, 1e9, 1.0) == 1
    assert cc.fewest_servers_to_carry(100e6, 16, 1.28e9, 0.25) == 10  # exactly 10.0 needs no 11th


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        cc.ring_allreduce_seconds(1, 0, 1, 0)
    with pytest.raises(ValueError):
        cc.allreduce_seconds("butterfly", 1, 2, 1, 0)
    with pytest.raises(ValueError):
        cc.parameter_server_bytes_per_server(1, 4, 0)


# --------------------------------------------------------------------------------------------- overlap


def test_buckets_split_like_ddp() -> None:
    assert bucket_sizes_bytes(60 * MIB, 25 * MIB, 1 * MIB) == [1 * MIB, 25 * MIB, 25 * MIB, 9 * MIB]
    assert bucket_sizes_bytes(0.5 * MIB, 25 * MIB, 1 * MIB) == [0.5 * MIB]
    # DDP closes a bucket once it reaches its cap, so the parameter that crosses the cap stays in it
    assert ddp_bucket_sizes_bytes([40, 40960, 4096, 4 * MIB, 4096, 4 * MIB, 4096], 25 * MIB, 1 * MIB) == [
        40 + 40960 + 4096 + 4 * MIB, 4096 + 4 * MIB + 4096]
    assert uniform_ready_times_s([1, 1, 2], 0.4) == pytest.approx([0.1, 0.2, 0.4])


def test_a_single_bucket_cannot_overlap() -> None:
    assert exposed_after_backward_s([BucketCost(0.030)], [0.100], 0.100, overlap=True) == pytest.approx(0.030)


def test_small_buckets_hide_but_the_last() -> None:
    # four 10 ms collectives ready at 25, 50, 75, 100 ms: each finishes before the next is ready; the last shows
    buckets = [BucketCost(0.010)] * 4
    assert exposed_after_backward_s(buckets, [0.025, 0.05, 0.075, 0.1], 0.1, True) == pytest.approx(0.010)


def test_long_collectives_queue_up() -> None:
    # four 40 ms collectives ready at 25, 50, 75, 100 ms: they end at 65, 105, 145, 185 -> 85 ms after backward
    buckets = [BucketCost(0.040)] * 4
    assert exposed_after_backward_s(buckets, [0.025, 0.05, 0.075, 0.1], 0.1, True) == pytest.approx(0.085)
    assert exposed_after_backward_s(buckets, [0.025, 0.05, 0.075, 0.1], 0.1, False) == pytest.approx(0.160)


def test_host_cost_never_hides() -> None:
    # CPU-bound collectives (host = link = 10 ms): backward is stretched by their CPU time, all 40 ms show
    buckets = [BucketCost(0.010, host_s=0.010)] * 4
    assert exposed_after_backward_s(buckets, [0.025, 0.05, 0.075, 0.1], 0.1, True) == pytest.approx(0.040)
    # a slow link with a little host work: the host part of earlier buckets delays later ones
    slow = [BucketCost(0.040, host_s=0.005)] * 2
    # r1 = 50, f1 = 90; r2 = 100 + 5 = 105, f2 = 145; end = max(100 + 10, 145) -> 45 ms
    assert exposed_after_backward_s(slow, [0.05, 0.1], 0.1, True) == pytest.approx(0.045)


# ------------------------------------------------------------------------------------------------ step


def _cluster(**changes: object) -> tuple[ModelSpec, ComputeSpec, TopologySpec, StrategySpec]:
    model = ModelSpec("m", parameters=25_000_000)  # 100 MB of fp32 gradient
    compute = ComputeSpec(seconds_per_sample=0.003, backward_fraction=2 / 3)  # 96 ms per 32 samples
    topology = TopologySpec(devices_per_node=8, intra_bandwidth_bytes_per_s=100e9,
                            inter_bandwidth_bytes_per_s=gbit_per_s_to_bytes_per_s(10))
    strategy = StrategySpec(overlap=False, bucket_bytes=200e6, first_bucket_bytes=200e6)  # one bucket
    return model, compute, topology, strategy.with_(**changes)


def test_step_without_overlap_by_hand() -> None:
    model, compute, topology, strategy = _cluster()
    p = predict_step(model, compute, topology, strategy, devices=16, per_device_batch=32)
    comm = 2 * 15 / 16 * 100e6 / 1.25e9  # 0.15 s over the 10 Gbit/s links between the 2 nodes
    assert p.compute_s == pytest.approx(0.096)
    assert p.exposed_communication_s == pytest.approx(comm)
    assert p.step_s == pytest.approx(0.096 + comm)
    assert p.samples_per_s == pytest.approx(512 / (0.096 + comm))
    assert p.scaling_efficiency == pytest.approx(0.096 / (0.096 + comm))
    assert p.bottleneck == "communication: inter-node bandwidth"


def test_aggregation_divides_the_exposed_communication() -> None:
    model, compute, topology, strategy = _cluster(aggregation_frequency=4)
    p = predict_step(model, compute, topology, strategy, devices=16, per_device_batch=32)
    assert p.exposed_communication_s == pytest.approx(2 * 15 / 16 * 100e6 / 1.25e9 / 4)


def test_compression_divides_the_bytes() -> None:
    model, compute, topology, strategy = _cluster(compression_ratio=0.5)
    p = predict_step(model, compute, topology, strategy, devices=16, per_device_batch=32)
    assert p.communication_s == pytest.approx(2 * 15 / 16 * 50e6 / 1.25e9)


def test_one_device_and_one_node() -> None:
    model, compute, topology, strategy = _cluster()
    one = predict_step(model, compute, topology, strategy, devices=1, per_device_batch=32)
    assert one.step_s == one.compute_s and one.scaling_efficiency == 1.0 and one.bottleneck == "compute"
    node = predict_step(model, compute, topology, strategy, devices=8, per_device_batch=32)
    assert node.communication_s == pytest.approx(2 * 7 / 8 * 100e6 / 100e9)  # the fast link inside the node


def test_overlap_hides_what_backward_covers() -> None:
    model, compute, topology, strategy = _cluster(overlap=True, bucket_bytes=25e6, first_bucket_bytes=25e6)
    p = predict_step(model, compute, topology, strategy, devices=16, per_device_batch=32)
    # 4 buckets of 37.5 ms each, ready every 16 ms of the 64 ms backward: exposed = 150 - 48 = 102 ms
    assert p.exposed_communication_s == pytest.approx(0.150 - 0.064 * 3 / 4)


def test_parameter_servers_in_a_step() -> None:
    model, compute, topology, strategy = _cluster(algorithm="parameter_server", servers=4)
    p = predict_step(model, compute, topology, strategy, devices=16, per_device_batch=32)
    assert p.communication_s == pytest.approx(2 * 100e6 * 16 / 4 / 1.25e9)  # the servers' NICs
    assert p.bottleneck == "communication: parameter-server NICs"


def test_host_cost_and_shared_medium_of_this_machine() -> None:
    # 2 workers on a loopback shaped to 1 Gbit/s: the 16 MB all-reduce puts 32 MB on the one queue (0.256 s);
    # the host's 2*alpha + S*beta (0.2 ms + 16 ms) is less, so the link decides
    model = ModelSpec("m", parameters=4_000_000)
    topology = TopologySpec(devices_per_node=2, intra_bandwidth_bytes_per_s=125e6, shared_medium=True,
                            host=HostCost(latency_s=1e-4, seconds_per_byte=1e-9))
    strategy = StrategySpec(overlap=False, bucket_bytes=32e6, first_bucket_bytes=32e6)
    p = predict_step(model, ComputeSpec(seconds_per_sample=1e-3), topology, strategy, 2, 10)
    assert p.communication_s == pytest.approx(0.256)
    loopback = TopologySpec(devices_per_node=2, intra_bandwidth_bytes_per_s=1e9, intra_latency_s=1e-4,
                            host=HostCost(latency_s=1e-4, seconds_per_byte=1e-9))
    q = predict_step(model, ComputeSpec(seconds_per_sample=1e-3), loopback, strategy.with_(overlap=True), 2, 10)
    assert q.exposed_communication_s == pytest.approx(2e-4 + 16e-3)  # CPU-bound: nothing hides


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        StrategySpec(algorithm="gossip")
    with pytest.raises(ValueError, match="compression_ratio"):
        StrategySpec(compression_ratio=0)
    with pytest.raises(ValueError, match="seconds_per_sample"):
        ComputeSpec(seconds_per_sample=0)
    with pytest.raises(ValueError, match="devices_per_node"):
        TopologySpec(devices_per_node=0)
    assert math.isinf(TopologySpec().inter_bandwidth_bytes_per_s)
