"""What the landscape analyses: a :class:`~attnaudit.core.task.Task` and its engine.

A bare ``nn.Module`` is wrapped in a task (flat inputs, logits width read from one probe
row); a Task keeps its inputs and output adapter, and the analysis' loss and parameter
selector, when given, replace the task's own (a causal language model keeps its next-token
loss: a classification loss cannot replace it). Parameters are resolved once, here, so a
selector that matches nothing fails before any compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from attnaudit.core.engine import Engine
from attnaudit.core.task import LOSSES, Loss, NextTokenLoss, Task, as_loss, as_task, select_parameter_names
from attnaudit.errors import AuditError

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}

#: the losses measured by name: the classification losses a user names, and a causal language
#: model's next-token loss (the one its checkpoint comes with)
LOSS_NAMES = (*LOSSES, NextTokenLoss.name)
#: each loss in words, as the report states it
LOSS_DESCRIPTIONS = {
    "mse": "mean squared error 0.5 ||f - onehot(y)||^2",
    "ce": "cross-entropy",
    NextTokenLoss.name: "next-token cross-entropy",
}
#: why a language model's landscape has no accuracy (nor the untrained rule built on it)
NO_ACCURACY = (
    "not defined: the next-token loss scores a causal language model's documents, which have no class labels; "
    "the training loss is the measure (no untrained verdict either, it reads accuracy against chance)"
)


class ParameterSelectionError(AuditError):
    """The parameter selector matches nothing on a model (the CLI maps it to ``--params``)."""


def loss_named(loss: str | Loss) -> Loss:
    """The :class:`Loss` named ``loss`` (one of :data:`LOSS_NAMES`), or a Loss as it is."""
    if isinstance(loss, Loss):
        return loss
    key = str(loss).strip().lower()
    return NextTokenLoss() if key == NextTokenLoss.name else as_loss(key)


def classifies(loss: str | Loss) -> bool:
    """Whether ``loss`` scores class logits (batch, classes) against labels, so that accuracy means something."""
    return loss_named(loss).logits_ndim == 2


def labels_as_given(y: torch.Tensor) -> torch.Tensor:
    """Class labels (n,) as integers; targets given whole (a language model's (n, 2L) next ids and
    weights) as they are: rounding the weights would change the loss."""
    return y.long() if y.ndim == 1 else y


def landscape_task(
    model: nn.Module | Task,
    X: torch.Tensor,
    loss: str | Loss | None = None,
    params: Sequence[str] | str | None = None,
) -> Task:
    """The task whose training loss is analysed.

    ``loss`` (``mse``/``ce``/``next-token``/a Loss) and ``params`` (selector: ``all``, ``head``,
    module names, globs) override a Task's own when given; for a bare module they default to
    ``mse`` and ``all``. A classification loss cannot replace a language model's next-token loss
    nor the reverse (their logits have different shapes).
    """
    selector = None if params is None else ([params] if isinstance(params, str) else list(params))
    if isinstance(model, Task):
        changes: dict = {}
        own = as_loss(model.loss)
        if loss is not None:
            wanted = loss_named(loss)
            check_loss_fits(wanted, own, model.name)
            if wanted.name != own.name:
                changes["loss"] = wanted
        if selector is not None:
            changes["params"] = selector
        return dataclasses.replace(model, **changes) if changes else model
    return as_task(model, loss=loss_named(loss) if loss is not None else "mse", params=selector or "all", probe=X)


def check_loss_fits(wanted: Loss, own: Loss, label: str) -> None:
    """Refuse measuring a model with a loss whose logits differ from its own loss' (classifier vs language model)."""
    if wanted.logits_ndim == own.logits_ndim:
        return
    if own.name == NextTokenLoss.name:
        raise AuditError(
            f"loss {wanted.name} scores a classifier's logits, but {label} is a causal language model measured on "
            "its next-token cross-entropy; drop the loss (next-token is used)"
        )
    raise AuditError(
        f"loss {wanted.name} is a causal language model's, but {label} is scored with {own.name}; use mse or ce"
    )


def parameter_names(task: Task, X: torch.Tensor) -> list[str]:
    """The task's selector resolved on its module (``head`` found with a probe row of X)."""
    try:
        return task.parameter_names(X)
    except AuditError as exc:
        raise ParameterSelectionError(str(exc)) from None


def landscape_engine(
    task: Task, X: torch.Tensor, dtype: torch.dtype | str | None = None, names: Sequence[str] | None = None
) -> Engine:
    """The engine over the tracked parameters; copies in ``dtype`` (default: the parameters' own).

    The module is not modified: the engine holds detached copies, runs it in eval mode and
    with the math attention kernel.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise AuditError(f"unknown dtype {dtype!r}; use float64 or float32")
        dtype = DTYPES[dtype]
    names = list(names) if names is not None else parameter_names(task, X)
    return Engine(task, dtype=dtype, names=names)


def check_labels(engine: Engine, y: torch.Tensor) -> None:
    """Labels must index the model's outputs (the one-hot targets have ``n_classes`` columns);
    targets given whole (a language model's) are checked by the loss itself."""
    if y.ndim != 1:
        return
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= engine.n_classes):
        raise AuditError(
            f"the labels go from {int(y.min())} to {int(y.max())} but the model has {engine.n_classes} outputs; "
            "use data whose labels match the model (select classes) or a model with more outputs"
        )


def check_selector(module: nn.Module, params: Sequence[str] | str | None) -> list[str]:
    """Resolve a selector on a module without data (``head`` from its structure); fails if nothing matches."""

    try:
        return select_parameter_names(module, "all" if params is None else params)
    except AuditError as exc:
        raise ParameterSelectionError(str(exc)) from None
