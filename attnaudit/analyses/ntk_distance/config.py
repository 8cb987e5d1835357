"""Configuration of ``ntk-distance``: the three analyses' settings and the one resolved configuration.

* :class:`NTKDistanceConfig` -- the 2-layer width sweep (:mod:`.widths`);
* :class:`TransformerSweepConfig` -- the width sweep of the built-in transformers (:mod:`.transformers`);
* :class:`CheckpointKernelConfig` -- the kernel movement of a trained model (:mod:`.checkpoint`);
* :class:`NtkDistanceSettings` -- what :meth:`NtkDistanceRequest.resolve
  <attnaudit.analyses.ntk_distance.run.NtkDistanceRequest.resolve>` builds once per request: the
  mode's configuration and the sizes of its data (:func:`sweep_settings`,
  :func:`transformer_settings`, :func:`checkpoint_settings`, from the request's values with the
  mode's defaults: :data:`PRESETS`, :data:`TRANSFORMER_DEFAULTS`, :data:`CHECKPOINT_DEFAULTS`).

Each configuration validates itself once, at construction; its errors are
:class:`~attnaudit.analyses.request.FieldError` naming its field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from attnaudit.analyses.request import FieldError, check_seeds, field_check, literal
from attnaudit.core.fit import Recipe
from attnaudit.core.precision import check_precision, resolve_precision
from attnaudit.core.recipes import MINI_BATCH, VIT_DEFAULTS
from attnaudit.core.ntk import PREDICTOR_MODES
from attnaudit.core.training import LOSSES
from attnaudit.errors import check_seed
from attnaudit.models.builtin import ARCHITECTURES, ATTN_SCALINGS, INITS, PARAMETRIZATIONS
from attnaudit.models.vit import VIT_ARCHITECTURES
from attnaudit.report.envelope import Record

SCHEMA = "attnaudit.ntk-distance/1"
SCHEMA_CHECKPOINT = "attnaudit.ntk-checkpoint/1"
SCHEMA_TRANSFORMERS = "attnaudit.ntk-transformers/1"
KERNEL_FORMS = ("full", "trace")
LINEARIZED_METHODS = ("auto", "kernel-gd", "train", "off")
DEFAULT_MEMORY_BYTES = 2 << 30  # the Jacobian budget of the kernel-movement analyses
TRAIN_DTYPES = ("float64", "float32")
MODEL_LABELS = {"relu": "2L-ReLU", "attn": "MLP-Attn"}  # the 2-layer models as the report names them


def _distinct(name: str, values: tuple, what: str) -> None:
    """Refuse a value listed twice in the list field ``name``."""
    if len(set(values)) != len(values):
        raise FieldError(name, f"{what} is listed twice in " + "{name}; list each once")


def _names(name: str, values: tuple, known: tuple[str, ...], what: str) -> list[str]:
    """Refuse an empty list field ``name`` of ``what`` (plural) or one holding a value twice; the
    values outside ``known`` (for the caller's message)."""
    if not values:
        raise FieldError(name, f"no {what} given; use " + "{name} " + ",".join(known))
    _distinct(name, values, "a value")
    return [v for v in values if v not in known]


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Refuse a value of field ``name`` outside ``allowed``."""
    if value not in allowed:
        raise FieldError(name, "unknown {name} " + literal(f"{value!r}; use one of {', '.join(allowed)}"))


@dataclass(frozen=True)
class NTKDistanceConfig:
    """Settings of the 2-layer width sweep; see :mod:`attnaudit.analyses.ntk_distance.widths`.

    ``lr=None`` applies the rule lr = lr_fraction * 2n / lambda_max(Theta_inf).
    ``float32_from_width``: train networks at least this wide in float32 (kernels,
    predictor and all metrics stay float64); None trains everything in ``train_dtype``.
    ``kernel_points``: rows of the training set used for the kernel metrics (None: all;
    otherwise a fixed random subset, drawn with seed 0).
    ``resample_data``: each seed draws its own training and held-out rows
    (:func:`~attnaudit.analyses.ntk_distance.planning.seed_recipe`); False: every seed uses the caller's rows.
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
        bad = _names("models", self.models, ARCHITECTURES, "models")
        if bad:
            raise FieldError("models", literal(f"unknown model(s) {bad}; use a subset of {','.join(ARCHITECTURES)}"))
        if not self.widths:
            raise FieldError("widths", "no widths given; use e.g. {name} 16,64,256")
        if any(int(w) != w or w < 1 for w in self.widths):
            raise FieldError("widths", "{name} must be positive integers, got " + literal(list(self.widths)))
        _distinct("widths", self.widths, "a width")
        _choice("loss", self.loss, LOSSES)
        _choice("parametrization", self.parametrization, PARAMETRIZATIONS)
        _choice("init", self.init, INITS)
        _choice("attn_scaling", self.attn_scaling, ATTN_SCALINGS)
        _choice("predictor", self.predictor, PREDICTOR_MODES)
        odd = [w for w in self.widths if w % 2]
        if self.init == "antisymmetric" and odd:
            raise FieldError(
                "widths",
                literal(f"antisymmetric init needs even widths, got {odd}") + "; use even {name} or init standard",
            )
        if not self.seeds:
            raise FieldError("seeds", "no seeds given; use {name} 1 or more")
        _distinct("seeds", self.seeds, "a seed")
        if self.steps < 1:
            raise FieldError("steps", "{name} must be >= 1, got " + literal(self.steps))
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise FieldError("lr", "{name} must be a positive number, got " + literal(self.lr))
        if not (0 < self.lr_fraction < 1):
            raise FieldError(
                "lr_fraction",
                "{name} must be in (0, 1) of the stable step 2n/lambda_max, got " + literal(self.lr_fraction),
            )
        if self.train_dtype not in TRAIN_DTYPES:
            raise FieldError(
                "train_dtype",
                "{name} " + literal(repr(self.train_dtype)) + " is not supported here; use float64 or float32",
            )
        if self.float32_from_width is not None and self.float32_from_width < 1:
            raise FieldError("float32_from_width", "{name} must be a positive width or None")
        if self.kernel_points is not None and self.kernel_points < 2:
            raise FieldError("kernel_points", "{name} must be >= 2, got " + literal(self.kernel_points))

    def dtype_for(self, width: int) -> str:
        """The training dtype of the width-``width`` networks."""
        if self.float32_from_width is not None and width >= self.float32_from_width:
            return "float32"
        return self.train_dtype

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("models", "widths", "seeds"):
            out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, data: dict) -> NTKDistanceConfig:
        """Inverse of :meth:`to_dict` (a cell's configuration on a worker)."""
        values: dict[str, Any] = {k: tuple(v) if k in ("models", "widths", "seeds") else v for k, v in data.items()}
        return cls(**values)


def _check_kernel_settings(kernel_points: Any, form: str, linearized: str) -> None:
    """Refuse bad kernel rows, kernel form or linearized method (of a checkpoint audit or a transformer sweep)."""
    if not isinstance(kernel_points, int) or kernel_points < 2:
        raise FieldError("kernel_points", "{name} must be an integer >= 2, got " + literal(repr(kernel_points)))
    if form not in KERNEL_FORMS:
        raise FieldError("form", "unknown kernel {name} " + literal(repr(form)) + "; use full or trace")
    _choice("linearized", linearized, LINEARIZED_METHODS)


def default_transformer_recipe() -> Recipe:
    """The ViT defaults of ``attnaudit train``: Adam, lr 1e-3, batch 64, 5 epochs, cross-entropy."""
    return Recipe(optimizer="adam", lr=1e-3, batch_size=64, epochs=5, loss="ce")


@dataclass(frozen=True)
class TransformerSweepConfig:
    """Width sweep of the built-in transformers. ``widths``: embedding dims; ``heads`` fixed
    (head dim = width / heads grows with width); ``recipe``: how every network is trained (its
    ``seed``, the mini-batch order, is set to each cell's seed); ``train_dtype``: float32 (as
    ``attnaudit train``) or float64; kernels and metrics are float64."""

    archs: tuple[str, ...] = ("vit", "vit-linear")
    widths: tuple[int, ...] = (16, 32, 64, 128)
    seeds: tuple[int, ...] = (0, 1)
    recipe: Recipe = field(default_factory=default_transformer_recipe)
    heads: int = 4
    depth: int = 2
    mlp_ratio: int = 2
    patch: int | None = None
    kernel_points: int = 128
    form: str = "full"
    linearized: str = "auto"
    train_dtype: str = "float32"
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    precision: str = "float64"  # the kernels' Jacobians (resolved: float64, float32 or bfloat16)

    def __post_init__(self) -> None:
        bad = _names("archs", self.archs, VIT_ARCHITECTURES, "architectures")
        if bad:
            raise FieldError(
                "archs",
                "unknown {name} "
                + literal(f"{','.join(bad)}; the transformer sweep takes {','.join(VIT_ARCHITECTURES)}")
                + " (the 2-layer nets are swept with models relu,attn)",
            )
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise FieldError(
                "widths", "{name} must be positive integers (embedding dims), got " + literal(list(self.widths))
            )
        _distinct("widths", self.widths, "a width")
        if not isinstance(self.heads, int) or self.heads < 1:
            raise FieldError("heads", "{name} must be a positive integer, got " + literal(repr(self.heads)))
        odd = [w for w in self.widths if w % self.heads]
        if odd:
            raise FieldError(
                "widths",
                "{name} "
                + literal(
                    f"{odd} are not multiples of the {self.heads} attention heads; use multiples of {self.heads}"
                ),
            )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise FieldError("seeds", "give at least one seed, each once ({name})")
        if not isinstance(self.recipe, Recipe):
            raise FieldError("recipe", "the sweep needs a training {name} (attnaudit.core.fit.Recipe)")
        _check_kernel_settings(self.kernel_points, self.form, self.linearized)
        if self.train_dtype not in TRAIN_DTYPES:
            raise FieldError(
                "train_dtype",
                "{name} " + literal(repr(self.train_dtype)) + " is not supported here; use float32 or float64",
            )

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["recipe"] = self.recipe.to_dict()
        for key in ("archs", "widths", "seeds"):
            out[key] = list(out[key])
        out["heads_rule"] = f"fixed at {self.heads} (head dim = width / {self.heads})"
        return out


@dataclass(frozen=True)
class CheckpointKernelConfig(Record):
    """``kernel_points``: training rows for the kernels; ``n_test``: held-out rows for the
    linearized distance; ``form``: full or trace kernel; ``linearized``: auto, kernel-gd,
    train or off; ``memory_bytes``: the Jacobian budget; ``seed``: of the rows drawn."""

    kernel_points: int = 256
    n_test: int = 500
    form: str = "full"
    linearized: str = "auto"
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    seed: int = 0
    precision: str = "auto"  # the kernels' Jacobians; auto is resolved on the loaded model

    def __post_init__(self) -> None:
        field_check("seed", check_seed, self.seed)
        check_precision(self.precision)
        if not isinstance(self.n_test, int) or self.n_test < 1:
            raise FieldError("n_test", "{name} must be a positive integer, got " + literal(repr(self.n_test)))
        _check_kernel_settings(self.kernel_points, self.form, self.linearized)
        if self.memory_bytes < 1:
            raise FieldError("memory_bytes", "the memory budget ({name}) must be positive")


AnalysisConfig = NTKDistanceConfig | TransformerSweepConfig | CheckpointKernelConfig


@dataclass(frozen=True)
class NtkDistanceSettings:
    """The one configuration an ``ntk-distance`` run works from, built (and validated) once per
    request by :meth:`~attnaudit.analyses.ntk_distance.run.NtkDistanceRequest.resolve`.

    ``analysis``: the mode's configuration; ``n_train``/``n_test``: the rows of the sweeps'
    holdout split (``n_train`` None for a checkpoint, whose rows come from its configuration);
    ``preset``: the 2-layer sweep's preset (None in the other modes).
    """

    analysis: AnalysisConfig
    n_train: int | None = None
    n_test: int | None = None
    preset: str | None = None

    @property
    def mode(self) -> str:
        """``widths`` (the 2-layer sweep), ``transformers`` or ``checkpoint``."""
        if isinstance(self.analysis, NTKDistanceConfig):
            return "widths"
        return "transformers" if isinstance(self.analysis, TransformerSweepConfig) else "checkpoint"


# --------------------------------------------------------------------------- the request's presets and mode defaults
# The presets of the 2-layer width sweep (field -> value; float32_from_width is the width from
# which networks train in float32 when no dtype is given). Sizes only (the data set comes from
# dataset). quick: a couple of minutes at most on 2 CPU cores on digits (d = 64). paper: the
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


# --------------------------------------------------------------------------- the configuration of each mode
# ``r``: a request's values with the mode's defaults filled in (NtkDistanceRequest.resolve)

# the analysis configurations' fields that the request names otherwise
CONFIG_FIELD_NAMES = {"archs": "arch", "train_dtype": "dtype"}
# the dtype spellings the request accepts beside float32 and float64
DTYPE_ALIASES = {"fp32": "float32", "fp64": "float64"}


def _configured(build: Callable[..., Any], **settings: Any) -> Any:
    """``build(**settings)``, an analysis configuration built from the request's values; its
    error about a field the request names otherwise names the request's field."""
    try:
        return build(**settings)
    except FieldError as exc:
        if exc.field not in CONFIG_FIELD_NAMES:
            raise
        raise FieldError(CONFIG_FIELD_NAMES[exc.field], exc.template) from None


def _check_sizes(r: Any) -> None:
    """The sizes of a width sweep: the seeds, at least 2 training and 1 held-out rows."""
    check_seeds(r.seed, r.seeds)
    if r.n_train < 2:
        raise FieldError("n_train", "{name} must be >= 2, got " + literal(r.n_train))
    if r.n_test < 1:
        raise FieldError("n_test", "{name} must be >= 1, got " + literal(r.n_test))


def sweep_settings(r: Any) -> NtkDistanceSettings:
    """The 2-layer sweep: its :class:`NTKDistanceConfig`; an explicit dtype trains every width in it,
    else the preset's widths from ``float32_from_width`` train in float32."""
    _check_sizes(r)
    if r.dtype is not None:
        train_dtype, f32_from = DTYPE_ALIASES.get(r.dtype, r.dtype), None
    else:
        train_dtype, f32_from = "float64", PRESETS[r.preset]["float32_from_width"]
    config = _configured(
        NTKDistanceConfig,
        models=tuple(r.models),
        widths=tuple(r.widths),
        seeds=tuple(r.seed + i for i in range(r.seeds)),
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
    return NtkDistanceSettings(config, n_train=r.n_train, n_test=r.n_test, preset=r.preset)


def transformer_settings(r: Any) -> NtkDistanceSettings:
    """The transformer sweep: its :class:`TransformerSweepConfig`, the recipe the ViT defaults of
    ``attnaudit train`` where not given."""
    _check_sizes(r)
    if r.lr is None:
        raise FieldError(
            "lr",
            f"optimizer {literal(r.optimizer)} needs {{name}}: the default learning "
            f"rate {TRANSFORMER_DEFAULTS['lr']:g} is the one for {TRANSFORMER_DEFAULTS['optimizer']}",
        )
    recipe = Recipe(
        optimizer=r.optimizer,
        lr=r.lr,
        batch_size=r.batch_size,
        epochs=r.epochs,
        steps=r.steps,
        loss=r.loss,
        seed=r.seed,
    )
    config = _configured(
        TransformerSweepConfig,
        archs=tuple(r.arch),
        widths=tuple(r.widths),
        seeds=tuple(r.seed + i for i in range(r.seeds)),
        recipe=recipe,
        kernel_points=r.kernel_points,
        linearized=r.linearized,
        train_dtype=DTYPE_ALIASES.get(r.dtype, r.dtype),
        precision=resolve_precision(r.precision, None).used,  # the built-in ViTs: auto is float64
        memory_bytes=memory_bytes(r),
    )
    return NtkDistanceSettings(config, n_train=r.n_train, n_test=r.n_test)


def memory_bytes(r: Any) -> int:
    """The request's ``memory_budget`` (MiB) in bytes, refused unless positive and finite."""
    budget = r.memory_budget
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget < float("inf"):
        raise FieldError("memory_budget", "{name} must be a positive number of MiB, got " + literal(repr(budget)))
    return int(budget * 2**20)


def checkpoint_settings(r: Any) -> NtkDistanceSettings:
    """A trained model's audit: its :class:`CheckpointKernelConfig`."""
    config = CheckpointKernelConfig(
        kernel_points=r.kernel_points,
        n_test=r.n_test,
        linearized=r.linearized,
        seed=r.seed,
        precision=r.precision,
        memory_bytes=memory_bytes(r),
    )
    return NtkDistanceSettings(config, n_test=r.n_test)


# mode (NtkDistanceRequest.mode) -> the function that builds its settings from the request's values
SETTINGS_BY_MODE: dict[str, Callable[[Any], NtkDistanceSettings]] = {
    "widths": sweep_settings,
    "transformers": transformer_settings,
    "checkpoint": checkpoint_settings,
}
