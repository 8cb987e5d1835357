"""Influence of training samples on a test loss, for any module described by a
:class:`~attnaudit.core.task.Task`, behind one interface.

Sign convention (the same for every estimator, the flip rate and the figures)
------------------------------------------------------------------------------
Training minimises R(theta) = (1/n) sum_i l(z_i, theta). Up-weighting one training sample
z by epsilon (R + epsilon * l(z, .)) moves the minimiser by
d theta / d epsilon = -(H + lambda I)^{-1} grad l(z), so the test loss changes at the rate

    I(z, z_test) = d l(z_test) / d epsilon = -grad l(z_test)^T (H + lambda I)^{-1} grad l(z)

(Koh & Liang's I_up,loss). Units: test-loss change per unit of added sample weight.

* I < 0: **helpful** -- up-weighting z lowers the test loss;
* I > 0: **harmful** -- up-weighting z raises the test loss.

Removing z is epsilon = -1/n, so the predicted change of the test loss on leave-one-out
retraining is -I / n. Some libraries report -I (or drop the minus); attnaudit never does.

Estimators
----------
* ``exact``: the full Hessian of the training loss over the tracked parameters (default:
  every trainable parameter), built from Hessian-vector products in blocks, then
  ``eigh``. Refused above ``max_exact_params`` (the P x P Hessian and its eigenvectors
  need 2 P^2 floats).
* ``last-layer``: the same, restricted to the head -- the weight and bias of the layer that
  produces the logits (:func:`attnaudit.core.task.head_parameter_names`); other
  parameters frozen.
* ``cg``: Hessian-free conjugate gradient on (H + lambda I) s = grad l(z_test), one
  Hessian-vector product (forward-over-reverse) per iteration, over the tracked parameters.
* ``tracin``: -sum_t w_t grad l(z_test; theta_t) . grad l(z; theta_t) over checkpoints,
  w_t = learning rate x number of GD steps the checkpoint stands for. This is the
  first-order change of the test loss along the training path when z's weight is raised
  (no Hessian, no damping), in the same units and with the same sign as above.

Which parameters: ``InfluenceConfig.params`` -- ``head``, ``all``, a module name, glob
patterns or a list of names (:func:`attnaudit.core.task.select_parameter_names`). The
resolved names and their count are in every result.

Paths
-----
Every derivative comes from the functional :class:`~attnaudit.core.engine.Engine` built
from the task (``"path": "generic: engine"``): eval mode, frozen buffers, the math kernel
of scaled dot-product attention, parameters copied in ``InfluenceConfig.dtype`` (float64
by default) -- the user's module is never modified. One declared fast path,
:func:`~attnaudit.analyses.influence.paths.twolayer_head_fast_path` (``"path": "fast: TwoLayerNet head, cached features"``),
computes the hidden features of a built-in 2-layer net once when only its head is
tracked; ``InfluenceConfig(fast_path=False)`` switches it off, and the tests assert both
paths give the same numbers.

Inputs: X rows are flat (n, d) as the data layer gives them (any (n, ...) works as long
as train and test rows have the same shape); the task's
:class:`~attnaudit.core.task.Inputs` turns them into what the module takes (images,
tokens).

Indefinite Hessians: a trained non-convex network's Hessian can have negative
eigenvalues. Damping lambda shifts every eigenvalue by lambda; ``exact`` and
``last-layer`` report the smallest eigenvalue of H and of H + lambda I and warn when the
damped Hessian is not positive definite (the influence is then the solution of an
indefinite system, dominated by negative-curvature directions: raise the damping above
|lambda_min|). ``cg`` stops and says so when it meets a direction of non-positive
curvature. A singular damped Hessian is refused.

Relative damping: a damping given as a string ``"<m>x"`` (``"1e-3x"``) means m times
lambda_max(H), the largest eigenvalue of the (undamped) Hessian over the tracked
parameters of the model at hand, resolved per model (:func:`parse_damping`). ``exact`` and
``last-layer`` read lambda_max from their eigendecomposition; ``cg`` estimates it by
Lanczos on Hessian-vector products (its residual is in the diagnostics). Every result
records the damping as given (``damping_given``), the absolute value used
(``damping_abs``, also ``InfluenceResult.damping``) and ``lambda_max``.

Computation: influence is an inner product of transformed gradients. Test-side gradients
are transformed once (s = (H + lambda I)^{-1} g_test), then per-sample training gradients
are streamed in chunks and contracted with s, so memory stays O(P (k + chunk)) beyond the
Hessian (k = 1 for the test-set total, n_test for per-test-point influence).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from attnaudit.analyses.influence.estimators import (
    ESTIMATORS,
    Context,
    Estimator,
    MemoryQuery,
    check_curvature,
    estimator_class,
)
from attnaudit.analyses.influence.estimators.exact import count_negative_eigenvalues
from attnaudit.analyses.influence.estimators.tracin import tracin_weights
from attnaudit.analyses.influence.paths import PATH_GENERIC, EngineView, engine_view
from attnaudit.analyses.influence.projection import PROJ_SPLITS
from attnaudit.core.cg import batched_cg
from attnaudit.core.contraction import contract
from attnaudit.core.engine import ranges
from attnaudit.core.task import (
    LOSSES as LOSS_TABLE,
    Inputs,
    Task,
    as_task,
    select_parameter_names,
)
from attnaudit.analyses.request import FieldError, field_check, literal
from attnaudit.errors import AuditError

__all__ = [
    "parse_damping",
    "damping_label",
    "count_negative_eigenvalues",
    "SOLVERS",
    "ESTIMATORS",
    "SIGN_CONVENTION",
    "InfluenceConfig",
    "InfluenceResult",
    "batched_cg",
    "check_exact_budget",
    "compute_influence",
    "InfluencePlan",
    "influence_memory",
    "influence_sweep",
    "plan_influence",
    "resolve_tracked",
    "tracin_weights",
]

SOLVERS = ("auto", "cholesky", "eigh")  # how exact / last-layer solve (see InfluenceConfig)
LOSSES = tuple(LOSS_TABLE)  # the core's one loss table: mse, ce
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
SIGN_CONVENTION = (
    "influence = d(test loss)/d(weight of the training sample) = -g_test^T (H + damping I)^-1 g_train; "
    "negative = helpful (up-weighting the sample lowers the test loss), positive = harmful"
)


def parse_damping(value, option: str = "damping") -> float | str:
    """A damping as given: an absolute number >= 0 (returned as float), or a multiple of
    lambda_max(H) written ``"<m>x"`` with m > 0 (returned in canonical form ``f"{m:g}x"``).
    Anything else raises a one-line :class:`AuditError`."""
    if isinstance(value, bool):
        raise AuditError(f"{option}: {value!r} is not a damping")
    if isinstance(value, (int, float)):
        v = float(value)
        if not (math.isfinite(v) and v >= 0):
            raise AuditError(
                f"{option} values must be numbers >= 0 (or multiples of lambda_max such as 1e-3x), got {value}"
            )
        return v
    text = str(value).strip().lower()
    relative = text.endswith("x")
    number = text[:-1].strip() if relative else text
    try:
        v = float(number)
    except ValueError:
        raise AuditError(
            f"{option}: {value!r} is not a damping; give a number >= 0 (absolute) or a multiple of lambda_max(H) such as 1e-3x"
        ) from None
    if relative:
        if not (math.isfinite(v) and v > 0):
            raise AuditError(
                f"{option}: relative damping {value!r} must be a positive multiple of lambda_max(H), e.g. 1e-3x"
            )
        return f"{v:g}x"
    if not (math.isfinite(v) and v >= 0):
        raise AuditError(
            f"{option} values must be numbers >= 0 (or multiples of lambda_max such as 1e-3x), got {value}"
        )
    return v


def damping_label(value) -> str:
    """A damping as text: ``1e-3x`` for relative, ``0.001`` for absolute."""
    return value if isinstance(value, str) else f"{value:g}"


# --------------------------------------------------------------------------- config / result
@dataclass(frozen=True)
class InfluenceConfig:
    """Settings of one influence computation (validated before any compute).

    ``params``: which parameters are tracked -- None (the estimator's default: ``head`` for
    ``last-layer``; for the others the task's own selector, ``all`` for a bare module),
    ``"head"``, ``"all"``, a module name, glob patterns (``"blocks.*.attn.*"``, several
    joined by commas) or a tuple of parameter names. ``"last"`` is a deprecated alias of
    ``"head"``. ``last-layer`` tracks the head only.
    ``chunk_size``: training samples per per-sample-gradient / Hessian-vector-product chunk
    (lowered automatically to fit ``memory_budget_mb``). ``hvp_batch``: Hessian columns
    built per vectorised block (``exact``). ``dtype``: the engine's floating dtype
    (``float64`` default; parameters are copied, the module is untouched).
    ``fast_path``: use a declared fast path when one applies (:mod:`attnaudit.analyses.influence.paths`);
    False forces the generic engine path. ``solver`` (exact, last-layer): ``cholesky``
    factors H + damping I once (P^3/3 flops) with lambda_min / lambda_max from Lanczos on the
    dense H and the count of negative eigenvalues from an LDL^T factorisation (Sylvester's
    inertia), falling back to ``eigh`` when the damped Hessian is not positive definite;
    ``eigh`` decomposes H (about 9 P^3 flops) and reuses it for every damping; ``auto``
    (default): cholesky for one damping, eigh for a damping sweep.
    """

    estimator: str = "last-layer"
    damping: float | str = 1e-3  # absolute, or "1e-3x": a multiple of lambda_max(H)
    params: str | tuple[str, ...] | None = None
    per_test: bool = False
    max_exact_params: int = 6000
    cg_tol: float = 1e-8
    cg_max_iter: int = 1000
    chunk_size: int = 512
    hvp_batch: int = 32
    memory_budget_mb: float = 2048.0
    dtype: str = "float64"
    fast_path: bool = True
    solver: str = "auto"
    curvature: str = "auto"  # kfac / ekfac: ggn (exact output-Hessian columns), fisher (sampled labels) or auto
    # projected: auto / ggn / empirical (projected Gauss-Newton or Fisher) or galerkin (the Hessian from k HVPs)
    proj_dim: int = 512  # projected: dimension k of the random sign projection
    proj_split: str = "layer"  # projected: k shared equally between layers (LoGra) or by parameter count ("params")
    cache_dir: str | None = None  # kfac / ekfac: folder keeping fitted factors, keyed by model and data fingerprint
    seed: int = 0  # kfac / ekfac with the sampled Fisher
    # projected: a folder keeping the projected training rows on disk (analyses.influence.store), reused across runs
    store: str | None = None
    store_executor: str = "local"  # projected with a store: missing rows computed here ("local") or on Ray ("ray")
    ray_address: str | None = None  # store_executor ray: a running cluster (None: a local Ray for the build)
    store_workers: int | None = None  # store_executor ray: tasks at once (None: the cluster's CPUs / torch threads)

    def __post_init__(self) -> None:
        if isinstance(self.proj_dim, bool) or int(self.proj_dim) != self.proj_dim or self.proj_dim < 1:
            raise FieldError("proj_dim", "{name} must be a positive integer, got " + literal(repr(self.proj_dim)))
        budget = self.memory_budget_mb
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
            raise FieldError(
                "memory_budget_mb", "{name} must be a positive number of MiB, got " + literal(repr(budget))
            )
        if self.proj_split not in PROJ_SPLITS:
            raise FieldError(
                "proj_split", "unknown {name} " + literal(repr(self.proj_split)) + f"; use {' or '.join(PROJ_SPLITS)}"
            )
        if self.curvature not in ("auto", "ggn", "fisher", "empirical", "galerkin"):
            raise FieldError(
                "curvature",
                "unknown {name} " + literal(repr(self.curvature)) + "; use auto, ggn, fisher, empirical or galerkin",
            )
        check_curvature(self.estimator, self.curvature)
        if self.solver not in SOLVERS:
            raise FieldError(
                "solver",
                "unknown influence {name} " + literal(repr(self.solver)) + f"; use one of {', '.join(SOLVERS)}",
            )
        if self.estimator not in ESTIMATORS:
            raise FieldError(
                "estimator", "unknown {name} " + literal(repr(self.estimator)) + f"; use one of {', '.join(ESTIMATORS)}"
            )
        object.__setattr__(self, "damping", field_check("damping", parse_damping, self.damping))
        params = self.params
        if isinstance(params, str):
            params = params.strip()
        elif params is not None:
            params = tuple(str(p) for p in params)
        if params is not None and not params:
            raise FieldError(
                "params", "{name} is empty; use head, all, a module name, glob patterns or parameter names"
            )
        object.__setattr__(self, "params", params)
        ESTIMATORS[self.estimator]().check_params(params)
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).replace("torch.", ""))
        if self.dtype not in DTYPES:
            raise FieldError(
                "dtype", "unknown influence {name} " + literal(repr(self.dtype)) + f"; use one of {', '.join(DTYPES)}"
            )
        for name in ("max_exact_params", "cg_max_iter", "chunk_size", "hvp_batch"):
            if getattr(self, name) < 1:
                raise FieldError(name, "{name} must be >= 1, got " + literal(getattr(self, name)))
        if not (0 < self.cg_tol < 1):
            raise FieldError("cg_tol", "{name} must be in (0, 1), got " + literal(self.cg_tol))
        self._check_store()

    def _check_store(self) -> None:
        """The gradient store's fields: a folder (not a file), an executor, Ray settings only with Ray."""
        if self.store is not None:
            if not isinstance(self.store, (str, os.PathLike)) or not str(self.store).strip():
                raise FieldError("store", "{name} must be a folder path, got " + literal(repr(self.store)))
            object.__setattr__(self, "store", str(self.store))
            if os.path.exists(self.store) and not os.path.isdir(self.store):
                raise FieldError(
                    "store", "{name} " + literal(self.store) + " is a file; give a folder (created if missing)"
                )
        if self.store is not None and (self.estimator != "projected" or self.curvature == "galerkin"):
            raise FieldError(
                "store",
                "{name} keeps the projected training rows of the projected estimator (curvature auto, ggn or "
                "empirical); use estimator projected, or drop {name}",
            )
        if self.store_executor not in ("local", "ray"):
            raise FieldError(
                "store_executor", "unknown {name} " + literal(repr(self.store_executor)) + "; use local or ray"
            )
        if self.store_executor == "ray" and self.store is None:
            raise FieldError("store_executor", "{name} ray builds the gradient store; give store (a folder) too")
        if self.ray_address is not None and self.store_executor != "ray":
            raise FieldError(
                "ray_address", "{name} joins a Ray cluster to build the gradient store; use store_executor ray"
            )
        workers = self.store_workers
        if workers is not None:
            if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
                raise FieldError("store_workers", "{name} must be a positive integer, got " + literal(repr(workers)))
            if self.store_executor != "ray":
                raise FieldError(
                    "store_workers", "{name} sets the Ray tasks building the store; use store_executor ray"
                )

    @property
    def tracked(self) -> str | tuple[str, ...]:
        """The selector for a bare module: ``params``, else the estimator's own (``head``:
        last-layer) or ``all``."""
        if self.params is None:
            return estimator_class(self.estimator).tracks_parameters or "all"
        return self.params

    def selector(self, task: Task) -> str | tuple[str, ...]:
        """The selector used on ``task``: ``params``, else the estimator's own (``head``:
        last-layer) or the task's own."""
        if self.params is not None:
            return self.params
        own = estimator_class(self.estimator).tracks_parameters
        if own is not None:
            return own
        return task.params if isinstance(task.params, str) else tuple(task.params)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class InfluenceResult:
    """Influence of each training sample (see the module docstring for the sign).

    ``total`` (n_train,) is the influence on the summed test loss; ``per_test``
    (n_train, n_test) per test point, when asked for. ``tracked`` names the parameters the
    influence is over (``n_params`` numbers in all); ``path`` says which implementation ran.
    ``diagnostics`` holds the memory estimate, timings, and the estimator's own checks
    (eigenvalues, CG residuals). ``train_losses`` (n_train,) float64: each training row's loss at
    the model, from the forward passes the estimator ran over the training rows (the projected
    estimator's, stored with its rows); None when it ran none of its own.
    """

    estimator: str
    damping: float | None
    total: torch.Tensor
    per_test: torch.Tensor | None
    n_params: int
    tracked: list[str]
    diagnostics: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    path: str = PATH_GENERIC
    train_losses: torch.Tensor | None = None

    @property
    def helpful(self) -> torch.Tensor:
        """Boolean mask: up-weighting the sample lowers the summed test loss."""
        return self.total < 0

    def to_dict(self, include_values: bool = False) -> dict:
        out = {
            "estimator": self.estimator,
            "damping": self.damping,
            "sign_convention": SIGN_CONVENTION,
            "path": self.path,
            "n_params": self.n_params,
            "tracked_parameters": self.tracked,
            "n_train": int(self.total.numel()),
            "diagnostics": self.diagnostics,
            "warnings": self.warnings,
        }
        if include_values:
            out["total"] = self.total.detach().cpu().tolist()
            if self.per_test is not None:
                out["per_test"] = self.per_test.detach().cpu().tolist()
        return out


# --------------------------------------------------------------------------- parameters
def resolve_tracked(task: Task, config: InfluenceConfig, X: torch.Tensor | None = None) -> list[str]:
    """Names of the parameters ``config`` tracks on ``task`` (registration order).

    ``head`` is found from the module's structure, with a probe forward pass on one row of
    ``X`` when given (:func:`attnaudit.core.task.head_parameter_names`).
    """
    return select_parameter_names(task.module, config.selector(task), X, task.inputs)


def check_exact_budget(estimator: str, n_params: int, max_exact_params: int, itemsize: int = 8) -> None:
    """Refuse ``exact``/``last-layer`` above the parameter budget (the dense P x P Hessian):
    :meth:`Estimator.check_budget` of the estimator (unknown names pass)."""
    ESTIMATORS.get(estimator, Estimator)().check_budget(int(n_params), max_exact_params, itemsize)


# --------------------------------------------------------------------------- memory
def influence_memory(
    estimator: str,
    n_params: int,
    n_train: int,
    n_test: int,
    per_test: bool,
    chunk: int,
    hvp_batch: int = 32,
    n_dampings: int = 1,
    itemsize: int = 8,
    activation_bytes_per_sample: int = 0,
    factor_bytes: int = 0,
    proj_dim: int = 0,
    n_classes: int = 0,
    gradient_params: int | None = None,
    test_params: int | None = None,
) -> dict:
    """Bytes the estimator holds at its peak.

    The estimator's own structures (:meth:`Estimator.memory_parts`; every registered
    estimator's keys are present, 0 for the others): exact / last-layer: Hessian +
    eigenvectors 2 P^2; cg: 4 P k vectors; kfac / ekfac: ``factor_bytes``; projected:
    3 k^2 and the projection's structures (``factor_bytes``; unmeasured: Galerkin's 128 P) and its projected rows (n_train k, and the row cache's n_train (c + 1) k up
    to ``ROW_CACHE_BYTES``). ``gradient_chunk``: chunk x ``gradient_params`` per-sample
    gradient entries (default P; K-FAC: its largest layer). Always the transformed test
    gradients P k (``test_params`` instead of P: projected, k), one chunk of per-sample
    gradients chunk x P and the output n_train x k (k = n_test if per_test else 1, times the
    number of dampings for an estimator that uses damping); ``activations``: the model's own
    activations for one chunk, from ``activation_bytes_per_sample`` (measured by the engine
    on the generic path; 0 when not measured).
    """
    P = n_params
    est = ESTIMATORS.get(estimator, Estimator)
    k = (n_test if per_test else 1) * (n_dampings if est.uses_damping else 1)
    rows = min(chunk, max(n_train, n_test))
    query = MemoryQuery(
        n_params=P,
        k=k,
        hvp_batch=hvp_batch,
        itemsize=itemsize,
        factor_bytes=factor_bytes,
        proj_dim=proj_dim,
        n_train=n_train,
        n_classes=n_classes,
    )
    parts = {key: 0 for cls in ESTIMATORS.values() for key in cls().memory_parts(query)}
    parts.update(est().memory_parts(query))
    parts.update(
        {
            "transformed_test_gradients": (P if test_params is None else test_params) * k * itemsize,
            "gradient_chunk": rows * (P if gradient_params is None else gradient_params) * itemsize,
            "activations": rows * int(activation_bytes_per_sample),
            "influence_output": n_train * k * itemsize,
        }
    )
    parts["total"] = sum(parts.values())
    return parts


def _budget_chunk(config: InfluenceConfig, P: int, fixed_bytes: int, itemsize: int, activation_bytes: int) -> int:
    """Largest chunk <= config.chunk_size whose gradient block and activations fit in what the budget leaves."""
    left = config.memory_budget_mb * 2**20 - fixed_bytes
    if left <= 0:
        return 0
    return int(max(1, min(config.chunk_size, left // (2 * itemsize * max(P, 1) + activation_bytes))))


def _plan(
    config: InfluenceConfig, est: Estimator, view: EngineView, X_train, n_train: int, n_test: int, n_dampings: int
):
    """(chunk, memory estimate) for one influence run, or an AuditError when nothing fits: the
    estimator's own hooks (``factor_bytes``, ``gradient_params_per_row``, ``test_gradient_params``,
    ``memory_parts``) asked with the run's config, on the engine the run uses."""
    eng = view.engine
    P, itemsize = eng.n_params, eng.theta.element_size()
    act = 0 if view.path != PATH_GENERIC else eng.probe_bytes_per_sample(X_train)
    factors = est.factor_bytes(eng, config)
    # the per-sample gradient block a chunk holds: all P, or one layer's for an estimator that
    # never forms all-parameter gradients (K-FAC's layer-wise fit and scores; not with fast_path=False)
    per_row = est.gradient_params_per_row(eng, X_train, config) if config.fast_path else P
    test_params = est.test_gradient_params(eng, config) if config.fast_path else P

    def estimate(chunk: int) -> dict:
        return influence_memory(
            config.estimator,
            P,
            n_train,
            n_test,
            config.per_test,
            chunk,
            config.hvp_batch,
            n_dampings,
            itemsize,
            act,
            factors,
            config.proj_dim,
            eng.n_classes,
            per_row,
            test_params,
        )

    mem = estimate(config.chunk_size)
    fixed = mem["total"] - mem["gradient_chunk"] - mem["activations"]
    chunk = _budget_chunk(config, per_row, fixed, itemsize, act)
    if chunk == 0:
        largest = max((k for k in mem if k not in ("total", "gradient_chunk", "activations")), key=lambda k: mem[k])
        needed = math.ceil((fixed + 2 * itemsize * per_row + act) / 2**20)
        raise AuditError(
            f"{config.estimator} influence needs {fixed / 2**20:,.0f} MiB before any chunk (most of it "
            f"{largest.replace('_', ' ')}: {mem[largest] / 2**20:,.1f} MiB), above the memory budget of "
            f"{config.memory_budget_mb:,g} MiB; {est.budget_hint}, or raise the memory budget to {needed} MiB or more"
        )
    return chunk, estimate(chunk)


@dataclass(frozen=True)
class InfluencePlan:
    """What one influence run will track and hold, planned before any compute (:func:`plan_influence`).

    ``tracked``: the parameter names; ``n_params``: their count P; ``chunk``: training rows per
    gradient chunk, fitted to the memory budget; ``bytes``: the estimator's peak memory by part
    (:func:`influence_memory`), ``bytes["total"]`` in all."""

    tracked: list[str]
    n_params: int
    chunk: int
    bytes: dict


@dataclass
class _Setup:
    """One model's influence run before any compute: the task, the estimator, the engine view and the plan."""

    task: Task
    names: list[str]
    est: Estimator
    view: EngineView
    chunk: int
    mem: dict


def _setup(
    task: Task, config: InfluenceConfig, X_train: torch.Tensor, n_test: int, n_dampings: int, state=None
) -> _Setup:
    """Resolve the tracked parameters, pick the engine view, refuse a P the estimator cannot
    hold and plan the memory: what :func:`influence_sweep` and :func:`plan_influence` share."""
    names = resolve_tracked(task, config, X_train)
    est = estimator_class(config.estimator)()
    # K-FAC needs the real module's linear layers: the generic engine, never a feature-cached fast path
    fast = config.fast_path and est.allows_fast_path
    view = engine_view(task, names, config.torch_dtype, fast, state=state, probe=X_train[:2])
    P = view.engine.n_params
    est.check_budget(P, config.max_exact_params, view.engine.theta.element_size())
    chunk, mem = _plan(config, est, view, X_train, int(X_train.shape[0]), n_test, n_dampings)
    return _Setup(task, names, est, view, chunk, mem)


def plan_influence(
    model: Task | nn.Module,
    X_train: torch.Tensor,
    n_test: int,
    config: InfluenceConfig,
    *,
    n_dampings: int = 1,
    loss: str = "mse",
    n_classes: int | None = None,
    inputs: Inputs | None = None,
) -> InfluencePlan:
    """The plan :func:`influence_sweep` makes for ``model`` on the training rows ``X_train``
    and ``n_test`` test rows (``n_dampings`` dampings), made the same way -- the estimator's
    own memory hooks with the config's settings -- without computing anything: refuses (an
    AuditError) what the run would refuse before any compute."""
    task = as_task(model, loss=loss, n_classes=n_classes, inputs=inputs, probe=X_train[:1])
    setup = _setup(task, config, X_train, n_test, n_dampings)
    return InfluencePlan(list(setup.names), setup.view.engine.n_params, setup.chunk, setup.mem)


# --------------------------------------------------------------------------- the interface
def _check_inputs(X_train, y_train, X_test, y_test) -> None:
    if X_train.ndim < 2 or X_test.ndim < 2:
        raise AuditError("influence needs one row per sample: inputs of shape (n, d) for the training and test sets")
    if tuple(X_train.shape[1:]) != tuple(X_test.shape[1:]):
        raise AuditError(
            f"training rows have shape {tuple(X_train.shape[1:])} but test rows {tuple(X_test.shape[1:])}; "
            "both sets must come from the same data"
        )
    if y_train is None or y_test is None:
        raise AuditError("influence needs labels for the training and test sets; this data set has none")
    if X_train.shape[0] != y_train.shape[0] or X_test.shape[0] != y_test.shape[0]:
        raise AuditError("inputs and labels have different numbers of rows")
    if X_train.shape[0] == 0 or X_test.shape[0] == 0:
        raise AuditError("influence needs at least one training and one test sample")


def _common_diagnostics(config: InfluenceConfig, task: Task, view: EngineView, chunk: int, mem: dict) -> dict:
    selector = config.selector(task)
    return {
        "path": view.path,
        "parameter_selector": selector if isinstance(selector, str) else list(selector),
        "dtype": config.dtype,
        "memory_estimate_bytes": mem,
        "chunk_size": chunk,
    }


def influence_sweep(
    model: Task | nn.Module,
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    config: InfluenceConfig,
    *,
    loss: str = "mse",
    n_classes: int | None = None,
    inputs: Inputs | None = None,
    dampings: Sequence[float | str] | None = None,
    checkpoints: Sequence[dict[str, torch.Tensor]] | None = None,
    checkpoint_weights: Sequence[float] | None = None,
) -> list[InfluenceResult]:
    """Influence for each damping in ``dampings`` (default: ``[config.damping]``).

    ``model``: a :class:`~attnaudit.core.task.Task`, or a bare module wrapped in one with
    ``loss``, ``n_classes`` (default: the width of its logits) and ``inputs`` (default:
    flat rows). ``exact``/``last-layer`` decompose the Hessian once and reuse it for every
    damping; ``cg`` solves once per damping; ``tracin`` has no damping and returns one
    result per requested damping, all equal, with ``damping=None``. The model is evaluated
    at its current parameters (``tracin``: at ``checkpoints``, dicts of named parameters as
    saved by :func:`attnaudit.core.training.train`, weighted by ``checkpoint_weights``); it is
    never modified. The estimator is looked up in the registry
    (:mod:`attnaudit.analyses.influence.estimators`): it transforms the test gradients
    (``prepare`` once, ``solve`` per damping), this function streams the training gradients.
    """
    _check_inputs(X_train, y_train, X_test, y_test)
    given = [config.damping] if dampings is None else [parse_damping(d, "damping") for d in dampings]
    task = as_task(model, loss=loss, n_classes=n_classes, inputs=inputs, probe=X_test)
    if estimator_class(config.estimator).uses_checkpoints:
        res = _checkpoint_sweep(task, X_train, y_train, X_test, y_test, config, checkpoints, checkpoint_weights)
        return [res for _ in given]
    t0 = time.perf_counter()
    setup = _setup(task, config, X_train, int(X_test.shape[0]), len(given))
    est, view, names, chunk, mem = setup.est, setup.view, setup.names, setup.chunk, setup.mem
    eng = view.engine
    P = eng.n_params
    n_train = X_train.shape[0]

    U_tr, T_tr = view.prepare(X_train), eng.targets(y_train)
    U_te, T_te = view.prepare(X_test), eng.targets(y_test)

    t_solve = time.perf_counter()
    targets = given if est.uses_damping else [None]
    # the test gradients (k, P) are formed by the estimator on first use: a projection can skip them
    context = Context(config, eng, U_tr, T_tr, U_te, T_te, tuple(targets), chunk)
    k = context.n_test_rows
    hvp = context.hvp
    state = est.prepare(context)
    solutions = [est.solve(state, g) for g in targets]
    info, trailing, train_map, train_losses = state.info, state.trailing_info, state.train_map, state.train_losses
    # fast_path=False: the per-sample gradients over all parameters, the reference the tests compare with
    scorer = est.train_scorer(state) if config.fast_path and train_map is None else None
    del state  # a Hessian's eigenvectors, factors: freed before the training gradients are streamed
    solve_s = time.perf_counter() - t_solve

    S = torch.cat([s.transformed for s in solutions]).T.contiguous()  # (P, k * n_dampings); projected: (proj_dim, ...)
    out = torch.empty(n_train, S.shape[1], dtype=S.dtype, device=S.device)
    t_train = time.perf_counter()
    # text: neighbours in length, at most `chunk` rows each (the gradient block the planner sized)
    for part in eng.row_chunks(U_tr, chunk, max_rows=chunk):
        if scorer is not None:
            out[part] = -scorer(U_tr[part], T_tr[part], S)
            continue
        g = eng.per_sample_grads(U_tr[part], T_tr[part])
        # summed over the parameters in float64 whatever the precision (attnaudit.core.contraction)
        out[part] = -contract(train_map(g) if train_map is not None else g, S.T).to(S.dtype)
    train_s = time.perf_counter() - t_train
    elapsed = time.perf_counter() - t0

    results = []
    common = _common_diagnostics(config, task, view, chunk, mem)
    for j, (as_given, sol) in enumerate(zip(targets, solutions)):
        block = out[:, j * k : (j + 1) * k]
        diag = {
            **common,
            "hvp_mode": hvp.mode,
            "hvp_vectors": hvp.calls,
            "solve_seconds": solve_s,
            "train_gradient_seconds": train_s,
            "train_gradients": "per-layer outer products" if scorer is not None else "per-sample gradients",
            "seconds": elapsed,
            **sol.diagnostics,
            **info,
            "damping_given": as_given,
            "damping_relative": float(as_given[:-1]) if isinstance(as_given, str) else None,
            "damping_abs": sol.damping,
            **trailing,
        }
        results.append(
            InfluenceResult(
                estimator=config.estimator,
                damping=sol.damping,
                total=block.sum(1),
                per_test=block.clone() if config.per_test else None,
                n_params=P,
                tracked=list(names),
                diagnostics=diag,
                warnings=sol.warnings,
                path=view.path,
                train_losses=train_losses,
            )
        )
    return results if est.uses_damping else [results[0] for _ in given]


def _checkpoint_sweep(task: Task, X_train, y_train, X_test, y_test, config, checkpoints, weights) -> InfluenceResult:
    """-sum_t w_t train_map(g_train(theta_t)) . solve(g_test(theta_t)) over weighted checkpoints (``tracin``)."""
    name = config.estimator
    if not checkpoints:
        raise AuditError(
            f"{name} needs checkpoints saved during training (TrainConfig.checkpoint_every); none were given"
        )
    if weights is None:
        raise AuditError(
            f"{name} needs one weight per checkpoint (learning rate x steps it stands for); see tracin_weights"
        )
    if len(weights) != len(checkpoints):
        raise AuditError(f"{name} got {len(checkpoints)} checkpoints but {len(weights)} weights")
    t0 = time.perf_counter()
    n_train = X_train.shape[0]
    out = None
    setup: _Setup | None = None
    own: dict = {}
    warns: list[str] = []
    used = 0
    for ckpt, w in zip(checkpoints, weights):
        if w == 0:
            continue
        if setup is None:  # planned on the first checkpoint used; the others have the same shapes
            setup = _setup(task, config, X_train, int(X_test.shape[0]), 1, state=ckpt)
            view = setup.view
        else:
            fast = config.fast_path and setup.est.allows_fast_path
            view = engine_view(task, setup.names, config.torch_dtype, fast, state=ckpt, probe=X_train[:2])
        est, chunk, eng = setup.est, setup.chunk, view.engine
        U_tr, T_tr = view.prepare(X_train), eng.targets(y_train)
        U_te, T_te = view.prepare(X_test), eng.targets(y_test)
        state = est.prepare(Context(config, eng, U_tr, T_tr, U_te, T_te, (None,), chunk))
        sol = est.solve(state, None)
        train_map = state.train_map
        own = {**sol.diagnostics, **state.info, **state.trailing_info}
        warns += [m for m in sol.warnings if m not in warns]
        del state
        S = sol.transformed.T  # (P, k)
        if out is None:
            out = torch.zeros(n_train, S.shape[1], dtype=S.dtype, device=S.device)
        for a, b in ranges(n_train, chunk):
            g = eng.per_sample_grads(U_tr[a:b], T_tr[a:b])
            out[a:b] -= w * contract(train_map(g) if train_map is not None else g, S.T).to(S.dtype)
        used += 1
    if out is None or setup is None:
        raise AuditError(f"every {name} checkpoint has weight 0 (no training steps); train for at least one step")
    diag = {
        **_common_diagnostics(config, task, setup.view, setup.chunk, setup.mem),
        **own,
        "checkpoints_used": used,
        "checkpoint_weights": [float(w) for w in weights],
        "seconds": time.perf_counter() - t0,
    }
    return InfluenceResult(
        estimator=config.estimator,
        damping=None,
        total=out.sum(1),
        per_test=out if config.per_test else None,
        n_params=setup.view.engine.n_params,
        tracked=list(setup.names),
        diagnostics=diag,
        warnings=warns,
        path=setup.view.path,
    )


def compute_influence(
    model: Task | nn.Module,
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    config: InfluenceConfig = InfluenceConfig(),
    *,
    loss: str = "mse",
    n_classes: int | None = None,
    inputs: Inputs | None = None,
    checkpoints: Sequence[dict[str, torch.Tensor]] | None = None,
    checkpoint_weights: Sequence[float] | None = None,
) -> InfluenceResult:
    """Influence of every training sample on the test loss (see the module docstring).

    ``model``: a Task, or a module (wrapped with ``loss``, ``inputs`` and ``n_classes``,
    which defaults to the width of its logits on one test row).
    """
    return influence_sweep(
        model,
        X_train,
        y_train,
        X_test,
        y_test,
        config,
        loss=loss,
        n_classes=n_classes,
        inputs=inputs,
        checkpoints=checkpoints,
        checkpoint_weights=checkpoint_weights,
    )[0]
