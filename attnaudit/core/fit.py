"""Mini-batch training of any module on flat rows: the code path of ``attnaudit train``.

A :class:`Recipe` says how (optimizer, learning rate, batch size, how long, loss, data
order seed); :func:`fit` trains a module in place and returns a :class:`FitResult`.

Loss: the mean over the batch of the core's per-sample loss
(:func:`attnaudit.core.task.as_loss`), on one-hot targets, the normalisation of
:mod:`attnaudit.core.training`:

* ``mse``: L = 1/(2B) * sum_i ||f(x_i) - onehot(y_i)||^2;
* ``ce``:  L = 1/B * sum_i (logsumexp f(x_i) - f(x_i)_{y_i}).

Optimizers: ``gd`` is full-batch gradient descent (SGD on every row at every step, so it is
the same dynamics as :func:`attnaudit.core.training.train`), ``sgd`` mini-batch SGD with
optional momentum, ``adam`` Adam (``torch.optim.Adam``); ``weight_decay`` is torch's L2
weight decay of SGD/Adam (added to the gradient). ``gd`` and ``sgd`` run
:class:`GradientDescent`, the updates of ``torch.optim.SGD`` bit for bit without its
construction, which imports ``torch._dynamo`` the first time in a process (about 1.8 s of
every command that trains a built-in model and uses no functional transform).

Fast path (declared as the architecture notes ask): MLP-Attn's input map is a fixed buffer,
f_att(x) = context @ x, so for a :class:`~attnaudit.models.builtin.TwoLayerNet` with a context that
keeps TwoLayerNet's own forward computation and is fed flat rows
(:func:`attnaudit.models.builtin.two_layer_fast_path_blocker` says nothing against it), training on
(X, y) is training its MLP on (f_att(X), y): :func:`fit` maps the rows once instead of
multiplying every batch by the d x d context at every step (the same parameter trajectory,
to round-off; 4x faster on MNIST). ``fast_path=False`` turns it off; ``FitResult.path``
says which ran.

Determinism: the data order comes from a local :class:`torch.Generator` seeded with
``recipe.seed`` (each epoch a fresh permutation; the last, partial batch is kept), and the
module runs with every training flag off (:class:`attnaudit.core.task.eval_mode`: no
dropout, no batch statistics; the flags are restored afterwards). The result is then a
deterministic function of the module's initial weights, the data and the recipe: two runs
on the same machine and thread count give bit-identical weights. Dropout is deliberately
not used — an audit should see the function that was trained, not a random sub-network.
"""

from __future__ import annotations


import math
import time
import dataclasses
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from attnaudit.core.task import LOSSES as LOSS_TABLE, Inputs, as_loss, closed_form_blocker, eval_mode, to_logits
from attnaudit.errors import AuditError, FieldError, check_seed, is_int, is_real, literal, show_value
from attnaudit.errors import clip_text as _clip

OPTIMIZERS = ("gd", "sgd", "adam")
LOSSES = tuple(LOSS_TABLE)  # the core's one loss table: mse, ce
#: The default learning rate of ``adam`` where a command's preset gives a GD rate.
DEFAULT_ADAM_LR = 1e-3
_EVAL_CHUNK = 2048


@dataclass(frozen=True)
class Recipe:
    """How to train; validated on construction (a :class:`~attnaudit.errors.FieldError` naming the field).

    ``optimizer``: ``gd`` (full-batch gradient descent), ``sgd`` or ``adam``. ``lr``: the
    learning rate. ``batch_size``: rows per step, None = every row (must be None for gd).
    Exactly one of ``epochs`` (passes over the data) and ``steps`` (optimizer steps,
    counted across epochs). ``loss``: ``mse`` or ``ce``. ``seed``: the data order.
    ``momentum``: SGD momentum (sgd only). ``weight_decay``: L2 weight decay.
    """

    optimizer: str
    lr: float
    batch_size: int | None = None
    epochs: int | None = None
    steps: int | None = None
    loss: str = "mse"
    seed: int = 0
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZERS:
            raise FieldError(
                "optimizer",
                "unknown {name} " + literal(show_value(self.optimizer)) + f"; use one of {', '.join(OPTIMIZERS)}",
            )
        if not isinstance(self.loss, str) or self.loss not in LOSSES:
            raise FieldError(
                "loss", "unknown {name} " + literal(show_value(self.loss)) + f"; use one of {', '.join(LOSSES)}"
            )
        if not is_real(self.lr) or not math.isfinite(self.lr) or not self.lr > 0:
            raise FieldError("lr", "{name} must be a positive number, got " + literal(show_value(self.lr)))
        object.__setattr__(self, "lr", float(self.lr))
        for name in ("momentum", "weight_decay"):
            value = getattr(self, name)
            if not is_real(value) or not math.isfinite(value) or value < 0:
                raise FieldError(name, "{name} must be a number >= 0, got " + literal(show_value(value)))
            object.__setattr__(self, name, float(value))
        if self.momentum >= 1:
            raise FieldError("momentum", "{name} must be below 1 (0.9 is usual), got " + f"{self.momentum:g}")
        if self.momentum and self.optimizer != "sgd":
            raise FieldError("momentum", "{name} applies to the sgd optimizer, not " + f"{self.optimizer}; drop it")
        if self.batch_size is not None:
            if not is_int(self.batch_size) or self.batch_size < 1:
                raise FieldError(
                    "batch_size", "{name} must be a positive integer, got " + literal(show_value(self.batch_size))
                )
            object.__setattr__(self, "batch_size", int(self.batch_size))
            if self.optimizer == "gd":
                raise FieldError(
                    "batch_size",
                    "{name} does not apply to the gd optimizer (full-batch gradient descent uses every row at "
                    "every step); drop it, or use sgd for mini-batches",
                )
        if (self.epochs is None) == (self.steps is None):
            raise FieldError(
                "epochs",
                "{name} and steps both say how long to train; give one of them"
                if self.epochs is not None
                else "say how long to train: give {name} or steps",
            )
        for name in ("epochs", "steps"):
            value = getattr(self, name)
            if value is not None:
                if not is_int(value) or value < 0:
                    raise FieldError(name, "{name} must be an integer >= 0, got " + literal(show_value(value)))
                object.__setattr__(self, name, int(value))
        try:
            check_seed(self.seed, "seed")
        except AuditError as exc:
            raise FieldError("seed", literal(str(exc)).replace("seed", "{name}", 1)) from None
        object.__setattr__(self, "seed", int(self.seed))

    def batch_rows(self, n: int) -> int:
        """Rows per step on a training set of ``n`` rows."""
        return n if self.batch_size is None else min(self.batch_size, n)

    def steps_per_epoch(self, n: int) -> int:
        """Optimizer steps in one pass over ``n`` rows (the last batch may be partial)."""
        return math.ceil(n / self.batch_rows(n)) if n else 0

    def total_steps(self, n: int) -> int:
        """Optimizer steps the recipe runs on ``n`` rows (unless it diverges)."""
        if self.steps is not None:
            return self.steps
        assert self.epochs is not None  # __post_init__ requires exactly one of epochs and steps
        return self.epochs * self.steps_per_epoch(n)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Recipe":
        """A Recipe from a dict read from an untrusted side-car (unknown or missing keys refused)."""
        if not isinstance(d, dict):
            raise AuditError(f"the training recipe must be an object, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise AuditError(
                f"the training recipe has unknown field(s) {_clip(', '.join(unknown), 120)}; "
                f"a recipe holds {', '.join(known)}"
            )
        missing = [k for k in ("optimizer", "lr") if k not in d]
        if missing:
            raise AuditError(f"the training recipe lacks field(s) {', '.join(missing)}")
        try:
            return cls(**d)
        except AuditError as exc:
            raise AuditError(f"the training recipe is invalid: {exc}") from None


@dataclass
class FitResult:
    """What :func:`fit` did. ``loss_curve``: the loss of each step's batch, before its update
    (a non-finite value ends it when the run diverged). ``final_train_loss`` and
    ``train_accuracy``: over the whole training set after training; ``val_*``: over the
    validation rows (None without them). ``epochs_run``: steps_run / steps_per_epoch."""

    steps_run: int
    epochs_run: float
    steps_per_epoch: int
    loss_curve: list[float]
    final_train_loss: float
    train_accuracy: float
    val_loss: float | None
    val_accuracy: float | None
    diverged: bool
    seconds: float
    path: str = "generic"
    n_train: int = 0
    n_val: int = 0
    notes: list[str] = field(default_factory=list)
    #: with ``loss_tol``: whether the loss reached it (None without a tolerance)
    reached_tol: bool | None = None
    #: with ``checkpoint_every``: parameter snapshots (TracIn), not part of the report
    checkpoints: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(dataclasses.replace(self, checkpoints=[]))
        out.pop("checkpoints")
        out.pop("reached_tol")
        return out


def _model_reference(model: nn.Module) -> torch.Tensor:
    ref = next((t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()), None)
    if ref is None:
        raise AuditError("the model has no floating-point parameters; nothing to train")
    return ref


def _check_data(X: torch.Tensor, y: torch.Tensor, what: str) -> None:
    # rows are (n, d); a module called on its own input layout directly may take (n, ...)
    if not isinstance(X, torch.Tensor) or X.ndim < 2:
        raise AuditError(f"{what} rows must be a 2-D tensor (n, d), got {getattr(X, 'shape', type(X).__name__)}")
    if not isinstance(y, torch.Tensor) or y.ndim != 1 or y.shape[0] != X.shape[0]:
        raise AuditError(f"{what} labels must be a 1-D tensor with one label per row ({X.shape[0]})")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise AuditError(f"{what} labels must be integer class indices, got {str(y.dtype).replace('torch.', '')}")
    if y.numel() and int(y.min()) < 0:
        raise AuditError(f"{what} labels must be class indices >= 0, got {int(y.min())}")


def evaluate(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    loss: str,
    inputs: Inputs | None = None,
    chunk: int = _EVAL_CHUNK,
) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on rows X with labels y, in eval mode, without gradients."""
    inputs = inputs if inputs is not None else _default_inputs(model)
    ref = _model_reference(model)
    loss_fn = as_loss(loss)
    total, correct, n = 0.0, 0, int(X.shape[0])
    if n == 0:
        return float("nan"), float("nan")
    with torch.no_grad(), eval_mode(model):
        for a in range(0, n, chunk):
            rows = X[a : a + chunk].to(device=ref.device, dtype=ref.dtype)
            labels = y[a : a + chunk].to(ref.device).long()
            logits = to_logits(inputs.call(model, inputs(rows)))
            target = torch.nn.functional.one_hot(labels, logits.shape[-1]).to(logits.dtype)
            total += float(loss_fn.per_sample(logits, target).sum())
            correct += int((logits.argmax(1) == labels).sum())
    return total / n, correct / n


def _validation(
    model: nn.Module, X_val: torch.Tensor | None, y_val: torch.Tensor | None, loss: str, inputs: Inputs
) -> tuple[float | None, float | None]:
    """(loss, accuracy) on the validation rows; (None, None) without any."""
    if X_val is None or y_val is None or not X_val.shape[0]:
        return None, None
    return evaluate(model, X_val, y_val, loss, inputs)


def _default_inputs(model: nn.Module) -> Inputs:
    declared = getattr(model, "audit_inputs", None)
    return declared() if callable(declared) else Inputs()


def _attention_features_apply(model: nn.Module, inputs: Inputs) -> bool:
    """Whether the MLP-Attn fast path applies: a TwoLayerNet with an attention context that
    keeps TwoLayerNet's forward computation, fed flat rows positionally."""
    if getattr(model, "context", None) is None:
        return False
    return closed_form_blocker(model, inputs) is None


class GradientDescent:
    """The update of ``torch.optim.SGD`` without dampening or Nesterov: g = grad + weight_decay *
    theta; with momentum mu, b = g at the first step, then b = mu b + g, and g = b; theta -= lr g.
    The same tensor operations in the same order as torch's single-tensor path, so the same
    numbers bit for bit (its multi-tensor path runs the same element-wise operations)."""

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        """Drops the gradients (torch's default ``set_to_none``)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad
            if self.weight_decay != 0:
                g = g.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = g.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(g, alpha=1)
                g = buf
            p.add_(g, alpha=-self.lr)


def _optimizer(params: list[nn.Parameter], recipe: Recipe) -> torch.optim.Optimizer | GradientDescent:
    if recipe.optimizer == "adam":
        return torch.optim.Adam(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    return GradientDescent(params, recipe.lr, recipe.momentum, recipe.weight_decay)


def _check_fit_inputs(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    X_val: torch.Tensor | None,
    y_val: torch.Tensor | None,
) -> None:
    """Refuse what :func:`fit` cannot train: not a Recipe or a module, malformed rows or labels, no rows."""
    if not isinstance(recipe, Recipe):
        raise AuditError(f"fit needs a Recipe, got {type(recipe).__name__}")
    if not isinstance(model, nn.Module):
        raise AuditError(f"fit trains a torch.nn.Module, got {type(model).__name__}")
    _check_data(X, y, "training")
    if (X_val is None) != (y_val is None):
        raise AuditError("give both X_val and y_val, or neither")
    if X_val is not None and y_val is not None:  # both or neither, checked above
        _check_data(X_val, y_val, "validation")
    if int(X.shape[0]) == 0:
        raise AuditError("no training rows; give at least one")


def _check_full_batch_options(
    loss_tol: float | None, final_loss: bool, checkpoint_every: int | None, shuffle: bool
) -> None:
    """``loss_tol`` and ``final_loss`` need full-batch steps; a checkpoint interval is >= 1."""
    if (loss_tol is not None or final_loss) and shuffle:
        raise AuditError("loss_tol and final_loss are full-batch options; drop batch_size")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise AuditError("checkpoint interval must be >= 1")


def _output_width(model: nn.Module, inputs: Inputs, Xd: torch.Tensor, yd: torch.Tensor) -> int:
    """The model's number of outputs (one probe row); refused when the labels go beyond it."""
    with torch.no_grad(), eval_mode(model):
        width = int(to_logits(inputs.call(model, inputs(Xd[:1]))).shape[-1])
    top = int(yd.max())
    if top >= width:
        raise AuditError(
            f"the model has {width} outputs (classes 0..{width - 1}) but the labels go up to {top}; "
            "build it with one output per class"
        )
    return width


def fit(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    *,
    inputs: Inputs | None = None,
    X_val: torch.Tensor | None = None,
    y_val: torch.Tensor | None = None,
    progress: Callable[[int], None] | None = None,
    fast_path: bool = True,
    loss_tol: float | None = None,
    checkpoint_every: int | None = None,
    record_every: int = 1,
    final_loss: bool = False,
    evaluate_after: bool = True,
) -> FitResult:
    """Train ``model`` in place on rows ``X`` (n, d) with integer labels ``y`` (n,).

    ``inputs`` turns a batch of rows into the module's input (default: the module's
    ``audit_inputs()``, else flat rows); the logits are read with
    :func:`~attnaudit.core.task.to_logits`. Rows are cast to the module's floating dtype
    and device. The module runs in eval mode throughout (no dropout: see the module
    docstring), so the run is a deterministic function of its initial weights and the
    recipe. Every trainable parameter is trained. A non-finite batch loss stops the run
    before its update (``diverged``). ``progress(1)`` is called after every step. After
    training, the loss and accuracy on all of ``X`` (and on ``X_val``, ``y_val`` when
    given) are measured without gradients. ``fast_path``: allow the MLP-Attn fast path of
    the module docstring.

    Per step the loop does what a plain PyTorch loop does (index the batch, forward,
    loss, backward, optimizer step) plus reading the batch loss as a Python float.

    Full-batch options (the protocol of :func:`attnaudit.core.training.train`, which calls
    this function): ``loss_tol`` stops before the update once the loss is <= it
    (``reached_tol``); ``checkpoint_every`` keeps a parameter snapshot before every k-th
    update and at the end; ``record_every`` keeps every k-th loss of the curve (the last
    and the stopping one always); ``final_loss`` evaluates the loss once more after the
    last update and appends it to the curve (tolerance and divergence checked on it too);
    ``evaluate_after=False`` skips the whole-set evaluation (``final_train_loss`` is then
    the curve's last value and ``train_accuracy`` NaN).
    """
    _check_fit_inputs(model, X, y, recipe, X_val, y_val)
    n = int(X.shape[0])
    inputs = inputs if inputs is not None else _default_inputs(model)
    ref = _model_reference(model)
    device, dtype = ref.device, ref.dtype
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise AuditError("the model has no trainable parameters; nothing to train")
    loss_fn = as_loss(recipe.loss)
    Xd = X.to(device=device, dtype=dtype)
    yd = y.to(device).long()
    width = _output_width(model, inputs, Xd, yd)
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None
    if fast_path and _attention_features_apply(model, inputs):
        with torch.no_grad():
            # f_att of every row, once (the context is a fixed buffer); TwoLayerNet methods, not Module attributes
            Xd = model.features_in(Xd)  # type: ignore[operator]
        forward = model.mlp  # type: ignore[assignment]
    eye = torch.eye(width, dtype=dtype, device=device)  # one-hot targets by row lookup
    optimizer = _optimizer(params, recipe)
    batch = recipe.batch_rows(n)
    per_epoch = recipe.steps_per_epoch(n)
    total = recipe.total_steps(n)
    shuffle = batch < n  # full-batch steps see every row, in the data's own order
    gen = torch.Generator().manual_seed(recipe.seed)

    _check_full_batch_options(loss_tol, final_loss, checkpoint_every, shuffle)
    curve: list[float] = []
    checkpoints: list[dict[str, torch.Tensor]] = []
    diverged = False
    reached: bool | None = None if loss_tol is None else False
    steps_run = 0

    def batch_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        logits = forward(xb) if forward is not None else to_logits(inputs.call(model, inputs(xb)))
        return loss_fn.per_sample(logits, eye.index_select(0, yb)).mean()

    def observe(value: float) -> bool:
        """Record the loss before an update; True when the run stops here (diverged or reached)."""
        nonlocal diverged, reached
        stopping = not math.isfinite(value) or (loss_tol is not None and value <= loss_tol)
        if steps_run % record_every == 0 or stopping:
            curve.append(value)
        if not math.isfinite(value):
            diverged = True
        elif loss_tol is not None and value <= loss_tol:
            reached = True
        if not stopping and checkpoint_every and steps_run % checkpoint_every == 0:
            checkpoints.append({k: v.detach().clone() for k, v in model.named_parameters()})
        return stopping

    start = time.perf_counter()
    with eval_mode(model):
        while steps_run < total and not diverged and not reached:
            order = torch.randperm(n, generator=gen).to(device) if shuffle else None
            for a in range(0, n, batch):
                if steps_run >= total:
                    break
                if order is None:
                    xb, yb = Xd, yd
                else:
                    idx = order[a : a + batch]
                    xb, yb = Xd.index_select(0, idx), yd.index_select(0, idx)
                loss = batch_loss(xb, yb)
                if observe(loss.item()):
                    break
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps_run += 1
                if progress is not None:
                    progress(1)
        if final_loss and not diverged and not reached:
            with torch.no_grad():
                value = batch_loss(Xd, yd).item()
            if not observe(value) and steps_run % record_every:
                curve.append(value)  # the loss at the end is always on the curve
    if checkpoint_every and (not checkpoints or steps_run % checkpoint_every):
        checkpoints.append({k: v.detach().clone() for k, v in model.named_parameters()})
    seconds = time.perf_counter() - start
    notes = []
    if diverged:
        notes.append(f"the loss became non-finite at step {steps_run} (lr {recipe.lr:g}); lower --lr")
    if evaluate_after:
        train_loss, train_acc = evaluate(model, X, y, recipe.loss, inputs)
    else:
        train_loss, train_acc = (curve[-1] if curve else float("nan")), float("nan")
    val_loss, val_acc = _validation(model, X_val, y_val, recipe.loss, inputs)
    return FitResult(
        steps_run=steps_run,
        epochs_run=steps_run / per_epoch if per_epoch else 0.0,
        steps_per_epoch=per_epoch,
        loss_curve=curve,
        final_train_loss=train_loss,
        train_accuracy=train_acc,
        val_loss=val_loss,
        val_accuracy=val_acc,
        diverged=diverged,
        seconds=seconds,
        path="fast: MLP-Attn features precomputed" if forward is not None else "generic",
        n_train=n,
        n_val=0 if X_val is None else int(X_val.shape[0]),
        notes=notes,
        reached_tol=reached,
        checkpoints=checkpoints,
    )


# --------------------------------------------------------------------------- tables and figure


def build_tables(result: FitResult, model_info: dict) -> list:
    """The rich summary table of one training run (``model_info``: arch, parameters, path)."""
    from rich.table import Table
    from rich.text import Text

    def pct(v: float | None) -> str:
        return "-" if v is None or not math.isfinite(v) else f"{100 * v:.2f}%"

    def num(v: float | None) -> str:
        return "-" if v is None or not math.isfinite(v) else f"{v:.4g}"

    table = Table(title="attnaudit train")
    for name in (
        "arch",
        "parameters",
        "steps",
        "epochs",
        "final train loss",
        "train accuracy",
        "held-out accuracy",
        "seconds",
    ):
        table.add_column(name, justify="left" if name == "arch" else "right")
    table.add_row(
        str(model_info.get("arch")),
        f"{int(model_info.get('parameters', 0)):,}",
        str(result.steps_run),
        f"{result.epochs_run:.2f}",
        num(result.final_train_loss),
        pct(result.train_accuracy),
        pct(result.val_accuracy),
        f"{result.seconds:.1f}",
    )
    out: list = [table]
    out.extend(Text(f"warning: {note}", style="yellow") for note in result.notes)
    return out


def plot_fit(result: FitResult, path: str | Path, title: str) -> None:
    """The loss of each step's batch (log scale when positive), saved to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    try:
        steps = list(range(1, len(result.loss_curve) + 1))
        ax.plot(steps, result.loss_curve, lw=1.0, label="batch loss")
        if len(result.loss_curve) >= 20:
            k = max(5, len(result.loss_curve) // 50)
            curve = torch.tensor(result.loss_curve, dtype=torch.float64)
            smooth = torch.nn.functional.avg_pool1d(curve[None, None], k, stride=1).flatten().tolist()
            ax.plot(steps[k - 1 :], smooth, lw=2.0, label=f"running mean ({k} steps)")
        finite = [v for v in result.loss_curve if math.isfinite(v)]
        if finite and min(finite) > 0:
            ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (batch)")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
