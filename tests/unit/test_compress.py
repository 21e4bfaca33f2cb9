"""Compressors against independent references: round-trip error bounds, QSGD's unbiasedness, conservation
under error feedback, bytes on the wire against their formulas, bounded loss at epsilon 0 against none."""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.compress import REGISTRY, BucketInfo, WireStats, build_compressor
from dtrain.compress.local import reduce_locally
from dtrain.compress.powersgd import PowerSGD
from dtrain.compress.qsgd import QSGD
from dtrain.compress.sign import pack_signs, unpack_signs
from dtrain.compress.topk import TopK, top_k_indices

SHAPES = [torch.Size([48, 40]), torch.Size([48]), torch.Size([10, 48]), torch.Size([10])]
N = sum(s.numel() for s in SHAPES)


def gradients(seed: int, world: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=generator, dtype=dtype) for _ in range(world)]


def round_trip(name: str, tensor: torch.Tensor, **options: object) -> torch.Tensor:
    """What one rank alone gets back: the compressor's own decoding of what it sent."""
    return reduce_locally([build_compressor(name, **options)], [tensor.clone()], shapes=SHAPES)[0]


# ------------------------------------------------------------------------------------- round-trip bounds


def test_none_is_exact_and_casts_are_within_half_an_ulp() -> None:
    x = gradients(0, 1)[0]
    assert torch.equal(round_trip("none", x), x)
    for name, unit in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        error = (round_trip(name, x) - x).abs()
        assert torch.all(error <= unit * x.abs() + 1e-30), name


def test_qsgd_error_is_below_one_level_per_element() -> None:
    x = gradients(1, 1)[0]
    for norm in ("l2", "max"):
        compressor = QSGD(levels=15, chunk_size=64, norm=norm)
        out = reduce_locally([compressor], [x.clone()])[0]
        rows = torch.nn.functional.pad(x, (0, (-N) % 64)).view(-1, 64)
        norms = rows.norm(dim=1) if norm == "l2" else rows.abs().amax(dim=1)
        level = (norms / 15).repeat_interleave(64)[:N]
        assert torch.all((out - x).abs() <= level * (1 + 1e-6))
        assert torch.all(out * x >= 0)  # never flips a sign


def test_topk_without_feedback_keeps_exactly_the_largest_entries() -> None:
    x = gradients(2, 1)[0]
    out = round_trip("topk", x, ratio=0.05, error_feedback=False)
    k = round(0.05 * N)
    expected = torch.zeros_like(x)
    top = torch.topk(x.abs(), k).indices
    expected[top] = x[top]
    assert torch.equal(out, expected)


def test_sampled_threshold_picks_the_same_set_as_torch_topk() -> None:
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    for k in (30, 3_000, 30_000):
        fast = set(top_k_indices(x, k, torch.Generator().manual_seed(0)).tolist())
        assert fast == set(torch.topk(x.abs(), k).indices.tolist())


def test_sign_sends_scaled_signs_per_tensor_and_never_grows_the_error() -> None:
    x = gradients(4, 1)[0]
    out = round_trip("sign", x, error_feedback=False)
    position = 0
    for shape in SHAPES:
        part = x[position : position + shape.numel()]
        expected = part.abs().mean() * torch.where(part >= 0, 1.0, -1.0)
        assert torch.allclose(out[position : position + shape.numel()], expected, rtol=1e-6, atol=0)
        position += shape.numel()
    assert (out - x).norm() <= x.norm()
    bits = torch.randn(1001)
    assert torch.equal(unpack_signs(pack_signs(bits), 1001), torch.where(bits >= 0, 1.0, -1.0))


def test_powersgd_reproduces_a_rank_one_matrix_and_never_exceeds_the_gradient() -> None:
    compressor = PowerSGD(rank=1, start_iter=2)
    u, v = torch.randn(48, 1, dtype=torch.float64), torch.randn(1, 40, dtype=torch.float64)
    matrix = (u @ v).reshape(-1)
    for _ in range(2):  # the uncompressed first steps
        assert torch.equal(reduce_locally([compressor], [matrix.clone()], shapes=[torch.Size([48, 40])])[0], matrix)
    out = reduce_locally([compressor], [matrix.clone()], shapes=[torch.Size([48, 40])])[0]
    assert torch.allclose(out, matrix, rtol=0, atol=1e-12)
    noisy = torch.randn(48 * 40, dtype=torch.float64)
    low_rank = PowerSGD(rank=4, start_iter=2, error_feedback=False)
    for _ in range(3):  # the third is compressed
        approximation = reduce_locally([low_rank], [noisy.clone()], shapes=[torch.Size([48, 40])])[0]
    assert 0 < approximation.norm() <= noisy.norm() * (1 + 1e-12)
    assert (approximation - noisy).norm() > 0.1 * noisy.norm()  # rank 4 of 40 loses most of a random matrix


def test_bounded_loss_drops_at_most_epsilon_of_the_chunks_and_keeps_the_rest_exact() -> None:
    compressor = build_compressor("bounded_loss", epsilon=0.2, chunk_size=16)
    chunks = math.ceil(N / 16)
    for seed in range(3):
        x = gradients(10 + seed, 1)[0]
        out = reduce_locally([compressor], [x.clone()], shapes=SHAPES)[0]
        rows_out = torch.nn.functional.pad(out, (0, chunks * 16 - N)).view(chunks, 16)
        rows_in = torch.nn.functional.pad(x, (0, chunks * 16 - N)).view(chunks, 16)
        dropped = [c for c in range(chunks) if not torch.equal(rows_out[c], rows_in[c])]
        assert all(torch.all(rows_out[c] == 0) for c in dropped)
        assert len(dropped) <= math.floor(0.2 * chunks)
        assert len(dropped) == (0 if seed == 0 else math.floor(0.2 * chunks))  # first step: no history


# ------------------------------------------------------------------------------------ statistical claims


def test_qsgd_is_unbiased_within_three_sigma() -> None:
    """Monte-Carlo mean of Q(x) against x, element by element, with sigma from the exact two-point law."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    levels, trials = 7, 4000
    compressor = QSGD(levels=levels, chunk_size=256, seed=11)
    generator = torch.Generator().manual_seed(11)
    total = torch.zeros_like(x)
    for _ in range(trials):
        total += compressor.dequantize(*compressor.quantize(x, generator), x.numel())
    mean = total / trials
    step = x.norm() / levels
    fraction = x.abs() / step - (x.abs() / step).floor()
    sigma = step * torch.sqrt(fraction * (1 - fraction) / trials)
    assert torch.all((mean - x).abs() <= 3 * sigma + 1e-12)
    assert (mean - x).abs().max() > 0  # it is random: the test could fail


# ------------------------------------------------------------------------------------ error feedback


@pytest.mark.parametrize("name,options", [
    ("topk", {"ratio": 0.02}), ("topk", {"ratio": 0.02, "warmup_steps": 5}), ("sign", {}),
    ("qsgd", {"levels": 3, "error_feedback": True}), ("powersgd", {"rank": 1, "start_iter": 2}),
    ("bounded_loss", {"epsilon": 0.3, "chunk_size": 8, "error_feedback": True}),
])
def test_error_feedback_conserves_the_sum_of_gradients(name: str, options: dict[str, object]) -> None:
    """sum of what was sent + the residual = sum of the gradients, to 1e-12 in float64 (one rank)."""
    compressor = build_compressor(name, **options)
    sent_total = torch.zeros(N, dtype=torch.float64)
    gradient_total = torch.zeros(N, dtype=torch.float64)
    for step in range(12):
        g = gradients(100 + step, 1, torch.float64)[0]
        sent_total += reduce_locally([compressor], [g.clone()], shapes=SHAPES)[0]
        gradient_total += g
    residual = compressor.state.residuals[0]
    assert residual.abs().max() > 1e-3  # something was held back
    assert torch.allclose(sent_total + residual, gradient_total, rtol=0, atol=1e-12)


def test_resumed_compressor_continues_its_warm_up_and_ignores_another_compressors_state() -> None:
    """The checkpointed state is {"name", "steps"} (the layout main has always written): a top-k restored from
    it sends what the uninterrupted one sends at that step; a state written by another compressor is ignored."""
    running = TopK(ratio=0.01, warmup_steps=6, error_feedback=False)
    for step in range(4):
        reduce_locally([running], gradients(400 + step, 1), shapes=SHAPES)
    assert running.state_dict() == {"name": "topk", "steps": 4}
    resumed = TopK(ratio=0.01, warmup_steps=6, error_feedback=False)
    resumed.load_state_dict({"name": "topk", "steps": 4})
    g = gradients(404, 1)[0]
    meters = [WireStats(), WireStats()]
    expected = reduce_locally([running], [g.clone()], shapes=SHAPES, meters=meters[:1])[0]
    assert torch.equal(reduce_locally([resumed], [g.clone()], shapes=SHAPES, meters=meters[1:])[0], expected)
    assert meters[0].payload_bytes == meters[1].payload_bytes == 8 * running.k_for(N, 4)
    other = TopK(ratio=0.01, warmup_steps=6)
    other.load_state_dict(PowerSGD().state_dict() | {"steps": 9})
    assert other.state.steps == 0


# ---------------------------------------------------------------------------------------- bytes


def expected_payload_bytes(name: str, k_ratio: float = 0.01) -> int:
    """Independent formulas for one bucket of SHAPES in fp32 (payload per rank per step)."""
    if name in ("none", "bounded_loss"):
        return 4 * N
    if name in ("fp16", "bf16"):
        return 2 * N
    if name == "qsgd":
        chunks = math.ceil(N / 512)
        return chunks * 512 + 4 * chunks
    if name == "topk":
        return 8 * round(k_ratio * N)
    if name == "sign":
        return math.ceil(N / 8) + 4 * len(SHAPES)
    if name == "powersgd":  # rank 4: 48x40 and 10x48 compressed (ratio >= 2), vectors whole
        compressed = [(48, 40), (10, 48)]
        factors = sum(4 * (n + m) for n, m in compressed if (n + m) * 4 * 2 < n * m)
        whole = N - sum(n * m for n, m in compressed if (n + m) * 4 * 2 < n * m)
        return 4 * (factors + whole)
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("world", [2, 4])
def test_bytes_on_the_wire_equal_the_formula(name: str, world: int) -> None:
    options: dict[str, object] = {"start_iter": 2} if name == "powersgd" else {}
    compressors = [build_compressor(name, **options) for _ in range(world)]
    meters = [WireStats() for _ in range(world)]
    for step in range(3):
        reduce_locally(compressors, gradients(step, world), shapes=SHAPES, meters=meters)
        stats = meters[0].take()
        payload = expected_payload_bytes(name) if not (name == "powersgd" and step < 2) else 4 * N
        gathered = name in ("qsgd", "topk", "sign")
        assert stats.payload_bytes == payload
        ring = (world - 1) * payload if gathered else 2 * (world - 1) / world * payload
        assert stats.wire_bytes == pytest.approx(ring)
        assert stats.dense_wire_bytes == pytest.approx(2 * (world - 1) / world * 4 * N)


# ----------------------------------------------------------------------------------- equivalences


def test_bounded_loss_with_epsilon_zero_is_bit_identical_to_none() -> None:
    none = [build_compressor("none") for _ in range(3)]
    bounded = [build_compressor("bounded_loss", epsilon=0.0, chunk_size=7) for _ in range(3)]
    for step in range(4):
        g = gradients(200 + step, 3)
        expected = reduce_locally(none, [t.clone() for t in g], shapes=SHAPES)
        got = reduce_locally(bounded, [t.clone() for t in g], shapes=SHAPES)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_every_compressor_gives_all_ranks_the_same_result_close_to_the_mean() -> None:
    bounds = {"none": 0.0, "fp16": 1e-3, "bf16": 1e-2, "qsgd": 0.1, "bounded_loss": 0.0}
    for name, bound in bounds.items():
        g = gradients(7, 2)
        mean = (g[0] + g[1]) / 2
        out = reduce_locally([build_compressor(name) for _ in range(2)], g, shapes=SHAPES)
        assert torch.equal(out[0], out[1])
        assert (out[0] - mean).norm() <= bound * mean.norm() + 1e-7, name


def test_topk_warm_up_follows_dgc_geometric_schedule() -> None:
    compressor = TopK(ratio=0.001, warmup_steps=4, warmup_start_ratio=0.25)
    densities = [compressor.density(step) for step in range(6)]
    assert densities[0] == pytest.approx(0.25)
    assert densities[2] == pytest.approx(math.sqrt(0.25 * 0.001))
    assert densities[4:] == [0.001, 0.001]
    assert all(a > b for a, b in zip(densities[:4], densities[1:5], strict=False))


def test_bucket_info_single_lays_out_shapes() -> None:
    info = BucketInfo.single(torch.zeros(N), shapes=SHAPES)
    assert [offset for offset, _ in info.spans] == [0, 1920, 1968, 2448]
    assert info.positions[0] == 0.0 and info.positions[-1] == 1.0


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_op_sum_is_world_times_average(name: str) -> None:
    options: dict[str, object] = {"start_iter": 2} if name == "powersgd" else {}
    results = []
    for average in (True, False):
        compressors = [build_compressor(name, **options) for _ in range(2)]
        for step in range(3):  # PowerSGD compresses from the third step on
            out = reduce_locally(compressors, gradients(300 + step, 2), shapes=SHAPES, average=average)
        results.append(out[0])
    if name == "powersgd":  # error feedback makes the third steps differ; compare their directions instead
        assert torch.nn.functional.cosine_similarity(results[0], results[1], dim=0) > 0.9
    else:
        assert torch.equal(results[0] * 2, results[1])


def test_a_failed_collective_fails_the_round_instead_of_passing_unreduced_payloads() -> None:
    from dtrain.sync.hooks import values_or_raise

    ok: torch.futures.Future[int] = torch.futures.Future()
    failed: torch.futures.Future[int] = torch.futures.Future()
    chained = torch.futures.collect_all([ok, failed]).then(values_or_raise)
    ok.set_result(1)
    failed.set_exception(RuntimeError("Application timeout caused pair closure"))
    with pytest.raises(RuntimeError, match="pair closure"):
        chained.wait()
    fine: torch.futures.Future[int] = torch.futures.Future()
    passed = torch.futures.collect_all([fine]).then(values_or_raise)
    fine.set_result(2)
    assert passed.wait() == [2]
