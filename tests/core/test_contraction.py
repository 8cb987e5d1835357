"""contract (attnaudit.core.contraction): long inner products of low-precision rows summed in
float64, against the float64 product of the same numbers."""

from __future__ import annotations

import pytest
import torch

from attnaudit.core.contraction import coefficients, column_norms, contract, dot, norm


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("mixed_signs", [False, True])
def test_float32_rows_of_four_million_columns_keep_float64_accuracy(mixed_signs):
    gen = torch.Generator().manual_seed(0)
    p = 1 << 22
    A = torch.randn(6, p, generator=gen) if mixed_signs else torch.rand(6, p, generator=gen)
    B = A + 0.1 * torch.randn(6, p, generator=gen)
    exact = A.double() @ B.double().T  # the same float32 numbers, multiplied and summed in float64
    K = contract(A, B)
    assert K.dtype == torch.float64
    # measured here: 1e-7 (one float32 product over all 4.2 M columns: 1.5e-4 positive, 3.3e-4 mixed)
    assert _relative(K, exact) < 1e-6


def test_float64_rows_are_one_plain_product():
    gen = torch.Generator().manual_seed(1)
    A, B = (
        torch.randn(3, 50, generator=gen, dtype=torch.float64),
        torch.randn(4, 50, generator=gen, dtype=torch.float64),
    )
    assert torch.equal(contract(A, B), A @ B.T)


@pytest.mark.parametrize("p, chunk", [(10, 3), (9, 3), (1, 4), (7, 100)])
def test_every_column_is_counted_once_whatever_the_chunking(p, chunk):
    A = torch.arange(2 * p, dtype=torch.float32).reshape(2, p)
    B = torch.ones(3, p, dtype=torch.float32)
    by_hand = torch.tensor([[sum(range(p))] * 3, [sum(range(p, 2 * p))] * 3], dtype=torch.float64)
    assert torch.equal(contract(A, B, chunk), by_hand)


@pytest.mark.parametrize("rows", [2, 130])  # 2 x 3 products are batched by chunk; 130 x 131 are not
def test_batched_and_chunk_by_chunk_products_count_every_column_once(rows):
    p, chunk = 10, 3
    A = torch.arange(rows * p, dtype=torch.float32).reshape(rows, p)
    B = torch.ones(rows + 1, p, dtype=torch.float32)
    by_hand = torch.tensor([[sum(range(i * p, (i + 1) * p))] * (rows + 1) for i in range(rows)], dtype=torch.float64)
    assert torch.equal(contract(A, B, chunk), by_hand)


def test_strided_and_sliced_rows_give_the_contiguous_rows_result():
    gen = torch.Generator().manual_seed(4)
    wide = torch.rand(3, 50_000, generator=gen)  # positive: no cancellation in the sums
    A = wide[:, 1_000:41_000]  # a column slice: unit column stride, rows 50,000 apart
    B = torch.rand(2, 40_000, generator=gen)
    want = A.contiguous().double() @ B.double().T
    assert torch.allclose(contract(A, B), want, rtol=1e-6, atol=0)
    strided = A.T.contiguous().T  # the same numbers with column stride 3: chunk by chunk
    assert strided.stride(1) != 1
    assert torch.allclose(contract(strided, B), want, rtol=1e-6, atol=0)


def test_rows_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match=r"\(r, p\) and \(m, p\)"):
        contract(torch.ones(2, 3), torch.ones(2, 4))


def test_dot_norm_and_projections_sum_in_float64():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.rand(1 << 22, generator=gen), torch.rand(1 << 22, generator=gen)
    exact = float(a.double() @ b.double())
    assert abs(dot(a, b) - exact) / exact < 1e-6  # float32's a @ b here: 1.2e-5
    assert abs(norm(a) - float(a.double().norm())) / float(a.double().norm()) < 1e-6  # float32's a.norm(): 7.4e-5
    Q = torch.rand(3, 1 << 22, generator=gen)
    assert torch.allclose(coefficients(Q, a).double(), Q.double() @ a.double(), rtol=1e-6, atol=0)
    U = torch.rand(1 << 22, 2, generator=gen)
    assert torch.allclose(column_norms(U).double(), U.double().norm(dim=0), rtol=1e-6, atol=0)


def test_float32_lanczos_on_four_million_dimensions_finds_the_eigenvalues_to_float32_accuracy():
    """A diagonal operator with known top eigenvalues 10, 9, 8 above a bulk in [0, 1): Lanczos in
    float32 must find them to float32's accuracy; with float32 dot products and norms over the
    4.2 M entries the top one came out 4.7e-4 off."""
    from attnaudit.core.linalg import lanczos_top_eigen

    gen = torch.Generator().manual_seed(3)
    d = torch.rand(1 << 22, generator=gen)
    d[:3] = torch.tensor([10.0, 9.0, 8.0])
    res = lanczos_top_eigen(lambda v: d * v, d.numel(), 3, max_steps=40, tol=1e-6, dtype=torch.float32)
    for found, true in zip(res.eigenvalues, (10.0, 9.0, 8.0)):
        assert abs(found - true) / true < 1e-5
