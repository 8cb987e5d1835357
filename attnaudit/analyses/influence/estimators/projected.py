"""``projected``: Galerkin projection of (H + lambda I) s = g onto a random sign subspace
(:class:`attnaudit.analyses.influence.projection.SignProjection`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import attnaudit.analyses.influence.estimators.base as base
from attnaudit.analyses.influence.projection import SignProjection

__all__ = ["Projected"]


@dataclass
class _ProjectedState(base.State):
    HR: torch.Tensor | None = None
    M: torch.Tensor | None = None
    Bp: torch.Tensor | None = None
    lam_max: float = 0.0
    diagnostics: dict | None = None


@base.register
class Projected(base.Estimator):
    """H_R = R^T H R from k Hessian-vector products, M = R^T R, then z = (H_R + lambda M)^-1 R^T g
    solved exactly (k x k) for every test gradient; a training gradient scores -(R^T g_train) . z.
    With k >= P (k is capped at P) and R of full rank this is exact influence; the error falls
    as k grows."""

    name = "projected"
    budget_hint = "lower --proj-dim, or use --estimator ekfac"

    def memory_parts(self, query: base.MemoryQuery) -> dict[str, int]:
        # R^T H R, R^T R and one factorisation (3 k^2), two column blocks of R and H R (2 x 64 P)
        P = query.n_params
        return {"projected_curvature": (3 * min(query.proj_dim, P) ** 2 + 2 * 64 * P) * query.itemsize}

    def prepare(self, context: base.Context) -> base.State:
        config, hvp, eng, B = context.config, context.hvp, context.engine, context.test_grads
        P = hvp.size
        k = min(int(config.proj_dim), P)  # more columns than parameters add nothing (R^T R would be singular)
        proj = SignProjection(P, k, seed=config.seed, dtype=eng.dtype, device=eng.device)
        HR = torch.empty(k, k, dtype=torch.float64, device=eng.device)
        M = torch.empty(k, k, dtype=torch.float64, device=eng.device)
        for j0, j1 in proj.blocks():
            Rj = proj.columns(j0, j1)
            HRj = hvp.matmat(Rj.T.contiguous()).T  # (P, b) = H R_j
            HR[:, j0:j1] = proj.apply(HRj.T).T.to(torch.float64)
            M[:, j0:j1] = proj.apply(Rj.T).T.to(torch.float64)
        HR = 0.5 * (HR + HR.T)
        M = 0.5 * (M + M.T)
        Bp = proj.apply(B).to(torch.float64)  # (k_test, k)
        # Ritz values of H on span(R): the generalised eigenvalues of (H_R, M)
        L = torch.linalg.cholesky(M)
        C = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, HR, upper=False).T, upper=False)
        evals = torch.linalg.eigvalsh(0.5 * (C + C.T))
        lam_max = float(evals[-1])
        info = {"lambda_max": lam_max, "lambda_max_method": "Ritz value on span(R)", "solver": "projected"}
        diag = {
            "proj_dim": int(config.proj_dim),
            "proj_dim_used": k,
            "projection": "random signs +-1/sqrt(k), seeded column blocks",
            "projection_seed": config.seed,
            "hessian_vector_products": k,
            "projected_min_eigenvalue": float(evals[0]),
        }
        return _ProjectedState(
            context, info, train_map=proj.apply, HR=HR, M=M, Bp=Bp, lam_max=lam_max, diagnostics=diag
        )

    def solve(self, state: base.State, damping: float | str | None) -> base.Solution:
        assert isinstance(state, _ProjectedState)  # what prepare returned
        assert damping is not None  # uses_damping: the sweep passes every damping as given
        HR, M, Bp, diagnostics = state.HR, state.M, state.Bp, state.diagnostics
        assert HR is not None and M is not None and Bp is not None and diagnostics is not None  # set by prepare
        d = base.absolute_damping(damping, state.lam_max) if isinstance(damping, str) else float(damping)
        Z = torch.linalg.solve(HR + d * M, Bp.T).T  # (k_test, k)
        return base.Solution(Z.to(state.context.test_grads.dtype), d, dict(diagnostics))
