"""The resolved settings of one malleability run: :class:`MalleabilityConfig`.

Built once per run (:meth:`attnaudit.analyses.malleability.run.MalleabilityRequest.resolve`,
or directly from Python) and validated once, on construction: every error is a
:class:`~attnaudit.analyses.request.FieldError` on the setting's name, which is the request's
field name (the command line prints its flag). The objects derived from the settings -- the
influence settings, the attack settings, the training settings of each model -- are built from
it once per run and passed down to the cells.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import torch

from attnaudit.analyses.influence.influence import ESTIMATORS, InfluenceConfig, parse_damping
from attnaudit.core.precision import Precision
from attnaudit.analyses.malleability.attacks import (
    ATTACKS,
    NORMS,
    RANDOM_CONTROLS,
    TOKEN_ATTACKS,
    TOKEN_CONTROL,
    AttackConfig,
)
from attnaudit.analyses.request import FieldError, field_check, literal
from attnaudit.core.fit import Recipe
from attnaudit.core.task import Loss, NextTokenLoss
from attnaudit.core.training import LOSSES, TrainConfig
from attnaudit.errors import AuditError, is_int, is_real
from attnaudit.models.builtin import ARCHITECTURES, ModelSpec

PROTOCOLS = ("retrain", "static", "finetune")
OPTIMIZERS = ("gd", "sgd", "adam")  # of built-in models and of --protocol finetune
ATTN_CONTEXTS = ("perturbed", "clean")
REINIT_SEED_OFFSET = 1_000_003  # the reinit control's initialisation seed is seed + this
# (under protocol finetune: the reorder control's data-order seed is seed + this)

#: the loss of a saved causal language model (its checkpoint brings it; no option names it)
LM_LOSS = "next-token"

#: ``match_loss="auto"``: every model is trained to L*, the largest clean training loss any
#: model reaches within the step budget over the seeds, so they are compared at equal loss.
AUTO_MATCH = "auto"


#: what ``precision`` sets in a malleability run (the built-in models train in float64 at any
#: precision; accuracies, losses and statistics are reduced in float64)
MALLEABILITY_HEAVY = (
    "influence: per-sample gradients, projections, factor fits, Hessian-vector products",
    "a saved model's working copy: its attacks, fine-tuning and evaluation (float32 under bfloat16)",
)


def parse_per_model(text: Any, option: str) -> float | dict | None:
    """``"0.1"`` -> 0.1 (every model); ``"relu=10,attn=8"`` -> {"relu": 10.0, "attn": 8.0};
    ``"none"`` -> None (the option's off value). One-line AuditError naming ``option`` otherwise
    (the request turns it into a FieldError with :func:`~attnaudit.analyses.request.field_check`)."""
    if is_real(text):
        return float(text)
    if isinstance(text, str) and text.strip().lower() == "none":
        return None
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    example = f"give a number or model=value pairs such as {option} relu=10,attn=8"
    if not items:
        raise AuditError(f"{option} is empty; {example}")
    if len(items) == 1 and "=" not in items[0]:
        try:
            return float(items[0])
        except ValueError:
            raise AuditError(f"{option}: {items[0]!r} is not a number; {example}") from None
    out: dict = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise AuditError(f"{option}: {item!r} is not model=value; {example} (or one number for every model)")
        try:
            out[name] = float(value)
        except ValueError:
            raise AuditError(f"{option}: {name}={value.strip()!r} is not a number; {example}") from None
    if len(out) != len(items):
        raise AuditError(f"{option} names a model twice: {text}")
    return out


def loss_of(name: str) -> str | Loss:
    """The loss a Task is built with: a classification loss's name, or a language model's
    :class:`~attnaudit.core.task.NextTokenLoss` for :data:`LM_LOSS`."""
    return NextTokenLoss() if name == LM_LOSS else name


def loss_name(loss: str | Loss | None) -> str | None:
    """A saved model's recorded loss as the config names it (``next-token`` for a language model)."""
    return loss.name if isinstance(loss, Loss) else loss


def _listed(value: Any) -> tuple:
    return (value,) if isinstance(value, str) or is_real(value) else tuple(value)


def _shown(values: tuple) -> str:
    return literal(",".join(map(str, values)))


@dataclass(frozen=True)
class MalleabilityConfig:
    """Settings of one malleability audit; validated on construction, once.

    Names are the request's (``memory_budget`` in MiB, ``cache`` a folder). ``seeds`` are the
    seeds themselves (the request's ``seeds`` count from its ``seed``); ``top_k`` the first k,
    ``top_ks`` every k (a tuple given as ``top_k`` fills both); ``match_loss`` a number, {model:
    number}, ``"auto"`` (resolved by the run from budget runs) or None (fixed steps)."""

    models: tuple[str, ...] = ("relu", "attn")
    attacks: tuple[str, ...] = ("pgd", "fgsm", "mim", "sign")
    eps: tuple[float, ...] = (0.3,)
    damping: tuple[float | str, ...] = (1e-3,)  # absolute numbers, or "1e-3x": a multiple of lambda_max(H)
    seeds: tuple[int, ...] = (0, 1, 2)
    protocol: str = "retrain"
    top_k: int = 30  # the first (or only) k; a tuple of k is accepted and stored in top_ks
    estimator: str = "last-layer"
    norm: str = "linf"
    pgd_steps: int = 10
    step_size: float | None = None
    width: int = 64
    steps: int = 300
    lr: float | dict = 4.0  # a number, or {model: lr}
    loss: str = "mse"
    match_loss: float | dict | str | None = None
    attn_context: str = "perturbed"
    controls: bool = True
    parametrization: str = "ntk"
    attn_scaling: str = "rms"
    confidence: float = 0.95
    loss_gap_factor: float = 1.5
    max_flip_rate: float | None = None
    tracin_checkpoints: int = 10
    max_exact_params: int = 6000
    cg_tol: float = 1e-8
    cg_max_iter: int = 1000
    proj_dim: int = 512  # estimator projected
    proj_split: str = "layer"  # estimator projected: k per layer equal (LoGra) or by parameter count
    memory_budget: float = 2048.0  # MiB: the influence planner's bound (and the attacks' graphs')
    curvature: str = "auto"  # estimator kfac / ekfac / exact / projected
    cache: str | None = None  # a folder keeping fitted K-FAC factors
    params: str | None = None
    finetune_steps: int = 100
    finetune_optimizer: str = "adam"
    finetune_lr: float = 1e-4
    finetune_batch_size: int | None = 64
    saved_models: bool = False  # models are labels of saved models (any architecture), not built-in names
    optimizer: str = "gd"
    batch_size: int | None = None
    resample_data: bool = False
    top_ks: tuple[int, ...] | None = None  # every k the flip rate is reported for (default: (top_k,))
    store: str | None = None  # estimator projected: the gradient store's folder (analyses.influence.store)
    store_executor: str = "local"  # the store's missing rows built here or on Ray (the run's --executor ray)
    ray_address: str | None = None  # store_executor ray: a running cluster (None: a local Ray)
    store_workers: int | None = None  # store_executor ray: Ray tasks at once (the run's --jobs)
    precision: str = "float64"  # the dtype influence computes in (resolved: float64, float32 or bfloat16)
    precision_asked: str = "float64"  # as asked (auto, or a dtype)
    precision_reason: str = "asked"

    def __post_init__(self) -> None:
        self._normalise()
        self._check_choices()
        self._check_numbers()
        self._check_training()
        self._check_estimator()
        # the derived settings are built now, once: their own checks fire before any compute
        self.influence  # noqa: B018
        if self.protocol == "finetune":
            self.finetune_recipe(0)
        if self.optimizer != "gd" and not self.saved_models:
            self.recipe(self.models[0], 0)
        if not self.saved_models:
            self.model_spec(self.models[0], 1, 1)  # ModelSpec validates the names (plain strings here)

    # ------------------------------------------------------------------ validation
    def _normalise(self) -> None:
        """Lists as tuples (a single value accepted), top_k / top_ks, dampings parsed."""
        ks = _listed(self.top_ks if self.top_ks is not None else self.top_k)
        if not ks:
            raise FieldError("top_k", "{name} is empty; give at least one value")
        if not all(is_int(k) for k in ks):
            raise FieldError("top_k", "{name} values must be integers, got " + _shown(ks))
        object.__setattr__(self, "top_ks", tuple(int(k) for k in ks))
        object.__setattr__(self, "top_k", int(ks[0]))
        damping = tuple(field_check("damping", parse_damping, d) for d in _listed(self.damping))
        object.__setattr__(self, "damping", damping)
        for name in ("models", "attacks", "eps", "damping", "seeds", "top_ks"):
            value = _listed(getattr(self, name))
            object.__setattr__(self, name, value)
            field = "top_k" if name == "top_ks" else name
            if not value:
                raise FieldError(field, "{name} is empty; give at least one value")
            if len(set(value)) != len(value):
                raise FieldError(field, "{name} lists a value twice: " + _shown(value))

    def _check_choices(self) -> None:
        """Names that must be one of a list."""
        bad = [] if self.saved_models else [m for m in self.models if m not in ARCHITECTURES]
        if bad:
            raise FieldError(
                "models", "unknown model(s) " + literal(", ".join(bad)) + " in {name}; use " + ", ".join(ARCHITECTURES)
            )
        bad = [a for a in self.attacks if a not in ATTACKS]
        if bad:
            raise FieldError(
                "attacks", "unknown attack(s) " + literal(", ".join(bad)) + " in {name}; use " + ", ".join(ATTACKS)
            )
        for name, choices in (
            ("protocol", PROTOCOLS),
            ("attn_context", ATTN_CONTEXTS),
            ("norm", NORMS),
            ("loss", tuple(LOSSES) + ((LM_LOSS,) if self.saved_models else ())),
            ("optimizer", OPTIMIZERS),
            ("finetune_optimizer", OPTIMIZERS),
            ("estimator", tuple(ESTIMATORS)),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise FieldError(name, "unknown {name} " + literal(repr(value)) + "; use one of " + ", ".join(choices))

        if self.loss == LM_LOSS and self.protocol != "static":
            raise FieldError(
                "protocol",
                "{name} "
                + self.protocol
                + " trains the model again, and attnaudit's training recipes fit classifiers on labels, not a "
                "language model on next tokens; audit a language model as saved ({name} static)",
            )

    def _check_numbers(self) -> None:
        """Sizes, radii, shares and budgets."""
        if any(not (math.isfinite(e) and e > 0) for e in self.eps):
            raise FieldError("eps", "{name} values must be positive numbers, got " + _shown(self.eps))
        token = [a for a in self.attacks if a in TOKEN_ATTACKS]
        if token and any(e != round(e) or e < 1 for e in self.eps):
            raise FieldError(
                "eps",
                "with attacks " + token[0] + ", {name} is the number of tokens swapped per text: give integers >= 1, "
                "got " + literal(",".join(f"{e:g}" for e in self.eps)),
            )
        for name in ("top_k", "width", "pgd_steps", "tracin_checkpoints", "finetune_steps"):
            value = min(self.top_ks or ()) if name == "top_k" else getattr(self, name)
            if not is_int(value) or value < 1:
                raise FieldError(name, "{name} must be a positive integer, got " + literal(value))
        if not is_int(self.steps) or self.steps < 0:
            raise FieldError("steps", "{name} must be an integer >= 0, got " + literal(self.steps))
        for name in ("step_size", "memory_budget", "finetune_lr"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise FieldError(name, "{name} must be a positive number, got " + literal(value))
        if self.max_flip_rate is not None and not (0 <= self.max_flip_rate <= 1):
            raise FieldError("max_flip_rate", "{name} must be a share in [0, 1], got " + literal(self.max_flip_rate))
        if not (0 < self.confidence < 1):
            raise FieldError("confidence", "{name} must be in (0, 1), got " + literal(self.confidence))
        if not self.loss_gap_factor > 1:
            raise FieldError("loss_gap_factor", "{name} must be > 1, got " + literal(self.loss_gap_factor))
        for name in ("batch_size", "finetune_batch_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise FieldError(name, "{name} must be a positive integer, got " + literal(value))

    def _check_training(self) -> None:
        """Learning rates and loss targets per model, and the training recipe."""
        object.__setattr__(self, "lr", self._per_model("lr", self.lr, allow_none=False))
        if self.match_loss != AUTO_MATCH:
            object.__setattr__(self, "match_loss", self._per_model("match_loss", self.match_loss, allow_none=True))
        for arch in self.models:
            v = self.match_loss_for(arch)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise FieldError("match_loss", "{name} must be a positive training loss, got " + literal(v))
            lr = self.lr_for(arch)
            if not (math.isfinite(lr) and lr > 0):
                raise FieldError("lr", "{name} must be a positive number, got " + literal(lr))
        if self.batch_size is not None and self.optimizer == "gd":
            raise FieldError(
                "batch_size",
                "{name} does not apply to optimizer gd (full-batch gradient descent); use optimizer sgd or adam",
            )
        if self.resample_data and self.saved_models:
            raise FieldError(
                "resample_data", "{name} draws new training rows per seed, which a saved model was not trained on"
            )

    def _check_estimator(self) -> None:
        """The estimator against the models, the optimizer and the dampings."""
        if self.estimator == "tracin":
            if any(isinstance(d, str) for d in self.damping):
                raise FieldError(
                    "damping",
                    "relative {name} (a multiple of lambda_max) does not apply to estimator tracin (no Hessian)",
                )
            if len(self.damping) > 1:
                raise FieldError(
                    "damping", "{name} takes a single value with estimator tracin (TracIn uses no Hessian)"
                )
            if self.optimizer != "gd":
                raise FieldError("estimator", "{name} tracin weights checkpoints by GD steps; use it with optimizer gd")
        if self.estimator in ("kfac", "ekfac") and not self.saved_models:
            raise FieldError(
                "estimator",
                "{name} "
                + self.estimator
                + " uses the Kronecker factors of nn.Linear layers, and the built-in relu/attn "
                "nets hold their two weight matrices as bare parameters; use it with a checkpoint (a ViT or your own "
                "transformer), or use estimator exact, last-layer or cg here",
            )

    def _per_model(self, name: str, value: Any, allow_none: bool) -> float | dict | None:
        """A number (every model), or {model: number} with every key one of ``models``."""
        if value is None:
            if allow_none:
                return None
            raise FieldError(name, "{name} needs a value")
        if not isinstance(value, dict):
            if not is_real(value):
                raise FieldError(name, "{name}: " + literal(repr(value)) + " is not a number")
            return float(value)
        unknown = [k for k in value if k not in self.models]
        if unknown:
            raise FieldError(
                name,
                "{name} names model(s) "
                + literal(f"{', '.join(map(str, unknown))} not in models ({', '.join(self.models)})"),
            )
        missing = [m for m in self.models if m not in value]
        if missing and not allow_none:
            raise FieldError(
                name,
                "{name} gives no value for "
                + literal(", ".join(missing))
                + "; give every model (e.g. "
                + ",".join(f"{m}=1" for m in self.models)
                + ") or one number",
            )
        out = {}
        for k in self.models:
            if k in value:
                v = value[k]
                if not is_real(v):
                    raise FieldError(name, "{name}: " + literal(f"{k}={v!r}") + " is not a number")
                out[k] = float(v)
        return out

    # ------------------------------------------------------------------ derived settings
    @property
    def control(self) -> str:
        """Name of the training-randomness control: ``reinit`` (retrain from another
        initialisation) or, under ``finetune``, ``reorder`` (the same fine-tuning on clean
        data in another data order)."""
        return "reorder" if self.protocol == "finetune" else "reinit"

    @property
    def random_control(self) -> str | None:
        """The random-noise control the ``random`` floor of fgsm/pgd/mim comes from: ``sign`` when listed, else ``random``."""
        return next((a for a in RANDOM_CONTROLS if a in self.attacks), None)

    def random_control_for(self, attack: str) -> str | None:
        """The control of ``attack`` at the same budget without the gradient: ``swap`` for
        ``hotflip`` (random token swaps), else :attr:`random_control`; None when not listed."""
        if attack in TOKEN_ATTACKS:
            return TOKEN_CONTROL if TOKEN_CONTROL in self.attacks else None
        return self.random_control

    def lr_for(self, arch: str) -> float:
        """The learning rate model ``arch`` is trained with."""
        return float(self.lr[arch]) if isinstance(self.lr, dict) else float(self.lr)

    def match_loss_for(self, arch: str) -> float | None:
        """The match_loss target of model ``arch`` (None: train the whole budget; so is an
        unresolved ``auto``, whose budget runs the run resolves the target from)."""
        if self.match_loss == AUTO_MATCH:
            return None
        if isinstance(self.match_loss, dict):
            return self.match_loss.get(arch)
        assert not isinstance(self.match_loss, str)  # __post_init__ made it a number (or None)
        return self.match_loss

    def model_spec(self, arch: str, d: int, n_classes: int, seed: int = 0) -> ModelSpec:
        """The built-in model ``arch`` on ``d`` features and ``n_classes`` outputs, initialised from ``seed``."""
        return ModelSpec(
            arch,  # type: ignore[arg-type]  # ModelSpec validates the names
            d,
            self.width,
            n_classes,
            self.parametrization,  # type: ignore[arg-type]
            attn_scaling=self.attn_scaling,  # type: ignore[arg-type]
            seed=seed,
        )

    def train_config(self, arch: str, loss_tol: float | None) -> TrainConfig:
        """Full-batch GD settings of model ``arch``, trained until its loss is <= ``loss_tol`` (None: every step)."""
        every = max(1, self.steps // self.tracin_checkpoints) if self.estimator == "tracin" else None
        return TrainConfig(
            loss=self.loss, lr=self.lr_for(arch), steps=self.steps, loss_tol=loss_tol, checkpoint_every=every
        )

    def recipe(self, arch: str, order_seed: int) -> Recipe:
        """The :class:`attnaudit.core.fit.Recipe` of optimizer sgd/adam for model ``arch`` (data order from ``order_seed``)."""
        return Recipe(
            optimizer=self.optimizer,
            lr=self.lr_for(arch),
            batch_size=self.batch_size,
            epochs=None,
            steps=self.steps,
            loss=self.loss,
            seed=order_seed,
        )

    def finetune_recipe(self, seed: int) -> Recipe:
        """The :class:`attnaudit.core.fit.Recipe` of protocol finetune (data order from ``seed``)."""
        return Recipe(
            optimizer=self.finetune_optimizer,
            lr=self.finetune_lr,
            batch_size=None if self.finetune_optimizer == "gd" else self.finetune_batch_size,
            epochs=None,
            steps=self.finetune_steps,
            loss=self.loss,
            seed=seed,
        )

    @cached_property
    def influence(self) -> InfluenceConfig:
        """The influence settings every cell computes with (built once)."""
        return InfluenceConfig(
            params=self.params,
            estimator=self.estimator,
            damping=self.damping[0],
            max_exact_params=self.max_exact_params,
            cg_tol=self.cg_tol,
            cg_max_iter=self.cg_max_iter,
            proj_dim=self.proj_dim,
            proj_split=self.proj_split,
            memory_budget_mb=self.memory_budget,
            curvature=self.curvature,
            cache_dir=self.cache,
            dtype=self.precision,
            store=self.store,
            store_executor=self.store_executor,
            ray_address=self.ray_address,
            store_workers=self.store_workers,
        )

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype of a saved model's working copy (its attacks, fine-tuning and evaluation):
        float64 at float64, float32 below. Not bfloat16: an attack's steps and a fine-tuning's
        updates below bfloat16's 8-bit mantissa would vanish, changing what is measured."""
        return torch.float64 if self.precision == "float64" else torch.float32

    @property
    def precision_policy(self) -> Precision:
        """What ``precision`` resolved to, and what runs in it."""
        return Precision(self.precision_asked, self.precision, self.precision_reason, MALLEABILITY_HEAVY)

    def attack_configs(self, value_range: tuple[float, float] | None) -> dict[tuple[str, float, int], AttackConfig]:
        """Every attack of the run, keyed (attack, eps, seed), clipped to ``value_range`` (None: no clipping)."""
        lo, hi = (None, None) if value_range is None else (float(value_range[0]), float(value_range[1]))
        return {
            (method, eps, seed): AttackConfig(
                method=method,
                eps=eps,
                norm=self.norm,
                steps=self.pgd_steps,
                step_size=self.step_size,
                clip_min=lo,
                clip_max=hi,
                seed=seed,
                memory_mb=self.memory_budget,  # the influence planner's budget bounds the attacks' graphs too
            )
            for method in self.attacks
            for eps in self.eps
            for seed in self.seeds
        }

    def to_dict(self, resolution: dict | None = None) -> dict:
        """The settings as the report's ``config``; ``resolution``: how the run resolved
        ``match_loss="auto"`` (its target is then the match_loss of every model)."""
        out = asdict(self)
        if resolution is not None:
            out["match_loss"] = resolution["target"]
        out["match_loss_resolution"] = resolution
        if not self.saved_models:
            out["lr_per_model"] = {m: self.lr_for(m) for m in self.models}
            out["match_loss_per_model"] = {
                m: resolution["target"] if resolution is not None else self.match_loss_for(m) for m in self.models
            }
        out["random_control"] = self.random_control
        return out
