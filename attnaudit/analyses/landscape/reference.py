"""The built-in reference models of the landscape comparison and how they are trained.

2L-ReLU (``relu``) and MLP-Attn (``attn``) of a given width, initialised from a seed
(:func:`build_reference_model`), trained with the project's full-batch GD
(:func:`attnaudit.core.training.train`) or, with a :class:`~attnaudit.core.fit.Recipe`, with
:func:`attnaudit.core.fit.fit` (:func:`train_one`). With ``match_loss auto`` every model and
seed first runs the whole step budget, and the largest final loss becomes the common target
(:func:`auto_match_loss`); each budget run keeps its loss at every step and parameter snapshots
(:class:`BudgetRun`), from which its matched run is resumed instead of trained again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from attnaudit.core import training as gd
from attnaudit.core.fit import Recipe, fit
from attnaudit.core.task import Inputs
from attnaudit.core.training import TrainConfig, train
from attnaudit.errors import AuditError
from attnaudit.models.builtin import ModelSpec, build_model

ARCHS = ("relu", "attn")

#: (X, y) a model seed trains and is analysed on
Rows = Callable[[int], tuple[torch.Tensor, torch.Tensor]]

#: parameter snapshots a budget run keeps: at most this many per run, and all runs' together
#: within :data:`SNAPSHOT_BYTES`
MAX_SNAPSHOTS = 16
SNAPSHOT_BYTES = 256 * 2**20


@dataclass
class BudgetRun:
    """What a ``match_loss auto`` budget run leaves for its matched run: full-batch GD is a
    deterministic function of the parameters (no optimizer state), so the run to a loss L* is the
    budget run stopped at its first step k with loss <= L*.

    ``losses[t]``: the loss before step t (t < steps), then after the last step; ``snapshots``:
    the parameters before steps 0, every, 2 every, ... and after the last step; ``rows``: the
    training rows.
    """

    losses: list[float]
    snapshots: list[dict[str, torch.Tensor]]
    every: int
    rows: torch.Tensor

    def snapshot_step(self, i: int) -> int:
        return min(i * self.every, len(self.losses) - 1)

    def matches(self, net: nn.Module, X: torch.Tensor) -> bool:
        """Whether ``net`` (untrained) and ``X`` are this run's starting point, bit for bit."""
        start = self.snapshots[0]
        params = dict(net.named_parameters())
        return (
            X.shape == self.rows.shape
            and bool(torch.equal(X, self.rows))
            and params.keys() == start.keys()
            and all(torch.equal(params[k].detach(), v) for k, v in start.items())
        )

    def resume(self, net: nn.Module, X: torch.Tensor, y: torch.Tensor, config: TrainConfig) -> gd.TrainResult:
        """``gd.train(net, X, y, config)`` with ``config.loss_tol`` = L* >= the budget's final loss:
        the same parameters and record, from the last snapshot at or before the stopping step k
        (at most ``every`` GD steps instead of k)."""
        tol = config.loss_tol
        assert tol is not None and self.losses[-1] <= tol  # L* is the largest final loss of the budget runs
        k = next(t for t, value in enumerate(self.losses) if value <= tol)
        i = max(j for j in range(len(self.snapshots)) if self.snapshot_step(j) <= k)
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(self.snapshots[i][name])
        todo = k - self.snapshot_step(i)
        if todo:
            # what gd.train runs, without its stopping rule: the same updates, bit for bit
            recipe = Recipe(optimizer="gd", lr=config.lr, steps=todo, loss=config.loss)
            fit(net, X, y, recipe, inputs=Inputs(), evaluate_after=False)
        every = config.record_every
        curve = [value for t, value in enumerate(self.losses[:k]) if t % every == 0] + [self.losses[k]]
        return gd.TrainResult(
            loss_curve=curve, steps_run=k, final_loss=curve[-1], reached_tol=True, diverged=False, checkpoints=[]
        )


def build_reference_model(arch: str, X: torch.Tensor, n_classes: int, *, width: int, seed: int) -> nn.Module:
    """2L-ReLU / MLP-Attn of ``width`` initialised from ``seed`` (MLP-Attn's context from X), in X's dtype and device."""

    spec = ModelSpec(arch, int(X.shape[1]), int(width), int(n_classes), seed=int(seed))  # type: ignore[arg-type]
    return build_model(spec, X, dtype=X.dtype, device=X.device)


def train_reference_model(
    arch: str, X: torch.Tensor, y: torch.Tensor, n_classes: int, *, width: int, seed: int, train_config
):
    """Build 2L-ReLU / MLP-Attn with ``seed`` and train it with the project's full-batch GD.

    Uses the same training path as every command (:func:`attnaudit.core.training.train`).
    Returns (model, TrainResult).
    """

    model = build_reference_model(arch, X, n_classes, width=width, seed=seed)
    return model, train(model, X, y.long(), train_config)


def train_one(
    label: str,
    net: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    train_config: TrainConfig,
    recipe: Recipe | None,
    seed: int,
    budget_run: BudgetRun | None = None,
) -> dict:
    """Train one built-in model (full-batch GD, or :func:`attnaudit.core.fit.fit` with ``recipe``,
    its data order from ``seed``); its training record, with ``_units`` the progress units it ran.
    ``budget_run``: its ``match_loss auto`` budget run, resumed when it started from this model and
    these rows (:meth:`BudgetRun.resume`)."""
    if recipe is None:
        if budget_run is not None and train_config.loss_tol is not None and budget_run.matches(net, X):
            tr = budget_run.resume(net, X, y, train_config)
        else:
            tr = gd.train(net, X, y, train_config)
        if tr.diverged:
            raise AuditError(f"training {label} diverged (loss {tr.final_loss}); lower the learning rate")
        return {
            "steps_run": tr.steps_run,
            "final_loss": tr.final_loss,
            "reached_match_loss": tr.reached_tol,
            "loss_curve_every_10": tr.loss_curve,
            "model_seed": seed,
            "optimizer": "gd",
            "_units": train_config.steps,
        }

    rec = dataclasses.replace(recipe, seed=int(seed))
    res = fit(net, X, y, rec)
    if res.diverged:
        reason = res.notes[0] if res.notes else "non-finite loss"
        raise AuditError(f"training {label} diverged ({reason}); lower the learning rate")
    reached = None if train_config.loss_tol is None else bool(res.final_train_loss <= train_config.loss_tol)
    return {
        "steps_run": res.steps_run,
        "final_loss": res.final_train_loss,
        "reached_match_loss": reached,
        "loss_curve_every_10": res.loss_curve[::10],
        "model_seed": seed,
        "optimizer": rec.optimizer,
        "batch_size": rec.batch_size,
        "lr": rec.lr,
        "train_accuracy": res.train_accuracy,
        "path": res.path,
        "_units": rec.total_steps(int(X.shape[0])),
    }


def auto_match_loss(
    labels: Iterable[str], seeds: Iterable[int], rows: Rows, n_classes: int, width: int, train_config: TrainConfig
) -> tuple[TrainConfig, dict, dict[tuple[str, int], BudgetRun]]:
    """``match_loss auto``: train every model and seed for the whole step budget (full-batch GD);
    the largest final loss L* becomes ``loss_tol``. Returns (the training config with L*, the
    resolution recorded in the report: rule, target, which run set it, every run's loss; each
    run's :class:`BudgetRun` by (model, seed), from which :func:`train_one` resumes it)."""
    labels, seeds = list(labels), list(seeds)
    runs: list[dict] = []
    kept: dict[tuple[str, int], BudgetRun] = {}
    for label in labels:
        for s in seeds:
            Xs, ys = rows(s)
            net = build_reference_model(label, Xs, n_classes, width=width, seed=s)
            size = sum(p.numel() * p.element_size() for p in net.parameters())
            count = max(1, min(MAX_SNAPSHOTS, SNAPSHOT_BYTES // max(1, size * len(labels) * len(seeds)) - 1))
            every = max(1, -(-train_config.steps // count))
            budget = dataclasses.replace(train_config, loss_tol=None, record_every=1, checkpoint_every=every)
            tr = train(net, Xs, ys, budget)
            if tr.diverged:
                raise AuditError(f"training {label} diverged (loss {tr.final_loss}); lower the learning rate")
            runs.append({"model": label, "seed": s, "final_loss": float(tr.final_loss), "steps_run": tr.steps_run})
            kept[(label, s)] = BudgetRun(list(tr.loss_curve), tr.checkpoints, every, Xs)
    slowest = max(runs, key=lambda r: r["final_loss"])
    resolution = {
        "rule": "auto: the largest training loss any model reaches within the step budget",
        "target": slowest["final_loss"],
        "set_by": f"{slowest['model']} seed {slowest['seed']}",
        "budget_steps": budget.steps,
        "budget_runs": runs,
    }
    return dataclasses.replace(train_config, loss_tol=slowest["final_loss"]), resolution, kept


def optimizer_record(train_config: TrainConfig | None, recipe: Recipe | None) -> dict | None:
    """How the built-in models were trained, as the report records it (None for saved models)."""
    if train_config is None:
        return None
    if recipe is not None:
        return recipe.to_dict()
    return {
        "optimizer": "gd",
        "lr": train_config.lr,
        "batch_size": None,
        "steps": train_config.steps,
        "loss": train_config.loss,
    }
