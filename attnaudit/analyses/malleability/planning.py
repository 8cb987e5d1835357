"""Planning a malleability run before any compute: what it refuses, how much work it is, and the
memory its influence runs need.

The memory is planned by the influence estimators themselves
(:func:`attnaudit.analyses.influence.influence.plan_influence`: each estimator's own memory
hooks, asked with the run's settings -- estimator, curvature, ``proj_dim``, ``params``, the
budget), on the models the run audits: the saved models, or each built-in architecture built
on the training rows. The run plans once and records the plan in its report.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch
from torch import nn

from attnaudit.analyses.influence.influence import plan_influence
from attnaudit.analyses.malleability.cell_tools import embedding_attacked
from attnaudit.analyses.malleability.config import AUTO_MATCH, MalleabilityConfig
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core.task import Task
from attnaudit.errors import AuditError
from attnaudit.models.builtin import build_model

if TYPE_CHECKING:
    from attnaudit.data import HoldoutRecipe
    from attnaudit.runtime.sweep import ExecutorConfig


def progress_total(config: MalleabilityConfig) -> int:
    """Units of work (one training + influence each) that :func:`run_malleability` reports."""
    per_model = 1 + int(config.controls)
    per_model += sum(1 if a == "none" else len(config.eps) for a in config.attacks)
    return len(config.seeds) * len(config.models) * per_model


def plan_memory(
    config: MalleabilityConfig,
    X_train: torch.Tensor,
    n_test: int,
    n_classes: int,
    models: Mapping[str, nn.Module | Task] | None = None,
) -> dict:
    """Tracked parameters and peak bytes of the influence runs, planned before any compute.

    Each model of ``config.models`` -- ``models[label]`` when given (saved models, as they are),
    else the built-in architecture built on ``X_train`` -- is planned as its influence runs plan
    it (:func:`~attnaudit.analyses.influence.influence.plan_influence` with ``config.influence``
    and every damping). Returns the largest P (``tracked_parameters``), each model's tracked
    names and the largest plan's bytes by part. Refuses (AuditError) what the influence runs
    would refuse before any compute (a Hessian above ``max_exact_params``, a budget nothing fits).
    """
    plans = {}
    for arch in config.models:
        if models is not None and arch in models:
            model = models[arch]
        else:
            spec = config.model_spec(arch, int(X_train.shape[1]), n_classes)
            model = build_model(spec, X_train, dtype=torch.float64, device=X_train.device)
        plans[arch] = plan_influence(
            model,
            X_train,
            n_test,
            config.influence,
            n_dampings=len(config.damping),
            loss=config.loss,
            n_classes=n_classes,
        )
    largest = max(plans.values(), key=lambda p: p.bytes["total"])
    return {
        "tracked_parameters": max(p.n_params for p in plans.values()),
        "tracked_parameter_names": {arch: p.tracked for arch, p in plans.items()},
        "bytes": largest.bytes,
    }


def for_saved_models(config: MalleabilityConfig, fixed_models: Mapping[str, nn.Module | Task]) -> MalleabilityConfig:
    """``config`` for the saved models ``fixed_models`` (labelled by their keys; not trained to a
    loss): unchanged when it already says so (as :meth:`MalleabilityRequest.resolve` builds it),
    else a copy that does (a config written in Python for built-in models)."""
    labels = tuple(fixed_models)
    match = None if config.match_loss == AUTO_MATCH else config.match_loss
    if config.models == labels and config.saved_models and match == config.match_loss:
        return config
    return replace(config, models=labels, saved_models=True, match_loss=match)


def check_recipes(config: MalleabilityConfig, labels: Iterable[str], rebuild: Mapping) -> None:
    """Refuse protocol retrain for saved models (``labels``) without a recorded recipe in ``rebuild``."""
    missing = [label for label in labels if label not in rebuild]
    if config.protocol == "retrain" and missing:
        raise FieldError(
            "protocol",
            "{name} retrain re-runs a checkpoint's recorded training recipe, and "
            + literal(", ".join(missing))
            + " records none (attnaudit train writes it); audit it as it is ({name} static) or fine-tune it "
            "({name} finetune, with finetune_steps)",
        )


def check_saved_models(
    config: MalleabilityConfig, fixed_models: Mapping[str, nn.Module | Task], rebuild: Mapping, n_classes: int, d: int
) -> None:
    """Refuse saved models the protocol cannot audit: retrain without a recorded recipe, the
    reinit control or TracIn on a model given as it is, classes or features that do not match
    the data, a text model's embeddings retrained on."""
    check_recipes(config, fixed_models, rebuild)
    if config.controls and config.protocol == "static":
        raise FieldError(
            "controls", "the reinit control ({name}) retrains from scratch and does not apply to a saved model"
        )
    if config.estimator == "tracin":
        raise FieldError(
            "estimator",
            "{name} tracin needs the training trajectory, which a saved model does not carry; use last-layer, exact or cg",
        )
    for arch, model in fixed_models.items():
        if isinstance(model, Task):
            if model.n_classes != n_classes:
                raise AuditError(
                    f"saved model {arch} has {model.n_classes} outputs but the audit uses {n_classes} classes; "
                    "audit models with the same classes together"
                )
            continue
        spec: Any = model.spec  # a built-in saved model (TwoLayerNet)
        if spec.d_in != d or spec.n_out != n_classes:
            raise AuditError(
                f"saved {arch} model expects {spec.d_in} features and {spec.n_out} classes, the data have "
                f"{d} and {n_classes}; audit it on the data it was trained on"
            )
    text = [label for label, m in fixed_models.items() if embedding_attacked(m, config)]
    if text and config.protocol == "retrain":
        raise FieldError(
            "protocol",
            "embedding attacks on text (" + literal(", ".join(text)) + ") run with {name} static or finetune; "
            "retraining a text checkpoint on shifted embeddings is not supported",
        )


def check_inputs(
    config: MalleabilityConfig,
    y_train: torch.Tensor | None,
    y_test: torch.Tensor | None,
    n_train: int,
    n_classes: int,
    saved: bool,
    data: HoldoutRecipe | None,
    executor: ExecutorConfig,
) -> None:
    """Refuse data, settings and an executor the run cannot use, before any compute."""
    if y_train is None or y_test is None:
        raise AuditError("malleability needs labelled data (influence is defined on a labelled loss)")
    assert config.top_ks is not None  # MalleabilityConfig.__post_init__ sets it
    if max(config.top_ks) > n_train:
        raise FieldError(
            "top_k", "{name} " + literal(max(config.top_ks)) + f" exceeds the {n_train} training samples; lower it"
        )
    if config.resample_data and (saved or data is None):
        raise FieldError(
            "resample_data",
            "{name} draws each seed's rows from the data recipe; pass data=HoldoutRecipe(...) (the command line "
            "does) and built-in models",
        )
    if n_classes < 2:
        raise AuditError(f"malleability needs at least 2 classes, the data has {n_classes}")
    present = torch.unique(y_train).tolist()
    if len(present) < 2:
        raise AuditError(
            f"the training labels hold a single class ({present[0]}): influence on a one-class loss says nothing; "
            "keep at least two classes (e.g. --classes 3,5)"
        )
    check_executor(executor, saved, data is not None)


def check_executor(executor: ExecutorConfig, saved: bool, recipe: bool) -> None:
    """Refuse an executor the cells cannot run on: saved models are audited in this process, and
    cells elsewhere rebuild their rows from a data ``recipe``."""
    remote = executor.kind != "local" or executor.jobs > 1
    if saved and (remote or executor.resume_dir):
        raise AuditError(
            "saved models are audited in this process; run them with the local executor, one job and no resume"
        )
    if remote and not recipe:
        raise AuditError(
            "cells on worker processes or Ray rebuild their data from a recipe; pass data=HoldoutRecipe(...) "
            "(the command line does), or run with the local executor"
        )
