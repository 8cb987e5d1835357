"""The protocol every influence estimator implements, and the registry of estimators.

See :mod:`attnaudit.analyses.influence` for the protocol in words. The registry,
:data:`ESTIMATORS`, maps a name (what ``InfluenceConfig(estimator=...)`` and
``--estimator`` take) to its class, in registration order (the order of every list of
estimators shown to the user).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from attnaudit.analyses.request import FieldError, literal
from attnaudit.errors import AuditError

if TYPE_CHECKING:
    from attnaudit.core.engine import Engine, HessianVectorProduct

__all__ = [
    "ESTIMATORS",
    "Context",
    "Estimator",
    "MemoryQuery",
    "Solution",
    "State",
    "absolute_damping",
    "check_curvature",
    "estimator_class",
    "register",
]


# --------------------------------------------------------------------------- what an estimator gets and returns
@dataclass(frozen=True)
class Context:
    """What an estimator's :meth:`Estimator.prepare` gets: one model at one set of parameter values.

    ``test_grads`` (k, P): the gradients of the test losses over the tracked parameters, one
    row per test point (``config.per_test``) or one row for the summed test loss, formed on
    first use (an estimator that projects the test side from ``test_rows`` / ``test_targets``
    never forms them). ``train_rows`` / ``train_targets``, ``test_rows`` / ``test_targets``:
    the training and test sets as the engine takes them (features on a fast path).
    ``dampings``: the dampings as given (parsed: floats, and ``"<m>x"`` strings for multiples
    of lambda_max(H)); ``(None,)`` for an estimator without damping. ``chunk``: rows per
    chunk, fitted to the memory budget. ``hvp``: v -> H v for the mean training loss, built
    on first use.
    """

    config: Any  # the InfluenceConfig (typed loosely: influence.py imports this module)
    engine: Engine
    train_rows: torch.Tensor
    train_targets: torch.Tensor
    test_rows: torch.Tensor
    test_targets: torch.Tensor
    dampings: tuple
    chunk: int

    @property
    def n_test_rows(self) -> int:
        """k: rows of ``test_grads`` (test points, or 1 for the summed test loss)."""
        return int(self.test_rows.shape[0]) if self.config.per_test else 1

    @cached_property
    def test_grads(self) -> torch.Tensor:
        if self.config.per_test:
            return self.engine.per_sample_grads(self.test_rows, self.test_targets, chunk=self.chunk)
        return self.engine.summed_grad(self.test_rows, self.test_targets, self.chunk)[None]

    @cached_property
    def hvp(self) -> HessianVectorProduct:
        return self.engine.hvp_operator(self.train_rows, self.train_targets, self.chunk)


@dataclass
class State:
    """What :meth:`Estimator.prepare` returns and :meth:`Estimator.solve` reads (estimators subclass it).

    ``info``: diagnostics shared by every damping (lambda_max, the solver), written after the
    per-damping ones; ``trailing_info``: diagnostics written last. ``train_map``: applied to
    every chunk of per-sample training gradients (m, P) before they meet the transformed test
    gradients (a projection), None for the identity. ``train_losses``: each training row's loss
    at the model (n_train,) float64, when ``prepare`` ran forward passes over every training row
    anyway (the projected estimator's rows); None otherwise. The sweep keeps only these four once
    every damping is solved, so the rest of the state (a Hessian's eigenvectors) is freed
    before the training gradients are streamed.
    """

    context: Context
    info: dict = field(default_factory=dict)
    trailing_info: dict = field(default_factory=dict)
    train_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    train_losses: torch.Tensor | None = None


@dataclass
class Solution:
    """One damping's transformed test gradients: ``transformed`` (k, P') with P' the width of
    ``train_map``'s output (P without one); a training gradient g scores -train_map(g) . row.
    ``damping``: the absolute damping used (None: no damping, or one per layer given in the
    diagnostics)."""

    transformed: torch.Tensor
    damping: float | None
    diagnostics: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MemoryQuery:
    """What :meth:`Estimator.memory_parts` sizes: P tracked parameters, k transformed test
    gradients (test points x dampings), floats of ``itemsize`` bytes; ``factor_bytes`` from
    :meth:`Estimator.factor_bytes`, ``proj_dim`` from the config, ``n_train`` training rows and
    ``n_classes`` outputs (0 when unknown)."""

    n_params: int
    k: int
    hvp_batch: int
    itemsize: int
    factor_bytes: int = 0
    proj_dim: int = 0
    n_train: int = 0
    n_classes: int = 0


# --------------------------------------------------------------------------- the protocol
class Estimator:
    """Base class of influence estimators; subclass it, set ``name``, implement :meth:`solve`
    (and usually :meth:`prepare`), then :func:`register` the class."""

    name: ClassVar[str] = ""
    #: False: one result whatever the dampings (solve gets damping None; TracIn)
    uses_damping: ClassVar[bool] = True
    #: a selector the estimator always tracks (``"head"``: last-layer); None: InfluenceConfig.params or the task's
    tracks_parameters: ClassVar[str | None] = None
    #: InfluenceConfig.curvature values accepted, each with what it means ("auto" first)
    curvatures: ClassVar[dict[str, str]] = {"auto": "the Hessian"}
    #: False: always run on the generic engine (the real module), never a cached-feature fast path
    allows_fast_path: ClassVar[bool] = True
    #: True: evaluated at saved training checkpoints, weighted, not at the current parameters
    uses_checkpoints: ClassVar[bool] = False
    #: what to try when even one chunk does not fit the memory budget
    budget_hint: ClassVar[str] = "drop per-test influence, use fewer test points"

    def prepare(self, context: Context) -> State:
        """Fit the curvature once (and transform what can be transformed once)."""
        return State(context)

    def solve(self, state: State, damping: float | str | None) -> Solution:
        """The test gradients transformed for one damping as given (None without damping)."""
        raise NotImplementedError

    def train_scorer(self, state: State) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """A function (rows, targets, transformed (P, k)) -> (rows, k) of the training
        gradients' products with the transformed test gradients, computed without the
        per-sample gradients over all P parameters (K-FAC: per-layer outer products), or None
        to stream per-sample gradients (the default). Called once, after every damping is
        solved and before ``state`` is released, so it keeps only what it needs."""
        return None

    def memory_parts(self, query: MemoryQuery) -> dict[str, int]:
        """Bytes held by the estimator's own structures, by name (the shared ones are added)."""
        return {}

    def factor_bytes(self, engine: Engine, config: Any = None) -> int:
        """Bytes of fitted factors, measured on the engine before any compute, for the
        InfluenceConfig ``config`` (None: the largest any config needs; 0: no factors)."""
        return 0

    def gradient_params_per_row(self, engine: Engine, rows: Any = None, config: Any = None) -> int:
        """Numbers (of the engine's dtype) one training row holds at once while the estimator
        runs, beyond its autograd graph (sizes the planner's gradient chunk): its per-sample
        gradients over all P by default. ``rows``: training rows, for an estimator whose
        working set depends on them (tokens per row); ``config``: the InfluenceConfig, for one
        whose working set depends on its settings (None: the largest any needs)."""
        return engine.n_params

    def test_gradient_params(self, engine: Engine, config: Any = None) -> int:
        """Numbers per test column the estimator's transformed test gradients hold: P by default
        (H^-1 g_test over every parameter)."""
        return engine.n_params

    def check_budget(self, n_params: int, max_exact_params: int, itemsize: int = 8) -> None:
        """Refuse, with an AuditError, a parameter count the estimator cannot handle."""

    def check_params(self, params: Any) -> None:
        """Refuse, with an AuditError, an ``InfluenceConfig.params`` the estimator cannot track."""


# --------------------------------------------------------------------------- the registry
ESTIMATORS: dict[str, type[Estimator]] = {}


def register(cls: type[Estimator]) -> type[Estimator]:
    """Add an estimator class to :data:`ESTIMATORS` under ``cls.name`` (usable as a decorator)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"an influence estimator needs a non-empty string name, got {name!r}")
    if ESTIMATORS.get(name, cls) is not cls:
        raise ValueError(
            f"an influence estimator named {name!r} is already registered ({ESTIMATORS[name].__qualname__})"
        )
    ESTIMATORS[name] = cls
    return cls


def estimator_class(name: str) -> type[Estimator]:
    """The registered class of ``name``, or an AuditError listing the known ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise AuditError(f"unknown influence estimator {name!r}; use one of {', '.join(ESTIMATORS)}") from None


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_curvature(name: str, curvature: str) -> None:
    """Refuse an ``InfluenceConfig.curvature`` the estimator ``name`` does not take (unknown names take auto only):
    a :class:`~attnaudit.analyses.request.FieldError` on ``curvature``."""
    accepted = ESTIMATORS.get(name, Estimator).curvatures
    if curvature in accepted:
        return
    if len(accepted) > 1:
        owners = "/".join(n for n, c in ESTIMATORS.items() if curvature in c.curvatures)
        takes = " or ".join(f"{what} ({value})" for value, what in accepted.items())
        raise FieldError(
            "curvature", "{name} " + literal(f"{curvature} is for estimator {owners}; estimator {name} takes {takes}")
        )
    users = [n for n, c in ESTIMATORS.items() if len(c.curvatures) > 1]
    raise FieldError(
        "curvature",
        "{name} applies to estimator "
        + literal(f"{_and(users)}, not {name} (which uses {accepted.get('auto', 'its own curvature')})")
        + "; leave it at auto",
    )


def absolute_damping(value: float | str, lam_max: float | None) -> float:
    """The absolute damping of ``value`` (parsed: a float, or ``"<m>x"``) given lambda_max(H)."""
    if not isinstance(value, str):
        return float(value)
    m = float(value[:-1])
    if lam_max is None or not (math.isfinite(lam_max) and lam_max > 0):
        raise FieldError(
            "damping",
            "relative {name} "
            + literal(f"{value} needs lambda_max(H) > 0, but lambda_max = {lam_max}")
            + "; give an absolute {name}",
        )
    return m * lam_max
