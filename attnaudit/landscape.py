"""Loss landscape: filter-normalized directions, 1-D/2-D surfaces, Hessian spectra.

Everything here works on the *training loss* L(theta) of a model over (X, y), with the
normalisations of :mod:`attnaudit.training` (MSE: 1/(2n) sum ||f - onehot||^2; CE: mean
cross entropy), and on any ``nn.Module`` whose named parameters we perturb through
``torch.func.functional_call``.

* **Directions** (Li et al. 2018). A random Gaussian direction d is *filter-normalized*:
  for every parameter with two or more axes, each first-axis slice ("filter") d[i] is
  rescaled to the norm of the matching slice theta[i] of the weights. For the reference
  two-layer nets, W (m, d) has one row per hidden neuron (its input filter) and a (m, c)
  has one row per neuron (its output weights a[j, :]), so both are normalized neuron by
  neuron. One-axis parameters (biases, norm scales) are zeroed by default; with
  ``keep_1d=True`` the whole vector is treated as a single filter. Because every filter of
  d has the norm of the matching filter of theta, ||d|| = ||theta|| over the perturbed
  parameters and the step alpha is a *relative* distance: alpha = 1 moves each filter by
  its own size. Hessian directions are the top eigenvectors, scaled to ||theta|| so the
  same reading holds.
* **Surfaces**: L(theta + a d1) on a line and L(theta + a d1 + b d2) on a grid, many points
  per call (``torch.func.vmap`` over ``functional_call``), chunked over points and samples.
  Two-layer reference nets use an exact structured path: the first-layer preactivation is
  linear in the grid coordinates, so X W^T is formed once per direction instead of once per
  point.
* **Sharpness**: top-k Hessian eigenvalues by Lanczos with full re-orthogonalisation on
  Hessian-vector products (forward-over-reverse ``torch.func``), with Ritz residual bounds
  and true residuals; the Hessian trace by Hutchinson's estimator (Rademacher probes,
  optionally deflated by the Lanczos eigenvectors, which keeps it unbiased and lowers its
  variance) with its standard error; and a basin width: the mean distance alpha along
  filter-normalized random half-lines at which the loss first reaches ``factor`` times its
  value at the minimum.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap

from .errors import AuditError
from .training import LOSSES, per_sample_loss

Params = dict[str, torch.Tensor]
Progress = Callable[[int], None] | None

DIRECTION_KINDS = ("random", "hessian")
BACKENDS = ("auto", "structured", "vmap", "loop")
#: Models whose training losses differ by more than this factor are not comparable for sharpness.
LOSS_MISMATCH_RATIO = 2.0

# Seed offsets: every random object gets its own seed derived from the one base seed, so a
# figure can be redrawn from the JSON alone (the derived seeds are reported too).
_SEED_DIR2 = 1
_SEED_BASIN = 100
_SEED_LANCZOS = 10_000
_SEED_HUTCH = 20_000


# --------------------------------------------------------------------------- parameters


def select_params(model: nn.Module, patterns: Sequence[str] | None = None) -> Params:
    """The trainable named parameters to perturb (detached, in registration order).

    ``patterns`` are fnmatch globs on parameter names (``"W"``, ``"layers.0.*"``); None means
    every parameter with ``requires_grad``.
    """
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    if patterns is None:
        chosen = named
    else:
        chosen = [(k, p) for k, p in named if any(fnmatch.fnmatchcase(k, pat) for pat in patterns)]
    if not chosen:
        have = ", ".join(k for k, _ in named) or "none"
        raise AuditError(f"--params: no trainable parameters match {list(patterns or [])}; the model has: {have}")
    return {k: p.detach() for k, p in chosen}


class _Flat:
    """Flatten a parameter dict to one vector and back (views, no copies on the way back)."""

    def __init__(self, params: Params):
        self.names = list(params)
        self.shapes = [params[k].shape for k in self.names]
        self.numels = [params[k].numel() for k in self.names]
        self.size = sum(self.numels)

    def flatten(self, tensors: Params) -> torch.Tensor:
        return torch.cat([tensors[k].reshape(-1) for k in self.names])

    def unflatten(self, vec: torch.Tensor) -> Params:
        parts = torch.split(vec, self.numels)
        return {k: part.view(shape) for k, part, shape in zip(self.names, parts, self.shapes)}


def params_norm(params: Params) -> float:
    """Euclidean norm of all parameters together."""
    return math.sqrt(sum(float(p.double().pow(2).sum()) for p in params.values()))


# --------------------------------------------------------------------------- directions


def filter_normalize(direction: Params, params: Params, keep_1d: bool = False) -> Params:
    """Rescale each first-axis slice of ``direction`` to the norm of the same slice of ``params``.

    Parameters with <= 1 axis are zeroed, or (``keep_1d``) rescaled as one filter. A zero
    filter of the weights gives a zero filter of the direction.
    """
    out: Params = {}
    for name, p in params.items():
        d = direction[name]
        if d.shape != p.shape:
            raise AuditError(f"direction for {name!r} has shape {tuple(d.shape)}, parameter has {tuple(p.shape)}")
        if p.dim() <= 1:
            if keep_1d:
                dn = d.norm()
                out[name] = d * (p.norm() / dn) if dn > 0 else torch.zeros_like(d)
            else:
                out[name] = torch.zeros_like(d)
            continue
        axes = tuple(range(1, p.dim()))
        pn = torch.linalg.vector_norm(p, dim=axes, keepdim=True)
        dn = torch.linalg.vector_norm(d, dim=axes, keepdim=True)
        # where the random row happens to be exactly zero there is no direction to rescale
        out[name] = torch.where(dn > 0, d * pn / dn.clamp_min(torch.finfo(d.dtype).tiny), torch.zeros_like(d))
    return out


def random_direction(params: Params, seed: int, keep_1d: bool = False) -> Params:
    """A filter-normalized Gaussian direction drawn from a CPU generator seeded with ``seed``.

    The draw is in float64 on the CPU whatever the device, so a seed gives the same
    direction on CPU and CUDA; every parameter is drawn (also the zeroed 1-D ones) so the
    stream does not depend on ``keep_1d``.
    """
    gen = torch.Generator().manual_seed(int(seed))
    raw = {
        k: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
        for k, p in params.items()
    }
    return filter_normalize(raw, params, keep_1d)


def eigenvector_direction(vector: torch.Tensor, params: Params) -> Params:
    """A flat Hessian eigenvector as a direction, scaled to ||theta|| (alpha = relative distance)."""
    flat = _Flat(params)
    v = vector.to(device=next(iter(params.values())).device, dtype=next(iter(params.values())).dtype)
    v = v / v.norm() * params_norm(params)
    return {k: t.clone() for k, t in flat.unflatten(v).items()}


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class PointEval:
    """Training loss and accuracy at a batch of points theta + sum_j c_j d_j."""

    loss: torch.Tensor  # (B,) float64, CPU
    accuracy: torch.Tensor  # (B,) float64, CPU
    backend: str
    points_per_batch: int
    samples_per_batch: int


def _structured_ok(model: nn.Module, names: Sequence[str]) -> bool:
    """True for an unmodified TwoLayerNet perturbed only in W and/or a."""
    from .models import TwoLayerNet

    if not isinstance(model, TwoLayerNet):
        return False
    cls = type(model)
    same = all(getattr(cls, f) is getattr(TwoLayerNet, f) for f in ("forward", "hidden", "features_in"))
    return same and set(names) <= {"W", "a"}


def _out_dim(model: nn.Module, X: torch.Tensor) -> int:
    with torch.no_grad():
        out = model(X[:1])
    return int(out.reshape(1, -1).shape[1])


# Activation elements per call on CPU: blocks much larger than this fall out of cache and
# run slower per point (measured on digits and MNIST two-layer nets: 2-4x at 8M elements).
_CPU_BLOCK = 2**21


def _plan(
    model: nn.Module,
    params: Params,
    n_samples: int,
    n_points: int,
    n_dirs: int,
    backend: str,
    out_dim: int,
    memory_mb: float,
    points_per_batch: int | None,
    samples_per_batch: int | None,
) -> tuple[int, int]:
    """(points, samples) per call: cache-sized blocks on CPU, never above ``memory_mb``.

    The activation size per sample and point is estimated from the parameters: a layer
    with a (k, ...) weight produces about k activations per sample (a few temporaries each).
    The structured path also keeps D + 1 preactivation tables per sample chunk.
    """
    p0 = next(iter(params.values()))
    budget = max(memory_mb, 1.0) * 2**20 / p0.element_size()
    block = _CPU_BLOCK if p0.device.type == "cpu" else budget
    n_par = sum(p.numel() for p in params.values())
    if backend == "structured":
        act = model.W.shape[0] + out_dim
        tables = (n_dirs + 1) * model.W.shape[0]
        per_point_fixed = model.a.numel()
    else:
        act = sum(p.shape[0] for p in params.values() if p.dim() >= 2) + out_dim
        tables = 0
        per_point_fixed = 2 * n_par
    act = max(act, 1)
    if samples_per_batch is not None:
        s = max(1, min(samples_per_batch, n_samples))
    else:
        s = min(n_samples, max(128, int(block // act)))
        while s > 1 and s * (3 * act + tables) + per_point_fixed > budget:
            s //= 2
    if points_per_batch is not None:
        b = points_per_batch
    else:
        b_cache = block // (s * act)
        b_mem = (budget - s * tables) // (per_point_fixed + 3 * s * act)
        b = int(min(b_cache, b_mem))
    return max(1, min(b, n_points)), s


def _stack_dirs(directions: Sequence[Params], names: Sequence[str], base: Params) -> Params:
    return {k: torch.stack([d[k].to(base[k]) for d in directions]) for k in names}


def evaluate_points(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    loss: str,
    directions: Sequence[Params],
    coeffs: torch.Tensor,
    *,
    names: Sequence[str] | None = None,
    backend: str = "auto",
    memory_mb: float = 512.0,
    points_per_batch: int | None = None,
    samples_per_batch: int | None = None,
    progress: Progress = None,
) -> PointEval:
    """Loss and accuracy at theta + sum_j coeffs[b, j] * directions[j] for every row b.

    ``directions`` are dicts over the perturbed parameter names (``names``; default: the
    directions' keys). Parameters not named keep the model's values. Work is done in chunks
    of points and samples (``_plan``) and summed, so the result equals one full-batch
    evaluation per point. ``backend``: ``structured`` (TwoLayerNet only, exact), ``vmap``
    (generic), ``loop`` (generic, one point per call), ``auto`` (structured when possible,
    else vmap, falling back to loop if the model cannot be vmapped).
    """
    if loss not in LOSSES:
        raise AuditError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)}")
    if backend not in BACKENDS:
        raise AuditError(f"unknown evaluation backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if not directions:
        raise AuditError("no directions given")
    names = list(names if names is not None else directions[0].keys())
    named = dict(model.named_parameters())
    base = {k: named[k].detach() for k in names}
    device, dtype = base[names[0]].device, base[names[0]].dtype
    coeffs = torch.as_tensor(coeffs).to(device=device, dtype=dtype)
    if coeffs.dim() != 2 or coeffs.shape[1] != len(directions):
        raise AuditError(f"coefficients must have shape (points, {len(directions)}), got {tuple(coeffs.shape)}")
    X = X.to(device)
    y = y.to(device).long()
    n, n_points, n_dirs = X.shape[0], coeffs.shape[0], len(directions)
    if backend == "auto":
        backend = "structured" if _structured_ok(model, names) else "vmap"
    elif backend == "structured" and not _structured_ok(model, names):
        raise AuditError("the structured backend needs an unmodified TwoLayerNet perturbed in W and a only; use vmap")
    stack = _stack_dirs(directions, names, base)
    b, s = _plan(model, base, n, n_points, n_dirs, backend, _out_dim(model, X), memory_mb, points_per_batch, samples_per_batch)
    loss_sum = torch.zeros(n_points, dtype=torch.float64, device=device)
    correct = torch.zeros(n_points, dtype=torch.float64, device=device)

    with torch.no_grad():
        for start in range(0, n, s):
            Xc, yc = X[start : start + s], y[start : start + s]
            if backend == "structured":
                chunk_fn = _structured_chunk(model, base, stack, Xc, yc, loss)
            else:
                chunk_fn = _generic_chunk(model, base, stack, Xc, yc, loss)
            for p0 in range(0, n_points, b):
                cb = coeffs[p0 : p0 + b]
                if backend == "loop":
                    rows = [chunk_fn(c, batched=False) for c in cb]
                    ls = torch.stack([r[0] for r in rows])
                    cs = torch.stack([r[1] for r in rows])
                else:
                    try:
                        ls, cs = chunk_fn(cb, batched=True)
                    except (RuntimeError, NotImplementedError):
                        if backend != "vmap" or start or p0:
                            raise
                        # this model cannot be vmapped (data-dependent control flow, ...):
                        # evaluate point by point, still without state-dict reloads
                        backend = "loop"
                        rows = [chunk_fn(c, batched=False) for c in cb]
                        ls = torch.stack([r[0] for r in rows])
                        cs = torch.stack([r[1] for r in rows])
                loss_sum[p0 : p0 + b] += ls.to(torch.float64)
                correct[p0 : p0 + b] += cs.to(torch.float64)
                if progress is not None and start + s >= n:
                    progress(len(cb))
    return PointEval(
        loss=(loss_sum / n).cpu(),
        accuracy=(correct / n).cpu(),
        backend=backend,
        points_per_batch=b,
        samples_per_batch=s,
    )


def _generic_chunk(model, base: Params, stack: Params, Xc, yc, loss: str):
    def one(c: torch.Tensor):
        theta = {k: base[k] + torch.tensordot(c, stack[k], dims=1) for k in base}
        out = functional_call(model, theta, (Xc,))
        return per_sample_loss(out, yc, loss).sum(), (out.argmax(-1) == yc).sum()

    batched_one = vmap(one)

    def run(c: torch.Tensor, batched: bool):
        return batched_one(c) if batched else one(c)

    return run


def _structured_chunk(model, base: Params, stack: Params, Xc, yc, loss: str):
    """TwoLayerNet: preact(c) = s_in F (W + sum_j c_j DW_j)^T = Z0 + sum_j c_j Z_j, exact.

    F W^T is formed once per direction (D + 1 products of size n x d x m) instead of once
    per point; each point then costs O(n m c). Preactivations are kept transposed (m, n),
    so a batch of points is one addmm (a single pass over memory) with the ReLU in place,
    and the output layer is a (c x m) @ (m x n) product per point, the faster layout for
    small c (measured).
    """
    s_in, s_out = model.preactivation_scale()
    F = model.features_in(Xc)
    W0 = base["W"] if "W" in base else model.W.detach()
    a0 = base["a"] if "a" in base else model.a.detach()
    n, m, c = F.shape[0], W0.shape[0], a0.shape[1]
    Z0 = (W0 @ F.T * s_in).reshape(1, m * n)
    # [Z0; Z_1..Z_D] with coefficients [1, c]: one mm per batch, no broadcast copy of Z0
    ZD = torch.cat([Z0, torch.einsum("nd,jmd->jmn", F, stack["W"]).reshape(-1, m * n) * s_in]) if "W" in stack else None
    DA = stack["a"].transpose(1, 2).reshape(-1, c * m) if "a" in stack else None
    aT = a0.T.contiguous()
    aT_flat = aT.reshape(1, c * m)
    batch_loss = vmap(lambda o: per_sample_loss(o, yc, loss))

    def run(coef: torch.Tensor, batched: bool):
        cb = coef if batched else coef[None]
        B = cb.shape[0]
        if ZD is not None:
            ones = torch.ones(B, 1, dtype=cb.dtype, device=cb.device)
            HT = torch.mm(torch.cat([ones, cb], 1), ZD).clamp_min_(0).view(B, m, n)
        else:
            HT = Z0.clamp_min(0).view(1, m, n).expand(B, m, n)
        if DA is not None:
            outT = torch.bmm(torch.addmm(aT_flat, cb, DA).view(B, c, m), HT)
        else:
            outT = torch.matmul(aT, HT)
        out = (outT * s_out).transpose(1, 2).contiguous()  # (B, n, c); small, and argmax wants it contiguous
        ls = batch_loss(out).sum(-1)
        cs = (out.argmax(-1) == yc).sum(-1)
        return (ls, cs) if batched else (ls[0], cs[0])

    return run


def loss_and_accuracy(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss: str, samples_per_batch: int = 8192
) -> tuple[float, float]:
    """Training loss and accuracy at the current parameters (plain forward, data in chunks)."""
    device = next(model.parameters()).device
    total, correct, n = 0.0, 0.0, X.shape[0]
    with torch.no_grad():
        for start in range(0, n, samples_per_batch):
            Xc, yc = X[start : start + samples_per_batch].to(device), y[start : start + samples_per_batch].to(device)
            out = model(Xc)
            total += float(per_sample_loss(out, yc, loss).double().sum())
            correct += float((out.argmax(1) == yc).double().sum())
    return total / n, correct / n


# --------------------------------------------------------------------------- surfaces


def symmetric_grid(points: int, span: float) -> torch.Tensor:
    """``points`` evenly spaced values on [-span, span], exactly antisymmetric (0 exact for odd counts)."""
    half = (points - 1) / 2
    return span * (torch.arange(points, dtype=torch.float64) - half) / half


@dataclass(frozen=True)
class Surface1D:
    """Loss and accuracy at theta + alpha d for alpha on a uniform grid over [-span, span]."""

    alphas: tuple[float, ...]
    loss: tuple[float, ...]
    accuracy: tuple[float, ...]

    def to_dict(self) -> dict:
        return {"alphas": list(self.alphas), "loss": list(self.loss), "accuracy": list(self.accuracy)}


@dataclass(frozen=True)
class Surface2D:
    """loss[i][j] = L(theta + alphas[i] d1 + betas[j] d2) (rows: first direction)."""

    alphas: tuple[float, ...]
    betas: tuple[float, ...]
    loss: tuple[tuple[float, ...], ...]
    accuracy: tuple[tuple[float, ...], ...]

    def to_dict(self) -> dict:
        return {
            "alphas": list(self.alphas),
            "betas": list(self.betas),
            "loss": [list(r) for r in self.loss],
            "accuracy": [list(r) for r in self.accuracy],
        }


def loss_surface_1d(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss: str, direction: Params,
    points: int = 51, span: float = 1.0, **eval_kw,
) -> Surface1D:
    """L(theta + alpha d) for ``points`` values of alpha evenly spaced on [-span, span]."""
    if points < 2:
        raise AuditError(f"a 1-D surface needs at least 2 points, got {points}")
    alphas = symmetric_grid(points, span)
    ev = evaluate_points(model, X, y, loss, [direction], alphas[:, None], **eval_kw)
    return Surface1D(tuple(alphas.tolist()), tuple(ev.loss.tolist()), tuple(ev.accuracy.tolist()))


def loss_surface_2d(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss: str, dir1: Params, dir2: Params,
    grid: int = 31, span: float = 1.0, **eval_kw,
) -> Surface2D:
    """L(theta + a d1 + b d2) on a ``grid`` x ``grid`` mesh over [-span, span]^2."""
    if grid < 2:
        raise AuditError(f"a 2-D surface needs a grid of at least 2, got {grid}")
    ax = symmetric_grid(grid, span)
    A, B = torch.meshgrid(ax, ax, indexing="ij")
    coeffs = torch.stack([A.reshape(-1), B.reshape(-1)], 1)
    ev = evaluate_points(model, X, y, loss, [dir1, dir2], coeffs, **eval_kw)
    L = ev.loss.reshape(grid, grid)
    acc = ev.accuracy.reshape(grid, grid)
    return Surface2D(
        tuple(ax.tolist()), tuple(ax.tolist()),
        tuple(tuple(r) for r in L.tolist()), tuple(tuple(r) for r in acc.tolist()),
    )


# --------------------------------------------------------------------------- Hessian


class HessianOperator:
    """v -> H v, H the Hessian of the training loss w.r.t. the selected parameters (flat vectors).

    Forward-over-reverse (``jvp`` of ``grad``), summed over sample chunks with weights n_c/n
    so the memory stays bounded; falls back to reverse-over-reverse for modules without
    forward-mode support. ``calls`` counts products.
    """

    def __init__(
        self, model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss: str,
        names: Sequence[str] | None = None, samples_per_batch: int = 4096,
    ):
        if loss not in LOSSES:
            raise AuditError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)}")
        self.model = model
        self.params = select_params(model, names)
        self.flat = _Flat(self.params)
        self.theta = self.flat.flatten(self.params).detach()
        self.device, self.dtype = self.theta.device, self.theta.dtype
        self.X = X.to(self.device)
        self.y = y.to(self.device).long()
        self.loss = loss
        self.samples_per_batch = max(1, int(samples_per_batch))
        self.size = self.flat.size
        self.calls = 0
        self.mode = "forward-over-reverse"

    def _chunk_loss(self, Xc, yc):
        n = self.X.shape[0]

        def f(t: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.model, self.flat.unflatten(t), (Xc,))
            return per_sample_loss(out, yc, self.loss).sum() / n

        return f

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        v = v.to(device=self.device, dtype=self.dtype)
        out = torch.zeros_like(self.theta)
        for start in range(0, self.X.shape[0], self.samples_per_batch):
            f = self._chunk_loss(self.X[start : start + self.samples_per_batch], self.y[start : start + self.samples_per_batch])
            if self.mode == "forward-over-reverse":
                try:
                    out += jvp(grad(f), (self.theta,), (v,))[1]
                    continue
                except (RuntimeError, NotImplementedError):
                    if start:
                        raise
                    self.mode = "reverse-over-reverse"
            _, pullback = vjp(grad(f), self.theta)
            out += pullback(v)[0]
        self.calls += 1
        return out.detach()

    __call__ = matvec


@dataclass(frozen=True)
class EigenResult:
    """Top Hessian eigenvalues (descending) with Lanczos diagnostics.

    ``ritz_bounds``: |beta_m s_mi|, Lanczos' own residual bound; ``residuals``: the true
    ||H u - lambda u|| recomputed with one more product per vector. Both are relative to
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

    def to_dict(self) -> dict:
        return {
            "eigenvalues": list(self.eigenvalues),
            "residuals": list(self.residuals),
            "ritz_bounds": list(self.ritz_bounds),
            "steps": self.steps,
            "hvp_calls": self.hvp_calls,
            "converged": self.converged,
            "tol": self.tol,
            "seed": self.seed,
        }


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
) -> EigenResult:
    """The k largest (algebraic) eigenvalues of the symmetric operator ``matvec``.

    Lanczos with full re-orthogonalisation (the basis is kept: memory max_steps x size).
    Stops when every wanted Ritz pair has |beta_m s_mi| <= tol * max|theta|, or after
    ``max_steps``. If the Krylov space becomes invariant before k values are found, it is
    restarted with a fresh random vector orthogonal to the basis (a zero off-diagonal).
    Like any single-vector Krylov method it finds one copy of a repeated eigenvalue per
    invariant subspace reached.
    """
    if k < 1:
        raise AuditError(f"top-k must be >= 1, got {k}")
    if size < 1:
        raise AuditError("the operator has no dimensions")
    k = min(k, size)
    m_max = max(min(size, max_steps), k)
    gen = torch.Generator().manual_seed(int(seed))

    def fresh(Qj: torch.Tensor) -> torch.Tensor:
        q = torch.randn(size, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        for _ in range(2):
            if Qj.shape[0]:
                q = q - Qj.T @ (Qj @ q)
        return q / q.norm()

    Q = torch.zeros(m_max, size, device=device, dtype=dtype)
    alphas: list[float] = []
    betas: list[float] = []  # betas[j] couples q_j and q_{j+1}
    q = fresh(Q[:0])
    converged = False
    evals = evecs = None
    steps = 0
    bounds = torch.zeros(0)
    for j in range(m_max):
        Q[j] = q
        w = matvec(q)
        steps += 1
        if progress is not None:
            progress(1)
        a = float(q @ w)
        alphas.append(a)
        # full re-orthogonalisation (twice is enough) replaces the three-term recurrence's
        # explicit subtraction and keeps the basis orthogonal in floating point
        Qj = Q[: j + 1]
        for _ in range(2):
            w = w - Qj.T @ (Qj @ w)
        b = float(w.norm())
        T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if j:
            off = torch.tensor(betas, dtype=torch.float64)
            T = T + torch.diag(off, 1) + torch.diag(off, -1)
        evals, evecs = torch.linalg.eigh(T)
        kk = min(k, j + 1)
        scale = max(float(evals.abs().max()), torch.finfo(dtype).tiny)
        bounds = b * evecs[-1, -kk:].abs()
        invariant = b <= 1e3 * torch.finfo(dtype).eps * scale
        if j + 1 >= k and (bool((bounds <= tol * scale).all()) or invariant):
            converged = True
            break
        if j + 1 == m_max:
            break
        if invariant:
            betas.append(0.0)
            q = fresh(Qj)
            bounds = torch.zeros_like(bounds)
        else:
            betas.append(b)
            q = w / b
    if progress is not None and steps < m_max:
        progress(m_max - steps)
    m = len(alphas)
    kk = min(k, m)
    order = torch.arange(m - 1, m - 1 - kk, -1)
    vals = evals[order]
    S = evecs[:, order].to(device=device, dtype=dtype)
    U = Q[:m].T @ S  # (size, kk) Ritz vectors
    U = U / U.norm(dim=0, keepdim=True)
    HU = torch.stack([matvec(U[:, i]) for i in range(kk)], 1)
    scale = max(float(evals.abs().max()), torch.finfo(dtype).tiny)
    res = (HU - U * vals.to(device=device, dtype=dtype)).norm(dim=0) / scale
    # fix each eigenvector's arbitrary sign: largest-magnitude entry positive
    sign = torch.sign(U.gather(0, U.abs().argmax(0, keepdim=True))).squeeze(0)
    sign[sign == 0] = 1
    U, HU = U * sign, HU * sign
    return EigenResult(
        eigenvalues=tuple(vals.tolist()),
        residuals=tuple(res.cpu().tolist()),
        ritz_bounds=tuple((bounds.flip(0)[:kk] / scale).tolist()),
        steps=steps,
        hvp_calls=steps + kk,
        converged=converged,
        tol=tol,
        seed=int(seed),
        eigenvectors=U,
        h_eigenvectors=HU,
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
            HU = torch.stack([matvec(U[:, i]) for i in range(U.shape[1])], 1)
        exact = float((U * HU).sum())
    vals = []
    for _ in range(samples):
        v = (torch.randint(0, 2, (size,), generator=gen, dtype=torch.int64) * 2 - 1).to(device=device, dtype=dtype)
        if U is not None:
            v = v - U @ (U.T @ v)
        vals.append(float(v @ matvec(v)))
        if progress is not None:
            progress(1)
    t = torch.tensor(vals, dtype=torch.float64)
    return TraceResult(
        estimate=exact + float(t.mean()),
        stderr=float(t.std(unbiased=True)) / math.sqrt(samples),
        samples=samples,
        seed=int(seed),
        deflated=0 if U is None else U.shape[1],
        exact_part=exact,
    )


# --------------------------------------------------------------------------- basin width


@dataclass(frozen=True)
class BasinResult:
    """Distance alpha along filter-normalized half-lines at which L first reaches ``threshold``.

    ``radii`` lists one value per (direction, sign); a half-line that never reaches the
    threshold within ``max_radius`` counts as ``max_radius`` (a lower bound, ``censored``).
    ``width`` is their mean, ``stderr`` its standard error over half-lines.
    """

    width: float
    stderr: float
    radii: tuple[float, ...]
    censored: int
    base_loss: float
    threshold: float
    factor: float
    max_radius: float
    direction_seeds: tuple[int, ...]

    def to_dict(self) -> dict:
        return {
            "width": self.width,
            "stderr": self.stderr,
            "radii": list(self.radii),
            "censored": self.censored,
            "base_loss": self.base_loss,
            "threshold": self.threshold,
            "factor": self.factor,
            "max_radius": self.max_radius,
            "direction_seeds": list(self.direction_seeds),
        }


def basin_width(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    loss: str,
    directions: Sequence[Params],
    *,
    factor: float = 2.0,
    max_radius: float = 1.0,
    points: int = 24,
    refine: int = 2,
    direction_seeds: Sequence[int] = (),
    progress: Progress = None,
    **eval_kw,
) -> BasinResult:
    """Mean first distance at which L(theta +/- alpha d) >= factor * L(theta).

    A geometric grid of ``points`` radii on [1e-4, 1] * max_radius brackets each crossing;
    ``refine`` rounds of 8 evenly spaced points inside every bracket narrow it, and the
    crossing is linearly interpolated in the final bracket. All half-lines are evaluated
    together in one batched call per round.
    """
    if not factor > 1:
        raise AuditError(f"basin factor must be > 1, got {factor}")
    if not max_radius > 0:
        raise AuditError(f"basin max radius must be positive, got {max_radius}")
    D = len(directions)
    H = 2 * D  # half-lines: +d_j, -d_j
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(D)
    which = torch.arange(D).repeat_interleave(2)

    def eval_radii(r: torch.Tensor) -> torch.Tensor:
        """r: (H, G) radii -> (H, G) losses."""
        G = r.shape[1]
        C = torch.zeros(H * G, D, dtype=torch.float64)
        rows = torch.arange(H * G)
        C[rows, which.repeat_interleave(G)] = (signs[:, None] * r).reshape(-1)
        ev = evaluate_points(model, X, y, loss, directions, C, progress=progress, **eval_kw)
        return ev.loss.reshape(H, G)

    zero_coeff = torch.zeros(1, D, dtype=torch.float64)
    base = float(evaluate_points(model, X, y, loss, directions, zero_coeff, **eval_kw).loss[0])
    threshold = factor * base
    grid = max_radius * torch.logspace(-4, 0, points, dtype=torch.float64)
    r = torch.cat([torch.zeros(1, dtype=torch.float64), grid]).expand(H, -1)
    Lr = torch.cat([torch.full((H, 1), base, dtype=torch.float64), eval_radii(r[:, 1:].contiguous())], 1)
    lo, hi, llo, lhi, censored = _brackets(r, Lr, threshold)
    for _ in range(refine):
        live = ~censored
        if not bool(live.any()):
            break
        t = torch.linspace(0, 1, 10, dtype=torch.float64)[1:-1]  # 8 interior points
        inner = lo[:, None] + (hi - lo)[:, None] * t[None, :]
        Li = eval_radii(inner)
        rr = torch.cat([lo[:, None], inner, hi[:, None]], 1)
        LL = torch.cat([llo[:, None], Li, lhi[:, None]], 1)
        nlo, nhi, nllo, nlhi, _ = _brackets(rr, LL, threshold)
        lo = torch.where(live, nlo, lo)
        hi = torch.where(live, nhi, hi)
        llo = torch.where(live, nllo, llo)
        lhi = torch.where(live, nlhi, lhi)
    # linear interpolation of the crossing inside [lo, hi]
    frac = ((threshold - llo) / (lhi - llo).clamp_min(torch.finfo(torch.float64).tiny)).clamp(0, 1)
    radii = torch.where(censored, torch.full_like(lo, max_radius), lo + frac * (hi - lo))
    width = float(radii.mean())
    stderr = float(radii.std(unbiased=True)) / math.sqrt(H) if H > 1 else float("nan")
    return BasinResult(
        width=width,
        stderr=stderr,
        radii=tuple(radii.tolist()),
        censored=int(censored.sum()),
        base_loss=base,
        threshold=threshold,
        factor=factor,
        max_radius=max_radius,
        direction_seeds=tuple(int(s) for s in direction_seeds),
    )


def _brackets(r: torch.Tensor, L: torch.Tensor, threshold: float):
    """For each row, the first grid interval [r_{i-1}, r_i] with L(r_i) >= threshold."""
    above = L >= threshold
    above[:, 0] = False  # the minimum itself is below threshold (factor > 1)
    hit = above.any(1)
    first = torch.where(hit, above.float().argmax(1), torch.full_like(hit, r.shape[1] - 1, dtype=torch.long))
    first = first.clamp_min(1)
    rows = torch.arange(r.shape[0])
    return r[rows, first - 1], r[rows, first], L[rows, first - 1], L[rows, first], ~hit


# --------------------------------------------------------------------------- orchestrator


@dataclass(frozen=True)
class LandscapeConfig:
    """Settings for :func:`analyze_landscape` (validated here, before any compute).

    ``span``: surfaces cover alpha in [-span, span] (relative distance, see module doc);
    ``points`` = 0 skips the 1-D curve, ``grid`` = 0 the 2-D surface; ``top_k`` eigenvalues
    by Lanczos (at most ``lanczos_steps`` products, stop at relative Ritz bound
    ``lanczos_tol``); ``hutchinson_samples`` probes, deflated by the Lanczos vectors when
    ``hutchinson_deflate``; basin: ``basin_directions`` random directions (both signs),
    threshold ``basin_factor`` x L(theta), searched up to ``basin_max``. ``params``: fnmatch
    patterns of the parameters to perturb (None: all trainable). ``seed`` is the base of
    every random draw (directions, Lanczos start, probes).
    """

    loss: str = "mse"
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

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise AuditError(f"unknown --loss {self.loss!r}; use one of {', '.join(LOSSES)}")
        if self.directions not in DIRECTION_KINDS:
            raise AuditError(f"unknown --directions {self.directions!r}; use one of {', '.join(DIRECTION_KINDS)}")
        if self.backend not in BACKENDS:
            raise AuditError(f"unknown evaluation backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        if self.points != 0 and self.points < 3:
            raise AuditError(f"--points must be 0 (skip) or >= 3, got {self.points}")
        if self.grid != 0 and self.grid < 3:
            raise AuditError(f"--grid must be 0 (skip) or >= 3, got {self.grid}")
        if not (self.span > 0 and math.isfinite(self.span)):
            raise AuditError(f"--span must be a positive number, got {self.span}")
        if self.top_k < 1:
            raise AuditError(f"--top-k must be >= 1, got {self.top_k}")
        if self.lanczos_steps < 1:
            raise AuditError(f"Lanczos steps must be >= 1, got {self.lanczos_steps}")
        if not (0 < self.lanczos_tol < 1):
            raise AuditError(f"Lanczos tolerance must be in (0, 1), got {self.lanczos_tol}")
        if self.hutchinson_samples < 2:
            raise AuditError(f"--hutchinson-samples must be >= 2 (a standard error needs two), got {self.hutchinson_samples}")
        if self.basin_directions < 1:
            raise AuditError(f"--basin-directions must be >= 1, got {self.basin_directions}")
        if not (self.basin_factor > 1 and math.isfinite(self.basin_factor)):
            raise AuditError(f"--basin-factor must be > 1, got {self.basin_factor}")
        if not (self.basin_max > 0 and math.isfinite(self.basin_max)):
            raise AuditError(f"basin max radius must be positive, got {self.basin_max}")
        if self.basin_points < 2:
            raise AuditError(f"basin points must be >= 2, got {self.basin_points}")
        if not self.memory_mb > 0:
            raise AuditError(f"memory budget must be positive, got {self.memory_mb} MB")
        for name in ("points_per_batch", "samples_per_batch"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise AuditError(f"{name.replace('_', ' ')} must be >= 1, got {v}")

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
        """Progress units of :func:`analyze_landscape` (products + points; an upper bound, the bar is topped up)."""
        basin = 2 * self.basin_directions * (self.basin_points + 8 * 2)
        return self.lanczos_steps + self.hutchinson_samples + self.points + self.grid**2 + basin


@dataclass(frozen=True)
class LandscapeResult:
    """Sharpness and surfaces of one model at its current parameters."""

    n_samples: int
    n_params: int
    param_names: tuple[str, ...]
    loss: float
    accuracy: float
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

    def to_dict(self) -> dict:
        return {
            "n_samples": self.n_samples,
            "n_params": self.n_params,
            "param_names": list(self.param_names),
            "loss": self.loss,
            "accuracy": self.accuracy,
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
            "timings": self.timings,
        }


def analyze_landscape(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, config: LandscapeConfig, progress: Progress = None
) -> LandscapeResult:
    """Loss, accuracy, Hessian top-k, trace, top share, basin width and surfaces at the current theta.

    The model is not modified. ``progress(n)`` is advanced by products and evaluated points;
    ``config.work_units()`` is the total.
    """
    if y is None:
        raise AuditError("the loss landscape needs labels; use a labelled dataset")
    if X.shape[0] != y.shape[0]:
        raise AuditError(f"{X.shape[0]} samples but {y.shape[0]} labels")
    if X.shape[0] == 0:
        raise AuditError("no training samples; increase --n-train")
    params = select_params(model, config.params)
    device = next(iter(params.values())).device
    done = [0]
    outer = progress

    def progress(k: int) -> None:  # noqa: F811 - count what was reported so the bar ends full
        if outer is not None:
            k = min(k, config.work_units() - done[0])
            if k > 0:
                done[0] += k
                outer(k)

    X, y = X.to(device), y.to(device).long()
    names = list(params)
    seeds = config.seeds()
    eval_kw = dict(
        names=names, backend=config.backend, memory_mb=config.memory_mb,
        points_per_batch=config.points_per_batch, samples_per_batch=config.samples_per_batch,
    )
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    loss0, acc0 = loss_and_accuracy(model, X, y, config.loss, config.samples_per_batch or 8192)
    timings["loss"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    op = HessianOperator(model, X, y, config.loss, names, samples_per_batch=config.samples_per_batch or 4096)
    # the Lanczos basis holds steps x n_params numbers: keep it within 4 x the memory budget
    # (a capped run reports converged=False rather than running out of memory)
    basis_cap = int(4 * config.memory_mb * 2**20 / (op.theta.element_size() * op.size))
    eig = lanczos_top_eigen(
        op, op.size, config.lanczos_k, max_steps=max(min(config.lanczos_steps, basis_cap), config.lanczos_k + 2),
        tol=config.lanczos_tol,
        seed=seeds["lanczos_start"], device=op.device, dtype=op.dtype, progress=progress,
    )
    timings["lanczos"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tr = hutchinson_trace(
        op, op.size, config.hutchinson_samples, seed=seeds["hutchinson"], device=op.device, dtype=op.dtype,
        deflate=eig.eigenvectors[:, : config.top_k] if config.hutchinson_deflate else None,
        deflate_products=eig.h_eigenvectors[:, : config.top_k] if config.hutchinson_deflate else None,
        progress=progress,
    )
    timings["hutchinson"] = time.perf_counter() - t0
    top = torch.tensor(eig.eigenvalues[: config.top_k], dtype=torch.float64)
    cum = torch.cumsum(top, 0)
    share = cum / tr.estimate if tr.estimate != 0 else torch.full_like(cum, float("nan"))
    share_se = share.abs() * (tr.stderr / abs(tr.estimate)) if tr.estimate != 0 else share
    lam1 = eig.eigenvalues[0]
    trace_over_top = tr.estimate / lam1 if lam1 != 0 else float("nan")

    t0 = time.perf_counter()
    if config.directions == "random":
        d1 = random_direction(params, seeds["direction_1"], config.keep_1d_params)
        d2 = random_direction(params, seeds["direction_2"], config.keep_1d_params) if config.grid else None
        dir_info = {
            "kind": "random", "normalization": "filter", "keep_1d_params": config.keep_1d_params,
            "seeds": [seeds["direction_1"], seeds["direction_2"]],
        }
    else:
        d1 = eigenvector_direction(eig.eigenvectors[:, 0], params)
        d2 = eigenvector_direction(eig.eigenvectors[:, 1], params) if config.grid and eig.eigenvectors.shape[1] > 1 else None
        dir_info = {
            "kind": "hessian", "normalization": "global: ||d|| = ||theta||", "eigen_index": [0, 1],
            "lanczos_seed": seeds["lanczos_start"],
        }
    dir_info["theta_norm"] = params_norm(params)
    timings["directions"] = time.perf_counter() - t0

    surf1 = surf2 = None
    t0 = time.perf_counter()
    if config.points:
        surf1 = loss_surface_1d(model, X, y, config.loss, d1, config.points, config.span, progress=progress, **eval_kw)
    timings["surface_1d"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if config.grid and d2 is not None:
        surf2 = loss_surface_2d(model, X, y, config.loss, d1, d2, config.grid, config.span, progress=progress, **eval_kw)
    timings["surface_2d"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    bdirs = [random_direction(params, s, config.keep_1d_params) for s in seeds["basin_directions"]]
    basin = basin_width(
        model, X, y, config.loss, bdirs, factor=config.basin_factor, max_radius=config.basin_max,
        points=config.basin_points, direction_seeds=seeds["basin_directions"], progress=progress, **eval_kw,
    )
    timings["basin"] = time.perf_counter() - t0
    # the evaluator actually used (vmap falls back to a loop for modules it cannot batch)
    backend = evaluate_points(
        model, X[:2], y[:2], config.loss, [d1], torch.zeros(1, 1, dtype=torch.float64), **eval_kw
    ).backend
    progress(config.work_units() - done[0])
    return LandscapeResult(
        n_samples=int(X.shape[0]),
        n_params=op.size,
        param_names=tuple(names),
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
        backend=backend,
        timings=timings,
    )


def loss_mismatch_warning(losses: dict[str, float], ratio: float = LOSS_MISMATCH_RATIO) -> str | None:
    """A warning when the models' training losses differ by more than ``ratio`` (else None)."""
    finite = {k: v for k, v in losses.items() if math.isfinite(v)}
    if len(finite) < 2:
        return None
    lo_k = min(finite, key=finite.get)
    hi_k = max(finite, key=finite.get)
    lo, hi = finite[lo_k], finite[hi_k]
    if lo <= 0 or hi / lo > ratio:
        r = "inf" if lo <= 0 else f"{hi / lo:.3g}"
        return (
            f"training losses differ {r}x ({hi_k} {hi:.4g} vs {lo_k} {lo:.4g}): sharpness is only comparable "
            f"at comparable loss; rerun with --match-loss L"
        )
    return None


def state_dict_loop(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss: str, directions: Sequence[Params], coeffs: torch.Tensor
) -> torch.Tensor:
    """Reference evaluator: load a state dict per point and run the plain forward (slow, simple).

    Used by the tests and the benchmark as the independent baseline for :func:`evaluate_points`.
    """
    from .training import loss_value

    work = copy.deepcopy(model)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = []
    with torch.no_grad():
        for c in torch.as_tensor(coeffs, dtype=torch.float64):
            sd = dict(base)
            for k in directions[0]:
                sd[k] = base[k] + sum(float(c[j]) * directions[j][k] for j in range(len(directions)))
            work.load_state_dict(sd)
            out.append(float(loss_value(work(X), y, loss)))
    return torch.tensor(out, dtype=torch.float64)


def train_reference_model(
    arch: str, X: torch.Tensor, y: torch.Tensor, n_classes: int, *, width: int, seed: int, train_config
):
    """Build 2L-ReLU / MLP-Attn with ``seed`` and train it with the project's full-batch GD.

    Uses the same training path as every command (:func:`attnaudit.training.train`).
    Returns (model, TrainResult).
    """
    from .models import ModelSpec, build_model
    from .training import train

    spec = ModelSpec(arch, int(X.shape[1]), int(width), int(n_classes), seed=int(seed))
    model = build_model(spec, X, dtype=X.dtype, device=X.device)
    return model, train(model, X, y.long(), train_config)
