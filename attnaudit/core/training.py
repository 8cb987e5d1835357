"""Deterministic full-batch gradient descent.

Loss normalisations (the NTK predictor in ``ntk.py`` relies on the first one):

* ``mse``: L = 1/(2n) * sum_i ||f(x_i) - y_i||^2 with one-hot targets y_i, so that one GD
  step with learning rate eta moves the training outputs by -(eta/n) Theta (f - Y) to first
  order;
* ``ce``:  L = 1/n * sum_i cross_entropy(f(x_i), label_i).

Plain GD, no momentum, no minibatches: the finite network and its linearisation are then
driven by the same dynamics, and a seed fixes the run completely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from attnaudit.core.fit import Recipe, fit
from attnaudit.core.task import LOSSES as LOSS_TABLE, Inputs, Loss, as_loss
from attnaudit.errors import AuditError

LOSSES = tuple(LOSS_TABLE)  # the core's one loss table: mse, ce


@dataclass(frozen=True)
class TrainConfig:
    """Full-batch GD settings. ``loss_tol`` stops early once the training loss is <= it."""

    loss: str = "mse"
    lr: float = 1.0
    steps: int = 1000
    loss_tol: float | None = None
    checkpoint_every: int | None = None  # keep parameter snapshots (TracIn)
    record_every: int = 1

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise AuditError(f"unknown --loss {self.loss!r}; use one of {', '.join(LOSSES)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise AuditError(f"learning rate must be a positive number, got {self.lr}")
        if self.steps < 0:
            raise AuditError(f"steps must be >= 0, got {self.steps}")
        if self.loss_tol is not None and not self.loss_tol > 0:
            raise AuditError(f"loss tolerance must be positive, got {self.loss_tol}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise AuditError("checkpoint interval must be >= 1")


@dataclass
class TrainResult:
    """What happened during training: loss curve, steps run, whether the tolerance was met."""

    loss_curve: list[float]
    steps_run: int
    final_loss: float
    reached_tol: bool | None
    diverged: bool
    checkpoints: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "steps_run": self.steps_run,
            "final_loss": self.final_loss,
            "reached_tol": self.reached_tol,
            "diverged": self.diverged,
            "loss_curve": self.loss_curve,
        }


def one_hot_targets(y: torch.Tensor, n_classes: int, dtype=torch.float64) -> torch.Tensor:
    """One-hot matrix (n, n_classes) for integer labels."""
    return torch.nn.functional.one_hot(y.long(), n_classes).to(dtype)


def per_sample_loss(outputs: torch.Tensor, y: torch.Tensor, loss: str | Loss) -> torch.Tensor:
    """Per-sample losses (n,) of ``outputs`` (n, c) against integer labels ``y``.

    The one implementation is the core's :class:`~attnaudit.core.task.Loss` (``mse``:
    0.5 ||f - onehot(y)||^2, ``ce``: logsumexp(f) - f_y) on one-hot targets; ``loss`` is
    its name or the object. Works inside ``vmap`` over stacks of outputs.
    """
    target = one_hot_targets(y.to(outputs.device), outputs.shape[-1], outputs.dtype)
    return as_loss(loss).per_sample(outputs, target)


def loss_value(outputs: torch.Tensor, y: torch.Tensor, loss: str | Loss) -> torch.Tensor:
    """The training loss of ``outputs`` (n, c) against integer labels ``y``: the mean of
    :func:`per_sample_loss` (see the module docstring)."""
    return per_sample_loss(outputs, y, loss).mean()


def accuracy(outputs: torch.Tensor, y: torch.Tensor) -> float:
    """Share of rows whose arg-max output equals the label."""
    if len(y) == 0:
        return float("nan")
    return (outputs.argmax(1) == y.to(outputs.device)).double().mean().item()


def require_nonzero_inputs(X: torch.Tensor) -> None:
    """Refuse all-zero training inputs: a bias-free network's outputs and gradients are then all zero."""
    if not bool(torch.any(X != 0)):
        raise AuditError(
            "the training inputs are all zero, so every network output and gradient is zero and there is nothing "
            "to measure; check the data (and --preprocess: centering constant data gives zeros)"
        )


def train(model: nn.Module, X: torch.Tensor, y: torch.Tensor, config: TrainConfig) -> TrainResult:
    """Full-batch GD on (X, y) in place; returns the loss curve (loss before each step, then final).

    The one trainer is :func:`attnaudit.core.fit.fit`; this is its full-batch GD protocol
    (``optimizer="gd"``, the loss evaluated once more after the last step, ``loss_tol``
    stopping, TracIn snapshots every ``checkpoint_every`` steps) with this module's result type.
    X keeps the caller's rows: they must be in the model's dtype (no cast happens here).
    """
    require_nonzero_inputs(X)
    recipe = Recipe(optimizer="gd", lr=config.lr, steps=config.steps, loss=config.loss)
    result = fit(
        model,
        X,
        y,
        recipe,
        inputs=Inputs(),
        loss_tol=config.loss_tol,
        checkpoint_every=config.checkpoint_every,
        record_every=config.record_every,
        final_loss=True,
        evaluate_after=False,
    )
    curve = list(result.loss_curve)
    return TrainResult(
        loss_curve=curve,
        steps_run=result.steps_run,
        final_loss=curve[-1] if curve else float("nan"),
        reached_tol=result.reached_tol,
        diverged=result.diverged,
        checkpoints=result.checkpoints,
    )
