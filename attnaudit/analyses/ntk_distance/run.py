"""`ntk-distance` as a request and a run: how far finite networks are from their kernel regime.

Three modes, chosen by the request:

* the 2-layer width sweep (default): finite 2L-ReLU / MLP-Attn networks against their NTK
  predictor across ``widths`` (:mod:`attnaudit.analyses.ntk_distance.widths`); ``preset``
  quick or paper sets the sizes, explicit fields beat it; ``resample_data``: each seed trains
  and is measured on its own rows (those a run with that base seed uses), not the base seed's;
* ``checkpoint`` (or ``factory`` / ``loaded_models``): how far training moved a trained model's
  kernel from its initialization (:mod:`attnaudit.analyses.ntk_distance.checkpoint`);
* ``arch`` vit,vit-linear: the width sweep of the built-in transformers
  (:mod:`attnaudit.analyses.ntk_distance.transformers`), trained with the ViT defaults of
  ``attnaudit train`` unless the recipe fields are given.

Fields that do not apply to the chosen mode are refused by name. :meth:`NtkDistanceRequest.resolve`
builds the mode's configuration once (:class:`~attnaudit.analyses.ntk_distance.config.NtkDistanceSettings`);
:func:`run` runs from it. The sweeps run their cells on ``executor``
(:class:`attnaudit.runtime.sweep.ExecutorConfig`; default: in this process); cells that fail
are listed in ``Result.failed_cells`` and the report holds the others.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

from attnaudit.analyses.ntk_distance.checkpoint import audit_loaded, refuse_without_initialization
from attnaudit.analyses.ntk_distance.config import (
    CHECKPOINT_DEFAULTS,
    DEFAULT_PRESET,
    PRESETS,
    SCHEMA,
    SCHEMA_CHECKPOINT,
    SCHEMA_TRANSFORMERS,
    SETTINGS_BY_MODE,
    SWEEP_DEFAULTS,
    TRANSFORMER_DEFAULTS,
    CheckpointKernelConfig,
    NTKDistanceConfig,
    NtkDistanceSettings,
    TransformerSweepConfig,
)
from attnaudit.analyses.ntk_distance.planning import is_remote
from attnaudit.analyses.ntk_distance.report import (
    PNG_CHECKPOINT,
    PNG_NAME,
    PNG_TRANSFORMERS,
    build_checkpoint_tables,
    build_sweep_tables,
    build_tables,
    plot_checkpoints,
    plot_ntk_distance,
    plot_sweep,
)
from attnaudit.analyses.ntk_distance.transformers import run_transformer_sweep
from attnaudit.analyses.ntk_distance.widths import model_saver, prepare_save_folder, run_ntk_distance
from attnaudit.analyses.request import (
    ANALYSIS,
    EXECUTION,
    MODEL,
    OUTPUT,
    PROTOCOL,
    BuiltinNets,
    DeviceField,
    Epochs,
    FieldError,
    LearningRate,
    LrFraction,
    PrecisionField,
    Request,
    SeedField,
    SplitRows,
    TrainingDtype,
    list_of,
    literal,
    option,
    redefault,
    unknown_preset,
    unset,
)
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DataFields, ModelFields
from attnaudit.core.precision import closed_forms
from attnaudit.data import HoldoutRecipe, data_fingerprint, holdout_split
from attnaudit.errors import AuditError
from attnaudit.models.builtin import image_shape_of
from attnaudit.models.checkpoints import fit_to_data, load_model_source
from attnaudit.report.envelope import build_report
from attnaudit.runtime.device import resolve_device
from attnaudit.runtime.sweep import ExecutorConfig

# fields each mode refuses (they belong to another mode)
CHECKPOINT_REFUSES = (
    "preset",
    "models",
    "widths",
    "seeds",
    "n_train",
    "steps",
    "lr",
    "lr_fraction",
    "loss",
    "parametrization",
    "init",
    "attn_scaling",
    "predictor",
    "dtype",
    "save_models",
    "optimizer",
    "batch_size",
    "epochs",
)
TRANSFORMER_REFUSES = (
    "preset",
    "models",
    "lr_fraction",
    "parametrization",
    "init",
    "attn_scaling",
    "predictor",
    "save_models",
)
SWEEP_REFUSES = ("linearized", "optimizer", "batch_size", "epochs")


def _lower(value: str | None) -> str | None:
    return None if value is None else value.strip().lower()


class FieldsError(FieldError):
    """A :class:`FieldError` about several fields: ``render(names)`` spells them as the caller
    spelled the first (field names from Python, flags on the command line)."""

    def __init__(self, fields: Sequence[str], render: Callable[[list[str]], str]) -> None:
        self.fields = tuple(fields)
        self.render = render
        super().__init__(self.fields[0], literal(render(list(self.fields))))

    def named(self, name: str) -> AuditError:
        first = self.fields[0]
        if name == NtkDistanceRequest.flag_of(first):
            names = [NtkDistanceRequest.flag_of(f) for f in self.fields]
        elif name.endswith(first):
            names = [name[: len(name) - len(first)] + f for f in self.fields]
        else:
            names = [name, *self.fields[1:]]
        return AuditError(self.render(names))


def _refuse(request: Any, fields: Sequence[str], why: str) -> None:
    """One error naming every field given (not None) that does not apply."""
    given = [f for f in fields if getattr(request, f) is not None]
    if given:
        raise FieldsError(given, lambda names: f"{', '.join(names)} {why}; drop {'it' if len(names) == 1 else 'them'}")


@dataclass(frozen=True)
class NtkDistanceRequest(
    ModelFields,
    DataFields,
    SeedField,
    DeviceField,
    PrecisionField,
    BuiltinNets,
    SplitRows,
    LearningRate,
    Epochs,
    LrFraction,
    TrainingDtype,
    Request,
):
    """What ``attnaudit ntk-distance`` computes; every field is one option (see :class:`Option`).

    Fields left None take the mode's default: the preset's (``PRESETS``) and ``SWEEP_DEFAULTS``
    for the 2-layer sweep, ``TRANSFORMER_DEFAULTS`` with ``arch``, ``CHECKPOINT_DEFAULTS`` with a
    model (an explicit field beats the preset). :meth:`resolve` gives the configuration a run
    works from, built once.
    """

    COMMAND: ClassVar[str] = "ntk-distance"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS
    TRANSFORMER_DEFAULTS: ClassVar[dict[str, Any]] = TRANSFORMER_DEFAULTS
    CHECKPOINT_DEFAULTS: ClassVar[dict[str, Any]] = CHECKPOINT_DEFAULTS

    seed: int = redefault(
        SeedField,
        "seed",
        help="Base random seed; also fixes the train/held-out rows (each seed draws its own with --resample-data).",
    )
    optimizer: str | None = redefault(
        BuiltinNets,
        "optimizer",
        help="With --arch: gd (full batch), sgd or adam (default adam, as attnaudit train).",
    )
    steps: int | None = redefault(
        BuiltinNets,
        "steps",
        help="Full-batch GD steps (default: preset); with --arch optimizer steps (default: 5 epochs).",
    )
    resample_data: bool = redefault(
        BuiltinNets,
        "resample_data",
        help="Each seed draws its own train/held-out rows (the rows a run with that --seed uses), so intervals "
        "include the choice of training rows. 2-layer sweep only.",
    )
    preset: str | None = redefault(
        BuiltinNets,
        "preset",
        None,
        help="quick (default; digits in about a minute) or paper (MNIST-size: n_train 500, widths 16-4096, 3 seeds). "
        "Explicit options override it. 2-layer sweep only.",
    )
    models: tuple[str, ...] | None = redefault(
        BuiltinNets,
        "models",
        help="Models of the 2-layer sweep: relu (2L-ReLU), attn (MLP-Attn), comma-separated (default relu,attn).",
    )
    arch: tuple[str, ...] | None = option(
        None,
        "--arch",
        panel=PROTOCOL,
        parse=list_of(str),
        help="Sweep the built-in transformers instead: vit, vit-linear or vit,vit-linear (--widths = embedding dims, "
        "heads fixed at 4; trained with the ViT defaults of attnaudit train unless "
        "--optimizer/--lr/--steps/--epochs/--batch-size/--loss are given).",
    )
    widths: tuple[int, ...] | None = option(
        None,
        "--widths",
        panel=PROTOCOL,
        parse=list_of(int),
        help="Hidden widths, e.g. 16,64,256,1024,4096 (default: preset); with --arch the embedding dims "
        "(default 16,32,64,128).",
    )
    seeds: int | None = redefault(
        BuiltinNets,
        "seeds",
        help="Number of initialisation seeds per width: seed, seed+1, ... (default: preset; 2 with --arch); with "
        "--resample-data each seed also draws its own rows.",
    )
    n_train: int | None = redefault(SplitRows, "n_train", help="Training points (default: preset; 1000 with --arch).")
    n_test: int | None = redefault(
        SplitRows, "n_test", help="Held-out points (default: preset; 400 with --arch; 500 with --checkpoint)."
    )
    lr: float | None = redefault(
        LearningRate,
        "lr",
        help="Learning rate (default: the rule lr = lr_fraction * 2n / lambda_max(Theta_inf); 1e-3 for adam with --arch).",
    )
    lr_fraction: float | None = redefault(
        LrFraction,
        "lr_fraction",
        help="Fraction of the stable step 2n/lambda_max used when --lr is not given (default 0.5).",
    )
    loss: str | None = redefault(
        BuiltinNets,
        "loss",
        help="mse (closed-form kernel predictor, default) or ce (linearized GD iterated in function space); with "
        "--arch the training loss (default ce).",
    )
    parametrization: str | None = option(None, "--parametrization", panel=PROTOCOL, help="ntk (default) or standard.")
    init: str | None = option(None, "--init", panel=PROTOCOL, help="antisymmetric (f_0 = 0, default) or standard.")
    attn_scaling: str | None = option(
        None, "--attn-scaling", panel=PROTOCOL, help="Scale of the attention context: rms (default), spectral or none."
    )
    predictor: str | None = option(
        None,
        "--predictor",
        panel=ANALYSIS,
        help="discrete (exact for GD steps, default) or continuous (gradient flow for time lr*steps).",
    )
    dtype: str | None = option(
        None,
        "--train-dtype",
        panel=PROTOCOL,
        deprecated=("--dtype",),
        help="Training dtype of the networks the sweeps train: float64 or float32 (default: float64; the paper "
        "preset uses float32 from width 1024; float32 with --arch). The kernels' precision is --precision.",
    )
    kernel_points: int | None = option(
        None,
        "--kernel-points",
        panel=ANALYSIS,
        kind=int,
        help="Training points used for the kernel-movement metrics (default: all; 128 with --arch; 256 with "
        "--checkpoint).",
    )
    memory_budget: float = option(
        2048.0,
        "--memory-budget",
        panel=EXECUTION,
        help="MiB the kernel-movement Jacobians may take (--checkpoint, --arch); a kernel that cannot fit even "
        "layer by layer is refused with the budget it needs.",
    )
    save_models: str | None = option(
        None,
        "--save-models",
        panel=OUTPUT,
        metavar="PATH",
        help="Folder to save every trained network (safetensors + JSON side-car). 2-layer sweep only.",
    )
    reference_checkpoint: str | None = option(
        None,
        "--reference-checkpoint",
        panel=MODEL,
        metavar="PATH",
        help="With --checkpoint: the same model at initialization (default: a fresh initialization of the same "
        "architecture from the side-car's recorded seed).",
    )
    linearized: str | None = option(
        None,
        "--linearized",
        panel=ANALYSIS,
        help="With --checkpoint or --arch: the linearized model to compare with: auto (default: kernel-gd when the "
        "recipe is full-batch gd on a small training set, else train), kernel-gd (closed-form kernel gradient "
        "descent with the initial eNTK), train (the linearized network trained with the same recipe) or off.",
    )
    batch_size: int | None = redefault(
        BuiltinNets, "batch_size", help="With --arch: rows per step for sgd/adam (default 64)."
    )
    epochs: int | None = redefault(
        Epochs, "epochs", help="With --arch: passes over the training rows (default 5); give --epochs or --steps."
    )

    # ---- the mode and its defaults
    @property
    def mode(self) -> str:
        """``checkpoint`` (a trained model given), ``transformers`` (``arch``) or ``widths`` (the 2-layer sweep)."""
        if self.model_given:
            return "checkpoint"
        return "transformers" if self.arch is not None else "widths"

    @property
    def png_name(self) -> str:
        """The figure's file name under ``--out-dir``."""
        return {"checkpoint": PNG_CHECKPOINT, "transformers": PNG_TRANSFORMERS, "widths": PNG_NAME}[self.mode]

    def defaults(self) -> dict[str, Any]:
        """The values this request's mode gives the fields left None (the preset's for the sweep)."""
        mode = self.mode
        if mode == "checkpoint":
            return dict(CHECKPOINT_DEFAULTS)
        if mode == "transformers":
            out = {k: v for k, v in TRANSFORMER_DEFAULTS.items() if k not in ("lr", "epochs", "batch_size")}
            optimizer = _lower(self.optimizer) or TRANSFORMER_DEFAULTS["optimizer"]
            if optimizer == TRANSFORMER_DEFAULTS["optimizer"]:
                out["lr"] = TRANSFORMER_DEFAULTS["lr"]  # the default lr is adam's: other optimizers need lr
            if self.steps is None:
                out["epochs"] = TRANSFORMER_DEFAULTS["epochs"]
            if optimizer != "gd":
                out["batch_size"] = TRANSFORMER_DEFAULTS["batch_size"]
            return out
        preset = _lower(self.preset) or DEFAULT_PRESET
        if preset not in PRESETS:
            raise unknown_preset(self.preset, PRESETS)
        fields = {f.name for f in dataclasses.fields(self)}
        return {"preset": preset, **{k: v for k, v in PRESETS[preset].items() if k in fields}, **SWEEP_DEFAULTS}

    def _changes(self) -> dict[str, Any]:
        """The fields :meth:`resolved` sets: defaults of the fields left None, choices normalised."""
        changes = unset(self, self.defaults())
        for name in (
            "preset",
            "loss",
            "parametrization",
            "init",
            "attn_scaling",
            "predictor",
            "linearized",
            "optimizer",
            "dtype",
        ):
            value = changes.get(name, getattr(self, name))
            if value is not None:
                changes[name] = value.strip().lower()
        if self.arch is not None:
            changes["arch"] = tuple(a.lower() for a in self.arch)
        return changes

    def resolved(self) -> NtkDistanceRequest:
        """This request with every field left None set to its mode's default (explicit beats preset);
        the free-text choices are normalised (stripped, lower case)."""
        return dataclasses.replace(self, **self._changes())

    # ---- validation and the one configuration
    def validate(self) -> None:
        """Refuse the fields of another mode, then build (and so check) the configuration."""
        self._refuse_other_modes()
        self.resolve()  # builds, and so checks, the mode's configuration

    def _refuse_other_modes(self) -> None:
        """Refuse, by name, the fields that belong to another mode than this request's."""
        mode = self.mode
        if mode == "checkpoint":
            if self.arch is not None:
                raise FieldError(
                    "arch", "{name} trains new transformers, but a trained model is given to audit; give one of them"
                )
            _refuse(
                self,
                CHECKPOINT_REFUSES,
                "set how the sweeps train new networks and do not apply to --checkpoint "
                "(a trained model, compared with its initialization)",
            )
            if self.resample_data:
                raise FieldError(
                    "resample_data",
                    "{name} draws new training rows per seed, which a saved model was not trained on; drop it",
                )
            return
        if self.reference_checkpoint is not None:
            raise FieldError(
                "reference_checkpoint",
                "{name} is the initialization of a --checkpoint; give the trained model with --checkpoint",
            )
        if mode == "transformers":
            _refuse(
                self,
                TRANSFORMER_REFUSES,
                "belong to the 2-layer sweep (--models relu,attn), not to the transformer sweep (--arch)",
            )
            if self.resample_data:
                raise FieldError(
                    "resample_data",
                    "{name} resamples the rows of the 2-layer sweep; the transformer sweep (--arch) trains every "
                    "seed on one split, drop it",
                )
            return
        _refuse(
            self,
            SWEEP_REFUSES,
            "apply to --checkpoint or --arch vit,vit-linear, not to the 2-layer sweep (which "
            "trains by full-batch GD with the lr rule)",
        )
        if self.loaded_data is not None and self.resample_data:
            raise FieldError(
                "resample_data",
                "{name} draws each seed's rows from a data recipe; a request holding "
                "loaded data has none (give the data as dataset or data, or drop it)",
            )

    def resolve(self) -> NtkDistanceSettings:
        """The configuration this request runs from: the mode's defaults filled in (explicit beats
        preset), the mode's analysis configuration built and validated. Built once, at construction
        (which validates it), and returned again after."""
        return self.built_once(self._build)

    def _build(self) -> NtkDistanceSettings:
        values = SimpleNamespace(
            **{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **self._changes()}
        )
        return SETTINGS_BY_MODE[self.mode](values)

    def check(self) -> None:
        """The dry run: the fields, the model files (and the reference), the data."""
        super().check()
        if self.reference_checkpoint is not None:
            load_model_source(self.reference_checkpoint, trust_pickle=self.trust_pickle)


# --------------------------------------------------------------------------- run


def run(
    request: NtkDistanceRequest, *, progress: Progress | None = None, executor=None, overwrite: bool = False
) -> Result:
    """Run ``request``; the report is the one ``attnaudit ntk-distance --json`` writes.

    ``executor`` (:class:`attnaudit.runtime.sweep.ExecutorConfig`) says where the sweeps' cells
    run; ``overwrite`` lets ``save_models`` replace files already there. The result's
    ``failed_cells`` lists the sweep cells that failed (the report holds the others).
    """
    settings = request.resolve()
    shown = progress_or_silent(progress)
    if isinstance(settings.analysis, CheckpointKernelConfig):
        return _run_checkpoint(request, settings.analysis, shown, executor)
    if isinstance(settings.analysis, TransformerSweepConfig):
        return _run_transformers(request, settings, settings.analysis, shown, executor)
    return _run_widths(request, settings, settings.analysis, shown, executor, overwrite)


def _remote(executor: ExecutorConfig | None) -> bool:
    """Whether the cells would run outside this process or be resumed from a folder."""
    return executor is not None and (is_remote(executor) or bool(executor.resume_dir))


def _holdout_error(exc: AuditError, n_train: int, n_test: int) -> AuditError:
    """The data layer's error about its row count ``n``: here that count is n_train + n_test."""
    template = getattr(exc, "template", None)  # a FieldError of the data layer's field n
    if getattr(exc, "field", None) != "n" or not isinstance(template, str):
        return exc
    return FieldsError(
        ("n_train", "n_test"),
        lambda names: (
            f"{names[0]} {n_train} + {names[1]} {n_test} = {n_train + n_test} rows: "
            + template.format(name=f"{names[0]}/{names[1]}")
        ),
    )


def _sweep_rows(request: NtkDistanceRequest, settings: NtkDistanceSettings, what: str):
    """(train, held-out, recipe) of a sweep, ``n_train`` + ``n_test`` rows split with the base seed;
    the recipe is what every worker rebuilds the rows from (None for in-memory data)."""
    n_train, n_test = settings.n_train, settings.n_test
    assert n_train is not None and n_test is not None  # a sweep's settings hold both
    try:
        if request.loaded_data is not None:
            train_ds, test_ds = holdout_split(request.loaded_data, n_train, n_test, request.seed, stratify=True)
            recipe = None
        else:
            spec = request.data_spec(request.seed, n=n_train + n_test)
            recipe = HoldoutRecipe.of(spec, n_train, n_test, request.seed, stratify=True)
            train_ds, test_ds = recipe.load()
    except AuditError as exc:
        raise _holdout_error(exc, n_train, n_test) from None
    if train_ds.y is None:
        raise AuditError(f"{train_ds.name} has no labels; {what} trains classifiers, so give labelled data")
    return train_ds, test_ds, recipe


def _holdout_seeds(base: int, seeds: Sequence[int], resample: bool) -> dict:
    """The report's record of which rows each model seed used: one split drawn with the base
    seed, or (``--resample-data``) seed s's own, the split a run with ``--seed s`` draws."""
    if not resample:
        return {
            "holdout_seed": base,
            "holdout_seeds": [base for _ in seeds],
            "data": "one train/held-out split drawn with the base seed, shared by every model seed",
        }
    return {
        "holdout_seed": "per model seed",
        "holdout_seeds": list(seeds),
        "data": "--resample-data: model seed s trains and is measured on its own rows, the subset and split a "
        "run with --seed s draws",
    }


def _run_widths(
    request: NtkDistanceRequest,
    settings: NtkDistanceSettings,
    config: NTKDistanceConfig,
    progress: Progress,
    executor: ExecutorConfig | None,
    overwrite: bool,
) -> Result:
    """The 2-layer width sweep."""
    dev = resolve_device(request.device)
    save_dir = None
    if request.save_models is not None:
        if _remote(executor):
            raise FieldError(
                "save_models",
                "{name} keeps the networks trained in this process; use it without --executor ray, --jobs or --resume",
            )
        save_dir = prepare_save_folder(request.save_models, config, overwrite)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    (executor or ExecutorConfig()).check_available()
    train_ds, test_ds, recipe = _sweep_rows(request, settings, "ntk-distance")
    timings["load"] = time.perf_counter() - t0
    training_data = {
        "name": train_ds.name,
        "split": train_ds.info.get("split"),
        "n": train_ds.n,
        "seed": request.seed,
        "preprocess": request.preprocess,
        "fingerprint": data_fingerprint(train_ds.X, train_ds.y),
    }
    saved: list[str] = []
    saver = model_saver(config, save_dir, training_data, recipe, overwrite, saved) if save_dir else None
    total = len(config.models) * len(config.widths) * len(config.seeds)
    t1 = time.perf_counter()
    with progress("ntk-distance", total, "cells") as advance:
        result = run_ntk_distance(
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            train_ds.n_classes,
            config,
            progress=lambda: advance(1),
            on_model=saver,
            executor=executor,
            data=recipe,
        )
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0
    results = {k: v for k, v in result.to_dict().items() if k not in ("schema", "warnings", "verdicts")}
    results["dataset"] = {"train": train_ds.info, "test": test_ds.info}
    if saved:
        results["saved_models"] = saved
    results |= closed_forms(
        request.precision, "the 2-layer nets' kernels", "the transformers' Jacobians: --arch, --checkpoint"
    )
    f32_from = config.float32_from_width
    return _sweep_result(
        request,
        settings,
        config,
        result,
        SCHEMA,
        inputs={"preset": settings.preset},
        seeds=_holdout_seeds(request.seed, config.seeds, config.resample_data),
        device=dev,
        dtype=f"float64 (kernels, predictor, metrics); training {config.train_dtype}"
        + (f", float32 from width {f32_from}" if f32_from else ""),
        timings=timings,
        results=results,
        renderables=build_tables(result),
        plot=lambda p: plot_ntk_distance(result, p),
        png_name=PNG_NAME,
    )


def _sweep_result(
    request: NtkDistanceRequest,
    settings: NtkDistanceSettings,
    config: NTKDistanceConfig | TransformerSweepConfig,
    result: Any,
    schema: str,
    *,
    inputs: dict,
    seeds: dict,
    device: Any,
    dtype: str,
    timings: dict[str, float],
    results: dict,
    renderables: list,
    plot: Callable[[Any], Any],
    png_name: str,
) -> Result:
    """The :class:`Result` of a width sweep (2-layer nets or transformers): its report records the data,
    ``inputs`` (what only this sweep takes), the sizes and the configuration, the base and model seeds
    with ``seeds`` (the other seeds it used), and the cells that failed."""
    report = build_report(
        schema,
        inputs={
            **request.data_inputs(),
            **inputs,
            "n_train": settings.n_train,
            "n_test": settings.n_test,
            **config.to_dict(),
            "execution": result.execution,
        },
        seeds={"base_seed": request.seed, "model_seeds": list(config.seeds), **seeds},
        device=device,
        dtype=dtype,
        timings=timings,
        results=results,
        warnings=result.warnings,
        verdicts=result.verdicts(),
        request=request,
    )
    return Result(
        report,
        request,
        renderables=renderables,
        plot=plot,
        png_name=png_name,
        failed_cells=list(result.failed_cells),
    )


def _run_checkpoint(
    request: NtkDistanceRequest, config: CheckpointKernelConfig, progress: Progress, executor: ExecutorConfig | None
) -> Result:
    """Kernel movement of trained models against their initialization."""
    from rich.text import Text

    if _remote(executor):
        raise FieldError(
            "checkpoint",
            "{name} analyses the given models in this process; --executor, --jobs and --resume run the width sweeps",
        )
    dev = resolve_device(request.device)
    t0 = time.perf_counter()
    loaded = request.load_models()  # every file checked before any data are read
    reference = None
    if request.reference_checkpoint is not None:
        if len(loaded) != 1:
            raise FieldError(
                "reference_checkpoint", "{name} is the initialization of one model; give a single --checkpoint"
            )
        reference = load_model_source(request.reference_checkpoint, trust_pickle=request.trust_pickle)
    else:
        refuse_without_initialization(loaded)
    ds = request.load_data(config.seed)
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; the kernel-label alignment and the linearized model need labels")
    fitted = {label: fit_to_data(lm, ds) for label, lm in loaded.items()}
    if reference is not None:
        reference = fit_to_data(reference, ds)
    timings = {"load": time.perf_counter() - t0}
    # a causal language model's kernel is its documents' log-likelihood eNTK (one output per document)
    language = all(lm.source.get("task") == "causal-lm" for lm in fitted.values())
    kernel = "eNTK of each document's log-likelihood" if language else f"eNTK, {config.form} kernel"
    plan = (
        f"ntk-distance --checkpoint: {', '.join(fitted)} on {ds.name} ({ds.n} rows); {kernel} on up to "
        f"{config.kernel_points} training rows, float64, engine"
    )
    warnings: list[str] = []
    results = []
    t1 = time.perf_counter()
    with progress("ntk-distance", len(fitted), "models") as advance:
        for label, lm in fitted.items():
            result, rows_warnings = audit_loaded(
                label, lm, ds, config, reference=reference, reference_path=request.reference_checkpoint, device=dev
            )
            results.append(result)
            warnings.extend(rows_warnings)
            advance(1)
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0
    report = build_report(
        SCHEMA_CHECKPOINT,
        inputs={
            **request.data_inputs(),
            "models": request.model_sources(),
            "reference_checkpoint": request.reference_checkpoint,
            **config.to_dict(),
        },
        seeds={"base_seed": config.seed, "subset_seed": config.seed},
        device=dev,
        dtype="kernels' Jacobians: see each model's precision; kernel sums and metrics float64; the linearized "
        "model trains in the checkpoint's dtype",
        timings=timings,
        results={
            "dataset": ds.info,
            "models": {r.label: {"source": fitted[r.label].source, **r.to_dict()} for r in results},
        },
        warnings=[*warnings, *(w for r in results for w in r.warnings)],
        verdicts=[r.verdict for r in results],
        request=request,
    )
    return Result(
        report,
        request,
        renderables=[Text(plan), *build_checkpoint_tables(results, warnings)],
        plot=lambda p: plot_checkpoints(results, p),
        png_name=PNG_CHECKPOINT,
    )


def _run_transformers(
    request: NtkDistanceRequest,
    settings: NtkDistanceSettings,
    config: TransformerSweepConfig,
    progress: Progress,
    executor: ExecutorConfig | None,
) -> Result:
    """The kernel regime of the built-in transformers across widths."""
    from rich.text import Text

    recipe = config.recipe
    dev = resolve_device(request.device)
    t0 = time.perf_counter()
    (executor or ExecutorConfig()).check_available()
    train_ds, test_ds, data_recipe = _sweep_rows(request, settings, "the transformer sweep")
    image_shape_of(train_ds.feature_shape, config.archs[0])  # flat data is refused before any training
    timings = {"load": time.perf_counter() - t0}
    plan = (
        f"ntk-distance --arch {','.join(config.archs)}: {train_ds.name}, {train_ds.n} train / {test_ds.n} held-out "
        f"rows, widths {','.join(map(str, config.widths))} (heads fixed at {config.heads}), {len(config.seeds)} "
        f"seed(s), {recipe.optimizer} lr {recipe.lr:g}, {recipe.total_steps(train_ds.n)} steps, {recipe.loss}; eNTK "
        f"on {min(train_ds.n, config.kernel_points)} training rows"
    )
    t1 = time.perf_counter()
    total = len(config.archs) * len(config.widths) * len(config.seeds)
    with progress("ntk-distance", total, "cells") as advance:
        result = run_transformer_sweep(
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            train_ds.n_classes,
            train_ds.feature_shape,
            config,
            device=dev,
            progress=lambda: advance(1),
            executor=executor,
            data=data_recipe,
        )
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0
    results = result.to_dict()
    results["dataset"] = {"train": train_ds.info, "test": test_ds.info}
    return _sweep_result(
        request,
        settings,
        config,
        result,
        SCHEMA_TRANSFORMERS,
        inputs={},
        seeds={"holdout_seed": request.seed, "kernel_rows_seed": 0},
        device=dev,
        dtype=f"kernels' Jacobians {config.precision}; kernel sums and metrics float64; training {config.train_dtype}",
        timings=timings,
        results=results,
        renderables=[Text(plan), *build_sweep_tables(result)],
        plot=lambda p: plot_sweep(result, p),
        png_name=PNG_TRANSFORMERS,
    )
