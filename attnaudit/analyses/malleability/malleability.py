"""Influence malleability: how stable are training-sample influence scores when an
adversary perturbs the training data?

Protocol (one *cell* = seed x model x attack x eps x damping):

1. build the model from the seed (same initialisation for everything that seed touches),
   train on clean data (full-batch GD, :mod:`attnaudit.core.training`), compute the influence
   of every training sample on the summed loss of a clean held-out test set
   (:mod:`attnaudit.analyses.influence.influence`; negative = helpful);
2. perturb the training data against the clean model (:mod:`attnaudit.analyses.malleability.attacks`);
3. ``retrain`` (default, the paper's): rebuild the model with the same initialisation,
   train on the perturbed data, recompute influence of the perturbed samples on the same
   clean test set. ``static``: keep the clean model and recompute influence with the
   perturbed samples (Hessian and gradients on the perturbed training set) -- how one
   audits a fixed checkpoint;
4. compare clean and perturbed influence, sample by sample (sample i stays sample i):

   * flip rate: among the ``top_k`` samples by clean |influence|, the share whose
     influence changes sign (clean x perturbed < 0: helpful <-> harmful; an exact zero is
     not a flip);
   * Spearman rank correlation of the full clean and perturbed influence vectors;
   * top-k overlap: |top-k(clean) n top-k(perturbed)| / k, both by |influence|.

Controls, the floors every adversarial flip rate is read against: the random-noise control
of the same radius (``sign``, +-eps on every coordinate, by default; ``random``, uniform
noise in the ball, when ``sign`` is not in ``--attacks``; reported as ``floors.random``
with the attack it came from) and ``reinit`` (clean data, retrained from a
different initialisation: the flip rate training randomness alone produces). ``none`` is
a pipeline check (deterministic GD on the same data: flip rate 0).

Seeds: each seed fixes the initialisation, the attack's randomness and (``sgd``/``adam``)
the data order; the data split is fixed (chosen once by the caller), unless
``resample_data``: then seed s draws its own train/held-out split (the caller's
:class:`~attnaudit.data.HoldoutRecipe` with its seed replaced by s), so the intervals
include the choice of training rows.

Training (built-in models): ``optimizer`` ``gd`` (default; full-batch gradient descent,
:func:`attnaudit.core.training.train`), or ``sgd``/``adam`` through :func:`attnaudit.core.fit.fit`
(``batch_size`` rows per step, None = full batch; data order from the seed; the reinit
control also draws a new data order). ``lr`` and ``match_loss`` may be given per model.

Untrained models: a model whose mean clean training accuracy is below
1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n_train)) (chance plus a few points, or two binomial
standard errors) is flagged ``untrained`` and every verdict about it makes no claim. Over seeds we report mean, sample standard deviation
and Student's t interval (shares such as the flip rate: the variance floored at the binomial
variance of top-k items, :func:`attnaudit.core.stats.proportion_interval`). Model ratios (each
model over the first of ``models``) get Fieller's interval pairing the same seeds. A seed
whose comparison ran on bitwise the inputs of an earlier seed (a deterministic attack on a
saved model's fixed rows) is a copy, not a replicate: it is counted once
(:func:`distinct_replicates`), and its influence runs are not computed again.

Cost: seeds x models x (1 + reinit + eps x attacks) trainings and influence computations;
see :func:`progress_total`. Memory: the data, a handful of models, and the influence
estimator's own need (recorded in the diagnostics).
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from attnaudit.analyses.malleability.attacks import (
    ADVERSARIAL,
    ATTACKS,
    NORMS,
    RANDOM_CONTROLS,
    TOKEN_ATTACKS,
    TOKEN_CONTROL,
    AttackConfig,
    perturb,
)
from attnaudit.errors import AuditError
from attnaudit.core.stats import mean_interval, proportion_interval, ratio_interval, t_quantile
from attnaudit.analyses.influence.influence import (
    ESTIMATORS,
    SIGN_CONVENTION,
    InfluenceConfig,
    check_exact_budget,
    damping_label,
    influence_memory,
    parse_damping,
    influence_sweep,
    tracin_weights,
)
from attnaudit.core.task import Inputs, Task
from attnaudit.models.hf import HFEmbeddingShiftClassifier, HFSequenceClassifier, embedding_shift_rows
from attnaudit.models.builtin import ARCHITECTURES, ModelSpec, TwoLayerNet, build_model
from attnaudit.core.training import LOSSES, TrainConfig, TrainResult, accuracy, loss_value, train
from attnaudit.core.task import select_parameter_names
from attnaudit.analyses.influence.kfac import (
    capture_entries_per_row,
    gradient_entries_per_row,
    kfac_memory_bytes,
    linear_blocks,
    linear_modules,
    tensors_sha256,
)
from attnaudit.core.engine import Engine
from attnaudit.core.fit import fit as fit_recipe
from attnaudit.core.training import require_nonzero_inputs
from attnaudit.runtime.sweep import CellTask, ExecutorConfig, cached, clear_cache, run_cells
from attnaudit.data import data_fingerprint
from attnaudit.data import HoldoutRecipe
from attnaudit.core.fit import Recipe

if TYPE_CHECKING:
    from attnaudit.data import HoldoutRecipe
    from attnaudit.runtime.sweep import ExecutorConfig

SCHEMA = "attnaudit.malleability/1"
PROTOCOLS = ("retrain", "static", "finetune")
FINETUNE_OPTIMIZERS = ("gd", "sgd", "adam")
OPTIMIZERS = ("gd", "sgd", "adam")
ATTN_CONTEXTS = ("perturbed", "clean")
REINIT_SEED_OFFSET = 1_000_003  # the reinit control's initialisation seed is seed + this
# (under --protocol finetune: the reorder control's data-order seed is seed + this)

#: ``--match-loss auto``: every model is trained to L*, the largest clean training loss any
#: model reaches within the step budget over the seeds, so they are compared at equal loss.
AUTO_MATCH = "auto"

# The presets live with the request (attnaudit.analyses.malleability.run.PRESETS).


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class MalleabilityConfig:
    """Settings of one malleability audit; validated on construction."""

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
    match_loss: float | dict | str | None = None  # a number, {model: loss}, or "auto" (resolved before training)
    attn_context: str = "perturbed"
    controls: bool = True
    parametrization: str = "ntk"
    attn_scaling: str = "rms"
    confidence: float = 0.95
    loss_gap_factor: float = 1.5
    max_flip_rate: float | None = None
    tracin_checkpoints: int = 10
    #: set by :func:`run_malleability` when ``match_loss`` was ``auto``: the rule, the budget
    #: runs' clean training losses and the target L* every model was then trained to
    match_loss_resolution: dict | None = None
    max_exact_params: int = 6000
    cg_tol: float = 1e-8
    cg_max_iter: int = 1000
    proj_dim: int = 512  # --estimator projected
    proj_split: str = "layer"  # --estimator projected: k per layer equal (LoGra) or by parameter count
    memory_budget_mb: float = 2048.0  # --memory-budget: the influence planner's bound
    curvature: str = "auto"  # --estimator kfac / ekfac
    cache_dir: str | None = None  # --cache: fitted K-FAC factors kept on disk
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

    @property
    def control(self) -> str:
        """Name of the training-randomness control: ``reinit`` (retrain from another
        initialisation) or, under ``finetune``, ``reorder`` (the same fine-tuning on clean
        data in another data order)."""
        return "reorder" if self.protocol == "finetune" else "reinit"

    def __post_init__(self) -> None:
        ks = self.top_ks if self.top_ks is not None else self.top_k
        ks = (ks,) if isinstance(ks, (int, np.integer)) else tuple(ks)
        if not ks:
            raise AuditError("--top-k is empty; give at least one value")
        if any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) for k in ks):
            raise AuditError(f"--top-k values must be integers, got {','.join(map(str, ks))}")
        if len(set(ks)) != len(ks):
            raise AuditError(f"--top-k lists a value twice: {','.join(map(str, ks))}")
        top_ks = tuple(int(k) for k in ks)
        object.__setattr__(self, "top_ks", top_ks)
        object.__setattr__(self, "top_k", int(ks[0]))
        if isinstance(self.damping, (str, int, float)):
            object.__setattr__(self, "damping", (self.damping,))
        object.__setattr__(self, "damping", tuple(parse_damping(d) for d in self.damping))
        for name in ("models", "attacks", "eps", "damping", "seeds"):
            value = getattr(self, name)
            if isinstance(value, (str, int, float)):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
            if not getattr(self, name):
                raise AuditError(f"--{name} is empty; give at least one value")
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise AuditError(f"--{name} lists a value twice: {','.join(map(str, getattr(self, name)))}")
        bad = [] if self.saved_models else [m for m in self.models if m not in ARCHITECTURES]
        if bad:
            raise AuditError(f"unknown model(s) {', '.join(bad)} in --models; use {', '.join(ARCHITECTURES)}")
        bad = [a for a in self.attacks if a not in ATTACKS]
        if bad:
            raise AuditError(f"unknown attack(s) {', '.join(bad)} in --attacks; use {', '.join(ATTACKS)}")
        if any(not (math.isfinite(e) and e > 0) for e in self.eps):
            raise AuditError(f"--eps values must be positive numbers, got {','.join(map(str, self.eps))}")
        token = [a for a in self.attacks if a in TOKEN_ATTACKS]
        if token and any(e != round(e) or e < 1 for e in self.eps):
            raise AuditError(
                f"with --attacks {token[0]}, --eps is the number of tokens swapped per text: give "
                f"integers >= 1, got {','.join(f'{e:g}' for e in self.eps)}"
            )
        if self.estimator == "tracin" and any(isinstance(d, str) for d in self.damping):
            raise AuditError(
                "relative --damping (a multiple of lambda_max) does not apply to --estimator tracin (no Hessian)"
            )
        if self.estimator not in ESTIMATORS:
            raise AuditError(f"unknown --estimator {self.estimator!r}; use one of {', '.join(ESTIMATORS)}")
        if self.estimator in ("kfac", "ekfac") and not self.saved_models:
            raise AuditError(
                f"--estimator {self.estimator} uses the Kronecker factors of nn.Linear layers, and the built-in relu/attn "
                "nets hold their two weight matrices as bare parameters; use it with --checkpoint (a ViT or your own "
                "transformer), or use --estimator exact, last-layer or cg here"
            )
        if self.estimator == "tracin" and len(self.damping) > 1:
            raise AuditError("--damping takes a single value with --estimator tracin (TracIn uses no Hessian)")
        if self.protocol not in PROTOCOLS:
            raise AuditError(f"unknown --protocol {self.protocol!r}; use retrain, static or finetune")
        if self.protocol == "finetune":
            self.finetune_recipe(0)  # validates steps, optimizer, lr and batch size now
        if self.attn_context not in ATTN_CONTEXTS:
            raise AuditError(f"unknown --attn-context {self.attn_context!r}; use perturbed or clean")
        if self.norm not in NORMS:
            raise AuditError(f"unknown --norm {self.norm!r}; use linf or l2")
        if self.loss not in LOSSES:
            raise AuditError(f"unknown --loss {self.loss!r}; use mse or ce")
        if min(top_ks) < 1:
            raise AuditError(f"--top-k must be >= 1, got {min(top_ks)}")
        if self.width < 1:
            raise AuditError(f"--width must be >= 1, got {self.width}")
        object.__setattr__(self, "lr", self._per_model("lr", "--lr", self.lr, allow_none=False))
        if self.match_loss != AUTO_MATCH:
            object.__setattr__(
                self, "match_loss", self._per_model("match_loss", "--match-loss", self.match_loss, allow_none=True)
            )
        for arch in self.models:
            v = self.match_loss_for(arch)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise AuditError(f"--match-loss must be a positive training loss, got {v}")
            lr = self.lr_for(arch)
            if not (math.isfinite(lr) and lr > 0):
                raise AuditError(f"--lr must be a positive number, got {lr}")
        if self.optimizer not in OPTIMIZERS:
            raise AuditError(f"unknown --optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.optimizer != "gd" and self.estimator == "tracin":
            raise AuditError("--estimator tracin weights checkpoints by GD steps; use it with --optimizer gd")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool)
            or not isinstance(self.batch_size, (int, np.integer))
            or self.batch_size < 1
        ):
            raise AuditError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if self.batch_size is not None and self.optimizer == "gd":
            raise AuditError(
                "--batch-size does not apply to --optimizer gd (full-batch gradient descent); use --optimizer sgd or adam"
            )
        if self.resample_data and self.saved_models:
            raise AuditError(
                "--resample-data draws new training rows per seed, which a saved model was not trained on; drop it"
            )
        if self.optimizer != "gd" and not self.saved_models:
            self.recipe(self.models[0], 0)  # validates the recipe now
        if self.max_flip_rate is not None and not (0 <= self.max_flip_rate <= 1):
            raise AuditError(f"--max-flip-rate must be a share in [0, 1], got {self.max_flip_rate}")
        if not (0 < self.confidence < 1):
            raise AuditError(f"confidence level must be in (0, 1), got {self.confidence}")
        if not self.loss_gap_factor > 1:
            raise AuditError(f"loss gap factor must be > 1, got {self.loss_gap_factor}")
        if self.tracin_checkpoints < 1:
            raise AuditError("tracin checkpoints must be >= 1")
        # Build the per-step configs once, so their own checks fire now, before any compute.
        self.train_config()
        self.influence_config()
        for a in self.attacks:
            self.attack_config(a, self.eps[0], 0, None)
        if not self.saved_models:
            ModelSpec(  # ModelSpec validates the names (the config holds plain strings)
                self.models[0],  # type: ignore[arg-type]
                1,
                self.width,
                1,
                self.parametrization,  # type: ignore[arg-type]
                attn_scaling=self.attn_scaling,  # type: ignore[arg-type]
            )

    def _per_model(self, name: str, option: str, value, allow_none: bool):
        """A number (every model), or {model: number} with every key one of ``models``."""
        if value is None:
            if allow_none:
                return None
            raise AuditError(f"{option} needs a value")
        if isinstance(value, dict):
            unknown = [k for k in value if k not in self.models]
            if unknown:
                raise AuditError(
                    f"{option} names model(s) {', '.join(map(str, unknown))} not in --models ({', '.join(self.models)})"
                )
            missing = [m for m in self.models if m not in value]
            if missing and not allow_none:
                raise AuditError(
                    f"{option} gives no value for {', '.join(missing)}; give every model (e.g. {option} "
                    + ",".join(f"{m}=1" for m in self.models)
                    + ") or one number"
                )
            out = {}
            for k in self.models:
                if k in value:
                    v = value[k]
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        raise AuditError(f"{option}: {k}={v!r} is not a number")
                    out[k] = float(v)
            return out
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AuditError(f"{option}: {value!r} is not a number")
        return float(value)

    def lr_for(self, arch: str) -> float:
        """The learning rate model ``arch`` is trained with."""
        return float(self.lr[arch]) if isinstance(self.lr, dict) else float(self.lr)

    def match_loss_for(self, arch: str) -> float | None:
        """The --match-loss target of model ``arch`` (None: train the whole budget; so is an
        unresolved ``auto``, whose budget runs are what :func:`_resolve_auto_match` reads)."""
        if self.match_loss == AUTO_MATCH:
            return None
        if isinstance(self.match_loss, dict):
            return self.match_loss.get(arch)
        assert not isinstance(self.match_loss, str)  # __post_init__ made it a number (or None)
        return self.match_loss

    def train_config(self, arch: str | None = None) -> TrainConfig:
        """Full-batch GD settings of model ``arch`` (default: the first model)."""
        arch = self.models[0] if arch is None else arch
        every = max(1, self.steps // self.tracin_checkpoints) if self.estimator == "tracin" else None
        return TrainConfig(
            loss=self.loss,
            lr=self.lr_for(arch),
            steps=self.steps,
            loss_tol=self.match_loss_for(arch),
            checkpoint_every=every,
        )

    def recipe(self, arch: str, order_seed: int):
        """The :class:`attnaudit.core.fit.Recipe` of ``--optimizer sgd|adam`` for model ``arch`` (data order from ``order_seed``)."""

        return Recipe(
            optimizer=self.optimizer,
            lr=self.lr_for(arch),
            batch_size=self.batch_size,
            epochs=None,
            steps=self.steps,
            loss=self.loss,
            seed=order_seed,
        )

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

    def finetune_recipe(self, seed: int):
        """The :class:`attnaudit.core.fit.Recipe` of ``--protocol finetune`` (data order from ``seed``)."""

        if not isinstance(self.finetune_steps, int) or self.finetune_steps < 1:
            raise AuditError(f"--finetune-steps must be a positive integer, got {self.finetune_steps}")
        if self.finetune_optimizer not in FINETUNE_OPTIMIZERS:
            raise AuditError(
                f"unknown --finetune-optimizer {self.finetune_optimizer!r}; use one of {', '.join(FINETUNE_OPTIMIZERS)}"
            )
        return Recipe(
            optimizer=self.finetune_optimizer,
            lr=self.finetune_lr,
            batch_size=None if self.finetune_optimizer == "gd" else self.finetune_batch_size,
            epochs=None,
            steps=self.finetune_steps,
            loss=self.loss,
            seed=seed,
        )

    def influence_config(self) -> InfluenceConfig:
        return InfluenceConfig(
            params=self.params,
            estimator=self.estimator,
            damping=self.damping[0],
            max_exact_params=self.max_exact_params,
            cg_tol=self.cg_tol,
            cg_max_iter=self.cg_max_iter,
            proj_dim=self.proj_dim,
            proj_split=self.proj_split,
            memory_budget_mb=self.memory_budget_mb,
            curvature=self.curvature,
            cache_dir=self.cache_dir,
        )

    def attack_config(self, method: str, eps: float, seed: int, value_range) -> AttackConfig:
        lo, hi = (None, None) if value_range is None else (float(value_range[0]), float(value_range[1]))
        return AttackConfig(
            method=method,
            eps=eps,
            norm=self.norm,
            steps=self.pgd_steps,
            step_size=self.step_size,
            clip_min=lo,
            clip_max=hi,
            seed=seed,
            memory_mb=self.memory_budget_mb,  # the influence planner's budget bounds the attacks' graphs too
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.saved_models:
            out["lr_per_model"] = {m: self.lr_for(m) for m in self.models}
            out["match_loss_per_model"] = {m: self.match_loss_for(m) for m in self.models}
        out["random_control"] = self.random_control
        return out


def parse_match_loss(text) -> float | dict | str | None:
    """``--match-loss``: a number, model=value pairs, ``auto`` (every model trained to the
    largest loss any of them reaches in the step budget) or ``none`` (fixed steps)."""
    if isinstance(text, str) and text.strip().lower() in (AUTO_MATCH, "none"):
        return AUTO_MATCH if text.strip().lower() == AUTO_MATCH else None
    return parse_per_model(text, "--match-loss")


def parse_per_model(text, option: str) -> float | dict | None:
    """``"0.1"`` -> 0.1 (every model); ``"relu=10,attn=8"`` -> {"relu": 10.0, "attn": 8.0};
    ``"none"`` -> None (the option's off value). One-line AuditError otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if isinstance(text, str) and text.strip().lower() == "none":
        return None
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise AuditError(f"{option} is empty; give a number or model=value pairs such as {option} relu=10,attn=8")
    if len(items) == 1 and "=" not in items[0]:
        try:
            return float(items[0])
        except ValueError:
            raise AuditError(
                f"{option}: {items[0]!r} is not a number; give a number or model=value pairs such as {option} relu=10,attn=8"
            ) from None
    out: dict = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise AuditError(
                f"{option}: {item!r} is not model=value; give e.g. {option} relu=10,attn=8 (or one number for every model)"
            )
        try:
            out[name] = float(value)
        except ValueError:
            raise AuditError(
                f"{option}: {name}={value.strip()!r} is not a number; give e.g. {option} relu=10,attn=8"
            ) from None
    if len(out) != len(items):
        raise AuditError(f"{option} names a model twice: {text}")
    return out


def untrained_threshold(n_classes: int, n_train: int) -> tuple[float, float]:
    """(chance, threshold): a model whose training accuracy is below the threshold
    1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n_train)) is called untrained (within a few points,
    or two binomial standard errors, of chance)."""
    chance = 1.0 / n_classes
    return chance, chance + max(0.05, 2.0 * math.sqrt(chance * (1.0 - chance) / max(n_train, 1)))


def influence_memory_estimate(
    config: MalleabilityConfig,
    d: int,
    n_classes: int,
    n_train: int,
    n_test: int,
    models: Mapping[str, nn.Module | Task] | None = None,
    probe: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> dict:
    """Tracked parameters and peak bytes of one influence computation (before any compute).

    The tracked parameters are resolved on the models themselves: ``models`` when given
    (saved checkpoints), else the :class:`~attnaudit.models.builtin.TwoLayerNet` each architecture
    in ``config.models`` builds (its parameters do not depend on the data: MLP-Attn's
    context is a buffer, a placeholder here), with the estimator's parameter selector
    (``head`` for last-layer, ``all`` otherwise). The largest count sizes the estimate.
    Raises :class:`AuditError` (:func:`attnaudit.analyses.influence.influence.check_exact_budget`) when
    ``exact``/``last-layer`` would exceed the parameter budget, so an impossible run
    fails before the first training. ``rows``: the training rows (default ``probe``), whose
    longest K-FAC's capture per row is measured on.
    """

    icfg = config.influence_config()
    tracked: dict[str, dict] = {}
    for arch in config.models:
        if models is not None and arch in models:
            model = models[arch]
        else:
            spec = ModelSpec(  # ModelSpec validates the names (the config holds plain strings)
                arch,  # type: ignore[arg-type]
                d,
                config.width,
                n_classes,
                config.parametrization,  # type: ignore[arg-type]
                attn_scaling=config.attn_scaling,  # type: ignore[arg-type]
            )
            placeholder = torch.zeros(d, d, dtype=torch.float64) if arch == "attn" else None
            model = TwoLayerNet(spec, context=placeholder)
        task = model if isinstance(model, Task) else None
        if isinstance(model, Task):
            selector = icfg.selector(model)
            inputs, model = model.inputs, model.module
        else:
            selector, inputs = icfg.tracked, None
        names = select_parameter_names(model, selector, probe, inputs)
        named = dict(model.named_parameters())
        factor_bytes = 0
        count = int(sum(named[n].numel() for n in names))
        per_row = count  # per-sample gradient entries a row holds at once
        if config.estimator in ("kfac", "ekfac"):
            blocks = linear_modules(model, names)[0]
            factor_bytes = kfac_memory_bytes(blocks, keep_covariances=config.cache_dir is not None)
            per_row = gradient_entries_per_row(model, blocks) or count
            rows = probe if rows is None else rows
            if task is not None and rows is not None and blocks:
                # what the fit and the scores capture per row over every covered layer, as the
                # run's planner counts it (the engine in the model's own dtype: shapes only)
                engine = Engine(task, names=names)
                per_row += capture_entries_per_row(engine, linear_blocks(engine)[0], rows)
                del engine
        tracked[arch] = {"names": names, "count": count, "factor_bytes": factor_bytes, "per_row": per_row}
    p = max(v["count"] for v in tracked.values())
    check_exact_budget(config.estimator, p, config.max_exact_params)
    per_row = max(v["per_row"] for v in tracked.values())

    def estimate(chunk: int) -> dict:
        return influence_memory(
            config.estimator,
            p,
            n_train,
            n_test,
            False,
            chunk,
            n_dampings=len(config.damping),
            factor_bytes=max(v["factor_bytes"] for v in tracked.values()),
            gradient_params=per_row,
        )

    mem = estimate(icfg.chunk_size)
    budget = icfg.memory_budget_mb * 2**20
    if mem["total"] > budget:  # the planner lowers the chunk to the budget (two gradient blocks a row)
        fixed = mem["total"] - mem["gradient_chunk"] - mem["activations"]
        fitted = int((budget - fixed) // (2 * 8 * max(per_row, 1)))
        if fitted >= 1:
            mem = estimate(min(icfg.chunk_size, fitted))
    return {
        "tracked_parameters": p,
        "tracked_parameter_names": {k: v["names"] for k, v in tracked.items()},
        "bytes": mem,
    }


def progress_total(config: MalleabilityConfig) -> int:
    """Units of work (one training + influence each) that :func:`run_malleability` reports."""
    per_model = 1 + int(config.controls)
    per_model += sum(1 if a == "none" else len(config.eps) for a in config.attacks)
    return len(config.seeds) * len(config.models) * per_model


# --------------------------------------------------------------------------- stability metrics
def top_k_indices(values, k: int) -> np.ndarray:
    """Indices of the k largest |values| (ties broken by index, so the choice is reproducible)."""
    v = np.abs(np.asarray(values, dtype=np.float64))
    return np.argsort(-v, kind="stable")[: min(k, v.size)]


def flip_rate(clean, perturbed, top_k: int) -> float:
    """Share of the top-k samples by clean |influence| whose influence changes sign."""
    c, p = np.asarray(clean, dtype=np.float64), np.asarray(perturbed, dtype=np.float64)
    if c.shape != p.shape:
        raise AuditError(f"clean and perturbed influence differ in length ({c.size} vs {p.size})")
    idx = top_k_indices(c, top_k)
    return float(np.mean(c[idx] * p[idx] < 0)) if idx.size else float("nan")


def stability(clean, perturbed, top_k: int) -> dict:
    """Flip rate, Spearman correlation and top-k overlap of two influence vectors."""
    from scipy.stats import spearmanr

    c, p = np.asarray(clean, dtype=np.float64), np.asarray(perturbed, dtype=np.float64)
    k = min(top_k, c.size)
    idx_c, idx_p = top_k_indices(c, k), top_k_indices(p, k)
    if np.ptp(c) == 0 or np.ptp(p) == 0:
        rho = None  # a constant vector has no ranking
    else:
        rho = float(spearmanr(c, p).statistic)
    return {
        "flip_rate": flip_rate(c, p, k),
        "n_flipped": int(np.sum(c[idx_c] * p[idx_c] < 0)),
        "top_k": int(k),
        "spearman": rho,
        "top_k_overlap": len(set(idx_c.tolist()) & set(idx_p.tolist())) / k if k else float("nan"),
        "clean_helpful_in_top_k": int(np.sum(c[idx_c] < 0)),
    }


def stability_by_k(clean, perturbed, top_ks) -> dict:
    """:func:`stability` at the first k (its keys), plus ``by_top_k``: flip rate, flips and
    overlap at every k."""
    first = stability(clean, perturbed, top_ks[0])
    by = []
    for k in top_ks:
        st = first if k == top_ks[0] else stability(clean, perturbed, k)
        by.append(
            {key: st[key] for key in ("top_k", "flip_rate", "n_flipped", "top_k_overlap", "clean_helpful_in_top_k")}
        )
    return {**first, "by_top_k": by}


def summarize(values, confidence: float = 0.95, trials: int | None = None) -> dict:
    """Mean, sample std and interval of per-seed values (None = undefined).

    ``trials``: the values are shares of that many items (a flip rate over the top-k, a
    top-k overlap): Student's t over seeds with the binomial variance floor
    (:func:`attnaudit.core.stats.proportion_interval`); otherwise the plain Student-t interval.
    One seed gives no interval (both ends None)."""
    v = [float(x) for x in values if x is not None and np.isfinite(x)]
    iv = proportion_interval(v, trials, confidence) if trials else mean_interval(v, confidence)
    if not v:
        return {
            "mean": None,
            "std": None,
            "ci_low": None,
            "ci_high": None,
            "n": 0,
            "values": list(values),
            "interval_method": iv.method,
        }
    return {
        "mean": float(np.mean(v)),
        "std": float(np.std(v, ddof=1)) if len(v) > 1 else None,
        "ci_low": iv.low,
        "ci_high": iv.high,
        "n": len(v),
        "values": v,
        "interval_method": iv.method,
    }


def ratio_summary(numerator, denominator, confidence: float = 0.95, trials: tuple[int, int] | None = None) -> dict:
    """Ratio of mean flip rates (paired by seed) with Fieller's interval over seeds.

    ``ratio`` is None when the denominator's mean is 0. ``ci_high`` None means the interval
    is unbounded above (the denominator is not clearly above 0): every seed is kept, none
    dropped. ``trials``: top-k of numerator and denominator (binomial variance floors).
    See :func:`attnaudit.core.stats.ratio_interval`."""
    a, b = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    iv = ratio_interval(a.tolist(), b.tolist(), confidence, trials=trials)
    return {
        "ratio": iv.estimate,
        "ci_low": iv.low,
        "ci_high": iv.high,
        "unbounded_high": bool(a.size > 1 and iv.high is None),
        "interval_method": iv.method,
        "n": int(a.size),
        "numerator_values": a.tolist(),
        "denominator_values": b.tolist(),
        "note": iv.note,
    }


# --------------------------------------------------------------------------- result
@dataclass
class MalleabilityResult:
    """Everything measured; ``to_dict`` is the JSON ``results`` block (schema malleability/1)."""

    config: MalleabilityConfig
    runs: list[dict]
    controls: list[dict]
    training: list[dict]
    attacks: list[dict]
    summary: list[dict]
    ratios: list[dict]
    sensitivity: dict
    influence_diagnostics: list[dict]
    exceeded: list[dict]
    warnings: list[str]
    verdicts: list[str]
    timings: dict
    n_train: int
    n_test: int
    influence_memory: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)  # for the figure, not serialised
    failed_cells: list = field(default_factory=list)
    execution: dict = field(default_factory=dict)  # executor, cells, resumed (how it ran; not a result)
    model_status: list = field(default_factory=list)  # per model: chance, threshold, train accuracy, untrained
    splits: list = field(default_factory=list)  # per seed: the rows it trained and was measured on
    edits: list = field(default_factory=list)  # token attacks: each perturbed text's swaps (not serialised)

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "failed_cells": self.failed_cells,
            "sign_convention": SIGN_CONVENTION,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "summary": self.summary,
            "ratios": self.ratios,
            "sensitivity": self.sensitivity,
            "training": self.training,
            "attacks": self.attacks,
            "runs": self.runs,
            "controls": self.controls,
            "influence_memory_estimate": self.influence_memory,
            "influence_diagnostics": self.influence_diagnostics,
            "exceeded": self.exceeded,
            "untrained": {r["model"]: r["untrained"] for r in self.model_status},
            "model_status": self.model_status,
            "splits": self.splits,
        }


# --------------------------------------------------------------------------- the run
def _influences(
    model, X, y, X_test, y_test, config: MalleabilityConfig, n_classes: int, tr, arch: str | None = None
) -> list:
    weights = None
    ckpts = None
    if config.estimator == "tracin":
        tcfg = config.train_config(arch if arch in config.models else None)
        ckpts = tr.checkpoints
        assert tcfg.checkpoint_every is not None  # train_config sets it under tracin
        weights = tracin_weights(len(ckpts), tcfg.checkpoint_every, tr.steps_run, tcfg.lr)
    return influence_sweep(
        model,
        X,
        y,
        X_test,
        y_test,
        config.influence_config(),
        loss=config.loss,
        n_classes=n_classes,
        dampings=config.damping,
        checkpoints=ckpts,
        checkpoint_weights=weights,
    )


def _logits(model: nn.Module | Task, X: torch.Tensor) -> torch.Tensor:
    """Logits of flat rows X: a Task maps rows to its module's input; a bare module takes rows."""
    return model.logits(X) if isinstance(model, Task) else model(X)


def _float64_copy(model: nn.Module | Task, device, always: bool = False) -> nn.Module | Task:
    """``model`` in float64 on ``device``: a deep copy when it is not already (or ``always``), so a
    user's model is never changed."""
    module = model.module if isinstance(model, Task) else model
    floats = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    if always or any(t.dtype != torch.float64 or t.device != device for t in floats):
        module = copy.deepcopy(module).to(device=device, dtype=torch.float64)
    return replace(model, module=module) if isinstance(model, Task) else module


def _influence_key(
    model: nn.Module | Task,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    config: "MalleabilityConfig",
    n_classes: int,
    arch: str,
) -> str:
    """sha256 over what one influence run depends on: the model (class, layer structure, every
    parameter and buffer, its input mapping), the training rows X with the cell's labels, the
    test rows, and the estimator's settings (the influence estimators draw no randomness from the
    cell's seed: their own seed is fixed in :class:`InfluenceConfig`). Equal keys give
    bitwise-equal results."""
    module = model.module if isinstance(model, Task) else model
    h = hashlib.sha256(f"{type(module).__qualname__}|{arch}|{config.loss}|{n_classes}|".encode())
    h.update(repr((config.influence_config(), tuple(config.damping))).encode())
    if isinstance(model, Task):
        h.update(repr((model.inputs, getattr(model.loss, "name", model.loss), model.params)).encode())
    h.update(repr(module).encode())  # the layer structure (the state dict holds the numbers)
    tensors = {f"state.{name}": t for name, t in module.state_dict().items()}
    tensors.update(zip(("X", "y", "X_test", "y_test"), rows))
    h.update(tensors_sha256(tensors).encode())
    return h.hexdigest()


def _pair_key(clean: str | None, perturbed: str | None) -> str | None:
    """The inputs of one clean-vs-perturbed comparison (None when either run has no key)."""
    if clean is None or perturbed is None:
        return None
    return hashlib.sha256(f"{clean}|{perturbed}".encode()).hexdigest()[:16]


def _diag_row(seed, arch, role, res) -> dict:
    d = res.diagnostics
    keys = (
        "min_eigenvalue",
        "max_eigenvalue",
        "damped_min_eigenvalue",
        "positive_definite",
        "n_negative_eigenvalues",
        "damped_condition_number",
        "iterations",
        "relative_residual_max",
        "converged",
        "negative_curvature",
        "checkpoints_used",
        "lambda_max",
        "lambda_max_method",
        "lambda_max_residual",
        "lambda_max_converged",
        "damping_relative",
        "damping_abs",
        "solver",
        "curvature",
        "curvature_seed",
        "layers",
        "excluded_parameters",
        "damping_per_layer",
        "factor_bytes",
        "proj_dim",
        "proj_dim_used",
        "projection_layout",
        "projected_rows_computed",
        "projected_rows_reused",
        "hessian_vector_products",
        "projected_min_eigenvalue",
    )
    row = {
        "seed": seed,
        "model": arch,
        "role": role,
        "estimator": res.estimator,
        "damping": res.damping,
        "path": res.path,
        "n_params": res.n_params,
        "memory_estimate_bytes": d.get("memory_estimate_bytes", {}).get("total"),
        "seconds": d.get("seconds"),
    }
    row.update({k: d[k] for k in keys if k in d})
    if "damping_given" in d:
        row["damping"] = d["damping_given"]  # as given (a number, or "1e-3x"); damping_abs is what was used
    else:
        row["damping_abs"] = res.damping
    return row


class _MatchLossReached(Exception):
    """Raised from fit's progress callback to stop training at --match-loss."""


def _sampled_curve(curve: list[float], points: int = 11) -> list[list]:
    """[[step, loss], ...] at up to ``points`` evenly spaced entries of a loss curve (step = index)."""
    if not curve:
        return []
    idx = sorted(set(np.linspace(0, len(curve) - 1, min(points, len(curve))).round().astype(int).tolist()))
    return [[int(i), float(curve[i])] for i in idx]


def _train_recipe(model: TwoLayerNet, X: torch.Tensor, y: torch.Tensor, recipe, loss_tol: float | None) -> TrainResult:
    """Train a built-in model with an :class:`attnaudit.core.fit.Recipe` (sgd/adam); with ``loss_tol``
    stop once the loss over the whole training set is <= it, checked before training and
    after every epoch (every step when full-batch)."""

    require_nonzero_inputs(X)
    n = int(X.shape[0])
    per_epoch = recipe.steps_per_epoch(n)
    forward: Callable[[torch.Tensor], torch.Tensor]
    if getattr(model, "context", None) is not None and hasattr(model, "mlp"):
        feats, forward = model.features_in(X).detach(), model.mlp
    else:
        feats, forward = X, model

    def full_loss() -> float:
        with torch.no_grad():
            return loss_value(forward(feats), y, recipe.loss).item()

    steps = {"n": 0}
    checks: list[float] = []

    def check(_k: int = 1) -> None:
        steps["n"] += 1
        if steps["n"] % per_epoch == 0:
            v = full_loss()
            checks.append(v)
            if loss_tol is not None and v <= loss_tol:  # check runs only with a loss_tol
                raise _MatchLossReached

    if loss_tol is not None:
        v0 = full_loss()
        if v0 <= loss_tol:
            return TrainResult(loss_curve=[v0], steps_run=0, final_loss=v0, reached_tol=True, diverged=False)
        checks.append(v0)
    try:
        res = fit_recipe(model, X, y, recipe, progress=check if loss_tol is not None else None)
    except _MatchLossReached:
        return TrainResult(
            loss_curve=checks, steps_run=steps["n"], final_loss=checks[-1], reached_tol=True, diverged=False
        )
    final = full_loss() if not res.diverged else float("nan")
    return TrainResult(
        loss_curve=list(res.loss_curve) + [final],
        steps_run=res.steps_run,
        final_loss=final,
        reached_tol=None if loss_tol is None else bool(final <= loss_tol),
        diverged=res.diverged,
    )


def run_malleability(
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    n_classes: int,
    config: MalleabilityConfig,
    *,
    value_range: tuple[float, float] | None = None,
    progress: Callable[[int], None] | None = None,
    fixed_models: dict[str, TwoLayerNet | Task] | None = None,
    rebuild: dict | None = None,
    executor: "ExecutorConfig | None" = None,
    data: "HoldoutRecipe | None" = None,
) -> MalleabilityResult:
    """Run the malleability protocol (module docstring) on a fixed train/test split.

    ``value_range``: the data's valid range (attacks clip to it); None = no clipping.
    ``fixed_models``: already-trained models keyed by architecture (a user's checkpoint).
    They are audited as they are: only ``protocol='static'`` applies (nothing is retrained,
    so there is no ``reinit`` control and no TracIn trajectory); ``config.models`` is ignored
    and the seeds only vary the attacks' randomness.
    Tensors may live on any device; everything runs there in float64. A saved model is
    never modified (one in another dtype or on another device is audited through a copy).

    Each seed x model is one cell (:func:`malleability_cell`: its trainings, attacks and
    influences) run by ``executor`` (:mod:`attnaudit.runtime.sweep`; default in this process).
    Executors other than the in-process one need ``data``, the recipe the tensors came from,
    and built-in models (saved models are audited in this process). A seed with a failed cell
    is left out of the summaries and listed in ``failed_cells``.
    """

    rebuild = rebuild or {}
    if fixed_models:
        if config.protocol == "retrain" and not all(label in rebuild for label in fixed_models):
            missing = [label for label in fixed_models if label not in rebuild]
            raise AuditError(
                f"--protocol retrain re-runs a checkpoint's recorded training recipe, and {', '.join(missing)} records "
                "none (attnaudit train writes it); audit it as it is (--protocol static) or fine-tune it "
                "(--protocol finetune --finetune-steps N)"
            )
        if config.controls and config.protocol == "static":
            raise AuditError(
                "the reinit control retrains from scratch and does not apply to a saved model; pass --no-controls"
            )
        if config.estimator == "tracin":
            raise AuditError(
                "--estimator tracin needs the training trajectory, which a saved model does not carry; use last-layer, exact or cg"
            )
        for arch, model in fixed_models.items():
            if isinstance(model, Task):
                if model.n_classes != n_classes:
                    raise AuditError(
                        f"saved model {arch} has {model.n_classes} outputs but the audit uses {n_classes} classes; "
                        "audit models with the same classes together"
                    )
                continue
            spec = model.spec
            if spec.d_in != int(X_train.shape[1]) or spec.n_out != n_classes:
                raise AuditError(
                    f"saved {arch} model expects {spec.d_in} features and {spec.n_out} classes, the data have "
                    f"{int(X_train.shape[1])} and {n_classes}; audit it on the data it was trained on"
                )
        text = [label for label, m in fixed_models.items() if _embedding_attacked(m, config)]
        if text and config.protocol == "retrain":
            raise AuditError(
                f"embedding attacks on text ({', '.join(text)}) run with --protocol static or finetune; retraining a "
                "text checkpoint on shifted embeddings is not supported"
            )
        config = replace(config, models=tuple(fixed_models), saved_models=True)
    if y_train is None or y_test is None:
        raise AuditError("malleability needs labelled data (influence is defined on a labelled loss)")
    n_train, n_test = int(X_train.shape[0]), int(X_test.shape[0])
    assert config.top_ks is not None  # MalleabilityConfig.__post_init__ sets it
    if max(config.top_ks) > n_train:
        raise AuditError(f"--top-k {max(config.top_ks)} exceeds the {n_train} training samples; lower --top-k")
    if config.resample_data and (fixed_models or data is None):
        raise AuditError(
            "--resample-data draws each seed's rows from the data recipe; pass data=HoldoutRecipe(...) "
            "(the CLI does) and built-in models"
        )
    if n_classes < 2:
        raise AuditError(f"malleability needs at least 2 classes, the data has {n_classes}")
    present = torch.unique(y_train).tolist()
    if len(present) < 2:
        raise AuditError(
            f"the training labels hold a single class ({present[0]}): influence on a one-class loss says nothing; "
            "keep at least two classes (e.g. --classes 3,5)"
        )
    memory = influence_memory_estimate(
        config, int(X_train.shape[1]), n_classes, n_train, n_test, fixed_models, X_train[:1], X_train
    )  # fails early
    ex = executor or ExecutorConfig()
    remote = ex.kind != "local" or ex.jobs > 1
    if fixed_models and (remote or ex.resume_dir):
        raise AuditError("saved models are audited in this process; drop --executor ray / --jobs / --resume")
    if remote and data is None:
        raise AuditError(
            "cells on worker processes or Ray rebuild their data from a recipe; pass data=HoldoutRecipe(...) "
            "(the CLI does), or run with the local executor"
        )

    def no_progress(k: int = 1) -> None:
        return None

    advance = progress or no_progress
    memory_key = data.key if data is not None else f"memory:{id(X_train)}"
    if config.match_loss == AUTO_MATCH and fixed_models:
        config = replace(config, match_loss=None)  # a saved model is not trained to a loss
    state = _MalleabilityState(
        X_train,
        y_train,
        X_test,
        y_test,
        n_classes,
        config,
        value_range,
        fixed_models,
        rebuild,
        split=_split_info(X_train, y_train, data),
    )
    base = {
        "data": None if data is None else data.to_dict(),
        "memory_key": memory_key,
        "n_classes": n_classes,
        "value_range": None if value_range is None else list(value_range),
        "device": str(X_train.device),
    }

    def seed_data(seed: int) -> dict:
        """The cell's data: the caller's rows, or (--resample-data) the recipe's split drawn with ``seed``."""
        if not config.resample_data:
            return {}
        assert data is not None  # --resample-data without a recipe is refused above
        rec = replace(data, seed=int(seed))
        return {"data": rec.to_dict(), "memory_key": rec.key}

    def cells(fn: str, cfg: MalleabilityConfig) -> list:
        return [
            CellTask(
                f"attnaudit.analyses.malleability.malleability:{fn}",
                {**base, "config": cfg, **seed_data(seed), "seed": seed, "arch": arch},
                f"{arch} seed {seed}",
            )
            for seed in cfg.seeds
            for arch in cfg.models
        ]

    try:
        cached(f"malleability:{memory_key}", lambda: state)
        if config.match_loss == AUTO_MATCH:
            config = _resolve_auto_match(config, run_cells(cells("budget_loss_cell", config), ex))
        per_cell = progress_total(config) // (len(config.seeds) * len(config.models))
        outcomes = run_cells(cells("malleability_cell", config), ex, on_done=lambda o: advance(per_cell))
    finally:
        clear_cache()
    failed = [o.failure() for o in outcomes if not o.ok]
    bad_seeds = {o.task.config["seed"] for o in outcomes if not o.ok}
    row_keys = ("runs", "controls", "training", "attacks", "diagnostics")
    merged: dict[str, list] = {key: [] for key in row_keys}
    infl_warnings: dict[str, int] = {}
    examples: dict = {}
    edits: list = []
    t_train = t_attack = t_infl = 0.0
    for o in outcomes:
        if not o.ok or o.task.config["seed"] in bad_seeds:
            continue
        raw = o.result
        for key in row_keys:
            merged[key] += raw[key]
        for w, k in raw["influence_warnings"].items():
            infl_warnings[w] = infl_warnings.get(w, 0) + k
        for arch, ex_rows in raw["examples"].items():
            examples.setdefault(arch, {}).update(ex_rows)
        edits += raw.get("edits", [])
        t_train += raw["timings"]["train"]
        t_attack += raw["timings"]["attack"]
        t_infl += raw["timings"]["influence"]
    runs, controls, training, attack_rows, diags = (merged[key] for key in row_keys)

    status = _model_status(config, training, n_classes, n_train)
    summary, ratios = _aggregate(config, runs, controls, status)
    sensitivity = _sensitivity(config, summary)
    warnings = _warnings(config, training, infl_warnings)
    for row in summary:
        if row.get("degenerate"):
            warnings.append(
                f"{row['model']}: the {row['attack']} control reproduced the clean influence run bit for bit ("
                + (
                    "the data order changes nothing when one batch holds every row: lower --finetune-batch-size"
                    if config.protocol == "finetune"
                    else "the other initialisation trained to the same model"
                )
                + "), so its flip rate is 0 by construction and is not used as a floor"
            )
        if row.get("same_inputs"):
            again = ", ".join(str(c["seed"]) for c in row["same_inputs"])
            warnings.append(
                f"{row['model']}, {row['attack']}"
                + (f"@{row['eps']:g}" if row["eps"] is not None and row["attack"] != config.control else "")
                + f": seed(s) {again} ran on bitwise the inputs of seed {row['same_inputs'][0]['as_seed']} (a "
                "deterministic comparison: the same model, rows and perturbation), so they are counted once; its "
                f"summary rests on {len(row['seeds'])} distinct replicate(s)"
            )
    for st in status:
        if st["untrained"]:
            warnings.append(
                _untrained_text(st) + "; every verdict about it makes no claim (train it longer, raise --lr, "
                "or scale the inputs)"
            )
    splits = []
    for o in outcomes:
        if o.ok and o.task.config["seed"] not in bad_seeds and o.result.get("split") is not None:
            row = {"seed": o.task.config["seed"], **o.result["split"]}
            if row not in splits:
                splits.append(row)
    splits.sort(key=lambda r: config.seeds.index(r["seed"]))
    if failed:
        warnings.append(
            f"{len(failed)} of {len(outcomes)} cells failed (listed in failed_cells); their seeds ({', '.join(map(str, sorted(bad_seeds)))}) "
            "are left out of the summaries: " + "; ".join(f"{f['cell']}: {f['error']}" for f in failed[:3])
        )
    _loss_gate(config, training, ratios)
    exceeded = []
    if config.max_flip_rate is not None:
        for row in summary:
            if row["attack"] not in ADVERSARIAL:  # the gate counts attacks; controls are context
                continue
            m = row["flip_rate"]["mean"]
            if m is not None and m > config.max_flip_rate:
                exceeded.append({k: row[k] for k in ("model", "attack", "eps", "damping")} | {"flip_rate": m})
    verdicts = _verdicts(config, summary, ratios, sensitivity, exceeded, status)
    timings = {"train": t_train, "attack": t_attack, "influence": t_infl}
    return MalleabilityResult(
        config=config,
        runs=runs,
        controls=controls,
        training=training,
        attacks=attack_rows,
        summary=summary,
        ratios=ratios,
        sensitivity=sensitivity,
        influence_diagnostics=diags,
        exceeded=exceeded,
        warnings=warnings,
        verdicts=verdicts,
        timings=timings,
        n_train=n_train,
        n_test=n_test,
        influence_memory=memory,
        examples=examples,
        edits=edits,
        failed_cells=failed,
        execution={**ex.to_dict(), "cells": len(outcomes), "resumed": sum(o.resumed for o in outcomes)},
        model_status=status,
        splits=splits,
    )


def _resolve_auto_match(config: MalleabilityConfig, outcomes: list) -> MalleabilityConfig:
    """``--match-loss auto`` made concrete: L* = the largest clean training loss any model
    reaches within the step budget (over every seed); every model is then trained until its
    loss is <= L*, so the slowest stops where its budget ends and the others where they first
    reach the same loss. The budget runs are recorded in ``match_loss_resolution``."""
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise AuditError(f"--match-loss auto: the step-budget run of {failed[0].task.label} failed: {failed[0].error}")
    runs = [o.result for o in outcomes]
    target = max(r["final_loss"] for r in runs)
    if not (math.isfinite(target) and target > 0):
        raise AuditError(
            f"--match-loss auto: the step-budget runs ended at training loss {target}; give --match-loss a "
            "number or none"
        )
    slowest = max(runs, key=lambda r: r["final_loss"])
    resolution = {
        "rule": "auto: the largest clean training loss any model reaches within the step budget",
        "target": target,
        "set_by": f"{slowest['model']} seed {slowest['seed']}",
        "budget_steps": config.steps,
        "budget_runs": runs,
    }
    return replace(config, match_loss=target, match_loss_resolution=resolution)


def _loss_gate(config: MalleabilityConfig, training: list[dict], ratios: list[dict]) -> None:
    """Add ``loss_gate`` to every ratio row: the two models' mean clean training losses and
    whether they are within ``config.loss_gap_factor`` of each other. A ratio of flip rates
    at very different training losses compares two training outcomes, not two models, so
    readers (``claims``, the verdicts) do not compare across a failed gate."""
    clean = [r for r in training if r["role"] == "clean" and r.get("final_loss") is not None]
    means = {
        m: float(np.mean([r["final_loss"] for r in clean if r["model"] == m])) for m in {r["model"] for r in clean}
    }
    for row in ratios:
        a, b = means.get(row["numerator"]), means.get(row["denominator"])
        if a is None or b is None:
            row["loss_gate"] = {
                "numerator_loss": a,
                "denominator_loss": b,
                "loss_ratio": None,
                "factor": config.loss_gap_factor,
                "comparable": None,
            }
            continue
        lo, hi = min(a, b), max(a, b)
        ratio = hi / lo if lo > 0 else (1.0 if hi == 0 else math.inf)
        row["loss_gate"] = {
            "numerator_loss": a,
            "denominator_loss": b,
            "loss_ratio": ratio if math.isfinite(ratio) else None,
            "factor": config.loss_gap_factor,
            "comparable": bool(ratio <= config.loss_gap_factor),
        }


def _split_info(X_train: torch.Tensor, y_train: torch.Tensor, data: "HoldoutRecipe | None") -> dict:
    """Which rows a cell trained and was measured on: the split seed and index checksums (from
    the recipe) and a checksum of the training rows' contents."""

    info: dict = {
        "split_seed": None if data is None else int(data.seed),
        "train_indices_sha256": None,
        "test_indices_sha256": None,
        "train_data_sha256": data_fingerprint(X_train, y_train),
    }
    if data is not None:
        try:
            tr, te = data.load()
            info["train_indices_sha256"] = (tr.info.get("holdout") or {}).get("indices_sha256")
            info["test_indices_sha256"] = (te.info.get("holdout") or {}).get("indices_sha256")
        except AuditError:
            pass
    return info


def _model_status(config: MalleabilityConfig, training: list[dict], n_classes: int, n_train: int) -> list[dict]:
    """Per model: chance, the untrained threshold, its clean training accuracy (mean and per seed), and the flag."""
    chance, threshold = untrained_threshold(n_classes, n_train)
    out = []
    for m in config.models:
        accs = [r["train_accuracy"] for r in training if r["model"] == m and r["role"] == "clean"]
        mean = float(np.mean(accs)) if accs else None
        out.append(
            {
                "model": m,
                "chance": chance,
                "threshold": threshold,
                "train_accuracy_mean": mean,
                "train_accuracy_by_seed": [float(a) for a in accs],
                "untrained": bool(mean is not None and mean < threshold),
                "rule": "train accuracy < 1/c + max(0.05, 2 sqrt((1/c)(1-1/c)/n_train))",
            }
        )
    return out


def _untrained_text(st: dict) -> str:
    return (
        f"{st['model']} did not train (clean train accuracy {100 * st['train_accuracy_mean']:.1f}% against chance "
        f"{100 * st['chance']:.1f}%, below the {100 * st['threshold']:.1f}% threshold)"
    )


@dataclass
class _MalleabilityState:
    """A malleability run's rows and settings, shared by its cells in one process."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int
    config: "MalleabilityConfig"
    value_range: tuple | None
    fixed_models: dict | None
    rebuild: dict
    split: dict | None = None
    # influence results by the sha256 of everything they depend on (_influence_key): a run on
    # identical inputs (the static protocol's clean run, or a deterministic attack's, repeated
    # for every seed) is computed once
    influence_memo: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.X_train = self.X_train.to(torch.float64)
        self.X_test = self.X_test.to(self.X_train.device, torch.float64)
        self.y_train = self.y_train.to(self.X_train.device).long()
        self.y_test = self.y_test.to(self.X_train.device).long()
        self.rebuild = self.rebuild or {}


def malleability_cell(payload: dict) -> dict:
    """One seed x model cell (a pure function of ``payload``): its trainings, attacks, influence
    and stability rows, unaggregated."""
    state = _cell_state(payload)
    return _cell_raw(state, int(payload["seed"]), payload["arch"])


def _cell_state(payload: dict) -> "_MalleabilityState":
    """The cell's data and settings: cached per data key (a worker reuses its loaded rows), with
    the payload's own config (a budget run and the matched run share the rows, not the config)."""

    def build() -> _MalleabilityState:
        recipe = HoldoutRecipe(**payload["data"])
        train_ds, test_ds = recipe.load()
        dev = torch.device(payload["device"])
        vr = payload["value_range"]
        return _MalleabilityState(
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            int(payload["n_classes"]),
            payload["config"],
            None if vr is None else tuple(vr),
            None,
            {},
            split=_split_info(train_ds.X, train_ds.y, recipe),
        )

    state = cached(f"malleability:{payload['memory_key']}", build)
    if state.config != payload["config"]:
        state = replace(state, config=payload["config"])
    return state


def _train_builtin(
    config: MalleabilityConfig,
    spec: ModelSpec,
    X_ctx: torch.Tensor,
    X: torch.Tensor,
    y: torch.Tensor,
    order_seed: int,
    what: str,
) -> tuple[nn.Module, TrainResult]:
    """A built-in model of ``spec`` (attention context ``X_ctx``) trained on (X, y) with the
    config's optimizer, learning rate and loss target; divergence is a one-line error."""
    model = build_model(spec, X_ctx, dtype=torch.float64, device=X.device)
    if config.optimizer == "gd":
        tr = train(model, X, y, config.train_config(spec.arch))
    else:
        tr = _train_recipe(model, X, y, config.recipe(spec.arch, order_seed), config.match_loss_for(spec.arch))
    if tr.diverged:
        raise AuditError(f"training diverged for {spec.arch} ({what}) at --lr {config.lr_for(spec.arch):g}; lower --lr")
    return model, tr


def budget_loss_cell(payload: dict) -> dict:
    """The clean training loss of one seed x model trained for the whole step budget (the
    measurement ``--match-loss auto`` resolves its target from)."""
    state = _cell_state(payload)
    config = state.config
    spec = ModelSpec(
        payload["arch"],
        int(state.X_train.shape[1]),
        config.width,
        state.n_classes,
        config.parametrization,  # type: ignore[arg-type]  # ModelSpec validates the names
        attn_scaling=config.attn_scaling,  # type: ignore[arg-type]
        seed=int(payload["seed"]),
    )
    _, tr = _train_builtin(
        config,
        spec,
        state.X_train,
        state.X_train,
        state.y_train,
        int(payload["seed"]),
        f"budget run, seed {payload['seed']}",
    )
    return {
        "seed": int(payload["seed"]),
        "model": payload["arch"],
        "final_loss": float(tr.final_loss),
        "steps_run": int(tr.steps_run),
    }


def _embedding_attacked(model, config: "MalleabilityConfig") -> bool:
    """Whether ``model`` is a text classifier fed token ids and ``config`` attacks its embeddings
    (fgsm, pgd, mim or a noise control): its rows then become embedding-shift rows."""
    module = model.module if isinstance(model, Task) else model
    continuous = [a for a in config.attacks if a in ADVERSARIAL + RANDOM_CONTROLS and a not in TOKEN_ATTACKS]
    return (
        bool(continuous)
        and isinstance(module, HFSequenceClassifier)
        and not isinstance(module, HFEmbeddingShiftClassifier)
    )


def _as_embedding_rows(model: Task, *rows: torch.Tensor) -> tuple[Task, list[torch.Tensor]]:
    """The text ``model`` fed embedding-shift rows, and ``rows`` (token ids) as such rows (zero shift):
    same numbers, parameter gradients included (:class:`~attnaudit.models.hf.HFEmbeddingShiftClassifier`)."""
    assert isinstance(model.module, HFSequenceClassifier)
    shift = HFEmbeddingShiftClassifier(model.module)
    return replace(model, module=shift, inputs=Inputs()), [
        embedding_shift_rows(r, shift.hidden).to(r.device) for r in rows
    ]


def _token_edits(model, X: torch.Tensor, X_adv: torch.Tensor) -> list[dict]:
    """Each changed text of a token attack: its training-row index, its ids before and the swaps [position, old id, new id]."""
    module = model.module if isinstance(model, Task) else model
    if isinstance(module, HFEmbeddingShiftClassifier):
        before, after = module.split_rows(X)[0], module.split_rows(X_adv)[0]
    else:
        before, after = X.round().long(), X_adv.round().long()
    out = []
    for i in torch.nonzero((before != after).any(1)).flatten().tolist():
        positions = torch.nonzero(before[i] != after[i]).flatten().tolist()
        swaps = [[p, int(before[i, p]), int(after[i, p])] for p in positions]
        out.append({"index": i, "ids": before[i].tolist(), "swaps": swaps})
    return out


def _cell_raw(state: _MalleabilityState, seed: int, arch: str) -> dict:
    """The protocol for one seed and one model (module docstring): clean model, control, attacks."""
    config, n_classes, value_range = state.config, state.n_classes, state.value_range
    fixed_models, rebuild = state.fixed_models, state.rebuild
    X_train, y_train, X_test, y_test = state.X_train, state.y_train, state.X_test, state.y_test
    if fixed_models and isinstance(fixed_models[arch], Task) and _embedding_attacked(fixed_models[arch], config):
        text_model, (X_train, X_test) = _as_embedding_rows(fixed_models[arch], X_train, X_test)
        fixed_models = {**fixed_models, arch: text_model}
    d = int(X_train.shape[1])
    t_train = t_attack = t_infl = 0.0
    runs: list[dict] = []
    controls: list[dict] = []
    training: list[dict] = []
    attack_rows: list[dict] = []
    diags: list[dict] = []
    infl_warnings: dict[str, int] = {}
    examples: dict = {}
    edits: list[dict] = []

    def note(res_list) -> None:
        for r in res_list:
            for w in r.warnings:
                infl_warnings[w] = infl_warnings.get(w, 0) + 1

    def fit(spec: ModelSpec, X_ctx, X, role: str, seed: int, order_seed: int | None = None):
        nonlocal t_train
        t0 = time.perf_counter()
        order_seed = seed if order_seed is None else order_seed
        model, tr = _train_builtin(config, spec, X_ctx, X, y_train, order_seed, f"{role}, seed {seed}")
        t_train += time.perf_counter() - t0
        lr = config.lr_for(spec.arch)
        with torch.no_grad():
            row = {
                "seed": seed,
                "model": spec.arch,
                "role": role,
                "final_loss": tr.final_loss,
                "steps_run": tr.steps_run,
                "reached_match_loss": tr.reached_tol,
                "train_accuracy": accuracy(model(X), y_train),
                "test_accuracy": accuracy(model(X_test), y_test),
                "optimizer": config.optimizer,
                "lr": lr,
                "batch_size": config.batch_size,
                "data_order_seed": None if config.optimizer == "gd" else order_seed,
                "match_loss": config.match_loss_for(spec.arch),
                "loss_curve": _sampled_curve(tr.loss_curve),
            }
        training.append(row)
        return model, tr, row

    def given(arch: str, seed: int, role: str = "clean"):
        """A saved model as it is (the 'clean' model of ``static``): no training, its loss and accuracy recorded."""
        assert fixed_models is not None  # called for saved models only
        model = _float64_copy(fixed_models[arch], X_train.device)  # the user's model stays as it is
        head = {"seed": seed, "model": arch, "role": role, "source": "saved model"}
        return recorded(model, X_train, config.loss, head, {"steps_run": 0})

    def recorded(model, X, loss: str, head: dict, after_loss: dict):
        """(model, TrainResult, row) of a saved model as it is or trained here from a recipe:
        its row of ``training`` (``head``, its loss on (X, y_train), ``after_loss``, accuracies)."""
        with torch.no_grad():
            out = _logits(model, X)
            row: dict[str, Any] = {
                **head,
                "final_loss": loss_value(out, y_train, loss).item(),
                **after_loss,
                "reached_match_loss": None,
                "train_accuracy": accuracy(out, y_train),
                "test_accuracy": accuracy(_logits(model, X_test), y_test),
            }
        training.append(row)
        tr = TrainResult(
            loss_curve=[row["final_loss"]],
            steps_run=row["steps_run"],
            final_loss=row["final_loss"],
            reached_tol=None,
            diverged=False,
        )
        return model, tr, row

    def finetune(base, X, order_seed: int, role: str, seed: int, arch: str):
        """A copy of the saved model ``base`` fine-tuned on (X, y_train) with the finetune recipe."""
        nonlocal t_train

        t0 = time.perf_counter()
        model = _float64_copy(base, X.device, always=True)
        module = model.module if isinstance(model, Task) else model
        res = fit_recipe(
            module,
            X,
            y_train,
            config.finetune_recipe(order_seed),
            inputs=model.inputs if isinstance(model, Task) else None,
        )
        t_train += time.perf_counter() - t0
        if res.diverged:
            raise AuditError(
                f"fine-tuning diverged for {arch} ({role}, seed {seed}) at --finetune-lr {config.finetune_lr:g}; lower it"
            )
        head = {"seed": seed, "model": arch, "role": role, "source": "fine-tuned saved model"}
        return recorded(model, X, config.loss, head, {"steps_run": res.steps_run, "data_order_seed": order_seed})

    def refit(arch: str, init_seed: int, order_seed: int, X_ctx, X, role: str, seed: int):
        """A checkpoint's architecture rebuilt from ``init_seed`` and trained on (X, y_train)
        with its recorded recipe (data order from ``order_seed``)."""
        nonlocal t_train

        t0 = time.perf_counter()
        assert fixed_models is not None  # called for saved models only
        rb, template = rebuild[arch], fixed_models[arch]
        module = rb.build(init_seed, X_ctx)
        model = replace(template, module=module) if isinstance(template, Task) else module
        res = fit_recipe(
            module,
            X,
            y_train,
            replace(rb.recipe, seed=order_seed),
            inputs=template.inputs if isinstance(template, Task) else None,
        )
        t_train += time.perf_counter() - t0
        if res.diverged:
            raise AuditError(f"retraining diverged for {arch} ({role}, seed {seed}) with the recorded recipe")
        head = {"seed": seed, "model": arch, "role": role, "source": "recorded recipe re-run"}
        loss = rb.recipe.loss  # the loss the recorded recipe trains with (the audit's --loss may differ)
        after_loss = {"loss": loss, "steps_run": res.steps_run, "init_seed": init_seed, "data_order_seed": order_seed}
        return recorded(model, X, loss, head, after_loss)

    def influences(model, X, tr, seed, arch, role):
        """Influence vectors per damping, the absolute dampings they used (None for TracIn), and
        the key of the run's inputs (None for TracIn, whose checkpoints come from training)."""
        nonlocal t_infl
        t0 = time.perf_counter()
        rows = (X, y_train, X_test, y_test)
        key = None if config.estimator == "tracin" else _influence_key(model, rows, config, n_classes, arch)
        earlier = state.influence_memo.get(key) if key is not None else None
        if earlier is not None:
            res, first = earlier
        else:
            res = _influences(model, X, y_train, X_test, y_test, config, n_classes, tr, arch)
            if key is not None:
                state.influence_memo[key] = (res, {"seed": seed, "role": role})
        t_infl += time.perf_counter() - t0
        note(res)
        seen = set()
        for r in res:
            if id(r) not in seen:
                row = _diag_row(seed, arch, role, r)
                if earlier is not None:  # bitwise the same inputs: the earlier result, not computed again
                    row.update(seconds=0.0, same_inputs_as=first)
                diags.append(row)
                seen.add(id(r))
        return [r.total.detach().cpu().numpy() for r in res], [r.damping for r in res], key

    spec = (
        None
        if fixed_models
        else ModelSpec(  # ModelSpec validates the names (the config holds plain strings)
            arch,  # type: ignore[arg-type]
            d,
            config.width,
            n_classes,
            config.parametrization,  # type: ignore[arg-type]
            attn_scaling=config.attn_scaling,  # type: ignore[arg-type]
            seed=seed,
        )
    )
    if fixed_models and config.protocol == "retrain":
        k = config.seeds.index(seed)
        init_seed, order_seed = rebuild[arch].init_seed + k, rebuild[arch].recipe.seed + k
        clean_model, clean_tr, clean_row = refit(arch, init_seed, order_seed, X_train, X_train, "clean", seed)
        attack_target = clean_model
    elif fixed_models:
        saved_model = given(arch, seed, "saved" if config.protocol == "finetune" else "clean")
        if config.protocol == "finetune":
            clean_model, clean_tr, clean_row = finetune(saved_model[0], X_train, seed, "clean", seed, arch)
        else:
            clean_model, clean_tr, clean_row = saved_model
        attack_target = saved_model[0]  # the adversary perturbs against the model it can see
    else:
        assert spec is not None  # built-in models
        clean_model, clean_tr, clean_row = fit(spec, X_train, X_train, "clean", seed)
        attack_target = clean_model
    clean_infl, clean_abs, clean_key = influences(clean_model, X_train, clean_tr, seed, arch, "clean")
    if config.controls:
        control_seed = seed + REINIT_SEED_OFFSET
        if fixed_models and config.protocol == "retrain":
            control_seed = init_seed + REINIT_SEED_OFFSET
            r_model, r_tr, r_row = refit(arch, control_seed, order_seed, X_train, X_train, config.control, seed)
        elif fixed_models:
            r_model, r_tr, r_row = finetune(saved_model[0], X_train, control_seed, config.control, seed, arch)
        else:
            assert spec is not None  # built-in models
            r_model, r_tr, r_row = fit(
                replace(spec, seed=control_seed), X_train, X_train, config.control, seed, order_seed=control_seed
            )
        r_infl, r_abs, r_key = influences(r_model, X_train, r_tr, seed, arch, config.control)
        for damping, ci, ri, ca, ra in zip(config.damping, clean_infl, r_infl, clean_abs, r_abs):
            controls.append(
                {
                    "seed": seed,
                    "model": arch,
                    "control": config.control,
                    "damping": damping,
                    "damping_abs": ra,
                    "damping_abs_clean": ca,
                    f"{'data_order' if config.protocol == 'finetune' else 'reinit'}_seed": control_seed,
                    "inputs_sha256": _pair_key(clean_key, r_key),
                    # the control reproduced the clean influence run bit for bit: it varied nothing
                    "same_as_clean": clean_key is not None and r_key == clean_key,
                    **stability_by_k(ci, ri, config.top_ks),
                    "perturbed_test_accuracy": r_row["test_accuracy"],
                    "perturbed_train_loss": r_row["final_loss"],
                }
            )
    for eps in config.eps:
        for attack in config.attacks:
            if attack == "none" and eps != config.eps[0]:
                continue
            acfg = config.attack_config(attack, eps, seed, value_range)
            t0 = time.perf_counter()
            ares = perturb(attack_target, X_train, y_train, acfg, config.loss)
            t_attack += time.perf_counter() - t0
            eps_used = 0.0 if attack == "none" else eps
            with torch.no_grad():
                clean_on_pert = accuracy(_logits(attack_target, ares.X_adv), y_train)
            attack_rows.append({"seed": seed, "model": arch, **ares.to_dict(), "eps": eps_used})
            if attack in TOKEN_ATTACKS:
                edits.append(
                    {"seed": seed, "model": arch, "attack": attack, "eps": eps_used}
                    | {"texts": _token_edits(attack_target, X_train, ares.X_adv)}
                )
            role = f"{attack}@{eps_used:g}"
            if config.protocol == "retrain":
                attn = (rebuild[arch].spec.arch if fixed_models else arch) == "attn"
                ctx = ares.X_adv if (attn and config.attn_context == "perturbed") else X_train
                if fixed_models:
                    p_model, p_tr, p_row = refit(arch, init_seed, order_seed, ctx, ares.X_adv, role, seed)
                else:
                    assert spec is not None  # built-in models
                    p_model, p_tr, p_row = fit(spec, ctx, ares.X_adv, role, seed)
            elif config.protocol == "finetune":
                p_model, p_tr, p_row = finetune(saved_model[0], ares.X_adv, seed, role, seed, arch)
            else:
                p_model, p_tr, p_row = clean_model, clean_tr, clean_row
            p_infl, p_abs, p_key = influences(p_model, ares.X_adv, p_tr, seed, arch, role)
            for damping, ci, pi, ca, pa in zip(config.damping, clean_infl, p_infl, clean_abs, p_abs):
                runs.append(
                    {
                        "seed": seed,
                        "model": arch,
                        "attack": attack,
                        "eps": eps_used,
                        "damping": damping,
                        "damping_abs": pa,
                        "damping_abs_clean": ca,
                        **stability_by_k(ci, pi, config.top_ks),
                        "clean_model_accuracy_on_perturbed_train": clean_on_pert,
                        "clean_model_loss_on_perturbed_train": ares.loss_after,
                        "perturbation_norm_mean": ares.radius_mean,
                        "perturbation_linf_mean": ares.linf_mean,
                        "perturbation_linf_max": ares.linf_max,
                        "perturbation_l2_mean": ares.l2_mean,
                        "perturbation_l2_max": ares.l2_max,
                        "perturbed_test_accuracy": p_row["test_accuracy"],
                        "perturbed_train_loss": p_row["final_loss"] if config.protocol != "static" else None,
                        "clean_train_loss": clean_row["final_loss"],
                        "clean_test_accuracy": clean_row["test_accuracy"],
                        "inputs_sha256": _pair_key(clean_key, p_key),
                    }
                )
            if seed == config.seeds[0] and eps == config.eps[0]:
                examples.setdefault(arch, {})[attack] = (clean_infl[0], p_infl[0])
    if seed == config.seeds[0] and config.controls:
        examples.setdefault(arch, {})[config.control] = (clean_infl[0], r_infl[0])

    if state.split is not None:
        for row in training:
            row["train_data_sha256"] = state.split["train_data_sha256"]
            row["split_seed"] = state.split["split_seed"]
    return {
        "runs": runs,
        "controls": controls,
        "training": training,
        "attacks": attack_rows,
        "diagnostics": diags,
        "influence_warnings": infl_warnings,
        "examples": examples,
        "edits": edits,
        "split": state.split,
        "timings": {"train": t_train, "attack": t_attack, "influence": t_infl},
    }


# --------------------------------------------------------------------------- aggregation
_METRICS = ("flip_rate", "spearman", "top_k_overlap", "perturbed_test_accuracy")


def _cells(config: MalleabilityConfig) -> list[tuple[str, float | None]]:
    out: list[tuple[str, float | None]] = []
    for a in config.attacks:
        if a == "none":
            out.append((a, 0.0))
        else:
            out.extend((a, e) for e in config.eps)
    if config.controls:
        out.append((config.control, None))
    return out


def _aggregate(
    config: MalleabilityConfig, runs: list[dict], controls: list[dict], status: list[dict] | None = None
) -> tuple[list[dict], list[dict]]:
    cf = config.confidence
    top_ks = config.top_ks
    assert top_ks is not None  # MalleabilityConfig.__post_init__ sets it
    shares = {"flip_rate": True, "top_k_overlap": True}
    untrained = {r["model"] for r in (status or []) if r["untrained"]}
    by_key: dict[tuple, dict] = {}
    for attack, eps in _cells(config):
        for damping in config.damping:
            for model in config.models:
                if attack == config.control:
                    rows = [r for r in controls if r["model"] == model and r["damping"] == damping]
                else:
                    rows = [
                        r
                        for r in runs
                        if r["model"] == model and r["attack"] == attack and r["eps"] == eps and r["damping"] == damping
                    ]
                rows.sort(key=lambda r: config.seeds.index(r["seed"]))
                rows, copies = distinct_replicates(rows)
                entry: dict[str, Any] = {
                    "model": model,
                    "attack": attack,
                    "eps": eps,
                    "damping": damping,
                    "estimator": config.estimator,
                    "seeds": [r["seed"] for r in rows],
                }
                if copies:
                    entry["same_inputs"] = copies
                if attack == config.control and rows:
                    entry["degenerate"] = all(r.get("same_as_clean") for r in rows)
                for metric in _METRICS:
                    entry[metric] = summarize(
                        [r.get(metric) for r in rows], cf, config.top_k if shares.get(metric) else None
                    )
                if attack != config.control:
                    entry["clean_model_accuracy_on_perturbed_train"] = summarize(
                        [r["clean_model_accuracy_on_perturbed_train"] for r in rows], cf
                    )
                    entry["perturbation_norm_mean"] = (
                        float(np.mean([r["perturbation_norm_mean"] for r in rows])) if rows else None
                    )
                    for key in ("perturbation_linf_mean", "perturbation_l2_mean"):
                        vals = [r[key] for r in rows if r.get(key) is not None]
                        entry[key] = float(np.mean(vals)) if vals else None
                    for key in ("perturbation_linf_max", "perturbation_l2_max"):
                        vals = [r[key] for r in rows if r.get(key) is not None]
                        entry[key] = float(np.max(vals)) if vals else None
                abs_vals = [r["damping_abs"] for r in rows if r.get("damping_abs") is not None]
                entry["damping_abs_mean"] = float(np.mean(abs_vals)) if abs_vals else None
                entry["top_k"] = config.top_k
                entry["by_top_k"] = [
                    {
                        "top_k": k,
                        "flip_rate": summarize([_at_k(r, k, "flip_rate") for r in rows], cf, k),
                        "top_k_overlap": summarize([_at_k(r, k, "top_k_overlap") for r in rows], cf, k),
                    }
                    for k in top_ks
                ]
                entry["untrained"] = model in untrained
                by_key[(model, attack, eps, damping)] = entry
    # floors: read every adversarial flip rate against the training-randomness control and random noise of the same radius
    for (model, attack, eps, damping), entry in by_key.items():
        if attack not in ADVERSARIAL:
            continue
        rc = config.random_control_for(attack)
        sources = ((config.control, (model, config.control, None, damping)), ("random", (model, rc, eps, damping)))

        def floors_of(get) -> dict:
            floors = {}
            for name, key in sources:
                other = by_key.get(key)
                if other is None or get(other)["mean"] is None or other.get("degenerate"):
                    continue  # a control that reproduced the clean run is no floor
                lo = get(entry)["ci_low"]
                floors[name] = {
                    "mean": get(other)["mean"],
                    "ci_high": get(other)["ci_high"],
                    # conservative reading: the intervals do not overlap
                    "exceeded": bool(
                        lo is not None and get(other)["ci_high"] is not None and lo > get(other)["ci_high"]
                    ),
                    "attack": key[1],
                }
            return floors

        entry["floors"] = floors_of(lambda e: e["flip_rate"])
        for j, k_entry in enumerate(entry["by_top_k"]):
            k_entry["floors"] = floors_of(lambda e, j=j: e["by_top_k"][j]["flip_rate"])
    ratios = []
    base = config.models[0]
    for attack, eps in _cells(config):
        for damping in config.damping:
            den_entry = by_key[(base, attack, eps, damping)]
            for model in config.models[1:]:
                num_entry = by_key[(model, attack, eps, damping)]
                common = [s for s in num_entry["seeds"] if s in den_entry["seeds"]]

                def paired(get, k):
                    num = [get(num_entry)["values"][num_entry["seeds"].index(s)] for s in common]
                    den = [get(den_entry)["values"][den_entry["seeds"].index(s)] for s in common]
                    return {**ratio_summary(num, den, cf, trials=(k, k)), "seeds": common}

                by_k = [
                    {"top_k": k, **paired(lambda e, j=j: e["by_top_k"][j]["flip_rate"], k)}
                    for j, k in enumerate(top_ks)
                ]
                ratios.append(
                    {
                        "numerator": model,
                        "denominator": base,
                        "attack": attack,
                        "eps": eps,
                        "damping": damping,
                        **paired(lambda e: e["flip_rate"], config.top_k),
                        "top_k": config.top_k,
                        "by_top_k": by_k,
                        "untrained": [m for m in (model, base) if m in untrained],
                    }
                )
    return list(by_key.values()), ratios


def distinct_replicates(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rows that are independent replicates, and the others as [{"seed", "as_seed"}].

    A seed whose comparison ran on bitwise the inputs of an earlier seed's (the same
    ``inputs_sha256``: model, clean and perturbed rows, estimator) repeats it exactly -- a
    deterministic attack on a fixed model and rows varies nothing with the seed -- so it is no
    second sample: counting it would shrink an interval by sqrt(2) for no new information.
    Rows without a key (TracIn) are always kept."""
    first: dict[str, int] = {}
    kept, copies = [], []
    for r in rows:
        key = r.get("inputs_sha256")
        if key is not None and key in first:
            copies.append({"seed": r["seed"], "as_seed": first[key]})
            continue
        if key is not None:
            first[key] = r["seed"]
        kept.append(r)
    return kept, copies


def _at_k(row: dict, k: int, key: str):
    """``row[key]`` at top-k ``k`` (from its ``by_top_k``; the row's own value when it has none)."""
    for item in row.get("by_top_k") or ():
        if item["top_k"] == k:
            return item[key]
    return row.get(key) if row.get("top_k") == k else None


def _sensitivity(config: MalleabilityConfig, summary: list[dict]) -> dict:
    """Model ranking by mean flip rate in every (eps, damping) cell, per attack; does it hold?"""
    out: dict = {"by_attack": [], "ranking_stable": True}
    for attack in [a for a in config.attacks if a != "none"]:
        cells: list[dict[str, Any]] = []
        for eps in config.eps:
            for damping in config.damping:
                means = {}
                for row in summary:
                    if row["attack"] == attack and row["eps"] == eps and row["damping"] == damping:
                        means[row["model"]] = row["flip_rate"]["mean"]
                order = sorted(
                    means, key=lambda m: (-(means[m] if means[m] is not None else -1), config.models.index(m))
                )
                cells.append({"eps": eps, "damping": damping, "flip_rate": means, "ranking": order})
        # ties count as no reversal: compare strict orderings only
        rankings = {tuple(c["ranking"]) for c in cells if len(set(c["flip_rate"].values())) == len(c["flip_rate"])}
        stable = len(rankings) <= 1
        out["ranking_stable"] &= stable
        out["by_attack"].append({"attack": attack, "cells": cells, "ranking_stable": stable})
    return out


def _warnings(config: MalleabilityConfig, training: list[dict], infl_warnings: dict[str, int]) -> list[str]:
    out = []
    clean = [r for r in training if r["role"] == "clean"]
    means = {
        m: float(np.mean([r["final_loss"] for r in clean if r["model"] == m]))
        for m in config.models
        if any(r["model"] == m for r in clean)
    }
    if len(means) > 1:
        lo, hi = min(means.values()), max(means.values())
        if lo > 0 and hi / lo > config.loss_gap_factor:
            accs = {m: float(np.mean([r["train_accuracy"] for r in clean if r["model"] == m])) for m in config.models}
            desc = ", ".join(f"{m} {v:.3g} (train accuracy {100 * accs[m]:.0f}%)" for m, v in means.items())
            out.append(
                f"models are compared at very different training losses ({desc}; ratio {hi / lo:.1f} > "
                f"{config.loss_gap_factor:g}); "
                + (
                    "train the checkpoints to comparable losses before comparing their flip rates"
                    if config.saved_models
                    else "pass --match-loss to train each to the same loss"
                )
            )
    if config.match_loss is not None:
        missed = [r for r in training if r["reached_match_loss"] is False]
        if missed:
            worst = max(missed, key=lambda r: r["final_loss"])
            target = config.match_loss_for(worst["model"]) if worst["model"] in config.models else None
            out.append(
                f"{len(missed)} of {len(training)} trainings did not reach --match-loss "
                f"{'-' if target is None else format(target, 'g')} within "
                f"{config.steps} steps (worst: {worst['model']} {worst['role']} seed {worst['seed']} at {worst['final_loss']:.3g}); "
                "raise --steps or --lr"
            )
    if len(config.seeds) == 1:
        out.append("one seed: no spread and a degenerate interval; pass several --seeds for a confidence interval")
    elif len(config.seeds) < 5:
        out.append(
            f"{len(config.seeds)} seeds: Student-t / Fieller intervals over so few seeds are wide (t(0.975, "
            f"{len(config.seeds) - 1}) = {t_quantile(0.95, len(config.seeds) - 1):.2f}); fewer than 3 seeds never resolve a verdict"
            if len(config.seeds) < 3
            else f"{len(config.seeds)} seeds: Student-t / Fieller intervals over so few seeds are wide (t(0.975, "
            f"{len(config.seeds) - 1}) = {t_quantile(0.95, len(config.seeds) - 1):.2f})"
        )
    if config.protocol == "static" and "attn" in config.models and config.attn_context != "perturbed":
        out.append("--attn-context applies to --protocol retrain only; static keeps the clean model and its context")
    for w, count in infl_warnings.items():
        out.append(f"influence ({count}x): {w}")
    return out


def _ratio_interval_text(r: dict) -> str:
    """ "[1.20, 4.00]", with +inf for an unbounded upper end and n/a where there is no interval."""
    if r.get("ci_high") is None and r.get("unbounded_high"):
        return f"[{r.get('ci_low') or 0.0:.2f}, +inf]"
    if r.get("ci_low") is None or r.get("ci_high") is None:
        return "n/a"
    return f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def _ratio_text(r: dict) -> str:
    """ "2.10 [1.20, 4.00]" (undefined when the denominator's mean is 0)."""
    est = f"undefined ({r['denominator']} flip rate is 0)" if r.get("ratio") is None else f"{r['ratio']:.2f}"
    return f"{est} {_ratio_interval_text(r)}"


def _fmt_ci(s: dict, pct: bool = True) -> str:
    if s["mean"] is None:
        return "n/a"
    f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.3g}")
    if s["ci_low"] is None or s["ci_high"] is None:
        return f"{f(s['mean'])} (no interval from {s['n']} seed)"
    return f"{f(s['mean'])} [{f(s['ci_low'])}, {f(s['ci_high'])}]"


def _verdicts(config, summary, ratios, sensitivity, exceeded, status=None) -> list[str]:
    out = []
    status = {r["model"]: r for r in (status or [])}
    untrained = [m for m in config.models if status.get(m, {}).get("untrained")]
    for m in untrained:
        out.append(
            _untrained_text(status[m]) + ": its flip rates are no evidence of stability or malleability; "
            "no claim is made about it"
        )
    for row in summary:
        if row["attack"] not in ADVERSARIAL:
            continue
        rc = config.random_control_for(row["attack"])
        floors = row.get("floors", {})
        parts = []
        for name in ("random", config.control):
            if name in floors:
                f = floors[name]
                label = (f"{rc}-noise" if rc != TOKEN_CONTROL else "random-swap") if name == "random" and rc else name
                parts.append(
                    f"{'above' if f['exceeded'] else 'not clearly above'} the {label} floor {100 * f['mean']:.1f}%"
                )
        text = (
            f"{row['model']} {row['attack']} eps={row['eps']:g} damping={damping_label(row['damping'])}: flip rate "
            f"{_fmt_ci(row['flip_rate'])}"
        )
        if row["model"] in untrained:
            out.append(text + f" -- {row['model']} did not train: no claim")
            continue
        out.append(text + (f", {'; '.join(parts)}" if parts else ""))
        if len(config.top_ks) > 1:
            out.append(
                f"{row['model']} {row['attack']} eps={row['eps']:g} damping={damping_label(row['damping'])}: flip rate by "
                "top-k: " + ", ".join(f"k={e['top_k']} {_fmt_ci(e['flip_rate'])}" for e in row["by_top_k"])
            )
    for r in ratios:
        if r["attack"] not in ADVERSARIAL:
            continue
        text = _ratio_text(r)
        gate = r.get("loss_gate") or {}
        if gate.get("comparable") is False:
            text += (
                f" -- not compared: mean training losses {gate['numerator_loss']:.3g} vs {gate['denominator_loss']:.3g} "
                f"differ by more than {gate['factor']:g}x (train both to one loss, --match-loss)"
            )
        head = f"flip-rate ratio {r['numerator']}/{r['denominator']} ({r['attack']} eps={r['eps']:g} damping={damping_label(r['damping'])}): "
        bad = [m for m in (r["numerator"], r["denominator"]) if m in untrained]
        if bad:
            out.append(head + f"{text} -- {', '.join(bad)} did not train: no claim about which model is more malleable")
        else:
            out.append(head + text)
    if len(config.models) > 1 and (len(config.eps) > 1 or len(config.damping) > 1):
        if untrained:
            out.append(f"no ranking of models is read across eps/damping: {', '.join(untrained)} did not train")
        elif sensitivity["ranking_stable"]:
            out.append("the ranking of models by flip rate is the same at every eps and damping tried")
        else:
            flips = [s["attack"] for s in sensitivity["by_attack"] if not s["ranking_stable"]]
            out.append(
                f"the ranking of models by mean flip rate changes across eps/damping for: {', '.join(flips)} "
                "(compare the intervals before reading a reversal as real)"
            )
    for e in exceeded:
        out.append(
            f"FAIL: {e['model']} under {e['attack']} (eps={e['eps']:g}, damping={damping_label(e['damping'])}) has flip rate "
            f"{100 * e['flip_rate']:.1f}% > --max-flip-rate {100 * config.max_flip_rate:.1f}%"
            + (
                f" ({e['model']} did not train: the gate fires on the number, which says nothing about the model)"
                if e["model"] in untrained
                else ""
            )
        )
    return out


# --------------------------------------------------------------------------- presentation
def build_tables(result: MalleabilityResult) -> list:
    """Rich tables: per-cell stability, model ratios, training comparability."""
    from rich.table import Table

    cfg = result.config
    assert cfg.top_ks is not None  # MalleabilityConfig.__post_init__ sets it
    t = Table(
        title=(
            f"influence malleability: flip rate among the top-{cfg.top_k} of {result.n_train} samples by clean |influence| "
            + (
                f"(other k: {', '.join(map(str, cfg.top_ks[1:]))} in the JSON's by_top_k and the verdicts) "
                if len(cfg.top_ks) > 1
                else ""
            )
            + f"({cfg.protocol}, {cfg.estimator}; mean [{int(100 * cfg.confidence)}% Student-t CI; ratios Fieller] over {len(cfg.seeds)} seed(s))"
        )
    )
    t.caption = (
        f"above floor: the flip-rate interval lies entirely above the "
        f"{cfg.random_control + '-noise' if cfg.random_control else 'random-swap' if TOKEN_CONTROL in cfg.attacks else 'random-noise'} / "
        f"{cfg.control} control's"
    )
    s = Table(title="stability and attack strength (means over seeds)")
    after = {"retrain": "retrained acc", "finetune": "fine-tuned acc", "static": "model acc"}[cfg.protocol]
    s.caption = (
        f"strength: the attacked model's accuracy on the perturbed training data; {after}: held-out accuracy of "
        + {
            "retrain": "the model retrained on perturbed data",
            "finetune": "the copy fine-tuned on perturbed data",
            "static": "the saved model (static: nothing is retrained)",
        }[cfg.protocol]
    )
    floor_col = f"above floor random/{cfg.control}"
    for col in ("model", "attack", "eps", "damping", "flip rate [CI]", floor_col):
        t.add_column(col, justify="left" if col in ("model", "attack") else "right", no_wrap=col != floor_col)
    for col in ("model", "attack", "eps", "damping", "Spearman", "top-k overlap", "strength", after):
        s.add_column(col, justify="left" if col in ("model", "attack") else "right", no_wrap=col in ("model", "attack"))

    def mean(x: dict | None, pct: bool = True) -> str:
        if x is None or x["mean"] is None:
            return "-"
        return f"{100 * x['mean']:.1f}%" if pct else f"{x['mean']:.3f}"

    for row in result.summary:
        floors = row.get("floors")
        above = "-"
        if floors:
            above = "/".join(
                ("yes" if floors[k]["exceeded"] else "no") if k in floors else "-" for k in ("random", cfg.control)
            )
        key = (
            row["model"] + (" (untrained)" if row.get("untrained") else ""),
            row["attack"],
            "-" if row["eps"] is None else f"{row['eps']:g}",
            damping_label(row["damping"]),
        )
        t.add_row(*key, _fmt_ci(row["flip_rate"]), above)
        s.add_row(
            *key,
            mean(row["spearman"], pct=False),
            mean(row["top_k_overlap"]),
            mean(row.get("clean_model_accuracy_on_perturbed_train")),
            mean(row["perturbed_test_accuracy"]),
        )
    out = [t, s]
    if result.ratios:
        r = Table(title="flip-rate ratio between models (paired over seeds; Fieller interval, +inf = unbounded)")
        for col in ("ratio", "attack", "eps", "damping", "value", "interval", "losses comparable"):
            r.add_column(col, justify="right")
        for row in result.ratios:
            gate = (row.get("loss_gate") or {}).get("comparable")
            r.add_row(
                f"{row['numerator']}/{row['denominator']}",
                row["attack"],
                "-" if row["eps"] is None else f"{row['eps']:g}",
                damping_label(row["damping"]),
                "undefined" if row["ratio"] is None else f"{row['ratio']:.2f}",
                _ratio_interval_text(row),
                {True: "yes", False: "no", None: "-"}[gate],
            )
        out.append(r)
    tr = Table(
        title={
            "retrain": "training (clean models; "
            + ("the recorded recipe re-run" if cfg.saved_models else _optimizer_text(cfg))
            + ", mean over seeds"
            + ("; rows resampled per seed" if cfg.resample_data else "")
            + ")",
            "finetune": f"clean models (saved model fine-tuned {cfg.finetune_steps} steps, {cfg.finetune_optimizer} "
            f"lr {cfg.finetune_lr:g}; mean over seeds)",
            "static": "saved models as they are (no training)",
        }[cfg.protocol]
    )
    status = {r["model"]: r for r in result.model_status}
    for col in ("model", "final train loss", "train acc", "test acc", "steps", "reached --match-loss", "untrained?"):
        tr.add_column(col, justify="right")
    for model in cfg.models:
        rows = [x for x in result.training if x["model"] == model and x["role"] == "clean"]
        if not rows:  # every cell of this model failed (see failed_cells)
            tr.add_row(model, "-", "-", "-", "-", "-", "-")
            continue
        reached = [x["reached_match_loss"] for x in rows]
        tr.add_row(
            model,
            f"{np.mean([x['final_loss'] for x in rows]):.4g}",
            f"{100 * np.mean([x['train_accuracy'] for x in rows]):.1f}%",
            f"{100 * np.mean([x['test_accuracy'] for x in rows]):.1f}%",
            f"{np.mean([x['steps_run'] for x in rows]):.0f}",
            "-" if reached[0] is None else f"{sum(bool(v) for v in reached)}/{len(reached)}",
            ("yes" if status[model]["untrained"] else "no") + f" (< {100 * status[model]['threshold']:.1f}%)"
            if model in status
            else "-",
        )
    out.append(tr)
    return out


def _optimizer_text(cfg: MalleabilityConfig) -> str:
    lr = (
        ", ".join(f"{m} {cfg.lr_for(m):g}" for m in cfg.models)
        if isinstance(cfg.lr, dict)
        else f"{cfg.lr_for(cfg.models[0]):g}"
    )
    if cfg.optimizer == "gd":
        return f"full-batch GD, lr {lr}"
    return f"{cfg.optimizer}, lr {lr}, " + ("full batch" if cfg.batch_size is None else f"batch {cfg.batch_size}")


def plot_malleability(result: MalleabilityResult, path: str | Path, title: str = "") -> None:
    """Figure: clean vs perturbed influence per model (top-k and flips marked), flip-rate bars
    with intervals per attack and the reinit floor, and flip rate vs eps / damping when swept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result.config
    models = list(cfg.models)
    sweep = len(cfg.eps) > 1 or len(cfg.damping) > 1
    nrows = 3 if sweep else 2
    fig = plt.figure(figsize=(4.2 * max(len(models), 2), 3.8 * nrows), constrained_layout=True)
    grid = fig.add_gridspec(nrows, max(len(models), 2))
    primary = next((a for a in cfg.attacks if a in ADVERSARIAL), cfg.attacks[0])
    for j, model in enumerate(models):
        ax = fig.add_subplot(grid[0, j])
        pair = result.examples.get(model, {}).get(primary)
        if pair is None:
            ax.set_axis_off()
            continue
        c, p = pair
        idx = top_k_indices(c, cfg.top_k)
        flipped = idx[c[idx] * p[idx] < 0]
        ax.scatter(c, p, s=6, c="0.7", label="all samples")
        ax.scatter(c[idx], p[idx], s=12, c="tab:blue", label=f"top-{cfg.top_k} by clean |I|")
        ax.scatter(c[flipped], p[flipped], s=16, c="tab:red", label=f"flipped ({len(flipped)})")
        ax.axhline(0, c="k", lw=0.5)
        ax.axvline(0, c="k", lw=0.5)
        ax.set_xlabel("clean influence (negative = helpful)")
        ax.set_ylabel(f"perturbed influence ({primary})")
        ax.set_title(
            f"{model}, seed {cfg.seeds[0]}, eps={cfg.eps[0]:g}, damping={damping_label(cfg.damping[0])}", fontsize=9
        )
        ax.legend(fontsize=7, loc="best")
    ax = fig.add_subplot(grid[1, :])
    cells = [(a, e) for a, e in _cells(cfg) if a == cfg.control or a == "none" or e == cfg.eps[0]]
    width = 0.8 / len(models)
    for j, model in enumerate(models):
        means, lows, highs = [], [], []
        for attack, eps in cells:
            row = next(
                r
                for r in result.summary
                if r["model"] == model and r["attack"] == attack and r["eps"] == eps and r["damping"] == cfg.damping[0]
            )
            s = row["flip_rate"]
            m = s["mean"] if s["mean"] is not None else 0.0
            means.append(m)
            lows.append(m - (s["ci_low"] if s["ci_low"] is not None else m))
            highs.append((s["ci_high"] if s["ci_high"] is not None else m) - m)
        x = np.arange(len(cells)) + (j - (len(models) - 1) / 2) * width
        ax.bar(x, means, width, yerr=[lows, highs], capsize=3, label=model)
    ax.set_xticks(np.arange(len(cells)))
    ax.set_xticklabels([a if a in (cfg.control, "none") else f"{a}\neps={e:g}" for a, e in cells], fontsize=8)
    ax.set_ylabel(f"flip rate (top-{cfg.top_k})")
    ax.set_title(
        f"flip rate, mean and {int(100 * cfg.confidence)}% Student-t CI over {len(cfg.seeds)} seed(s); random and {cfg.control} are floors",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    if sweep:
        for k, (name, values) in enumerate((("eps", cfg.eps), ("damping", cfg.damping))):
            ax = fig.add_subplot(grid[2, k])
            for model in models:
                for attack in [a for a in cfg.attacks if a not in ("none",)]:
                    ys = []
                    for v in values:
                        at_eps, at_damping = (v, cfg.damping[0]) if name == "eps" else (cfg.eps[0], v)
                        row = next(
                            r
                            for r in result.summary
                            if r["model"] == model
                            and r["attack"] == attack
                            and r["eps"] == at_eps
                            and r["damping"] == at_damping
                        )
                        ys.append(row["flip_rate"]["mean"])
                    categorical = any(isinstance(v, str) for v in values)  # relative damping: one tick per value
                    xs = list(range(len(values))) if categorical else values
                    ax.plot(xs, [np.nan if y is None else y for y in ys], marker="o", label=f"{model} {attack}")
            if any(isinstance(v, str) for v in values):
                ax.set_xticks(list(range(len(values))))
                ax.set_xticklabels([damping_label(v) for v in values], fontsize=8)
            elif name == "damping" and min(float(v) for v in values) > 0:  # numbers only here
                ax.set_xscale("log")
            ax.set_xlabel(name)
            ax.set_ylabel("flip rate (mean over seeds)")
            fixed = f"damping={damping_label(cfg.damping[0])}" if name == "eps" else f"eps={cfg.eps[0]:g}"
            ax.set_title(f"flip rate vs {name} at {fixed}", fontsize=9)
            ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
