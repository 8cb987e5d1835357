"""NTK distance: do finite 2L-ReLU / MLP-Attn networks approach their infinite-width
kernel predictor as width grows?

Protocol (one *cell* per model x width x seed):

1. Build the finite network (``models.py``; antisymmetric init by default, so f_0 = 0 up
   to round-off) and train it by full-batch GD for ``steps`` steps (``training.py``).
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
seed replaced by s (:func:`seed_recipe`: the rows a run whose base seed is s uses), and
everything computed from the rows (the analytic NTK Theta_inf, the lr rule, the kernel
predictor, the distances, the kernel metrics) is computed per seed from that seed's rows.

Learning-rate rule (when no lr is given): lr = lr_fraction * 2n / lambda_max(Theta_inf on
the training set), the stable step of linearized GD on the trainer's MSE
(L = 1/(2n) sum ||f - y||^2). The default fraction 1/2 critically damps the top mode and
leaves a factor 2 for finite-width fluctuations of the empirical lambda_max. Under the
standard parametrization Theta_inf grows with width, so the rule gives one lr per width.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

import torch

from attnaudit.errors import AuditError
from attnaudit.core.stats import MIN_SEEDS, mean_interval
from attnaudit.runtime.device import refuse_if_too_big
from attnaudit.models.builtin import (
    ARCHITECTURES,
    ATTN_SCALINGS,
    INITS,
    PARAMETRIZATIONS,
    ModelSpec,
    TwoLayerNet,
    attention_context,
)
from attnaudit.core.ntk import (
    PREDICTOR_MODES,
    AnalyticNTKParts,
    LinearizedGDConfig,
    TwoLayerState,
    analytic_ntk_parts,
    entk_two_layer_blocks,
    kernel_gd_predict,
)
from attnaudit.core.training import (
    LOSSES,
    require_nonzero_inputs,
    TrainConfig,
    accuracy,
    loss_value,
    one_hot_targets,
    train,
)
from attnaudit.runtime.sweep import CellTask, ExecutorConfig, cached, clear_cache, run_cells
from attnaudit.data import HoldoutRecipe, data_fingerprint

if TYPE_CHECKING:
    from attnaudit.data import HoldoutRecipe
    from attnaudit.runtime.sweep import ExecutorConfig

SCHEMA = "attnaudit.ntk-distance/1"
MODEL_LABELS = {"relu": "2L-ReLU", "attn": "MLP-Attn"}
F64 = torch.float64


@dataclass(frozen=True)
class NTKDistanceConfig:
    """Settings of the width sweep; see the module docstring for the protocol.

    ``lr=None`` applies the rule lr = lr_fraction * 2n / lambda_max(Theta_inf).
    ``float32_from_width``: train networks at least this wide in float32 (kernels,
    predictor and all metrics stay float64); None trains everything in ``train_dtype``.
    ``kernel_points``: rows of the training set used for the kernel metrics (None: all;
    otherwise a fixed random subset, drawn with seed 0).
    ``resample_data``: each seed draws its own training and held-out rows
    (:func:`seed_recipe`); False: every seed uses the caller's rows.
    """

    models: tuple[str, ...] = ("relu", "attn")
    widths: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 200
    lr: float | None = None
    lr_fraction: float = 0.5
    loss: str = "mse"
    parametrization: str = "ntk"
    init: str = "antisymmetric"
    attn_scaling: str = "rms"
    predictor: str = "discrete"
    train_dtype: str = "float64"
    float32_from_width: int | None = None
    kernel_points: int | None = None
    resample_data: bool = False

    def __post_init__(self) -> None:
        if not self.models:
            raise AuditError("no models given; use --models relu,attn")
        bad = [m for m in self.models if m not in ARCHITECTURES]
        if bad:
            raise AuditError(f"unknown model(s) {bad}; use a subset of {','.join(ARCHITECTURES)}")
        if len(set(self.models)) != len(self.models):
            raise AuditError("a model is listed twice in --models; list each once")
        if not self.widths:
            raise AuditError("no widths given; use e.g. --widths 16,64,256")
        if any(int(w) != w or w < 1 for w in self.widths):
            raise AuditError(f"widths must be positive integers, got {list(self.widths)}")
        if len(set(self.widths)) != len(self.widths):
            raise AuditError("a width is listed twice in --widths; list each once")
        if self.init == "antisymmetric" and any(w % 2 for w in self.widths):
            odd = [w for w in self.widths if w % 2]
            raise AuditError(f"antisymmetric init needs even widths, got {odd}; use even widths or --init standard")
        if not self.seeds:
            raise AuditError("no seeds given; use --seeds 1 or more")
        if len(set(self.seeds)) != len(self.seeds):
            raise AuditError("a seed is listed twice; list each once")
        if self.steps < 1:
            raise AuditError(f"--steps must be >= 1, got {self.steps}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise AuditError(f"--lr must be a positive number, got {self.lr}")
        if not (0 < self.lr_fraction < 1):
            raise AuditError(f"lr fraction must be in (0, 1) of the stable step 2n/lambda_max, got {self.lr_fraction}")
        if self.loss not in LOSSES:
            raise AuditError(f"unknown loss {self.loss!r}; use one of {', '.join(LOSSES)}")
        if self.parametrization not in PARAMETRIZATIONS:
            raise AuditError(
                f"unknown parametrization {self.parametrization!r}; use one of {', '.join(PARAMETRIZATIONS)}"
            )
        if self.init not in INITS:
            raise AuditError(f"unknown init {self.init!r}; use one of {', '.join(INITS)}")
        if self.attn_scaling not in ATTN_SCALINGS:
            raise AuditError(f"unknown attention scaling {self.attn_scaling!r}; use one of {', '.join(ATTN_SCALINGS)}")
        if self.predictor not in PREDICTOR_MODES:
            raise AuditError(f"unknown predictor {self.predictor!r}; use one of {', '.join(PREDICTOR_MODES)}")
        if self.train_dtype not in ("float64", "float32"):
            raise AuditError(f"--dtype {self.train_dtype!r} is not supported here; use float64 or float32")
        if self.float32_from_width is not None and self.float32_from_width < 1:
            raise AuditError("float32_from_width must be a positive width or None")
        if self.kernel_points is not None and self.kernel_points < 2:
            raise AuditError(f"--kernel-points must be >= 2, got {self.kernel_points}")

    def dtype_for(self, width: int) -> str:
        if self.float32_from_width is not None and width >= self.float32_from_width:
            return "float32"
        return self.train_dtype

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("models", "widths", "seeds"):
            out[key] = list(out[key])
        return out


@dataclass
class Cell:
    """One trained network (model x width x seed) and its kernel predictor."""

    model: str
    width: int
    seed: int
    lr: float
    train_dtype: str
    steps_run: int
    diverged: bool
    distance_rms: float
    distance_rel: float
    ntk_output_rms: float
    distance_train_rms: float
    kernel_movement: float
    kernel_init_error: float
    kernel_movement_complement: float
    kernel_init_error_complement: float
    kernel_movement_trace: float
    net_train_loss: float
    net_initial_loss: float
    net_train_acc: float
    net_test_acc: float
    kernel_train_loss: float
    kernel_train_acc: float
    kernel_test_acc: float
    predictor: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return _clean(asdict(self))


@dataclass
class ModelSummary:
    """Per-model diagnostics of the analytic kernel, the width trend and the verdict."""

    model: str
    condition_number: float
    numerical_rank: int
    top_eig_share: float
    mean_pairwise_cosine: float
    diagnostic_kernel: str
    lr_by_width: dict
    slope_per_seed: list
    slope_mean: float
    slope_std: float
    slope_of_mean: float
    movement_slope: float
    init_error_slope: float
    monotone_decreasing: bool
    trend: str
    verdict: str
    slope_interval: list = field(default_factory=list)  # [low, high]: see INTERVAL_RULE
    interval_rule: str = ""
    increases_beyond_spread: list = field(default_factory=list)  # [[w_a, w_b, rise, spread], ...]
    train_acc_by_width: dict = field(default_factory=dict)  # width -> mean net train accuracy over seeds
    untrained_by_width: dict = field(default_factory=dict)  # width -> within a few points of chance
    untrained: bool = False  # at chance at every width: no trend claim
    chance: float | None = None
    untrained_threshold: float | None = None
    # resample_data: each seed's own analytic-kernel diagnostics and lr per width (the fields
    # above are the first seed's); empty when every seed shares the rows
    kernel_by_seed: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return _clean(asdict(self))


@dataclass
class NTKDistanceResult:
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

        return _summary_rows(self.cells, "model", self.config.models, self.config.widths, head, keys)

    def verdicts(self) -> list[str]:
        return _verdicts(self.models, self.config.models, MODEL_LABELS.__getitem__)

    def to_dict(self) -> dict:
        return _clean(
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


def _cell_grid(
    function: str,
    base: dict,
    grid: tuple[str, Sequence[str], Sequence[int], Sequence[int]],
    label: Callable[[str, int, int], str],
    cost: Callable[[int], float],
    per_seed: Callable[[int], dict] | None = None,
) -> list[CellTask]:
    """A width sweep's cells: one per name, width and seed of ``grid`` (the key the names go
    under, the names, the widths, the seeds), each calling ``function`` on ``base`` and the three.
    ``per_seed(seed)``: payload entries that replace ``base``'s for that seed's cells (its own data)."""
    by, names, widths, seeds = grid
    return [
        CellTask(
            function,
            {**base, **(per_seed(seed) if per_seed is not None else {}), by: name, "width": width, "seed": seed},
            label(name, width, seed),
            cost=cost(width),
        )
        for name in names
        for width in widths
        for seed in seeds
    ]


def _summary_rows(
    cells: Sequence[Any],
    by: str,
    names: Sequence[str],
    widths: Sequence[int],
    head: Callable[[list], dict],
    keys: Sequence[str],
) -> list[dict]:
    """A sweep's summary: one row per name (the cells' ``by``: model or arch) and width, with
    the number of seeds, ``head(cells of the row)`` and the mean and spread over seeds of each
    of ``keys`` (a missing value counts as NaN)."""
    rows = []
    for name in names:
        for width in widths:
            group = [c for c in cells if getattr(c, by) == name and c.width == width]
            row = {by: name, "width": width, "n_seeds": len(group), **head(group)}
            for key in keys:
                row[key] = _stats([getattr(c, key) if getattr(c, key) is not None else float("nan") for c in group])
            rows.append(row)
    return rows


def _verdicts(summaries: Mapping[str, Any], names: Sequence[str], label: Callable[[str], str] = str) -> list[str]:
    """A sweep's verdicts: each model's (``summaries[name].verdict``), or that every cell of it failed."""
    return [summaries[n].verdict if n in summaries else f"{label(n)}: every cell failed; no verdict" for n in names]


def _clean(obj):
    """Non-finite floats -> None so the report is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _stats(values: Sequence[float]) -> dict:
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    if not finite:
        return {"mean": float("nan"), "std": float("nan"), "values": vals}
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) if len(finite) > 1 else 0.0
    return {"mean": mean, "std": std, "values": vals}


def _loglog_slope(widths: Sequence[int], values: Sequence[float]) -> float:
    """Least-squares slope of log(value) against log(width); NaN if fewer than 2 usable points."""
    pts = [(math.log(w), math.log(v)) for w, v in zip(widths, values) if v is not None and math.isfinite(v) and v > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def _rms_rows(F: torch.Tensor) -> float:
    return F.pow(2).sum(1).mean().sqrt().item() if F.numel() else float("nan")


def _kernel_metrics(
    state0: TwoLayerState, stateT: TwoLayerState, Z: torch.Tensor, kinf: torch.Tensor, v: torch.Tensor
) -> dict:
    """Frobenius ratios on the full (n c)^2 kernel, streamed block by output pair (k <= l)."""
    gram = Z @ Z.T
    n = Z.shape[0]

    def project(B: torch.Tensor) -> torch.Tensor:
        # (I - v v^T) B (I - v v^T) without forming the projector
        Bv, vB = B @ v, v @ B
        return B - torch.outer(Bv, v) - torch.outer(v, vB) + (v @ Bv) * torch.outer(v, v)

    acc = dict.fromkeys(("t0", "ainf", "move", "init", "t0_q", "ainf_q", "move_q", "init_q"), 0.0)
    trace0 = torch.zeros(n, n, dtype=Z.dtype, device=Z.device)
    traceT = torch.zeros_like(trace0)
    kinf_q = project(kinf)
    for (k, l, B0), (_, _, BT) in zip(
        entk_two_layer_blocks(state0, Z, gram=gram), entk_two_layer_blocks(stateT, Z, gram=gram)
    ):
        w = 1.0 if k == l else 2.0  # Theta_lk = Theta_kl^T has the same norm
        A = kinf if k == l else None
        dM = BT - B0
        dI = B0 - A if A is not None else B0
        B0q, dMq, dIq = project(B0), project(dM), project(dI)
        acc["t0"] += w * B0.pow(2).sum().item()
        acc["move"] += w * dM.pow(2).sum().item()
        acc["init"] += w * dI.pow(2).sum().item()
        acc["t0_q"] += w * B0q.pow(2).sum().item()
        acc["move_q"] += w * dMq.pow(2).sum().item()
        acc["init_q"] += w * dIq.pow(2).sum().item()
        if k == l:
            acc["ainf"] += kinf.pow(2).sum().item()
            acc["ainf_q"] += kinf_q.pow(2).sum().item()
            trace0 += B0
            traceT += BT

    def ratio(a: str, b: str) -> float:
        return math.sqrt(acc[a] / acc[b]) if acc[b] > 0 else float("nan")

    return {
        "kernel_movement": ratio("move", "t0"),
        "kernel_init_error": ratio("init", "ainf"),
        "kernel_movement_complement": ratio("move_q", "t0_q"),
        "kernel_init_error_complement": ratio("init_q", "ainf_q"),
        "kernel_movement_trace": ((traceT - trace0).norm() / trace0.norm()).item(),
    }


def _spectrum_diagnostics(K: torch.Tensor) -> dict:
    lam = torch.linalg.eigvalsh(0.5 * (K + K.T))
    top = lam[-1].item()
    tol = K.shape[0] * torch.finfo(K.dtype).eps * max(abs(top), abs(lam[0].item()))
    pos = lam[lam > tol]
    total = lam.clamp_min(0).sum().item()
    return {
        "lam_max": top,
        "condition_number": top / pos[0].item() if pos.numel() else float("inf"),
        "numerical_rank": int(pos.numel()),
        "top_eig_share": top / total if total > 0 else float("nan"),
    }


def _mean_pairwise_cosine(Z: torch.Tensor) -> float:
    n = Z.shape[0]
    if n < 2:
        return float("nan")
    U = Z / Z.norm(dim=1, keepdim=True).clamp_min(torch.finfo(Z.dtype).tiny)
    s = U.sum(0)
    # sum over i != j of cos = |sum u|^2 - sum |u|^2
    return ((s @ s - U.pow(2).sum()) / (n * (n - 1))).item()


def untrained_threshold(n_classes: int, n_train: int) -> tuple[float, float]:
    """(chance, threshold): training accuracy below ``threshold`` = 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n))
    is within a few points (or two binomial standard errors) of chance: the model learned nothing
    worth a verdict. ``n_classes``: classes present in the training labels."""
    c = max(int(n_classes), 1)
    chance = 1.0 / c
    return chance, chance + max(0.05, 2.0 * math.sqrt(chance * (1.0 - chance) / max(int(n_train), 1)))


def slope_interval(slopes: Sequence[float]) -> tuple[float, float, float, int]:
    """(mean, low, high, k) of the finite per-seed slopes: the 95 % Student-t interval
    mean +- t(0.975, k - 1) sd / sqrt(k) (:func:`attnaudit.core.stats.mean_interval`; the normal
    "2 sd / sqrt(k)" covers only 0.70-0.82 at k = 2-3); k = 1 gives a point (no interval)."""
    iv = mean_interval(slopes)
    if not iv.n:
        return float("nan"), float("nan"), float("nan"), 0
    assert iv.estimate is not None  # at least one finite slope
    if iv.n == 1:
        return iv.estimate, iv.estimate, iv.estimate, 1
    assert iv.low is not None and iv.high is not None  # two or more: a two-sided interval
    return iv.estimate, iv.low, iv.high, iv.n


INTERVAL_RULE = (
    "slope interval = 95 % Student-t interval mean ± t(0.975, k - 1) sd/sqrt(k) over the k seeds' "
    "log-log slopes (sd ddof 1); an interval that includes 0, or fewer than 3 seeds, reads 'no clear "
    "trend'"
)
MONOTONE_RULE = (
    "an increase of the seed-mean between neighbouring widths counts only when it exceeds the seed "
    "spread there (the larger of the two widths' sd over seeds)"
)


def increases_beyond_spread(widths: Sequence[int], means: Sequence[float], sds: Sequence[float] | None) -> list[list]:
    """[[w_a, w_b, rise, spread], ...] for neighbouring widths (sorted) where the mean rises by more
    than max(sd_a, sd_b) (with one seed, or no sds, every rise counts)."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    out = []
    for i, j in zip(order, order[1:]):
        a, b = means[i], means[j]
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            continue
        spread = 0.0
        if sds is not None:
            vals = [v for v in (sds[i], sds[j]) if v is not None and math.isfinite(v)]
            spread = max(vals) if vals else 0.0
        if b - a > spread:
            out.append([widths[i], widths[j], b - a, spread])
    return out


def _trend(
    slopes: list[float],
    monotone: bool | None = None,
    *,
    widths: Sequence[int] | None = None,
    means: Sequence[float] | None = None,
    sds: Sequence[float] | None = None,
    untrained: bool = False,
) -> str:
    """The trend word: untrained / undetermined / no-clear-trend / falls / falls-non-monotone / rises.

    ``falls``/``rises`` only when the slope interval (:func:`slope_interval`) excludes 0;
    ``falls-non-monotone`` when it falls but the seed-mean curve rises between neighbouring
    widths by more than the seed spread there (``widths``, ``means``, ``sds``; without them the
    legacy ``monotone`` flag decides). ``untrained``: the model stayed at chance at every
    width, so no trend is claimed.
    """
    if untrained:
        return "untrained"
    mean, lo, hi, k = slope_interval(slopes)
    if not k:
        return "undetermined"
    if lo <= 0 <= hi or k < MIN_SEEDS:
        return "no-clear-trend"
    if hi < 0:
        if widths is not None and means is not None:
            rising = increases_beyond_spread(widths, means, sds)
            return "falls-non-monotone" if rising else "falls"
        return "falls" if (monotone is None or monotone) else "falls-non-monotone"
    return "rises"


KERNEL_RATE = -0.5  # distance ~ m^-1/2 in the kernel regime (kernel fluctuation and movement are O(m^-1/2))


def _verdict(
    label: str,
    trend: str,
    slope_mean: float,
    slope_std: float,
    k: int,
    rel_last: float,
    w_first: int,
    w_last: int,
    d_first: float,
    d_last: float,
    *,
    interval: tuple[float, float] | None = None,
    rising: Sequence | None = None,
    untrained_widths: Sequence[int] = (),
    train_acc: dict | None = None,
    chance: float | None = None,
) -> str:
    """One sentence: the measured trend with its interval, its rate against m^-1/2, and what it means.

    Never claims more than the numbers: a model at chance at every width gets no trend claim;
    an interval that includes 0 reads "no clear trend"; one seed gives no interval, so no claim
    about the kernel regime is made from it.
    """
    accs = train_acc or {}
    if trend == "untrained":
        acc = ", ".join(f"m={w}: {100 * a:.0f}%" for w, a in accs.items())
        where = (
            "at every width"
            if not untrained_widths or len(untrained_widths) == len(accs)
            else f"at {len(untrained_widths)} of {len(accs)} widths, leaving fewer than two trained widths"
        )
        return (
            f"{label}: untrained — the network stayed within a few points of chance ({100 * (chance or 0):.0f}%) "
            f"{where} (train accuracy {acc}); its distance to the NTK predictor is no evidence about the "
            "kernel regime, so no claim is made."
        )
    if trend == "undetermined":
        return f"{label}: trend undetermined (needs at least two widths with finite distances)."
    if interval is not None and k > 1:
        spread = (
            f"{slope_mean:+.2f} ± {slope_std:.2f} over {k} seeds, interval [{interval[0]:+.2f}, {interval[1]:+.2f}]"
        )
    else:
        spread = (
            f"{slope_mean:+.2f} ± {slope_std:.2f} over {k} seeds"
            if k > 1
            else f"{slope_mean:+.2f}, 1 seed (no interval)"
        )
    factor = d_first / d_last if d_last and d_last > 0 else float("nan")
    predicted = (w_last / w_first) ** -KERNEL_RATE
    change = f"fell by a factor {factor:.3g}" if factor >= 1 else f"rose by a factor {1 / factor:.3g}"
    rate = (
        f"log-log slope {spread}, kernel regime about {KERNEL_RATE}; the distance {change} from m={w_first} "
        f"to m={w_last}, where m^-1/2 predicts a fall by a factor {predicted:.3g}; "
        f"relative distance {rel_last:.1%} at m={w_last}"
    )
    one_seed = k <= 1
    if trend == "falls":
        head = (
            f"{label}: distance to the NTK predictor falls with width, no rise between neighbouring widths beyond "
            f"the seed spread ({rate})"
        )
        if one_seed:
            claim = "a single seed gives no interval, so this is not resolved; rerun with more seeds"
        else:
            claim = (
                "approaching the kernel regime as width grows, but at less than half the m^-1/2 rate"
                if slope_mean > KERNEL_RATE / 2
                else "approaching the kernel regime as width grows"
            )
    elif trend == "falls-non-monotone":
        where = "; ".join(f"m={a}->{b} rose by {r:.3g} (seed spread {sp:.2g})" for a, b, r, sp in (rising or []))
        head = (
            f"{label}: distance falls overall but not monotonically with width ({where}{'; ' if where else ''}{rate})"
        )
        claim = "not clearly approaching the kernel regime at these widths"
    elif trend == "rises":
        head = f"{label}: distance to the NTK predictor rises with width ({rate})"
        claim = (
            "a single seed gives no interval, so this is not resolved; rerun with more seeds"
            if one_seed
            else "moving away from the kernel regime"
        )
    else:
        head = f"{label}: no clear trend of distance with width (the slope interval includes 0; {rate})"
        claim = "no evidence of approaching the kernel regime at these widths"
    if untrained_widths:
        # a distance measured on a network that learned nothing is no evidence: no regime claim from this sweep
        claim = (
            f"no claim about the kernel regime: at width(s) {', '.join(str(w) for w in untrained_widths)} the "
            "network stayed within a few points of chance ("
            + ", ".join(f"{100 * accs[w]:.0f}%" for w in untrained_widths if w in accs)
            + f" train accuracy against a chance level of {100 * (chance or 0):.0f}%), so the trend mixes trained "
            "and untrained networks"
        )
    return f"{head} — {claim}."


# The presets live with the request (attnaudit.analyses.ntk_distance.run.PRESETS).


ProgressFn = Callable[[], None]
ModelHook = Callable[[str, int, int, TwoLayerNet], None]


def cell_memory_bytes(
    width: int, n_train: int, n_test: int, d: int, n_classes: int, kernel_points: int | None = None
) -> int:
    """Peak bytes of one width-``width`` cell of the sweep, estimated before any compute.

    Counts float64 copies of the parameters (network, initial and final states, gradients:
    6 x m(d + c)), the training and test activations (4 n m + 2 n_test m) and the
    kernel-movement features (4 kp m); the n x n kernels are shared by all widths and small.
    """
    m, kp = int(width), int(n_train if kernel_points is None else min(n_train, kernel_points))
    return 8 * (6 * m * (d + n_classes) + (4 * n_train + 2 * n_test + 4 * kp) * m)


def run_ntk_distance(
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    n_classes: int,
    config: NTKDistanceConfig = NTKDistanceConfig(),
    *,
    progress: ProgressFn | None = None,
    on_model: ModelHook | None = None,
    executor: "ExecutorConfig | None" = None,
    data: "HoldoutRecipe | None" = None,
) -> NTKDistanceResult:
    """Run the width sweep (see the module docstring). Tensors' device is used throughout.

    ``progress()`` is called after each cell; ``on_model(model, width, seed, net)`` gets
    each trained network (an attnaudit TwoLayerNet, e.g. to save it; local executor only).
    Each model x width x seed is one cell (:func:`ntk_cell`) run by ``executor``
    (:mod:`attnaudit.runtime.sweep`; default: in this process). Executors other than the local
    in-process one need ``data``, the recipe the tensors came from, since cells ship their
    configuration, not tensors. Cells that fail are listed in ``result.failed_cells``; the
    summaries use the cells that finished.
    """

    t_start = time.perf_counter()
    ex = executor or ExecutorConfig()
    if X_train.ndim != 2 or X_test.ndim != 2 or X_train.shape[1] != X_test.shape[1]:
        raise AuditError("training and test inputs must be (n, d) matrices with the same d")
    if y_train is None or y_test is None:
        raise AuditError("ntk-distance needs labels; use a labelled dataset or a data file with labels")
    n, d = X_train.shape
    if n < 2 or X_test.shape[0] < 1:
        raise AuditError(f"need at least 2 training and 1 test points, got {n} and {X_test.shape[0]}")
    c = max(int(n_classes), int(y_train.max().item()) + 1, int(y_test.max().item()) + 1)
    device = X_train.device
    require_nonzero_inputs(X_train)
    present = torch.unique(y_train).tolist()
    if len(present) < 2:
        raise AuditError(
            f"the training labels hold a single class ({present[0]}): a classifier's distance to its kernel "
            "predictor says nothing with one class; keep at least two classes (e.g. --classes 3,5)"
        )
    widest = max(config.widths)
    refuse_if_too_big(
        cell_memory_bytes(widest, n, int(X_test.shape[0]), d, c, config.kernel_points),
        device,
        f"one network of width {widest} (--widths) with its activations and kernel features",
        "use smaller --widths, or fewer --n-train / --kernel-points",
    )
    remote = ex.kind != "local" or ex.jobs > 1
    if remote and data is None:
        raise AuditError(
            "cells on worker processes or Ray rebuild their data from a recipe; pass data=HoldoutRecipe(...) "
            "(the CLI does), or run with the local executor"
        )
    if on_model is not None and (remote or ex.resume_dir):
        raise AuditError(
            "--save-models keeps the trained networks of this process; use it with the local executor "
            "and without --resume"
        )
    if config.resample_data and data is None:
        raise AuditError(
            "--resample-data draws each seed's rows from the data recipe; pass data=HoldoutRecipe(...) (the CLI does)"
        )
    # the driver's own tensors serve the in-process cells; workers load theirs from the recipe
    memory_key = data.key if data is not None else f"memory:{id(X_train)}"
    sweep = _Sweep(memory_key, X_train, y_train, X_test, y_test, c)
    cached(f"ntk-sweep:{memory_key}", lambda: sweep)
    hook_key = None
    if on_model is not None:
        hook_key = f"ntk-hook:{id(on_model)}"
        cached(hook_key, lambda: on_model)
    payload_data = data.to_dict() if data is not None else None
    base = {
        "data": payload_data,
        "memory_key": memory_key,
        "n_classes": c,
        "config": config.to_dict(),
        "device": str(device),
        "hook": hook_key,
    }

    def seed_data(seed: int) -> dict:
        """The cell's data: the caller's rows, or (resample_data) the rows drawn with ``seed``."""
        if not config.resample_data:
            return {}
        assert data is not None  # refused above
        rec = seed_recipe(data, seed)
        return {"data": rec.to_dict(), "memory_key": rec.key}

    tasks = _cell_grid(
        "attnaudit.analyses.ntk_distance.widths:ntk_cell",
        base,
        ("model", config.models, config.widths, config.seeds),
        lambda arch, width, seed: f"{arch} m={width} seed={seed}",
        float,
        per_seed=seed_data if config.resample_data else None,
    )
    try:
        # each seed's rows (one shared sweep unless resample_data), loaded before any training so
        # a seed whose rows cannot serve fails now; the in-process cells reuse them
        sweeps = {s: _seed_sweep(sweep, {**base, **seed_data(s)}) for s in config.seeds}
        if config.resample_data:
            for s, sw in sweeps.items():
                classes = torch.unique(sw.y).tolist()
                if len(classes) < 2:
                    raise AuditError(
                        f"seed {s}'s training rows hold a single class ({classes[0]}); keep at least two classes "
                        "(e.g. --classes 3,5) or more --n-train"
                    )
        outcomes = run_cells(
            tasks,
            ex,
            on_done=(lambda o: progress()) if progress is not None else None,
            encode=lambda r: r,
            decode=lambda r: r,
        )
        warnings: list[str] = []
        cells = [Cell(**o.result) for o in outcomes if o.ok]
        failed = [o.failure() for o in outcomes if not o.ok]
        summaries: dict[str, ModelSummary] = {}
        # one diagnostic pass per distinct set of rows: the shared sweep, or (resample_data) each seed's
        kernel_seeds: list[tuple[int, _Sweep]] = []
        for s, sw in sweeps.items():
            if all(sw is not other for _, other in kernel_seeds):
                kernel_seeds.append((s, sw))
        for arch in config.models:
            ctx = kernel_seeds[0][1].arch_context(arch, config)  # the first seed's rows
            lr_by_width: dict[int, float] = {}
            kernel_by_seed = []
            singular = []
            for s, sw in kernel_seeds:
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
                            "mean_pairwise_cosine": _mean_pairwise_cosine(seed_ctx.Z),
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
                summaries[arch] = _summarise(arch, group, config, ctx, lr_by_width, n_present=len(present))
                summaries[arch].kernel_by_seed = kernel_by_seed
            warnings.extend(singular)
        rows_by_seed = _rows_by_seed(config, sweeps, data, seed_recipe if config.resample_data else None)
    finally:
        clear_cache()
    if failed:
        warnings.append(
            f"{len(failed)} of {len(tasks)} cells failed (listed in failed_cells): "
            + "; ".join(f"{f['cell']}: {f['error']}" for f in failed[:3])
        )
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
        execution={**ex.to_dict(), "cells": len(tasks), "resumed": sum(o.resumed for o in outcomes)},
        rows_by_seed=rows_by_seed,
    )


def seed_recipe(recipe: HoldoutRecipe, seed: int) -> HoldoutRecipe:
    """``recipe`` with every seed replaced by ``seed`` (the rows' subset and their split): the rows
    a run whose base seed is ``seed`` trains and is measured on (``resample_data``)."""
    return dataclasses.replace(recipe, seed=int(seed), spec={**recipe.spec, "seed": int(seed)})


def _seed_sweep(shared: "_Sweep", payload: dict) -> "_Sweep":
    """A seed's :class:`_Sweep`: the shared one when the payload names its rows, else built (and
    cached for the in-process cells) from the payload's recipe."""
    return shared if payload["memory_key"] == shared.key else _sweep_for(payload)


def _rows_by_seed(
    config: NTKDistanceConfig,
    sweeps: Mapping[int, "_Sweep"],
    data: "HoldoutRecipe | None",
    reseed: Callable[[HoldoutRecipe, int], HoldoutRecipe] | None,
) -> list[dict]:
    """Per seed, the rows it trained and was measured on: the split's seed, the holdout index
    checksums (from the recipe) and checksums of the rows' contents; ``reseed`` None: one split."""
    out = []
    for s in config.seeds:
        sw = sweeps[s]
        rec = data if data is None or reseed is None else reseed(data, s)
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


@dataclass
class _ArchContext:
    context: torch.Tensor | None
    Z: torch.Tensor
    Zt: torch.Tensor
    parts_tr: AnalyticNTKParts
    parts_te: AnalyticNTKParts
    spec_diag: dict


@dataclass
class _WidthContext:
    kinf: torch.Tensor
    kinf_test: torch.Tensor
    lam_max: float
    lr: float
    kin_k: torch.Tensor
    v_top: torch.Tensor
    gd_cfg: LinearizedGDConfig


class _Sweep:
    """One sweep's rows and the per-model / per-width quantities its cells share (cached per process)."""

    def __init__(self, key: str, X_train, y_train, X_test, y_test, c: int) -> None:
        device = X_train.device
        self.key = key
        self.X = X_train.to(F64)
        self.Xt = X_test.to(device, F64)
        self.y, self.yt = y_train.to(device).long(), y_test.to(device).long()
        self.c = c
        self.Y = one_hot_targets(self.y, c).to(device)
        self._arch: dict = {}
        self._width: dict = {}

    def kernel_rows(self, config: NTKDistanceConfig) -> torch.Tensor:
        n = self.X.shape[0]
        kp = n if config.kernel_points is None else min(n, config.kernel_points)
        # a fixed random subset (rows arrive in source order, which may be sorted by class)
        return (
            torch.arange(n, device=self.X.device)
            if kp == n
            else (torch.randperm(n, generator=torch.Generator().manual_seed(0))[:kp].sort().values.to(self.X.device))
        )

    def arch_context(self, arch: str, config: NTKDistanceConfig) -> _ArchContext:
        key = (arch, config.attn_scaling, config.parametrization, max(config.widths))
        if key not in self._arch:
            X, Xt = self.X, self.Xt
            if arch == "attn":
                context = attention_context(X, config.attn_scaling).to(X.device, F64)
                Z, Zt = X @ context, Xt @ context
            else:
                context, Z, Zt = None, X, Xt
            parts_tr = analytic_ntk_parts(Z)
            parts_te = analytic_ntk_parts(Zt, Z)
            ref_kernel = parts_tr.kernel(config.parametrization, max(config.widths))
            self._arch[key] = _ArchContext(context, Z, Zt, parts_tr, parts_te, _spectrum_diagnostics(ref_kernel))
        return self._arch[key]

    def width_context(self, arch: str, width: int, config: NTKDistanceConfig) -> _WidthContext:
        key = (
            arch,
            width,
            config.attn_scaling,
            config.parametrization,
            config.lr,
            config.lr_fraction,
            config.steps,
            config.predictor,
            config.loss,
            config.kernel_points,
        )
        if key not in self._width:
            ctx = self.arch_context(arch, config)
            n = self.X.shape[0]
            kinf = ctx.parts_tr.kernel(config.parametrization, width)
            kinf_test = ctx.parts_te.kernel(config.parametrization, width)
            lam_max = torch.linalg.eigvalsh(0.5 * (kinf + kinf.T))[-1].item()
            lr = config.lr if config.lr is not None else config.lr_fraction * 2 * n / lam_max
            kidx = self.kernel_rows(config)
            kin_k = kinf[kidx][:, kidx]
            evals, evecs = torch.linalg.eigh(0.5 * (kin_k + kin_k.T))
            gd_cfg = LinearizedGDConfig(lr=lr, steps=config.steps, mode=config.predictor, loss=config.loss)
            self._width[key] = _WidthContext(kinf, kinf_test, lam_max, lr, kin_k, evecs[:, -1], gd_cfg)
        return self._width[key]


def _sweep_for(payload: dict) -> _Sweep:
    """This process's :class:`_Sweep` for a cell: the driver's own, or rebuilt from the data recipe."""

    def build() -> _Sweep:
        recipe = HoldoutRecipe(**payload["data"])
        train_ds, test_ds = recipe.load()
        dev = torch.device(payload["device"])
        return _Sweep(
            payload["memory_key"],
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            payload["n_classes"],
        )

    return cached(f"ntk-sweep:{payload['memory_key']}", build)


def ntk_cell(payload: dict) -> dict:
    """One model x width x seed cell of the sweep (a pure function of ``payload``): the Cell as a dict."""

    raw = dict(payload["config"])
    for key in ("models", "widths", "seeds"):
        raw[key] = tuple(raw[key])
    config = NTKDistanceConfig(**raw)
    sweep = _sweep_for(payload)
    arch, width, seed = payload["model"], int(payload["width"]), int(payload["seed"])
    ctx = sweep.arch_context(arch, config)
    w = sweep.width_context(arch, width, config)
    hook = cached(payload["hook"], lambda: None) if payload.get("hook") else None
    cell = _run_cell(
        arch,
        width,
        seed,
        w.lr,
        config,
        ctx.context,
        ctx.Z,
        ctx.Zt,
        sweep.X,
        sweep.Xt,
        sweep.y,
        sweep.yt,
        sweep.Y,
        sweep.c,
        w.kinf,
        w.kinf_test,
        w.gd_cfg,
        w.kin_k,
        w.v_top,
        sweep.kernel_rows(config),
        hook,
        time.perf_counter(),
    )
    return asdict(cell)


def _summarise(
    arch: str,
    group: list,
    config: NTKDistanceConfig,
    ctx: _ArchContext,
    lr_by_width: dict,
    n_present: int | None = None,
) -> "ModelSummary":
    """Per-model slopes and verdict from the cells that finished (a failed cell leaves its seed's slope out).

    ``n_present``: classes present in the training labels (chance = 1/n_present; 10 when not given).
    A model whose mean net training accuracy is at chance at every width gets no trend claim."""
    widths = sorted({cl.width for cl in group}, key=list(config.widths).index)
    per_seed = []
    for s in config.seeds:
        mine = {cl.width: cl.distance_rms for cl in group if cl.seed == s}
        if all(w in mine for w in widths):
            per_seed.append(_loglog_slope(widths, [mine[w] for w in widths]))
    dist_stats = [_stats([cl.distance_rms for cl in group if cl.width == w]) for w in widths]
    mean_dist = [st["mean"] for st in dist_stats]
    sd_dist = [st["std"] for st in dist_stats]
    mean_move = [_stats([cl.kernel_movement for cl in group if cl.width == w])["mean"] for w in widths]
    mean_init = [_stats([cl.kernel_init_error for cl in group if cl.width == w])["mean"] for w in widths]
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    ordered = [mean_dist[i] for i in order]
    monotone = all(b < a for a, b in zip(ordered, ordered[1:]))
    slope_stats = _stats(per_seed)
    # untrained rule: mean net train accuracy per width against chance + a few points
    n_train = int(ctx.Z.shape[0])
    c = n_present or 10
    chance, threshold = untrained_threshold(c, n_train)
    acc_by_width = {w: _stats([cl.net_train_acc for cl in group if cl.width == w])["mean"] for w in widths}
    untrained_by_width = {w: bool(math.isfinite(a) and a < threshold) for w, a in acc_by_width.items()}
    all_untrained = bool(untrained_by_width) and all(untrained_by_width.values())
    # at chance somewhere and fewer than two trained widths left: no trend to read at all
    too_few_trained = any(untrained_by_width.values()) and sum(not u for u in untrained_by_width.values()) < 2
    rising = increases_beyond_spread(widths, mean_dist, sd_dist)
    trend = _trend(per_seed, monotone, widths=widths, means=mean_dist, sds=sd_dist, untrained=too_few_trained)
    _, lo, hi, _k = slope_interval(per_seed)
    first, last = widths[order[0]], widths[order[-1]]
    rel_last = _stats([cl.distance_rel for cl in group if cl.width == last])["mean"]
    if config.parametrization == "ntk":
        diag_name = "analytic NTK on the training set (width free, NTK parametrization)"
    else:
        diag_name = f"expected NTK at width {max(config.widths)} (standard parametrization)"
    return ModelSummary(
        model=arch,
        condition_number=ctx.spec_diag["condition_number"],
        numerical_rank=ctx.spec_diag["numerical_rank"],
        top_eig_share=ctx.spec_diag["top_eig_share"],
        mean_pairwise_cosine=_mean_pairwise_cosine(ctx.Z),
        diagnostic_kernel=diag_name,
        lr_by_width={str(w): lr_by_width[w] for w in config.widths},
        slope_per_seed=per_seed,
        slope_mean=slope_stats["mean"],
        slope_std=slope_stats["std"],
        slope_of_mean=_loglog_slope(widths, mean_dist),
        movement_slope=_loglog_slope(widths, mean_move),
        init_error_slope=_loglog_slope(widths, mean_init),
        monotone_decreasing=monotone,
        trend=trend,
        verdict=_verdict(
            MODEL_LABELS[arch],
            trend,
            slope_stats["mean"],
            slope_stats["std"],
            len(per_seed),
            rel_last,
            first,
            last,
            mean_dist[order[0]],
            mean_dist[order[-1]],
            interval=(lo, hi),
            rising=rising,
            untrained_widths=[w for w in widths if untrained_by_width[w]],
            train_acc=acc_by_width,
            chance=chance,
        ),
        slope_interval=[lo, hi],
        interval_rule=INTERVAL_RULE + "; " + MONOTONE_RULE,
        increases_beyond_spread=rising,
        train_acc_by_width={str(w): a for w, a in acc_by_width.items()},
        untrained_by_width={str(w): u for w, u in untrained_by_width.items()},
        untrained=all_untrained,
        chance=chance,
        untrained_threshold=threshold,
    )


def _run_cell(
    arch,
    width,
    seed,
    lr,
    config,
    context,
    Z,
    Zt,
    X,
    Xt,
    y,
    yt,
    Y,
    c,
    kinf,
    kinf_test,
    gd_cfg,
    kin_k,
    v_top,
    kidx,
    on_model,
    t_cell,
) -> Cell:
    """Train one network on the MLP's inputs Z and compare it with the kernel predictor."""
    device = Z.device
    dtype_name = config.dtype_for(width)
    tdt = torch.float32 if dtype_name == "float32" else F64
    # The MLP is trained on precomputed f_att(X): identical maths to MLP-Attn's forward,
    # without re-applying the (d x d) context every step.
    spec = ModelSpec(
        "relu",
        Z.shape[1],
        width,
        c,
        parametrization=config.parametrization,
        init=config.init,
        attn_scaling=config.attn_scaling,
        seed=seed,
    )
    net = TwoLayerNet(spec, dtype=tdt).to(device)
    state0 = TwoLayerState.from_model(net)
    with torch.no_grad():
        f0 = net(Z.to(tdt)).to(F64)
        f0t = net(Zt.to(tdt)).to(F64)
    result = train(net, Z.to(tdt), y, TrainConfig(loss=config.loss, lr=lr, steps=config.steps))
    stateT = TwoLayerState.from_model(net)
    W64, a64 = stateT.W.to(F64), stateT.a.to(F64)

    def forward64(inputs: torch.Tensor) -> torch.Tensor:
        return torch.relu(inputs @ W64.T * stateT.s_in) @ a64 * stateT.s_out

    f_tr, f_te = forward64(Z), forward64(Zt)
    initial_loss = result.loss_curve[0] if result.loss_curve else float("nan")
    final_loss = loss_value(f_tr, y, config.loss).item()
    diverged = bool(result.diverged or not math.isfinite(final_loss) or final_loss > initial_loss)

    pred = kernel_gd_predict(kinf, Y, gd_cfg, K_test=kinf_test, f0_train=f0, f0_test=f0t)
    pred_test = pred.f_test
    assert pred_test is not None  # K_test given
    diff = f_te - pred_test
    dist = _rms_rows(diff)
    ref = _rms_rows(pred_test)
    if diverged or not torch.isfinite(f_tr).all():
        km = dict.fromkeys(
            (
                "kernel_movement",
                "kernel_init_error",
                "kernel_movement_complement",
                "kernel_init_error_complement",
                "kernel_movement_trace",
            ),
            float("nan"),
        )
    else:
        km = _kernel_metrics(_as64(state0), _as64(stateT), Z[kidx], kin_k, v_top)
    if on_model is not None:
        on_model(arch, width, seed, _as_reference_model(arch, spec, context, stateT))
    return Cell(
        model=arch,
        width=width,
        seed=seed,
        lr=lr,
        train_dtype=dtype_name,
        steps_run=result.steps_run,
        diverged=diverged,
        distance_rms=dist,
        distance_rel=dist / ref if ref > 0 else float("nan"),
        ntk_output_rms=ref,
        distance_train_rms=_rms_rows(f_tr - pred.f_train),
        net_train_loss=final_loss,
        net_initial_loss=initial_loss,
        net_train_acc=accuracy(f_tr, y),
        net_test_acc=accuracy(f_te, yt),
        kernel_train_loss=loss_value(pred.f_train, y, config.loss).item(),
        kernel_train_acc=accuracy(pred.f_train, y),
        kernel_test_acc=accuracy(pred_test, yt),
        predictor={"stability_ratio": pred.stability_ratio, "diverges": pred.diverges, "method": pred.method},
        seconds=time.perf_counter() - t_cell,
        **km,
    )


def _as64(state: TwoLayerState) -> TwoLayerState:
    return TwoLayerState(state.W.to(F64), state.a.to(F64), state.s_in, state.s_out)


def _as_reference_model(arch: Literal["relu", "attn"], spec: ModelSpec, context, state: TwoLayerState) -> TwoLayerNet:
    """The trained weights as an attnaudit model of the requested architecture (attn keeps its context)."""
    full_spec = ModelSpec(
        arch,
        spec.d_in,
        spec.width,
        spec.n_out,
        parametrization=spec.parametrization,
        init=spec.init,
        attn_scaling=spec.attn_scaling,
        seed=spec.seed,
    )
    net = TwoLayerNet(full_spec, context=None if context is None else context.cpu(), dtype=state.W.dtype)
    with torch.no_grad():
        net.W.copy_(state.W.cpu())
        net.a.copy_(state.a.cpu())
    return net


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def _pm(stat: dict, fmt: str = "{:.3g}") -> str:
    mean, std = stat["mean"], stat["std"]
    if mean is None or not math.isfinite(mean):
        return "—"
    return fmt.format(mean) + ("" if not std else " ± " + fmt.format(std))


def build_tables(result: NTKDistanceResult) -> list:
    """Rich renderables: per model x width table, then per-model diagnostics and verdicts."""
    from rich.table import Table
    from rich.text import Text

    n_seeds = len(result.config.seeds)
    rows = ", rows resampled per seed" if result.config.resample_data else ""
    table = Table(title=f"NTK distance (held-out n={result.n_test}, mean ± sd over {n_seeds} seed(s){rows})")
    for col in (
        "model",
        "width",
        "‖f_m − f_NTK‖ rms",
        "relative",
        "ΔΘ/Θ₀",
        "Θ₀ vs Θ∞",
        "ΔΘ/Θ₀ ⊥top",
        "Θ₀ vs Θ∞ ⊥top",
        "net acc tr/te",
        "kernel acc tr/te",
        "loss net/kernel",
    ):
        table.add_column(col, justify="right" if col not in ("model",) else "left")
    for row in result.summary_rows():
        pct = "{:.1%}"
        table.add_row(
            MODEL_LABELS[row["model"]],
            str(row["width"]) + (" ⚠" if row["diverged"] else ""),
            _pm(row["distance_rms"]),
            _pm(row["distance_rel"], pct),
            _pm(row["kernel_movement"]),
            _pm(row["kernel_init_error"]),
            _pm(row["kernel_movement_complement"]),
            _pm(row["kernel_init_error_complement"]),
            f"{row['net_train_acc']['mean']:.1%}/{row['net_test_acc']['mean']:.1%}",
            f"{row['kernel_train_acc']['mean']:.1%}/{row['kernel_test_acc']['mean']:.1%}",
            f"{row['net_train_loss']['mean']:.3g}/{row['kernel_train_loss']['mean']:.3g}",
        )
    diag = Table(title="Analytic kernel diagnostics and width trend")
    for col in (
        "model",
        "lr",
        "cond(Θ∞)",
        "rank",
        "top-eig share",
        "mean cos",
        "slope dist",
        "slope ΔΘ",
        "slope Θ₀−Θ∞",
        "trend",
    ):
        diag.add_column(col, justify="left" if col in ("model", "trend") else "right")
    for name in result.config.models:
        s = result.models[name]
        lrs = sorted(set(round(v, 12) for v in s.lr_by_width.values()))
        lr_txt = f"{lrs[0]:.4g}" if len(lrs) == 1 else f"{lrs[0]:.3g}…{lrs[-1]:.3g}"
        slope = "—" if not math.isfinite(s.slope_mean) else f"{s.slope_mean:+.2f} ± {s.slope_std:.2f}"
        diag.add_row(
            MODEL_LABELS[name],
            lr_txt,
            f"{s.condition_number:.3g}",
            f"{s.numerical_rank}/{result.n_train}",
            f"{s.top_eig_share:.1%}",
            f"{s.mean_pairwise_cosine:.4f}",
            slope,
            _fmt_slope(s.movement_slope),
            _fmt_slope(s.init_error_slope),
            s.trend,
        )
    out: list[Table | Text] = [table, diag]
    for text in result.verdicts():
        out.append(Text(text))
    for w in result.warnings:
        out.append(Text("warning: " + w, style="yellow"))
    return out


def _fmt_slope(x: float) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:+.2f}"


def plot_ntk_distance(result: NTKDistanceResult, path) -> None:
    """PNG: distance vs width and kernel movement vs width, log-log, error bars = sd over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.summary_rows()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for idx, name in enumerate(result.config.models):
        sel = sorted((r for r in rows if r["model"] == name), key=lambda r: r["width"])
        w = [r["width"] for r in sel]
        color = f"C{idx}"  # one colour per model in both panels
        for ax, key, style in (
            (axes[0], "distance_rms", "o-"),
            (axes[1], "kernel_movement", "o-"),
            (axes[1], "kernel_init_error", "s--"),
        ):
            mean = [r[key]["mean"] for r in sel]
            std = [r[key]["std"] for r in sel]
            label = MODEL_LABELS[name] + (
                "" if key == "distance_rms" else (" movement" if key == "kernel_movement" else " Θ₀ vs Θ∞")
            )
            ax.errorbar(w, mean, yerr=std, fmt=style, color=color, capsize=3, label=label)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width m")
        ax.grid(True, which="both", alpha=0.3)
    ws = sorted(result.config.widths)
    if len(ws) > 1:
        first = [r for r in rows if r["width"] == ws[0]]
        anchor = max((r["distance_rms"]["mean"] for r in first if r["distance_rms"]["mean"]), default=None)
        if anchor and math.isfinite(anchor):
            axes[0].plot(ws, [anchor * (w / ws[0]) ** -0.5 for w in ws], "k:", label="∝ m^-1/2")
    axes[0].set_ylabel("RMS ‖f_m − f_NTK‖ (held-out)")
    axes[0].set_title("Distance to the NTK predictor")
    axes[1].set_ylabel("relative Frobenius norm")
    axes[1].set_title("Kernel movement and initial kernel error")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{result.config.loss.upper()}, {result.config.steps} GD steps, n_train={result.n_train}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
