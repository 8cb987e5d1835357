"""`landscape` as a request and a run: train (or take saved) models, analyse each, compare.

:class:`LandscapeRequest` is what ``attnaudit landscape`` asks (its fields are the command's
options; :data:`PRESETS` fill the ones left unset). :meth:`LandscapeRequest.resolve` gives the
one :class:`LandscapeSetup` the run uses (the analysis' :class:`~.analysis.LandscapeConfig`,
the training settings, the saved models, the seeds and the device, each made once) and
:func:`run` answers it with a :class:`~attnaudit.analyses.result.Result` through
:func:`~.pipeline.run_landscape`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from attnaudit.analyses.landscape.analysis import LandscapeConfig
from attnaudit.analyses.landscape.pipeline import LandscapeRun, run_landscape, run_work_units
from attnaudit.analyses.landscape.reference import ARCHS, optimizer_record
from attnaudit.analyses.landscape.report import PNG_NAME, SCHEMA, build_tables, plot_landscape
from attnaudit.analyses.landscape.setup import (
    LOSS_DESCRIPTIONS,
    ParameterSelectionError,
    check_selector,
    loss_named,
)
from attnaudit.analyses.request import (
    ANALYSIS,
    EXECUTION,
    PROTOCOL,
    BuiltinNets,
    DeviceField,
    FieldError,
    HiddenWidth,
    LearningRate,
    PrecisionField,
    Request,
    SeedField,
    TrainRows,
    check_seeds,
    field_check,
    list_of,
    literal,
    option,
    redefault,
)
from attnaudit.analyses.result import Progress as RunProgress
from attnaudit.analyses.result import Result, progress_or_silent
from attnaudit.analyses.sources import ModelFields, PresetData
from attnaudit.core.fit import DEFAULT_ADAM_LR, Recipe
from attnaudit.core.precision import Precision, not_needed, resolve_precision
from attnaudit.core.task import NextTokenLoss
from attnaudit.core.training import TrainConfig
from attnaudit.data import data_fingerprint, load_dataset, subset
from attnaudit.errors import AuditError, check_seed
from attnaudit.models.checkpoints import LoadedModel, fit_to_data, recorded_split
from attnaudit.report.envelope import build_report
from attnaudit.runtime.device import resolve_device
from attnaudit.models.vit import n_parameters

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


#: what ``precision`` sets in a landscape run (the built-in models' training stays in its own dtype)
LANDSCAPE_HEAVY = ("Hessian-vector products (Lanczos, Hutchinson)", "loss surfaces and basin evaluations")


@dataclass(frozen=True)
class LandscapeRequest(
    ModelFields,
    PresetData,
    SeedField,
    DeviceField,
    PrecisionField,
    BuiltinNets,
    TrainRows,
    HiddenWidth,
    LearningRate,
    Request,
):
    """What ``attnaudit landscape`` computes; every field is one option.

    Train the built-in 2L-ReLU / MLP-Attn (``models``) or take saved ones (``checkpoint``,
    ``factory``, ``loaded_models``), then measure each loss landscape: top Hessian eigenvalues,
    trace, basin width and 1-D/2-D surfaces. The fields left None are filled by the preset
    (:meth:`resolved`); an explicit value beats the preset. :meth:`resolve` gives the
    :class:`LandscapeSetup` the run uses.
    """

    COMMAND = "landscape"
    PRESETS: ClassVar[dict[str, dict]] = PRESETS

    # the preset chooses the data set and split when none is given (PresetData)
    preset: str = redefault(
        BuiltinNets,
        "preset",
        help="quick (default; digits, < 2 min on 2 CPU cores) or paper (MNIST train split, n_train 2000, ~5 min). "
        "Explicit options override it.",
    )
    models: tuple[str, ...] | None = redefault(
        BuiltinNets,
        "models",
        help="Models to train and compare: relu (2L-ReLU), attn (MLP-Attn), comma-separated (default relu,attn).",
    )
    n_train: int | None = redefault(
        TrainRows,
        "n_train",
        help="Training samples: the loss, Hessian and surfaces are over these (default from --preset).",
    )
    width: int | None = redefault(HiddenWidth, "width", help="Hidden width m (default from --preset).")
    steps: int | None = redefault(BuiltinNets, "steps", help="Full-batch GD steps (the budget under --match-loss).")
    lr: float | None = redefault(LearningRate, "lr", help="GD learning rate (default from --preset).")
    loss: str | None = redefault(
        BuiltinNets,
        "loss",
        help="mse or ce: the training loss whose landscape is measured (default mse; a checkpoint's recorded training "
        "loss; a causal language model's is its next-token cross-entropy, next-token).",
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
    seeds: int | None = redefault(
        BuiltinNets,
        "seeds",
        help="Independent initialisations, trainings and analyses per built-in model (seeds seed, seed+1, ...; default "
        "3 for --preset quick, 1 for paper); the JSON gains per-seed values with mean/sd, and the comparison uses "
        "the mean with its Student-t tolerance (fewer than 3 seeds never resolve it); with --resample-data each seed "
        "also draws its own training rows.",
    )
    resample_data: bool = redefault(
        BuiltinNets,
        "resample_data",
        help="Each seed draws its own training rows (the rows a run with that --seed uses), so intervals include "
        "the choice of training rows. Built-in models only.",
    )
    optimizer: str | None = redefault(
        BuiltinNets,
        "optimizer",
        help="How the built-in models are trained: gd (full-batch gradient descent, default), sgd or adam "
        "(attnaudit.core.fit).",
    )
    batch_size: int | None = redefault(
        BuiltinNets, "batch_size", help="Rows per step of --optimizer sgd/adam (default: full batch)."
    )
    eigenvalues: int = option(
        5,
        "--eigenvalues",
        panel=ANALYSIS,
        help="Number of top Hessian eigenvalues (Lanczos).",
    )
    hutchinson_samples: int = option(
        30, "--hutchinson-samples", panel=ANALYSIS, help="Rademacher probes for the Hessian trace."
    )
    lanczos_steps: int = option(
        100,
        "--lanczos-steps",
        panel=ANALYSIS,
        help="Most Hessian-vector products the Lanczos run of --eigenvalues may take.",
    )
    lanczos_tol: float = option(
        1e-4,
        "--lanczos-tol",
        panel=ANALYSIS,
        help="Lanczos stops when every wanted Ritz pair's residual bound is within this fraction of the largest.",
    )
    memory_budget: float = option(
        512.0,
        "--memory-budget",
        panel=EXECUTION,
        help="MiB per chunk of Hessian-vector products and per batch of surface points; the Lanczos basis may "
        "take 4 x this (a smaller basis than the products need restarts: more products, the same accuracy).",
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
    seed: int = redefault(
        SeedField,
        "seed",
        help="Base random seed; also fixes the training rows (each seed draws its own with --resample-data).",
    )

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
                "models", "{name} trains new models and a checkpoint or factory gives saved ones; give one of them"
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
        if self.eigenvalues < 1:
            raise FieldError("eigenvalues", "{name} must be >= 1, got " + str(self.eigenvalues))
        if not (math.isfinite(self.memory_budget) and self.memory_budget > 0):
            raise FieldError(
                "memory_budget", "{name} must be a positive number of MiB, got " + f"{self.memory_budget:g}"
            )
        self.check_precision_field()
        config = self.landscape_config(self.loss)  # the analysis' own fields are checked by its configuration
        if not saved and config.loss == NextTokenLoss.name:
            raise FieldError(
                "loss",
                "{name} next-token is a causal language model's loss; the built-in models are classifiers: "
                "use mse or ce",
            )

    # ---- the configuration the run uses
    def landscape_config(self, loss: str | None, dtype: str = "float64") -> LandscapeConfig:
        """The analysis of every model, measuring the training loss ``loss`` (None: the task's own)
        with its heavy computations in ``dtype`` (the resolved precision)."""
        return LandscapeConfig(
            loss=None if loss is None else loss.strip().lower(),
            directions=self.directions.strip().lower(),
            points=self.points,
            span=self.span,
            grid=self.grid,
            keep_1d_params=self.keep_1d_params,
            params=self.params,
            top_k=self.eigenvalues,
            hutchinson_samples=self.hutchinson_samples,
            lanczos_steps=self.lanczos_steps,
            lanczos_tol=self.lanczos_tol,
            memory_mb=self.memory_budget,
            basin_directions=self.basin_directions,
            basin_factor=self.basin_factor,
            seed=self.seed,
            dtype=dtype,
        )

    def resolve(self) -> LandscapeSetup:
        """The one configuration of the run: the preset filled, the saved models loaded (before any
        data are read: an unreadable checkpoint or a ``params`` typo fails now), the loss chosen
        (given, else the saved models' recorded training loss, else mse), the analysis and the
        training of the built-in models configured, the model seeds listed and the device resolved."""
        r = self.resolved()
        saved = r.load_models() if r.model_given else {}
        loss = _measured_loss(r.loss, saved)
        device = resolve_device(r.device)
        # the largest saved model decides auto (None: the built-in models)
        n_params = max((n_parameters(lm.module) for lm in saved.values()), default=None)
        precision = resolve_precision(r.precision, n_params, device, LANDSCAPE_HEAVY)
        config = r.landscape_config(loss, precision.used)
        train, recipe = r.training(config.loss or "mse")
        try:
            for lm in saved.values():  # a params typo fails before the data are read
                check_selector(lm.module, config.params)
        except ParameterSelectionError as exc:
            raise FieldError("params", "{name}: " + literal(exc)) from None
        assert r.seeds is not None  # resolved() fills it
        seeds = (r.seed,) if r.model_given else tuple(range(r.seed, r.seed + r.seeds))
        return LandscapeSetup(r, config, saved, train, recipe, seeds, device, precision)

    def training(self, loss: str) -> tuple[TrainConfig | None, Recipe | None]:
        """How this (preset-filled) request trains the built-in models on ``loss``: full-batch GD
        (its ``loss_tol`` the match-loss target, None under ``auto`` until the budget runs) and,
        for sgd/adam, the :class:`~attnaudit.core.fit.Recipe`; (None, None) for saved models."""
        if self.model_given:
            return None, None
        assert self.lr is not None and self.steps is not None  # resolved() fills them
        target = self.match_target
        loss_tol = None if target == "auto" else target
        assert not isinstance(loss_tol, str)  # a number or None: "auto" is handled, "none" became None
        train = TrainConfig(loss=loss, lr=self.lr, steps=self.steps, loss_tol=loss_tol, record_every=10)
        if self.optimizer_name == "gd":
            return train, None
        recipe = Recipe(
            optimizer=self.optimizer_name,
            lr=self.lr,
            batch_size=self.batch_size,
            steps=train.steps,
            loss=loss,
            seed=self.seed,
        )
        return train, recipe


@dataclass(frozen=True)
class LandscapeSetup:
    """One ``attnaudit landscape`` run, resolved once from its request (:meth:`LandscapeRequest.resolve`).

    ``request``: the request with its preset filled (data set, split, ``n_train``, ``width``,
    ``seeds``, ...); ``config``: the analysis of every model; ``saved``: the saved models,
    loaded (label -> model; empty when the built-in ones are trained); ``train``: full-batch GD
    of the built-in models (None for saved ones); ``recipe``: sgd/adam instead of GD (None
    otherwise); ``seeds``: the model seeds; ``device``: where the models and rows go.
    """

    request: LandscapeRequest
    config: LandscapeConfig
    saved: dict[str, LoadedModel] = field(default_factory=dict)
    train: TrainConfig | None = None
    recipe: Recipe | None = None
    seeds: tuple[int, ...] = (0,)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: Precision = field(default_factory=lambda: Precision("float64", "float64", "asked", LANDSCAPE_HEAVY))

    @property
    def labels(self) -> list[str]:
        """The models compared: the saved models' labels, else the built-in architectures."""
        return list(self.saved) if self.request.model_given else list(self.request.arch_list)


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
    except FieldError as exc:
        if exc.field == "n":  # the data's row count is this request's n_train
            raise FieldError("n_train", exc.template) from None
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
    progress = progress_or_silent(progress)
    setup = request.resolve()
    r, config, dev = setup.request, setup.config, setup.device
    model = request.model_sources() if request.model_given else None
    saved_models = setup.saved
    t0 = time.perf_counter()
    ds, rows_note = _load_rows(request, r, saved_models)
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; the loss landscape needs labelled data")
    # every model seed's rows: the base seed's, or (resample_data) the rows a run with seed s draws
    seed_rows = {s: ds if s == r.seed or not r.resample_data else _load_rows(request, r, {}, s)[0] for s in setup.seeds}
    saved_tasks = None
    if saved_models:
        fitted = {label: fit_to_data(lm, ds) for label, lm in saved_models.items()}
        measured = None if config.loss is None else loss_named(config.loss)
        saved_tasks = {label: _on_device(lm.task(loss=measured), dev) for label, lm in fitted.items()}
    load_time = time.perf_counter() - t0
    n_runs = len(setup.labels) * len(setup.seeds)
    train_steps = 0 if setup.train is None else setup.train.steps
    if setup.recipe is not None:
        train_steps = setup.recipe.total_steps(ds.n)
    unit = "Hessian/loss evaluations" if model else f"{_TRAINERS[r.optimizer_name]} steps and Hessian/loss evaluations"
    on_dev = {s: dataclasses.replace(d, X=d.X.to(dev), y=d.y.to(dev)) for s, d in seed_rows.items()}
    try:
        with progress("landscape", run_work_units(config, n_runs, train_steps), unit) as advance:
            out_run = run_landscape(
                on_dev[r.seed],
                config,
                models=None if model else r.arch_list,
                width=r.width if r.width is not None else 256,  # None for saved models: unused
                train_config=setup.train,
                seed=r.seed,
                saved=saved_tasks,
                seeds=None if model else setup.seeds,
                recipe=setup.recipe,
                match_loss_auto=r.match_target == "auto",
                seed_data=on_dev if r.resample_data else None,
                saved_info={label: _saved_info(lm, rows_note) for label, lm in saved_models.items()},
                progress=advance,
            )
    except ParameterSelectionError as exc:
        raise FieldError("params", "{name}: " + literal(exc)) from None
    timings = {"load": load_time, **out_run.timings, "total": time.perf_counter() - t0}
    report = _report(request, setup, ds, seed_rows, out_run, timings)
    return Result(
        report,
        request,
        renderables=_renderables(setup, ds, out_run),
        plot=lambda path: plot_landscape(
            out_run.results, path, f"{ds.name}: n={ds.n}, {config.loss}, directions {config.directions}, seed {r.seed}"
        ),
        png_name=PNG_NAME,
    )


_TRAINERS = {"gd": "GD", "sgd": "SGD", "adam": "Adam"}


def _measured_loss(given: str | None, saved: dict[str, LoadedModel]) -> str:
    """The name of the training loss measured: ``given``, else the saved models' recorded one (a
    causal language model records its next-token loss), else mse. A language model is measured
    on its own next-token loss only, and that loss on language models only."""
    recorded = {label: loss_named(lm.loss).name for label, lm in saved.items() if lm.loss}
    if given is None:
        names = set(recorded.values())
        return names.pop() if len(names) == 1 else "mse"
    name = str(given).strip().lower()
    for label in saved:
        own = recorded.get(label)
        if own == NextTokenLoss.name and name != own:
            raise FieldError(
                "loss",
                "{name} "
                + literal(name)
                + " scores a classifier's logits, but model "
                + literal(label)
                + " is a causal language model measured on its next-token cross-entropy; drop {name}",
            )
        if own != NextTokenLoss.name and name == NextTokenLoss.name:
            raise FieldError(
                "loss",
                "{name} next-token is a causal language model's loss, but model "
                + literal(label)
                + " is not one; use mse or ce",
            )
    return name


def _saved_info(lm: LoadedModel, rows_note: dict | None) -> dict:
    """What the report records of a saved model: its source, and where its audited rows came from."""
    return {
        "source": lm.source.get("path") or lm.source.get("factory"),
        "checkpoint": lm.source,
        **({"audit_rows": rows_note} if rows_note else {}),
    }


def _report(
    request: LandscapeRequest, setup: LandscapeSetup, ds, seed_rows: dict, out_run: LandscapeRun, timings: dict
):
    """The JSON report of a landscape run."""
    r, config = setup.request, setup.config
    saved = request.model_given
    model_seeds = None if saved else list(setup.seeds)
    out = out_run.to_dict()
    train = setup.train
    checks = {label: res.precision_check for label, res in out_run.results.items() if res.precision_check}
    precision_warnings = [f"{label}: {c['warning']}" for label, c in checks.items() if c.get("warning")]
    return build_report(
        SCHEMA,
        inputs={
            "preset": request.preset_key,
            **request.preset_data_inputs(r.dataset, r.split),
            "n_train": r.n_train,
            "models": setup.labels,
            "saved_models": request.model_sources() if saved else None,
            "width": None if saved else r.width,
            "training": None if train is None else dataclasses.asdict(train),
            "optimizer": optimizer_record(train, setup.recipe),
            "seeds": None if saved else r.seeds,
            "resample_data": r.resample_data,
            "match_loss": r.match_target,
            "match_loss_resolution": out_run.match_loss_resolution,
            "loss_comparable_within": LOSS_COMPARABLE_WITHIN,
            "landscape": dataclasses.asdict(config),
        },
        seeds={
            "base_seed": r.seed,
            "model_seed": None if saved else r.seed,
            "subset_seed": "per model seed" if r.resample_data else r.seed,
            "subset_seeds": [s if r.resample_data else r.seed for s in setup.seeds],
            "data": "--resample-data: model seed s trains and is analysed on its own rows, the subset a run with "
            "--seed s draws"
            if r.resample_data
            else "one subset of training rows drawn with the base seed, shared by every model seed",
            "landscape": config.seeds(),
            "model_seeds": model_seeds,
        },
        device=setup.device,
        dtype=config.dtype,
        timings=timings,
        results={
            "dataset": ds.info,
            "rows_by_seed": [_rows_record(s, seed_rows[s if r.resample_data else r.seed]) for s in setup.seeds],
            "models": out["models"],
            "gd_stability_bound": out["gd_stability_bound"],
            "optimizer": out["optimizer"],
            "precision": setup.precision.to_dict(),
            "precision_check": checks or not_needed(setup.precision),
            "loss": _loss_words(config.loss),
        },
        warnings=list(out_run.warnings) + precision_warnings,
        verdicts=list(out_run.verdicts),
        request=request,
    )


def _loss_words(name: str | None) -> str:
    """The measured loss in words (``next-token cross-entropy`` for a language model)."""
    key = loss_named(name or "mse").name
    return LOSS_DESCRIPTIONS.get(key, key)


def _renderables(setup: LandscapeSetup, ds, out_run: LandscapeRun) -> list:
    """The header line, tables, verdicts and warnings printed for a landscape run."""
    from rich.text import Text

    r, train = setup.request, setup.train
    n_seeds = len(setup.seeds)
    what = (
        f"saved model(s) {', '.join(setup.labels)}"
        if train is None
        else f"models {','.join(setup.labels)}, width {r.width}, {r.optimizer_name} {train.steps} steps, lr {train.lr:g}"
        + (f", batch {r.batch_size}" if r.batch_size else "")
        + (f", {n_seeds} seeds" if n_seeds > 1 else "")
        + (", rows resampled per seed" if r.resample_data else "")
    )
    renderables: list = [
        Text(f"landscape: {ds.name} ({r.split}), n={ds.n}, {what}; loss: {_loss_words(setup.config.loss)}")
    ]
    renderables.extend(
        build_tables(out_run.results, out_run.training if train is not None else {}, out_run.lr, run=out_run)
    )
    notes = sorted({r.accuracy_note for r in out_run.results.values() if r.accuracy_note})
    renderables.extend(Text(f"training accuracy n/a: {note}") for note in notes)
    renderables.extend(Text(f"- {v}") for v in out_run.verdicts)
    renderables.extend(Text(f"warning: {w}", style="yellow") for w in out_run.warnings)
    return renderables
