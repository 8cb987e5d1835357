"""Influence malleability: how stable are training-sample influence scores when an
adversary perturbs the training data?

Protocol (one *cell* = seed x model x attack x eps x damping):

1. build the model from the seed (same initialisation for everything that seed touches),
   train on clean data (full-batch GD, :mod:`attnaudit.core.training`), compute the influence
   of every training sample on the summed loss of a clean held-out test set
   (:mod:`attnaudit.analyses.influence.influence`; negative = helpful);
2. perturb the training data against the clean model (:mod:`attnaudit.analyses.malleability.attacks`);
3. ``retrain`` (default, the paper's): rebuild the model with the same initialisation,
   train on the perturbed data, recompute influence of the perturbed samples on the same
   clean test set. ``static``: keep the clean model and recompute influence with the
   perturbed samples (Hessian and gradients on the perturbed training set) -- how one
   audits a fixed checkpoint;
4. compare clean and perturbed influence, sample by sample (sample i stays sample i):

   * flip rate: among the ``top_k`` samples by clean |influence|, the share whose
     influence changes sign (clean x perturbed < 0: helpful <-> harmful; an exact zero is
     not a flip);
   * Spearman rank correlation of the full clean and perturbed influence vectors;
   * top-k overlap: |top-k(clean) n top-k(perturbed)| / k, both by |influence|.

Controls, the floors every adversarial flip rate is read against: the random-noise control
of the same radius (``sign``, +-eps on every coordinate, by default; ``random``, uniform
noise in the ball, when ``sign`` is not in ``--attacks``; reported as ``floors.random``
with the attack it came from) and ``reinit`` (clean data, retrained from a
different initialisation: the flip rate training randomness alone produces). ``none`` is
a pipeline check (deterministic GD on the same data: flip rate 0).

Seeds: each seed fixes the initialisation, the attack's randomness and (``sgd``/``adam``)
the data order; the data split is fixed (chosen once by the caller), unless
``resample_data``: then seed s draws its own train/held-out split (the caller's
:class:`~attnaudit.data.HoldoutRecipe` with its seed replaced by s), so the intervals
include the choice of training rows.

Training (built-in models): ``optimizer`` ``gd`` (default; full-batch gradient descent,
:func:`attnaudit.core.training.train`), or ``sgd``/``adam`` through :func:`attnaudit.core.fit.fit`
(``batch_size`` rows per step, None = full batch; data order from the seed; the reinit
control also draws a new data order). ``lr`` and ``match_loss`` may be given per model.

Untrained models: a model whose mean clean training accuracy is below
1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n_train)) (chance plus a few points, or two binomial
standard errors) is flagged ``untrained`` and every verdict about it makes no claim. Over seeds we report mean, sample standard deviation
and Student's t interval (shares such as the flip rate: the variance floored at the binomial
variance of top-k items, :func:`attnaudit.core.stats.proportion_interval`). Model ratios (each
model over the first of ``models``) get Fieller's interval pairing the same seeds. A seed
whose comparison ran on bitwise the inputs of an earlier seed (a deterministic attack on a
saved model's fixed rows) is a copy, not a replicate: it is counted once
(:func:`~attnaudit.analyses.malleability.stability.distinct_replicates`), and its influence runs are not computed again.

Cost: seeds x models x (1 + reinit + eps x attacks) trainings and influence computations;
see :func:`~attnaudit.analyses.malleability.planning.progress_total`. Memory: the data, a handful of models, and the influence
estimator's own need (recorded in the diagnostics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from attnaudit.analyses.influence.influence import SIGN_CONVENTION
from attnaudit.analyses.malleability.aggregate import aggregate, loss_gate, model_status, sensitivity
from attnaudit.analyses.malleability.attacks import ADVERSARIAL
from attnaudit.analyses.malleability.cell_tools import split_info
from attnaudit.analyses.malleability.cells import CellPlan, CellState
from attnaudit.analyses.malleability.config import AUTO_MATCH, MalleabilityConfig
from attnaudit.analyses.malleability.planning import (
    check_inputs,
    check_saved_models,
    for_saved_models,
    plan_memory,
    progress_total,
)
from attnaudit.analyses.malleability.training import resolve_auto_match
from attnaudit.analyses.malleability.verdicts import run_warnings, summary_warnings, verdicts
from attnaudit.core.task import Task
from attnaudit.runtime.sweep import CellTask, ExecutorConfig, cached, clear_cache, run_cells

if TYPE_CHECKING:
    from attnaudit.data import HoldoutRecipe

__all__ = ["SCHEMA", "MalleabilityConfig", "MalleabilityResult", "run_malleability"]

SCHEMA = "attnaudit.malleability/1"
CELLS = "attnaudit.analyses.malleability.cells"  # the module of the cell functions the executor runs


@dataclass
class MalleabilityResult:
    """Everything measured; ``to_dict`` is the JSON ``results`` block (schema malleability/1)."""

    config: MalleabilityConfig
    runs: list[dict]
    controls: list[dict]
    training: list[dict]
    attacks: list[dict]
    summary: list[dict]
    ratios: list[dict]
    sensitivity: dict
    influence_diagnostics: list[dict]
    exceeded: list[dict]
    warnings: list[str]
    verdicts: list[str]
    timings: dict
    n_train: int
    n_test: int
    influence_memory: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)  # for the figure, not serialised
    failed_cells: list = field(default_factory=list)
    execution: dict = field(default_factory=dict)  # executor, cells, resumed (how it ran; not a result)
    model_status: list = field(default_factory=list)  # per model: chance, threshold, train accuracy, untrained
    splits: list = field(default_factory=list)  # per seed: the rows it trained and was measured on
    edits: list = field(default_factory=list)  # token attacks: each perturbed text's swaps (not serialised)
    precision_check: list = field(default_factory=list)  # per model: the float64 spot check (lower precision only)
    #: how ``match_loss="auto"`` was resolved (the rule, the target, the budget runs); None otherwise
    match_loss_resolution: dict | None = None

    def _no_check(self) -> dict:
        """Why the report holds no float64 spot check."""
        if self.config.precision == "float64":
            return {"status": "not needed", "why": "influence ran in float64"}
        if self.config.estimator == "tracin":
            return {
                "status": "not computed",
                "why": "TracIn's checkpoints come from the models' training, which is not repeated in float64",
            }
        return {"status": "not computed", "why": "no cell of the first seed finished"}

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(self.match_loss_resolution),
            "failed_cells": self.failed_cells,
            "sign_convention": SIGN_CONVENTION,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "summary": self.summary,
            "ratios": self.ratios,
            "sensitivity": self.sensitivity,
            "training": self.training,
            "attacks": self.attacks,
            "runs": self.runs,
            "controls": self.controls,
            "influence_memory_estimate": self.influence_memory,
            "influence_diagnostics": self.influence_diagnostics,
            "precision": self.config.precision_policy.to_dict(),
            "precision_check": self.precision_check or self._no_check(),
            "exceeded": self.exceeded,
            "untrained": {r["model"]: r["untrained"] for r in self.model_status},
            "model_status": self.model_status,
            "splits": self.splits,
        }


def run_malleability(
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    n_classes: int,
    config: MalleabilityConfig,
    *,
    value_range: tuple[float, float] | None = None,
    progress: Callable[[int], None] | None = None,
    fixed_models: dict[str, nn.Module | Task] | None = None,
    rebuild: dict | None = None,
    executor: ExecutorConfig | None = None,
    data: HoldoutRecipe | None = None,
    memory: dict | None = None,
) -> MalleabilityResult:
    """Run the malleability protocol (module docstring) on a fixed train/test split.

    ``value_range``: the data's valid range (attacks clip to it); None = no clipping.
    ``fixed_models``: already-trained models keyed by label (a user's checkpoints), audited
    under ``config.protocol`` (static: as they are; finetune: fine-tuned copies; retrain: their
    recorded recipe ``rebuild[label]`` re-run); ``config.models`` are then their labels.
    Tensors may live on any device; everything runs there in float64. A saved model is
    never modified (one in another dtype or on another device is audited through a copy).
    ``memory``: the plan of :func:`~attnaudit.analyses.malleability.planning.plan_memory`
    when the caller made it (the command line, to say it before any training); else it is made here.

    Each seed x model is one cell (:class:`~attnaudit.analyses.malleability.cells.Cell`: its
    trainings, attacks and influences) run by ``executor`` (:mod:`attnaudit.runtime.sweep`;
    default in this process). Executors other than the in-process one need ``data``, the recipe
    the tensors came from, and built-in models (saved models are audited in this process). A
    seed with a failed cell is left out of the summaries and listed in ``failed_cells``.
    """
    rebuild = rebuild or {}
    ex = executor or ExecutorConfig()
    if fixed_models:
        check_saved_models(config, fixed_models, rebuild, n_classes, int(X_train.shape[1]))
        config = for_saved_models(config, fixed_models)
    n_train, n_test = int(X_train.shape[0]), int(X_test.shape[0])
    check_inputs(config, y_train, y_test, n_train, n_classes, bool(fixed_models), data, ex)
    if memory is None:
        memory = plan_memory(config, X_train, n_test, n_classes, fixed_models)  # refuses before any compute
    plan = CellPlan.of(config, value_range)
    state = CellState(
        X_train, y_train, X_test, y_test, n_classes, plan, fixed_models, rebuild, split_info(X_train, y_train, data)
    )
    outcomes, resolution = _run_cells(state, value_range, ex, data, progress)
    return _result(config, outcomes, resolution, memory, ex, n_train, n_test, n_classes)


def _run_cells(
    state: CellState,
    value_range: tuple | None,
    ex: ExecutorConfig,
    data: HoldoutRecipe | None,
    progress: Callable[[int], None] | None,
) -> tuple[list, dict | None]:
    """Every cell's outcome (after the budget runs that resolve ``match_loss="auto"``) and that resolution."""
    config = state.plan.config
    memory_key = data.key if data is not None else f"memory:{id(state.X_train)}"
    base = {
        "data": None if data is None else data.to_dict(),
        "memory_key": memory_key,
        "n_classes": state.n_classes,
        "value_range": None if value_range is None else list(value_range),
        "device": str(state.X_train.device),
    }

    def seed_data(seed: int) -> dict:
        """The cell's data: the caller's rows, or (resample_data) the recipe's split drawn with ``seed``."""
        if not config.resample_data:
            return {}
        assert data is not None  # resample_data without a recipe is refused before
        rec = replace(data, seed=int(seed))
        return {"data": rec.to_dict(), "memory_key": rec.key}

    def cells(fn: str, plan: CellPlan) -> list:
        return [
            CellTask(f"{CELLS}:{fn}", {**base, "plan": plan, **seed_data(s), "seed": s, "arch": a}, f"{a} seed {s}")
            for s in config.seeds
            for a in config.models
        ]

    per_cell = progress_total(config) // (len(config.seeds) * len(config.models))
    resolution = None
    plan = state.plan
    try:
        cached(f"malleability:{memory_key}", lambda: state)
        if config.match_loss == AUTO_MATCH:
            resolution = resolve_auto_match(config, run_cells(cells("budget_loss_cell", plan), ex))
            plan = plan.with_targets({m: resolution["target"] for m in config.models})
        done = (lambda o: progress(per_cell)) if progress is not None else None
        outcomes = run_cells(cells("malleability_cell", plan), ex, on_done=done)
    finally:
        clear_cache()
    return outcomes, resolution


def merge_outcomes(outcomes: list, seeds: tuple) -> dict:
    """The rows of every cell whose seed has no failed cell, merged: runs, controls, training,
    attacks, diagnostics, influence warnings (counted), examples, edits, splits and timings."""
    bad_seeds = {o.task.config["seed"] for o in outcomes if not o.ok}
    keys = ("runs", "controls", "training", "attacks", "diagnostics", "edits", "precision_check")
    merged: dict = {key: [] for key in keys} | {"influence_warnings": {}, "examples": {}, "splits": []}
    merged["timings"] = {"train": 0.0, "attack": 0.0, "influence": 0.0}
    merged["bad_seeds"] = bad_seeds
    for o in outcomes:
        if not o.ok or o.task.config["seed"] in bad_seeds:
            continue
        raw = o.result
        for key in keys:
            merged[key] += raw.get(key, [])
        for w, k in raw["influence_warnings"].items():
            merged["influence_warnings"][w] = merged["influence_warnings"].get(w, 0) + k
        for arch, rows in raw["examples"].items():
            merged["examples"].setdefault(arch, {}).update(rows)
        for part in merged["timings"]:
            merged["timings"][part] += raw["timings"][part]
        if raw.get("split") is not None:
            row = {"seed": o.task.config["seed"], **raw["split"]}
            if row not in merged["splits"]:
                merged["splits"].append(row)
    merged["splits"].sort(key=lambda r: seeds.index(r["seed"]))
    return merged


def _result(
    config: MalleabilityConfig,
    outcomes: list,
    resolution: dict | None,
    memory: dict,
    ex: ExecutorConfig,
    n_train: int,
    n_test: int,
    n_classes: int,
) -> MalleabilityResult:
    """The cells' rows aggregated over seeds, read against their floors and turned into warnings and verdicts."""
    failed = [o.failure() for o in outcomes if not o.ok]
    m = merge_outcomes(outcomes, config.seeds)
    training = m["training"]
    targets = {a: resolution["target"] if resolution else config.match_loss_for(a) for a in config.models}
    status = model_status(config, training, n_classes, n_train)
    summary, ratios = aggregate(config, m["runs"], m["controls"], status)
    sens = sensitivity(config, summary)
    warnings = run_warnings(config, training, m["influence_warnings"], targets)
    warnings += [
        f"{row['model']}: " + row["warning"] for row in m["precision_check"] if not row["agrees"] and row.get("warning")
    ]
    warnings += summary_warnings(config, summary, status, failed, len(outcomes), m["bad_seeds"])
    loss_gate(config, training, ratios)
    exceeded = []
    if config.max_flip_rate is not None:
        for row in summary:
            if row["attack"] not in ADVERSARIAL:  # the gate counts attacks; controls are context
                continue
            mean = row["flip_rate"]["mean"]
            if mean is not None and mean > config.max_flip_rate:
                exceeded.append({k: row[k] for k in ("model", "attack", "eps", "damping")} | {"flip_rate": mean})
    return MalleabilityResult(
        config=config,
        runs=m["runs"],
        controls=m["controls"],
        training=training,
        attacks=m["attacks"],
        summary=summary,
        ratios=ratios,
        sensitivity=sens,
        influence_diagnostics=m["diagnostics"],
        precision_check=m["precision_check"],
        exceeded=exceeded,
        warnings=warnings,
        verdicts=verdicts(config, summary, ratios, sens, exceeded, status),
        timings=m["timings"],
        n_train=n_train,
        n_test=n_test,
        influence_memory=memory,
        examples=m["examples"],
        edits=m["edits"],
        failed_cells=failed,
        execution={**ex.to_dict(), "cells": len(outcomes), "resumed": sum(o.resumed for o in outcomes)},
        model_status=status,
        splits=m["splits"],
        match_loss_resolution=resolution,
    )
