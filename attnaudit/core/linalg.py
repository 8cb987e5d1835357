"""Shared linear algebra on symmetric operators given only as matrix-vector products.

* :func:`lanczos_top_eigen`: the k largest eigenvalues (and Ritz vectors) by Lanczos with
  full re-orthogonalisation, with Ritz residual bounds and true residuals;
* :func:`hutchinson_trace`: the trace by Hutchinson's estimator (Rademacher probes),
  optionally deflated by known orthonormal vectors, with its standard error.

Used with :meth:`attnaudit.core.engine.Engine.hvp_operator` (Hessian spectra and traces of
any module) and with plain callables in the tests. Conjugate gradients live in
:mod:`attnaudit.core.cg`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnaudit.core.contraction import coefficients, column_norms, dot, norm
from attnaudit.errors import AuditError

Progress = Callable[[int], None] | None

__all__ = ["EigenResult", "TraceResult", "hutchinson_trace", "lanczos_top_eigen"]


@dataclass(frozen=True)
class EigenResult:
    """Top Hessian eigenvalues (descending) with Lanczos diagnostics.

    ``ritz_bounds``: |beta_m s_mi|, Lanczos' own residual bound; ``residuals``: the true
    ||H u - lambda u||, with H u from the kept products H q_j (or one more product per
    vector when they did not fit; see :func:`lanczos_top_eigen`). Both are relative to
    max |Ritz value| (the spectral scale), so 1e-6 means converged to six digits of it.
    """

    eigenvalues: tuple[float, ...]
    residuals: tuple[float, ...]
    ritz_bounds: tuple[float, ...]
    steps: int
    hvp_calls: int
    converged: bool
    tol: float
    seed: int
    eigenvectors: torch.Tensor | None = field(default=None, repr=False, compare=False)  # (size, k)
    h_eigenvectors: torch.Tensor | None = field(default=None, repr=False, compare=False)  # H @ eigenvectors
    basis: int = 0  # vectors the basis held (0: not recorded)
    restarts: int = 0  # thick restarts a basis smaller than the products needed

    def to_dict(self) -> dict:
        return {
            "eigenvalues": list(self.eigenvalues),
            "residuals": list(self.residuals),
            "ritz_bounds": list(self.ritz_bounds),
            "steps": self.steps,
            "hvp_calls": self.hvp_calls,
            "basis": self.basis,
            "restarts": self.restarts,
            "converged": self.converged,
            "tol": self.tol,
            "seed": self.seed,
        }


def _apply_block(matvec: Callable[[torch.Tensor], torch.Tensor], U: torch.Tensor) -> torch.Tensor:
    """The operator applied to each column of U (size, k) -> (size, k): in one batched call
    when the operator offers ``matmat`` (rows in, rows out), else column by column."""
    matmat = getattr(matvec, "matmat", None)
    if matmat is not None:
        return matmat(U.T.contiguous()).T
    return torch.stack([matvec(U[:, i]) for i in range(U.shape[1])], 1)


def _rotate_rows(Q: torch.Tensor, S: torch.Tensor, block: int = 1 << 16) -> None:
    """Q[:l] <- S^T Q[:m] in place for S (m, l), l <= m, a column block at a time: the rotated rows
    need no second (l, size) array beside the basis."""
    m, l = S.shape
    St = S.T.to(device=Q.device, dtype=Q.dtype)
    for a in range(0, Q.shape[1], block):
        Q[:l, a : a + block] = St @ Q[:m, a : a + block]


def lanczos_top_eigen(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    size: int,
    k: int,
    *,
    max_steps: int = 100,
    tol: float = 1e-4,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float64,
    progress: Progress = None,
    keep_products_bytes: int = 256 * 2**20,
    basis: int | None = None,
) -> EigenResult:
    """The k largest (algebraic) eigenvalues of the symmetric operator ``matvec``.

    Lanczos with full re-orthogonalisation: the basis Q (m x size) is kept, m = ``basis``
    (default ``max_steps``, at least k + 2 when it is smaller than both). When m products do
    not converge and ``max_steps`` allows more, the run is restarted thick (Wu & Simon 2000):
    the l = max(k, min(m - 2, (m + k) // 2)) best Ritz vectors y_i = Q^T s_i and the last
    residual direction q' become the new basis, with projected matrix [[diag(theta), sigma],
    [sigma^T, .]], sigma_i = beta_m s_mi, and Lanczos goes on from q' (H Q^T = Q^T T +
    beta q'' e^T holds throughout, so the Ritz pairs and their bounds keep their meaning): a
    memory-capped basis costs products, not accuracy.
    The returned pairs' true residuals ||H u - theta u|| come from the products H q_j
    themselves, kept (another m x size, rotated with the basis) when that fits
    ``keep_products_bytes``: H u = (H Q) s by linearity, no further product; otherwise one
    more product per pair. Stops when every wanted Ritz pair has |beta s_mi| <= tol *
    max|theta|, or after ``max_steps`` products in all. If the Krylov space becomes invariant
    before k values are found, it is restarted with a fresh random vector orthogonal to the
    basis (a zero off-diagonal). Like any single-vector Krylov method it finds one copy of a
    repeated eigenvalue per invariant subspace reached.
    """
    if k < 1:
        raise AuditError(f"top-k must be >= 1, got {k}")
    if size < 1:
        raise AuditError("the operator has no dimensions")
    if basis is not None and basis < 1:
        raise AuditError(f"the Lanczos basis must hold at least one vector, got {basis}")
    k = min(k, size)
    budget = max(min(size, max_steps), k)  # products in all (a full basis is invariant after size)
    m_max = budget
    if basis is not None and basis < budget:
        m_max = min(size, max(basis, k + 2))
        budget = max(max_steps, m_max)  # restarts can use more products than the dimension
    gen = torch.Generator().manual_seed(int(seed))

    def fresh(Qj: torch.Tensor) -> torch.Tensor:
        q = torch.randn(size, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        for _ in range(2):
            if Qj.shape[0]:
                q = q - Qj.T @ coefficients(Qj, q)
        return q / norm(q)

    Q = torch.zeros(m_max, size, device=device, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    W = torch.zeros(m_max, size, device=device, dtype=dtype) if m_max * size * itemsize <= keep_products_bytes else None
    # the projected matrix T = Q H Q^T (float64): tridiagonal, with a first row and column of
    # couplings sigma to the kept Ritz vectors after a thick restart
    T = torch.zeros(m_max, m_max, dtype=torch.float64)
    q = fresh(Q[:0])
    converged = False
    evals = evecs = None
    steps = restarts = 0
    bounds = torch.zeros(0)
    j = 0  # the basis row q goes into
    while True:
        Q[j] = q
        w = matvec(q)
        if W is not None:
            W[j] = w
        steps += 1
        if progress is not None:
            progress(1)
        # inner products over every parameter are summed in float64 whatever the vectors' dtype
        # (attnaudit.core.contraction: a float32 dot product over 67 M entries was 1.9e-3 off)
        T[j, j] = dot(q, w)
        # full re-orthogonalisation (twice is enough) replaces the three-term recurrence's
        # explicit subtraction (and a restart's couplings) and keeps the basis orthogonal
        Qj = Q[: j + 1]
        for _ in range(2):
            w = w - Qj.T @ coefficients(Qj, w)
        b = norm(w)
        evals, evecs = torch.linalg.eigh(T[: j + 1, : j + 1])
        kk = min(k, j + 1)
        scale = max(float(evals.abs().max()), torch.finfo(dtype).tiny)
        bounds = b * evecs[-1, -kk:].abs()
        invariant = b <= 1e3 * torch.finfo(dtype).eps * scale
        if j + 1 >= k and (bool((bounds <= tol * scale).all()) or invariant):
            converged = True
            break
        if steps >= budget:
            break
        if j + 1 == m_max:  # the basis is full: restart thick from the best Ritz vectors
            keep = max(kk, min(m_max - 2, (m_max + kk) // 2))
            if keep >= m_max:  # a basis of k vectors over a space of k dimensions: nothing to restart with
                break
            S = evecs[:, -keep:]  # ascending: the largest last
            _rotate_rows(Q, S)
            if W is not None:
                _rotate_rows(W, S)
            T.zero_()
            T[:keep, :keep] = torch.diag(evals[-keep:])
            if invariant:  # nothing couples the Ritz vectors to the rest: go on from a fresh direction
                q = fresh(Q[:keep])
            else:
                T[keep, :keep] = T[:keep, keep] = b * evecs[-1, -keep:]
                q = w / b
            j = keep
            restarts += 1
            continue
        if invariant:
            q = fresh(Qj)  # T[j, j + 1] stays 0
            bounds = torch.zeros_like(bounds)
        else:
            T[j, j + 1] = T[j + 1, j] = b
            q = w / b
        j += 1
    if progress is not None and steps < budget:
        progress(budget - steps)
    assert evals is not None and evecs is not None  # the loop runs at least once: m_max >= k >= 1
    m = j + 1
    kk = min(k, m)
    order = torch.arange(m - 1, m - 1 - kk, -1)
    vals = evals[order]
    S = evecs[:, order].to(device=device, dtype=dtype)
    U = Q[:m].T @ S  # (size, kk) Ritz vectors
    norms = column_norms(U)[None, :]
    U = U / norms
    HU = _apply_block(matvec, U) if W is None else (W[:m].T @ S) / norms
    scale = max(float(evals.abs().max()), torch.finfo(dtype).tiny)
    res = column_norms(HU - U * vals.to(device=device, dtype=dtype)) / scale
    # fix each eigenvector's arbitrary sign: largest-magnitude entry positive
    sign = torch.sign(U.gather(0, U.abs().argmax(0, keepdim=True))).squeeze(0)
    sign[sign == 0] = 1
    U, HU = U * sign, HU * sign
    return EigenResult(
        eigenvalues=tuple(vals.tolist()),
        residuals=tuple(res.cpu().tolist()),
        ritz_bounds=tuple((bounds.flip(0)[:kk] / scale).tolist()),
        steps=steps,
        hvp_calls=steps + (kk if W is None else 0),
        converged=converged,
        tol=tol,
        seed=int(seed),
        eigenvectors=U,
        h_eigenvectors=HU,
        basis=m_max,
        restarts=restarts,
    )


@dataclass(frozen=True)
class TraceResult:
    """Hutchinson estimate of tr(H) = E[v^T H v] over Rademacher v, with its standard error.

    With ``deflated`` = k > 0: tr(H) = sum_i u_i^T H u_i + E[(Pv)^T H (Pv)], P = I - U U^T,
    exact for the first term; the standard error is that of the second term only.
    """

    estimate: float
    stderr: float
    samples: int
    seed: int
    deflated: int
    exact_part: float

    def to_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "stderr": self.stderr,
            "samples": self.samples,
            "seed": self.seed,
            "deflated": self.deflated,
            "exact_part": self.exact_part,
            "distribution": "rademacher",
        }


def hutchinson_trace(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    size: int,
    samples: int = 30,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float64,
    deflate: torch.Tensor | None = None,
    deflate_products: torch.Tensor | None = None,
    progress: Progress = None,
) -> TraceResult:
    """Hutchinson's trace estimator; the span of ``deflate`` (size, k) is handled exactly.

    ``deflate_products`` = H @ deflate when already known (saves k products; ``deflate``
    must then be orthonormal, as Lanczos' Ritz vectors are).
    Standard error = sample std / sqrt(samples).
    """
    if samples < 2:
        raise AuditError(f"Hutchinson's estimator needs at least 2 samples for a standard error, got {samples}")
    gen = torch.Generator().manual_seed(int(seed))
    exact = 0.0
    U = None
    if deflate is not None and deflate.numel():
        U = deflate.to(device=device, dtype=dtype)
        if deflate_products is not None:
            # Lanczos' Ritz vectors are orthonormal to round-off; reuse their known products
            HU = deflate_products.to(device=device, dtype=dtype)
        else:
            U, _ = torch.linalg.qr(U)  # the estimator is unbiased for any orthonormal U
            HU = _apply_block(matvec, U)
        exact = float((U * HU).sum())
    vals: list[float] = []
    # probes go through the operator in blocks when it offers matmat (one batched pass per
    # block); the draws are the same sequence either way. Blocks hold at most ~2^24 numbers.
    block = min(8, max(1, 2**24 // max(size, 1))) if hasattr(matvec, "matmat") else 1
    while len(vals) < samples:
        k = min(block, samples - len(vals))
        V = torch.stack([(torch.randint(0, 2, (size,), generator=gen, dtype=torch.int64) * 2 - 1) for _ in range(k)], 1)
        V = V.to(device=device, dtype=dtype)
        if U is not None:
            V = V - U @ (U.T @ V)
        vals.extend((V * _apply_block(matvec, V)).sum(0).tolist())
        if progress is not None:
            progress(k)
    t = torch.tensor(vals, dtype=torch.float64)
    return TraceResult(
        estimate=exact + float(t.mean()),
        stderr=float(t.std(unbiased=True)) / math.sqrt(samples),
        samples=samples,
        seed=int(seed),
        deflated=0 if U is None else U.shape[1],
        exact_part=exact,
    )


def centered_kernel_alignment(K: torch.Tensor, Y: torch.Tensor) -> float:
    """CKA <HKH, HLH>_F / (||HKH||_F ||HLH||_F) of an (n, n) kernel K with L = Y Y^T (Y (n, c))."""
    K = K.to(torch.float64)
    Y = Y.to(device=K.device, dtype=torch.float64)
    if K.ndim != 2 or K.shape[0] != K.shape[1] or Y.shape[0] != K.shape[0]:
        raise AuditError(f"CKA needs an (n, n) kernel and (n, c) targets, got {tuple(K.shape)} and {tuple(Y.shape)}")
    Kc = K - K.mean(0, keepdim=True) - K.mean(1, keepdim=True) + K.mean()
    Yc = Y - Y.mean(0, keepdim=True)  # H Y: then H L H = (HY)(HY)^T
    num = (Yc.T @ Kc @ Yc).trace()
    den = Kc.norm() * (Yc.T @ Yc).norm()
    return float(num / den) if float(den) > 0 else float("nan")
