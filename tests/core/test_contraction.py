"""contract (attnaudit.core.contraction): long inner products of low-precision rows summed in
float64, against the float64 product of the same numbers."""

from __future__ import annotations

import pytest
import torch

from attnaudit.core.contraction import contract


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


def test_rows_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match=r"\(r, p\) and \(m, p\)"):
        contract(torch.ones(2, 3), torch.ones(2, 4))
