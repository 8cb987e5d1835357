"""NTK distance: do finite 2L-ReLU / MLP-Attn networks approach their infinite-width
kernel predictor as width grows?

Protocol (one *cell* per model x width x seed):

1. Build the finite network (:mod:`attnaudit.models.builtin`; antisymmetric init by default, so f_0 = 0 up
   to round-off) and train it by full-batch GD for ``steps`` steps (:mod:`attnaudit.core.training`).
2. The kernel predictor: the analytic NTK Theta_inf of the 2-layer ReLU net on the MLP's
   inputs (raw X for relu, f_att(X) for attn), evolved by linearized GD for the same
   number of steps at the same learning rate, from the finite network's own f_0
   (:func:`attnaudit.core.ntk.kernel_gd_predict`).
3. On held-out points: distance = RMS over points of ||f_m(x) - f_NTK(x)||_2 (the norm
   over the c outputs), and relative distance = distance / RMS ||f_NTK(x)||.
4. Kernel movement on the training set, on the full (n c) x (n c) empirical kernel (the
   finite-width kernel is not block diagonal across outputs, so nothing is averaged
   away): ||Theta(T) - Theta(0)||_F / ||Theta(0)||_F, and the initial kernel's distance
   from the analytic one, ||Theta(0) - Theta_inf (x) I_c||_F / ||Theta_inf (x) I_c||_F.
   Both again on the complement of Theta_inf's top eigenvector v, i.e. after projecting
   with Q = (I - v v^T) (x) I_c on both sides: the top direction (the data mean, which
   after attention carries almost all of the kernel's trace) otherwise dominates every
   Frobenius ratio and hides how the directions that separate classes behave.
5. Per model: log-log least-squares slope of distance vs width, per seed; the kernel
   regime predicts about -1/2 (kernel fluctuations and movement are O(1/sqrt(m))).

Seeds: each seed fixes the network's initialisation; the training and held-out rows are
drawn once (the caller's split), unless ``resample_data``: then seed s trains and is
measured on its own rows, the caller's :class:`~attnaudit.data.HoldoutRecipe` with every
seed replaced by s (:func:`~.planning.seed_recipe`: the rows a run whose base seed is s uses), and
everything computed from the rows (the analytic NTK Theta_inf, the lr rule, the kernel
predictor, the distances, the kernel metrics) is computed per seed from that seed's rows.

Learning-rate rule (when no lr is given): lr = lr_fraction * 2n / lambda_max(Theta_inf on
the training set), the stable step of linearized GD on the trainer's MSE
(L = 1/(2n) sum ||f - y||^2). The default fraction 1/2 critically damps the top mode and
leaves a factor 2 for finite-width fluctuations of the empirical lambda_max. Under the
standard parametrization Theta_inf grows with width, so the rule gives one lr per width.

This module runs the sweep (:func:`run_ntk_distance`); one cell is :mod:`.cells`, the
per-model verdicts :mod:`.verdicts`, the tables and figure :mod:`.report`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from dataclasses import dataclass, field

import torch

from attnaudit.analyses.ntk_distance.aggregate import strict_json, summary_rows, sweep_verdicts
from attnaudit.analyses.ntk_distance.cells import (
    F64,
    Cell,
    SweepRows,
    config_key,
    mean_pairwise_cosine,
    seed_rows,
)
from attnaudit.analyses.ntk_distance.config import MODEL_LABELS, SCHEMA, NTKDistanceConfig
from attnaudit.analyses.ntk_distance.planning import (
    ProgressFn,
    cell_grid,
    check_sweep_rows,
    execution_record,
    failed_cells_warning,
    is_remote,
    refuse_too_wide,
    require_data_recipe,
    seed_recipe,
)
from attnaudit.analyses.ntk_distance.verdicts import ModelSummary, summarise_model
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core.training import require_nonzero_inputs
from attnaudit.data import HoldoutRecipe, data_fingerprint
from attnaudit.errors import AuditError
from attnaudit.models.builtin import TwoLayerNet, save_model
from attnaudit.report.envelope import check_target
from attnaudit.runtime.sweep import ExecutorConfig, cached, clear_cache, run_cells

ModelHook = Callable[[str, int, int, TwoLayerNet], None]
CELL_FUNCTION = "attnaudit.analyses.ntk_distance.cells:ntk_cell"


@dataclass
class NTKDistanceResult:
    """The 2-layer width sweep: its cells, per-model summaries and verdicts, warnings."""

    config: NTKDistanceConfig
    n_train: int
    n_test: int
    n_classes: int
    d: int
    cells: list[Cell]
    models: dict[str, ModelSummary]
    warnings: list[str]
    lr_rule: str
    seconds: float
    failed_cells: list = field(default_factory=list)
    execution: dict = field(default_factory=dict)  # executor, cells, resumed (how it ran; not a result)
    rows_by_seed: list = field(default_factory=list)  # per seed: which rows it trained and was measured on

    def summary_rows(self) -> list[dict]:
        """Mean and spread over seeds, one row per model x width."""
        keys = (
            "distance_rms",
            "distance_rel",
            "kernel_movement",
            "kernel_init_error",
            "kernel_movement_complement",
            "kernel_init_error_complement",
            "net_train_acc",
            "net_test_acc",
            "kernel_train_acc",
            "kernel_test_acc",
            "net_train_loss",
            "kernel_train_loss",
        )

        def head(group: list[Cell]) -> dict:
            return {"lr": group[0].lr if group else float("nan"), "diverged": sum(c.diverged for c in group)}

        return summary_rows(self.cells, "model", self.config.models, self.config.widths, head, keys)

    def verdicts(self) -> list[str]:
        """One verdict per model (or that every cell of it failed)."""
        return sweep_verdicts(self.models, self.config.models, MODEL_LABELS.__getitem__)

    def to_dict(self) -> dict:
        return strict_json(
            {
                "schema": SCHEMA,
                "failed_cells": list(self.failed_cells),
                "config": self.config.to_dict(),
                "n_train": self.n_train,
                "n_test": self.n_test,
                "n_classes": self.n_classes,
                "d": self.d,
                "lr_rule": self.lr_rule,
                "distance_definition": "RMS over held-out points of ||f_m(x) - f_NTK(x)||_2 over the c outputs; "
                "relative: divided by RMS ||f_NTK(x)||_2",
                "kernel_definition": "full (n c) x (n c) empirical NTK on the training set (or its first "
                "kernel_points rows, a fixed random subset); complement = both sides projected off the top eigenvector of Theta_inf",
                "rows_by_seed": list(self.rows_by_seed),
                "cells": [c.to_dict() for c in self.cells],
                "summary": self.summary_rows(),
                "models": {k: v.to_dict() for k, v in self.models.items()},
                "warnings": list(self.warnings),
                "verdicts": self.verdicts(),
                "seconds": self.seconds,
            }
        )


def run_ntk_distance(
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    n_classes: int,
    config: NTKDistanceConfig | None = None,
    *,
    progress: ProgressFn | None = None,
    on_model: ModelHook | None = None,
    executor: ExecutorConfig | None = None,
    data: HoldoutRecipe | None = None,
) -> NTKDistanceResult:
    """Run the width sweep (see the module docstring). Tensors' device is used throughout.

    ``progress()`` is called after each cell; ``on_model(model, width, seed, net)`` gets
    each trained network (an attnaudit TwoLayerNet, e.g. to save it; local executor only).
    Each model x width x seed is one cell (:func:`~.cells.ntk_cell`) run by ``executor``
    (:mod:`attnaudit.runtime.sweep`; default: in this process). Executors other than the local
    in-process one need ``data``, the recipe the tensors came from, since cells ship their
    configuration, not tensors. Cells that fail are listed in ``result.failed_cells``; the
    summaries use the cells that finished.
    """
    t_start = time.perf_counter()
    config = config or NTKDistanceConfig()
    ex = executor or ExecutorConfig()
    check_sweep_rows(X_train, X_test)
    if y_train is None or y_test is None:
        raise AuditError("ntk-distance needs labels; use a labelled dataset or a data file with labels")
    n, d = X_train.shape
    c = max(int(n_classes), int(y_train.max().item()) + 1, int(y_test.max().item()) + 1)
    require_nonzero_inputs(X_train)
    present = torch.unique(y_train).tolist()
    if len(present) < 2:
        raise AuditError(
            f"the training labels hold a single class ({present[0]}): a classifier's distance to its kernel "
            "predictor says nothing with one class; keep at least two classes (e.g. --classes 3,5)"
        )
    refuse_too_wide(config.widths, n, int(X_test.shape[0]), d, c, config.kernel_points, X_train.device)
    require_data_recipe(ex, data)
    if on_model is not None and (is_remote(ex) or ex.resume_dir):
        raise AuditError(
            "on_model receives the networks trained in this process; use it with the local executor and without resume"
        )
    if config.resample_data and data is None:
        raise FieldError(
            "resample_data", "{name} draws each seed's rows from the data recipe; pass data=HoldoutRecipe(...)"
        )
    # the driver's own tensors and configuration serve the in-process cells; workers build theirs
    memory_key = data.key if data is not None else f"memory:{id(X_train)}"
    shared = SweepRows(memory_key, X_train, y_train, X_test, y_test, c)
    cached(f"ntk-sweep:{memory_key}", lambda: shared)
    cached(config_key(config.to_dict()), lambda: config)
    hook_key = None
    if on_model is not None:
        hook_key = f"ntk-hook:{id(on_model)}"
        cached(hook_key, lambda: on_model)
    base = {
        "data": data.to_dict() if data is not None else None,
        "memory_key": memory_key,
        "n_classes": c,
        "config": config.to_dict(),
        "device": str(X_train.device),
        "hook": hook_key,
    }

    def seed_data(seed: int) -> dict:
        """The cell's data: the caller's rows, or (resample_data) the rows drawn with ``seed``."""
        if not config.resample_data:
            return {}
        assert data is not None  # refused above
        rec = seed_recipe(data, seed)
        return {"data": rec.to_dict(), "memory_key": rec.key}

    tasks = cell_grid(
        CELL_FUNCTION,
        base,
        ("model", config.models, config.widths, config.seeds),
        lambda arch, width, seed: f"{arch} m={width} seed={seed}",
        float,
        per_seed=seed_data if config.resample_data else None,
    )
    try:
        # each seed's rows (one shared sweep unless resample_data), loaded before any training so
        # a seed whose rows cannot serve fails now; the in-process cells reuse them
        sweeps = {s: seed_rows(shared, {**base, **seed_data(s)}) for s in config.seeds}
        if config.resample_data:
            _refuse_single_class(sweeps)
        outcomes = run_cells(
            tasks,
            ex,
            on_done=(lambda o: progress()) if progress is not None else None,
            encode=lambda r: r,
            decode=lambda r: r,
        )
        cells = [Cell(**o.result) for o in outcomes if o.ok]
        failed = [o.failure() for o in outcomes if not o.ok]
        summaries, warnings = _model_summaries(config, cells, sweeps, len(present))
        rows_by_seed = _rows_by_seed(config, sweeps, data)
    finally:
        clear_cache()
    warnings.extend(failed_cells_warning(failed, len(tasks)))
    diverged = [f"{cl.model} m={cl.width} seed={cl.seed}" for cl in cells if cl.diverged]
    if diverged:
        warnings.append(
            "training diverged or did not reduce the loss for " + ", ".join(diverged) + "; lower --lr or --lr-fraction"
        )
    f32 = sorted({cl.width for cl in cells if cl.train_dtype == "float32"})
    if f32:
        warnings.append(
            f"networks of width {f32} were trained in float32 for speed; kernels, predictor and metrics are float64"
        )
    rule = (
        f"lr = {config.lr} (given)"
        if config.lr is not None
        else f"lr = {config.lr_fraction} * 2n / lambda_max(Theta_inf on the training set), n = {n}"
    )
    return NTKDistanceResult(
        config=config,
        n_train=n,
        n_test=X_test.shape[0],
        n_classes=c,
        d=d,
        cells=cells,
        models=summaries,
        warnings=warnings,
        lr_rule=rule,
        seconds=time.perf_counter() - t_start,
        failed_cells=failed,
        execution=execution_record(ex, tasks, outcomes),
        rows_by_seed=rows_by_seed,
    )


def _refuse_single_class(sweeps: Mapping[int, SweepRows]) -> None:
    """Refuse a seed whose own training rows (resample_data) hold a single class."""
    for s, sw in sweeps.items():
        classes = torch.unique(sw.y).tolist()
        if len(classes) < 2:
            raise AuditError(
                f"seed {s}'s training rows hold a single class ({classes[0]}); keep at least two classes "
                "(e.g. --classes 3,5) or more --n-train"
            )


def _model_summaries(
    config: NTKDistanceConfig, cells: list[Cell], sweeps: Mapping[int, SweepRows], n_present: int
) -> tuple[dict[str, ModelSummary], list[str]]:
    """Each model's summary (from the cells that finished) and the warnings about its kernels: an lr
    above the stable step, a numerically singular analytic NTK. One diagnostic pass per distinct set
    of rows: the shared sweep, or (resample_data) each seed's."""
    warnings: list[str] = []
    summaries: dict[str, ModelSummary] = {}
    kernel_seeds: list[tuple[int, SweepRows]] = []
    for s, sw in sweeps.items():
        if all(sw is not other for _, other in kernel_seeds):
            kernel_seeds.append((s, sw))
    for arch in config.models:
        ctx = kernel_seeds[0][1].arch_context(arch, config)  # the first seed's rows
        lr_by_width: dict[int, float] = {}
        kernel_by_seed = []
        singular = []
        for s, sw in kernel_seeds:
            n = sw.X.shape[0]
            who = f"seed {s} " if config.resample_data else ""
            seed_ctx = sw.arch_context(arch, config)
            seed_lr = {}
            for width in config.widths:
                w = sw.width_context(arch, width, config)
                seed_lr[width] = w.lr
                if config.lr is not None and w.lr * w.lam_max / n > 2:
                    warnings.append(
                        f"{who}{arch} m={width}: --lr {w.lr:g} exceeds the stable step 2n/lambda_max = "
                        f"{2 * n / w.lam_max:.4g}; the linearized dynamics (and probably the network) diverge"
                    )
            lr_by_width = lr_by_width or seed_lr
            diag = seed_ctx.spec_diag
            if config.resample_data:
                kernel_by_seed.append(
                    {
                        "seed": s,
                        **{k: diag[k] for k in ("condition_number", "numerical_rank", "top_eig_share")},
                        "mean_pairwise_cosine": mean_pairwise_cosine(seed_ctx.Z),
                        "lr_by_width": {str(w): lr for w, lr in seed_lr.items()},
                    }
                )
            if diag["condition_number"] > 1 / torch.finfo(F64).eps or diag["numerical_rank"] < n:
                singular.append(
                    f"{who}{arch}: the analytic NTK on the training set is numerically singular (numerical rank "
                    f"{diag['numerical_rank']} of {n}); the predictor stays finite (eigen-decomposition, "
                    "null directions follow the lr*T/n limit) but directions below round-off are not resolved"
                )
        group = [cl for cl in cells if cl.model == arch]
        if group:
            summaries[arch] = summarise_model(arch, group, config, ctx, lr_by_width, n_present=n_present)
            summaries[arch].kernel_by_seed = kernel_by_seed
        warnings.extend(singular)
    return summaries, warnings


def _rows_by_seed(config: NTKDistanceConfig, sweeps: Mapping[int, SweepRows], data: HoldoutRecipe | None) -> list[dict]:
    """Per seed, the rows it trained and was measured on: the split's seed, the holdout index
    checksums (from the recipe) and checksums of the rows' contents."""
    out = []
    for s in config.seeds:
        sw = sweeps[s]
        rec = data if data is None or not config.resample_data else seed_recipe(data, s)
        info: dict = {
            "seed": s,
            "split_seed": None if rec is None else int(rec.seed),
            "train_indices_sha256": None,
            "test_indices_sha256": None,
            "train_data_sha256": data_fingerprint(sw.X, sw.y),
            "test_data_sha256": data_fingerprint(sw.Xt, sw.yt),
        }
        if rec is not None:
            tr, te = rec.load()  # cached: the rows this run loaded
            info["train_indices_sha256"] = (tr.info.get("holdout") or {}).get("indices_sha256")
            info["test_indices_sha256"] = (te.info.get("holdout") or {}).get("indices_sha256")
        out.append(info)
    return out


# --------------------------------------------------------------------------- saving the trained networks


def model_filename(arch: str, width: int, seed: int) -> str:
    """The file name ``save_models`` gives one trained 2-layer network."""
    return f"{arch}_m{width}_seed{seed}.safetensors"


def prepare_save_folder(folder: str | Path, config: NTKDistanceConfig, overwrite: bool) -> Path:
    """The folder the trained networks go to (field ``save_models``), made, with every file the sweep
    will write checked first (refused when there, unless ``overwrite``)."""
    save_dir = Path(folder)
    if save_dir.exists() and not save_dir.is_dir():
        raise FieldError("save_models", "{name} " + literal(f"{save_dir} is a file; give a folder"))
    save_dir.mkdir(parents=True, exist_ok=True)
    for arch in config.models:
        for w in config.widths:
            for s in config.seeds:
                target = save_dir / model_filename(arch, w, s)
                check_target(target, overwrite)
                check_target(target.with_suffix(".safetensors.json"), overwrite)
    return save_dir


def model_saver(
    config: NTKDistanceConfig,
    save_dir: Path,
    training_data: dict,
    recipe: HoldoutRecipe | None,
    overwrite: bool,
    saved: list[str],
) -> ModelHook:
    """The sweep's ``on_model`` hook: saves each trained network (path appended to ``saved``) with a
    side-car recording the rows it trained on (``training_data``: the caller's rows; with
    ``resample_data`` each seed's own, from ``recipe``)."""

    def seed_training_data(s: int) -> dict:
        """The side-car's record of the rows seed ``s`` trained on (its own with resample_data)."""
        if not config.resample_data:
            return training_data
        assert recipe is not None  # resample_data is refused with loaded data
        rows, _ = seed_recipe(recipe, s).load()  # cached: the rows its cells trained on
        return {**training_data, "n": rows.n, "seed": s, "fingerprint": data_fingerprint(rows.X, rows.y)}

    def on_model(arch: str, width: int, s: int, net: TwoLayerNet) -> None:
        path = save_model(
            net,
            save_dir / model_filename(arch, width, s),
            overwrite=overwrite,
            metadata={
                "command": "ntk-distance",
                "dataset": training_data["name"],
                "steps": config.steps,
                "training_data": seed_training_data(s),
            },
        )
        saved.append(str(path))

    return on_model
