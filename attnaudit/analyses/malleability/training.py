"""Training a cell's built-in models: full-batch GD or a mini-batch recipe (sgd/adam), each
optionally until the training loss reaches a target (``match_loss``), and the resolution of
``match_loss="auto"`` from the step-budget runs."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import nn

from attnaudit.analyses.malleability.config import MalleabilityConfig
from attnaudit.core.fit import fit as fit_recipe
from attnaudit.core.training import TrainConfig, TrainResult, loss_value, require_nonzero_inputs, train
from attnaudit.analyses.request import FieldError, literal
from attnaudit.models.builtin import ModelSpec, TwoLayerNet, build_model


class _MatchLossReached(Exception):
    """Raised from fit's progress callback to stop training at the match_loss target."""


def sampled_curve(curve: list[float], points: int = 11) -> list[list]:
    """[[step, loss], ...] at up to ``points`` evenly spaced entries of a loss curve (step = index)."""
    if not curve:
        return []
    idx = sorted(set(np.linspace(0, len(curve) - 1, min(points, len(curve))).round().astype(int).tolist()))
    return [[int(i), float(curve[i])] for i in idx]


def train_recipe(model: TwoLayerNet, X: torch.Tensor, y: torch.Tensor, recipe, loss_tol: float | None) -> TrainResult:
    """Train a built-in model with an :class:`attnaudit.core.fit.Recipe` (sgd/adam); with ``loss_tol``
    stop once the loss over the whole training set is <= it, checked before training and
    after every epoch (every step when full-batch)."""

    require_nonzero_inputs(X)
    n = int(X.shape[0])
    per_epoch = recipe.steps_per_epoch(n)
    forward: Callable[[torch.Tensor], torch.Tensor]
    if getattr(model, "context", None) is not None and hasattr(model, "mlp"):
        feats, forward = model.features_in(X).detach(), model.mlp
    else:
        feats, forward = X, model

    def full_loss() -> float:
        with torch.no_grad():
            return loss_value(forward(feats), y, recipe.loss).item()

    steps = {"n": 0}
    checks: list[float] = []

    def check(_k: int = 1) -> None:
        steps["n"] += 1
        if steps["n"] % per_epoch == 0:
            v = full_loss()
            checks.append(v)
            if loss_tol is not None and v <= loss_tol:  # check runs only with a loss_tol
                raise _MatchLossReached

    if loss_tol is not None:
        v0 = full_loss()
        if v0 <= loss_tol:
            return TrainResult(loss_curve=[v0], steps_run=0, final_loss=v0, reached_tol=True, diverged=False)
        checks.append(v0)
    try:
        res = fit_recipe(model, X, y, recipe, progress=check if loss_tol is not None else None)
    except _MatchLossReached:
        return TrainResult(
            loss_curve=checks, steps_run=steps["n"], final_loss=checks[-1], reached_tol=True, diverged=False
        )
    final = full_loss() if not res.diverged else float("nan")
    return TrainResult(
        loss_curve=list(res.loss_curve) + [final],
        steps_run=res.steps_run,
        final_loss=final,
        reached_tol=None if loss_tol is None else bool(final <= loss_tol),
        diverged=res.diverged,
    )


def train_builtin(
    config: MalleabilityConfig,
    spec: ModelSpec,
    X_ctx: torch.Tensor,
    X: torch.Tensor,
    y: torch.Tensor,
    order_seed: int,
    what: str,
    gd: TrainConfig,
) -> tuple[nn.Module, TrainResult]:
    """A built-in model of ``spec`` (attention context ``X_ctx``) trained on (X, y): full-batch GD
    with ``gd`` (the model's settings, loss target ``gd.loss_tol`` included), or the config's
    sgd/adam recipe with data order ``order_seed`` to the same target; divergence is a one-line error."""
    model = build_model(spec, X_ctx, dtype=torch.float64, device=X.device)
    if config.optimizer == "gd":
        tr = train(model, X, y, gd)
    else:
        tr = train_recipe(model, X, y, config.recipe(spec.arch, order_seed), gd.loss_tol)
    if tr.diverged:
        raise FieldError(
            "lr",
            f"training diverged for {spec.arch} ({what}) at " + "{name} " + f"{config.lr_for(spec.arch):g}; lower it",
        )
    return model, tr


def resolve_auto_match(config: MalleabilityConfig, outcomes: list) -> dict:
    """``match_loss="auto"`` made concrete: L* = the largest clean training loss any model
    reaches within the step budget (over every seed); every model is then trained until its
    loss is <= L*, so the slowest stops where its budget ends and the others where they first
    reach the same loss. Returns the resolution: the rule, the ``target`` L* and the budget runs."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise FieldError(
            "match_loss",
            "{name} auto: the step-budget run of " + literal(f"{failed[0].task.label} failed: {failed[0].error}"),
        )
    runs = [o.result for o in outcomes]
    target = max(r["final_loss"] for r in runs)
    if not (math.isfinite(target) and target > 0):
        raise FieldError(
            "match_loss",
            "{name} auto: the step-budget runs ended at training loss " + literal(target) + "; give {name} a "
            "number or none",
        )
    slowest = max(runs, key=lambda r: r["final_loss"])
    resolution = {
        "rule": "auto: the largest clean training loss any model reaches within the step budget",
        "target": target,
        "set_by": f"{slowest['model']} seed {slowest['seed']}",
        "budget_steps": config.steps,
        "budget_runs": runs,
    }
    return resolution
