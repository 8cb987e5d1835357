"""`attnaudit train`: train a built-in model on a data set and save an auditable checkpoint.

Thin CLI over :func:`attnaudit.models.builtin.build_builtin`, :func:`attnaudit.core.fit.fit` and
:func:`attnaudit.models.builtin.save_model`. The side-car records the training data (with the
seeded holdout split and a fingerprint of the training rows) and the recipe, so a later
audit can rebuild the exact split and re-run the training.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from attnaudit.cli.common import DeviceOpt, cli_errors, emit, progress
from attnaudit.cli.options import MODEL, OUTPUT, PROTOCOL, DataOptions, ManualCommand, OutputBundle, bundled
from attnaudit.errors import AuditError

SCHEMA = "attnaudit.train/1"
PNG_NAME = "train.png"

VIT_ARCHS = ("vit", "vit-linear")
TWO_LAYER_ARCHS = ("relu", "attn")
# Per-family defaults (docs/train.md explains each choice).
VIT_DEFAULTS = dict(optimizer="adam", lr=1e-3, epochs=5, loss="ce", dtype="float32", depth=2, dim=64, heads=4, mlp_ratio=2)
TWO_LAYER_DEFAULTS = dict(optimizer="gd", lr=4.0, steps=300, loss="mse", dtype="float64", width=64)
MINI_BATCH = 64  # default --batch-size for sgd and adam

HELP = (
    "Train a built-in model and save it as an auditable checkpoint (safetensors + JSON side-car recording the "
    "training data, its held-out split and the recipe).\n\n"
    "Defaults per architecture. vit, vit-linear: adam, --lr 1e-3, --batch-size 64, 5 epochs, cross-entropy, float32; "
    "depth 2, dim 64, 4 heads, MLP ratio 2, and the largest patch that leaves at least 16 tokens (7 for 28x28, 8 for "
    "32x32, 2 for 8x8). relu, attn: full-batch gradient descent, --lr 4.0, 300 steps, mse, float64, width 64 (how "
    "the other commands train them). Another --optimizer than the default needs an explicit --lr.\n\n"
    "--seed fixes the initialisation, the order of the mini-batches and the held-out split."
)


def _family_defaults(arch: str) -> dict:
    return VIT_DEFAULTS if arch in VIT_ARCHS else TWO_LAYER_DEFAULTS


def register(app: typer.Typer) -> None:
    @app.command("train", help=HELP, cls=ManualCommand, epilog="Example: attnaudit train --arch vit --dataset digits --out vit.safetensors")
    @bundled(source=DataOptions.defaults(dataset="digits", split="train"), out=OutputBundle)
    def train_command(
        source: DataOptions,
        out: OutputBundle,
        out_path: Annotated[str, typer.Option("--out", help="The checkpoint to write (.safetensors); its side-car PATH.json is written beside it. Existing files are kept unless --overwrite.", metavar="PATH", rich_help_panel=OUTPUT)],
        arch: Annotated[str, typer.Option("--arch", help="relu (2L-ReLU), attn (MLP-Attn), vit (softmax attention) or vit-linear (linearized attention).", rich_help_panel=MODEL)] = "vit",
        width: Annotated[Optional[int], typer.Option("--width", help="Hidden width m of relu/attn (default 64).", rich_help_panel=MODEL)] = None,
        depth: Annotated[Optional[int], typer.Option("--depth", help="ViT blocks (default 2).", rich_help_panel=MODEL)] = None,
        dim: Annotated[Optional[int], typer.Option("--dim", help="ViT token width (default 64).", rich_help_panel=MODEL)] = None,
        heads: Annotated[Optional[int], typer.Option("--heads", help="ViT attention heads; must divide --dim (default 4).", rich_help_panel=MODEL)] = None,
        patch: Annotated[Optional[int], typer.Option("--patch", help="ViT patch size; must divide the image height and width (default: the largest leaving >= 16 tokens).", rich_help_panel=MODEL)] = None,
        mlp_ratio: Annotated[Optional[int], typer.Option("--mlp-ratio", help="ViT MLP hidden width / --dim (default 2).", rich_help_panel=MODEL)] = None,
        optimizer: Annotated[Optional[str], typer.Option("--optimizer", help="gd (full batch), sgd or adam (default: adam for ViTs, gd for relu/attn).", rich_help_panel=PROTOCOL)] = None,
        lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate (default: 1e-3 for adam on ViTs, 4.0 for gd on relu/attn).", rich_help_panel=PROTOCOL)] = None,
        batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Rows per step for sgd/adam (default 64); gd always uses every row.", rich_help_panel=PROTOCOL)] = None,
        epochs: Annotated[Optional[int], typer.Option("--epochs", help="Passes over the training rows (ViT default 5); give --epochs or --steps.", rich_help_panel=PROTOCOL)] = None,
        steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps, counted across epochs (relu/attn default 300).", rich_help_panel=PROTOCOL)] = None,
        loss: Annotated[Optional[str], typer.Option("--loss", help="ce or mse (default: ce for ViTs, mse for relu/attn).", rich_help_panel=PROTOCOL)] = None,
        momentum: Annotated[float, typer.Option("--momentum", help="SGD momentum (sgd only).", rich_help_panel=PROTOCOL)] = 0.0,
        weight_decay: Annotated[float, typer.Option("--weight-decay", help="L2 weight decay.", rich_help_panel=PROTOCOL)] = 0.0,
        seed: Annotated[int, typer.Option("--seed", help="Initialisation, mini-batch order and held-out split.", rich_help_panel=PROTOCOL)] = 0,
        n_train: Annotated[Optional[int], typer.Option("--n-train", help="Training rows (default: every row not held out).", rich_help_panel=PROTOCOL)] = None,
        n_test: Annotated[Optional[int], typer.Option("--n-test", help="Held-out rows for the accuracy (default: min(1000, n/5)).", rich_help_panel=PROTOCOL)] = None,
        dtype: Annotated[Optional[str], typer.Option("--dtype", help="float32 or float64 (default: float32 for ViTs, float64 for relu/attn).", rich_help_panel=PROTOCOL)] = None,
        device: DeviceOpt = "auto",
    ) -> None:
        import torch

        from attnaudit import __version__
        from attnaudit.data import check_seed, data_fingerprint, holdout_split, load_dataset
        from attnaudit.runtime.device import resolve_device
        from attnaudit.core.fit import Recipe, build_tables, fit, plot_fit
        from attnaudit.models.builtin import BUILTIN_ARCHITECTURES, build_builtin, image_shape_of, save_model
        from attnaudit.report.envelope import build_report
        from attnaudit.models.vit import default_patch, n_parameters

        with cli_errors(out.debug):
            opts = out.options()
            arch_key = str(arch).strip().lower()
            if arch_key not in BUILTIN_ARCHITECTURES:
                raise AuditError(f"unknown --arch {arch!r}; use one of {', '.join(BUILTIN_ARCHITECTURES)}")
            is_vit = arch_key in VIT_ARCHS
            vit_opts = {"--depth": depth, "--dim": dim, "--heads": heads, "--patch": patch, "--mlp-ratio": mlp_ratio}
            misplaced = [k for k, v in vit_opts.items() if v is not None] if not is_vit else (
                ["--width"] if width is not None else [])
            if misplaced:
                family = "the 2-layer nets (relu, attn)" if is_vit else "the transformers (vit, vit-linear)"
                raise AuditError(f"{', '.join(misplaced)} set(s) the size of {family}, not of --arch {arch_key}; drop it")
            for name, value in (("--width", width), *vit_opts.items(), ("--n-train", n_train), ("--n-test", n_test)):
                if value is not None and value < 1:
                    raise AuditError(f"{name} must be a positive integer, got {value}")
            check_seed(seed, "--seed")
            d = _family_defaults(arch_key)
            dtype_name = (dtype or d["dtype"]).strip().lower()
            if dtype_name not in ("float32", "float64"):
                raise AuditError(f"unknown --dtype {dtype!r}; use float32 or float64")
            opt_name = (optimizer or d["optimizer"]).strip().lower()
            if lr is None and opt_name != d["optimizer"]:
                raise AuditError(
                    f"--optimizer {opt_name} needs --lr: the default learning rate {d['lr']:g} is the one for "
                    f"{d['optimizer']} on --arch {arch_key}"
                )
            if epochs is None and steps is None:
                epochs_v, steps_v = d.get("epochs"), d.get("steps")
            else:
                epochs_v, steps_v = epochs, steps
            recipe = Recipe(
                optimizer=opt_name,
                lr=lr if lr is not None else d["lr"],
                batch_size=batch_size if batch_size is not None else (None if opt_name == "gd" else MINI_BATCH),
                epochs=epochs_v,
                steps=steps_v,
                loss=(loss or d["loss"]).strip().lower(),
                seed=seed,
                momentum=momentum,
                weight_decay=weight_decay,
            )  # validates every value before any data is read

            target = Path(out_path)
            if target.suffix.lower() != ".safetensors":
                raise AuditError(f"--out {target}: checkpoints are safetensors files; give a path ending in .safetensors")
            sidecar = target.with_suffix(target.suffix + ".json")
            opts.check_writable((PNG_NAME,), extra=[("--out", target), ("--out", sidecar)])
            dev = resolve_device(device)
            torch_dtype = getattr(torch, dtype_name)

            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            spec = source.spec(seed)
            ds = load_dataset(spec)
            if ds.y is None:
                raise AuditError(f"{ds.name} has no labels; training a classifier needs labelled data")
            if is_vit:
                image_shape_of(ds.feature_shape, arch_key)  # refuses flat data before anything else
            nte = n_test if n_test is not None else min(1000, ds.n // 5)
            if nte < 1:
                raise AuditError(f"{ds.name} has only {ds.n} rows, too few to hold any out; give --n-test or more data")
            ntr = n_train if n_train is not None else ds.n - nte
            if ntr < 1:
                raise AuditError(f"--n-test {nte} leaves no training rows of the {ds.n}; lower --n-test")
            train_ds, test_ds = holdout_split(ds, ntr, nte, seed=seed, stratify=True)
            timings["load"] = time.perf_counter() - t0

            sizes: dict = {}
            if is_vit:
                sizes = {k: (v if v is not None else d[k]) for k, v in
                         (("depth", depth), ("dim", dim), ("heads", heads), ("mlp_ratio", mlp_ratio))}
                sizes["patch"] = patch if patch is not None else default_patch(image_shape_of(ds.feature_shape, arch_key))
            else:
                sizes = {"width": width if width is not None else d["width"]}
            model = build_builtin(
                arch_key, n_out=ds.n_classes, feature_shape=ds.feature_shape, X_train=train_ds.X, seed=seed,
                dtype=torch_dtype, device=dev, **sizes,
            )
            parameters = n_parameters(model)
            total_steps = recipe.total_steps(train_ds.n)
            if not opts.quiet:
                opts.console.print(
                    f"train: {arch_key} ({parameters:,} parameters, {dtype_name}) on {ds.name} ({spec.split}), "
                    f"{train_ds.n} train / {test_ds.n} held-out rows, {recipe.optimizer} lr {recipe.lr:g}"
                    + (f", batch {recipe.batch_rows(train_ds.n)}" if recipe.optimizer != "gd" else ", full batch")
                    + f", {total_steps} steps, {recipe.loss} loss, seed {seed}, device {dev}",
                    highlight=False,
                )
            t1 = time.perf_counter()
            with progress(opts, f"train {arch_key}", total_steps) as advance:
                result = fit(model, train_ds.X, train_ds.y, recipe, X_val=test_ds.X, y_val=test_ds.y, progress=advance)
            timings["train"] = time.perf_counter() - t1
            if result.diverged:
                raise AuditError(
                    f"training diverged: the loss became non-finite at step {result.steps_run + 1} of {total_steps} "
                    f"(--lr {recipe.lr:g}); nothing was saved; lower --lr"
                )

            metrics = {k: v for k, v in result.to_dict().items() if k != "loss_curve"}
            training_data = {
                "name": ds.name,
                "dataset": spec.dataset if spec.data is None else None,
                "data": spec.data,
                # As typed (not resolved): where the data lived when the model was trained, a
                # hint for rebuilding the split; the fingerprint is what identifies the rows.
                "data_dir": spec.data_dir,
                "split": spec.split if spec.data is None else None,
                "classes": list(spec.classes) if spec.classes is not None else None,
                "preprocess": spec.preprocess,
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
            save_model(model, target, overwrite=out.overwrite, metadata=_jsonable(metadata))
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
                "arch": arch_key, "parameters": parameters, "dtype": dtype_name, "path": str(target),
                "sidecar": str(sidecar), "spec": _jsonable(model.spec), "sizes": sizes,
            }
            report = build_report(
                SCHEMA,
                inputs={
                    **source.inputs(),
                    "arch": arch_key, "out": str(target), "n_train": train_ds.n, "n_test": test_ds.n,
                    "dtype": dtype_name, **sizes,
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
            )
            renderables: list = build_tables(result, model_info)
            renderables.extend(Text(f"- {v}") for v in verdicts)
            renderables.append(Text(f"checkpoint written to {target} (side-car {sidecar.name})"))
            title = f"{arch_key} on {ds.name}: {recipe.optimizer} lr {recipe.lr:g}, {result.steps_run} steps"
            emit(opts, report, renderables, plot=lambda p: plot_fit(result, p, title), png_name=PNG_NAME)


def _jsonable(value):
    from attnaudit.report.envelope import to_jsonable

    return to_jsonable(value)
