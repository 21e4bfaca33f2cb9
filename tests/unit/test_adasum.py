"""The Adasum pairwise rule against its defining properties and a direct float64 formula."""

from __future__ import annotations

import pytest
import torch

from dtrain.comm.adasum import adasum_pair, tree_partners


def reference_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The paper's rule for one tensor, written out in float64 with Python floats."""
    a64, b64 = a.double(), b.double()
    dot, a_sq, b_sq = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    return (1 - dot / (2 * a_sq)) * a64 + (1 - dot / (2 * b_sq)) * b64


def test_orthogonal_gradients_add_up() -> None:
    a = torch.tensor([3.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    b = torch.tensor([0.0, 2.0, 5.0, 0.0], dtype=torch.float64)
    assert torch.equal(adasum_pair(a, b), a + b)


def test_parallel_gradients_are_averaged() -> None:
    x = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(adasum_pair(x, 2 * x), 1.5 * x, rtol=1e-14, atol=0)
    torch.testing.assert_close(adasum_pair(x, x), x, rtol=1e-14, atol=0)


def test_opposite_gradients_cancel() -> None:
    x = torch.randn(257, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert float(adasum_pair(x, -x).abs().max()) < 1e-14


def test_rule_is_symmetric_and_matches_the_formula() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(300, dtype=torch.float64, generator=gen), torch.randn(300, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(adasum_pair(a, b), reference_pair(a, b), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(adasum_pair(a, b), adasum_pair(b, a), rtol=1e-13, atol=1e-13)


def test_applied_per_tensor_not_to_the_flattened_vector() -> None:
    """First tensor: parallel (x, 2x -> 1.5x); second: orthogonal (sum). On the whole vector the rule
    would mix the two and give neither."""
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    u, v = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 4.0], dtype=torch.float64)
    a, b = torch.cat([x, u]), torch.cat([2 * x, v])
    combined = adasum_pair(a, b, [3, 2])
    torch.testing.assert_close(combined[:3], 1.5 * x, rtol=1e-14, atol=0)
    assert torch.equal(combined[3:], u + v)
    assert not torch.allclose(adasum_pair(a, b), combined)
    torch.testing.assert_close(combined, torch.cat([reference_pair(x, 2 * x), reference_pair(u, v)]))


def test_coefficients_are_float64_for_float32_gradients() -> None:
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    result = adasum_pair(a, b)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, reference_pair(a, b).float(), rtol=0, atol=1e-6)


def test_zero_gradient_leaves_the_other() -> None:
    x = torch.randn(10, dtype=torch.float64)
    zero = torch.zeros(10, dtype=torch.float64)
    assert torch.equal(adasum_pair(x, zero), x)
    assert torch.equal(adasum_pair(zero, x), x)
    assert torch.equal(adasum_pair(zero, zero), zero)


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="add up to 4"):
        adasum_pair(torch.zeros(5), torch.zeros(5), [2, 2])


@pytest.mark.parametrize(("world", "leaves", "distances"), [(1, 1, []), (2, 2, [1]), (3, 2, [1]), (4, 4, [1, 2]),
                                                            (6, 4, [1, 2]), (8, 8, [1, 2, 4])])
def test_tree_shape(world: int, leaves: int, distances: list[int]) -> None:
    assert tree_partners(world) == (leaves, distances)
