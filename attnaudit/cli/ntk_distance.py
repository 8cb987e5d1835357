"""`attnaudit ntk-distance`: thin CLI over :mod:`attnaudit.analyses.ntk_distance.widths` (the 2-layer width
sweep) and :mod:`attnaudit.analyses.ntk_distance.movement` (``--checkpoint``: a trained model against its
initialization; ``--arch vit,vit-linear``: the width sweep of the built-in transformers)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from attnaudit.cli.common import (
    exit_if_cells_failed,
    DeviceOpt,
    SeedOpt,
    cli_errors,
    emit,
    parse_list,
    progress,
)
from attnaudit.cli.options import (
    ANALYSIS,
    MODEL,
    OUTPUT,
    PROTOCOL,
    DataOptions,
    ExecutorOptions,
    ManualCommand,
    ModelOptions,
    OutputBundle,
    bundled,
)
from attnaudit.errors import AuditError

PNG_NAME = "ntk_distance.png"
PNG_CHECKPOINT = "ntk_checkpoint.png"
PNG_TRANSFORMERS = "ntk_transformers.png"
# defaults of the transformer width sweep (--arch vit,vit-linear)
TRANSFORMER_DEFAULTS = {"widths": (16, 32, 64, 128), "n_seeds": 2, "n_train": 1000, "n_test": 400, "kernel_points": 128}
# defaults of --checkpoint
CHECKPOINT_DEFAULTS = {"kernel_points": 256, "n_test": 500}


def _model_filename(arch: str, width: int, seed: int) -> str:
    return f"{arch}_m{width}_seed{seed}.safetensors"


def register(app: typer.Typer) -> None:
    @app.command("ntk-distance", cls=ManualCommand,
                 epilog="Example: attnaudit ntk-distance --dataset digits --preset quick --json ntk.json --png ntk.png")
    @bundled(source=DataOptions, out=OutputBundle, saved=ModelOptions, execution=ExecutorOptions)
    def ntk_distance_command(
        source: DataOptions,
        out: OutputBundle,
        saved: ModelOptions,
        execution: ExecutorOptions,
        preset: Annotated[Optional[str], typer.Option("--preset", help="quick (default; digits in about a minute) or paper (MNIST-size: n_train 500, widths 16-4096, 3 seeds). Explicit options override it. 2-layer sweep only.", rich_help_panel=PROTOCOL)] = None,
        models: Annotated[Optional[str], typer.Option("--models", help="Models of the 2-layer sweep: relu (2L-ReLU), attn (MLP-Attn), comma-separated (default relu,attn).", rich_help_panel=PROTOCOL)] = None,
        arch: Annotated[Optional[str], typer.Option("--arch", help="Sweep the built-in transformers instead: vit, vit-linear or vit,vit-linear (--widths = embedding dims, heads fixed at 4; trained with the ViT defaults of attnaudit train unless --optimizer/--lr/--steps/--epochs/--batch-size/--loss are given).", rich_help_panel=PROTOCOL)] = None,
        widths: Annotated[Optional[str], typer.Option("--widths", help="Hidden widths, e.g. 16,64,256,1024,4096 (default: preset); with --arch the embedding dims (default 16,32,64,128).", rich_help_panel=PROTOCOL)] = None,
        seeds: Annotated[Optional[int], typer.Option("--seeds", help="Number of initialisation seeds per width: seed, seed+1, ... (default: preset; 2 with --arch).", rich_help_panel=PROTOCOL)] = None,
        n_train: Annotated[Optional[int], typer.Option("--n-train", help="Training points (default: preset; 1000 with --arch).", rich_help_panel=PROTOCOL)] = None,
        n_test: Annotated[Optional[int], typer.Option("--n-test", help="Held-out points (default: preset; 400 with --arch; 500 with --checkpoint).", rich_help_panel=PROTOCOL)] = None,
        steps: Annotated[Optional[int], typer.Option("--steps", help="Full-batch GD steps (default: preset); with --arch optimizer steps (default: 5 epochs).", rich_help_panel=PROTOCOL)] = None,
        lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate (default: the rule lr = lr_fraction * 2n / lambda_max(Theta_inf); 1e-3 for adam with --arch).", rich_help_panel=PROTOCOL)] = None,
        lr_fraction: Annotated[Optional[float], typer.Option("--lr-fraction", help="Fraction of the stable step 2n/lambda_max used when --lr is not given (default 0.5).", rich_help_panel=PROTOCOL)] = None,
        loss: Annotated[Optional[str], typer.Option("--loss", help="mse (closed-form kernel predictor, default) or ce (linearized GD iterated in function space); with --arch the training loss (default ce).", rich_help_panel=PROTOCOL)] = None,
        parametrization: Annotated[Optional[str], typer.Option("--parametrization", help="ntk (default) or standard.", rich_help_panel=PROTOCOL)] = None,
        init: Annotated[Optional[str], typer.Option("--init", help="antisymmetric (f_0 = 0, default) or standard.", rich_help_panel=PROTOCOL)] = None,
        attn_scaling: Annotated[Optional[str], typer.Option("--attn-scaling", help="Scale of the attention context: rms (default), spectral or none.", rich_help_panel=PROTOCOL)] = None,
        predictor: Annotated[Optional[str], typer.Option("--predictor", help="discrete (exact for GD steps, default) or continuous (gradient flow for time lr*steps).", rich_help_panel=ANALYSIS)] = None,
        dtype: Annotated[Optional[str], typer.Option("--dtype", help="Training dtype for every width: float64 or float32 (default: float64; the paper preset uses float32 from width 1024; float32 with --arch). Kernels and metrics are always float64.", rich_help_panel=PROTOCOL)] = None,
        kernel_points: Annotated[Optional[int], typer.Option("--kernel-points", help="Training points used for the kernel-movement metrics (default: all; 128 with --arch; 256 with --checkpoint).", rich_help_panel=ANALYSIS)] = None,
        save_models: Annotated[Optional[str], typer.Option("--save-models", help="Folder to save every trained network (safetensors + JSON side-car). 2-layer sweep only.", metavar="PATH", rich_help_panel=OUTPUT)] = None,
        reference_checkpoint: Annotated[Optional[str], typer.Option("--reference-checkpoint", help="With --checkpoint: the same model at initialization (default: a fresh initialization of the same architecture from the side-car's recorded seed).", metavar="PATH", rich_help_panel=MODEL)] = None,
        linearized: Annotated[Optional[str], typer.Option("--linearized", help="With --checkpoint or --arch: the linearized model to compare with: auto (default: kernel-gd when the recipe is full-batch gd on a small training set, else train), kernel-gd (closed-form kernel gradient descent with the initial eNTK), train (the linearized network trained with the same recipe) or off.", rich_help_panel=ANALYSIS)] = None,
        optimizer: Annotated[Optional[str], typer.Option("--optimizer", help="With --arch: gd (full batch), sgd or adam (default adam, as attnaudit train).", rich_help_panel=PROTOCOL)] = None,
        batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="With --arch: rows per step for sgd/adam (default 64).", rich_help_panel=PROTOCOL)] = None,
        epochs: Annotated[Optional[int], typer.Option("--epochs", help="With --arch: passes over the training rows (default 5); give --epochs or --steps.", rich_help_panel=PROTOCOL)] = None,
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
    ) -> None:
        """Distance of finite 2L-ReLU / MLP-Attn networks from their NTK predictor across widths; with
        --checkpoint, how far training moved a trained model from the kernel regime; with --arch
        vit,vit-linear, the same across widths of the built-in transformers."""
        from attnaudit.data import HoldoutRecipe, data_fingerprint
        from attnaudit.runtime.device import resolve_device, resolve_dtype
        from attnaudit.models.builtin import save_model
        from attnaudit.analyses.ntk_distance.widths import PRESETS, SCHEMA, NTKDistanceConfig, build_tables, plot_ntk_distance, run_ntk_distance
        from attnaudit.report.envelope import build_report, check_target

        with cli_errors(out.debug):
            executor = execution.config()
            if saved.given:
                if executor.kind != "local" or executor.jobs > 1 or executor.resume_dir:
                    raise AuditError("--checkpoint analyses given models in this process; --executor, --jobs and --resume "
                                     "run the width sweeps")
                if arch is not None:
                    raise AuditError("--checkpoint audits a trained model and --arch trains new transformers; give one of them")
                return _checkpoint_command(
                    source, out, saved, kernel_points=kernel_points, n_test=n_test,
                    reference_checkpoint=reference_checkpoint, linearized=linearized, seed=seed, device=device,
                    refused={"preset": preset, "models": models, "widths": widths, "seeds": seeds, "n_train": n_train,
                             "steps": steps, "lr": lr, "lr_fraction": lr_fraction, "loss": loss,
                             "parametrization": parametrization, "init": init, "attn_scaling": attn_scaling,
                             "predictor": predictor, "dtype": dtype, "save_models": save_models, "optimizer": optimizer,
                             "batch_size": batch_size, "epochs": epochs},
                )
            if reference_checkpoint is not None:
                raise AuditError("--reference-checkpoint is the initialization of a --checkpoint; give the trained model with --checkpoint")
            if arch is not None:
                return _transformer_command(
                    source, out, arch=arch, widths=widths, seeds=seeds, n_train=n_train, n_test=n_test, steps=steps,
                    epochs=epochs, lr=lr, optimizer=optimizer, batch_size=batch_size, loss=loss,
                    kernel_points=kernel_points, linearized=linearized, dtype=dtype, seed=seed, device=device,
                    executor=executor, refused={"preset": preset, "models": models, "lr_fraction": lr_fraction,
                             "parametrization": parametrization, "init": init, "attn_scaling": attn_scaling,
                             "predictor": predictor, "save_models": save_models},
                )
            _refuse("apply to --checkpoint or --arch vit,vit-linear, not to the 2-layer sweep (which trains by full-batch "
                    "GD with the lr rule)", linearized=linearized, optimizer=optimizer, batch_size=batch_size, epochs=epochs)
            preset = "quick" if preset is None else preset
            models = "relu,attn" if models is None else models
            lr_fraction = 0.5 if lr_fraction is None else lr_fraction
            loss = "mse" if loss is None else loss
            parametrization = "ntk" if parametrization is None else parametrization
            init = "antisymmetric" if init is None else init
            attn_scaling = "rms" if attn_scaling is None else attn_scaling
            predictor = "discrete" if predictor is None else predictor
            opts = out.options()
            key = preset.strip().lower()
            if key not in PRESETS:
                raise AuditError(f"unknown --preset {preset!r}; use {' or '.join(PRESETS)}")
            base = PRESETS[key]
            model_list = tuple(parse_list(models, str, "--models"))
            width_list, n_seeds, ntr, nte = _sweep_sizes(base, widths, seeds, n_train, n_test, seed)
            if dtype is not None:
                train_dtype = str(resolve_dtype(dtype)).replace("torch.", "")
                f32_from = None
            else:
                train_dtype, f32_from = "float64", base["float32_from_width"]
            seed_list = tuple(seed + i for i in range(n_seeds))
            config = NTKDistanceConfig(
                models=model_list,
                widths=width_list,
                seeds=seed_list,
                steps=base["steps"] if steps is None else steps,
                lr=lr,
                lr_fraction=lr_fraction,
                loss=loss.strip().lower(),
                parametrization=parametrization.strip().lower(),
                init=init.strip().lower(),
                attn_scaling=attn_scaling.strip().lower(),
                predictor=predictor.strip().lower(),
                train_dtype=train_dtype,
                float32_from_width=f32_from,
                kernel_points=kernel_points,
            )
            dev = resolve_device(device)
            save_dir = None
            if save_models is not None:
                save_dir = Path(save_models)
                if save_dir.exists() and not save_dir.is_dir():
                    raise AuditError(f"--save-models {save_dir} is a file; give a folder")
                save_dir.mkdir(parents=True, exist_ok=True)
                for arch in model_list:
                    for w in width_list:
                        for s in seed_list:
                            target = save_dir / _model_filename(arch, w, s)
                            check_target(target, out.overwrite)
                            check_target(target.with_suffix(".safetensors.json"), out.overwrite)
            opts.check_writable((PNG_NAME,))
            spec = source.spec(seed, n=ntr + nte)

            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            recipe = HoldoutRecipe.of(spec, ntr, nte, seed, stratify=True)
            executor.check_available()
            if save_dir is not None and (executor.kind != "local" or executor.jobs > 1 or executor.resume_dir):
                raise AuditError("--save-models keeps the networks trained in this process; use it without --executor "
                                 "ray, --jobs or --resume")
            try:
                train_ds, test_ds = recipe.load()  # the same rows every worker rebuilds from the recipe
            except AuditError as exc:
                # the data layer speaks of --n; here the row count is --n-train + --n-test
                if "--n " in str(exc):
                    raise AuditError(
                        f"--n-train {ntr} + --n-test {nte} = {ntr + nte} rows: "
                        + str(exc).replace("lower --n", "lower --n-train/--n-test")
                    ) from None
                raise
            ds = train_ds
            if ds.y is None:
                raise AuditError(f"{ds.name} has no labels; ntk-distance trains classifiers, so give labelled data")
            timings["load"] = time.perf_counter() - t0
            training_data = {
                "name": ds.name, "split": ds.info.get("split"), "n": train_ds.n, "seed": seed,
                "preprocess": source.preprocess, "fingerprint": data_fingerprint(train_ds.X, train_ds.y),
            }

            saved: list[str] = []

            def on_model(arch: str, width: int, s: int, net) -> None:
                if save_dir is None:
                    return
                path = save_model(net, save_dir / _model_filename(arch, width, s), overwrite=out.overwrite,
                                  metadata={"command": "ntk-distance", "dataset": ds.name, "steps": config.steps,
                                            "training_data": training_data})
                saved.append(str(path))

            total = len(model_list) * len(width_list) * len(seed_list)
            t1 = time.perf_counter()
            with progress(opts, "ntk-distance", total, "cells") as advance:
                result = run_ntk_distance(
                    train_ds.X.to(dev), train_ds.y.to(dev), test_ds.X.to(dev), test_ds.y.to(dev), ds.n_classes, config,
                    progress=lambda: advance(1), on_model=on_model if save_dir is not None else None,
                    executor=executor, data=recipe,
                )
            timings["analysis"] = time.perf_counter() - t1
            timings["total"] = time.perf_counter() - t0

            results = {k: v for k, v in result.to_dict().items() if k not in ("schema", "warnings", "verdicts")}
            results["dataset"] = {"train": train_ds.info, "test": test_ds.info}
            if saved:
                results["saved_models"] = saved
            report = build_report(
                SCHEMA,
                inputs={
                    **source.inputs(),
                    "preset": key,
                    "n_train": ntr,
                    "n_test": nte,
                    **config.to_dict(),
                    "execution": result.execution,
                },
                seeds={"base_seed": seed, "model_seeds": list(seed_list), "holdout_seed": seed},
                device=dev,
                dtype=f"float64 (kernels, predictor, metrics); training {train_dtype}"
                + (f", float32 from width {f32_from}" if f32_from else ""),
                timings=timings,
                results=results,
                warnings=result.warnings,
                verdicts=result.verdicts(),
            )
            emit(opts, report, build_tables(result), plot=lambda p: plot_ntk_distance(result, p), png_name=PNG_NAME)
            exit_if_cells_failed(result.failed_cells)


def _sweep_sizes(defaults: dict, widths, seeds, n_train, n_test, seed: int) -> tuple[tuple[int, ...], int, int, int]:
    """(widths, number of seeds, training rows, held-out rows) of a width sweep, defaults filled in and checked."""
    from attnaudit.data import check_seed

    width_list = tuple(parse_list(widths, int, "--widths")) if widths is not None else tuple(defaults["widths"])
    n_seeds = defaults["n_seeds"] if seeds is None else seeds
    if n_seeds < 1:
        raise AuditError(f"--seeds must be >= 1, got {n_seeds}")
    check_seed(seed, "--seed", count=n_seeds)
    ntr = defaults["n_train"] if n_train is None else n_train
    nte = defaults["n_test"] if n_test is None else n_test
    if ntr < 2:
        raise AuditError(f"--n-train must be >= 2, got {ntr}")
    if nte < 1:
        raise AuditError(f"--n-test must be >= 1, got {nte}")
    return width_list, n_seeds, ntr, nte


def _refuse(why: str, **options) -> None:
    """One AuditError line naming every option given (not None) that does not apply."""
    given = [f"--{name.replace('_', '-')}" for name, value in options.items() if value is not None]
    if given:
        raise AuditError(f"{', '.join(given)} {why}; drop {'it' if len(given) == 1 else 'them'}")


def _checkpoint_command(source: DataOptions, out: OutputBundle, saved: ModelOptions, *, kernel_points, n_test,
                        reference_checkpoint, linearized, seed: int, device: str, refused: dict) -> None:
    """``ntk-distance --checkpoint``: kernel movement of trained models against their initialization."""
    import torch

    from attnaudit.models.checkpoints import fit_to_data, load_model_source, rebuild_of, recorded_split
    from attnaudit.core.task import Task
    from attnaudit.data import check_seed, holdout_split, load_dataset, subset
    from attnaudit.runtime.device import resolve_device
    from attnaudit.analyses.ntk_distance.movement import (SCHEMA_CHECKPOINT, CheckpointKernelConfig, analyse_checkpoint,
                                 build_checkpoint_tables, initial_model, plot_checkpoints)
    from attnaudit.report.envelope import build_report

    _refuse("set how the sweeps train new networks and do not apply to --checkpoint (a trained model, compared with "
            "its initialization)", **refused)
    opts = out.options()
    check_seed(seed, "--seed")
    config = CheckpointKernelConfig(
        kernel_points=CHECKPOINT_DEFAULTS["kernel_points"] if kernel_points is None else kernel_points,
        n_test=CHECKPOINT_DEFAULTS["n_test"] if n_test is None else n_test,
        linearized="auto" if linearized is None else linearized.strip().lower(),
        seed=seed,
    )  # validates before anything is loaded
    dev = resolve_device(device)
    opts.check_writable((PNG_CHECKPOINT,))
    t0 = time.perf_counter()
    loaded = saved.load()  # every file checked before any data are read
    reference = None
    if reference_checkpoint is not None:
        if len(loaded) != 1:
            raise AuditError("--reference-checkpoint is the initialization of one model; give a single --checkpoint")
        reference = load_model_source(reference_checkpoint, trust_pickle=saved.trust_pickle)
    else:
        for label, lm in loaded.items():
            if initial_model(lm) is None:
                raise AuditError(
                    f"{label}: ntk-distance --checkpoint compares the model with its initialization, and a "
                    f"{lm.source.get('kind')} model does not record one; give the same model at initialization with "
                    "--reference-checkpoint PATH"
                )
    ds = load_dataset(source.spec(seed))
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; the kernel-label alignment and the linearized model need labels")
    fitted = {label: fit_to_data(lm, ds) for label, lm in loaded.items()}
    if reference is not None:
        reference = fit_to_data(reference, ds)
    timings = {"load": time.perf_counter() - t0}
    if not opts.quiet:
        opts.console.print(
            f"ntk-distance --checkpoint: {', '.join(fitted)} on {ds.name} ({ds.n} rows); eNTK on "
            f"{config.kernel_points} training rows, {config.form} kernel, float64, engine",
            highlight=False,
        )
    warnings: list[str] = []
    results = []
    sources = {}
    t1 = time.perf_counter()
    with progress(opts, "ntk-distance", len(fitted), "models") as advance:
        for label, lm in fitted.items():
            task_trained = Task(lm.module, lm.n_classes, inputs=lm.inputs)
            if reference is not None:
                task_init = Task(reference.module, reference.n_classes, inputs=reference.inputs)
                ref_info = {"kind": "checkpoint", "path": str(reference_checkpoint), "source": reference.source,
                            "detail": f"--reference-checkpoint {reference.label}"}
            else:
                module0, ref_info = initial_model(lm)
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
                rows_info = {"rows": "checkpoint split", "recorded_split": rec,
                             "detail": f"kernel: {kern.n} of the checkpoint's {train_all.n} training rows; held-out: "
                                       f"{test.n} of its {held_all.n} held-out rows (split rebuilt, fingerprint matched)"}
            else:
                kp = min(config.kernel_points, ds.n - 1)
                kern, test = holdout_split(ds, kp, min(config.n_test, ds.n - kp), seed, stratify=True)
                rows_info = {"rows": "fresh split", "detail": f"a seeded holdout split of the data (seed {seed}): "
                                                              f"{kern.n} kernel rows, {test.n} held-out rows"}
                recorded_data = lm.metadata.get("training_data") if isinstance(lm.metadata, dict) else None
                if isinstance(recorded_data, dict) and recorded_data.get("fingerprint"):
                    where = ", ".join(f"{k} {recorded_data[k]}" for k in ("name", "split", "n", "preprocess")
                                      if recorded_data.get(k) is not None)
                    warnings.append(
                        f"{label}: its training split ({where}) could not be rebuilt from {ds.name} as given, so the kernel "
                        "rows are a fresh split of these data and may include rows the model never saw; give the data "
                        "it was trained on (same --dataset, --split, --classes, --preprocess)"
                    )
                if recipe is not None:
                    no_lin = ("the checkpoint's training rows could not be rebuilt from this data (its side-car records "
                              "no holdout split, or the rebuilt rows' fingerprint differs), so its training cannot be "
                              "re-run on the linearized model; give the data it was trained on")
            rows_info["kernel_rows"] = kern.info.get("holdout")
            rows_info["held_out_rows"] = test.info.get("holdout")
            recorded = (lm.metadata.get("metrics") or {}).get("steps_run") if isinstance(lm.metadata, dict) else None
            steps = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
            dtype = next((p.dtype for p in lm.module.parameters() if p.is_floating_point()), torch.float64)
            results.append(analyse_checkpoint(
                task_trained, task_init, kern.X.to(dev), kern.y.to(dev), config, label=label, recipe=recipe,
                train=None if train is None else (train[0].to(dev), train[1].to(dev)), test=(test.X.to(dev), test.y.to(dev)),
                steps=steps, train_dtype=dtype, reference=ref_info, rows=rows_info, no_linearized=no_lin, device=dev,
            ))
            sources[label] = lm.source
            advance(1)
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0
    report = build_report(
        SCHEMA_CHECKPOINT,
        inputs={**source.inputs(), "models": saved.sources(), "reference_checkpoint": reference_checkpoint,
                **config.to_dict()},
        seeds={"base_seed": seed, "subset_seed": seed},
        device=dev,
        dtype="float64 (kernels, metrics); the linearized model trains in the checkpoint's dtype",
        timings=timings,
        results={"dataset": ds.info,
                 "models": {r.label: {"source": sources[r.label], **r.to_dict()} for r in results}},
        warnings=[*warnings, *(w for r in results for w in r.warnings)],
        verdicts=[r.verdict for r in results],
    )
    emit(opts, report, build_checkpoint_tables(results, warnings), plot=lambda p: plot_checkpoints(results, p),
         png_name=PNG_CHECKPOINT)


def _transformer_command(source: DataOptions, out: OutputBundle, *, arch, widths, seeds, n_train, n_test, steps, epochs,
                         lr, optimizer, batch_size, loss, kernel_points, linearized, dtype, seed: int, device: str,
                         executor, refused: dict) -> None:
    """``ntk-distance --arch vit,vit-linear``: the kernel regime of the built-in transformers across widths."""
    from attnaudit.data import HoldoutRecipe
    from attnaudit.runtime.device import resolve_device
    from attnaudit.core.fit import Recipe
    from attnaudit.analyses.ntk_distance.movement import (SCHEMA_TRANSFORMERS, TransformerSweepConfig, build_sweep_tables, plot_sweep,
                                 run_transformer_sweep)
    from attnaudit.models.builtin import image_shape_of
    from attnaudit.report.envelope import build_report
    from attnaudit.cli.train import MINI_BATCH, VIT_DEFAULTS

    _refuse("belong to the 2-layer sweep (--models relu,attn), not to the transformer sweep (--arch)", **refused)
    opts = out.options()
    archs = tuple(a.lower() for a in parse_list(arch, str, "--arch"))
    width_list, n_seeds, ntr, nte = _sweep_sizes(TRANSFORMER_DEFAULTS, widths, seeds, n_train, n_test, seed)
    opt_name = (optimizer or VIT_DEFAULTS["optimizer"]).strip().lower()
    if lr is None and opt_name != VIT_DEFAULTS["optimizer"]:
        raise AuditError(f"--optimizer {opt_name} needs --lr: the default learning rate {VIT_DEFAULTS['lr']:g} is the one "
                         f"for {VIT_DEFAULTS['optimizer']}")
    if epochs is None and steps is None:
        epochs = VIT_DEFAULTS["epochs"]
    recipe = Recipe(
        optimizer=opt_name, lr=VIT_DEFAULTS["lr"] if lr is None else lr,
        batch_size=batch_size if batch_size is not None else (None if opt_name == "gd" else MINI_BATCH),
        epochs=epochs, steps=steps, loss=(loss or VIT_DEFAULTS["loss"]).strip().lower(), seed=seed,
    )
    config = TransformerSweepConfig(
        archs=archs, widths=width_list, seeds=tuple(seed + i for i in range(n_seeds)), recipe=recipe,
        kernel_points=TRANSFORMER_DEFAULTS["kernel_points"] if kernel_points is None else kernel_points,
        linearized="auto" if linearized is None else linearized.strip().lower(),
        train_dtype=(dtype or "float32").strip().lower(),
    )  # validates before any data is read
    dev = resolve_device(device)
    opts.check_writable((PNG_TRANSFORMERS,))
    t0 = time.perf_counter()
    executor.check_available()
    data_recipe = HoldoutRecipe.of(source.spec(seed, n=ntr + nte), ntr, nte, seed, stratify=True)
    try:
        train_ds, test_ds = data_recipe.load()  # the same rows every worker rebuilds from the recipe
    except AuditError as exc:
        if "--n " in str(exc):
            raise AuditError(f"--n-train {ntr} + --n-test {nte} = {ntr + nte} rows: "
                             + str(exc).replace("lower --n", "lower --n-train/--n-test")) from None
        raise
    ds = train_ds
    if ds.y is None:
        raise AuditError(f"{ds.name} has no labels; the transformer sweep trains classifiers, so give labelled data")
    image_shape_of(ds.feature_shape, archs[0])  # flat data is refused before any training
    timings = {"load": time.perf_counter() - t0}
    if not opts.quiet:
        opts.console.print(
            f"ntk-distance --arch {','.join(archs)}: {ds.name}, {train_ds.n} train / {test_ds.n} held-out rows, widths "
            f"{','.join(map(str, width_list))} (heads fixed at {config.heads}), {n_seeds} seed(s), {recipe.optimizer} "
            f"lr {recipe.lr:g}, {recipe.total_steps(train_ds.n)} steps, {recipe.loss}; eNTK on "
            f"{min(train_ds.n, config.kernel_points)} training rows",
            highlight=False,
        )
    t1 = time.perf_counter()
    total = len(archs) * len(width_list) * n_seeds
    with progress(opts, "ntk-distance", total, "cells") as advance:
        result = run_transformer_sweep(
            train_ds.X.to(dev), train_ds.y.to(dev), test_ds.X.to(dev), test_ds.y.to(dev), ds.n_classes,
            ds.feature_shape, config, device=dev, progress=lambda: advance(1), executor=executor, data=data_recipe,
        )
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0
    results = result.to_dict()
    results["dataset"] = {"train": train_ds.info, "test": test_ds.info}
    report = build_report(
        SCHEMA_TRANSFORMERS,
        inputs={**source.inputs(), "n_train": ntr, "n_test": nte, **config.to_dict(), "execution": result.execution},
        seeds={"base_seed": seed, "model_seeds": list(config.seeds), "holdout_seed": seed, "kernel_rows_seed": 0},
        device=dev,
        dtype=f"float64 (kernels, metrics); training {config.train_dtype}",
        timings=timings,
        results=results,
        warnings=result.warnings,
        verdicts=result.verdicts(),
    )
    emit(opts, report, build_sweep_tables(result), plot=lambda p: plot_sweep(result, p), png_name=PNG_TRANSFORMERS)
    exit_if_cells_failed(result.failed_cells)
