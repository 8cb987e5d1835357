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

from attnaudit.core.task import LOSSES as LOSS_TABLE, Loss, as_loss
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
    """Full-batch GD on (X, y) in place; returns the loss curve (loss before each step, then final)."""
    require_nonzero_inputs(X)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs, forward = X, model
    if getattr(model, "context", None) is not None and hasattr(model, "mlp"):
        # MLP-Attn's input map is a fixed buffer, so GD on (X, y) is GD of the MLP on
        # (f_att(X), y): the same parameter trajectory without an n x d x d product per step.
        with torch.no_grad():
            inputs = model.features_in(X)  # type: ignore[operator]  # nn.Module attribute: a TwoLayerNet method
        forward = model.mlp  # type: ignore[assignment]  # nn.Module attribute: a TwoLayerNet method
    curve: list[float] = []
    checkpoints: list[dict[str, torch.Tensor]] = []
    reached = None if config.loss_tol is None else False
    diverged = False
    steps_run = 0

    def snapshot() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    for step in range(config.steps + 1):
        model.zero_grad(set_to_none=True)
        loss = loss_value(forward(inputs), y, config.loss)
        value = loss.item()
        # the step that stops the run is always recorded, so final_loss is the loss at the end
        stopping = not math.isfinite(value) or (config.loss_tol is not None and value <= config.loss_tol)
        if step % config.record_every == 0 or step == config.steps or stopping:
            curve.append(value)
        if not math.isfinite(value):
            diverged = True
            break
        if config.loss_tol is not None and value <= config.loss_tol:
            reached = True
            break
        if config.checkpoint_every and step % config.checkpoint_every == 0:
            checkpoints.append(snapshot())
        if step == config.steps:
            break
        loss.backward()
        with torch.no_grad():
            for p in params:
                assert p.grad is not None  # every trained parameter is in the loss's graph
                p.add_(p.grad, alpha=-config.lr)
        steps_run += 1
    if config.checkpoint_every and (not checkpoints or steps_run % config.checkpoint_every):
        checkpoints.append(snapshot())
    return TrainResult(
        loss_curve=curve,
        steps_run=steps_run,
        final_loss=curve[-1] if curve else float("nan"),
        reached_tol=reached,
        diverged=diverged,
        checkpoints=checkpoints,
    )
