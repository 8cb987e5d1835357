"""The width sweep of the built-in transformers (``ntk-distance --arch vit,vit-linear``).

Per arch x width x seed cell (:func:`transformer_cell`): the ViT (dim = width, heads fixed, so
the head dim grows with width) is trained with the recipe, then its kernel movement against its
initialization (:func:`~.movement.kernel_movement`) on ``kernel_points`` training rows and its
distance to the linearized model (:func:`~.linearized.linearized_prediction`) on the held-out
rows are measured. Per arch: the width trends and the verdict (:func:`~.verdicts.arch_summary`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import asdict, dataclass, field

import torch

from attnaudit.analyses.ntk_distance.aggregate import strict_json, summary_rows, sweep_verdicts
from attnaudit.analyses.ntk_distance.config import TransformerSweepConfig
from attnaudit.analyses.ntk_distance.linearized import DISTANCE_DEFINITION, LinearizedResult, linearized_prediction
from attnaudit.analyses.ntk_distance.movement import (
    CKA_DEFINITION,
    MOVEMENT_DEFINITION,
    kernel_movement,
    kernel_precision_check,
)
from attnaudit.analyses.ntk_distance.planning import (
    ProgressFn,
    cell_grid,
    check_sweep_rows,
    execution_record,
    failed_cells_warning,
    kernel_row_indices,
    require_data_recipe,
)
from attnaudit.analyses.ntk_distance.verdicts import ArchSummary, arch_summary
from attnaudit.core.fit import fit
from attnaudit.core.precision import TORCH_DTYPES
from attnaudit.core.task import Task
from attnaudit.data import HoldoutRecipe
from attnaudit.models.builtin import build_builtin, image_shape_of
from attnaudit.models.vit import ViT, default_patch, n_parameters
from attnaudit.runtime.sweep import ExecutorConfig, cached, clear_cache, run_cells


@dataclass
class TransformerCell:
    """One trained transformer (arch x width x seed)."""

    arch: str
    width: int
    heads: int
    seed: int
    n_params: int
    steps_run: int
    diverged: bool
    train_loss: float
    train_acc: float
    test_acc: float
    movement: float | None
    movement_trace: float
    norm_ratio: float
    kernel_distance: float
    cka_init: float | None
    cka_trained: float | None
    group_movement: dict
    linearized: dict
    distance_rms: float
    distance_rel: float
    seconds: float

    @property
    def headline(self) -> float:
        return self.movement if self.movement is not None else self.movement_trace

    def to_dict(self) -> dict:
        return strict_json(asdict(self))


@dataclass
class TransformerSweepResult:
    """The transformer width sweep: its cells, per-arch trends and verdicts, warnings."""

    config: TransformerSweepConfig
    n_train: int
    n_test: int
    n_classes: int
    image_shape: tuple
    patch: int
    cells: list[TransformerCell]
    archs: dict[str, ArchSummary]
    warnings: list[str]
    seconds: float
    failed_cells: list = field(default_factory=list)
    execution: dict = field(default_factory=dict)  # executor, cells, resumed (how it ran; not a result)
    precision_check: list = field(default_factory=list)  # below float64: each arch's first cell's kernel block

    def summary_rows(self) -> list[dict]:
        """Mean and spread over seeds, one row per arch x width."""

        def head(group: list[TransformerCell]) -> dict:
            return {"diverged": sum(c.diverged for c in group), "n_params": group[0].n_params if group else 0}

        keys = (
            "movement",
            "movement_trace",
            "norm_ratio",
            "kernel_distance",
            "cka_init",
            "cka_trained",
            "distance_rms",
            "distance_rel",
            "train_acc",
            "test_acc",
            "train_loss",
        )
        return summary_rows(self.cells, "arch", self.config.archs, self.config.widths, head, keys)

    def verdicts(self) -> list[str]:
        """One verdict per arch (or that every cell of it failed)."""
        return sweep_verdicts(self.archs, self.config.archs)

    def to_dict(self) -> dict:
        return strict_json(
            {
                "config": self.config.to_dict(),
                "n_train": self.n_train,
                "n_test": self.n_test,
                "n_classes": self.n_classes,
                "image_shape": list(self.image_shape),
                "patch": self.patch,
                "movement_definition": MOVEMENT_DEFINITION,
                "cka_definition": CKA_DEFINITION,
                "distance_definition": DISTANCE_DEFINITION,
                "cells": [c.to_dict() for c in self.cells],
                "summary": self.summary_rows(),
                "archs": {k: v.to_dict() for k, v in self.archs.items()},
                "seconds": self.seconds,
                "failed_cells": list(self.failed_cells),
                "precision": {"used": self.config.precision, "heavy_computations": ["kernel Jacobian contractions"]},
                "precision_check": self.precision_check
                or {"status": "not needed", "why": f"the kernels' Jacobians ran in {self.config.precision}"},
            }
        )


def run_transformer_sweep(
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    n_classes: int,
    feature_shape,
    config: TransformerSweepConfig | None = None,
    *,
    device=None,
    progress: ProgressFn | None = None,
    executor: ExecutorConfig | None = None,
    data: HoldoutRecipe | None = None,
) -> TransformerSweepResult:
    """Train every arch x width x seed with the recipe and measure its kernel regime.

    Per cell: the ViT (``attnaudit.models.builtin.build_builtin``, dim = width, heads fixed, depth,
    MLP ratio and patch as configured; patch default: the largest leaving >= 16 tokens) is
    trained by :func:`attnaudit.core.fit.fit`; :func:`kernel_movement` against its initialization
    on ``kernel_points`` training rows (a fixed random subset, seed 0); and
    :func:`linearized_prediction` on the held-out rows. Per arch: log-log slopes against width
    per seed, mean ± sd, and the verdict. Each arch x width x seed is one cell
    (:func:`transformer_cell`) run by ``executor`` (:mod:`attnaudit.runtime.sweep`); executors other
    than the in-process one need ``data``, the recipe the tensors came from.
    """

    t_start = time.perf_counter()
    config = config or TransformerSweepConfig()
    check_sweep_rows(X_train, X_test)
    n = int(X_train.shape[0])
    image = image_shape_of(feature_shape, config.archs[0])
    patch = config.patch if config.patch is not None else default_patch(image)
    c = max(int(n_classes), int(y_train.max()) + 1, int(y_test.max()) + 1)
    ex = executor or ExecutorConfig()
    require_data_recipe(ex, data)
    memory_key = data.key if data is not None else f"memory:{id(X_train)}"
    cached(f"vit-sweep:{memory_key}", lambda: (X_train, y_train, X_test, y_test))
    base = {
        "data": None if data is None else data.to_dict(),
        "memory_key": memory_key,
        "n_classes": c,
        "feature_shape": list(feature_shape),
        "patch": patch,
        "device": None if device is None else str(device),
        "config": config,
    }
    tasks = cell_grid(
        "attnaudit.analyses.ntk_distance.transformers:transformer_cell",
        base,
        ("arch", config.archs, config.widths, config.seeds),
        lambda a, w, s: f"{a} width {w} seed {s}",
        lambda w: float(w) ** 2,
    )
    try:
        outcomes = run_cells(tasks, ex, on_done=(lambda o: progress()) if progress is not None else None)
    finally:
        clear_cache()
    cells = [TransformerCell(**o.result["cell"]) for o in outcomes if o.ok]
    warnings = [w for o in outcomes if o.ok for w in o.result["warnings"]]
    checks = [o.result["precision_check"] for o in outcomes if o.ok and o.result.get("precision_check")]
    failed = [o.failure() for o in outcomes if not o.ok]
    warnings.extend(failed_cells_warning(failed, len(tasks)))
    shaky = [f"{c.arch} width {c.width} seed {c.seed}" for c in cells if c.linearized.get("unstable")]
    if shaky:
        warnings.append(
            "the linearized model's training loss ended above its initial value (or diverged) for "
            + ", ".join(shaky)
            + ": the learning rate is too large for its initial eNTK there; at a fixed initial std the eNTK grows with "
            "width, so a fixed lr is a larger step for a wider network, and the distance at those widths mostly "
            "measures that instability"
        )
    measured = config.linearized != "off"
    summaries = {
        a: arch_summary(a, [cl for cl in cells if cl.arch == a], config.widths, config.seeds, measured)
        for a in config.archs
        if any(cl.arch == a for cl in cells)
    }
    if config.recipe.optimizer == "adam":
        warnings.append(
            "the networks are trained with Adam: its per-parameter normalisation moves every weight by about lr per "
            "step whatever the width, so the kernel-regime argument (made for gradient descent) does not predict "
            "lazy training here; the distance is to the linearized model trained with Adam, not to kernel gradient "
            "descent (--optimizer gd --lr ... --steps ... measures the gradient-descent case)"
        )
    return TransformerSweepResult(
        config=config,
        n_train=n,
        n_test=int(X_test.shape[0]),
        n_classes=c,
        image_shape=tuple(image),
        patch=patch,
        cells=cells,
        archs=summaries,
        warnings=warnings,
        seconds=time.perf_counter() - t_start,
        failed_cells=failed,
        execution=execution_record(ex, tasks, outcomes),
        precision_check=checks,
    )


def transformer_cell(payload: dict) -> dict:
    """One arch x width x seed cell of the transformer sweep (a pure function of ``payload``):
    build the ViT from the seed, train it with the recipe, measure its kernel movement and its
    distance to the linearized model. Returns {"cell": TransformerCell fields, "warnings": [...]}."""

    def rows():
        train_ds, test_ds = HoldoutRecipe(**payload["data"]).load()
        dev = torch.device(payload["device"]) if payload["device"] else None
        return tuple(t.to(dev) if dev is not None else t for t in (train_ds.X, train_ds.y, test_ds.X, test_ds.y))

    X_train, y_train, X_test, y_test = cached(f"vit-sweep:{payload['memory_key']}", rows)
    config: TransformerSweepConfig = payload["config"]
    arch, width, seed = payload["arch"], int(payload["width"]), int(payload["seed"])
    c, patch = int(payload["n_classes"]), int(payload["patch"])
    device = torch.device(payload["device"]) if payload["device"] else None
    n = int(X_train.shape[0])
    dtype = getattr(torch, config.train_dtype)
    kidx = kernel_row_indices(n, config.kernel_points)
    Xk, yk = X_train[kidx.to(X_train.device)], y_train[kidx.to(y_train.device)]
    warnings: list[str] = []
    precision_check = None
    t_cell = time.perf_counter()
    model = build_builtin(
        arch,
        n_out=c,
        feature_shape=tuple(payload["feature_shape"]),
        seed=seed,
        dim=width,
        heads=config.heads,
        depth=config.depth,
        patch=patch,
        mlp_ratio=config.mlp_ratio,
        dtype=dtype,
        device=device,
    )
    assert isinstance(model, ViT)  # the sweep's archs are ViTs (checked with the config)
    init = copy.deepcopy(model)
    recipe = dataclasses.replace(config.recipe, seed=seed)
    fr = fit(model, X_train, y_train, recipe, X_val=X_test, y_val=y_test)
    inputs = model.audit_inputs()
    t_init, t_trained = Task(init, c, inputs=inputs), Task(model, c, inputs=inputs)
    if fr.diverged:
        warnings.append(f"{arch} width {width} seed {seed}: training diverged at step {fr.steps_run + 1}")
        mv = None
        lin = LinearizedResult(method="none", applicable=False, reason="training diverged")
    else:
        kernel_dtype = TORCH_DTYPES[config.precision]
        mv = kernel_movement(
            t_init,
            t_trained,
            Xk,
            yk,
            form=config.form,
            memory_bytes=config.memory_bytes,
            device=device,
            dtype=kernel_dtype,
        )
        lin = linearized_prediction(
            t_init,
            t_trained,
            recipe,
            X_train,
            y_train,
            X_test,
            y_test,
            method=config.linearized,
            steps=fr.steps_run,
            train_dtype=dtype,
            memory_bytes=config.memory_bytes,
            device=device,
            kernel_dtype=kernel_dtype,
        )
        first = width == config.widths[0] and seed == config.seeds[0]
        if first and kernel_dtype != torch.float64:
            check = kernel_precision_check(t_trained, Xk, kernel_dtype, device)
            precision_check = {"arch": arch, "width": width, "seed": seed, **check.to_dict()}
            if check.warning:
                warnings.append(f"{arch} width {width} seed {seed}: {check.warning}")
    nan = float("nan")
    cell = TransformerCell(
        arch=arch,
        width=width,
        heads=config.heads,
        seed=seed,
        n_params=n_parameters(model),
        steps_run=fr.steps_run,
        diverged=fr.diverged,
        train_loss=fr.final_train_loss,
        train_acc=fr.train_accuracy,
        test_acc=fr.val_accuracy if fr.val_accuracy is not None else nan,
        movement=None if mv is None else mv.movement,
        movement_trace=nan if mv is None else mv.movement_trace,
        norm_ratio=nan if mv is None else mv.norm_ratio,
        kernel_distance=nan if mv is None else mv.kernel_distance,
        cka_init=None if mv is None else mv.cka_init,
        cka_trained=None if mv is None else mv.cka_trained,
        group_movement={}
        if mv is None
        else {g.group: (g.movement if g.movement is not None else g.movement_trace) for g in mv.groups},
        linearized={k: v for k, v in lin.to_dict().items() if k not in ("definition",)},
        distance_rms=lin.distance_rms,
        distance_rel=lin.distance_rel,
        seconds=time.perf_counter() - t_cell,
    )
    return {"cell": asdict(cell), "warnings": warnings, "precision_check": precision_check}
