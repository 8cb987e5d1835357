"""`ntk-distance` as a request and a run: how far finite networks are from their kernel regime.

Three modes, chosen by the request:

* the 2-layer width sweep (default): finite 2L-ReLU / MLP-Attn networks against their NTK
  predictor across ``widths`` (:mod:`attnaudit.analyses.ntk_distance.widths`); ``preset``
  quick or paper sets the sizes, explicit fields beat it; ``resample_data``: each seed trains
  and is measured on its own rows (those a run with that base seed uses), not the base seed's;
* ``checkpoint`` (or ``factory`` / ``loaded_models``): how far training moved a trained model's
  kernel from its initialization (:mod:`attnaudit.analyses.ntk_distance.movement`);
* ``arch`` vit,vit-linear: the width sweep of the built-in transformers
  (:mod:`attnaudit.analyses.ntk_distance.movement`), trained with the ViT defaults of
  ``attnaudit train`` unless the recipe fields are given.

Fields that do not apply to the chosen mode are refused by name. The sweeps run their cells
on ``executor`` (:class:`attnaudit.runtime.sweep.ExecutorConfig`; default: in this process);
cells that fail are listed in ``Result.failed_cells`` and the report holds the others.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

from attnaudit.analyses.request import (
    ANALYSIS,
    EXECUTION,
    MODEL,
    OUTPUT,
    PROTOCOL,
    FieldError,
    Request,
    check_seeds,
    field_check,
    list_of,
    literal,
    option,
    unknown_preset,
    unset,
)
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DataFields, ModelFields
from attnaudit.core.recipes import MINI_BATCH, VIT_DEFAULTS
from attnaudit.errors import AuditError, check_seed
from attnaudit.runtime.device import resolve_device
from attnaudit.data import HoldoutRecipe, holdout_split
from attnaudit.analyses.ntk_distance.widths import (
    SCHEMA,
    build_tables,
    plot_ntk_distance,
    run_ntk_distance,
    seed_recipe,
)
from attnaudit.data import data_fingerprint
from attnaudit.models.builtin import save_model
from attnaudit.report.envelope import build_report, check_target
from attnaudit.runtime.sweep import ExecutorConfig
from attnaudit.analyses.ntk_distance.movement import (
    SCHEMA_CHECKPOINT,
    analyse_checkpoint,
    build_checkpoint_tables,
    initial_model,
    plot_checkpoints,
)
from attnaudit.core.task import Task
from attnaudit.data import subset
from attnaudit.models.checkpoints import fit_to_data, load_model_source, rebuild_of, recorded_split
from attnaudit.analyses.ntk_distance.movement import (
    SCHEMA_TRANSFORMERS,
    build_sweep_tables,
    plot_sweep,
    run_transformer_sweep,
)
from attnaudit.models.builtin import image_shape_of
from attnaudit.analyses.ntk_distance.widths import NTKDistanceConfig
from attnaudit.core.ntk import PREDICTOR_MODES
from attnaudit.core.training import LOSSES
from attnaudit.models.builtin import ARCHITECTURES, ATTN_SCALINGS, INITS, PARAMETRIZATIONS
from attnaudit.runtime.device import resolve_dtype
from attnaudit.analyses.ntk_distance.movement import TransformerSweepConfig
from attnaudit.core.fit import Recipe
from attnaudit.analyses.ntk_distance.movement import CheckpointKernelConfig

PNG_NAME = "ntk_distance.png"
PNG_CHECKPOINT = "ntk_checkpoint.png"
PNG_TRANSFORMERS = "ntk_transformers.png"

# The presets of the 2-layer width sweep (field -> value; float32_from_width is the width from
# which networks train in float32 when no dtype is given). Sizes only (the data set comes from
# --dataset). quick: a couple of minutes at most on 2 CPU cores on digits (d = 64). paper: the
# paper's width range with several hundred training points; networks of width >= 1024 are
# trained in float32 (float64 training of the 4096-wide nets dominated the run time; on real
# MNIST the float32 and float64 distances agreed to ~1e-6 relative); everything measured
# stays float64.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "n_train": 200,
        "n_test": 200,
        "widths": (16, 64, 256, 1024),
        "seeds": 3,
        "steps": 200,
        "float32_from_width": None,
    },
    "paper": {
        "n_train": 500,
        "n_test": 500,
        "widths": (16, 64, 256, 1024, 4096),
        "seeds": 3,
        "steps": 200,
        "float32_from_width": 1024,
    },
}
DEFAULT_PRESET = "quick"
# the rest of the 2-layer sweep's protocol when not given
SWEEP_DEFAULTS: dict[str, Any] = {
    "models": ("relu", "attn"),
    "lr_fraction": 0.5,
    "loss": "mse",
    "parametrization": "ntk",
    "init": "antisymmetric",
    "attn_scaling": "rms",
    "predictor": "discrete",
}
# defaults of the transformer width sweep (arch vit,vit-linear): sizes, and the ViT recipe of
# `attnaudit train` (adam, lr 1e-3, mini-batches of 64, 5 epochs, cross-entropy, float32)
TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "widths": (16, 32, 64, 128),
    "seeds": 2,
    "n_train": 1000,
    "n_test": 400,
    "kernel_points": 128,
    "linearized": "auto",
    **{k: VIT_DEFAULTS[k] for k in ("dtype", "optimizer", "lr", "epochs", "loss")},
    "batch_size": MINI_BATCH,
}
# defaults of checkpoint (kernel movement of a trained model)
CHECKPOINT_DEFAULTS: dict[str, Any] = {"kernel_points": 256, "n_test": 500, "linearized": "auto"}

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


def model_filename(arch: str, width: int, seed: int) -> str:
    """The file name ``save_models`` gives one trained 2-layer network."""
    return f"{arch}_m{width}_seed{seed}.safetensors"


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


_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _flagged(build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a library check whose error names a command-line option (``--steps must ...``) and
    turn it into a :class:`FieldError` on that option's field."""
    try:
        return build(*args, **kwargs)
    except FieldError:
        raise
    except AuditError as exc:
        text = str(exc)
        for flag in _FLAG.findall(text):
            name = NtkDistanceRequest.field_of(flag)
            if name is not None and NtkDistanceRequest.flag_of(name) == flag:
                template = re.sub(re.escape(flag) + r"(?![\w-])", "{name}", literal(text))
                raise FieldError(name, template) from None
        raise


@dataclass(frozen=True)
class NtkDistanceRequest(ModelFields, DataFields, Request):
    """What ``attnaudit ntk-distance`` computes; every field is one option (see :class:`Option`).

    Fields left None take the mode's default: the preset's (``PRESETS``) and ``SWEEP_DEFAULTS``
    for the 2-layer sweep, ``TRANSFORMER_DEFAULTS`` with ``arch``, ``CHECKPOINT_DEFAULTS`` with a
    model (:meth:`resolved` fills them in; an explicit field beats the preset).
    """

    COMMAND: ClassVar[str] = "ntk-distance"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS
    TRANSFORMER_DEFAULTS: ClassVar[dict[str, Any]] = TRANSFORMER_DEFAULTS
    CHECKPOINT_DEFAULTS: ClassVar[dict[str, Any]] = CHECKPOINT_DEFAULTS

    preset: str | None = option(
        None,
        "--preset",
        panel=PROTOCOL,
        help="quick (default; digits in about a minute) or paper (MNIST-size: n_train 500, widths 16-4096, 3 seeds). "
        "Explicit options override it. 2-layer sweep only.",
    )
    models: tuple[str, ...] | None = option(
        None,
        "--models",
        panel=PROTOCOL,
        parse=list_of(str),
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
    seeds: int | None = option(
        None,
        "--seeds",
        panel=PROTOCOL,
        kind=int,
        help="Number of initialisation seeds per width: seed, seed+1, ... (default: preset; 2 with --arch); with "
        "--resample-data each seed also draws its own rows.",
    )
    resample_data: bool = option(
        False,
        "--resample-data",
        panel=PROTOCOL,
        negative="--fixed-data",
        help="Each seed draws its own train/held-out rows (the rows a run with that --seed uses), so intervals "
        "include the choice of training rows. 2-layer sweep only.",
    )
    n_train: int | None = option(
        None, "--n-train", panel=PROTOCOL, kind=int, help="Training points (default: preset; 1000 with --arch)."
    )
    n_test: int | None = option(
        None,
        "--n-test",
        panel=PROTOCOL,
        kind=int,
        help="Held-out points (default: preset; 400 with --arch; 500 with --checkpoint).",
    )
    steps: int | None = option(
        None,
        "--steps",
        panel=PROTOCOL,
        kind=int,
        help="Full-batch GD steps (default: preset); with --arch optimizer steps (default: 5 epochs).",
    )
    lr: float | None = option(
        None,
        "--lr",
        panel=PROTOCOL,
        kind=float,
        help="Learning rate (default: the rule lr = lr_fraction * 2n / lambda_max(Theta_inf); 1e-3 for adam with --arch).",
    )
    lr_fraction: float | None = option(
        None,
        "--lr-fraction",
        panel=PROTOCOL,
        kind=float,
        help="Fraction of the stable step 2n/lambda_max used when --lr is not given (default 0.5).",
    )
    loss: str | None = option(
        None,
        "--loss",
        panel=PROTOCOL,
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
        "--dtype",
        panel=PROTOCOL,
        help="Training dtype for every width: float64 or float32 (default: float64; the paper preset uses float32 "
        "from width 1024; float32 with --arch). Kernels and metrics are always float64.",
    )
    kernel_points: int | None = option(
        None,
        "--kernel-points",
        panel=ANALYSIS,
        kind=int,
        help="Training points used for the kernel-movement metrics (default: all; 128 with --arch; 256 with "
        "--checkpoint).",
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
    optimizer: str | None = option(
        None,
        "--optimizer",
        panel=PROTOCOL,
        help="With --arch: gd (full batch), sgd or adam (default adam, as attnaudit train).",
    )
    batch_size: int | None = option(
        None, "--batch-size", panel=PROTOCOL, kind=int, help="With --arch: rows per step for sgd/adam (default 64)."
    )
    epochs: int | None = option(
        None,
        "--epochs",
        panel=PROTOCOL,
        kind=int,
        help="With --arch: passes over the training rows (default 5); give --epochs or --steps.",
    )
    seed: int = option(
        0,
        "--seed",
        panel=PROTOCOL,
        help="Base random seed; also fixes the train/held-out rows (each seed draws its own with --resample-data).",
    )
    device: str = option("auto", "--device", panel=EXECUTION, help="auto, cpu, cuda or cuda:<i>.")

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

    def _values(self) -> Any:
        """The resolved values, without building (and so validating) a request."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return SimpleNamespace(**{**values, **self._changes()})

    def resolved(self) -> NtkDistanceRequest:
        """This request with every field left None set to its mode's default (explicit beats preset);
        the free-text choices are normalised (stripped, lower case)."""
        return dataclasses.replace(self, **self._changes())

    # ---- validation
    def validate(self) -> None:
        mode = self.mode
        if mode == "checkpoint":
            if self.arch is not None:
                raise FieldError(
                    "arch", "--checkpoint audits a trained model and {name} trains new transformers; give one of them"
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
            self.checkpoint_config()
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
            self.transformer_config()
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
        self.sweep_config()

    def _sizes(self, r: Any) -> None:
        """The sizes of a width sweep (``r``: this request resolved)."""
        assert r.seeds is not None and r.n_train is not None and r.n_test is not None
        check_seeds(r.seed, r.seeds)
        if r.n_train < 2:
            raise FieldError("n_train", "{name} must be >= 2, got " + str(r.n_train))
        if r.n_test < 1:
            raise FieldError("n_test", "{name} must be >= 1, got " + str(r.n_test))

    def sweep_config(self):
        """The 2-layer sweep's :class:`~attnaudit.analyses.ntk_distance.widths.NTKDistanceConfig` (validated)."""

        r = self._values()
        assert r.preset is not None and r.models is not None and r.widths is not None and r.steps is not None
        if not r.models:
            raise FieldError("models", "no models given; use {name} relu,attn")
        bad = [m for m in r.models if m not in ARCHITECTURES]
        if bad:
            raise FieldError("models", literal(f"unknown model(s) {bad}; use a subset of {','.join(ARCHITECTURES)}"))
        self._sizes(r)
        if r.dtype is not None:
            train_dtype, f32_from = str(_flagged(resolve_dtype, r.dtype)).replace("torch.", ""), None
        else:
            train_dtype, f32_from = "float64", PRESETS[r.preset]["float32_from_width"]
        if any(w < 1 for w in r.widths):
            raise FieldError("widths", "{name} must be positive integers, got " + literal(str(list(r.widths))))
        choices = (
            ("loss", "loss", LOSSES),
            ("parametrization", "parametrization", PARAMETRIZATIONS),
            ("init", "init", INITS),
            ("attn_scaling", "attention scaling", ATTN_SCALINGS),
            ("predictor", "predictor", PREDICTOR_MODES),
        )
        for name, what, allowed in choices:
            value = getattr(r, name)
            if value not in allowed:
                raise FieldError(name, literal(f"unknown {what} {value!r}; use one of {', '.join(allowed)}"))
        if r.init == "antisymmetric" and any(w % 2 for w in r.widths):
            odd = [w for w in r.widths if w % 2]
            raise FieldError(
                "widths",
                literal(f"antisymmetric init needs even widths, got {odd}; use even widths or --init standard"),
            )
        assert r.lr_fraction is not None
        if not 0 < r.lr_fraction < 1:
            raise FieldError(
                "lr_fraction", "{name} must be in (0, 1) of the stable step 2n/lambda_max, got " + str(r.lr_fraction)
            )
        return _flagged(
            NTKDistanceConfig,
            models=tuple(r.models),
            widths=tuple(r.widths),
            seeds=tuple(r.seed + i for i in range(r.seeds or 0)),
            steps=r.steps,
            lr=r.lr,
            lr_fraction=r.lr_fraction,
            loss=r.loss,
            parametrization=r.parametrization,
            init=r.init,
            attn_scaling=r.attn_scaling,
            predictor=r.predictor,
            train_dtype=train_dtype,
            float32_from_width=f32_from,
            kernel_points=r.kernel_points,
            resample_data=r.resample_data,
        )

    def transformer_config(self):
        """The transformer sweep's :class:`~attnaudit.analyses.ntk_distance.movement.TransformerSweepConfig`
        (validated; its recipe the ViT defaults of ``attnaudit train`` where not given)."""

        r = self._values()
        self._sizes(r)
        if r.lr is None:
            raise FieldError(
                "lr",
                f"--optimizer {literal(str(r.optimizer))} needs {{name}}: the default learning "
                f"rate {TRANSFORMER_DEFAULTS['lr']:g} is the one for {TRANSFORMER_DEFAULTS['optimizer']}",
            )
        recipe = _flagged(
            Recipe,
            optimizer=r.optimizer,
            lr=r.lr,
            batch_size=r.batch_size,
            epochs=r.epochs,
            steps=r.steps,
            loss=r.loss,
            seed=r.seed,
        )
        assert r.arch is not None and r.widths is not None and r.seeds is not None
        return _flagged(
            TransformerSweepConfig,
            archs=tuple(r.arch),
            widths=tuple(r.widths),
            seeds=tuple(r.seed + i for i in range(r.seeds)),
            recipe=recipe,
            kernel_points=r.kernel_points,
            linearized=r.linearized,
            train_dtype=r.dtype,
        )

    def checkpoint_config(self):
        """The :class:`~attnaudit.analyses.ntk_distance.movement.CheckpointKernelConfig` of a trained model (validated)."""

        field_check("seed", check_seed, self.seed)
        r = self._values()
        return _flagged(
            CheckpointKernelConfig, kernel_points=r.kernel_points, n_test=r.n_test, linearized=r.linearized, seed=r.seed
        )

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
    mode = request.mode
    if mode == "checkpoint":
        return _run_checkpoint(request, progress_or_silent(progress), executor)
    if mode == "transformers":
        return _run_transformers(request, progress_or_silent(progress), executor)
    return _run_widths(request, progress_or_silent(progress), executor, overwrite)


def _remote(executor) -> bool:
    return executor is not None and (executor.kind != "local" or executor.jobs > 1 or bool(executor.resume_dir))


def _device(request: NtkDistanceRequest):

    return _flagged(resolve_device, request.device)


def _load_holdout(request: NtkDistanceRequest, n_train: int, n_test: int):
    """(train, held-out, recipe): the recipe every worker rebuilds the rows from (None for in-memory data)."""

    if request.loaded_data is not None:
        train_ds, test_ds = holdout_split(request.loaded_data, n_train, n_test, request.seed, stratify=True)
        return train_ds, test_ds, None
    recipe = HoldoutRecipe.of(
        request.data_spec(request.seed, n=n_train + n_test), n_train, n_test, request.seed, stratify=True
    )
    return (*recipe.load(), recipe)


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


def _holdout_error(exc: AuditError, n_train: int, n_test: int) -> AuditError:
    """The data layer speaks of ``--n``; here the row count is n_train + n_test."""
    if "--n " not in str(exc):
        return exc
    rest = str(exc).replace("lower --n", "lower --n-train/--n-test")
    return FieldsError(
        ("n_train", "n_test"),
        lambda names: f"{names[0]} {n_train} + {names[1]} {n_test} = {n_train + n_test} rows: {rest}",
    )


def _run_widths(request: NtkDistanceRequest, progress: Progress, executor, overwrite: bool) -> Result:
    """The 2-layer width sweep."""

    r = request._values()
    config = request.sweep_config()
    assert r.preset is not None and r.n_train is not None and r.n_test is not None
    ntr, nte = r.n_train, r.n_test
    dev = _device(request)
    save_dir = None
    if request.save_models is not None:
        if _remote(executor):
            raise FieldError(
                "save_models",
                "{name} keeps the networks trained in this process; use it without --executor ray, --jobs or --resume",
            )
        save_dir = Path(request.save_models)
        if save_dir.exists() and not save_dir.is_dir():
            raise FieldError("save_models", "{name} " + literal(f"{save_dir} is a file; give a folder"))
        save_dir.mkdir(parents=True, exist_ok=True)
        for arch in config.models:
            for w in config.widths:
                for s in config.seeds:
                    target = save_dir / model_filename(arch, w, s)
                    check_target(target, overwrite)
                    check_target(target.with_suffix(".safetensors.json"), overwrite)

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    ex = executor or ExecutorConfig()
    ex.check_available()
    try:
        train_ds, test_ds, recipe = _load_holdout(request, ntr, nte)  # the same rows every worker rebuilds
    except AuditError as exc:
        raise _holdout_error(exc, ntr, nte) from None
    ds = train_ds
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; ntk-distance trains classifiers, so give labelled data")
    timings["load"] = time.perf_counter() - t0
    training_data = {
        "name": ds.name,
        "split": ds.info.get("split"),
        "n": train_ds.n,
        "seed": request.seed,
        "preprocess": request.preprocess,
        "fingerprint": data_fingerprint(train_ds.X, train_ds.y),
    }

    saved: list[str] = []

    def seed_training_data(s: int) -> dict:
        """The side-car's record of the rows seed ``s`` trained on (its own with --resample-data)."""
        if not config.resample_data:
            return training_data
        assert recipe is not None  # --resample-data is refused with loaded data
        rows, _ = seed_recipe(recipe, s).load()  # cached: the rows its cells trained on
        return {**training_data, "n": rows.n, "seed": s, "fingerprint": data_fingerprint(rows.X, rows.y)}

    def on_model(arch: str, width: int, s: int, net) -> None:
        assert save_dir is not None
        path = save_model(
            net,
            save_dir / model_filename(arch, width, s),
            overwrite=overwrite,
            metadata={
                "command": "ntk-distance",
                "dataset": ds.name,
                "steps": config.steps,
                "training_data": seed_training_data(s),
            },
        )
        saved.append(str(path))

    total = len(config.models) * len(config.widths) * len(config.seeds)
    t1 = time.perf_counter()
    with progress("ntk-distance", total, "cells") as advance:
        result = run_ntk_distance(
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            ds.n_classes,
            config,
            progress=lambda: advance(1),
            on_model=on_model if save_dir is not None else None,
            executor=executor,
            data=recipe,
        )
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0

    results = {k: v for k, v in result.to_dict().items() if k not in ("schema", "warnings", "verdicts")}
    results["dataset"] = {"train": train_ds.info, "test": test_ds.info}
    if saved:
        results["saved_models"] = saved
    f32_from = config.float32_from_width
    report = build_report(
        SCHEMA,
        inputs={
            **request.data_inputs(),
            "preset": r.preset,
            "n_train": ntr,
            "n_test": nte,
            **config.to_dict(),
            "execution": result.execution,
        },
        seeds={
            "base_seed": request.seed,
            "model_seeds": list(config.seeds),
            **_holdout_seeds(request.seed, config.seeds, config.resample_data),
        },
        device=dev,
        dtype=f"float64 (kernels, predictor, metrics); training {config.train_dtype}"
        + (f", float32 from width {f32_from}" if f32_from else ""),
        timings=timings,
        results=results,
        warnings=result.warnings,
        verdicts=result.verdicts(),
        request=request,
    )
    return Result(
        report,
        request,
        renderables=build_tables(result),
        plot=lambda p: plot_ntk_distance(result, p),
        png_name=PNG_NAME,
        failed_cells=list(result.failed_cells),
    )


def _run_checkpoint(request: NtkDistanceRequest, progress: Progress, executor) -> Result:
    """Kernel movement of trained models against their initialization."""
    import torch
    from rich.text import Text

    if _remote(executor):
        raise AuditError(
            "--checkpoint analyses given models in this process; --executor, --jobs and --resume run the width sweeps"
        )
    config = request.checkpoint_config()
    seed = request.seed
    dev = _device(request)
    t0 = time.perf_counter()
    loaded = request.load_models()  # every file checked before any data are read
    reference = None
    reference_checkpoint = request.reference_checkpoint
    if reference_checkpoint is not None:
        if len(loaded) != 1:
            raise FieldError(
                "reference_checkpoint", "{name} is the initialization of one model; give a single --checkpoint"
            )
        reference = load_model_source(reference_checkpoint, trust_pickle=request.trust_pickle)
    else:
        for label, lm in loaded.items():
            if initial_model(lm) is None:
                raise AuditError(
                    f"{label}: ntk-distance --checkpoint compares the model with its initialization, and a "
                    f"{lm.source.get('kind')} model does not record one; give the same model at initialization with "
                    "--reference-checkpoint PATH"
                )
    ds = request.load_data(seed)
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; the kernel-label alignment and the linearized model need labels")
    fitted = {label: fit_to_data(lm, ds) for label, lm in loaded.items()}
    if reference is not None:
        reference = fit_to_data(reference, ds)
    timings = {"load": time.perf_counter() - t0}
    plan = (
        f"ntk-distance --checkpoint: {', '.join(fitted)} on {ds.name} ({ds.n} rows); eNTK on "
        f"{config.kernel_points} training rows, {config.form} kernel, float64, engine"
    )
    warnings: list[str] = []
    results = []
    sources = {}
    t1 = time.perf_counter()
    with progress("ntk-distance", len(fitted), "models") as advance:
        for label, lm in fitted.items():
            task_trained = Task(lm.module, lm.n_classes, inputs=lm.inputs)
            if reference is not None:
                task_init = Task(reference.module, reference.n_classes, inputs=reference.inputs)
                ref_info = {
                    "kind": "checkpoint",
                    "path": str(reference_checkpoint),
                    "source": reference.source,
                    "detail": f"--reference-checkpoint {reference.label}",
                }
            else:
                initial = initial_model(lm)
                assert initial is not None  # every model was checked to have one above
                module0, ref_info = initial
                task_init = Task(module0, lm.n_classes, inputs=lm.inputs)
            rebuild = rebuild_of(lm) if lm.source.get("kind") == "attnaudit" else None
            recipe = rebuild.recipe if rebuild is not None else None
            rebuilt = recorded_split(ds, {label: lm})
            no_lin = None
            train = None
            if rebuilt is not None:
                train_all, held_all, rec = rebuilt
                kern = subset(train_all, min(config.kernel_points, train_all.n), seed)
                test = subset(held_all, min(config.n_test, held_all.n), seed)
                train = (train_all.X, train_all.y)
                rows_info = {
                    "rows": "checkpoint split",
                    "recorded_split": rec,
                    "detail": f"kernel: {kern.n} of the checkpoint's {train_all.n} training rows; held-out: "
                    f"{test.n} of its {held_all.n} held-out rows (split rebuilt, fingerprint matched)",
                }
            else:
                kp = min(config.kernel_points, ds.n - 1)
                kern, test = holdout_split(ds, kp, min(config.n_test, ds.n - kp), seed, stratify=True)
                rows_info = {
                    "rows": "fresh split",
                    "detail": f"a seeded holdout split of the data (seed {seed}): "
                    f"{kern.n} kernel rows, {test.n} held-out rows",
                }
                recorded_data = lm.metadata.get("training_data") if isinstance(lm.metadata, dict) else None
                if isinstance(recorded_data, dict) and recorded_data.get("fingerprint"):
                    where = ", ".join(
                        f"{k} {recorded_data[k]}"
                        for k in ("name", "split", "n", "preprocess")
                        if recorded_data.get(k) is not None
                    )
                    warnings.append(
                        f"{label}: its training split ({where}) could not be rebuilt from {ds.name} as given, so the kernel "
                        "rows are a fresh split of these data and may include rows the model never saw; give the data "
                        "it was trained on (same --dataset, --split, --classes, --preprocess)"
                    )
                if recipe is not None:
                    no_lin = (
                        "the checkpoint's training rows could not be rebuilt from this data (its side-car records "
                        "no holdout split, or the rebuilt rows' fingerprint differs), so its training cannot be "
                        "re-run on the linearized model; give the data it was trained on"
                    )
            rows_info["kernel_rows"] = kern.info.get("holdout")
            rows_info["held_out_rows"] = test.info.get("holdout")
            recorded = (lm.metadata.get("metrics") or {}).get("steps_run") if isinstance(lm.metadata, dict) else None
            steps = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
            dtype = next((p.dtype for p in lm.module.parameters() if p.is_floating_point()), torch.float64)
            assert kern.y is not None and test.y is not None  # rows of ds, which has labels
            results.append(
                analyse_checkpoint(
                    task_trained,
                    task_init,
                    kern.X.to(dev),
                    kern.y.to(dev),
                    config,
                    label=label,
                    recipe=recipe,
                    train=None if train is None else (train[0].to(dev), train[1].to(dev)),
                    test=(test.X.to(dev), test.y.to(dev)),
                    steps=steps,
                    train_dtype=dtype,
                    reference=ref_info,
                    rows=rows_info,
                    no_linearized=no_lin,
                    device=dev,
                )
            )
            sources[label] = lm.source
            advance(1)
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0
    report = build_report(
        SCHEMA_CHECKPOINT,
        inputs={
            **request.data_inputs(),
            "models": request.model_sources(),
            "reference_checkpoint": reference_checkpoint,
            **config.to_dict(),
        },
        seeds={"base_seed": seed, "subset_seed": seed},
        device=dev,
        dtype="float64 (kernels, metrics); the linearized model trains in the checkpoint's dtype",
        timings=timings,
        results={"dataset": ds.info, "models": {r.label: {"source": sources[r.label], **r.to_dict()} for r in results}},
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


def _run_transformers(request: NtkDistanceRequest, progress: Progress, executor) -> Result:
    """The kernel regime of the built-in transformers across widths."""
    from rich.text import Text

    r = request._values()
    config = request.transformer_config()
    recipe = config.recipe
    assert r.n_train is not None and r.n_test is not None
    ntr, nte = r.n_train, r.n_test
    archs, width_list, n_seeds = config.archs, config.widths, len(config.seeds)
    dev = _device(request)
    t0 = time.perf_counter()
    (executor or ExecutorConfig()).check_available()
    try:
        train_ds, test_ds, data_recipe = _load_holdout(request, ntr, nte)  # the same rows every worker rebuilds
    except AuditError as exc:
        raise _holdout_error(exc, ntr, nte) from None
    ds = train_ds
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; the transformer sweep trains classifiers, so give labelled data")
    image_shape_of(ds.feature_shape, archs[0])  # flat data is refused before any training
    timings = {"load": time.perf_counter() - t0}
    plan = (
        f"ntk-distance --arch {','.join(archs)}: {ds.name}, {train_ds.n} train / {test_ds.n} held-out rows, widths "
        f"{','.join(map(str, width_list))} (heads fixed at {config.heads}), {n_seeds} seed(s), {recipe.optimizer} "
        f"lr {recipe.lr:g}, {recipe.total_steps(train_ds.n)} steps, {recipe.loss}; eNTK on "
        f"{min(train_ds.n, config.kernel_points)} training rows"
    )
    t1 = time.perf_counter()
    total = len(archs) * len(width_list) * n_seeds
    with progress("ntk-distance", total, "cells") as advance:
        result = run_transformer_sweep(
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            ds.n_classes,
            ds.feature_shape,
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
    report = build_report(
        SCHEMA_TRANSFORMERS,
        inputs={
            **request.data_inputs(),
            "n_train": ntr,
            "n_test": nte,
            **config.to_dict(),
            "execution": result.execution,
        },
        seeds={
            "base_seed": request.seed,
            "model_seeds": list(config.seeds),
            "holdout_seed": request.seed,
            "kernel_rows_seed": 0,
        },
        device=dev,
        dtype=f"float64 (kernels, metrics); training {config.train_dtype}",
        timings=timings,
        results=results,
        warnings=result.warnings,
        verdicts=result.verdicts(),
        request=request,
    )
    return Result(
        report,
        request,
        renderables=[Text(plan), *build_sweep_tables(result)],
        plot=lambda p: plot_sweep(result, p),
        png_name=PNG_TRANSFORMERS,
        failed_cells=list(result.failed_cells),
    )
