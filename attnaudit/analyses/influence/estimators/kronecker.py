"""``kfac`` and ``ekfac``: Kronecker-factored curvature of the linear layers
(:mod:`attnaudit.analyses.influence.kfac`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnaudit.analyses.influence.estimators.base import Context, Estimator, MemoryQuery, Solution, State, register
from attnaudit.analyses.influence.kfac import (
    LinearBlock,
    cached_factors,
    capture_entries_per_row,
    gradient_entries_per_row,
    kfac_memory_bytes,
    layer_gradient_scores,
    linear_blocks,
    resolve_damping,
    shared_weights,
)

__all__ = ["EKFAC", "KFAC"]


@dataclass
class _KroneckerState(State):
    factors: Any = None


@register
class KFAC(Estimator):
    """K-FAC factors fitted (or loaded from ``cache_dir``) once; one preconditioning per damping."""

    name = "kfac"
    curvatures = {
        "auto": "the Hessian",
        "ggn": "the exact Gauss-Newton matrix",
        "fisher": "the sampled Fisher",
        "empirical": "the empirical Fisher",
    }
    allows_fast_path = False  # needs the real module's linear layers
    budget_hint = "track fewer layers (params), use the projected estimator with a small proj_dim"

    def factor_bytes(self, engine, config=None) -> int:
        # the covariances A and S are kept only to be written to a --cache folder
        keep = config is not None and getattr(config, "cache_dir", None) is not None
        return kfac_memory_bytes(linear_blocks(engine)[0], keep_covariances=keep)

    def memory_parts(self, query: MemoryQuery) -> dict[str, int]:
        return {"kronecker_factors": int(query.factor_bytes)}

    def gradient_params_per_row(self, engine, rows=None, config=None) -> int:
        """One layer's (:func:`~attnaudit.analyses.influence.kfac.gradient_entries_per_row`),
        all P when K-FAC streams per-sample gradients over everything; with ``rows``, plus what
        the fit and the scores capture per row over every covered layer
        (:func:`~attnaudit.analyses.influence.kfac.capture_entries_per_row`, in the engine's
        itemsize): measured on DeiT-tiny rows, leaving it out let 300 rows at a 2 GiB budget
        peak at 8.7 GiB."""
        blocks = linear_blocks(engine)[0]
        per_row = gradient_entries_per_row(engine.module, blocks)
        per_row = engine.n_params if per_row is None else per_row
        if rows is not None:
            captured = capture_entries_per_row(engine, blocks, rows)
            per_row += -(-captured * 8 // engine.theta.element_size())
        return per_row

    def prepare(self, context: Context) -> State:
        config = context.config
        factors = cached_factors(
            context.engine,
            context.train_rows,
            self.name,
            chunk=context.chunk,
            curvature=config.curvature,
            seed=config.seed,
            cache_dir=config.cache_dir,
            targets=context.train_targets,
        )
        return _KroneckerState(
            context, {"lambda_max": None, "lambda_max_method": None, "solver": self.name}, factors=factors
        )

    def train_scorer(self, state: State):
        """Per-layer outer products of the covered layers' inputs and output gradients
        (:func:`~attnaudit.analyses.influence.kfac.layer_gradient_scores`): the preconditioned
        test gradients are zero outside those layers, so the training gradients are never
        formed over all parameters. None (per-sample gradients) when a covered weight is tied
        to another module's."""
        assert isinstance(state, _KroneckerState)  # what prepare returned
        engine = state.context.engine
        # the layer structure only, not the factors (freed with the state)
        blocks = [
            LinearBlock(b.path, b.weight, b.bias, b.d_in, b.d_out, source=b.source, module=b.module)
            for b in state.factors.blocks
        ]
        if shared_weights(engine.module, blocks):
            return None

        def score(rows, targets, transformed):
            return layer_gradient_scores(engine, blocks, transformed, rows, targets)

        return score

    def solve(self, state: State, damping: float | str | None) -> Solution:
        assert isinstance(state, _KroneckerState)  # what prepare returned
        assert damping is not None  # uses_damping: the sweep passes every damping as given
        factors, ctx = state.factors, state.context
        excluded = factors.excluded
        X = factors.precondition(ctx.test_grads, ctx.engine, damping)
        per_layer = {b.path: resolve_damping(damping, b.eigenvalues(factors.kind)) for b in factors.blocks}
        diag = {
            "curvature": factors.diagnostics["curvature"],
            "curvature_seed": factors.diagnostics["seed"],
            "factor_cache": factors.diagnostics.get("cache"),
            "layers": [b.path for b in factors.blocks],
            "excluded_parameters": excluded,
            "damping_per_layer": per_layer,
            "factor_bytes": factors.memory_bytes(),
        }
        warnings = (
            [
                f"{self.name} covers linear layers only (nn.Linear, nn.Conv2d, transformers Conv1D, self-attention "
                f"projections); {len(excluded)} tracked parameter(s) left out "
                f"of the influence: {', '.join(excluded[:6])}{' ...' if len(excluded) > 6 else ''}"
            ]
            if excluded
            else []
        )
        # a relative damping is resolved per layer (in the diagnostics)
        return Solution(X, None if isinstance(damping, str) else float(damping), diag, warnings)


@register
class EKFAC(KFAC):
    """K-FAC with eigenvalues refitted in the Kronecker eigenbasis."""

    name = "ekfac"
