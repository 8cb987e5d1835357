"""``cg``: Hessian-free conjugate gradient on (H + lambda I) s = g_test, one batch of
Hessian-vector products per iteration."""

from __future__ import annotations

import attnaudit.analyses.influence.estimators.base as base
from attnaudit.core.cg import batched_cg
from attnaudit.core.linalg import lanczos_top_eigen

__all__ = ["CG"]


@base.register
class CG(base.Estimator):
    """Conjugate gradient per damping; lambda_max (relative damping) by Lanczos on Hessian-vector products."""

    name = "cg"

    def memory_parts(self, query: base.MemoryQuery) -> dict[str, int]:
        return {"cg_vectors": 4 * query.n_params * query.k * query.itemsize}

    def prepare(self, context: base.Context) -> base.State:
        info: dict = {"lambda_max": None, "lambda_max_method": None}
        if any(isinstance(g, str) for g in context.dampings):
            eng, hvp = context.engine, context.hvp
            P = eng.n_params
            eig = lanczos_top_eigen(
                lambda v: hvp.matmat(v[None])[0],
                P,
                1,
                max_steps=min(P, 200),
                tol=1e-6,
                device=eng.theta.device,
                dtype=eng.theta.dtype,
            )
            info = {
                "lambda_max": float(eig.eigenvalues[0]),
                "lambda_max_method": "lanczos",
                "lambda_max_residual": float(eig.residuals[0]),
                "lambda_max_converged": eig.converged,
            }
        for given in context.dampings:  # a relative damping needs lambda_max > 0: refuse before any solve
            base.absolute_damping(given, info["lambda_max"])
        return base.State(context, info)

    def solve(self, state: base.State, damping: float | str | None) -> base.Solution:
        assert damping is not None  # uses_damping: the sweep passes every damping as given
        ctx = state.context
        config, hvp = ctx.config, ctx.hvp
        d = base.absolute_damping(damping, state.info["lambda_max"])
        X, cgd = batched_cg(lambda V: hvp.matmat(V) + d * V, ctx.test_grads, config.cg_tol, config.cg_max_iter)
        w = []
        if cgd["negative_curvature"]:
            w.append(
                f"CG met non-positive curvature at damping {d:g}: the damped Hessian is not positive definite; raise --damping"
            )
        elif not cgd["converged"]:
            w.append(
                f"CG did not converge in {cgd['iterations']} iterations at damping {d:g} "
                f"(relative residual {cgd['relative_residual_max']:.2g}); raise --cg-max-iter or --damping"
            )
        return base.Solution(X, d, cgd, w)
