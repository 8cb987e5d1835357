"""Sharpness and surfaces of one model at its current parameters: config -> analyze -> result.

Everything works on the *training loss* L(theta) = (1/n) sum_i l(f(x_i; theta), y_i) of a
task (any ``nn.Module`` with its input/output adapters and per-sample loss; MSE: 0.5
||f - onehot||^2, CE: cross entropy; a causal language model's next-token loss: per document
sum_t w_t CE_t / max(1, sum_t w_t), so L is the mean over documents of each one's mean
next-token cross-entropy in nats) over (X, y), as a function of the tracked parameters
(the task's selector: all, head, module names, globs). Accuracy is a classifier's only: a
language model's is None, with the reason in ``accuracy_note``.

* Hessian-vector products: :meth:`attnaudit.core.engine.Engine.hvp_operator` (the one HVP
  of the project: forward-over-reverse, eval mode, math attention kernel);
* top-k eigenvalues by Lanczos and the trace by Hutchinson (:mod:`attnaudit.core.linalg`);
* surfaces along filter-normalized random or Hessian directions (:mod:`.directions`,
  :mod:`.surfaces`), evaluated by :class:`.evaluate.SurfaceEvaluator` (structured fast path
  for the built-in two-layer nets when it applies, else the generic engine path; the
  result records which in ``path``);
* the basin width (:mod:`.basin`).

The module is never modified: the engine works on detached copies in ``config.dtype``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attnaudit.core.precision import PrecisionCheck, compare
from attnaudit.core.linalg import EigenResult, TraceResult, hutchinson_trace, lanczos_top_eigen
from attnaudit.core.task import Task
from attnaudit.analyses.request import FieldError, literal
from attnaudit.errors import AuditError
from attnaudit.analyses.landscape.basin import BasinResult, basin_width
from attnaudit.analyses.landscape.directions import (
    DIRECTION_KINDS,
    eigenvector_direction,
    params_norm,
    random_direction,
)
from attnaudit.analyses.landscape.evaluate import BACKENDS, Direction, SurfaceEvaluator, loss_and_accuracy
from attnaudit.analyses.landscape.setup import (
    DTYPES,
    LOSS_NAMES,
    NO_ACCURACY,
    check_labels,
    classifies,
    labels_as_given,
    landscape_engine,
    landscape_task,
)
from attnaudit.analyses.landscape.surfaces import Surface1D, Surface2D, loss_surface_1d, loss_surface_2d

Progress = Callable[[int], None] | None

# Seed offsets: every random object gets its own seed derived from the one base seed, so a
# figure can be redrawn from the JSON alone (the derived seeds are reported too).
_SEED_DIR2 = 1
_SEED_BASIN = 100
_SEED_LANCZOS = 10_000
_SEED_HUTCH = 20_000
# forward-over-reverse keeps primal, tangent and their saved tensors: a third of the budget per chunk
_HVP_MEMORY_SHARE = 3


@dataclass(frozen=True)
class LandscapeConfig:
    """Settings for :func:`analyse_landscape` (validated here, before any compute).

    ``loss``: ``mse``, ``ce`` or ``next-token`` (a causal language model's; None: the task's own,
    ``mse`` for a bare module);
    ``params``: parameter selector items (``all``, ``head``, module names, fnmatch globs;
    None: the task's own, all trainable parameters for a bare module).
    ``span``: surfaces cover alpha in [-span, span] (relative distance, see
    :mod:`.directions`); ``points`` = 0 skips the 1-D curve, ``grid`` = 0 the 2-D surface;
    ``top_k`` eigenvalues by Lanczos (at most ``lanczos_steps`` products, stop at relative
    Ritz bound ``lanczos_tol``); ``hutchinson_samples`` probes, deflated by the Lanczos
    vectors when ``hutchinson_deflate``; basin: ``basin_directions`` random directions
    (both signs), threshold ``basin_factor`` x L(theta), searched up to ``basin_max``.
    ``seed`` is the base of every random draw (directions, Lanczos start, probes).
    ``dtype``: precision of the analysis (the engine's parameter copies and data).
    ``fast_path``: use the structured two-layer evaluation where it applies (False forces
    the generic engine path); ``backend``: ``auto``, ``structured``, ``vmap``, ``loop``.
    """

    loss: str | None = None
    directions: str = "random"
    points: int = 51
    span: float = 1.0
    grid: int = 31
    keep_1d_params: bool = False
    params: tuple[str, ...] | None = None
    top_k: int = 5
    lanczos_steps: int = 100
    lanczos_tol: float = 1e-4
    hutchinson_samples: int = 30
    hutchinson_deflate: bool = True
    basin_directions: int = 8
    basin_factor: float = 2.0
    basin_max: float = 1.0
    basin_points: int = 24
    seed: int = 0
    memory_mb: float = 512.0
    points_per_batch: int | None = None
    samples_per_batch: int | None = None
    backend: str = "auto"
    fast_path: bool = True
    dtype: str = "float64"

    def __post_init__(self) -> None:
        if self.loss is not None and self.loss not in LOSS_NAMES:
            raise FieldError(
                "loss", "unknown {name} " + literal(repr(self.loss)) + f"; use one of {', '.join(LOSS_NAMES)}"
            )
        if self.params is not None:
            items = self.params.split(",") if isinstance(self.params, str) else self.params
            object.__setattr__(self, "params", tuple(str(p).strip() for p in items if str(p).strip()))
            if not self.params:
                raise FieldError("params", "{name} is empty; use all, head, a module name or glob patterns")
        for name, kinds in (("directions", DIRECTION_KINDS), ("backend", BACKENDS), ("dtype", tuple(DTYPES))):
            value = getattr(self, name)
            if value not in kinds:
                raise FieldError(name, "unknown {name} " + literal(repr(value)) + f"; use one of {', '.join(kinds)}")
        if self.backend == "structured" and not self.fast_path:
            raise FieldError("backend", "the structured {name} is the fast path; it cannot run with fast_path=False")
        for name in ("points", "grid"):
            if getattr(self, name) != 0 and getattr(self, name) < 3:
                raise FieldError(name, "{name} must be 0 (skip) or >= 3, got " + str(getattr(self, name)))
        for name, low in (("top_k", 1), ("lanczos_steps", 1), ("basin_directions", 1), ("basin_points", 2)):
            if getattr(self, name) < low:
                raise FieldError(name, "{name} must be >= " + f"{low}, got {getattr(self, name)}")
        if self.hutchinson_samples < 2:
            raise FieldError(
                "hutchinson_samples",
                "{name} must be >= 2 (a standard error needs two), got " + str(self.hutchinson_samples),
            )
        for name in ("span", "basin_max", "memory_mb"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise FieldError(name, "{name} must be a positive number, got " + str(getattr(self, name)))
        if not (0 < self.lanczos_tol < 1):
            raise FieldError("lanczos_tol", "{name} must be in (0, 1), got " + str(self.lanczos_tol))
        if not (self.basin_factor > 1 and math.isfinite(self.basin_factor)):
            raise FieldError("basin_factor", "{name} must be > 1, got " + str(self.basin_factor))
        for name in ("points_per_batch", "samples_per_batch"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise FieldError(name, "{name} must be >= 1, got " + str(v))

    @property
    def lanczos_k(self) -> int:
        """Eigenpairs computed: top_k, and at least 2 when the 2-D surface uses Hessian directions."""
        return max(self.top_k, 2 if self.directions == "hessian" and self.grid else 1)

    def seeds(self) -> dict:
        """Every derived seed, as reported in the JSON."""
        return {
            "base": self.seed,
            "direction_1": self.seed,
            "direction_2": self.seed + _SEED_DIR2,
            "basin_directions": [self.seed + _SEED_BASIN + j for j in range(self.basin_directions)],
            "lanczos_start": self.seed + _SEED_LANCZOS,
            "hutchinson": self.seed + _SEED_HUTCH,
        }

    def work_units(self) -> int:
        """Progress units of :func:`analyse_landscape` (products + points; an upper bound, the bar is topped up)."""
        basin = 2 * self.basin_directions * (self.basin_points + 8 * 2)
        return self.lanczos_steps + self.hutchinson_samples + self.points + self.grid**2 + basin


@dataclass(frozen=True)
class LandscapeResult:
    """Sharpness and surfaces of one model at its current parameters.

    ``path``: which surface evaluation ran (``fast: TwoLayerNet structured evaluation`` or
    ``generic: engine``); ``backend``: ``structured``, ``vmap`` or ``loop``; ``hvp_mode``:
    how the engine differentiated twice. ``accuracy``: the training accuracy of a classifier;
    None for a causal language model, with the reason in ``accuracy_note``.
    """

    n_samples: int
    n_params: int
    param_names: tuple[str, ...]
    loss: float
    accuracy: float | None
    eigen: EigenResult
    trace: TraceResult
    top_share: tuple[float, ...]  # cumulative sum_{i<=j} lambda_i / tr(H), j = 1..k
    top_share_stderr: tuple[float, ...]
    trace_over_top: float  # tr(H) / lambda_1: how many lambda_1-sized directions the trace holds
    basin: BasinResult
    surface_1d: Surface1D | None
    surface_2d: Surface2D | None
    directions: dict
    seeds: dict
    backend: str
    timings: dict
    path: str = ""
    hvp_mode: str = ""
    loss_function: str = ""
    dtype: str = ""
    precision_check: dict | None = None  # below float64: the top eigenvalues against the float64 Hessian
    accuracy_note: str | None = None  # why accuracy is None (a language model), else None

    def to_dict(self) -> dict:
        return {
            "n_samples": self.n_samples,
            "n_params": self.n_params,
            "param_names": list(self.param_names),
            "loss": self.loss,
            "accuracy": self.accuracy,
            **({"accuracy_note": self.accuracy_note} if self.accuracy_note else {}),
            "top_eigenvalues": self.eigen.to_dict(),
            "trace": self.trace.to_dict(),
            "top_share": list(self.top_share),
            "top_share_stderr": list(self.top_share_stderr),
            "trace_over_top": self.trace_over_top,
            "basin": self.basin.to_dict(),
            "surface_1d": None if self.surface_1d is None else self.surface_1d.to_dict(),
            "surface_2d": None if self.surface_2d is None else self.surface_2d.to_dict(),
            "directions": self.directions,
            "seeds": self.seeds,
            "backend": self.backend,
            "path": self.path,
            "hvp_mode": self.hvp_mode,
            "loss_function": self.loss_function,
            "dtype": self.dtype,
            "precision_check": self.precision_check,
            "timings": self.timings,
        }


class _Ticks:
    """``progress`` capped at ``total`` units; :meth:`finish` tops the bar up to the total."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, k: int) -> None:
        if self.progress is not None:
            k = min(k, self.total - self.done)
            if k > 0:
                self.done += k
                self.progress(k)

    def finish(self) -> None:
        self(self.total - self.done)


def _surface_directions(
    config: LandscapeConfig, params: dict, vecs: torch.Tensor, seeds: dict
) -> tuple[Direction, Direction | None, dict]:
    """The surfaces' directions (the second only with a 2-D grid) and how they were made:
    filter-normalized random directions, or the top Hessian eigenvectors (``vecs``, scaled so
    that ||d|| = ||theta||)."""
    d1: Direction
    d2: Direction | None
    if config.directions == "random":
        d1 = random_direction(params, seeds["direction_1"], config.keep_1d_params)
        d2 = random_direction(params, seeds["direction_2"], config.keep_1d_params) if config.grid else None
        dir_info = {
            "kind": "random",
            "normalization": "filter",
            "keep_1d_params": config.keep_1d_params,
            "seeds": [seeds["direction_1"], seeds["direction_2"]],
        }
    else:
        d1 = eigenvector_direction(vecs[:, 0], params)
        d2 = eigenvector_direction(vecs[:, 1], params) if config.grid and vecs.shape[1] > 1 else None
        dir_info = {
            "kind": "hessian",
            "normalization": "global: ||d|| = ||theta||",
            "eigen_index": [0, 1],
            "lanczos_seed": seeds["lanczos_start"],
        }
    dir_info["theta_norm"] = params_norm(params)
    return d1, d2, dir_info


def analyse_landscape(
    model: nn.Module | Task, X: torch.Tensor, y: torch.Tensor, config: LandscapeConfig, progress: Progress = None
) -> LandscapeResult:
    """Loss, accuracy, Hessian top-k, trace, top share, basin width and surfaces at the current theta.

    ``model``: any ``nn.Module`` (flat rows in, logits out) or a :class:`~attnaudit.core.task.Task`
    (images, tokens, keyword inputs, tuple/dict outputs). The module is not modified (no
    dtype change; eval mode only inside the analysis). ``progress(n)`` is advanced by
    products and evaluated points; ``config.work_units()`` is the total.
    """
    if y is None:
        raise AuditError("the loss landscape needs labels; use a labelled dataset")
    if X.shape[0] != y.shape[0]:
        raise AuditError(f"{X.shape[0]} samples but {y.shape[0]} labels")
    if X.shape[0] == 0:
        raise AuditError("no training samples; give more rows")
    task = landscape_task(model, X, config.loss, config.params)
    engine = landscape_engine(task, X, config.dtype)
    X_given = X  # the float64 spot check reads the rows as given, not rounded to the engine's dtype
    X, y = engine.rows(X), labels_as_given(y.to(engine.device))
    check_labels(engine, y)
    T = engine.targets(y)
    params = engine.unflatten(engine.theta)  # the tracked parameters by name (views of theta)
    advance = _Ticks(progress, config.work_units())
    seeds = config.seeds()
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    loss0, acc0 = loss_and_accuracy(engine, X, y, config.samples_per_batch or 8192)
    timings["loss"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    budget = config.memory_mb * 2**20
    chunk = config.samples_per_batch or engine.plan_chunk(X, budget / _HVP_MEMORY_SHARE, limit=4096)
    hvp = engine.hvp_operator(X, T, chunk=chunk)
    # the Lanczos basis holds its vectors x n_params numbers: keep it within 4 x the memory budget;
    # a basis capped below the products allowed restarts thick (same products, same accuracy)
    steps = max(config.lanczos_steps, config.lanczos_k + 2)
    basis_cap = int(4 * budget / (engine.theta.element_size() * hvp.size))
    basis = max(min(steps, basis_cap), config.lanczos_k + 2)
    # the products H q_j are kept too (the Ritz residuals then need no further product) only
    # when basis and products together stay within that same 4 x budget
    basis_bytes = basis * hvp.size * engine.theta.element_size()
    eig = lanczos_top_eigen(
        hvp,
        hvp.size,
        config.lanczos_k,
        max_steps=steps,
        tol=config.lanczos_tol,
        seed=seeds["lanczos_start"],
        device=engine.device,
        dtype=engine.dtype,
        progress=advance,
        keep_products_bytes=max(0, int(4 * budget) - basis_bytes),
        basis=basis,
    )
    timings["lanczos"] = time.perf_counter() - t0
    vecs, h_vecs = eig.eigenvectors, eig.h_eigenvectors
    assert vecs is not None and h_vecs is not None  # lanczos_top_eigen returns both
    check = None
    if engine.dtype != torch.float64:
        t0 = time.perf_counter()
        check = eigen_precision_check(
            task, X_given, T, vecs[:, : config.top_k], eig.eigenvalues[: config.top_k], chunk, engine.names
        )
        timings["precision_check"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tr = hutchinson_trace(
        hvp,
        hvp.size,
        config.hutchinson_samples,
        seed=seeds["hutchinson"],
        device=engine.device,
        dtype=engine.dtype,
        deflate=vecs[:, : config.top_k] if config.hutchinson_deflate else None,
        deflate_products=h_vecs[:, : config.top_k] if config.hutchinson_deflate else None,
        progress=advance,
    )
    timings["hutchinson"] = time.perf_counter() - t0
    top = torch.tensor(eig.eigenvalues[: config.top_k], dtype=torch.float64)
    cum = torch.cumsum(top, 0)
    share = cum / tr.estimate if tr.estimate != 0 else torch.full_like(cum, float("nan"))
    share_se = share.abs() * (tr.stderr / abs(tr.estimate)) if tr.estimate != 0 else share
    lam1 = eig.eigenvalues[0]
    trace_over_top = tr.estimate / lam1 if lam1 != 0 else float("nan")

    t0 = time.perf_counter()
    d1, d2, dir_info = _surface_directions(config, params, vecs, seeds)
    timings["directions"] = time.perf_counter() - t0

    evaluate = SurfaceEvaluator(
        engine,
        X,
        y,
        fast_path=config.fast_path,
        backend=config.backend,
        memory_mb=config.memory_mb,
        points_per_batch=config.points_per_batch,
        samples_per_batch=config.samples_per_batch,
    )
    surf1 = surf2 = None
    t0 = time.perf_counter()
    if config.points:
        surf1 = loss_surface_1d(evaluate, d1, config.points, config.span, progress=advance)
    timings["surface_1d"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if config.grid and d2 is not None:
        surf2 = loss_surface_2d(evaluate, d1, d2, config.grid, config.span, progress=advance)
    timings["surface_2d"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    bdirs = [random_direction(params, s, config.keep_1d_params) for s in seeds["basin_directions"]]
    basin = basin_width(
        evaluate,
        bdirs,
        factor=config.basin_factor,
        max_radius=config.basin_max,
        points=config.basin_points,
        direction_seeds=seeds["basin_directions"],
        progress=advance,
    )
    timings["basin"] = time.perf_counter() - t0
    advance.finish()
    return LandscapeResult(
        n_samples=int(X.shape[0]),
        n_params=hvp.size,
        param_names=tuple(engine.names),
        loss=loss0,
        accuracy=acc0,
        eigen=eig,
        trace=tr,
        top_share=tuple(share.tolist()),
        top_share_stderr=tuple(share_se.tolist()),
        trace_over_top=trace_over_top,
        basin=basin,
        surface_1d=surf1,
        surface_2d=surf2,
        directions=dir_info,
        seeds=seeds,
        backend=evaluate.backend,  # the evaluator actually used (vmap falls back to a loop if it must)
        timings=timings,
        path=evaluate.path,
        hvp_mode=hvp.mode,
        loss_function=engine.loss.name,
        dtype=str(engine.dtype).replace("torch.", ""),
        precision_check=None if check is None else check.to_dict(),
        accuracy_note=None if classifies(engine.loss) else NO_ACCURACY,
    )


def eigen_precision_check(
    task: Task,
    X: torch.Tensor,
    T: torch.Tensor,
    vecs: torch.Tensor,
    values: Sequence[float],
    chunk: int,
    names: Sequence[str],
) -> PrecisionCheck:
    """The top eigenvalues found at a lower precision against the Rayleigh quotients of their
    eigenvectors under the float64 Hessian over the same rows (one float64 product per eigenvector):
    equal to second order in the eigenvectors' error when the low-precision Hessian is faithful."""
    t0 = time.perf_counter()
    engine64 = landscape_engine(task, X, "float64", names=names)
    V = vecs.T.to(device=engine64.device, dtype=torch.float64)  # (k, P): one eigenvector a row
    hvp64 = engine64.hvp_operator(engine64.rows(X), T.to(engine64.device, torch.float64), chunk=chunk)
    HV = hvp64.matmat(V)
    rayleigh = (V * HV).sum(1) / (V * V).sum(1)
    # how far each vector is from an eigenvector of the float64 Hessian: the Rayleigh quotients can
    # agree with a low-precision Lanczos run that converged to the wrong directions
    residual = (HV - rayleigh[:, None] * V).norm(dim=1) / (rayleigh.abs() * V.norm(dim=1)).clamp_min(1e-300)
    low = torch.tensor([float(v) for v in values], dtype=torch.float64)
    check = compare(
        low,
        rayleigh.cpu(),
        quantity="top Hessian eigenvalues (Rayleigh quotients under the float64 Hessian)",
        precision=str(vecs.dtype).replace("torch.", ""),
        subsample={"rows": int(X.shape[0]), "eigenvalues": int(V.shape[0])},
        seconds=time.perf_counter() - t0,
    )
    check.extra = {"relative_residual_float64": [float(r) for r in residual.cpu()]}
    # a Ritz pair with relative residual e lies within e |rho| of an eigenvalue of the float64 Hessian
    # (Bauer-Fike for symmetric matrices): beyond the tolerance the values are not eigenvalues at all
    if float(residual.max()) > check.tolerance["relative_error_max"]:
        check.agrees = False
    return check
