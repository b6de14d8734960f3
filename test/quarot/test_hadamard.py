"""Hadamard constructions: every matrix is checked against its definition (entries +-1, H H^T = n I, exact in
float64 integers), the orthogonal forms against Q^T Q = I (tolerance 1e-12), the fast transform against the dense
matrix (1e-12)."""

from __future__ import annotations

import math

import pytest
import torch

from msmodelslim.ops.hadamard import (
    KNOWN_BASE_ORDERS,
    factor_order,
    hadamard_matrix,
    hadamard_transform,
    orthogonal_hadamard,
    paley1,
    paley2,
    random_hadamard,
    williamson,
)


def assert_hadamard(h: torch.Tensor) -> None:
    n = h.shape[0]
    assert h.shape == (n, n)
    assert bool(h.abs().eq(1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))


def assert_orthogonal(q: torch.Tensor, tol: float = 1e-12) -> None:
    eye = torch.eye(q.shape[0], dtype=q.dtype)
    assert float((q.T @ q - eye).abs().max()) < tol
    assert float((q @ q.T - eye).abs().max()) < tol


CONSTRUCTIBLE = [k for k in KNOWN_BASE_ORDERS if factor_order(k) is not None]


@pytest.mark.parametrize("k", CONSTRUCTIBLE)
def test_every_known_base_order_is_a_hadamard_matrix(k):
    assert_hadamard(hadamard_matrix(k))


@pytest.mark.parametrize("q", [3, 7, 11, 19, 23, 27, 31, 43, 59, 107, 139])
def test_paley1_from_quadratic_residues_is_hadamard(q):
    assert_hadamard(paley1(q))  # q = 27 exercises GF(3^3)


@pytest.mark.parametrize("q", [5, 9, 13, 17, 25, 29, 37, 49])
def test_paley2_from_quadratic_residues_is_hadamard(q):
    assert_hadamard(paley2(q))  # q = 9, 25, 49 exercise GF(p^2)


def test_williamson_array_of_order_12_is_hadamard():
    # A = J_3, B = C = D = 2I - J_3: A^2 + 3 B^2 = 3J + 3(4I - J) = 12 I
    assert_hadamard(williamson([1, 1, 1], [1, -1, -1], [1, -1, -1], [1, -1, -1]))


@pytest.mark.parametrize("n", [64, 96, 192, 320, 448, 512, 1536, 2304, 3072])
def test_kimi_sizes_factor_and_are_hadamard(n):
    k, m = factor_order(n)
    assert k * 2**m == n
    assert_hadamard(hadamard_matrix(n))


def test_kimi_k3_hidden_size_7168_is_28_times_256():
    assert factor_order(7168) == (28, 8)  # checking H H^T at 7168 is slow; 28 and the Kronecker steps are checked


@pytest.mark.parametrize("n", [23 * 8, 7 * 16, 3 * 64, 100 * 3, 13 * 4 * 3])
def test_orthogonal_form_falls_back_to_block_diagonal(n):
    q = orthogonal_hadamard(n)
    assert_orthogonal(q)
    if factor_order(n) is None:
        assert q[0, -1] == 0  # block-diagonal


def test_explicit_block_size_is_used_and_validated():
    q = orthogonal_hadamard(23 * 8, block_size=8)  # 184 has no Hadamard matrix here
    assert_orthogonal(q)
    assert torch.equal(q[:8, :8], hadamard_matrix(8) / math.sqrt(8))
    with pytest.raises(ValueError, match="block_size 12"):
        orthogonal_hadamard(23 * 8, block_size=12)


def test_random_hadamard_is_orthogonal_seeded_and_signed():
    q = random_hadamard(192, seed=3)
    assert_orthogonal(q)
    assert torch.equal(q, random_hadamard(192, seed=3))
    assert not torch.equal(q, random_hadamard(192, seed=4))
    assert torch.allclose(q.abs(), torch.full_like(q, 1 / math.sqrt(192)))


@pytest.mark.parametrize("n", [1, 2, 16, 12, 48, 160, 1536])
def test_fast_transform_equals_dense_matrix(n):
    x = torch.randn(3, 5, n, dtype=torch.float64)
    ref = x @ hadamard_matrix(n).T / math.sqrt(n)
    assert float((hadamard_transform(x) - ref).abs().max()) < 1e-12


def test_order_172_comes_from_a_multiplier_invariant_williamson_search():
    from msmodelslim.ops.hadamard import williamson_search

    rows = williamson_search(43, 6)
    assert rows is not None and all(r == r[:1] + r[1:][::-1] for r in rows)  # symmetric first rows
    assert_hadamard(williamson(*rows))


def test_order_156_is_not_constructed_and_falls_back_to_blocks():
    assert factor_order(156) is None  # no multiplier-invariant Williamson solution; documented gap
    assert_orthogonal(orthogonal_hadamard(156))
