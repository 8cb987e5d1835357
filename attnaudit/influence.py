"""Influence of training samples on a test loss, behind one interface.

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
* ``exact``: the full Hessian of the training loss over all trainable parameters, built
  from Hessian-vector products in blocks, then ``eigh``. Refused above
  ``max_exact_params`` (the P x P Hessian and its eigenvectors need 2 P^2 floats).
* ``last-layer``: the same, restricted to the output layer (other parameters frozen);
  for a :class:`~attnaudit.models.TwoLayerNet` the hidden features are computed once.
* ``cg``: Hessian-free conjugate gradient on (H + lambda I) s = grad l(z_test), one
  Hessian-vector product (``torch.func`` forward-over-reverse) per iteration, all params.
* ``tracin``: -sum_t w_t grad l(z_test; theta_t) . grad l(z; theta_t) over checkpoints,
  w_t = learning rate x number of GD steps the checkpoint stands for. This is the
  first-order change of the test loss along the training path when z's weight is raised
  (no Hessian, no damping), in the same units and with the same sign as above.

Indefinite Hessians: a trained non-convex network's Hessian can have negative
eigenvalues. Damping lambda shifts every eigenvalue by lambda; ``exact`` and
``last-layer`` report the smallest eigenvalue of H and of H + lambda I and warn when the
damped Hessian is not positive definite (the influence is then the solution of an
indefinite system, dominated by negative-curvature directions: raise the damping above
|lambda_min|). ``cg`` stops and says so when it meets a direction of non-positive
curvature. A singular damped Hessian is refused.

Computation: influence is an inner product of transformed gradients. Test-side gradients
are transformed once (s = (H + lambda I)^{-1} g_test), then per-sample training gradients
are streamed in chunks and contracted with s, so memory stays O(P (k + chunk)) beyond the
Hessian (k = 1 for the test-set total, n_test for per-test-point influence).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from .errors import AuditError

ESTIMATORS = ("exact", "last-layer", "cg", "tracin")
LOSSES = ("mse", "ce")
SIGN_CONVENTION = (
    "influence = d(test loss)/d(weight of the training sample) = -g_test^T (H + damping I)^-1 g_train; "
    "negative = helpful (up-weighting the sample lowers the test loss), positive = harmful"
)


# --------------------------------------------------------------------------- config / result
@dataclass(frozen=True)
class InfluenceConfig:
    """Settings of one influence computation (validated before any compute).

    ``params``: which parameters are tracked -- None (the estimator's default: the output
    layer for ``last-layer``, every trainable parameter otherwise), ``"all"``, ``"last"`` or
    a tuple of parameter names. ``chunk_size``: training samples per per-sample-gradient /
    Hessian-vector-product chunk (lowered automatically to fit ``memory_budget_mb``).
    ``hvp_batch``: Hessian columns built per vectorised block (``exact``).
    """

    estimator: str = "last-layer"
    damping: float = 1e-3
    params: str | tuple[str, ...] | None = None
    per_test: bool = False
    max_exact_params: int = 6000
    cg_tol: float = 1e-8
    cg_max_iter: int = 1000
    chunk_size: int = 512
    hvp_batch: int = 32
    memory_budget_mb: float = 2048.0

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise AuditError(f"unknown influence estimator {self.estimator!r}; use one of {', '.join(ESTIMATORS)}")
        if not (math.isfinite(self.damping) and self.damping >= 0):
            raise AuditError(f"damping must be a finite number >= 0, got {self.damping}")
        if isinstance(self.params, str) and self.params not in ("all", "last"):
            raise AuditError(f"params must be 'all', 'last' or a list of parameter names, got {self.params!r}")
        if self.estimator == "last-layer" and self.params not in (None, "last"):
            raise AuditError("the last-layer estimator tracks the output layer only; use --estimator exact or cg for other parameters")
        if self.max_exact_params < 1:
            raise AuditError(f"max_exact_params must be >= 1, got {self.max_exact_params}")
        if not (0 < self.cg_tol < 1):
            raise AuditError(f"cg tolerance must be in (0, 1), got {self.cg_tol}")
        if self.cg_max_iter < 1:
            raise AuditError(f"cg max iterations must be >= 1, got {self.cg_max_iter}")
        if self.chunk_size < 1 or self.hvp_batch < 1:
            raise AuditError("chunk_size and hvp_batch must be >= 1")
        if not (self.memory_budget_mb > 0 and math.isfinite(self.memory_budget_mb)):
            raise AuditError(f"memory budget must be a positive number of MB, got {self.memory_budget_mb}")

    @property
    def tracked(self) -> str | tuple[str, ...]:
        if self.params is None:
            return "last" if self.estimator == "last-layer" else "all"
        return self.params


@dataclass
class InfluenceResult:
    """Influence of each training sample (see the module docstring for the sign).

    ``total`` (n_train,) is the influence on the summed test loss; ``per_test``
    (n_train, n_test) per test point, when asked for. ``diagnostics`` holds the memory
    estimate, timings, and the estimator's own checks (eigenvalues, CG residuals).
    """

    estimator: str
    damping: float | None
    total: torch.Tensor
    per_test: torch.Tensor | None
    n_params: int
    tracked: list[str]
    diagnostics: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def helpful(self) -> torch.Tensor:
        """Boolean mask: up-weighting the sample lowers the summed test loss."""
        return self.total < 0

    def to_dict(self, include_values: bool = False) -> dict:
        out = {
            "estimator": self.estimator,
            "damping": self.damping,
            "sign_convention": SIGN_CONVENTION,
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


# --------------------------------------------------------------------------- audit task
def loss_rows(outputs: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-sample loss for outputs (..., c) and one-hot targets (..., c).

    mse: 0.5 ||f - y||^2; ce: logsumexp(f) - <f, y>. Their means are the training losses of
    :mod:`attnaudit.training`. One-hot targets (not integer labels) keep this vmap-able.
    """
    if loss == "mse":
        return 0.5 * (outputs - targets).pow(2).sum(-1)
    if loss == "ce":
        return torch.logsumexp(outputs, -1) - (outputs * targets).sum(-1)
    raise AuditError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)}")


@dataclass
class AuditTask:
    """A functional view of a model for influence: flat tracked parameters theta (P,),
    ``prepare(x)`` (the part of the forward pass that does not depend on theta, run once
    without gradients) and ``apply(theta, u)`` -> outputs (B, c) on prepared inputs u.

    Everything else (frozen parameters, buffers such as the attention context) is bound
    inside ``apply``. Build one with :func:`make_task`.
    """

    theta: torch.Tensor
    names: list[str]
    shapes: list[tuple[int, ...]]
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    prepare: Callable[[torch.Tensor], torch.Tensor]
    loss: str
    n_classes: int
    description: str = ""

    @property
    def n_params(self) -> int:
        return int(self.theta.numel())

    def targets(self, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(y.long(), self.n_classes).to(self.theta.dtype).to(self.theta.device)

    def sample_loss(self, theta: torch.Tensor, u: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Loss of one prepared sample u with one-hot target t (scalar)."""
        return loss_rows(self.apply(theta, u.unsqueeze(0)).squeeze(0), t, self.loss)

    def sum_loss(self, theta: torch.Tensor, U: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        return loss_rows(self.apply(theta, U), T, self.loss).sum()


def _unflatten(theta: torch.Tensor, names: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in zip(names, shapes):
        size = math.prod(shape)
        out[name] = theta[offset : offset + size].view(shape)
        offset += size
    return out


def _select_names(model: nn.Module, params: str | tuple[str, ...]) -> list[str]:
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise AuditError("the model has no trainable parameters; nothing to compute influence for")
    if params == "all":
        return trainable
    if params == "last":
        return [trainable[-1]]
    unknown = [p for p in params if p not in dict(model.named_parameters())]
    if unknown:
        raise AuditError(f"unknown parameter name(s) {', '.join(unknown)}; the model has {', '.join(trainable)}")
    return list(params)


def make_task(model: nn.Module, loss: str, n_classes: int, params: str | tuple[str, ...] = "all") -> AuditTask:
    """Audit task for ``model`` tracking ``params`` ('all', 'last' or names) at its current values.

    For a :class:`~attnaudit.models.TwoLayerNet` tracking only the output layer ``a``, the
    hidden features relu(W z / sqrt(d)) / sqrt(m) are prepared once and ``apply`` is the
    linear head; otherwise ``apply`` is ``functional_call`` of the whole model.
    """
    from .models import TwoLayerNet

    if loss not in LOSSES:
        raise AuditError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)}")
    names = _select_names(model, params)
    named = dict(model.named_parameters())
    shapes = [tuple(named[n].shape) for n in names]
    theta = torch.cat([named[n].detach().reshape(-1) for n in names]).clone()

    if isinstance(model, TwoLayerNet) and names == ["a"]:
        _, s_out = model.preactivation_scale()
        m, c = model.a.shape

        def prepare(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model.hidden(x) * s_out

        def apply(th: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            return u @ th.view(m, c)

        return AuditTask(theta, names, shapes, apply, prepare, loss, n_classes, "TwoLayerNet output layer (features cached)")

    frozen = {k: v.detach() for k, v in model.named_parameters() if k not in names}
    frozen.update({k: v.detach() for k, v in model.named_buffers()})

    def apply_generic(th: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, {**frozen, **_unflatten(th, names, shapes)}, (x,))

    return AuditTask(theta, names, shapes, apply_generic, lambda x: x, loss, n_classes, f"functional_call over {', '.join(names)}")


# --------------------------------------------------------------------------- building blocks
def _ranges(n: int, size: int) -> Iterable[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


def per_sample_grads(task: AuditTask, U: torch.Tensor, T: torch.Tensor, theta: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample gradients (B, P) of the per-sample loss at theta (one chunk; vmap over rows)."""
    th = task.theta if theta is None else theta
    return vmap(grad(task.sample_loss), in_dims=(None, 0, 0))(th, U, T)


def summed_grad(task: AuditTask, U: torch.Tensor, T: torch.Tensor, chunk: int) -> torch.Tensor:
    """Gradient (P,) of sum_i l(z_i) over all rows, accumulated in chunks."""
    g = torch.zeros_like(task.theta)
    for a, b in _ranges(U.shape[0], chunk):
        g += grad(task.sum_loss)(task.theta, U[a:b], T[a:b])
    return g


def make_hvp(task: AuditTask, U: torch.Tensor, T: torch.Tensor, chunk: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """V (k, P) -> V H (k, P) with H the Hessian of the mean training loss (1/n) sum_i l(z_i).

    Forward-over-reverse (jvp of grad), vmapped over the k vectors, summed over data chunks.
    """
    n = U.shape[0]

    def block(V: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(V)
        for a, b in _ranges(n, chunk):
            Ua, Ta = U[a:b], T[a:b]

            def one(v: torch.Tensor) -> torch.Tensor:
                return jvp(lambda th: grad(task.sum_loss)(th, Ua, Ta), (task.theta,), (v,))[1]

            out += vmap(one)(V)
        return out / n

    return block


def dense_hessian(task: AuditTask, U: torch.Tensor, T: torch.Tensor, chunk: int = 512, hvp_batch: int = 32) -> torch.Tensor:
    """The P x P Hessian of the mean training loss, column blocks of Hessian-vector products."""
    P = task.n_params
    hvp = make_hvp(task, U, T, chunk)
    H = torch.empty(P, P, dtype=task.theta.dtype, device=task.theta.device)
    eye = torch.eye(P, dtype=task.theta.dtype, device=task.theta.device)
    for a, b in _ranges(P, hvp_batch):
        H[a:b] = hvp(eye[a:b])
    return 0.5 * (H + H.T)  # symmetric up to round-off; symmetrise so eigh sees one matrix


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
) -> dict:
    """Bytes the estimator holds at its peak (excluding the model's own activations per chunk).

    exact / last-layer: Hessian + eigenvectors 2 P^2; cg: 4 P k vectors; always the
    transformed test gradients P k, one chunk of per-sample gradients chunk x P and the
    output n_train x k (k = n_test if per_test else 1, times the number of dampings).
    """
    P = n_params
    k = (n_test if per_test else 1) * (1 if estimator == "tracin" else n_dampings)
    parts = {
        "hessian_and_eigenvectors": 2 * P * P * itemsize if estimator in ("exact", "last-layer") else 0,
        "hvp_block": hvp_batch * P * itemsize if estimator in ("exact", "last-layer") else 0,
        "cg_vectors": 4 * P * k * itemsize if estimator == "cg" else 0,
        "transformed_test_gradients": P * k * itemsize,
        "gradient_chunk": min(chunk, max(n_train, n_test)) * P * itemsize,
        "influence_output": n_train * k * itemsize,
    }
    parts["total"] = sum(parts.values())
    return parts


def tracin_weights(n_checkpoints: int, every: int, steps_run: int, lr: float) -> list[float]:
    """Weights for checkpoints saved by :func:`attnaudit.training.train` every ``every`` steps.

    Checkpoint j was taken before step j*every and stands for the GD steps
    j*every .. min((j+1)*every, steps_run) - 1, so its weight is lr times their number; a
    final snapshot taken after the last step stands for no step (weight 0).
    """
    return [lr * max(0, min(every, steps_run - j * every)) for j in range(n_checkpoints)]


# --------------------------------------------------------------------------- the interface
def _check_inputs(X_train, y_train, X_test, y_test) -> None:
    if X_train.ndim != 2 or X_test.ndim != 2:
        raise AuditError("influence needs 2-D inputs (n, d) for the training and test sets")
    if y_train is None or y_test is None:
        raise AuditError("influence needs labels for the training and test sets; this data set has none")
    if X_train.shape[0] != y_train.shape[0] or X_test.shape[0] != y_test.shape[0]:
        raise AuditError("inputs and labels have different numbers of rows")
    if X_train.shape[0] == 0 or X_test.shape[0] == 0:
        raise AuditError("influence needs at least one training and one test sample")


def _budget_chunk(config: InfluenceConfig, P: int, fixed_bytes: int) -> int:
    """Largest chunk <= config.chunk_size whose gradient block fits in what the budget leaves."""
    budget = config.memory_budget_mb * 2**20
    left = budget - fixed_bytes
    if left <= 0:
        return 0
    return int(max(1, min(config.chunk_size, left // (2 * 8 * max(P, 1)))))


def influence_sweep(
    model: nn.Module,
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    config: InfluenceConfig,
    *,
    loss: str,
    n_classes: int,
    dampings: Sequence[float] | None = None,
    checkpoints: Sequence[dict[str, torch.Tensor]] | None = None,
    checkpoint_weights: Sequence[float] | None = None,
) -> list[InfluenceResult]:
    """Influence for each damping in ``dampings`` (default: ``[config.damping]``).

    ``exact``/``last-layer`` decompose the Hessian once and reuse it for every damping;
    ``cg`` solves once per damping; ``tracin`` has no damping and returns one result per
    requested damping, all equal, with ``damping=None``. The model is evaluated at its
    current parameters (``tracin``: at ``checkpoints``, dicts of named parameters as saved
    by :func:`attnaudit.training.train`, weighted by ``checkpoint_weights``).
    """
    _check_inputs(X_train, y_train, X_test, y_test)
    dampings = [config.damping] if dampings is None else [float(d) for d in dampings]
    for d in dampings:
        if not (math.isfinite(d) and d >= 0):
            raise AuditError(f"damping must be a finite number >= 0, got {d}")
    if config.estimator == "tracin":
        res = _tracin(model, X_train, y_train, X_test, y_test, config, loss, n_classes, checkpoints, checkpoint_weights)
        return [res for _ in dampings]
    t0 = time.perf_counter()
    task = make_task(model, loss, n_classes, config.tracked)
    P = task.n_params
    n_train, n_test = X_train.shape[0], X_test.shape[0]
    exact_like = config.estimator in ("exact", "last-layer")
    if exact_like and P > config.max_exact_params:
        hint = "use --estimator last-layer or cg" if config.estimator == "exact" else "use --estimator cg or a smaller --width"
        raise AuditError(
            f"{config.estimator} influence needs the full {P:,} x {P:,} Hessian ({2 * P * P * 8 / 2**30:.2f} GiB with its "
            f"eigenvectors), above the budget of {config.max_exact_params:,} parameters; {hint}"
        )
    mem = influence_memory(config.estimator, P, n_train, n_test, config.per_test, config.chunk_size, config.hvp_batch, len(dampings))
    fixed = mem["total"] - mem["gradient_chunk"]
    chunk = _budget_chunk(config, P, fixed)
    if chunk == 0:
        raise AuditError(
            f"{config.estimator} influence needs {fixed / 2**20:,.0f} MB before any chunk, above the memory budget of "
            f"{config.memory_budget_mb:,.0f} MB; drop per-test influence, use fewer test points, or raise the budget"
        )
    mem = influence_memory(config.estimator, P, n_train, n_test, config.per_test, chunk, config.hvp_batch, len(dampings))

    U_tr, T_tr = task.prepare(X_train), task.targets(y_train)
    U_te, T_te = task.prepare(X_test), task.targets(y_test)
    if config.per_test:
        B = torch.cat([per_sample_grads(task, U_te[a:b], T_te[a:b]) for a, b in _ranges(n_test, chunk)])  # (n_test, P)
    else:
        B = summed_grad(task, U_te, T_te, chunk)[None]  # (1, P)
    k = B.shape[0]

    diags: list[dict] = []
    warns: list[list[str]] = []
    solved: list[torch.Tensor] = []  # each (k, P)
    t_solve = time.perf_counter()
    if exact_like:
        H = dense_hessian(task, U_tr, T_tr, chunk, config.hvp_batch)
        evals, evecs = torch.linalg.eigh(H)
        del H
        lam_min, lam_max = float(evals[0]), float(evals[-1])
        coeff = B @ evecs  # (k, P) in the eigenbasis
        scale = max(abs(lam_min), abs(lam_max), 1e-300)
        for d in dampings:
            shifted = evals + d
            w: list[str] = []
            smallest_abs = float(shifted.abs().min())
            if smallest_abs <= 1e-12 * scale:
                raise AuditError(
                    f"the damped Hessian is singular (smallest |eigenvalue + damping| = {smallest_abs:.3g}, "
                    f"lambda_max = {lam_max:.3g}); pass a damping > 0, e.g. --damping {max(1e-3 * lam_max, 1e-8):.1g}"
                )
            # eigenvalues within round-off of 0 (P eps lambda_max, numpy's rank rule) are not counted negative
            n_neg = int((evals < -evals.numel() * torch.finfo(evals.dtype).eps * scale).sum())
            pd = bool(shifted[0] > 0)
            if not pd:
                w.append(
                    f"damped Hessian is not positive definite (lambda_min(H) = {lam_min:.3g}, damping = {d:g}): influence "
                    f"solves an indefinite system; raise --damping above {abs(lam_min):.3g}"
                )
            solved.append((coeff / shifted) @ evecs.T)
            diags.append(
                {
                    "min_eigenvalue": lam_min,
                    "max_eigenvalue": lam_max,
                    "damped_min_eigenvalue": float(shifted[0]),
                    "n_negative_eigenvalues": n_neg,
                    "positive_definite": pd,
                    "damped_condition_number": float(shifted.abs().max() / shifted.abs().min()),
                }
            )
            warns.append(w)
        del evecs
    else:  # cg
        hvp = make_hvp(task, U_tr, T_tr, chunk)
        for d in dampings:
            X, cgd = batched_cg(lambda V, d=d: hvp(V) + d * V, B, config.cg_tol, config.cg_max_iter)
            w = []
            if cgd["negative_curvature"]:
                w.append(f"CG met non-positive curvature at damping {d:g}: the damped Hessian is not positive definite; raise --damping")
            elif not cgd["converged"]:
                w.append(
                    f"CG did not converge in {cgd['iterations']} iterations at damping {d:g} "
                    f"(relative residual {cgd['relative_residual_max']:.2g}); raise --cg-max-iter or --damping"
                )
            solved.append(X)
            diags.append(cgd)
            warns.append(w)
    solve_s = time.perf_counter() - t_solve

    S = torch.cat(solved).T.contiguous()  # (P, k * n_dampings)
    out = torch.empty(n_train, S.shape[1], dtype=S.dtype, device=S.device)
    for a, b in _ranges(n_train, chunk):
        out[a:b] = -(per_sample_grads(task, U_tr[a:b], T_tr[a:b]) @ S)
    elapsed = time.perf_counter() - t0

    results = []
    for j, d in enumerate(dampings):
        block = out[:, j * k : (j + 1) * k]
        diag = {
            "memory_estimate_bytes": mem,
            "chunk_size": chunk,
            "task": task.description,
            "solve_seconds": solve_s,
            "seconds": elapsed,
            **diags[j],
        }
        results.append(
            InfluenceResult(
                estimator=config.estimator,
                damping=d,
                total=block.sum(1),
                per_test=block.clone() if config.per_test else None,
                n_params=P,
                tracked=task.names,
                diagnostics=diag,
                warnings=warns[j],
            )
        )
    return results


def _tracin(model, X_train, y_train, X_test, y_test, config, loss, n_classes, checkpoints, weights) -> InfluenceResult:
    import copy

    if not checkpoints:
        raise AuditError("tracin needs checkpoints saved during training (TrainConfig.checkpoint_every); none were given")
    if weights is None:
        raise AuditError("tracin needs one weight per checkpoint (learning rate x steps it stands for); see tracin_weights")
    if len(weights) != len(checkpoints):
        raise AuditError(f"tracin got {len(checkpoints)} checkpoints but {len(weights)} weights")
    t0 = time.perf_counter()
    work = copy.deepcopy(model)
    n_train, n_test = X_train.shape[0], X_test.shape[0]
    out = None
    P = 0
    mem = None
    chunk = config.chunk_size
    names: list[str] = []
    used = 0
    for ckpt, w in zip(checkpoints, weights):
        if w == 0:
            continue
        with torch.no_grad():
            for name, p in work.named_parameters():
                if name in ckpt:
                    p.copy_(ckpt[name].to(p.device, p.dtype))
        task = make_task(work, loss, n_classes, config.tracked)
        if mem is None:
            P, names = task.n_params, task.names
            mem = influence_memory("tracin", P, n_train, n_test, config.per_test, config.chunk_size, n_dampings=1)
            chunk = _budget_chunk(config, P, mem["total"] - mem["gradient_chunk"])
            if chunk == 0:
                raise AuditError("tracin needs more memory than the budget before any chunk; drop per-test influence")
            mem = influence_memory("tracin", P, n_train, n_test, config.per_test, chunk, n_dampings=1)
        U_tr, T_tr = task.prepare(X_train), task.targets(y_train)
        U_te, T_te = task.prepare(X_test), task.targets(y_test)
        if config.per_test:
            S = torch.cat([per_sample_grads(task, U_te[a:b], T_te[a:b]) for a, b in _ranges(n_test, chunk)]).T
        else:
            S = summed_grad(task, U_te, T_te, chunk)[:, None]
        if out is None:
            out = torch.zeros(n_train, S.shape[1], dtype=S.dtype, device=S.device)
        for a, b in _ranges(n_train, chunk):
            out[a:b] -= w * (per_sample_grads(task, U_tr[a:b], T_tr[a:b]) @ S)
        used += 1
    if out is None:
        raise AuditError("every tracin checkpoint has weight 0 (no training steps); train for at least one step")
    diag = {
        "memory_estimate_bytes": mem,
        "chunk_size": chunk,
        "checkpoints_used": used,
        "checkpoint_weights": [float(w) for w in weights],
        "seconds": time.perf_counter() - t0,
    }
    return InfluenceResult(
        estimator="tracin",
        damping=None,
        total=out.sum(1),
        per_test=out if config.per_test else None,
        n_params=P,
        tracked=names,
        diagnostics=diag,
        warnings=[],
    )


def compute_influence(
    model: nn.Module,
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    config: InfluenceConfig = InfluenceConfig(),
    *,
    loss: str = "mse",
    n_classes: int | None = None,
    checkpoints: Sequence[dict[str, torch.Tensor]] | None = None,
    checkpoint_weights: Sequence[float] | None = None,
) -> InfluenceResult:
    """Influence of every training sample on the test loss (see the module docstring).

    ``n_classes`` defaults to the model's output width (inferred from one forward pass).
    """
    if n_classes is None:
        with torch.no_grad():
            n_classes = int(model(X_test[:1]).shape[1])
    return influence_sweep(
        model,
        X_train,
        y_train,
        X_test,
        y_test,
        config,
        loss=loss,
        n_classes=n_classes,
        checkpoints=checkpoints,
        checkpoint_weights=checkpoint_weights,
    )[0]
