"""One trained model against its initialization: kernel movement, linearized distance, verdict.

:func:`analyse_checkpoint` takes the two models and the rows; :func:`audit_loaded` takes a loaded
checkpoint and the data: its initialization (given, or rebuilt from an attnaudit side-car by
:func:`initial_model`), its rows (its recorded split when the data rebuild it, else a fresh
seeded split) and its recorded recipe for the linearized model.

A causal language model (a task whose loss is the next-token cross-entropy, e.g. a fine-tuned
model against its base with ``--reference-checkpoint``) is measured on the eNTK of each
document's log-likelihood of its own targets (:mod:`.language`); it has no class labels, so no
kernel-label alignment and no linearized comparator.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from attnaudit.analyses.ntk_distance.aggregate import strict_json
from attnaudit.analyses.ntk_distance.config import CheckpointKernelConfig
from attnaudit.analyses.ntk_distance.language import (
    KERNEL_LM,
    KERNEL_LOGITS,
    LOSS_LM,
    NO_LINEARIZED_LM,
    is_language_model,
    likelihood_tasks,
)
from attnaudit.analyses.ntk_distance.linearized import (
    LinearizedResult,
    kernel_gd_blocker,
    linearized_off,
    linearized_prediction,
)
from attnaudit.analyses.ntk_distance.movement import KernelMovement, kernel_movement, kernel_precision_check, task_of
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core.fit import Recipe
from attnaudit.core.precision import resolve_precision
from attnaudit.core.task import Loss, NextTokenLoss, Task
from attnaudit.data import Dataset, holdout_split, subset
from attnaudit.errors import AuditError
from attnaudit.models.builtin import ModelSpec, TwoLayerNet
from attnaudit.models.checkpoints import rebuild_of, recorded_split
from attnaudit.models.loaded import LoadedModel
from attnaudit.models.vit import ViT, ViTSpec, n_parameters

F64 = torch.float64
#: what ``precision`` sets in a checkpoint's kernel audit
NTK_HEAVY = ("Jacobian contractions of the empirical NTK (both models)", "kernel-gd's kernels")


@dataclass
class CheckpointKernelResult:
    """Kernel movement (and the linearized distance) of one trained model."""

    label: str
    reference: dict
    rows: dict
    movement: KernelMovement
    linearized: LinearizedResult
    recipe: dict | None
    verdict: str
    warnings: list[str]
    seconds: float
    precision: dict = field(default_factory=dict)
    precision_check: dict | None = None
    #: what the kernel is the eNTK of (the logits, or a language model's document log-likelihood)
    kernel: str = KERNEL_LOGITS
    #: a language model's loss (None for a classifier, whose recipe names its loss)
    loss: str | None = None

    def to_dict(self) -> dict:
        return strict_json(
            {
                "label": self.label,
                "kernel": self.kernel,
                "loss": self.loss,
                "precision": self.precision,
                "precision_check": self.precision_check,
                "reference": self.reference,
                "rows": self.rows,
                "movement": self.movement.to_dict(),
                "linearized": self.linearized.to_dict(),
                "recipe": self.recipe,
                "verdict": self.verdict,
                "warnings": list(self.warnings),
                "seconds": self.seconds,
            }
        )


# Reference points for reading a single movement (measured by the 2-layer sweep on MNIST,
# docs/ntk-distance.md): the full-kernel movement of 2L-ReLU after 200 GD steps.
REFERENCE_MOVEMENT = "2L-ReLU on MNIST after 200 GD steps: 1.25 at width 16, 0.03 at width 4096"


def checkpoint_verdict(label: str, mv: KernelMovement, lin: LinearizedResult, language: bool = False) -> str:
    """One sentence: how much the kernel moved, which group most, the alignment, the linearized distance
    (``language``: the kernel is a language model's document log-likelihood eNTK, :mod:`.language`)."""
    kind = "full" if mv.movement is not None else "output-averaged"
    top = max(mv.groups, key=lambda g: (g.movement if g.movement is not None else g.movement_trace) or 0.0)
    top_val = top.movement if top.movement is not None else top.movement_trace
    if language:
        # the 2-layer sweep's MNIST figures are movements of another kernel: no scale is given
        what = (
            f"the empirical NTK of the documents' log-likelihood by ||K_T - K_0|| / ||K_0|| = {mv.headline:.3g} "
            f"({mv.n_points} documents; in the kernel regime it stays near 0)"
        )
    else:
        what = (
            f"the empirical NTK by ||Theta_T - Theta_0|| / ||Theta_0|| = {mv.headline:.3g} ({kind} kernel, "
            f"{mv.n_points} training rows; in the kernel regime it stays near 0 — for scale, {REFERENCE_MOVEMENT})"
        )
    parts = [f"{label}: training moved {what}"]
    parts.append(
        f"its size changed by a factor {mv.norm_ratio:.3g} and its shape by a kernel distance (1 - cosine) "
        f"of {mv.kernel_distance:.3g}"
    )
    parts.append(
        f"the group that moved most is {top.group} ({top_val:.3g}, {top.trace_share_trained:.0%} of the "
        "trained kernel's trace)"
    )
    if mv.cka_init is not None and mv.cka_trained is not None:
        change = "rose" if mv.cka_trained > mv.cka_init else "fell"
        parts.append(f"its alignment with the labels {change} from {mv.cka_init:.3f} to {mv.cka_trained:.3f}")
    if lin.applicable:
        assert lin.dynamics is not None  # every applicable prediction says how it was trained
        parts.append(
            f"the network is {lin.distance_rel:.1%} (relative RMS) away from its linearized model on "
            f"{lin.n_test} held-out rows ({lin.dynamics.split(' (')[0]})"
        )
    else:
        parts.append(f"no linearized prediction ({lin.reason})")
    return "; ".join(parts) + "."


def analyse_checkpoint(
    task_trained: Task | nn.Module,
    task_init: Task | nn.Module,
    X_kernel: torch.Tensor,
    y_kernel: torch.Tensor | None,
    config: CheckpointKernelConfig | None = None,
    *,
    label: str = "model",
    recipe: Recipe | None = None,
    train: tuple[torch.Tensor, torch.Tensor] | None = None,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    steps: int | None = None,
    train_dtype: torch.dtype | None = None,
    reference: dict | None = None,
    rows: dict | None = None,
    no_linearized: str | None = None,
    device=None,
) -> CheckpointKernelResult:
    """Kernel movement of a trained model against its initialization, and its linearized distance.

    ``train``/``test``: the model's own training rows and held-out rows (needed with
    ``recipe`` for the linearized prediction); ``no_linearized``: why it cannot be made
    (shown instead). ``reference``/``rows``: descriptions for the report.
    """
    t0 = time.perf_counter()
    warnings: list[str] = []
    config = config or CheckpointKernelConfig()
    language = is_language_model(task_trained)
    # what the linearized comparison can be is settled before the expensive kernel pass
    skip = _linearized_skip(
        config, task_trained, X_kernel, recipe, train, test, NO_LINEARIZED_LM if language else no_linearized
    )
    groups: dict[str, Sequence[str]] | None = None
    if language:
        assert isinstance(task_trained, Task)  # is_language_model
        task_trained, task_init, X_kernel, groups = likelihood_tasks(task_trained, task_init, X_kernel, y_kernel)
        y_kernel = None  # next-token targets are no class labels: no kernel-label alignment
    trained = task_of(task_trained, X_kernel)
    n_params = n_parameters(trained.module)
    precision = resolve_precision(config.precision, n_params, device or "cpu", NTK_HEAVY)
    mv = kernel_movement(
        task_init,
        task_trained,
        X_kernel,
        y_kernel,
        groups,
        form=config.form,
        memory_bytes=config.memory_bytes,
        device=device,
        dtype=precision.dtype,
    )
    check = kernel_precision_check(trained, X_kernel, precision.dtype, device) if precision.lowered else None
    if check is not None and check.warning:
        warnings.append(f"{label}: {check.warning}")
    if skip is not None:
        lin = skip
    else:
        assert train is not None and test is not None and recipe is not None  # else skip is set
        lin = linearized_prediction(
            task_init,
            task_trained,
            recipe,
            train[0],
            train[1],
            test[0],
            test[1],
            method=config.linearized,
            steps=steps,
            train_dtype=train_dtype,
            memory_bytes=config.memory_bytes,
            device=device,
            kernel_dtype=precision.dtype,
        )
        if lin.unstable:
            warnings.append(
                f"{label}: the linearized model's training was unstable (loss {lin.lin_initial_loss:.4g} -> "
                f"{lin.lin_train_loss:.4g}): the learning rate is too large for the initial eNTK, so the distance "
                "mostly measures that instability"
            )
    if mv.jacobian_passes > 1.5:
        warnings.append(
            f"{label}: the Jacobians of the {mv.n_points} kernel rows did not fit the {config.memory_bytes / 2**30:.3g} "
            f"GiB budget at once and were recomputed ({mv.jacobian_passes:.1f} passes per row)"
        )
    return CheckpointKernelResult(
        label=label,
        reference=dict(reference or {}),
        rows=dict(rows or {}),
        movement=mv,
        linearized=lin,
        recipe=recipe.to_dict() if recipe is not None else None,
        verdict=checkpoint_verdict(label, mv, lin, language),
        warnings=warnings,
        seconds=time.perf_counter() - t0,
        precision=precision.to_dict(),
        precision_check=None if check is None else check.to_dict(),
        kernel=KERNEL_LM if language else KERNEL_LOGITS,
        loss=LOSS_LM if language else None,
    )


def _linearized_skip(
    config: CheckpointKernelConfig,
    task_trained: Task | nn.Module,
    X_kernel: torch.Tensor,
    recipe: Recipe | None,
    train: tuple[torch.Tensor, torch.Tensor] | None,
    test: tuple[torch.Tensor, torch.Tensor] | None,
    no_linearized: str | None,
) -> LinearizedResult | None:
    """The linearized result shown instead of a prediction (off, or why there is none), or None
    when the prediction is to be made; ``--linearized kernel-gd|train`` that cannot be made is
    refused (field ``linearized``) before any kernel is computed."""
    if config.linearized == "off":
        return linearized_off()
    reason = no_linearized
    if reason is None and recipe is None:
        reason = "the checkpoint records no training recipe"
    elif reason is None and (train is None or test is None):
        reason = "its training rows are unknown"
    if reason is not None:
        if config.linearized != "auto":
            raise FieldError("linearized", "{name} " + literal(f"{config.linearized}: {reason}") + "; use auto or off")
        return LinearizedResult(method="none", applicable=False, reason=reason)
    if config.linearized == "kernel-gd":
        assert train is not None and recipe is not None  # else reason is set
        blocker = kernel_gd_blocker(recipe, int(train[0].shape[0]), int(task_of(task_trained, X_kernel).n_classes))
        if blocker:
            raise FieldError("linearized", "{name} kernel-gd: " + literal(blocker) + "; use {name} train")
    return None


def initial_model(loaded: LoadedModel) -> tuple[nn.Module, dict] | None:
    """A fresh float64 copy of an attnaudit checkpoint's architecture at its initialization.

    The seed: the side-car's recorded ``init_seed`` (with or without a recipe), else the
    spec's ``seed`` (a built-in model is initialised deterministically from it). MLP-Attn
    keeps the checkpoint's attention context (a fixed buffer, not trained). None for other
    sources (Hugging Face, ``--factory``): give the reference checkpoint.
    """

    if (loaded.source or {}).get("kind") != "attnaudit":
        return None
    module = loaded.module
    spec = getattr(module, "spec", None)
    if not isinstance(spec, (ModelSpec, ViTSpec)):
        return None
    rebuild = rebuild_of(loaded)  # validates a recorded recipe and init_seed
    if rebuild is not None:
        seed, where = rebuild.init_seed, "the side-car's init_seed"
    elif "init_seed" in loaded.metadata:
        seed = loaded.metadata["init_seed"]
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise AuditError(f"checkpoint {loaded.label}: side-car init_seed must be an integer, got {seed!r}")
        where = "the side-car's init_seed"
    else:
        seed, where = spec.seed, "the spec's seed (the side-car records no init_seed)"
    init: nn.Module
    if isinstance(spec, ViTSpec):
        init = ViT(dataclasses.replace(spec, seed=seed), dtype=F64)
    else:
        context = getattr(module, "context", None)
        init = TwoLayerNet(
            dataclasses.replace(spec, seed=seed), context=None if context is None else context.detach().cpu(), dtype=F64
        )
    init.eval()
    return init, {
        "kind": "rebuilt",
        "init_seed": int(seed),
        "seed_from": where,
        "arch": spec.arch,
        "detail": f"fresh init, seed {seed}",
        "description": f"a fresh {spec.arch} of the same spec, float64, initialised from {where} ({seed})",
    }


# --------------------------------------------------------------------------- a loaded model against its initialization


@dataclass
class _Rows:
    """A checkpoint's rows: the kernel rows, the held-out rows, its own training rows (None when
    they cannot be rebuilt), the report's record of them and why there is no linearized model."""

    kernel: Dataset
    test: Dataset
    train: Dataset | None
    info: dict
    no_linearized: str | None = None
    warnings: list[str] = field(default_factory=list)


def _checkpoint_rows(
    label: str, lm: LoadedModel, ds: Dataset, config: CheckpointKernelConfig, has_recipe: bool
) -> _Rows:
    """The rows of ``lm``'s audit: of its recorded split when it can be rebuilt from ``ds`` (the
    kernel rows from its training rows, the held-out rows from its held-out rows), else a fresh
    seeded holdout split of ``ds`` (no linearized model then: its training cannot be re-run)."""
    seed = config.seed
    rebuilt = recorded_split(ds, {label: lm})
    if rebuilt is not None:
        train_all, held_all, rec = rebuilt
        kern = subset(train_all, min(config.kernel_points, train_all.n), seed)
        test = subset(held_all, min(config.n_test, held_all.n), seed)
        info = {
            "rows": "checkpoint split",
            "recorded_split": rec,
            "detail": f"kernel: {kern.n} of the checkpoint's {train_all.n} training rows; held-out: "
            f"{test.n} of its {held_all.n} held-out rows (split rebuilt, fingerprint matched)",
        }
        return _Rows(kern, test, train_all, info)
    kp = min(config.kernel_points, ds.n - 1)
    kern, test = holdout_split(ds, kp, min(config.n_test, ds.n - kp), seed, stratify=True)
    rows = _Rows(
        kern,
        test,
        None,
        {
            "rows": "fresh split",
            "detail": f"a seeded holdout split of the data (seed {seed}): {kern.n} kernel rows, {test.n} held-out rows",
        },
    )
    recorded_data = lm.metadata.get("training_data") if isinstance(lm.metadata, dict) else None
    if isinstance(recorded_data, dict) and recorded_data.get("fingerprint"):
        where = ", ".join(
            f"{k} {recorded_data[k]}" for k in ("name", "split", "n", "preprocess") if recorded_data.get(k) is not None
        )
        rows.warnings.append(
            f"{label}: its training split ({where}) could not be rebuilt from {ds.name} as given, so the kernel "
            "rows are a fresh split of these data and may include rows the model never saw; give the data "
            "it was trained on (same --dataset, --split, --classes, --preprocess)"
        )
    if has_recipe:
        rows.no_linearized = (
            "the checkpoint's training rows could not be rebuilt from this data (its side-car records "
            "no holdout split, or the rebuilt rows' fingerprint differs), so its training cannot be "
            "re-run on the linearized model; give the data it was trained on"
        )
    return rows


def _initial_task(lm: LoadedModel, reference: LoadedModel | None, reference_path: str | None) -> tuple[Task, dict]:
    """The task at initialization and the report's record of it: ``reference`` when given, else
    the rebuilt initialization of an attnaudit checkpoint (:func:`initial_model`)."""
    if reference is not None:
        return _task_of_loaded(reference), {
            "kind": "checkpoint",
            "path": str(reference_path),
            "source": reference.source,
            "detail": f"--reference-checkpoint {reference.label}",
        }
    initial = initial_model(lm)
    assert initial is not None, "refused by refuse_without_initialization"
    module0, info = initial
    return Task(module0, lm.n_classes, inputs=lm.inputs), info


def _task_of_loaded(lm: LoadedModel) -> Task:
    """The task of a loaded model's kernel: a causal language model keeps its next-token loss (its
    kernel is then the document log-likelihood's, :mod:`.language`); a classifier's eNTK of the
    logits does not depend on the loss."""
    loss: Loss | str = lm.loss if isinstance(lm.loss, NextTokenLoss) else "mse"
    return Task(lm.module, lm.n_classes, loss, inputs=lm.inputs)


def refuse_without_initialization(loaded: Mapping[str, LoadedModel]) -> None:
    """Refuse (field ``reference_checkpoint``) a model whose initialization cannot be rebuilt
    (:func:`initial_model`): every model is checked before any data are read."""
    for label, lm in loaded.items():
        if initial_model(lm) is None:
            raise FieldError(
                "reference_checkpoint",
                literal(
                    f"{label}: the kernel movement compares the model with its initialization, and a "
                    f"{lm.source.get('kind')} model does not record one"
                )
                + "; give the same model at initialization with {name} PATH",
            )


def audit_loaded(
    label: str,
    lm: LoadedModel,
    ds: Dataset,
    config: CheckpointKernelConfig,
    *,
    reference: LoadedModel | None = None,
    reference_path: str | None = None,
    device=None,
) -> tuple[CheckpointKernelResult, list[str]]:
    """One loaded model (fitted to ``ds``) against its initialization (``reference``, or the rebuilt
    initialization of an attnaudit checkpoint): :func:`analyse_checkpoint` on its rows
    (:func:`_checkpoint_rows`) with its recorded recipe. Returns the result and the warnings about its rows."""
    task_init, ref_info = _initial_task(lm, reference, reference_path)
    rebuild = rebuild_of(lm) if lm.source.get("kind") == "attnaudit" else None
    recipe = rebuild.recipe if rebuild is not None else None
    rows = _checkpoint_rows(label, lm, ds, config, recipe is not None)
    kern, test, train = rows.kernel, rows.test, rows.train
    rows.info["kernel_rows"] = kern.info.get("holdout")
    rows.info["held_out_rows"] = test.info.get("holdout")
    recorded = (lm.metadata.get("metrics") or {}).get("steps_run") if isinstance(lm.metadata, dict) else None
    steps = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
    dtype = next((p.dtype for p in lm.module.parameters() if p.is_floating_point()), torch.float64)
    assert kern.y is not None and test.y is not None  # rows of ds, which has labels
    own_rows = None
    if train is not None:
        assert train.y is not None
        own_rows = (train.X.to(device), train.y.to(device))
    result = analyse_checkpoint(
        _task_of_loaded(lm),
        task_init,
        kern.X.to(device),
        kern.y.to(device),
        config,
        label=label,
        recipe=recipe,
        train=own_rows,
        test=(test.X.to(device), test.y.to(device)),
        steps=steps,
        train_dtype=dtype,
        reference=ref_info,
        rows=rows.info,
        no_linearized=rows.no_linearized,
        device=device,
    )
    return result, rows.warnings
