"""`malleability` as a request and a run: do influence scores flip sign when the training data is perturbed?

Built-in models (``models``, default relu,attn) are trained here on a held-out split of the data
and retrained on perturbed data (:mod:`attnaudit.analyses.malleability.malleability`); a saved
model (``checkpoint``/``factory``/``loaded_models``) is audited as it is (``protocol`` static),
fine-tuned (finetune) or retrained from its recorded recipe (retrain).

A preset (``quick``, ``paper``) chooses the data set, the sizes and the training budget;
every field a preset sets defaults to None, and an explicit value beats the preset
(:meth:`MalleabilityRequest.resolve_preset`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from attnaudit.analyses.influence.influence import damping_label, parse_damping
from attnaudit.analyses.influence.store import reporting
from attnaudit.analyses.malleability.attacks import TOKEN_ATTACKS
from attnaudit.analyses.malleability.config import (
    AUTO_MATCH,
    LM_LOSS,
    MalleabilityConfig,
    loss_name,
    loss_of,
    parse_per_model,
)
from attnaudit.analyses.malleability.lm_attacks import is_language_model
from attnaudit.analyses.malleability.malleability import SCHEMA, MalleabilityResult, run_malleability
from attnaudit.analyses.malleability.planning import check_executor, check_recipes, plan_memory, progress_total
from attnaudit.analyses.malleability.report import build_tables, plot_malleability
from attnaudit.analyses.request import (
    ANALYSIS,
    DATA,
    EXECUTION,
    OUTPUT,
    PROTOCOL,
    BuiltinNets,
    DeviceField,
    FieldError,
    HiddenWidth,
    PrecisionField,
    Request,
    SeedField,
    SplitRows,
    check_seeds,
    field_check,
    internal,
    list_of,
    option,
    redefault,
    show_list,
)
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DATASET_HELP, ModelFields, PresetData
from attnaudit.core.fit import DEFAULT_ADAM_LR
from attnaudit.core.lm_rows import widen
from attnaudit.core.precision import resolve_precision
from attnaudit.core.task import Task, head_parameter_names
from attnaudit.data import HoldoutRecipe, data_fingerprint, holdout_split, load_dataset, subset
from attnaudit.errors import AuditError
from attnaudit.models.builtin import training_data_mismatch
from attnaudit.models.checkpoints import audit_split, fit_to_data, rebuild_of
from attnaudit.report.envelope import build_report, check_target
from attnaudit.runtime.atomic import write_text_atomic
from attnaudit.runtime.device import resolve_device
from attnaudit.runtime.sweep import ExecutorConfig
from attnaudit.models.vit import n_parameters

DEFAULT_MODELS = ("relu", "attn")
#: settings of :class:`MalleabilityConfig` no option sets (the report's inputs leave them out; its config has them)
LIBRARY_SETTINGS = (
    "seeds",
    "parametrization",
    "attn_scaling",
    "confidence",
    "loss_gap_factor",
    "tracin_checkpoints",
    "max_exact_params",
    "cg_tol",
    "cg_max_iter",
)
DEFAULT_ATTACKS = ("pgd", "fgsm", "mim", "sign")

# Presets, in request terms: sizes chosen for run time on 2 CPU cores, never for what the
# result looks like.
_QUICK: dict[str, Any] = dict(
    dataset="digits",
    split="train",
    n_train=300,
    n_test=100,
    width=64,
    steps=300,
    lr=4.0,
    seeds=3,
    eps=(0.3,),
    damping=(1e-3,),
    top_k=(30,),
    pgd_steps=10,
    # a comparison the loss gate accepts: with fixed steps MLP-Attn ends at 2-5x 2L-ReLU's loss
    match_loss=AUTO_MATCH,
)
PRESETS: dict[str, dict[str, Any]] = {
    "quick": _QUICK,
    # quick's protocol at the paper's sizes, on MNIST; the paper's protocol: full-batch GD for a fixed time
    "paper": {
        **_QUICK,
        "dataset": "mnist",
        "n_train": 2000,
        "n_test": 500,
        "steps": 400,
        "seeds": 5,
        "top_k": (200,),
        "match_loss": "none",
    },
}


def _by_preset(key: str) -> str:
    """'Default: the preset's (quick 300, paper 2000).' for the help of a preset-set option."""

    def text(v: Any) -> str:
        return show_list(v) if isinstance(v, tuple) else str(v)

    shown = {name: text(p[key]) for name, p in PRESETS.items()}
    if len(set(shown.values())) == 1:
        return f"Default: the preset's ({next(iter(shown.values()))})."
    return "Default: the preset's (" + ", ".join(f"{name} {v}" for name, v in shown.items()) + ")."


# --------------------------------------------------------------------------- value parsers


def _number_or_models(value: Any, name: str) -> float | dict:
    """A number (every model) or {model: number}; ``"relu=10,attn=8"`` from the command line."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise FieldError(name, "{name}: " + f"{k}={v!r} is not a number")
            out[str(k)] = float(v)
        return out
    if isinstance(value, bool):
        raise FieldError(name, "{name} takes a value, not true/false")

    return field_check(name, parse_per_model, value)


def _lr(value: Any, name: str) -> float | dict:
    """``lr``: a number or model=value pairs."""
    parsed = _number_or_models(value, name)
    if parsed is None:  # "none": there is no training without a learning rate
        raise FieldError(name, "{name} needs a value")
    return parsed


def _match_loss(value: Any, name: str) -> float | dict | str:
    """``match_loss``: a number, model=value pairs, ``auto`` or ``none`` (kept as text, so an
    explicit none beats the preset's auto)."""
    if isinstance(value, str) and value.strip().lower() in (AUTO_MATCH, "none"):
        return value.strip().lower()
    parsed = _number_or_models(value, name)
    return "none" if parsed is None else parsed


def _show_number_or_models(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v!r}" for k, v in value.items())
    return repr(value) if isinstance(value, float) else str(value)


def _damping(value: Any, name: str) -> tuple:
    """``damping``: absolute numbers (1e-3) or multiples of lambda_max(H) (1e-3x), a comma list."""

    return tuple(field_check(name, parse_damping, d) for d in list_of(str)(value, name))


@dataclass(frozen=True)
class MalleabilityRequest(
    ModelFields, PresetData, SeedField, DeviceField, PrecisionField, BuiltinNets, SplitRows, HiddenWidth, Request
):
    """What ``attnaudit malleability`` computes; every field is one option (see :class:`Option`)."""

    COMMAND = "malleability"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS

    dataset: str | None = option(None, "--dataset", panel=DATA, help=DATASET_HELP + " " + _by_preset("dataset"))
    split: str | None = option(None, "--split", panel=DATA, help="train or test. " + _by_preset("split"))

    preset: str = redefault(
        BuiltinNets,
        "preset",
        help="quick (digits, < 2 min) or paper (MNIST 2,000 train, PGD eps 0.3, 5 seeds, controls). Explicit options override it.",
    )
    models: tuple[str, ...] | None = redefault(
        BuiltinNets,
        "models",
        help="Models to compare, e.g. relu,attn (ratios are over the first). Default: relu,attn (with --checkpoint: "
        "the saved models).",
    )
    attacks: tuple[str, ...] = option(
        DEFAULT_ATTACKS,
        "--attacks",
        panel=ANALYSIS,
        parse=list_of(str),
        help="pgd, fgsm, mim, sign (the default random control: +-eps per coordinate), random (uniform noise in the ball), "
        "none; on a text checkpoint these move the input embeddings, and hotflip (gradient-guided token swaps) with swap "
        "(random swaps, its control) edit the tokens.",
    )
    eps: tuple[float, ...] | None = option(
        None,
        "--eps",
        panel=ANALYSIS,
        parse=list_of(float),
        help="Attack radius, or a list (0.1,0.3) for a sensitivity sweep; on text embeddings relative to each token's "
        "embedding norm, for hotflip/swap the tokens swapped per text. " + _by_preset("eps"),
    )
    save_perturbed: str | None = option(
        None,
        "--save-perturbed",
        panel=OUTPUT,
        metavar="PATH",
        help="Write the training texts hotflip/swap edited here (JSON lines: model, seed, attack, eps, row index, "
        "label, the text before and after, each swap).",
    )
    overwrite: bool = internal(False)
    damping: tuple[float | str, ...] | None = option(
        None,
        "--damping",
        panel=ANALYSIS,
        parse=_damping,
        help="Hessian damping lambda in (H + lambda I)^-1: absolute (1e-3), or relative to the curvature (1e-3x = 1e-3 "
        "lambda_max(H), per model), or a list. " + _by_preset("damping"),
    )
    seeds: int | None = redefault(
        BuiltinNets,
        "seeds",
        help="Number of repeats (seeds seed, seed+1, ...): initialisation, attack randomness, data order (sgd/adam) and, "
        "with --resample-data, the training rows. " + _by_preset("seeds"),
    )
    protocol: str | None = option(
        None,
        "--protocol",
        panel=PROTOCOL,
        help="retrain (paper: retrain from the same init on perturbed data), static (keep the model; the default with "
        "--checkpoint) or finetune (fine-tune copies of a checkpoint on perturbed and on clean data, --finetune-steps).",
    )
    top_k: tuple[int, ...] | None = option(
        None,
        "--top-k",
        panel=ANALYSIS,
        parse=list_of(int),
        help="Flip rate among the top-k samples by clean |influence|; a list (10,30,100) reports each k (the first in "
        "the main columns). " + _by_preset("top_k"),
    )
    estimator: str | None = option(
        None,
        "--estimator",
        panel=ANALYSIS,
        help="exact, last-layer, cg, tracin, kfac, ekfac (Kronecker-factored, for transformers over all parameters) or "
        "projected (LoGra/TRAK: per-layer projected gradients, --proj-dim). Default: last-layer; projected for a "
        "language model (its output layer is the vocabulary's, often tied to the input embeddings).",
    )
    proj_dim: int = option(
        512,
        "--proj-dim",
        panel=ANALYSIS,
        help="Total projected dimension k of --estimator projected, shared between layers by --proj-split (k >= the "
        "tracked parameter count is exact).",
    )
    memory_budget: float = option(
        2048.0,
        "--memory-budget",
        panel=EXECUTION,
        help="MiB the influence estimator's planned tensors may take (factors, curvature, gradient chunks); "
        "a run that cannot fit is refused with the budget it needs.",
    )
    proj_split: str = option(
        "layer",
        "--proj-split",
        panel=ANALYSIS,
        help="How --estimator projected shares --proj-dim between linear layers: layer (LoGra's layout: an equal "
        "share per layer, square factors) or params (in proportion to parameter counts).",
    )
    cache: str | None = option(
        None,
        "--cache",
        panel=EXECUTION,
        metavar="PATH",
        help="Folder keeping the fitted K-FAC/EK-FAC factors, one file per model + training-data fingerprint, reused by later runs.",
    )
    store: str | None = option(
        None,
        "--store",
        panel=EXECUTION,
        metavar="PATH",
        help="Estimator projected: folder of the gradient store. Every training row's projected gradient (and its "
        "share of the curvature) is computed once per model, data, projection and precision and reused by later "
        "audits (another test set, attack or seed computes only the rows that changed). With --executor ray the "
        "missing rows are built on Ray workers (--ray-address joins a cluster, --jobs sets the tasks at once).",
    )
    curvature: str = option(
        "auto",
        "--curvature",
        panel=ANALYSIS,
        help="Curvature of --estimator kfac/ekfac: ggn (exact Gauss-Newton columns), fisher (labels sampled from the "
        "model, kronfluence's choice), empirical (the true labels' loss gradients) or auto (ggn up to 32 classes). "
        "With --estimator exact: auto is the Hessian, ggn the exact Gauss-Newton matrix (what K-FAC approximates). "
        "With --estimator projected: auto (ggn up to 32 classes, empirical above), ggn or empirical in the projected "
        "space, or galerkin (the Hessian from k Hessian-vector products: the previous, slower estimator).",
    )
    params: str | None = option(
        None,
        "--params",
        panel=ANALYSIS,
        help="Parameters the influence is over: head (default with last-layer), all, a module name or glob patterns "
        "(e.g. 'blocks.1.*'); exact/cg default to all.",
    )
    finetune_steps: int = option(
        100, "--finetune-steps", panel=PROTOCOL, help="Optimizer steps of --protocol finetune."
    )
    finetune_optimizer: str | None = option(
        None,
        "--finetune-optimizer",
        panel=PROTOCOL,
        help="gd, sgd or adam for --protocol finetune (default: the checkpoint's recorded optimizer, else adam).",
    )
    finetune_lr: float | None = option(
        None,
        "--finetune-lr",
        panel=PROTOCOL,
        kind=float,
        help="Learning rate of --protocol finetune (default: the checkpoint's recorded rate, else 1e-4).",
    )
    finetune_batch_size: int | None = option(
        None,
        "--finetune-batch-size",
        panel=PROTOCOL,
        kind=int,
        help="Mini-batch of --protocol finetune (default: recorded, else 64).",
    )
    norm: str = option("linf", "--norm", panel=ANALYSIS, help="linf or l2.")
    pgd_steps: int | None = option(
        None, "--pgd-steps", panel=ANALYSIS, kind=int, help="Steps of PGD and MIM. " + _by_preset("pgd_steps")
    )
    step_size: float | None = option(
        None,
        "--step-size",
        panel=ANALYSIS,
        kind=float,
        help="PGD/MIM step (default 2.5 eps/steps for PGD, eps/steps for MIM).",
    )
    n_train: int | None = redefault(SplitRows, "n_train", help="Training samples. " + _by_preset("n_train"))
    n_test: int | None = redefault(
        SplitRows,
        "n_test",
        help="Held-out samples whose summed loss the influence is measured on. " + _by_preset("n_test"),
    )
    queries: str | None = option(
        None,
        "--queries",
        panel=DATA,
        metavar="PATH",
        help="Language models: documents (.jsonl, .txt or a folder, read like --data) whose summed next-token loss "
        "the influence is measured on, instead of --n-test held-out documents.",
    )
    width: int | None = redefault(HiddenWidth, "width", help="Hidden width m. " + _by_preset("width"))
    lr: float | dict | None = option(
        None,
        "--lr",
        panel=PROTOCOL,
        kind=str,
        parse=_lr,
        show=_show_number_or_models,
        help="Learning rate, or per model (relu=10,attn=8). Default: the preset's (4) for gd/sgd, 1e-3 for adam.",
    )
    batch_size: int | None = redefault(
        BuiltinNets, "batch_size", help="Mini-batch of --optimizer sgd/adam (default: full batch)."
    )
    loss: str | None = redefault(
        BuiltinNets, "loss", help="mse or ce (default mse; a checkpoint's recorded training loss)."
    )
    match_loss: float | dict | str | None = option(
        None,
        "--match-loss",
        panel=PROTOCOL,
        kind=str,
        parse=_match_loss,
        show=_show_number_or_models,
        help="Train every model until its training loss reaches this value (or say it could not); per model "
        "(relu=0.1,attn=0.1); auto: every model to the largest clean loss any reaches within --steps (default of "
        "--preset quick); none: fixed steps (default of --preset paper).",
    )
    attn_context: str = option(
        "perturbed",
        "--attn-context",
        panel=PROTOCOL,
        help="MLP-Attn under retrain: rebuild X^T X from the perturbed data (perturbed) or keep the clean one (clean).",
    )
    controls: bool | None = option(
        None,
        "--controls",
        panel=PROTOCOL,
        kind=bool,
        negative="--no-controls",
        help="Run the training-randomness control: reinit (retrain on clean data from another init) or, under finetune, "
        "reorder (fine-tune on clean data in another order); off for static.",
    )
    max_flip_rate: float | None = option(
        None,
        "--max-flip-rate",
        panel=ANALYSIS,
        kind=float,
        help="Exit 1 when a model's mean flip rate under an attack exceeds this share (CI gate).",
    )

    seed: int = redefault(
        SeedField,
        "seed",
        help="First seed; also fixes the train/test split (each seed draws its own with --resample-data).",
    )
    optimizer: str | None = redefault(
        BuiltinNets,
        "optimizer",
        help="How built-in models are trained: gd (full-batch gradient descent, default), sgd or adam.",
    )
    steps: int | None = redefault(
        BuiltinNets, "steps", help="Optimizer steps (the budget under --match-loss). " + _by_preset("steps")
    )
    resample_data: bool = redefault(
        BuiltinNets,
        "resample_data",
        help="Each seed draws its own train/held-out rows (split seeded by that seed), so intervals include the choice "
        "of training rows.",
    )

    # ---- presets, validation and the resolved configuration
    def resolve_preset(self) -> dict[str, Any]:
        """Every option field's value, the preset filling the fields left None (explicit beats
        preset). ``dataset`` is filled only when no other data are given; ``match_loss`` only
        for built-in models (a saved model is not trained to a loss); ``lr`` is the preset's for
        gd/sgd and Adam's default rate for ``optimizer`` adam."""
        values = {name: getattr(self, name) for name in self.options()}
        preset = self.PRESETS[self.preset]
        for key, value in preset.items():
            if values[key] is not None:
                continue
            if key == "dataset" and (self.data is not None or self.loaded_data is not None):
                continue
            if key == "match_loss" and self.model_given:
                continue
            if key == "lr" and self.optimizer == "adam":
                value = DEFAULT_ADAM_LR
            values[key] = value
        return values

    def validate(self) -> None:
        for name in self.options():  # values given from Python take the form the command line gives them
            object.__setattr__(self, name, type(self).parse_value(name, getattr(self, name)))
        self.check_preset(self.preset)
        self.check_precision_field()
        values = self.resolve_preset()
        check_seeds(self.seed, values["seeds"])
        for name in ("n_train", "n_test"):
            if values[name] < 1:
                raise FieldError(name, "{name} must be a positive integer, got " + str(values[name]))
        if self.model_given:
            if self.models is not None:
                raise FieldError(
                    "models", "a checkpoint is audited as saved and {name} trains new ones; give one of them"
                )
            self.refuse_training()
            if self.resample_data:
                raise FieldError(
                    "resample_data",
                    "{name} draws new training rows per seed, which a saved model was not trained on; drop it",
                )
        elif self.protocol == "finetune":
            raise FieldError("protocol", "{name} finetune fine-tunes a saved model; give --checkpoint (or --factory)")
        if self.loaded_data is not None and self.resample_data:
            raise FieldError(
                "resample_data",
                "{name} draws each seed's rows from a data recipe; a request holding "
                "loaded data has none (give the data as dataset or data, or drop it)",
            )
        if self.save_perturbed is not None and not any(a in TOKEN_ATTACKS for a in self.attacks):
            raise FieldError(
                "save_perturbed",
                "{name} writes the texts hotflip/swap edited; add --attacks hotflip (and swap, its control)",
            )
        # every value the protocol takes, checked now (a saved model not loaded yet: its recorded
        # loss and fine-tuning recipe assumed); built-in models run from this configuration
        self.built_once(self._build)

    def resolve(self, loaded: dict | None = None) -> MalleabilityConfig:
        """The configuration the analysis runs from: the preset filled in, the seeds from ``seed``
        and ``seeds``, the protocol, controls, loss and fine-tuning recipe defaulted (for saved
        models from what they recorded: ``loaded`` is label -> LoadedModel, None before they are
        loaded), every value validated once. Built-in models: the one built at construction."""
        return self._build(loaded) if loaded else self.built_once(self._build)

    def _build(self, loaded: dict | None = None) -> MalleabilityConfig:
        values = self.resolve_preset()
        saved = self.model_given
        loaded = loaded or {}
        protocol = self.protocol if self.protocol is not None else ("static" if saved else "retrain")
        losses = {str(loss_name(lm.loss)) for lm in loaded.values() if lm.loss}
        if LM_LOSS in losses and (len(losses) > 1 or len(losses) < len(loaded)):
            raise FieldError("checkpoint", "{name} mixes a language model with classifiers; audit them separately")
        if self.queries is not None and (not self.model_given or (loaded and LM_LOSS not in losses)):
            raise FieldError(
                "queries", "{name} applies to language models (documents); a classifier's queries are its held-out rows"
            )
        if LM_LOSS in losses and self.loss is not None and self.loss != LM_LOSS:
            raise FieldError(
                "loss", "a language model's loss is its next-token cross-entropy; drop {name} " + str(self.loss)
            )
        recorded = next(iter(lm.recipe or {} for lm in loaded.values()), {})
        recorded_lr, recorded_batch = recorded.get("lr"), recorded.get("batch_size")
        match_loss = values["match_loss"]
        models = (tuple(loaded) or ("model",)) if saved else (self.models or DEFAULT_MODELS)
        # the largest saved model decides auto (None: built-in models, or saved ones not loaded yet)
        n_params = max((n_parameters(lm.module) for lm in loaded.values()), default=None)
        precision = resolve_precision(self.precision, n_params, resolve_device(self.device))
        return MalleabilityConfig(
            precision=precision.used,
            precision_asked=precision.asked,
            precision_reason=precision.reason,
            models=models,
            attacks=tuple(self.attacks),
            eps=tuple(values["eps"]),
            damping=tuple(values["damping"]),
            seeds=tuple(range(self.seed, self.seed + values["seeds"])),
            protocol=protocol,
            top_k=values["top_k"][0],
            top_ks=tuple(values["top_k"]),
            estimator=self.estimator or ("projected" if LM_LOSS in losses else "last-layer"),
            proj_dim=self.proj_dim,
            proj_split=self.proj_split,
            memory_budget=self.memory_budget,
            curvature=self.curvature,
            cache=self.cache,
            store=self.store,
            norm=self.norm,
            pgd_steps=values["pgd_steps"],
            step_size=self.step_size,
            width=values["width"],
            steps=values["steps"],
            lr=values["lr"],
            loss=self.loss or (losses.pop() if len(losses) == 1 else "mse"),
            match_loss=None if match_loss in (None, "none") else match_loss,
            optimizer=self.optimizer or "gd",
            batch_size=self.batch_size,
            resample_data=self.resample_data,
            attn_context=self.attn_context,
            controls=self.controls if self.controls is not None else (not saved or protocol != "static"),
            max_flip_rate=self.max_flip_rate,
            params=self.params,
            finetune_steps=self.finetune_steps,
            finetune_optimizer=self.finetune_optimizer
            or (recorded["optimizer"] if recorded.get("optimizer") in ("gd", "sgd", "adam") else "adam"),
            finetune_lr=self.finetune_lr
            if self.finetune_lr is not None
            else (float(recorded_lr) if isinstance(recorded_lr, (int, float)) else 1e-4),
            finetune_batch_size=self.finetune_batch_size
            if self.finetune_batch_size is not None
            else (int(recorded_batch) if isinstance(recorded_batch, int) else 64),
            saved_models=saved,
        )

    def to_argv(self) -> list[str]:
        # ``overwrite`` is an output permission (the CLI's --overwrite), not part of the protocol
        if self.overwrite:
            shown = copy.copy(self)  # not validated again
            object.__setattr__(shown, "overwrite", False)
            return shown.to_argv()
        return super().to_argv()


# --------------------------------------------------------------------------- the run


def run(
    request: MalleabilityRequest,
    *,
    progress: Progress | None = None,
    executor=None,
    notice: Callable[[str], None] | None = None,
) -> Result:
    """Run ``request``; the report is the one ``attnaudit malleability --json`` writes.

    ``executor``: an :class:`attnaudit.runtime.sweep.ExecutorConfig` (where the cells run;
    default this process). ``notice(text)``: told, before any training, what the run will do
    and the memory its influence computation needs. Failed cells are in ``failed_cells``.
    """
    progress = progress_or_silent(progress)
    if request.save_perturbed is not None:
        check_target(request.save_perturbed, request.overwrite)
    rows = _load(request, executor)
    config = rows.config
    dev = resolve_device(request.device)
    memory = plan_memory(config, rows.train.X, rows.test.n, rows.n_classes, rows.fixed)  # refuses before compute
    if notice is not None:
        notice(_notice(rows, memory))
    token_models = any(
        isinstance(m, Task) and (m.inputs.kind == "tokens" or is_language_model(m)) for m in (rows.fixed or {}).values()
    )
    value_range = None if token_models else rows.ds.value_range  # token ids have no value range to clip to
    t1 = time.perf_counter()
    with progress("malleability", progress_total(config), "trainings with influence") as advance, reporting(progress):
        result = run_malleability(
            rows.train.X.to(dev),
            rows.train.y.to(dev),
            rows.test.X.to(dev),
            rows.test.y.to(dev),
            rows.n_classes,
            config,
            value_range=value_range,
            progress=advance,
            fixed_models=rows.fixed,
            rebuild=rows.rebuild,
            executor=rows.executor,
            data=rows.recipe,
            memory=memory,
        )
    if rows.fixed and rows.audit_rows is not None and rows.audit_rows["rows"] != "checkpoint split":
        fingerprint = data_fingerprint(rows.train.X, rows.train.y)
        mismatch = (training_data_mismatch(lm, label, fingerprint) for label, lm in rows.loaded.items())
        result.warnings[:0] = [w for w in mismatch if w]
    timings = {"load": rows.load_seconds, **result.timings, "analysis": time.perf_counter() - t1}
    timings["total"] = time.perf_counter() - rows.t0
    perturbed_texts = None
    if request.save_perturbed is not None:
        tokenizer = request.tokenizer or request.checkpoint_tokenizer()
        perturbed_texts = write_edited_texts(request.save_perturbed, result.edits, rows.train.y, tokenizer)
    report = _report(request, rows, result, value_range, perturbed_texts, timings, dev)
    return _result(request, rows, result, report)


@dataclass
class _Rows:
    """What a run reads before any compute: the configuration, the training and held-out rows,
    the saved models (as tasks, with their recipes) and how long reading took."""

    config: MalleabilityConfig
    ds: Any
    train: Any
    test: Any
    n_classes: int
    loaded: dict
    fixed: dict | None
    rebuild: dict
    recipe: HoldoutRecipe | None
    audit_rows: dict | None
    executor: ExecutorConfig
    dataset: str | None
    split: str | None
    n_train: int  # as asked (a saved model's audit split may hold fewer rows)
    n_test: int
    t0: float
    load_seconds: float


def _load(request: MalleabilityRequest, executor: ExecutorConfig | None) -> _Rows:
    """The saved models (every file checked before any data are read), the configuration
    resolved from them, and the rows: the recipe's split, or the saved models' audit split."""
    values = request.resolve_preset()
    seed, ntr, nte = request.seed, values["n_train"], values["n_test"]
    loaded: dict = request.load_models() if request.model_given else {}
    config = request.resolve(loaded)
    rebuild = {}
    if loaded and config.protocol == "retrain":
        rebuild = {label: rb for label, rb in ((label, rebuild_of(lm)) for label, lm in loaded.items()) if rb}
        check_recipes(config, loaded, rebuild)
    dataset, split = values["dataset"], values["split"]
    spec = request.data_spec(seed, dataset=dataset, split=split) if request.loaded_data is None else None
    ex = executor if executor is not None else ExecutorConfig()
    if config.store is not None and ex.kind == "ray":
        # with a gradient store, Ray builds the store's rows: the cells run here, one after another
        config = dataclasses.replace(
            config, store_executor="ray", ray_address=ex.ray_address, store_workers=ex.jobs if ex.jobs > 1 else None
        )
        ex = dataclasses.replace(ex, kind="local", jobs=1, ray_address=None, gpus_per_cell=0.0)
    recipe = None if loaded or spec is None else HoldoutRecipe.of(spec, ntr, nte, seed, stratify=True)
    check_executor(ex, bool(loaded), recipe is not None)  # before any data are read
    ex.check_available()
    t0 = time.perf_counter()
    if recipe is not None:  # the rows every worker rebuilds from the recipe
        train_ds, test_ds = recipe.load()
        ds = train_ds
    elif loaded:
        ds = load_dataset(spec) if spec is not None else request.loaded_data
    else:  # loaded data, built-in models: the same split, in this process
        train_ds, test_ds = holdout_split(request.loaded_data, ntr, nte, seed, stratify=True)
        ds = train_ds
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; malleability needs labelled data (influence is defined on a loss)")
    fixed, audit_rows = None, None
    if loaded:
        loaded = {label: fit_to_data(lm, ds) for label, lm in loaded.items()}
        fixed = {label: lm.task(loss=loss_of(config.loss), params="all") for label, lm in loaded.items()}
        if config.loss == LM_LOSS:
            _check_tied_head(config, fixed)
        if request.queries is None:
            train_ds, test_ds, audit_rows = audit_split(ds, loaded, ntr, nte, seed)
        else:
            train_ds, test_ds, audit_rows = _with_queries(request, ds, ntr, seed)
        n_classes = next(iter(fixed.values())).n_classes
    else:
        n_classes = ds.n_classes
    return _Rows(
        config,
        ds,
        train_ds,
        test_ds,
        n_classes,
        loaded,
        fixed,
        rebuild,
        recipe,
        audit_rows,
        ex,
        dataset,
        split,
        ntr,
        nte,
        t0,
        time.perf_counter() - t0,
    )


def _with_queries(request: MalleabilityRequest, ds: Any, n_train: int, seed: int) -> tuple[Any, Any, dict]:
    """``n_train`` training documents of ``ds`` drawn with ``seed``, the ``queries`` documents as the
    held-out set (read like the data, with the checkpoint's tokenizer), both padded to one length
    (their rows travel together through the analyses), and the audit rows' note."""
    queries = load_dataset(dataclasses.replace(request.data_spec(seed), data=request.queries, n=None))
    train = subset(ds, min(n_train, ds.n), seed)
    L = max(train.d, queries.d) // 2
    assert train.y is not None and queries.y is not None  # documents always carry next-token targets
    train = dataclasses.replace(train, X=widen(train.X, L), y=widen(train.y, L))
    queries = dataclasses.replace(queries, X=widen(queries.X, L), y=widen(queries.y, L))
    note = {
        "rows": "queries file",
        "detail": f"{train.n} of the {ds.n} documents (seed {seed}); the queries are the {queries.n} documents of "
        f"{request.queries}",
        "queries": {"path": str(request.queries), "documents": queries.n, "sha256": queries.info.get("sha256")},
    }
    return train, queries, note


def _check_tied_head(config: MalleabilityConfig, fixed: dict) -> None:
    """Refuse the head-only influence of a language model whose output layer shares its weight with
    the input embeddings (GPT-2): the head then holds no parameter of its own to select."""
    if config.estimator != "last-layer" or config.params not in (None, "head"):
        return
    for label, task in fixed.items():
        trainable = {name for name, p in task.module.named_parameters() if p.requires_grad}
        if not trainable.intersection(head_parameter_names(task.module)):
            raise FieldError(
                "estimator",
                "{name} last-layer tracks the output layer, and "
                + label
                + "'s shares its weight with the input embeddings; use {name} projected (or ekfac) over every layer",
            )


def _notice(rows: _Rows, memory: dict) -> str:
    """What the run will do and the memory its influence runs need (said before any training)."""
    config = rows.config
    tracked = "; ".join(f"{arch}: {', '.join(names)}" for arch, names in memory["tracked_parameter_names"].items())
    total = progress_total(config)
    work = (
        {
            "static": "saved models, no training",
            "finetune": f"{total} fine-tunings",
            "retrain": f"{total} re-runs of the recorded recipe",
        }[config.protocol]
        if rows.fixed
        else f"{total} trainings"
    )
    return (
        f"malleability: {rows.ds.name} ({rows.split}), {rows.train.n} train / {rows.test.n} held-out, models "
        f"{','.join(config.models)}, attacks {','.join(config.attacks)}, {len(config.seeds)} seed(s), {work}; "
        f"{config.estimator} influence over {memory['tracked_parameters']:,} parameters ({tracked}) needs about "
        f"{memory['bytes']['total'] / 2**20:,.1f} MB"
    )


def _report(
    request: MalleabilityRequest,
    rows: _Rows,
    result: MalleabilityResult,
    value_range,
    perturbed_texts: dict | None,
    timings: dict,
    dev,
) -> dict:
    """The JSON report: the request's inputs, the seeds, the rows read and the result."""
    config = rows.config
    results = {
        "dataset": rows.train.info,
        "held_out": rows.test.info.get("holdout"),
        "perturbed_texts": perturbed_texts,
        "value_range": value_range,
        "audit_rows": rows.audit_rows,
        "checkpoints": {label: lm.source for label, lm in rows.loaded.items()} or None,
        # a language model has no accuracy: its losses and perplexities stand in for it
        **({"loss": "next-token cross-entropy"} if config.loss == LM_LOSS else {}),
        **result.to_dict(),
    }
    # the settings as resolved, without those no option sets (fixed in the library) and the seeds (below)
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in LIBRARY_SETTINGS}
    inputs = {
        "preset": request.preset,
        **request.preset_data_inputs(rows.dataset, rows.split),
        "split": rows.split,
        "n_train": rows.n_train,
        "n_test": rows.test.n if request.queries is not None else rows.n_test,
        "queries": request.queries,
        **settings,
        "saved_models": request.model_sources() or None,
        "execution": result.execution,
    }
    return build_report(
        SCHEMA,
        inputs=inputs,
        seeds={"seeds": list(config.seeds), "split_seed": request.seed, "reinit_seed_offset": 1_000_003},
        device=dev,
        dtype="float64",
        timings=timings,
        results=results,
        warnings=result.warnings,
        verdicts=result.verdicts,
        request=request,
    )


def _result(request: MalleabilityRequest, rows: _Rows, result: MalleabilityResult, report: dict) -> Result:
    """The :class:`Result`: the report, the tables, verdicts and warnings, and the figure."""
    from rich.text import Text

    renderables: list = build_tables(result)
    # Text, not markup strings: verdicts contain brackets ([low, high]) that are not rich tags.
    renderables.extend(Text(f"- {v}") for v in result.verdicts)
    renderables.extend(Text(f"warning: {w}", style="yellow") for w in result.warnings)
    config = rows.config
    title = f"{rows.ds.name}: {rows.train.n} train, {config.protocol}, {config.estimator}, {config.norm}"
    return Result(
        report,
        request,
        renderables=renderables,
        plot=lambda path: plot_malleability(result, path, title),
        png_name="malleability.png",
        failed_cells=list(result.failed_cells),
    )


def write_edited_texts(path: str, edits: list[dict], labels, tokenizer_path: str | None) -> dict:
    """Write the texts a token attack edited to ``path`` (JSON lines, atomically): per edited
    training row its model, seed, attack, eps (the token budget), row index, label, the text
    before and after (decoded with the tokenizer, special tokens left out; None without one)
    and each swap (position, token and id before and after). Returns what the report records."""
    from attnaudit.data.text import load_tokenizer

    tok = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    lines = []
    for block in edits:
        for text in block["texts"]:
            i = int(text["index"])
            swaps = text["swaps"]
            label = int(labels[i]) if labels.ndim == 1 else None  # documents have targets, not a label
            row = {k: block[k] for k in ("model", "seed", "attack", "eps")} | {"index": i, "label": label}
            if tok is not None:
                ids = list(text.get("ids") or [])
                row["text"] = tok.decode(ids, skip_special_tokens=True) if ids else None
                row["perturbed"] = tok.decode(_edited(ids, swaps), skip_special_tokens=True) if ids else None
            row["swaps"] = [
                {
                    "position": pos,
                    "from": tok.id_to_token(old) if tok is not None else None,
                    "to": tok.id_to_token(new) if tok is not None else None,
                    "from_id": old,
                    "to_id": new,
                }
                for pos, old, new in swaps
            ]
            lines.append(json.dumps(row, ensure_ascii=False))
    write_text_atomic(path, "".join(line + "\n" for line in lines))
    return {"path": str(path), "rows": len(lines), "tokenizer": tokenizer_path}


def _edited(ids: list[int], swaps: list) -> list[int]:
    out = list(ids)
    for pos, _, new in swaps:
        out[pos] = new
    return out


def exceeded_message(result: Result) -> str | None:
    """The ``max_flip_rate`` gate's message when a model's mean flip rate under an attack exceeds
    it (the command then exits 1), else None."""
    exceeded = result.results.get("exceeded") or []
    if not exceeded:
        return None

    limit = result.request.max_flip_rate
    worst = max(exceeded, key=lambda e: e["flip_rate"])
    names = "; ".join(
        f"{e['model']} under {e['attack']} (eps={e['eps']:g}, damping={damping_label(e['damping'])}): {100 * e['flip_rate']:.1f}%"
        for e in exceeded
    )
    return (
        f"flip rate above --max-flip-rate {100 * limit:.1f}% for {len(exceeded)} cell(s), "
        f"worst {worst['model']} under {worst['attack']}: {names}"
    )
