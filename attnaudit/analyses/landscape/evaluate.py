"""Loss and accuracy at many points theta + sum_j c_j d_j of parameter space.

:class:`SurfaceEvaluator` evaluates the training loss (the task's per-sample loss, averaged
over the samples) and accuracy at a batch of points, chunked over points and samples so
the result equals one full-batch evaluation per point. Two paths:

* **generic: engine** -- ``vmap`` over points of :meth:`Engine.apply` (``functional_call``
  on the engine's parameter copies, eval mode, the task's input and output adapters, the
  math attention kernel); any module. A module that cannot be vmapped (data-dependent
  control flow) falls back to one point per call (``backend == "loop"``). Chunks are sized
  from the engine's measured probe of the bytes a sample keeps alive.
* **fast: TwoLayerNet structured evaluation** -- :mod:`.structured`, used when it declares
  that it applies and ``fast_path`` is on; tested equal to the generic path.

The result records which path ran (``path``) and the backend (``structured``, ``vmap``,
``loop``). Accuracy is a classifier's: for a causal language model (next-token loss, logits
(n, L, V)) it is None and only the loss is evaluated.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import vmap

from attnaudit.core.engine import Engine, length_spans, ranges
from attnaudit.core.task import Task
from attnaudit.errors import AuditError
from attnaudit.analyses.landscape import structured
from attnaudit.analyses.landscape.directions import Params
from attnaudit.analyses.landscape.setup import (
    check_labels,
    classifies,
    labels_as_given,
    landscape_engine,
    landscape_task,
)
from attnaudit.core.training import loss_value

Progress = Callable[[int], None] | None
BACKENDS = ("auto", "structured", "vmap", "loop")
GENERIC_PATH = "generic: engine"
FAST_PATH = structured.FAST_PATH
Direction = Params | torch.Tensor

# Activation elements per call on CPU: blocks much larger than this fall out of cache and
# run slower per point (measured on digits and MNIST two-layer nets: 2-4x at 8M elements).
_CPU_BLOCK = 2**21


@dataclass(frozen=True)
class PointEval:
    """Training loss and accuracy at a batch of points theta + sum_j c_j d_j (accuracy None
    for a language model)."""

    loss: torch.Tensor  # (B,) float64, CPU
    accuracy: torch.Tensor | None  # (B,) float64, CPU
    backend: str
    points_per_batch: int
    samples_per_batch: int
    path: str = GENERIC_PATH


def plan_chunks(
    n_samples: int,
    n_points: int,
    *,
    act: float,
    tables: float,
    per_point_fixed: float,
    temporaries: float,
    element_size: int,
    on_cpu: bool,
    memory_mb: float,
    points_per_batch: int | None,
    samples_per_batch: int | None,
) -> tuple[int, int]:
    """(points, samples) per call: cache-sized blocks on CPU, never above ``memory_mb``.

    Sizes are in elements: ``act`` activations per sample and point (``temporaries`` times
    that are alive at once), ``tables`` per sample shared by all points, ``per_point_fixed``
    per point (parameter copies).
    """
    budget = max(memory_mb, 1.0) * 2**20 / element_size
    block = _CPU_BLOCK if on_cpu else budget
    act = max(act, 1)
    if samples_per_batch is not None:
        s = max(1, min(samples_per_batch, n_samples))
    else:
        s = min(n_samples, max(128, int(block // act)))
        while s > 1 and s * (temporaries * act + tables) + per_point_fixed > budget:
            s //= 2
    if points_per_batch is not None:
        b = points_per_batch
    else:
        b_cache = block // (s * act)
        b_mem = (budget - s * tables) // (per_point_fixed + temporaries * s * act)
        b = int(min(b_cache, b_mem))
    return max(1, min(b, n_points)), s


def _generic_chunk(engine: Engine, theta0: torch.Tensor, D: torch.Tensor, Xc, Tc, yc):
    counts = classifies(engine.loss)  # a language model has no labels to count hits against

    def one(c: torch.Tensor):
        out = engine.apply(theta0 + c @ D, Xc)
        hits = (out.argmax(-1) == yc).sum() if counts else out.new_zeros((), dtype=torch.long)
        return engine.loss.per_sample(out, Tc).sum(), hits

    batched_one = vmap(one)

    def run(c: torch.Tensor, batched: bool):
        return batched_one(c) if batched else one(c)

    return run


class SurfaceEvaluator:
    """L(theta + sum_j c_j d_j) and accuracy over fixed data (X, y), for batches of points.

    ``fast_path``: use the structured two-layer evaluation when it applies (see
    :mod:`.structured`); False forces the generic engine path. ``backend``: ``auto``
    (fast path when on and applicable, else vmap), ``structured`` (require the fast path),
    ``vmap`` or ``loop`` (generic). ``memory_mb``, ``points_per_batch``,
    ``samples_per_batch``: chunking (None = planned).
    """

    def __init__(
        self,
        engine: Engine,
        X: torch.Tensor,
        y: torch.Tensor,
        *,
        fast_path: bool = True,
        backend: str = "auto",
        memory_mb: float = 512.0,
        points_per_batch: int | None = None,
        samples_per_batch: int | None = None,
    ):
        if backend not in BACKENDS:
            raise AuditError(f"unknown evaluation backend {backend!r}; use one of {', '.join(BACKENDS)}")
        self.engine = engine
        self.X = engine.rows(X)
        self.y = labels_as_given(y.to(engine.device))
        check_labels(engine, self.y)
        self.T = engine.targets(self.y)
        # text: losses are sums over rows; rows sorted by length run in chunks of neighbours,
        # each at its own longest sequence
        self.order = engine.length_order(self.X)
        if self.order is not None:
            self.X, self.y, self.T = self.X[self.order], self.y[self.order], self.T[self.order]
        self.fast_path_reason = structured.unavailable(engine) if fast_path else "the fast path is switched off"
        if backend == "auto":
            backend = "structured" if self.fast_path_reason is None else "vmap"
        elif backend == "structured" and self.fast_path_reason is not None:
            raise AuditError(
                f"the structured backend (TwoLayerNet fast path) does not apply: {self.fast_path_reason}; use vmap"
            )
        self.backend = backend
        self.memory_mb = memory_mb
        self.points_per_batch = points_per_batch
        self.samples_per_batch = samples_per_batch
        self._probe_elements: float | None = None

    @property
    def path(self) -> str:
        """Which path evaluates: ``fast: ...`` or ``generic: engine``."""
        return FAST_PATH if self.backend == "structured" else GENERIC_PATH

    def flat(self, directions: Sequence[Direction]) -> torch.Tensor:
        """Directions (dicts over the tracked parameters, or flat (P,) vectors) stacked as (k, P)."""
        eng = self.engine
        rows = []
        for d in directions:
            if isinstance(d, torch.Tensor):
                v = d.reshape(-1)
                if v.numel() != eng.n_params:
                    raise AuditError(f"a flat direction has {v.numel()} entries, the tracked parameters {eng.n_params}")
            else:
                missing = [k for k in eng.names if k not in d]
                if missing:
                    raise AuditError(f"direction has no entry for parameter(s) {', '.join(missing)}")
                v = eng.flatten({k: d[k].to(device=eng.device, dtype=eng.dtype) for k in eng.names})
            rows.append(v.to(device=eng.device, dtype=eng.dtype))
        return torch.stack(rows)

    def _plan(self, n_points: int, n_dirs: int) -> tuple[int, int]:
        eng = self.engine
        if self.backend == "structured":
            act, tables, fixed = structured.sizes(eng, n_dirs)
            temporaries = 3
        else:
            if self._probe_elements is None:  # measured once: bytes autograd keeps per sample
                self._probe_elements = eng.probe_bytes_per_sample(self.X) / eng.theta.element_size()
            act, tables, fixed, temporaries = self._probe_elements, 0, 2 * eng.n_params, 1
        return plan_chunks(
            int(self.X.shape[0]),
            n_points,
            act=act,
            tables=tables,
            per_point_fixed=fixed,
            temporaries=temporaries,
            element_size=eng.theta.element_size(),
            on_cpu=eng.device.type == "cpu",
            memory_mb=self.memory_mb,
            points_per_batch=self.points_per_batch,
            samples_per_batch=self.samples_per_batch,
        )

    def __call__(self, directions: Sequence[Direction], coeffs: torch.Tensor, progress: Progress = None) -> PointEval:
        """Loss and accuracy at theta + sum_j coeffs[b, j] * directions[j] for every row b."""
        if not directions:
            raise AuditError("no directions given")
        eng = self.engine
        coeffs = torch.as_tensor(coeffs).to(device=eng.device, dtype=eng.dtype)
        if coeffs.dim() != 2 or coeffs.shape[1] != len(directions):
            raise AuditError(f"coefficients must have shape (points, {len(directions)}), got {tuple(coeffs.shape)}")
        D = self.flat(directions)
        theta0 = eng.theta
        X, T, y = self.X, self.T, self.y
        n, n_points = X.shape[0], coeffs.shape[0]
        b, s = self._plan(n_points, len(directions))
        # text (sorted at construction): spans of neighbours in length within s rows' tokens
        spans = list(ranges(n, s)) if self.order is None else length_spans(self._lengths(), s)
        loss_sum = torch.zeros(n_points, dtype=torch.float64, device=eng.device)
        correct = torch.zeros(n_points, dtype=torch.float64, device=eng.device)
        with torch.no_grad(), eng.context():
            for start, stop in spans:
                Xc, Tc, yc = X[start:stop], T[start:stop], y[start:stop]
                make = structured.chunk if self.backend == "structured" else _generic_chunk
                chunk_fn = make(eng, theta0, D, Xc, Tc, yc)
                for p0 in range(0, n_points, b):
                    cb = coeffs[p0 : p0 + b]
                    if self.backend == "loop":
                        ls, cs = self._loop(chunk_fn, cb)
                    else:
                        try:
                            ls, cs = chunk_fn(cb, batched=True)
                        except (RuntimeError, NotImplementedError):
                            if self.backend != "vmap" or start or p0:
                                raise
                            # this module cannot be vmapped (data-dependent control flow, ...):
                            # evaluate point by point, still on the engine's parameter copies
                            self.backend = "loop"
                            ls, cs = self._loop(chunk_fn, cb)
                    loss_sum[p0 : p0 + b] += ls.to(torch.float64)
                    correct[p0 : p0 + b] += cs.to(torch.float64)
                    if progress is not None and stop >= n:
                        progress(len(cb))
        return PointEval(
            loss=(loss_sum / n).cpu(),
            accuracy=(correct / n).cpu() if classifies(eng.loss) else None,
            backend=self.backend,
            points_per_batch=b,
            samples_per_batch=s,
            path=self.path,
        )

    def _lengths(self) -> list[int]:
        lengths = self.engine.real_lengths(self.X)
        assert lengths is not None  # the rows were sorted by them
        return lengths.tolist()

    @staticmethod
    def _loop(chunk_fn, cb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [chunk_fn(c, batched=False) for c in cb]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def build_evaluator(
    model: nn.Module | Task,
    X: torch.Tensor,
    y: torch.Tensor,
    loss: str | None = None,
    *,
    names: Sequence[str] | None = None,
    params: Sequence[str] | str | None = None,
    dtype: torch.dtype | str | None = None,
    **options,
) -> SurfaceEvaluator:
    """A :class:`SurfaceEvaluator` for a module or task (``options``: fast_path, backend, chunking).

    ``names`` (exact parameter names) or ``params`` (a selector) choose the tracked
    parameters; default: the task's selector (all, for a bare module).
    """
    task = landscape_task(model, X, loss, params)
    return SurfaceEvaluator(landscape_engine(task, X, dtype, names), X, y, **options)


def evaluate_points(
    model: nn.Module | Task,
    X: torch.Tensor,
    y: torch.Tensor,
    loss: str | None,
    directions: Sequence[Direction],
    coeffs: torch.Tensor,
    *,
    names: Sequence[str] | None = None,
    progress: Progress = None,
    **options,
) -> PointEval:
    """One-shot :class:`SurfaceEvaluator` call; the tracked parameters default to the directions' keys."""
    if names is None and directions and isinstance(directions[0], dict):
        names = list(directions[0].keys())
    return build_evaluator(model, X, y, loss, names=names, **options)(directions, coeffs, progress)


def loss_and_accuracy(
    engine: Engine, X: torch.Tensor, y: torch.Tensor, chunk: int = 8192
) -> tuple[float, float | None]:
    """Training loss and accuracy at the engine's theta (one forward per sample chunk); the
    accuracy is None for a language model (no class labels)."""
    X = engine.rows(X)
    y = labels_as_given(y.to(engine.device))
    counts = classifies(engine.loss)
    total, correct, n = 0.0, 0.0, X.shape[0]
    with torch.no_grad(), engine.context():
        for part in engine.row_chunks(X, chunk):
            out = engine.apply(engine.theta, X[part])
            total += float(engine.loss.per_sample(out, engine.targets(y[part])).double().sum())
            if counts:
                correct += float((out.argmax(1) == y[part]).double().sum())
    return total / n, (correct / n if counts else None)


def state_dict_loop(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss: str, directions: Sequence[Params], coeffs: torch.Tensor
) -> torch.Tensor:
    """Reference evaluator: load a state dict per point into a copy and run its plain forward (slow, simple).

    Used by the tests and the benchmark as the independent baseline for :class:`SurfaceEvaluator`.
    """

    work = copy.deepcopy(model).eval()
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
