"""The trained network against its linearized model, after the same training.

f_lin(x; theta) = f(x; theta_0) + J(x; theta_0)(theta - theta_0), started at theta_0 and
trained with the checkpoint's recorded recipe on its training rows; the distance on held-out
rows is RMS_x ||f_T(x) - f_lin,T(x)||_2 (over the c outputs), relative: / RMS ||f_lin,T(x)||,
as in the 2-layer sweep. Two methods (:func:`linearized_prediction`):

* ``kernel-gd``: kernel gradient descent with the initial eNTK, in closed form
  (:func:`attnaudit.core.ntk.kernel_gd_predict`, the 2-layer sweep's predictor with the empirical
  instead of the analytic kernel): exact for full-batch ``gd`` recipes without weight decay
  (MSE closed form, CE iterated in function space). Needs the full kernel of all training
  rows, so only for small training sets.
* ``train``: the linearized network itself (:class:`LinearizedModel`, forward-mode
  ``jvp``) trained by :func:`attnaudit.core.fit.fit` with the same recipe, mini-batch order and
  steps. For ``gd`` it is the same kernel gradient descent (tested equal); for ``sgd``
  without momentum it is kernel SGD with the initial eNTK over the same mini-batches; for
  ``adam`` (and momentum or weight decay) it is the linearized model under that optimizer,
  **not** kernel gradient descent: Adam's per-parameter scaling makes the function-space
  step f <- f - lr J_0 P_t J_0^T r use a kernel that changes with its preconditioner P_t.
  It is then the lazy-training comparator (Chizat et al. 2019), and the report says so.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from attnaudit.analyses.ntk_distance.aggregate import rms_rows, strict_json
from attnaudit.analyses.ntk_distance.config import DEFAULT_MEMORY_BYTES, LINEARIZED_METHODS
from attnaudit.analyses.ntk_distance.movement import task_of
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core.engine import Engine, ranges
from attnaudit.core.fit import Recipe, fit
from attnaudit.core.ntk import LinearizedGDConfig, kernel_gd_predict
from attnaudit.core.task import Inputs, Task, as_loss

F64 = torch.float64
# kernel-gd holds the (n c) x (n c) training kernel and its eigenvectors: at most this many n c
KERNEL_GD_MAX_OUTPUTS = 4096
DISTANCE_DEFINITION = (
    "RMS over held-out rows of ||f_T(x) - f_lin,T(x)||_2 over the c outputs; relative: divided by RMS ||f_lin,T(x)||_2"
)


class LinearizedModel(nn.Module):
    """f_lin(x; theta) = f(x; theta_0) + J(x; theta_0) (theta - theta_0), the model linearized
    around the engine's parameters theta_0, with theta one flat trainable vector started at
    theta_0 (``torch.func.jvp`` of the engine's functional model; nothing of the original
    module is changed). It takes flat rows (the engine applies the model's input adapter) and
    trains with :func:`attnaudit.core.fit.fit` like any module; Adam, SGD and weight decay act
    elementwise, so a flat vector gets the same updates as the original tensors would."""

    def __init__(self, engine: Engine):
        super().__init__()
        self._engine = (engine,)  # a tuple: not registered as a submodule
        self.theta = nn.Parameter(engine.theta.detach().clone())

    def audit_inputs(self) -> Inputs:
        return Inputs()

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        engine = self._engine[0]
        theta0 = engine.theta
        with engine.context():
            f0, jv = torch.func.jvp(  # type: ignore[misc]  # a pair without has_aux; torch annotates the triple too
                lambda t: engine.apply(t, rows), (theta0,), (self.theta - theta0,)
            )
        return f0 + jv


@dataclass
class LinearizedResult:
    """The trained network against its linearized model on held-out rows (module docstring)."""

    method: str
    applicable: bool
    reason: str | None = None
    dynamics: str | None = None
    kernel_gd: bool = False
    n_train: int = 0
    n_test: int = 0
    steps: int = 0
    distance_rms: float = float("nan")
    distance_rel: float = float("nan")
    lin_output_rms: float = float("nan")
    distance_train_rms: float = float("nan")
    net_train_loss: float = float("nan")
    lin_train_loss: float = float("nan")
    net_test_acc: float = float("nan")
    lin_test_acc: float = float("nan")
    lin_initial_loss: float = float("nan")
    unstable: bool = False
    predictor: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["definition"] = DISTANCE_DEFINITION
        return strict_json(out)


def linearized_off() -> LinearizedResult:
    """The result when the linearized comparison is switched off."""
    return LinearizedResult(method="off", applicable=False, reason="switched off (--linearized off)")


def linearized_dynamics(recipe: Recipe, method: str) -> tuple[str, bool]:
    """What the linearized model's training is, and whether it is kernel GD with the initial eNTK."""
    if recipe.optimizer == "gd" and not recipe.weight_decay:
        how = "closed form" if method == "kernel-gd" else "the linearized network trained by full-batch GD"
        return f"kernel gradient descent with the initial eNTK ({how}; exact)", True
    if recipe.optimizer == "sgd" and not recipe.momentum and not recipe.weight_decay:
        return (
            "kernel SGD with the initial eNTK over the same mini-batches (the linearized network trained by "
            "the recipe; exact)"
        ), False
    extras = [
        f"momentum {recipe.momentum:g}" if recipe.momentum else "",
        f"weight decay {recipe.weight_decay:g}" if recipe.weight_decay else "",
    ]
    what = recipe.optimizer + "".join(f", {x}" for x in extras if x)
    return (
        f"the linearized network trained by the same recipe ({what}): not kernel gradient descent with a fixed "
        "kernel, since the optimizer's per-parameter scaling changes the effective kernel during training "
        "(the lazy-training comparator)"
    ), False


def kernel_gd_blocker(recipe: Recipe, n_train: int, c: int) -> str | None:
    """Why closed-form kernel gradient descent is not the recipe's dynamics on ``n_train`` rows of
    ``c`` outputs (None when it is)."""
    if recipe.optimizer != "gd":
        return f"kernel-gd is the dynamics of full-batch gd, but the recipe trains with {recipe.optimizer}"
    if recipe.weight_decay:
        return "kernel-gd has no weight decay, but the recipe uses it"
    if n_train * c > KERNEL_GD_MAX_OUTPUTS:
        return (
            f"kernel-gd needs the full ({n_train} x {c})^2 kernel of every training row and its eigenvectors "
            f"(limit n c <= {KERNEL_GD_MAX_OUTPUTS})"
        )
    return None


def linearized_prediction(
    task_init: Task | nn.Module,
    task_trained: Task | nn.Module,
    recipe: Recipe,
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor | None = None,
    *,
    method: str = "auto",
    steps: int | None = None,
    train_dtype: torch.dtype | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    device=None,
    kernel_dtype: torch.dtype = F64,
) -> LinearizedResult:
    """The trained network's outputs against its linearized model's after the same training.

    ``recipe``: the :class:`attnaudit.core.fit.Recipe` the network was trained with on
    (``X_train``, ``y_train``) starting from ``task_init``'s parameters. ``method``:
    ``kernel-gd`` (closed form; full-batch gd without weight decay and small training sets
    only), ``train`` (the :class:`LinearizedModel` trained with the recipe), ``auto``
    (kernel-gd when it applies, else train) or ``off``. ``steps``: the steps the network
    actually ran (default: the recipe's). ``kernel_dtype``: the Jacobians of ``kernel-gd``'s
    kernels (the precision policy; the kernels are then used in float64). ``train_dtype``: the linearized model's training
    dtype for ``train`` (default float64). Network outputs and kernels are float64.
    """

    if method not in LINEARIZED_METHODS:
        raise FieldError(
            "method", "unknown {name} " + literal(f"{method!r}; use one of {', '.join(LINEARIZED_METHODS)}")
        )
    if method == "off":
        return linearized_off()
    if not isinstance(recipe, Recipe):
        raise FieldError("recipe", "the linearized prediction needs the training {name}")
    t0 = time.perf_counter()
    task_init, task_trained = task_of(task_init, X_train), task_of(task_trained, X_train)
    c = int(task_trained.n_classes)
    n = int(X_train.shape[0])
    blocker = kernel_gd_blocker(recipe, n, c)
    if method == "kernel-gd" and blocker:
        raise FieldError("method", "{name} kernel-gd: " + literal(blocker) + "; use {name} train")
    chosen = "kernel-gd" if method == "kernel-gd" or (method == "auto" and blocker is None) else "train"
    total = recipe.total_steps(n) if steps is None else int(steps)
    net = Engine(task_trained, dtype=F64, device=device)
    f_tr, f_te = net.logits(X_train), net.logits(X_test)
    dev = net.device
    y_dev = y_train.to(dev).long()
    Y = torch.nn.functional.one_hot(y_dev, c).to(F64)
    predictor: dict = {}
    if chosen == "kernel-gd":
        eng0 = Engine(task_init, dtype=kernel_dtype, device=device)  # the kernels' Jacobians; K is used in float64
        K = eng0.entk(X_train, memory_bytes=memory_bytes).to(F64)
        Kt = eng0.entk(X_test, X_train, memory_bytes=memory_bytes).to(F64)
        f0, f0t = eng0.logits(X_train).to(F64), eng0.logits(X_test).to(F64)
        pred = kernel_gd_predict(
            K, Y, LinearizedGDConfig(lr=recipe.lr, steps=total, loss=recipe.loss), K_test=Kt, f0_train=f0, f0_test=f0t
        )
        assert pred.f_test is not None  # K_test given
        lin_tr, lin_te = pred.f_train, pred.f_test
        predictor = pred.to_dict()
    else:
        if recipe.total_steps(n) != total:
            recipe = dataclasses.replace(recipe, steps=total, epochs=None)
        eng0 = Engine(task_init, dtype=train_dtype or F64, device=device)
        lin = LinearizedModel(eng0)
        # the outputs on every training row are computed below; fit's own pass over them would repeat it
        result = fit(lin, X_train, y_train, recipe, inputs=Inputs(), evaluate_after=False)
        with torch.no_grad():
            lin_tr = torch.cat([lin(eng0.rows(X_train[a:b])) for a, b in ranges(n, 1024)]).to(F64)
            lin_te = torch.cat([lin(eng0.rows(X_test[a:b])) for a, b in ranges(X_test.shape[0], 1024)]).to(F64)
        predictor = {
            "steps_run": result.steps_run,
            "diverged": result.diverged,
            "dtype": str(eng0.dtype).replace("torch.", ""),
        }

    loss = as_loss(recipe.loss)
    f0_train = Engine(task_init, dtype=F64, device=device).logits(X_train)
    initial = float(loss.per_sample(f0_train, Y).mean())
    final = float(loss.per_sample(lin_tr, Y).mean())
    # the linearized model's training is unstable when its loss ends above where it started (the
    # step is too large for its kernel) or it diverged / the closed form's stability ratio is exceeded
    unstable = bool(
        not math.isfinite(final) or final > initial or predictor.get("diverged") or predictor.get("diverges")
    )
    dist = rms_rows(f_te - lin_te)
    ref = rms_rows(lin_te)
    dynamics, exact_kgd = linearized_dynamics(recipe, chosen)

    def acc(F: torch.Tensor, yy: torch.Tensor) -> float:
        return float((F.argmax(1) == yy.to(F.device)).double().mean())

    return LinearizedResult(
        method=chosen,
        applicable=True,
        reason=None if method != "auto" or chosen == "kernel-gd" else f"auto chose train: {blocker}",
        dynamics=dynamics,
        kernel_gd=exact_kgd,
        n_train=n,
        n_test=int(X_test.shape[0]),
        steps=total,
        distance_rms=dist,
        distance_rel=dist / ref if ref > 0 else float("nan"),
        lin_output_rms=ref,
        distance_train_rms=rms_rows(f_tr - lin_tr),
        net_train_loss=float(loss.per_sample(f_tr, Y).mean()),
        lin_train_loss=final,
        lin_initial_loss=initial,
        unstable=unstable,
        net_test_acc=acc(f_te, y_test) if y_test is not None else float("nan"),
        lin_test_acc=acc(lin_te, y_test) if y_test is not None else float("nan"),
        predictor=predictor,
        seconds=time.perf_counter() - t0,
    )
