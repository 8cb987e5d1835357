"""`train` as a request and a run: train a built-in model on a data set and save an auditable checkpoint.

:func:`run` builds the model (:func:`attnaudit.models.builtin.build_builtin`), trains it
(:func:`attnaudit.core.fit.fit`) and saves it (:func:`attnaudit.models.builtin.save_model`).
The side-car records the training data (with the seeded holdout split and a fingerprint of
the training rows) and the recipe, so a later audit can rebuild the exact split and re-run
the training. The training defaults depend on the architecture's family
(:attr:`TrainRequest.PRESETS`; docs/train.md explains each choice).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from attnaudit.analyses.request import (
    MODEL,
    OUTPUT,
    PROTOCOL,
    DeviceField,
    FieldError,
    Request,
    SeedField,
    field_check,
    internal,
    literal,
    option,
    redefault,
    LearningRate,
    BatchSize,
    Epochs,
    LossField,
    SplitRows,
    TrainingDtype,
)
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DataFields
from attnaudit.core.recipes import MINI_BATCH, TWO_LAYER_DEFAULTS, VIT_DEFAULTS
from attnaudit.errors import AuditError, check_seed
import torch
from attnaudit import __version__
from attnaudit.core.fit import build_tables, fit, plot_fit
from attnaudit.data import data_fingerprint
from attnaudit.models.builtin import TwoLayerNet, build_builtin, image_shape_of, save_model
from attnaudit.models.vit import ViT
from attnaudit.models.vit import default_patch, n_parameters
from attnaudit.report.envelope import build_report, to_jsonable
from attnaudit.runtime.device import resolve_device
from attnaudit.models.builtin import BUILTIN_ARCHITECTURES
from attnaudit.core.fit import Recipe
from attnaudit.report.envelope import check_target
from attnaudit.data import load_dataset
from attnaudit.data import holdout_split

SCHEMA = "attnaudit.train/1"
PNG_NAME = "train.png"

VIT_ARCHS = ("vit", "vit-linear")
TWO_LAYER_ARCHS = ("relu", "attn")
DTYPES = ("float32", "float64")
VIT_SIZES = ("depth", "dim", "heads", "patch", "mlp_ratio")


@dataclass(frozen=True)
class TrainingPlan:
    """What ``attnaudit train`` runs, resolved once from a :class:`TrainRequest`.

    ``arch``: the architecture (lower case); ``sizes``: the model's sizes (ViT: depth, dim,
    heads, mlp_ratio; relu/attn: width), the patch being chosen from the images by the run;
    ``dtype``: ``float32`` or ``float64``; ``recipe``: how it is trained; ``device``: where.
    """

    arch: str
    sizes: dict
    dtype: str
    recipe: Recipe
    device: torch.device


@dataclass(frozen=True)
class TrainRequest(
    DataFields, SeedField, DeviceField, TrainingDtype, SplitRows, LossField, Epochs, BatchSize, LearningRate, Request
):
    """What ``attnaudit train`` trains and where it saves it; every field is one option.

    Fields left None take the default of the architecture's family (:attr:`PRESETS`,
    filled by :meth:`resolved`; an explicit value beats the preset); :meth:`resolve` gives the
    :class:`TrainingPlan` the run trains from. ``overwrite``
    (no option of its own: the CLI's ``--overwrite``) allows replacing an existing
    checkpoint at ``out_path``.
    """

    COMMAND = "train"
    # family -> its training defaults; the family is chosen by ``arch`` (see FAMILIES)
    PRESETS: ClassVar[dict[str, dict]] = {"vit": VIT_DEFAULTS, "two-layer": TWO_LAYER_DEFAULTS}
    FAMILIES: ClassVar[dict[str, str]] = {**{a: "vit" for a in VIT_ARCHS}, **{a: "two-layer" for a in TWO_LAYER_ARCHS}}

    out_path: str | None = option(
        None,
        "--out",
        panel=OUTPUT,
        metavar="PATH",
        help="The checkpoint to write (.safetensors); its side-car PATH.json is written beside it. Existing files are "
        "kept unless --overwrite.",
    )
    arch: str = option(
        "vit",
        "--arch",
        panel=MODEL,
        help="relu (2L-ReLU), attn (MLP-Attn), vit (softmax attention) or vit-linear (linearized attention).",
    )
    width: int | None = option(None, "--width", panel=MODEL, kind=int, help="Hidden width m of relu/attn (default 64).")
    depth: int | None = option(None, "--depth", panel=MODEL, kind=int, help="ViT blocks (default 2).")
    dim: int | None = option(None, "--dim", panel=MODEL, kind=int, help="ViT token width (default 64).")
    heads: int | None = option(
        None, "--heads", panel=MODEL, kind=int, help="ViT attention heads; must divide --dim (default 4)."
    )
    patch: int | None = option(
        None,
        "--patch",
        panel=MODEL,
        kind=int,
        help="ViT patch size; must divide the image height and width (default: the largest leaving >= 16 tokens).",
    )
    mlp_ratio: int | None = option(
        None, "--mlp-ratio", panel=MODEL, kind=int, help="ViT MLP hidden width / --dim (default 2)."
    )
    optimizer: str | None = option(
        None,
        "--optimizer",
        panel=PROTOCOL,
        help="gd (full batch), sgd or adam (default: adam for ViTs, gd for relu/attn).",
    )
    lr: float | None = redefault(
        LearningRate, "lr", help="Learning rate (default: 1e-3 for adam on ViTs, 4.0 for gd on relu/attn)."
    )
    batch_size: int | None = redefault(
        BatchSize, "batch_size", help="Rows per step for sgd/adam (default 64); gd always uses every row."
    )
    epochs: int | None = redefault(
        Epochs, "epochs", help="Passes over the training rows (ViT default 5); give --epochs or --steps."
    )
    steps: int | None = option(
        None,
        "--steps",
        panel=PROTOCOL,
        kind=int,
        help="Optimizer steps, counted across epochs (relu/attn default 300).",
    )
    loss: str | None = redefault(LossField, "loss", help="ce or mse (default: ce for ViTs, mse for relu/attn).")
    momentum: float = option(0.0, "--momentum", panel=PROTOCOL, help="SGD momentum (sgd only).")
    weight_decay: float = option(0.0, "--weight-decay", panel=PROTOCOL, help="L2 weight decay.")
    seed: int = redefault(SeedField, "seed", help="Initialisation, mini-batch order and held-out split.")
    n_train: int | None = redefault(SplitRows, "n_train", help="Training rows (default: every row not held out).")
    n_test: int | None = redefault(
        SplitRows, "n_test", help="Held-out rows for the accuracy (default: min(1000, n/5))."
    )
    dtype: str | None = redefault(
        TrainingDtype, "dtype", help="float32 or float64 (default: float32 for ViTs, float64 for relu/attn)."
    )
    overwrite: bool = internal(False)

    # ---- the protocol
    @property
    def arch_key(self) -> str:
        return str(self.arch).strip().lower()

    @property
    def is_vit(self) -> bool:
        return self.arch_key in VIT_ARCHS

    @property
    def preset(self) -> dict:
        """The training defaults of ``arch``'s family."""
        return self.PRESETS[self.FAMILIES.get(self.arch_key, "vit")]

    def validate(self) -> None:

        arch = self.arch_key
        if arch not in BUILTIN_ARCHITECTURES:
            raise FieldError(
                "arch",
                "unknown {name} " + literal(repr(self.arch)) + f"; use one of {', '.join(BUILTIN_ARCHITECTURES)}",
            )
        misplaced = (
            [f for f in VIT_SIZES if getattr(self, f) is not None]
            if not self.is_vit
            else (["width"] if self.width is not None else [])
        )
        if misplaced:
            family = "the 2-layer nets (relu, attn)" if self.is_vit else "the transformers (vit, vit-linear)"
            also = f" (so do {', '.join(misplaced[1:])})" if misplaced[1:] else ""
            raise FieldError(
                misplaced[0], f"{{name}} sets the size of {family}, not of arch {literal(arch)}; drop it{also}"
            )
        for name in ("width", *VIT_SIZES, "n_train", "n_test"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FieldError(name, "{name} must be a positive integer, got " + literal(value))
        field_check("seed", check_seed, self.seed)
        p = self.preset
        if (self.dtype or p["dtype"]).strip().lower() not in DTYPES:
            raise FieldError("dtype", "unknown {name} " + literal(repr(self.dtype)) + "; use float32 or float64")
        opt_name = (self.optimizer or p["optimizer"]).strip().lower()
        if self.lr is None and opt_name != p["optimizer"]:
            raise FieldError(
                "lr",
                f"optimizer {literal(opt_name)} needs {{name}}: the default learning rate {p['lr']:g} "
                f"is the one for {p['optimizer']} on arch {literal(arch)}",
            )
        self.recipe()  # validates every training value before any data are read
        if self.out_path is not None and Path(self.out_path).suffix.lower() != ".safetensors":
            raise FieldError(
                "out_path",
                "{name} "
                + literal(Path(self.out_path))
                + ": checkpoints are safetensors files; give a path ending in .safetensors",
            )

    def _preset_values(self) -> dict:
        """The resolved values of the fields the family's preset fills (explicit beats preset)."""
        p = self.preset
        opt_name = (self.optimizer or p["optimizer"]).strip().lower()
        if self.epochs is None and self.steps is None:
            epochs, steps = p.get("epochs"), p.get("steps")
        else:
            epochs, steps = self.epochs, self.steps
        values: dict[str, Any] = {
            "arch": self.arch_key,
            "optimizer": opt_name,
            "lr": self.lr if self.lr is not None else p["lr"],
            "batch_size": self.batch_size
            if self.batch_size is not None
            else (None if opt_name == "gd" else MINI_BATCH),
            "epochs": epochs,
            "steps": steps,
            "loss": (self.loss or p["loss"]).strip().lower(),
            "dtype": (self.dtype or p["dtype"]).strip().lower(),
        }
        # the patch size depends on the images: resolved by run() from the data
        sizes = ("depth", "dim", "heads", "mlp_ratio") if self.is_vit else ("width",)
        values.update({k: getattr(self, k) if getattr(self, k) is not None else p[k] for k in sizes})
        return values

    def resolved(self) -> TrainRequest:
        """This request with every None training field filled from its family's preset
        (``patch``, ``n_train`` and ``n_test`` depend on the data and stay as given)."""
        return dataclasses.replace(self, **self._preset_values())

    def recipe(self) -> Recipe:
        """The :class:`attnaudit.core.fit.Recipe` this request trains with (validated: a refused
        value is a :class:`FieldError` on the request's field of the same name)."""

        v = self._preset_values()
        return Recipe(
            optimizer=v["optimizer"],
            lr=v["lr"],
            batch_size=v["batch_size"],
            epochs=v["epochs"],
            steps=v["steps"],
            loss=v["loss"],
            seed=self.seed,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
        )

    def resolve(self) -> TrainingPlan:
        """The plan the run trains from: the family's defaults filled, the recipe built, the device resolved."""
        v = self._preset_values()
        sizes = ("depth", "dim", "heads", "mlp_ratio") if self.is_vit else ("width",)
        return TrainingPlan(
            arch=v["arch"],
            sizes={k: v[k] for k in sizes},
            dtype=v["dtype"],
            recipe=self.recipe(),
            device=resolve_device(self.device),
        )

    # ---- the checkpoint
    def checkpoint_paths(self) -> tuple[Path, Path]:
        """(checkpoint, side-car) this request writes."""
        if self.out_path is None:
            raise FieldError("out_path", "{name} is required: the checkpoint to write, e.g. {name} model.safetensors")
        target = Path(self.out_path)
        return target, target.with_suffix(target.suffix + ".json")

    def check_out(self) -> None:
        """Refuse a checkpoint path that cannot be written, or that would replace a file unless ``overwrite``."""

        for path in self.checkpoint_paths():
            if path.is_file() and not self.overwrite:
                raise FieldError("overwrite", f"{literal(path)} already exists; pass {{name}} or choose another path")
            check_target(path, True)

    def check(self) -> None:
        """The dry run: the checkpoint path, the device, the data and the held-out split (nothing is trained)."""

        self.check_out()
        resolve_device(self.device)
        ds, _ = self._load()
        self._split(ds)

    def to_argv(self) -> list[str]:
        # ``overwrite`` is an output permission (the CLI's --overwrite), not part of what is trained
        if self.overwrite:
            return dataclasses.replace(self, overwrite=False).to_argv()
        return super().to_argv()

    # ---- the data
    def _load(self):
        """(data set, its DataSpec or None for loaded data); the data must be labelled images for a ViT."""

        spec = None
        if self.loaded_data is None:
            spec = self.data_spec(self.seed)
            ds = load_dataset(spec)
        else:
            ds = self.loaded_data
        if ds.y is None:
            raise AuditError(f"{ds.name} has no labels; training a classifier needs labelled data")
        if self.is_vit:
            image_shape_of(ds.feature_shape, self.arch_key)  # refuses flat data before anything else
        return ds, spec

    def _split(self, ds):
        """(training rows, held-out rows) of ``ds``: the seeded, stratified holdout split."""

        nte = self.n_test if self.n_test is not None else min(1000, ds.n // 5)
        if nte < 1:
            raise FieldError(
                "n_test",
                f"{literal(ds.name)} has only {ds.n} rows, too few to hold any out; give {{name}} or more data",
            )
        ntr = self.n_train if self.n_train is not None else ds.n - nte
        if ntr < 1:
            raise FieldError("n_test", "{name} " + f"{nte} leaves no training rows of the {ds.n}; lower {{name}}")
        return holdout_split(ds, ntr, nte, seed=self.seed, stratify=True)


def run(request: TrainRequest, *, progress: Progress | None = None, executor=None) -> Result:
    """Train and save the model ``request`` describes; the report is the one ``attnaudit train --json`` writes.

    Refuses to replace an existing checkpoint (or side-car) unless ``request.overwrite``.
    ``executor`` is accepted for the common signature; training runs here.
    """
    from rich.text import Text

    progress = progress_or_silent(progress)
    target, sidecar = request.checkpoint_paths()
    request.check_out()
    plan = request.resolve()
    recipe, arch_key, dtype_name, seed, dev = plan.recipe, plan.arch, plan.dtype, request.seed, plan.device

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    ds, spec = request._load()
    train_ds, test_ds = request._split(ds)
    timings["load"] = time.perf_counter() - t0

    sizes = dict(plan.sizes)
    if request.is_vit:
        patch = request.patch
        sizes["patch"] = patch if patch is not None else default_patch(image_shape_of(ds.feature_shape, arch_key))
    model = build_builtin(
        arch_key,
        n_out=ds.n_classes,
        feature_shape=ds.feature_shape,
        X_train=train_ds.X,
        seed=seed,
        dtype=getattr(torch, dtype_name),
        device=dev,
        **sizes,
    )
    assert isinstance(model, (TwoLayerNet, ViT))  # every built-in architecture is one of these
    parameters = n_parameters(model)
    total_steps = recipe.total_steps(train_ds.n)
    split_name = spec.split if spec is not None else "in-memory"
    headline = (
        f"train: {arch_key} ({parameters:,} parameters, {dtype_name}) on {ds.name} ({split_name}), "
        f"{train_ds.n} train / {test_ds.n} held-out rows, {recipe.optimizer} lr {recipe.lr:g}"
        + (f", batch {recipe.batch_rows(train_ds.n)}" if recipe.optimizer != "gd" else ", full batch")
        + f", {total_steps} steps, {recipe.loss} loss, seed {seed}, device {dev}"
    )
    t1 = time.perf_counter()
    with progress(f"train {arch_key}", total_steps, "") as advance:
        result = fit(model, train_ds.X, train_ds.y, recipe, X_val=test_ds.X, y_val=test_ds.y, progress=advance)
    timings["train"] = time.perf_counter() - t1
    if result.diverged:
        raise FieldError(
            "lr",
            f"training diverged: the loss became non-finite at step {result.steps_run + 1} of "
            f"{total_steps} ({{name}} {recipe.lr:g}); nothing was saved; lower {{name}}",
        )

    metrics = {k: v for k, v in result.to_dict().items() if k != "loss_curve"}
    training_data = {
        "name": ds.name,
        "dataset": spec.dataset if spec is not None and spec.data is None else None,
        "data": spec.data if spec is not None else None,
        # As typed (not resolved): where the data lived when the model was trained, a
        # hint for rebuilding the split; the fingerprint is what identifies the rows.
        "data_dir": spec.data_dir if spec is not None else None,
        "split": spec.split if spec is not None and spec.data is None else None,
        "classes": list(spec.classes) if spec is not None and spec.classes is not None else None,
        "preprocess": spec.preprocess if spec is not None else None,
        "n": train_ds.n,
        "n_classes": ds.n_classes,
        "feature_shape": list(ds.feature_shape),
        "value_range": list(ds.value_range) if ds.value_range is not None else None,
        "fingerprint": data_fingerprint(train_ds.X, train_ds.y),
        "holdout": {"n_train": train_ds.n, "n_test": test_ds.n, "seed": seed, "stratify": True},
    }
    metadata = {
        "attnaudit_version": __version__,
        "command": "train",
        "training_data": training_data,
        "recipe": recipe.to_dict(),
        "init_seed": seed,
        "metrics": metrics,
    }
    t2 = time.perf_counter()
    save_model(model, target, overwrite=request.overwrite, metadata=to_jsonable(metadata))
    timings["save"] = time.perf_counter() - t2
    timings["total"] = time.perf_counter() - t0

    chance = 1.0 / ds.n_classes if ds.n_classes else float("nan")
    verdicts = []
    if result.val_accuracy is not None:
        verdicts.append(
            f"held-out accuracy {100 * result.val_accuracy:.1f}% on {test_ds.n} rows "
            f"(chance {100 * chance:.0f}%); training accuracy {100 * result.train_accuracy:.1f}%"
        )
    model_info = {
        "arch": arch_key,
        "parameters": parameters,
        "dtype": dtype_name,
        "path": str(target),
        "sidecar": str(sidecar),
        "spec": to_jsonable(model.spec),
        "sizes": sizes,
    }
    report = build_report(
        SCHEMA,
        inputs={
            **request.data_inputs(),
            "arch": arch_key,
            "out": str(target),
            "n_train": train_ds.n,
            "n_test": test_ds.n,
            "dtype": dtype_name,
            **sizes,
        },
        seeds={"seed": seed, "init_seed": seed, "data_order_seed": recipe.seed, "holdout_seed": seed},
        device=dev,
        dtype=dtype_name,
        timings=timings,
        results={
            "checkpoint": model_info,
            "dataset": train_ds.info,
            "held_out": test_ds.info.get("holdout"),
            "training_data": training_data,
            "recipe": recipe.to_dict(),
            "fit": result.to_dict(),
        },
        warnings=result.notes,
        verdicts=verdicts,
        request=request,
    )
    renderables: list = [Text(headline), *build_tables(result, model_info)]
    renderables.extend(Text(f"- {v}") for v in verdicts)
    renderables.append(Text(f"checkpoint written to {target} (side-car {sidecar.name})"))
    title = f"{arch_key} on {ds.name}: {recipe.optimizer} lr {recipe.lr:g}, {result.steps_run} steps"
    return Result(
        report, request, renderables=renderables, plot=lambda p: plot_fit(result, p, title), png_name=PNG_NAME
    )
