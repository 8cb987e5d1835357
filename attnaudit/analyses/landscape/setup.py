"""What the landscape analyses: a :class:`~attnaudit.core.task.Task` and its engine.

A bare ``nn.Module`` is wrapped in a task (flat inputs, logits width read from one probe
row); a Task keeps its inputs and output adapter, and the analysis' loss and parameter
selector, when given, replace the task's own. Parameters are resolved once, here, so a
selector that matches nothing fails before any compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from attnaudit.core.engine import Engine
from attnaudit.core.task import Task, as_loss, as_task
from attnaudit.errors import AuditError
from attnaudit.core.task import select_parameter_names

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


class ParameterSelectionError(AuditError):
    """The parameter selector matches nothing on a model (the CLI maps it to ``--params``)."""


def landscape_task(
    model: nn.Module | Task, X: torch.Tensor, loss: str | None = None, params: Sequence[str] | str | None = None
) -> Task:
    """The task whose training loss is analysed.

    ``loss`` (``mse``/``ce``/a Loss) and ``params`` (selector: ``all``, ``head``, module
    names, globs) override a Task's own when given; for a bare module they default to
    ``mse`` and ``all``.
    """
    selector = None if params is None else ([params] if isinstance(params, str) else list(params))
    if isinstance(model, Task):
        changes: dict = {}
        if loss is not None and as_loss(loss).name != as_loss(model.loss).name:
            changes["loss"] = as_loss(loss)
        if selector is not None:
            changes["params"] = selector
        return dataclasses.replace(model, **changes) if changes else model
    return as_task(model, loss=loss if loss is not None else "mse", params=selector or "all", probe=X)


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
    """Labels must index the model's outputs (the one-hot targets have ``n_classes`` columns)."""
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
