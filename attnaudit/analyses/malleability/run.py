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

import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from attnaudit.analyses.request import ANALYSIS, DATA, EXECUTION, OUTPUT, PROTOCOL, FieldError, Request, field_check
from attnaudit.analyses.request import internal, list_of
from attnaudit.analyses.request import check_seeds, option, show_list
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DATASET_HELP, ModelFields, PresetData
from attnaudit.core.task import Task
from attnaudit.errors import AuditError
from attnaudit.analyses.malleability.malleability import parse_per_model
from attnaudit.analyses.malleability.attacks import TOKEN_ATTACKS
from attnaudit.analyses.influence.influence import parse_damping
from attnaudit.analyses.malleability.malleability import AUTO_MATCH as LIB_AUTO, MalleabilityConfig
from attnaudit.analyses.malleability.malleability import (
    SCHEMA,
    build_tables,
    influence_memory_estimate,
    plot_malleability,
    progress_total,
    run_malleability,
)
from attnaudit.data import HoldoutRecipe, data_fingerprint, holdout_split, load_dataset
from attnaudit.report.envelope import build_report, check_target
from attnaudit.runtime.atomic import write_text_atomic
from attnaudit.runtime.device import resolve_device
from attnaudit.runtime.sweep import ExecutorConfig
from attnaudit.models.checkpoints import rebuild_of
from attnaudit.models.checkpoints import audit_split, fit_to_data
from attnaudit.models.builtin import training_data_mismatch
from attnaudit.analyses.influence.influence import damping_label
from attnaudit.core.fit import DEFAULT_ADAM_LR

DEFAULT_MODELS = ("relu", "attn")
DEFAULT_ATTACKS = ("pgd", "fgsm", "mim", "sign")
AUTO_MATCH = "auto"

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
class MalleabilityRequest(ModelFields, PresetData, Request):
    """What ``attnaudit malleability`` computes; every field is one option (see :class:`Option`)."""

    COMMAND = "malleability"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = PRESETS

    dataset: str | None = option(None, "--dataset", panel=DATA, help=DATASET_HELP + " " + _by_preset("dataset"))
    split: str | None = option(None, "--split", panel=DATA, help="train or test. " + _by_preset("split"))

    preset: str = option(
        "quick",
        "--preset",
        panel=PROTOCOL,
        help="quick (digits, < 2 min) or paper (MNIST 2,000 train, PGD eps 0.3, 5 seeds, controls). Explicit options override it.",
    )
    models: tuple[str, ...] | None = option(
        None,
        "--models",
        panel=PROTOCOL,
        parse=list_of(str),
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
    seeds: int | None = option(
        None,
        "--seeds",
        panel=PROTOCOL,
        kind=int,
        help="Number of repeats (seeds seed, seed+1, ...): initialisation, attack randomness, data order (sgd/adam) and, "
        "with --resample-data, the training rows. " + _by_preset("seeds"),
    )
    seed: int = option(
        0,
        "--seed",
        panel=PROTOCOL,
        help="First seed; also fixes the train/test split (each seed draws its own with --resample-data).",
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
    estimator: str = option(
        "last-layer",
        "--estimator",
        panel=ANALYSIS,
        help="exact, last-layer, cg, tracin, kfac, ekfac (Kronecker-factored, for transformers over all parameters) or "
        "projected (LoGra/TRAK: per-layer projected gradients, --proj-dim).",
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
    n_train: int | None = option(
        None, "--n-train", panel=PROTOCOL, kind=int, help="Training samples. " + _by_preset("n_train")
    )
    n_test: int | None = option(
        None,
        "--n-test",
        panel=PROTOCOL,
        kind=int,
        help="Held-out samples whose summed loss the influence is measured on. " + _by_preset("n_test"),
    )
    width: int | None = option(None, "--width", panel=PROTOCOL, kind=int, help="Hidden width m. " + _by_preset("width"))
    steps: int | None = option(
        None,
        "--steps",
        panel=PROTOCOL,
        kind=int,
        help="Optimizer steps (the budget under --match-loss). " + _by_preset("steps"),
    )
    lr: float | dict | None = option(
        None,
        "--lr",
        panel=PROTOCOL,
        kind=str,
        parse=_lr,
        show=_show_number_or_models,
        help="Learning rate, or per model (relu=10,attn=8). Default: the preset's (4) for gd/sgd, 1e-3 for adam.",
    )
    optimizer: str | None = option(
        None,
        "--optimizer",
        panel=PROTOCOL,
        help="How built-in models are trained: gd (full-batch gradient descent, default), sgd or adam.",
    )
    batch_size: int | None = option(
        None, "--batch-size", panel=PROTOCOL, kind=int, help="Mini-batch of --optimizer sgd/adam (default: full batch)."
    )
    resample_data: bool = option(
        False,
        "--resample-data",
        panel=PROTOCOL,
        negative="--fixed-data",
        help="Each seed draws its own train/held-out rows (split seeded by that seed), so intervals include the choice "
        "of training rows.",
    )
    loss: str | None = option(
        None, "--loss", panel=PROTOCOL, help="mse or ce (default mse; a checkpoint's recorded training loss)."
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
    device: str = option("auto", "--device", panel=EXECUTION, help="auto, cpu, cuda or cuda:<i>.")

    # ---- presets and validation
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
        values = self.resolve_preset()
        check_seeds(self.seed, values["seeds"])
        for name in ("n_train", "n_test"):
            if values[name] < 1:
                raise FieldError(name, "{name} must be a positive integer, got " + str(values[name]))
        if self.model_given:
            if self.models is not None:
                raise FieldError(
                    "models", "--checkpoint audits saved models and {name} trains new ones; give one of them"
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
        try:  # every value the protocol takes, checked now (models not loaded yet: recorded values assumed)
            _config_kw(self, values, None)
        except FieldError:
            raise
        except AuditError as exc:
            raise _named(exc, type(self)) from None

    def to_argv(self) -> list[str]:
        # ``overwrite`` is an output permission (the CLI's --overwrite), not part of the protocol
        if self.overwrite:
            return dataclasses.replace(self, overwrite=False).to_argv()
        return super().to_argv()


def _named(exc: AuditError, request_type: type[Request]) -> AuditError:
    """A library error naming a flag of ``request_type`` -> a :class:`FieldError` on that field
    (its text unchanged on the command line); other errors as they are."""
    text = str(exc)
    for match in re.finditer(r"--[a-z][a-z0-9-]*", text):
        flag = match.group()
        name = request_type.field_of(flag)
        if name is not None and request_type.flag_of(name) == flag:
            template = text.replace("{", "{{").replace("}", "}}")
            return FieldError(name, re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", "{name}", template))
    return exc


def _config_kw(request: MalleabilityRequest, values: dict, loaded: dict | None) -> dict:
    """The :class:`MalleabilityConfig` arguments (validated by building it): ``loaded`` is label ->
    LoadedModel for saved models, {} for built-in models, None before a saved model is loaded
    (its recorded loss and fine-tuning recipe are then assumed)."""

    saved = request.model_given
    loaded = loaded or {}
    protocol = request.protocol if request.protocol is not None else ("static" if saved else "retrain")
    controls = request.controls if request.controls is not None else (not saved or protocol != "static")
    loss = request.loss
    if loss is None:
        losses = {lm.loss for lm in loaded.values() if lm.loss}
        loss = losses.pop() if len(losses) == 1 else "mse"
    recorded = [lm.recipe or {} for lm in loaded.values()]
    first = recorded[0] if recorded else {}
    ft_optimizer = request.finetune_optimizer or (
        first.get("optimizer") if first.get("optimizer") in ("gd", "sgd", "adam") else "adam"
    )
    ft_lr = (
        request.finetune_lr
        if request.finetune_lr is not None
        else (float(first["lr"]) if isinstance(first.get("lr"), (int, float)) else 1e-4)
    )
    ft_batch = (
        request.finetune_batch_size
        if request.finetune_batch_size is not None
        else (int(first["batch_size"]) if isinstance(first.get("batch_size"), int) else 64)
    )
    match_loss = values["match_loss"]
    top_ks = tuple(values["top_k"])
    n_seeds = values["seeds"]
    if saved:
        models = tuple(loaded) if loaded else ("model",)
    else:
        models = request.models if request.models is not None else DEFAULT_MODELS
    kw = dict(
        models=models,
        attacks=tuple(request.attacks),
        eps=tuple(values["eps"]),
        damping=tuple(values["damping"]),
        seeds=tuple(range(request.seed, request.seed + n_seeds)),
        protocol=protocol,
        top_k=top_ks[0],
        top_ks=top_ks,
        estimator=request.estimator,
        proj_dim=request.proj_dim,
        proj_split=request.proj_split,
        memory_budget_mb=request.memory_budget,
        curvature=request.curvature,
        cache_dir=request.cache,
        norm=request.norm,
        pgd_steps=values["pgd_steps"],
        step_size=request.step_size,
        width=values["width"],
        steps=values["steps"],
        lr=values["lr"],
        loss=loss,
        match_loss=LIB_AUTO if match_loss == AUTO_MATCH else (None if match_loss in (None, "none") else match_loss),
        optimizer=request.optimizer if request.optimizer is not None else "gd",
        batch_size=request.batch_size,
        resample_data=request.resample_data,
        attn_context=request.attn_context,
        controls=controls,
        max_flip_rate=request.max_flip_rate,
        params=request.params,
        finetune_steps=request.finetune_steps,
        finetune_optimizer=ft_optimizer,
        finetune_lr=ft_lr,
        finetune_batch_size=ft_batch,
        saved_models=saved,
    )
    MalleabilityConfig(**kw)  # validates every value before any data is read
    return kw


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
    from rich.text import Text

    progress = progress_or_silent(progress)
    values = request.resolve_preset()
    seed, ntr, nte = request.seed, values["n_train"], values["n_test"]
    if request.save_perturbed is not None:
        check_target(request.save_perturbed, request.overwrite)
    loaded: dict = request.load_models() if request.model_given else {}  # every file checked before any data are read
    protocol = request.protocol if request.protocol is not None else ("static" if loaded else "retrain")
    rebuild = {}
    if loaded and protocol == "retrain":
        rebuild = {label: rb for label, rb in ((label, rebuild_of(lm)) for label, lm in loaded.items()) if rb}
        missing = [label for label in loaded if label not in rebuild]
        if missing:
            raise FieldError(
                "protocol",
                "{name} " + f"retrain re-runs a checkpoint's recorded training recipe, and {', '.join(missing)} "
                "records none (attnaudit train writes it); audit it as it is (--protocol static) or fine-tune "
                "it (--protocol finetune --finetune-steps N)",
            )
    kw = _config_kw(request, values, loaded)
    config = MalleabilityConfig(**kw)
    dev = resolve_device(request.device)
    ds_name = values["dataset"]
    split_name = values["split"]
    spec = request.data_spec(seed, dataset=ds_name, split=split_name) if request.loaded_data is None else None

    ex = executor if executor is not None else ExecutorConfig()
    if loaded and (ex.kind != "local" or ex.jobs > 1 or ex.resume_dir):
        raise AuditError("saved models are audited in this process; drop --executor ray / --jobs / --resume")
    ex.check_available()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    recipe = None if loaded or spec is None else HoldoutRecipe.of(spec, ntr, nte, seed, stratify=True)
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
    fixed = None
    rows_note = None
    if loaded:
        loaded = {label: fit_to_data(lm, ds) for label, lm in loaded.items()}
        fixed = {label: lm.task(loss=config.loss, params="all") for label, lm in loaded.items()}
        train_ds, test_ds, rows_note = audit_split(ds, loaded, ntr, nte, seed)
        n_classes = next(iter(fixed.values())).n_classes
    else:
        n_classes = ds.n_classes
    timings["load"] = time.perf_counter() - t0
    memory = influence_memory_estimate(
        config, train_ds.d, n_classes, train_ds.n, test_ds.n, fixed, train_ds.X[:1], train_ds.X
    )  # refuses before compute
    if notice is not None:
        tracked = "; ".join(f"{arch}: {', '.join(names)}" for arch, names in memory["tracked_parameter_names"].items())
        work = (
            {
                "static": "saved models, no training",
                "finetune": f"{progress_total(config)} fine-tunings",
                "retrain": f"{progress_total(config)} re-runs of the recorded recipe",
            }[config.protocol]
            if fixed
            else f"{progress_total(config)} trainings"
        )
        notice(
            f"malleability: {ds.name} ({split_name}), {train_ds.n} train / {test_ds.n} held-out, models {','.join(config.models)}, "
            f"attacks {','.join(config.attacks)}, {len(config.seeds)} seed(s), {work}; "
            f"{config.estimator} influence over {memory['tracked_parameters']:,} parameters "
            f"({tracked}) needs about "
            f"{memory['bytes']['total'] / 2**20:,.1f} MB"
        )
    token_models = any(isinstance(m, Task) and m.inputs.kind == "tokens" for m in (fixed or {}).values())
    t1 = time.perf_counter()
    with progress("malleability", progress_total(config), "trainings with influence") as advance:
        result = run_malleability(
            train_ds.X.to(dev),
            train_ds.y.to(dev),
            test_ds.X.to(dev),
            test_ds.y.to(dev),
            n_classes,
            config,
            value_range=None if token_models else ds.value_range,  # token ids have no value range to clip to
            progress=advance,
            fixed_models=fixed,
            rebuild=rebuild,
            executor=ex,
            data=recipe,
        )
    if fixed and rows_note is not None and rows_note["rows"] != "checkpoint split":  # rows_note: set with fixed
        fingerprint = data_fingerprint(train_ds.X, train_ds.y)
        result.warnings[:0] = [
            w for w in (training_data_mismatch(lm, label, fingerprint) for label, lm in loaded.items()) if w
        ]
    timings.update({k: v for k, v in result.timings.items()})
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0

    perturbed_texts = None
    if request.save_perturbed is not None:
        perturbed_texts = write_edited_texts(
            request.save_perturbed, result.edits, train_ds.y, request.tokenizer or request.checkpoint_tokenizer()
        )
    results = {
        "dataset": train_ds.info,
        "held_out": test_ds.info.get("holdout"),
        "perturbed_texts": perturbed_texts,
        "value_range": None if token_models else ds.value_range,
        "audit_rows": rows_note,
        "checkpoints": {label: lm.source for label, lm in loaded.items()} or None,
        **result.to_dict(),
    }
    data_inputs = {**request.preset_data_inputs(ds_name, split_name), "split": split_name}
    report = build_report(
        SCHEMA,
        inputs={
            "preset": request.preset,
            **data_inputs,
            "n_train": ntr,
            "n_test": nte,
            **{k: v for k, v in kw.items() if k != "seeds"},
            "loss": config.loss,
            "saved_models": request.model_sources() or None,
            "execution": result.execution,
        },
        seeds={"seeds": list(config.seeds), "split_seed": seed, "reinit_seed_offset": 1_000_003},
        device=dev,
        dtype="float64",
        timings=timings,
        results=results,
        warnings=result.warnings,
        verdicts=result.verdicts,
        request=request,
    )
    renderables: list = build_tables(result)
    # Text, not markup strings: verdicts contain brackets ([low, high]) that are not rich tags.
    renderables.extend(Text(f"- {v}") for v in result.verdicts)
    renderables.extend(Text(f"warning: {w}", style="yellow") for w in result.warnings)
    title = f"{ds.name}: {train_ds.n} train, {config.protocol}, {config.estimator}, {config.norm}"
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
            row = {k: block[k] for k in ("model", "seed", "attack", "eps")} | {"index": i, "label": int(labels[i])}
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
