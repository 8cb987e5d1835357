"""Conjugate gradients on a block of right-hand sides: shared linear algebra.

Used by influence (``(H + damping I) s = g_test`` with Hessian-vector products from the
engine) and by any analysis that solves a symmetric positive-definite system given only
as a matrix-vector product.
"""

from __future__ import annotations

from typing import Callable

import torch


def batched_cg(
    matvec: Callable[[torch.Tensor], torch.Tensor], B: torch.Tensor, tol: float, max_iter: int
) -> tuple[torch.Tensor, dict]:
    """Solve A X_j = B_j for each row j of B (k, P) by conjugate gradients, A given by ``matvec``.

    Rows stop once ||r_j|| <= tol ||b_j||. A direction with p^T A p <= 0 means A is not
    positive definite there: that row stops and is reported as not converged. Returns X and
    diagnostics (iterations, the true relative residual ||B - A X|| / ||B|| per row, max of
    it, converged, negative_curvature).
    """
    X = torch.zeros_like(B)
    R = B.clone()
    Pd = R.clone()
    rs = (R * R).sum(1)
    bnorm = B.norm(dim=1)
    safe_b = torch.where(bnorm > 0, bnorm, torch.ones_like(bnorm))
    active = bnorm > 0
    negative = torch.zeros_like(active)
    iterations = 0
    for it in range(max_iter):
        if not bool(active.any()):
            break
        iterations = it + 1
        Ap = matvec(Pd)
        pAp = (Pd * Ap).sum(1)
        bad = active & (pAp <= 0)
        if bool(bad.any()):
            negative |= bad
            active &= ~bad
        alpha = torch.where(active, rs / torch.where(pAp > 0, pAp, torch.ones_like(pAp)), torch.zeros_like(rs))
        X += alpha[:, None] * Pd
        R -= alpha[:, None] * Ap
        rs_new = (R * R).sum(1)
        done = active & (rs_new.sqrt() <= tol * safe_b)
        beta = torch.where(active & ~done, rs_new / torch.where(rs > 0, rs, torch.ones_like(rs)), torch.zeros_like(rs))
        Pd = torch.where((active & ~done)[:, None], R + beta[:, None] * Pd, Pd)
        rs = torch.where(active, rs_new, rs)
        active &= ~done
    true_res = (B - matvec(X)).norm(dim=1) / safe_b  # recomputed, not the recursive estimate
    converged = (~negative) & (true_res <= max(tol * 10, 1e-12))
    diag = {
        "iterations": iterations,
        "max_iterations": max_iter,
        "tolerance": tol,
        "relative_residual_max": float(true_res.max()) if true_res.numel() else 0.0,
        "relative_residual_mean": float(true_res.mean()) if true_res.numel() else 0.0,
        "converged": bool(converged.all()),
        "n_converged": int(converged.sum()),
        "n_systems": int(B.shape[0]),
        "negative_curvature": bool(negative.any()),
    }
    return X, diag
