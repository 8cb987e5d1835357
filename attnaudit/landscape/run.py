"""The two-model comparison end to end: train (or take saved) models, analyse each, compare.

:func:`run_landscape` is what ``attnaudit landscape`` calls: options -> this one call ->
report. It builds every model and resolves the parameter selector on each before any
training or analysis, so a selector that matches nothing fails at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.task import Task
from ..errors import AuditError
from .analysis import LandscapeConfig, LandscapeResult, analyze_landscape
from .compare import compare_landscapes
from .setup import landscape_task, parameter_names

Progress = Callable[[int], None] | None
ARCHS = ("relu", "attn")


def build_reference_model(arch: str, X: torch.Tensor, n_classes: int, *, width: int, seed: int) -> nn.Module:
    """2L-ReLU / MLP-Attn of ``width`` initialised from ``seed`` (MLP-Attn's context from X), in X's dtype and device."""
    from ..models import ModelSpec, build_model

    spec = ModelSpec(arch, int(X.shape[1]), int(width), int(n_classes), seed=int(seed))
    return build_model(spec, X, dtype=X.dtype, device=X.device)


def train_reference_model(
    arch: str, X: torch.Tensor, y: torch.Tensor, n_classes: int, *, width: int, seed: int, train_config
):
    """Build 2L-ReLU / MLP-Attn with ``seed`` and train it with the project's full-batch GD.

    Uses the same training path as every command (:func:`attnaudit.training.train`).
    Returns (model, TrainResult).
    """
    from ..training import train

    model = build_reference_model(arch, X, n_classes, width=width, seed=seed)
    return model, train(model, X, y.long(), train_config)


def run_work_units(config: LandscapeConfig, n_models: int, train_steps: int = 0) -> int:
    """Progress units of :func:`run_landscape`: each model's training steps and analysis."""
    return n_models * (config.work_units() + train_steps)


@dataclass(frozen=True)
class LandscapeRun:
    """Landscapes of several models on the same data, with the comparison's verdicts and warnings.

    ``training[label]``: how the model came to be (trained here: steps run, final loss,
    loss curve, seed; saved: its source and spec). ``lr``: the GD learning rate when the
    models were trained here (GD's stability bound is 2 / lr), else None.
    """

    results: dict[str, LandscapeResult]
    training: dict[str, dict]
    verdicts: tuple[str, ...]
    warnings: tuple[str, ...]
    lr: float | None = None
    timings: dict = field(default_factory=dict)

    @property
    def labels(self) -> list[str]:
        return list(self.results)

    def to_dict(self) -> dict:
        return {
            "models": {k: {"training": self.training[k], **r.to_dict()} for k, r in self.results.items()},
            "gd_stability_bound": None if self.lr is None else 2.0 / self.lr,
            "verdicts": list(self.verdicts),
            "warnings": list(self.warnings),
        }


def _saved_checks(label: str, net: nn.Module | Task, X: torch.Tensor, y: torch.Tensor) -> None:
    spec = getattr(net.module if isinstance(net, Task) else net, "spec", None)
    if spec is None:
        return
    if getattr(spec, "d_in", X.shape[1]) != X.shape[1]:
        raise AuditError(f"saved model {label} takes {spec.d_in} input features but the data have {X.shape[1]}; use the data it was trained on")
    if int(y.max()) >= getattr(spec, "n_out", int(y.max()) + 1):
        raise AuditError(f"saved model {label} has {spec.n_out} outputs but the labels go up to {int(y.max())}; select matching classes")


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
) -> LandscapeRun:
    """Train the reference models ``models`` (default relu, attn) on ``data``, or take the
    ``saved`` ones (label -> module or Task), analyse each with ``config`` and compare them.

    ``data``: anything with ``X`` (n, d), ``y`` (n,) and ``n_classes`` (an
    :class:`attnaudit.data.Dataset`). ``train_config``: a :class:`attnaudit.training.TrainConfig`
    (its ``loss_tol`` is the match-loss target). ``saved_info``: provenance recorded under
    each saved model's ``training`` (e.g. its file). Saved models carrying a training-data
    fingerprint that differs from ``data`` get a warning.
    """
    from .. import training as gd  # looked up at call time (tests replace gd.train)

    X, y = data.X, data.y
    if y is None:
        raise AuditError("the loss landscape needs labelled data")
    y = y.to(X.device).long()
    if saved and models:
        raise AuditError("give reference models to train or saved models to analyse, not both")
    timings: dict[str, float] = {}
    training: dict[str, dict] = {}
    provenance: list[str] = []
    if saved:
        nets = dict(saved)
        for label, net in nets.items():
            _saved_checks(label, net, X, y)
            module = net.module if isinstance(net, Task) else net
            spec = getattr(module, "spec", None)
            training[label] = {**(saved_info or {}).get(label, {})}
            if dataclasses.is_dataclass(spec):
                training[label]["spec"] = dataclasses.asdict(spec)
        # models whose audited rows were drawn from their own recorded training split need no warning
        own_rows = {label for label, info in (saved_info or {}).items()
                    if (info.get("audit_rows") or {}).get("rows") == "checkpoint split"}
        provenance = _provenance({k: v for k, v in nets.items() if k not in own_rows}, X, y)
        train_config = None
    else:
        archs = tuple(models) if models is not None else ARCHS
        bad = [a for a in archs if a not in ARCHS]
        if bad:
            raise AuditError(f"unknown reference model {bad[0]!r}; use relu, attn or both")
        if len(set(archs)) != len(archs) or not archs:
            raise AuditError("list each reference model once (relu, attn)")
        train_config = train_config or gd.TrainConfig(loss=config.loss or "mse")
        nets = {a: build_reference_model(a, X, data.n_classes, width=width, seed=seed) for a in archs}
    for net in nets.values():  # a selector that matches nothing fails now, before training or analysis
        parameter_names(landscape_task(net, X, config.loss, config.params), X)

    results: dict[str, LandscapeResult] = {}
    for label, net in nets.items():
        t1 = time.perf_counter()
        if train_config is not None:
            tr = gd.train(net, X, y, train_config)
            if tr.diverged:
                raise AuditError(f"training {label} diverged (loss {tr.final_loss}); lower the learning rate")
            training[label] = {
                "steps_run": tr.steps_run, "final_loss": tr.final_loss, "reached_match_loss": tr.reached_tol,
                "loss_curve_every_10": tr.loss_curve, "model_seed": seed,
            }
            if progress is not None:
                progress(train_config.steps)
        timings[f"{label}.train"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        results[label] = analyze_landscape(net, X, y, config, progress=progress)
        timings[f"{label}.analysis"] = time.perf_counter() - t1

    lr = None if train_config is None else train_config.lr
    verdicts, warnings = compare_landscapes(
        results, training if train_config is not None else {}, lr=lr,
        match_loss=None if train_config is None else train_config.loss_tol, saved=bool(saved),
    )
    return LandscapeRun(
        results=results, training=training, verdicts=tuple(verdicts), warnings=tuple(provenance + list(warnings)),
        lr=lr, timings=timings,
    )


def _provenance(nets: Mapping[str, nn.Module | Task], X: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Warnings for saved models whose recorded training data differ from ``(X, y)``."""
    from ..data import data_fingerprint
    from ..models import training_data_mismatch

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
