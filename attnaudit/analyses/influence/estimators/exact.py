"""``exact`` and ``last-layer``: the dense Hessian (or Gauss-Newton matrix) of the training
loss over the tracked parameters, solved by Cholesky or an eigendecomposition."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import attnaudit.analyses.influence.estimators.base as base
from attnaudit.analyses.influence.kfac import dense_gauss_newton
from attnaudit.core.linalg import lanczos_top_eigen
from attnaudit.analyses.request import FieldError, literal
from attnaudit.errors import AuditError

__all__ = ["Exact", "LastLayer", "count_negative_eigenvalues"]


#: up to this many parameters the extreme eigenvalues come from one dense eigvalsh (0.15 s at
#: 1,024 on one core): Lanczos's lower end of a cross-entropy Hessian, whose small eigenvalues
#: cluster near 0, took 70 to 270 steps at P = 320 (up to 0.9 s, eigvalsh 0.01 s)
DENSE_EIGVALSH_PARAMS = 1024


def _extreme_eigenvalues(H: torch.Tensor) -> tuple[float, float, str]:
    """(lambda_min, lambda_max, method) of a dense symmetric H: eigvalsh up to
    :data:`DENSE_EIGVALSH_PARAMS` parameters; above, Lanczos at both ends (matrix products with
    H, Ritz residual <= 1e-12 lambda_scale), eigvalsh when either end has not converged in
    min(P, 300) steps -- exact to round-off either way."""
    P = H.shape[0]
    if P <= DENSE_EIGVALSH_PARAMS:
        ev = torch.linalg.eigvalsh(H)
        return float(ev[0]), float(ev[-1]), "eigvalsh"
    steps = min(P, 300)
    top = lanczos_top_eigen(lambda v: H @ v, P, 1, max_steps=steps, tol=1e-12, device=H.device, dtype=H.dtype)
    bottom = lanczos_top_eigen(
        lambda v: -(H @ v), P, 1, max_steps=steps, tol=1e-12, seed=1, device=H.device, dtype=H.dtype
    )
    # residuals are relative to each run's largest Ritz value; 1e-10 bounds the eigenvalue error
    if all((r.converged or r.steps >= P) and r.residuals[0] <= 1e-10 for r in (top, bottom)):
        return -bottom.eigenvalues[0], top.eigenvalues[0], "lanczos"
    ev = torch.linalg.eigvalsh(H)
    return float(ev[0]), float(ev[-1]), "eigvalsh (Lanczos not converged)"


def count_negative_eigenvalues(H: torch.Tensor, shift: float = 0.0) -> int:
    """Number of eigenvalues of the symmetric H below ``-shift``, by Sylvester's law of inertia
    on the Bunch-Kaufman factorisation H + shift I = L D L^T (D has 1x1 and 2x2 blocks), one
    O(P^3 / 3) factorisation instead of an eigendecomposition."""
    A = H + shift * torch.eye(H.shape[0], dtype=H.dtype, device=H.device) if shift else H
    LD, pivots, info = torch.linalg.ldl_factor_ex(A)
    if int(info) < 0:
        raise AuditError("LDL factorisation failed on the Hessian")
    piv = pivots.cpu().tolist()
    diag = LD.diagonal().cpu().tolist()
    sub = LD.diagonal(-1).cpu().tolist()
    count, k, n = 0, 0, len(piv)
    while k < n:
        if piv[k] > 0 or k + 1 == n:  # 1x1 block (LAPACK: a positive pivot index)
            count += diag[k] < 0
            k += 1
        else:  # 2x2 block [[a, b], [b, c]]: signs from its determinant and trace
            a, b, c = diag[k], sub[k], diag[k + 1]
            det = a * c - b * b
            count += 1 if det < 0 else (2 if det > 0 and a + c < 0 else 0)
            k += 2
    return count


@dataclass
class _ExactState(base.State):
    lam_min: float = 0.0
    lam_max: float = 0.0
    # cholesky: the solution and absolute damping per damping as given
    factored: dict = field(default_factory=dict)
    n_negative: int = 0
    # eigh: H = V diag(evals) V^T and the test gradients in that eigenbasis
    evals: torch.Tensor | None = None
    evecs: torch.Tensor | None = None
    coeff: torch.Tensor | None = None


def _cholesky(H: torch.Tensor, ctx: base.Context) -> _ExactState | None:
    """(H + damping I)^-1 B^T for every damping by Cholesky, with the diagnostics the eigh path
    reports, or None when some H + damping I is not positive definite (the caller decomposes)."""
    lam_min, lam_max, method = _extreme_eigenvalues(H)
    P = H.shape[0]
    eye = torch.eye(P, dtype=H.dtype, device=H.device)
    factored = {}
    for given in ctx.dampings:
        d = base.absolute_damping(given, lam_max)
        L, info = torch.linalg.cholesky_ex(H + d * eye)
        if int(info) != 0:
            return None
        B = ctx.test_grads.to(H.dtype)
        factored[given] = (torch.cholesky_solve(B.T, L).T.to(ctx.test_grads.dtype), d)  # (k, P)
        del L
    scale = max(abs(lam_min), abs(lam_max), 1e-300)
    # eigenvalues within round-off of 0 (P eps lambda_max, numpy's rank rule) are not counted negative
    n_neg = 0 if lam_min >= 0 else count_negative_eigenvalues(H, P * torch.finfo(H.dtype).eps * scale)
    info = {"lambda_max": lam_max, "lambda_max_method": method, "solver": "cholesky"}
    return _ExactState(ctx, info, lam_min=lam_min, lam_max=lam_max, factored=factored, n_negative=n_neg)


@base.register
class Exact(base.Estimator):
    """The full Hessian (``curvature="ggn"``: the exact Gauss-Newton matrix) over the tracked parameters."""

    name = "exact"
    curvatures = {"auto": "the Hessian", "ggn": "the exact Gauss-Newton matrix"}
    budget_hint = "use the ekfac, projected or cg estimator"
    size_hint = "use --estimator last-layer or cg"  # above max_exact_params

    def check_budget(self, n_params: int, max_exact_params: int, itemsize: int = 8) -> None:
        P = int(n_params)
        if P > max_exact_params:
            raise AuditError(
                f"{self.name} influence needs the full {P:,} x {P:,} Hessian ({2 * P * P * itemsize / 2**30:.2f} GiB with its "
                f"eigenvectors), above the budget of {max_exact_params:,} parameters; {self.size_hint}"
            )

    def memory_parts(self, query: base.MemoryQuery) -> dict[str, int]:
        P, itemsize = query.n_params, query.itemsize
        return {"hessian_and_eigenvectors": 2 * P * P * itemsize, "hvp_block": query.hvp_batch * P * itemsize}

    def prepare(self, context: base.Context) -> base.State:
        config = context.config
        if config.curvature == "ggn":  # the exact Gauss-Newton matrix, what K-FAC approximates
            H = dense_gauss_newton(
                context.engine,
                context.train_rows,
                budget_bytes=int(config.memory_budget_mb * 2**20) // 4,
                targets=context.train_targets,  # a language model's loss weights enter its output Hessian
            )
        else:
            H = context.hvp.dense(block=config.hvp_batch)
        trailing = {"curvature": "ggn" if config.curvature == "ggn" else "hessian"}
        # the P x P decomposition runs in float64 whatever the engine's precision (the precision
        # policy: small eigendecompositions and solves stay float64); its results go back to that dtype
        dtype = H.dtype
        H = H.to(torch.float64)
        one = len(context.dampings) == 1
        solver = "cholesky" if config.solver == "cholesky" or (config.solver == "auto" and one) else "eigh"
        if solver == "cholesky":
            state = _cholesky(H, context)
            if state is not None:
                state.trailing_info = trailing
                return state
            solver = "eigh (damped Hessian not positive definite)"
        evals, evecs = torch.linalg.eigh(H)
        evals, evecs = evals.to(dtype), evecs.to(dtype)
        del H
        lam_min, lam_max = float(evals[0]), float(evals[-1])
        for given in context.dampings:  # a relative damping needs lambda_max > 0: refuse before any solve
            base.absolute_damping(given, lam_max)
        info = {"lambda_max": lam_max, "lambda_max_method": "eigh", "solver": solver}
        coeff = context.test_grads @ evecs  # (k, P) in the eigenbasis
        return _ExactState(
            context, info, trailing, lam_min=lam_min, lam_max=lam_max, evals=evals, evecs=evecs, coeff=coeff
        )

    def solve(self, state: base.State, damping: float | str | None) -> base.Solution:
        assert isinstance(state, _ExactState)  # what prepare returned
        assert damping is not None  # uses_damping: the sweep passes every damping as given
        lam_min, lam_max = state.lam_min, state.lam_max
        if state.evals is None:  # cholesky
            X, d = state.factored[damping]
            diag = {
                "min_eigenvalue": lam_min,
                "max_eigenvalue": lam_max,
                "damped_min_eigenvalue": lam_min + d,
                "n_negative_eigenvalues": state.n_negative,
                "positive_definite": True,
                "damped_condition_number": (lam_max + d) / (lam_min + d),
            }
            return base.Solution(X, d, diag, [])
        evals, evecs, coeff = state.evals, state.evecs, state.coeff
        assert evecs is not None and coeff is not None  # eigh: set with evals
        d = base.absolute_damping(damping, lam_max)
        scale = max(abs(lam_min), abs(lam_max), 1e-300)
        shifted = evals + d
        w: list[str] = []
        smallest_abs = float(shifted.abs().min())
        if smallest_abs <= 1e-12 * scale:
            raise FieldError(
                "damping",
                f"the damped Hessian is singular (smallest |eigenvalue + damping| = {smallest_abs:.3g}, "
                f"lambda_max = {lam_max:.3g}); pass " + "{name} > 0, e.g. {name} " + f"{max(1e-3 * lam_max, 1e-8):.1g}",
            )
        # eigenvalues within round-off of 0 (P eps lambda_max, numpy's rank rule) are not counted negative
        n_neg = int((evals < -evals.numel() * torch.finfo(evals.dtype).eps * scale).sum())
        pd = bool(shifted[0] > 0)
        if not pd:
            w.append(
                f"damped Hessian is not positive definite (lambda_min(H) = {lam_min:.3g}, damping = {d:g}): influence "
                f"solves an indefinite system; raise --damping above {abs(lam_min):.3g}"
            )
        diag = {
            "min_eigenvalue": lam_min,
            "max_eigenvalue": lam_max,
            "damped_min_eigenvalue": float(shifted[0]),
            "n_negative_eigenvalues": n_neg,
            "positive_definite": pd,
            "damped_condition_number": float(shifted.abs().max() / shifted.abs().min()),
        }
        return base.Solution((coeff / shifted) @ evecs.T, d, diag, w)


@base.register
class LastLayer(Exact):
    """``exact`` restricted to the head (the weight and bias of the layer that produces the logits)."""

    name = "last-layer"
    tracks_parameters = "head"
    budget_hint = "use the cg estimator"
    size_hint = "use --estimator cg or a smaller --width"

    def check_params(self, params) -> None:
        if params not in (None, self.tracks_parameters):
            raise FieldError(
                "params",
                "the last-layer estimator tracks the head (the layer that produces the logits) only, not {name} "
                + literal(repr(params))
                + "; use the exact or cg estimator for other parameters",
            )
