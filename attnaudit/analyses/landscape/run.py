"""The two-model comparison end to end: train (or take saved) models, analyse each, compare.

:class:`LandscapeRequest` is what ``attnaudit landscape`` asks (its fields are the command's
options; :data:`PRESETS` fill the ones left unset) and :func:`run` answers it with a
:class:`~attnaudit.analyses.result.Result`. :func:`run_landscape` is the engine below: it
builds every model and resolves the parameter selector on each before any training or
analysis, so a selector that matches nothing fails at once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from attnaudit.core.task import LOSSES, Task
from attnaudit.errors import AuditError, check_seed
from attnaudit.analyses.landscape.analysis import LandscapeConfig, LandscapeResult, analyse_landscape
from attnaudit.analyses.landscape.compare import compare_landscapes
from attnaudit.analyses.landscape.directions import DIRECTION_KINDS
from attnaudit.analyses.landscape.setup import DTYPES, ParameterSelectionError, landscape_task, parameter_names
from attnaudit.analyses.request import ANALYSIS, EXECUTION, PROTOCOL, FieldError, Request, field_check, list_of, option
from attnaudit.analyses.request import check_seeds, literal
from attnaudit.analyses.result import Progress as RunProgress, Result, progress_or_silent
from attnaudit.analyses.sources import ModelFields, PresetData
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import train
from attnaudit.core import training as gd
from attnaudit.analyses.landscape.compare import untrained_status
from attnaudit.core.fit import fit
from attnaudit.data import data_fingerprint
from attnaudit.models.builtin import training_data_mismatch
from attnaudit.data import load_dataset, subset
from attnaudit.models.checkpoints import recorded_split
from attnaudit.analyses.landscape.compare import SEED_FIELDS as SEED_FIELDS, seed_record, seed_summary
from attnaudit.analyses.landscape.report import PNG_NAME, SCHEMA, build_tables, plot_landscape
from attnaudit.analyses.landscape.setup import check_selector
from attnaudit.core.training import TrainConfig
from attnaudit.report.envelope import build_report
from attnaudit.runtime.device import resolve_device
from attnaudit.core.fit import Recipe
from attnaudit.models.checkpoints import fit_to_data
from attnaudit.core.fit import DEFAULT_ADAM_LR

Progress = Callable[[int], None] | None
ARCHS = ("relu", "attn")

# Training and analysis sizes per preset; explicit options override every entry.
PRESETS: dict[str, dict] = {
    # digits, both models trained and analysed in well under 2 minutes on 2 CPU cores
    # compared at matched training loss (auto: the larger of the models' losses after the budget),
    # since with fixed steps MLP-Attn ends at ~5x 2L-ReLU's loss and the comparison gate refuses
    "quick": dict(
        dataset="digits", split="train", n_train=500, width=256, steps=1000, lr=4.0, match_loss="auto", seeds=3
    ),
    # real MNIST, training split like every paper preset (pass --split test where only the
    # test split exists, as in ../shared/data); about 5 minutes on 2 CPU cores
    # the paper's protocol: GD for a fixed time (its losses may not be comparable: the gate says so)
    "paper": dict(
        dataset="mnist", split="train", n_train=2000, width=256, steps=1000, lr=4.0, match_loss=None, seeds=1
    ),
}


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
    if int(y.max()) >= getattr(spec, "n_out", int(y.max()) + 1):
        raise AuditError(
            f"saved model {label} has {spec.n_out} outputs but the labels go up to {int(y.max())}; select matching classes"
        )


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
    :class:`attnaudit.data.Dataset`). ``train_config``: a :class:`attnaudit.core.training.TrainConfig`
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
    is then trained until its loss first reaches L* (the slowest one runs its whole budget).

    ``seed_data`` (built-in models; ``--resample-data``): seed -> that seed's own rows (like
    ``data``), on which its model is built (MLP-Attn's context), trained and analysed; None:
    every seed uses ``data``.
    """

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
            if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
                training[label]["spec"] = dataclasses.asdict(spec)
        # models whose audited rows were drawn from their own recorded training split need no warning
        own_rows = {
            label
            for label, info in (saved_info or {}).items()
            if (info.get("audit_rows") or {}).get("rows") == "checkpoint split"
        }
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
    seed_list = tuple(int(s) for s in seeds) if seeds is not None else (int(seed),)
    if not seed_list or len(set(seed_list)) != len(seed_list):
        raise AuditError("give at least one seed, each once")
    if saved and len(seed_list) > 1:
        raise AuditError("--seeds trains independent copies of the built-in models; a saved model is one model")
    if recipe is not None and saved:
        raise AuditError(
            "--optimizer and --batch-size say how to train the built-in models; a saved model is trained already"
        )
    if seed_data is not None:
        if saved:
            raise AuditError(
                "--resample-data draws new training rows per seed, which a saved model was not trained on; drop it"
            )
        missing = [s for s in seed_list if s not in seed_data]
        if missing:
            raise AuditError(f"seed_data holds no rows for seed(s) {', '.join(map(str, missing))}; give every seed's")
        if any(seed_data[s].y is None for s in seed_list):
            raise AuditError("the loss landscape needs labelled data")

    def rows(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(X, y) seed ``s`` trains and is analysed on: its own rows with ``seed_data``, else ``data``'s."""
        if seed_data is None:
            return X, y
        own = seed_data[s]
        return own.X, own.y.to(own.X.device).long()

    for net in nets.values():  # a selector that matches nothing fails now, before training or analysis
        parameter_names(landscape_task(net, X, config.loss, config.params), X)

    resolution = None
    if match_loss_auto:
        if train_config is None or recipe is not None:
            raise AuditError(
                "--match-loss auto trains the built-in models with full-batch GD; drop it for saved models "
                "or --optimizer sgd/adam"
            )
        budget = dataclasses.replace(train_config, loss_tol=None)
        runs: list[dict[str, Any]] = []
        for label in nets:
            for s in seed_list:
                Xs, ys = rows(s)
                tr = gd.train(build_reference_model(label, Xs, data.n_classes, width=width, seed=s), Xs, ys, budget)
                if tr.diverged:
                    raise AuditError(f"training {label} diverged (loss {tr.final_loss}); lower the learning rate")
                runs.append({"model": label, "seed": s, "final_loss": float(tr.final_loss), "steps_run": tr.steps_run})
        slowest = max(runs, key=lambda r: r["final_loss"])
        train_config = dataclasses.replace(train_config, loss_tol=slowest["final_loss"])
        resolution = {
            "rule": "auto: the largest training loss any model reaches within the step budget",
            "target": slowest["final_loss"],
            "set_by": f"{slowest['model']} seed {slowest['seed']}",
            "budget_steps": budget.steps,
            "budget_runs": runs,
        }

    results: dict[str, LandscapeResult] = {}
    seed_results: dict[str, list[LandscapeResult]] = {label: [] for label in nets}
    seed_training: dict[str, list[dict]] = {label: [] for label in nets}
    for label in list(nets):
        for i, s in enumerate(seed_list):
            Xs, ys = rows(s)
            own = i == 0 and Xs is X  # the model built above, on these rows
            net = nets[label] if own else build_reference_model(label, Xs, data.n_classes, width=width, seed=s)
            cfg = config if i == 0 else dataclasses.replace(config, seed=config.seed + (s - seed_list[0]))
            t1 = time.perf_counter()
            if train_config is not None:
                assert isinstance(net, nn.Module)  # only built-in models are trained (train_config is None if saved)
                info = _train_one(label, net, Xs, ys, train_config, recipe, s, gd)
                seed_training[label].append(info)
                if i == 0:
                    training[label] = info
                if progress is not None:
                    progress(info.pop("_units"))
            timings[f"{label}.train"] = timings.get(f"{label}.train", 0.0) + time.perf_counter() - t1
            t1 = time.perf_counter()
            res = analyse_landscape(net, Xs, ys, cfg, progress=progress)
            timings[f"{label}.analysis"] = timings.get(f"{label}.analysis", 0.0) + time.perf_counter() - t1
            seed_results[label].append(res)
            if i == 0:
                results[label] = res

    lr = None if train_config is None or recipe is not None else train_config.lr
    n_present = int(torch.unique(y).numel())
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
        seed_training=seed_training if len(seed_list) > 1 else {},
        seeds=seed_list,
        status=status,
        match_loss_resolution=resolution,
        optimizer=None
        if train_config is None
        else (
            recipe.to_dict()
            if recipe is not None
            else {
                "optimizer": "gd",
                "lr": train_config.lr,
                "batch_size": None,
                "steps": train_config.steps,
                "loss": train_config.loss,
            }
        ),
    )


def _train_one(
    label: str, net: nn.Module, X: torch.Tensor, y: torch.Tensor, train_config, recipe, seed: int, gd
) -> dict:
    """Train one built-in model (full-batch GD, or :func:`attnaudit.core.fit.fit` with ``recipe``); its training record."""
    if recipe is None:
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
        raise AuditError(f"training {label} diverged ({res.notes[0] if res.notes else 'non-finite loss'}); lower --lr")
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


# --------------------------------------------------------------------------- the request and its run

OPTIMIZER_NAMES = ("gd", "sgd", "adam")
#: training losses are compared only within this relative difference (the comparison's gate)
LOSS_COMPARABLE_WITHIN = 0.10


def _match_loss(value: Any, name: str) -> float | str | None:
    """``match_loss``: a positive training loss, ``auto`` or ``none`` (``none`` is kept, so that
    an explicit fixed-step run beats a preset that matches losses)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "none"):
            return text
        try:
            number = float(text)
        except ValueError:
            raise FieldError(
                name,
                "{name}: " + literal(repr(value)) + " is not a number; give a training loss such as 0.2, auto or none",
            ) from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise FieldError(
            name, "{name}: " + literal(repr(value)) + " is not a number; give a training loss such as 0.2, auto or none"
        )
    if not (math.isfinite(number) and number > 0):
        raise FieldError(name, "{name} must be a positive training loss, got " + f"{number:g}")
    return number


@dataclass(frozen=True)
class LandscapeRequest(ModelFields, PresetData, Request):
    """What ``attnaudit landscape`` computes; every field is one option.

    Train the built-in 2L-ReLU / MLP-Attn (``models``) or take saved ones (``checkpoint``,
    ``factory``, ``loaded_models``), then measure each loss landscape: top Hessian eigenvalues,
    trace, basin width and 1-D/2-D surfaces. The fields left None are filled by the preset
    (:meth:`resolved`); an explicit value beats the preset.
    """

    COMMAND = "landscape"
    PRESETS: ClassVar[dict[str, dict]] = PRESETS

    # the preset chooses the data set and split when none is given (PresetData)
    preset: str = option(
        "quick",
        "--preset",
        panel=PROTOCOL,
        help="quick (default; digits, < 2 min on 2 CPU cores) or paper (MNIST train split, n_train 2000, ~5 min). "
        "Explicit options override it.",
    )
    models: tuple[str, ...] | None = option(
        None,
        "--models",
        panel=PROTOCOL,
        parse=list_of(str),
        help="Models to train and compare: relu (2L-ReLU), attn (MLP-Attn), comma-separated (default relu,attn).",
    )
    n_train: int | None = option(
        None,
        "--n-train",
        panel=PROTOCOL,
        kind=int,
        help="Training samples: the loss, Hessian and surfaces are over these (default from --preset).",
    )
    width: int | None = option(
        None, "--width", panel=PROTOCOL, kind=int, help="Hidden width m (default from --preset)."
    )
    steps: int | None = option(
        None, "--steps", panel=PROTOCOL, kind=int, help="Full-batch GD steps (the budget under --match-loss)."
    )
    lr: float | None = option(
        None, "--lr", panel=PROTOCOL, kind=float, help="GD learning rate (default from --preset)."
    )
    loss: str | None = option(
        None,
        "--loss",
        panel=PROTOCOL,
        help="mse or ce: the training loss whose landscape is measured (default mse; a checkpoint's recorded training loss).",
    )
    match_loss: float | str | None = option(
        None,
        "--match-loss",
        panel=PROTOCOL,
        parse=_match_loss,
        help="Train each model until its training loss reaches this value (or say it could not), so sharpness is "
        "compared at equal loss (full-batch GD only); auto: every model to the largest loss any reaches within "
        "--steps (default of --preset quick); none: fixed steps (default of --preset paper). Models are compared "
        "only when their losses are within 10 %.",
    )
    seeds: int | None = option(
        None,
        "--seeds",
        panel=PROTOCOL,
        kind=int,
        help="Independent initialisations, trainings and analyses per built-in model (seeds seed, seed+1, ...; default "
        "3 for --preset quick, 1 for paper); the JSON gains per-seed values with mean/sd, and the comparison uses "
        "the mean with its Student-t tolerance (fewer than 3 seeds never resolve it); with --resample-data each seed "
        "also draws its own training rows.",
    )
    resample_data: bool = option(
        False,
        "--resample-data",
        panel=PROTOCOL,
        negative="--fixed-data",
        help="Each seed draws its own training rows (the rows a run with that --seed uses), so intervals include "
        "the choice of training rows. Built-in models only.",
    )
    optimizer: str | None = option(
        None,
        "--optimizer",
        panel=PROTOCOL,
        help="How the built-in models are trained: gd (full-batch gradient descent, default), sgd or adam "
        "(attnaudit.core.fit).",
    )
    batch_size: int | None = option(
        None,
        "--batch-size",
        panel=PROTOCOL,
        kind=int,
        help="Rows per step of --optimizer sgd/adam (default: full batch).",
    )
    eigenvalues: int = option(
        5,
        "--eigenvalues",
        panel=ANALYSIS,
        help="Number of top Hessian eigenvalues (Lanczos). (--top-k is its older spelling: "
        "in malleability --top-k is the list of k of the top-k overlap.)",
    )
    hutchinson_samples: int = option(
        30, "--hutchinson-samples", panel=ANALYSIS, help="Rademacher probes for the Hessian trace."
    )
    directions: str = option(
        "random",
        "--directions",
        panel=ANALYSIS,
        help="random (filter-normalized Gaussian) or hessian (top eigenvectors) for the surfaces.",
    )
    points: int = option(51, "--points", panel=ANALYSIS, help="Points of the 1-D curve (0 = skip).")
    span: float = option(
        1.0, "--span", panel=ANALYSIS, help="Surfaces cover alpha in [-span, span] (relative distance)."
    )
    grid: int = option(31, "--grid", panel=ANALYSIS, help="Grid size of the 2-D surface (0 = skip).")
    keep_1d_params: bool = option(
        False,
        "--keep-1d-params",
        panel=ANALYSIS,
        help="Perturb biases/1-D parameters too (one filter each) instead of zeroing them in random directions.",
    )
    basin_directions: int = option(
        8, "--basin-directions", panel=ANALYSIS, help="Random directions (both signs) averaged for the basin width."
    )
    basin_factor: float = option(
        2.0,
        "--basin-factor",
        panel=ANALYSIS,
        help="The basin ends where the loss first reaches this factor times its minimum.",
    )
    params: tuple[str, ...] | None = option(
        None,
        "--params",
        panel=ANALYSIS,
        parse=list_of(str),
        help="Only these parameters: all, head (the logits layer), module names or glob patterns, comma-separated "
        "(e.g. W or 'layers.0.*'); default all.",
    )
    precision: str = option(
        "float64",
        "--precision",
        panel=ANALYSIS,
        help="Precision of the analysis: float64 (default) or float32. The engine works on copies; a saved model "
        "keeps its own dtype. (--dtype is its older spelling: elsewhere --dtype is the training dtype.)",
    )
    seed: int = option(
        0,
        "--seed",
        panel=PROTOCOL,
        help="Base random seed; also fixes the training rows (each seed draws its own with --resample-data).",
    )
    device: str = option("auto", "--device", panel=EXECUTION, help="auto, cpu, cuda or cuda:<i>.")

    @property
    def optimizer_name(self) -> str:
        return (self.optimizer or "gd").strip().lower()

    @property
    def match_target(self) -> float | str | None:
        """The loss target as given: a number, ``auto``, or None (none given, or ``none``)."""
        value = _match_loss(self.match_loss, "match_loss")
        return None if value == "none" else value

    @property
    def arch_list(self) -> tuple[str, ...]:
        """The built-in models to train (none with a saved model)."""
        if self.model_given:
            return ()
        return tuple(a.strip().lower() for a in self.models) if self.models is not None else ARCHS

    def resolved(self) -> LandscapeRequest:
        """This request with every field left None filled from its preset (explicit beats preset).

        The data set and split, ``n_train``; for built-in models also ``width``, ``steps``,
        ``seeds``, ``lr`` (Adam: :data:`attnaudit.core.fit.DEFAULT_ADAM_LR`) and ``match_loss``
        (the preset's with full-batch GD, ``none`` with sgd/adam); a saved model is one seed."""
        p = self.preset_values()
        fill = self.preset_fill("n_train", *(() if self.model_given else ("width", "steps", "seeds")))
        if self.model_given:
            if self.seeds is None:
                fill["seeds"] = 1
        else:
            if self.lr is None:
                fill["lr"] = DEFAULT_ADAM_LR if self.optimizer_name == "adam" else p["lr"]
            if self.match_loss is None:
                chosen = p.get("match_loss") if self.optimizer_name == "gd" else None
                fill["match_loss"] = "none" if chosen is None else chosen
        return dataclasses.replace(self, **fill) if fill else self

    # ---- validation (before anything is read)
    def validate(self) -> None:
        self.check_preset()
        p = self.preset_values()
        field_check("seed", check_seed, self.seed)
        saved = self.model_given
        if saved and self.models is not None:
            raise FieldError(
                "models", "--checkpoint (--model) analyses saved models and {name} trains new ones; give one of them"
            )
        if saved:
            self.refuse_training()
            if self.seeds is not None and self.seeds != 1:
                raise FieldError(
                    "seeds",
                    "{name} trains independent copies of the built-in models; a saved model is one model, drop {name}",
                )
            if self.resample_data:
                raise FieldError(
                    "resample_data",
                    "{name} draws new training rows per seed, which a saved model was not trained on; drop it",
                )
        if self.loaded_data is not None and self.resample_data:
            raise FieldError(
                "resample_data",
                "{name} draws each seed's rows from a data recipe; a request holding "
                "loaded data has none (give the data as dataset or data, or drop it)",
            )
        check_seeds(
            self.seed, 1 if saved else (self.seeds if self.seeds is not None else p["seeds"]), rule="a positive integer"
        )
        if self.optimizer_name not in OPTIMIZER_NAMES:
            raise FieldError("optimizer", "unknown {name} " + literal(repr(self.optimizer)) + "; use gd, sgd or adam")
        if self.match_target is not None and self.optimizer_name != "gd":
            raise FieldError(
                "match_loss",
                "{name} stops full-batch GD at a training loss; with --optimizer sgd/adam "
                "train for --steps and compare (models are compared when their losses are within 10 %)",
            )
        if self.models is not None:
            archs = tuple(str(a).strip().lower() for a in self.models)
            if not archs:
                raise FieldError("models", "{name} is empty; use relu, attn or both (relu,attn)")
            bad = [a for a in archs if a not in ARCHS]
            if bad:
                raise FieldError(
                    "models", "{name}: unknown model " + literal(repr(bad[0])) + "; use relu, attn or both (relu,attn)"
                )
            if len(set(archs)) != len(archs):
                raise FieldError("models", "{name} lists a model twice; give each once")
        if self.n_train is not None and self.n_train < 2:
            raise FieldError("n_train", "{name} must be >= 2, got " + str(self.n_train))
        if self.width is not None and self.width < 1:
            raise FieldError("width", "{name} must be a positive integer, got " + str(self.width))
        if self.steps is not None and self.steps < 0:
            raise FieldError("steps", "{name} must be >= 0, got " + str(self.steps))
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise FieldError("lr", "{name} must be a positive number, got " + f"{self.lr:g}")
        if self.batch_size is not None:
            if self.optimizer_name == "gd":
                raise FieldError(
                    "batch_size", "{name} applies to --optimizer sgd or adam (gd uses every row at every step); drop it"
                )
            if self.batch_size < 1:
                raise FieldError("batch_size", "{name} must be a positive integer, got " + str(self.batch_size))
        if self.loss is not None and self.loss.strip().lower() not in LOSSES:
            raise FieldError(
                "loss",
                "unknown {name} " + literal(repr(self.loss.strip().lower())) + f"; use one of {', '.join(LOSSES)}",
            )
        for name, kinds in (("directions", DIRECTION_KINDS), ("precision", tuple(DTYPES))):
            value = str(getattr(self, name)).strip().lower()
            if value not in kinds:
                raise FieldError(name, "unknown {name} " + literal(repr(value)) + f"; use one of {', '.join(kinds)}")
        for name in ("points", "grid"):
            value = getattr(self, name)
            if value != 0 and value < 3:
                raise FieldError(name, "{name} must be 0 (skip) or >= 3, got " + str(value))
        if not (self.span > 0 and math.isfinite(self.span)):
            raise FieldError("span", "{name} must be a positive number, got " + str(self.span))
        if self.eigenvalues < 1:
            raise FieldError("eigenvalues", "{name} must be >= 1, got " + str(self.eigenvalues))
        if self.hutchinson_samples < 2:
            raise FieldError(
                "hutchinson_samples",
                "{name} must be >= 2 (a standard error needs two), got " + str(self.hutchinson_samples),
            )
        if self.basin_directions < 1:
            raise FieldError("basin_directions", "{name} must be >= 1, got " + str(self.basin_directions))
        if not (self.basin_factor > 1 and math.isfinite(self.basin_factor)):
            raise FieldError("basin_factor", "{name} must be > 1, got " + str(self.basin_factor))
        if self.params is not None and not any(str(v).strip() for v in self.params):
            raise FieldError("params", "{name} is empty; use all, head, a module name or glob patterns")


def _on_device(task, device):
    """The task with a copy of its module on ``device`` when it is elsewhere (the user's module is never moved)."""
    import copy

    ref = next((t for t in (*task.module.parameters(), *task.module.buffers())), None)
    if ref is None or ref.device == torch.device(device):
        return task
    return dataclasses.replace(task, module=copy.deepcopy(task.module).to(device))


def _load_rows(request: LandscapeRequest, r: LandscapeRequest, saved_models: dict, seed: int | None = None):
    """The audited rows: the saved models' own training split when their side-cars prove it,
    else ``n_train`` stratified rows drawn with ``seed`` (default the base seed; with
    ``--resample-data`` each model seed's); and the note on where the rows came from (or None)."""
    assert r.n_train is not None  # r is resolved(): the preset fills n_train
    seed = r.seed if seed is None else seed

    if saved_models:
        if request.loaded_data is not None:
            full = request.loaded_data
        else:
            full = load_dataset(
                dataclasses.replace(r.data_spec(seed, n=r.n_train, stratify=True), n=None, stratify=False)
            )
        rebuilt = recorded_split(full, saved_models)
        if rebuilt is not None:
            ds = subset(rebuilt[0], min(r.n_train, rebuilt[0].n), seed)
            note = {
                "rows": "checkpoint split",
                "detail": f"{ds.n} of the checkpoint's {rebuilt[0].n} training rows "
                "(its split rebuilt; training-data fingerprint matched)",
                "recorded_split": rebuilt[2],
            }
            return ds, note
    if request.loaded_data is not None:  # a stratified draw, recorded in the data set's info, as from a file
        full = request.loaded_data
        if r.n_train > full.n:
            raise FieldError(
                "n_train", "{name} " + f"{r.n_train} is more than the {full.n} rows of the loaded data set"
            )
        return subset(full, r.n_train, seed, stratify=True), None
    try:
        return r.load_data(seed, n=r.n_train, stratify=True), None
    except AuditError as exc:
        if "--n " in str(exc):
            raise FieldError(
                "n_train", literal(str(exc)).replace("--n ", "{name} ").replace("lower --n", "lower {name}")
            ) from None
        raise


def _rows_record(seed: int, ds) -> dict:
    """Which rows model seed ``seed`` trained and was analysed on: the seed they were drawn with,
    their index checksum and a checksum of their contents."""
    drawn = ds.info.get("holdout") or ds.info
    return {
        "seed": seed,
        "subset_seed": drawn.get("seed"),
        "indices_sha256": drawn.get("indices_sha256"),
        "train_data_sha256": data_fingerprint(ds.X, ds.y),
    }


def run(request: LandscapeRequest, *, progress: RunProgress | None = None, executor=None) -> Result:
    """Run ``request``; the report is the one ``attnaudit landscape --json`` writes.

    ``executor`` is accepted for the common signature; the models run in this process."""
    from rich.text import Text

    progress = progress_or_silent(progress)
    r = request.resolved()
    model = request.model_sources() if request.model_given else None
    assert r.seeds is not None  # resolved() fills it
    n_seeds = int(r.seeds)
    opt_name = r.optimizer_name
    match_target = r.match_target
    match_auto = match_target == "auto"
    arch_list = r.arch_list
    saved_models = request.load_models() if model else {}  # fails now, before data are read: unreadable checkpoints
    loss = request.loss
    if loss is None:
        recorded = {lm.loss for lm in saved_models.values() if lm.loss}
        loss = recorded.pop() if len(recorded) == 1 else "mse"
    loss_name = loss.strip().lower()
    train_cfg: TrainConfig | None = None  # set exactly when built-in models are trained (no saved model)
    recipe: Recipe | None = None
    width = 256  # run_landscape's default: only the built-in models use it
    if not model:
        assert r.lr is not None and r.steps is not None and r.width is not None  # resolved() fills them
        width = r.width
        loss_tol = None if match_auto else match_target
        assert not isinstance(loss_tol, str)  # a number or None: "auto" is handled, "none" became None
        train_cfg = TrainConfig(loss=loss_name, lr=r.lr, steps=r.steps, loss_tol=loss_tol, record_every=10)
        if opt_name != "gd":
            recipe = Recipe(
                optimizer=opt_name, lr=r.lr, batch_size=r.batch_size, steps=train_cfg.steps, loss=loss_name, seed=r.seed
            )
    config = LandscapeConfig(
        loss=loss_name,
        directions=r.directions.strip().lower(),
        points=r.points,
        span=r.span,
        grid=r.grid,
        keep_1d_params=r.keep_1d_params,
        params=r.params,
        top_k=r.eigenvalues,
        hutchinson_samples=r.hutchinson_samples,
        basin_directions=r.basin_directions,
        basin_factor=r.basin_factor,
        seed=r.seed,
        dtype=r.precision.strip().lower(),
    )
    dev = resolve_device(r.device)
    labels = list(saved_models) if model else list(arch_list)
    saved_tasks = None
    try:
        for lm in saved_models.values():  # a --params typo fails before the data are read
            check_selector(lm.module, config.params)
        t0 = time.perf_counter()
        ds, rows_note = _load_rows(request, r, saved_models)
        if ds.y is None:
            raise AuditError(f"{ds.name} has no labels; the loss landscape needs labelled data")
        seed_list = (r.seed,) if model else tuple(range(r.seed, r.seed + n_seeds))
        # every model seed's rows: the base seed's, or (--resample-data) the rows a run with --seed s draws
        seed_rows = {
            s: ds if s == r.seed or not r.resample_data else _load_rows(request, r, {}, s)[0] for s in seed_list
        }
        if saved_models:
            fitted = {label: fit_to_data(lm, ds) for label, lm in saved_models.items()}
            saved_tasks = {label: _on_device(lm.task(loss=loss_name), dev) for label, lm in fitted.items()}
        load_time = time.perf_counter() - t0
        what = (
            f"saved model(s) {', '.join(labels)}"
            if train_cfg is None
            else f"models {','.join(labels)}, width {r.width}, {opt_name} {train_cfg.steps} steps, lr {train_cfg.lr:g}"
            + (f", batch {r.batch_size}" if r.batch_size else "")
            + (f", {n_seeds} seeds" if n_seeds > 1 else "")
            + (", rows resampled per seed" if r.resample_data else "")
        )
        header = f"landscape: {ds.name} ({r.split}), n={ds.n}, {what}"
        steps_per_model = (
            0 if train_cfg is None else (recipe.total_steps(ds.n) if recipe is not None else train_cfg.steps)
        )
        total = run_work_units(config, len(labels) * n_seeds, steps_per_model)
        trainer = {"gd": "GD", "sgd": "SGD", "adam": "Adam"}[opt_name]
        unit = "Hessian/loss evaluations" if model else f"{trainer} steps and Hessian/loss evaluations"
        on_dev = {s: dataclasses.replace(d, X=d.X.to(dev), y=d.y.to(dev)) for s, d in seed_rows.items()}
        with progress("landscape", total, unit) as advance:
            out_run = run_landscape(
                on_dev[r.seed],
                config,
                models=None if model else arch_list,
                width=width,
                train_config=train_cfg,
                seed=r.seed,
                saved=saved_tasks,
                seeds=None if model else tuple(range(r.seed, r.seed + n_seeds)),
                recipe=recipe,
                match_loss_auto=match_auto,
                seed_data=on_dev if r.resample_data else None,
                saved_info={
                    label: {
                        "source": lm.source.get("path") or lm.source.get("factory"),
                        "checkpoint": lm.source,
                        **({"audit_rows": rows_note} if rows_note else {}),
                    }
                    for label, lm in saved_models.items()
                },
                progress=advance,
            )
    except ParameterSelectionError as exc:
        raise FieldError("params", "{name}: " + literal(exc)) from None
    timings = {"load": load_time, **out_run.timings, "total": time.perf_counter() - t0}

    out = out_run.to_dict()
    data_in = request.preset_data_inputs(r.dataset, r.split)
    report = build_report(
        SCHEMA,
        inputs={
            "preset": request.preset_key,
            **data_in,
            "n_train": r.n_train,
            "models": list(labels),
            "saved_models": model,
            "width": None if model else r.width,
            "training": None if train_cfg is None else dataclasses.asdict(train_cfg),
            "optimizer": None
            if train_cfg is None
            else (
                recipe.to_dict()
                if recipe is not None
                else {
                    "optimizer": "gd",
                    "lr": train_cfg.lr,
                    "batch_size": None,
                    "steps": train_cfg.steps,
                    "loss": loss_name,
                }
            ),
            "seeds": None if model else n_seeds,
            "resample_data": r.resample_data,
            "match_loss": match_target,
            "match_loss_resolution": out_run.match_loss_resolution,
            "loss_comparable_within": LOSS_COMPARABLE_WITHIN,
            "landscape": dataclasses.asdict(config),
        },
        seeds={
            "base_seed": r.seed,
            "model_seed": None if model else r.seed,
            "subset_seed": "per model seed" if r.resample_data else r.seed,
            "subset_seeds": [s if r.resample_data else r.seed for s in seed_list],
            "data": "--resample-data: model seed s trains and is analysed on its own rows, the subset a run with "
            "--seed s draws"
            if r.resample_data
            else "one subset of training rows drawn with the base seed, shared by every model seed",
            "landscape": config.seeds(),
            "model_seeds": None if model else list(range(r.seed, r.seed + n_seeds)),
        },
        device=dev,
        dtype=config.dtype,
        timings=timings,
        results={
            "dataset": ds.info,
            "rows_by_seed": [_rows_record(s, seed_rows[s if r.resample_data else r.seed]) for s in seed_list],
            "models": out["models"],
            "gd_stability_bound": out["gd_stability_bound"],
            "optimizer": out["optimizer"],
        },
        warnings=list(out_run.warnings),
        verdicts=list(out_run.verdicts),
        request=request,
    )
    renderables: list = [Text(header)]
    renderables.extend(build_tables(out_run.results, out_run.training if not model else {}, out_run.lr, run=out_run))
    renderables.extend(Text(f"- {v}") for v in out_run.verdicts)
    renderables.extend(Text(f"warning: {w}", style="yellow") for w in out_run.warnings)
    title = f"{ds.name}: n={ds.n}, {loss_name}, directions {config.directions}, seed {r.seed}"
    return Result(
        report,
        request,
        renderables=renderables,
        plot=lambda path: plot_landscape(out_run.results, path, title),
        png_name=PNG_NAME,
    )
