"""Inner products of long rows summed in float64, whatever the rows' precision.

An empirical NTK block is J1 J2^T over every parameter: for GPT-2-small a sum of 124 M
products per entry. A float32 matrix product accumulates that sum in float32, and its
rounding error grows with the length: the eNTK of a GPT-2-small document log-likelihood came
out 1.6e-2 (relative, Frobenius) off float64 although each Jacobian was 5e-7 off; on a 2-layer,
width-256 GPT-2 the float32 product was 3.6e-4 off and the same float32 Jacobians contracted in
float64 4.9e-8. The precision policy keeps kernel sums in float64
(:mod:`attnaudit.core.precision`): :func:`contract` forms the products of chunks of
:data:`CONTRACTION_CHUNK` columns at the rows' precision (its speed) and adds the chunks in
float64, so the float32 error is that of one chunk's sum: with chunks of 4,096 columns the
width-256 model's kernel is 1.0e-7 off float64 (16,384: 6.7e-7; 65,536: 4.8e-6), and a
640 x 2^21 Gram took 27.9 s against 29.8 s as one float32 product (one thread; float64: 62.0 s).
"""

from __future__ import annotations

import math

import torch

#: columns per lower-precision partial product of :func:`contract` (module docstring: the
#: error of one chunk's float32 sum against the cost of more, smaller matrix products)
CONTRACTION_CHUNK = 1 << 12


#: float32 numbers the partial products of one batched call of :func:`contract` may hold (64 MiB)
PARTIAL_NUMBERS = 1 << 24
#: r x m below which :func:`contract` batches its chunk products: a small product is mostly call
#: overhead; a large one runs 5-10 % faster called alone than strided in a batch (measured)
BATCH_BELOW = 1 << 14


def contract(A: torch.Tensor, B: torch.Tensor, chunk: int = CONTRACTION_CHUNK) -> torch.Tensor:
    """A B^T for A (r, p) and B (m, p) as an (r, m) float64 tensor: one float64 product for
    float64 rows; otherwise the products of column chunks of ``chunk`` at the rows' precision,
    each converted to float64 and summed (same arithmetic count, float64 accumulation across
    chunks). Few rows (r m below :data:`BATCH_BELOW`) have their chunks' products batched, as
    many per call as :data:`PARTIAL_NUMBERS` allows (rows with unit column stride are viewed,
    never copied): a product per chunk called one by one cost 5x the plain product for 2 rows
    over 7.9 M columns, all of it call overhead (a BERT-mini's word-table kernel panels)."""
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[1]:
        raise ValueError(f"contract needs (r, p) and (m, p) rows, got {tuple(A.shape)} and {tuple(B.shape)}")
    if A.dtype == torch.float64 and B.dtype == torch.float64:
        return A @ B.T
    (r, p), m = A.shape, B.shape[0]
    out = torch.zeros(r, m, dtype=torch.float64, device=A.device)
    batched = r * m < BATCH_BELOW and A.stride(1) == 1 and B.stride(1) == 1
    n_chunks = p // chunk if batched else 0
    done = n_chunks * chunk
    if n_chunks:
        A3 = A[:, :done].reshape(r, n_chunks, chunk)  # views: unit column stride
        B3 = B[:, :done].reshape(m, n_chunks, chunk)
        per_call = max(1, PARTIAL_NUMBERS // max(1, r * m))
        for a in range(0, n_chunks, per_call):
            b = min(n_chunks, a + per_call)
            partial = torch.matmul(A3[:, a:b].transpose(0, 1), B3[:, a:b].permute(1, 2, 0))  # (chunks, r, m)
            out += partial.sum(0, dtype=torch.float64)
    for start in range(done, p, chunk):  # the tail, or every chunk when not batched
        stop = min(p, start + chunk)
        out += (A[:, start:stop] @ B[:, start:stop].T).to(torch.float64)
    return out


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """a . b of two vectors of equal length, summed in float64 (:func:`contract`): a float32 dot
    product over 67 M entries was 1.9e-3 off float64 on this project's machine, this one 5e-8."""
    return float(contract(a.reshape(1, -1), b.reshape(1, -1))[0, 0])


def norm(a: torch.Tensor) -> float:
    """||a||_2 of a vector, its square summed in float64 (a float32 norm over 67 M entries: 4.0e-3 off)."""
    return math.sqrt(max(0.0, dot(a, a)))


def column_norms(U: torch.Tensor) -> torch.Tensor:
    """The 2-norms of the columns of U (size, k), summed in float64, in U's dtype."""
    return contract(U.T, U.T).diagonal().clamp(min=0).sqrt().to(U.dtype)


def coefficients(Q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Q v for rows Q (j, size) and a vector v, summed in float64, in Q's dtype (a basis' projection
    coefficients)."""
    return contract(Q, v.reshape(1, -1))[:, 0].to(Q.dtype)
