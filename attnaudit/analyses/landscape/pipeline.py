"""The two-model comparison as a library function: train (or take saved) models, analyse each, compare.

:func:`run_landscape` builds every model and resolves the parameter selector on each before
any training or analysis, so a selector that matches nothing fails at once; it returns a
:class:`LandscapeRun` (each model's :class:`~.analysis.LandscapeResult`, per seed, with the
comparison's verdicts and warnings). ``attnaudit landscape`` calls it from :mod:`.run`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from attnaudit.analyses.landscape.analysis import LandscapeConfig, LandscapeResult, analyse_landscape
from attnaudit.analyses.landscape.compare import compare_landscapes, seed_record, seed_summary, untrained_status
from attnaudit.analyses.landscape.reference import (
    ARCHS,
    auto_match_loss,
    build_reference_model,
    optimizer_record,
    train_one,
)
from attnaudit.analyses.landscape.setup import labels_as_given, landscape_task, parameter_names
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core import training as gd
from attnaudit.core.fit import Recipe
from attnaudit.core.task import Task
from attnaudit.data import data_fingerprint
from attnaudit.errors import AuditError
from attnaudit.models.builtin import training_data_mismatch

Progress = Callable[[int], None] | None


def run_work_units(config: LandscapeConfig, n_models: int, train_steps: int = 0) -> int:
    """Progress units of :func:`run_landscape`: each model's training steps and analysis."""
    return n_models * (config.work_units() + train_steps)


@dataclass(frozen=True)
class LandscapeRun:
    """Landscapes of several models on the same data, with the comparison's verdicts and warnings.

    ``training[label]``: how the model came to be (trained here: steps run, final loss,
    loss curve, seed; saved: its source and spec). ``lr``: the GD learning rate when the
    models were trained here with full-batch GD (GD's stability bound is 2 / lr), else None.
    ``results``: the first seed's analysis per model; ``seed_results``: every seed's (``seeds``
    lists them; one seed unless ``--seeds``). ``status[label]``: the untrained rule (chance,
    threshold, mean training accuracy, ``untrained``).
    """

    results: dict[str, LandscapeResult]
    training: dict[str, dict]
    verdicts: tuple[str, ...]
    warnings: tuple[str, ...]
    lr: float | None = None
    timings: dict = field(default_factory=dict)
    seed_results: dict[str, list[LandscapeResult]] = field(default_factory=dict)
    seed_training: dict[str, list[dict]] = field(default_factory=dict)
    seeds: tuple[int, ...] = ()
    status: dict[str, dict] = field(default_factory=dict)
    optimizer: dict | None = None
    #: ``match_loss_auto``: the rule, each model's and seed's loss after the step budget, and
    #: the common target L* every model was then trained to (None otherwise)
    match_loss_resolution: dict | None = None

    @property
    def labels(self) -> list[str]:
        return list(self.results)

    def model_dict(self, label: str) -> dict:
        out = {"training": self.training[label], **self.results[label].to_dict()}
        st = self.status.get(label)
        if st is not None:
            out.update({"untrained": st["untrained"], "chance": st["chance"], "untrained_threshold": st["threshold"]})
        runs = self.seed_results.get(label)
        if runs:
            seeds = self.seeds or tuple(range(len(runs)))
            out["seeds"] = seed_summary([seed_record(s, r) for s, r in zip(seeds, runs)])
            if self.seed_training.get(label):
                out["seeds"]["training"] = self.seed_training[label]
        return out

    def to_dict(self) -> dict:
        return {
            "models": {k: self.model_dict(k) for k in self.results},
            "gd_stability_bound": None if self.lr is None else 2.0 / self.lr,
            "optimizer": self.optimizer,
            "verdicts": list(self.verdicts),
            "warnings": list(self.warnings),
        }


def _saved_checks(label: str, net: nn.Module | Task, X: torch.Tensor, y: torch.Tensor) -> None:
    spec = getattr(net.module if isinstance(net, Task) else net, "spec", None)
    if spec is None:
        return
    if getattr(spec, "d_in", X.shape[1]) != X.shape[1]:
        raise AuditError(
            f"saved model {label} takes {spec.d_in} input features but the data have {X.shape[1]}; use the data it was trained on"
        )
    if y.ndim == 1 and int(y.max()) >= getattr(spec, "n_out", int(y.max()) + 1):
        raise AuditError(
            f"saved model {label} has {spec.n_out} outputs but the labels go up to {int(y.max())}; select matching classes"
        )


def _saved_nets(
    saved: Mapping[str, nn.Module | Task], saved_info: Mapping[str, dict], X: torch.Tensor, y: torch.Tensor
) -> tuple[dict[str, nn.Module | Task], dict[str, dict], list[str]]:
    """(nets, training records, provenance warnings) of saved models analysed on (X, y)."""
    nets = dict(saved)
    training: dict[str, dict] = {}
    for label, net in nets.items():
        _saved_checks(label, net, X, y)
        module = net.module if isinstance(net, Task) else net
        spec = getattr(module, "spec", None)
        training[label] = {**saved_info.get(label, {})}
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            training[label]["spec"] = dataclasses.asdict(spec)
    # models whose audited rows were drawn from their own recorded training split need no warning
    own_rows = {
        label for label, info in saved_info.items() if (info.get("audit_rows") or {}).get("rows") == "checkpoint split"
    }
    return nets, training, _provenance({k: v for k, v in nets.items() if k not in own_rows}, X, y)


def _check_arguments(
    saved: Mapping | None,
    models: Sequence[str] | None,
    seed_list: tuple[int, ...],
    recipe: Recipe | None,
    seed_data: Mapping[int, Any] | None,
) -> None:
    """Refuse arguments of :func:`run_landscape` that contradict each other (each names its argument)."""
    if saved and models:
        raise FieldError("models", "give reference {name} to train or saved models to analyse, not both")
    if not saved:
        archs = tuple(models) if models is not None else ARCHS
        bad = [a for a in archs if a not in ARCHS]
        if bad:
            raise FieldError(
                "models", "unknown reference model in {name}: " + literal(repr(bad[0])) + "; use relu, attn or both"
            )
        if len(set(archs)) != len(archs) or not archs:
            raise FieldError("models", "list each reference model once in {name} (relu, attn)")
    if not seed_list or len(set(seed_list)) != len(seed_list):
        raise FieldError("seeds", "give at least one of {name}, each once")
    if saved and len(seed_list) > 1:
        raise FieldError("seeds", "{name} trains independent copies of the built-in models; a saved model is one model")
    if recipe is not None and saved:
        raise FieldError("recipe", "{name} says how to train the built-in models; a saved model is trained already")
    if seed_data is not None:
        if saved:
            raise FieldError(
                "seed_data", "{name} holds new training rows per seed, which a saved model was not trained on; drop it"
            )
        missing = [s for s in seed_list if s not in seed_data]
        if missing:
            raise FieldError(
                "seed_data", "{name} holds no rows for seed(s) " + f"{', '.join(map(str, missing))}; give every seed's"
            )
        if any(seed_data[s].y is None for s in seed_list):
            raise AuditError("the loss landscape needs labelled data")


def run_landscape(
    data,
    config: LandscapeConfig,
    *,
    models: Sequence[str] | None = None,
    width: int = 256,
    train_config=None,
    seed: int = 0,
    saved: Mapping[str, nn.Module | Task] | None = None,
    saved_info: Mapping[str, dict] | None = None,
    progress: Progress = None,
    seeds: Sequence[int] | None = None,
    recipe=None,
    loss_ratio: float | None = None,
    match_loss_auto: bool = False,
    seed_data: Mapping[int, Any] | None = None,
) -> LandscapeRun:
    """Train the reference models ``models`` (default relu, attn) on ``data``, or take the
    ``saved`` ones (label -> module or Task), analyse each with ``config`` and compare them.

    ``data``: anything with ``X`` (n, d), ``y`` (n,) and ``n_classes`` (an
    :class:`attnaudit.data.Dataset`); for saved causal language models, documents: ``y`` (n, 2L)
    their next-token targets (:mod:`attnaudit.core.lm_rows`), used as they are; no accuracy and no
    untrained rule then (no class labels). ``train_config``: a :class:`attnaudit.core.training.TrainConfig`
    (its ``loss_tol`` is the match-loss target). ``saved_info``: provenance recorded under
    each saved model's ``training`` (e.g. its file). Saved models carrying a training-data
    fingerprint that differs from ``data`` get a warning.

    ``seeds``: built-in models only; one independent initialisation, training and analysis
    (random directions, Lanczos start, probes: ``config.seed`` + the seed's offset from the
    first) per seed, default ``(seed,)``. ``results`` holds the first seed's analysis, so a
    one-seed run is unchanged; the comparison uses the mean over seeds. ``recipe``: an
    :class:`attnaudit.core.fit.Recipe` (``sgd``/``adam`` with a batch size) trains the built-in
    models with :func:`attnaudit.core.fit.fit` instead of full-batch GD (``train_config`` then only
    names the loss); its ``seed`` (data order) is replaced by each model seed.

    ``match_loss_auto`` (full-batch GD): every model and seed is first trained for the whole
    step budget; the largest final loss L* becomes ``train_config.loss_tol``, so every model
    is then trained until its loss first reaches L* (the slowest one runs its whole budget),
    resumed from its budget run's snapshots (:class:`~.reference.BudgetRun`).

    ``seed_data`` (built-in models; ``--resample-data``): seed -> that seed's own rows (like
    ``data``), on which its model is built (MLP-Attn's context), trained and analysed; None:
    every seed uses ``data``.
    """

    X, y = data.X, data.y
    if y is None:
        raise AuditError("the loss landscape needs labelled data")
    y = labels_as_given(y.to(X.device))  # class labels; a language model's targets (n, 2L) as they are
    seed_list = tuple(int(s) for s in seeds) if seeds is not None else (int(seed),)
    _check_arguments(saved, models, seed_list, recipe, seed_data)
    training: dict[str, dict] = {}
    provenance: list[str] = []
    if saved:
        nets, training, provenance = _saved_nets(saved, saved_info or {}, X, y)
        train_config = None
    else:
        archs = tuple(models) if models is not None else ARCHS
        train_config = train_config or gd.TrainConfig(loss=config.loss or "mse")
        nets = {a: build_reference_model(a, X, data.n_classes, width=width, seed=seed) for a in archs}

    def rows(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(X, y) seed ``s`` trains and is analysed on: its own rows with ``seed_data``, else ``data``'s."""
        if seed_data is None:
            return X, y
        own = seed_data[s]
        return own.X, labels_as_given(own.y.to(own.X.device))

    for net in nets.values():  # a selector that matches nothing fails now, before training or analysis
        parameter_names(landscape_task(net, X, config.loss, config.params), X)

    resolution = None
    budget_runs: dict = {}
    if match_loss_auto:
        if train_config is None or recipe is not None:
            raise FieldError(
                "match_loss_auto",
                "{name} trains the built-in models with full-batch GD; drop it for saved models or a recipe (sgd/adam)",
            )
        train_config, resolution, budget_runs = auto_match_loss(
            nets, seed_list, rows, data.n_classes, width, train_config
        )

    timings: dict[str, float] = {}
    seed_results, seed_training = _train_and_analyse(
        nets, seed_list, rows, X, config, train_config, recipe, data.n_classes, width, timings, progress, budget_runs
    )
    results = {label: runs[0] for label, runs in seed_results.items()}
    if train_config is not None:
        training = {label: runs[0] for label, runs in seed_training.items()}

    lr = None if train_config is None or recipe is not None else train_config.lr
    # classes present turn the untrained rule on; a language model's targets have none (no rule)
    n_present = int(torch.unique(y).numel()) if y.ndim == 1 else None
    verdicts, warnings = compare_landscapes(
        results,
        training if train_config is not None else {},
        lr=lr,
        match_loss=None if train_config is None else train_config.loss_tol,
        saved=bool(saved),
        seed_results=seed_results,
        n_classes=n_present,
        **({} if loss_ratio is None else {"loss_ratio": loss_ratio}),
    )

    status = untrained_status({k: [r.accuracy for r in v] for k, v in seed_results.items()}, n_present, int(X.shape[0]))
    return LandscapeRun(
        results=results,
        training=training,
        verdicts=tuple(verdicts),
        warnings=tuple(provenance + list(warnings)),
        lr=lr,
        timings=timings,
        seed_results=seed_results if not saved else {},
        seed_training=seed_training if len(seed_list) > 1 and train_config is not None else {},
        seeds=seed_list,
        status=status,
        match_loss_resolution=resolution,
        optimizer=optimizer_record(train_config, recipe),
    )


def _train_and_analyse(
    nets: dict[str, nn.Module | Task],
    seed_list: tuple[int, ...],
    rows: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    X: torch.Tensor,
    config: LandscapeConfig,
    train_config,
    recipe: Recipe | None,
    n_classes: int,
    width: int,
    timings: dict[str, float],
    progress: Progress,
    budget_runs: dict,
) -> tuple[dict[str, list[LandscapeResult]], dict[str, list[dict]]]:
    """Every model and seed: build (seeds after the first, or on their own rows), train (built-in
    models) and analyse. Returns (analyses, training records) per model, in seed order; adds the
    training and analysis seconds of each model to ``timings``."""
    seed_results: dict[str, list[LandscapeResult]] = {label: [] for label in nets}
    seed_training: dict[str, list[dict]] = {label: [] for label in nets}
    for label in list(nets):
        for i, s in enumerate(seed_list):
            Xs, ys = rows(s)
            own = i == 0 and Xs is X  # the model built above, on these rows
            net = nets[label] if own else build_reference_model(label, Xs, n_classes, width=width, seed=s)
            cfg = config if i == 0 else dataclasses.replace(config, seed=config.seed + (s - seed_list[0]))
            t1 = time.perf_counter()
            if train_config is not None:
                assert isinstance(net, nn.Module)  # only built-in models are trained (train_config is None if saved)
                info = train_one(label, net, Xs, ys, train_config, recipe, s, budget_runs.get((label, s)))
                seed_training[label].append(info)
                if progress is not None:
                    progress(info.pop("_units"))
            timings[f"{label}.train"] = timings.get(f"{label}.train", 0.0) + time.perf_counter() - t1
            t1 = time.perf_counter()
            res = analyse_landscape(net, Xs, ys, cfg, progress=progress)
            timings[f"{label}.analysis"] = timings.get(f"{label}.analysis", 0.0) + time.perf_counter() - t1
            seed_results[label].append(res)
    return seed_results, seed_training


def _provenance(nets: Mapping[str, nn.Module | Task], X: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Warnings for saved models whose recorded training data differ from ``(X, y)``."""

    fingerprint = None
    out = []
    for label, net in nets.items():
        module = net.module if isinstance(net, Task) else net
        if not getattr(module, "metadata", None):
            continue
        fingerprint = fingerprint or data_fingerprint(X.cpu(), y.cpu())
        warning = training_data_mismatch(module, label, fingerprint)
        if warning:
            out.append(warning)
    return out
