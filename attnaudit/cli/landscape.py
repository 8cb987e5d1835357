"""`attnaudit landscape`: options -> :func:`attnaudit.analyses.landscape.run_landscape` -> report."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Annotated, Optional

import typer
from rich.text import Text

from attnaudit.cli.common import (
    DeviceOpt,
    SeedOpt,
    cli_errors,
    emit,
    parse_list,
    preset_value,
    progress,
    refuse_training_options_for_saved_model,
)
from attnaudit.cli.options import ANALYSIS, PROTOCOL, DataOptions, ManualCommand, ModelOptions, OutputBundle, bundled
from attnaudit.errors import AuditError



def _on_device(task, device):
    """The task with a copy of its module on ``device`` when it is elsewhere (the user's module is never moved)."""
    import copy

    import torch

    ref = next((t for t in (*task.module.parameters(), *task.module.buffers())), None)
    if ref is None or ref.device == torch.device(device):
        return task
    return dataclasses.replace(task, module=copy.deepcopy(task.module).to(device))


def _parse_match_loss(text: str | None) -> float | str | None:
    """--match-loss: a positive loss, ``auto`` or ``none`` (one-line error otherwise)."""
    if text is None or text.strip().lower() == "none":
        return None
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise AuditError(f"--match-loss: {text!r} is not a number; give a training loss such as 0.2, auto or none") from None
    if not (math.isfinite(value) and value > 0):
        raise AuditError(f"--match-loss must be a positive training loss, got {value:g}")
    return value


def register(app: typer.Typer) -> None:
    @app.command("landscape", cls=ManualCommand,
                 epilog="Example: attnaudit landscape --preset quick --json landscape.json --png landscape.png")
    @bundled(source=DataOptions.defaults(dataset=None, split=None), out=OutputBundle, saved=ModelOptions)
    def landscape_command(
        source: DataOptions,
        out: OutputBundle,
        saved: ModelOptions,
        preset: Annotated[str, typer.Option("--preset", help="quick (default; digits, < 2 min on 2 CPU cores) or paper (MNIST train split, n_train 2000, ~5 min). Explicit options override it.", rich_help_panel=PROTOCOL)] = "quick",
        models: Annotated[Optional[str], typer.Option("--models", help="Models to train and compare: relu (2L-ReLU), attn (MLP-Attn), comma-separated (default relu,attn).", rich_help_panel=PROTOCOL)] = None,
        n_train: Annotated[Optional[int], typer.Option("--n-train", help="Training samples: the loss, Hessian and surfaces are over these (default from --preset).", rich_help_panel=PROTOCOL)] = None,
        width: Annotated[Optional[int], typer.Option("--width", help="Hidden width m (default from --preset).", rich_help_panel=PROTOCOL)] = None,
        steps: Annotated[Optional[int], typer.Option("--steps", help="Full-batch GD steps (the budget under --match-loss).", rich_help_panel=PROTOCOL)] = None,
        lr: Annotated[Optional[float], typer.Option("--lr", help="GD learning rate (default from --preset).", rich_help_panel=PROTOCOL)] = None,
        loss: Annotated[Optional[str], typer.Option("--loss", help="mse or ce: the training loss whose landscape is measured (default mse; a checkpoint's recorded training loss).", rich_help_panel=PROTOCOL)] = None,
        match_loss: Annotated[Optional[str], typer.Option("--match-loss", help="Train each model until its training loss reaches this value (or say it could not), so sharpness is compared at equal loss (full-batch GD only); auto: every model to the largest loss any reaches within --steps (default of --preset quick); none: fixed steps (default of --preset paper). Models are compared only when their losses are within 10 %.", rich_help_panel=PROTOCOL)] = None,
        n_seeds: Annotated[Optional[int], typer.Option("--seeds", help="Independent initialisations, trainings and analyses per built-in model (seeds seed, seed+1, ...; default 3 for --preset quick, 1 for paper); the JSON gains per-seed values with mean/sd, and the comparison uses the mean with its Student-t tolerance (fewer than 3 seeds never resolve it).", rich_help_panel=PROTOCOL)] = None,
        optimizer: Annotated[Optional[str], typer.Option("--optimizer", help="How the built-in models are trained: gd (full-batch gradient descent, default), sgd or adam (attnaudit.core.fit).", rich_help_panel=PROTOCOL)] = None,
        batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Rows per step of --optimizer sgd/adam (default: full batch).", rich_help_panel=PROTOCOL)] = None,
        top_k: Annotated[int, typer.Option("--top-k", help="Number of top Hessian eigenvalues (Lanczos).", rich_help_panel=ANALYSIS)] = 5,
        hutchinson_samples: Annotated[int, typer.Option("--hutchinson-samples", help="Rademacher probes for the Hessian trace.", rich_help_panel=ANALYSIS)] = 30,
        directions: Annotated[str, typer.Option("--directions", help="random (filter-normalized Gaussian) or hessian (top eigenvectors) for the surfaces.", rich_help_panel=ANALYSIS)] = "random",
        points: Annotated[int, typer.Option("--points", help="Points of the 1-D curve (0 = skip).", rich_help_panel=ANALYSIS)] = 51,
        span: Annotated[float, typer.Option("--span", help="Surfaces cover alpha in [-span, span] (relative distance).", rich_help_panel=ANALYSIS)] = 1.0,
        grid: Annotated[int, typer.Option("--grid", help="Grid size of the 2-D surface (0 = skip).", rich_help_panel=ANALYSIS)] = 31,
        keep_1d_params: Annotated[bool, typer.Option("--keep-1d-params", help="Perturb biases/1-D parameters too (one filter each) instead of zeroing them in random directions.", rich_help_panel=ANALYSIS)] = False,
        basin_directions: Annotated[int, typer.Option("--basin-directions", help="Random directions (both signs) averaged for the basin width.", rich_help_panel=ANALYSIS)] = 8,
        basin_factor: Annotated[float, typer.Option("--basin-factor", help="The basin ends where the loss first reaches this factor times its minimum.", rich_help_panel=ANALYSIS)] = 2.0,
        params: Annotated[Optional[str], typer.Option("--params", help="Only these parameters: all, head (the logits layer), module names or glob patterns, comma-separated (e.g. W or 'layers.0.*'); default all.", rich_help_panel=ANALYSIS)] = None,
        dtype: Annotated[str, typer.Option("--dtype", help="Precision of the analysis: float64 (default) or float32. The engine works on copies; a saved model keeps its own dtype.", rich_help_panel=ANALYSIS)] = "float64",
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
    ) -> None:
        """Loss landscape: top Hessian eigenvalues, trace, basin width and 1-D/2-D loss surfaces."""
        from attnaudit.data import check_seed, load_dataset
        from attnaudit.runtime.device import resolve_device
        from attnaudit.analyses.landscape import LandscapeConfig, ParameterSelectionError, run_landscape, run_work_units
        from attnaudit.core.fit import DEFAULT_ADAM_LR
        from attnaudit.analyses.landscape.run import ARCHS, PRESETS  # the protocol lives in the library
        from attnaudit.analyses.landscape.report import PNG_NAME, SCHEMA, build_tables, plot_landscape
        from attnaudit.analyses.landscape.setup import check_selector
        from attnaudit.report.envelope import build_report
        from attnaudit.core.training import TrainConfig

        with cli_errors(out.debug):
            opts = out.options()
            model = saved.sources() if saved.given else None
            key = preset.strip().lower()
            if key not in PRESETS:
                raise AuditError(f"unknown --preset {preset!r}; use {' or '.join(PRESETS)}")
            p = PRESETS[key]
            check_seed(seed, "--seed")
            if model and models is not None:
                raise AuditError("--checkpoint (--model) analyses saved models and --models trains new ones; give one of them")
            if model:
                refuse_training_options_for_saved_model(width=width, steps=steps, lr=lr, match_loss=match_loss,
                                                        optimizer=optimizer, batch_size=batch_size)
                if n_seeds is not None and n_seeds != 1:
                    raise AuditError("--seeds trains independent copies of the built-in models; a saved model is one model, drop --seeds")
            n_seeds = 1 if model else preset_value(n_seeds, p, "seeds")
            if n_seeds < 1:
                raise AuditError(f"--seeds must be a positive integer, got {n_seeds}")
            check_seed(seed, "--seed", count=n_seeds)
            opt_name = (optimizer or "gd").strip().lower()
            if opt_name not in ("gd", "sgd", "adam"):
                raise AuditError(f"unknown --optimizer {optimizer!r}; use gd, sgd or adam")
            match_target = _parse_match_loss(match_loss)
            if match_loss is None and not model and opt_name == "gd":
                match_target = p.get("match_loss")  # the preset's choice (sgd/adam: fixed steps)
            match_auto = match_target == "auto"
            if opt_name != "gd" and match_target is not None:
                raise AuditError("--match-loss stops full-batch GD at a training loss; with --optimizer sgd/adam train "
                                 "for --steps and compare (models are compared when their losses are within 10 %)")
            arch_list = tuple(a.strip().lower() for a in parse_list(models if models is not None else "relu,attn", str, "--models"))
            bad = [a for a in arch_list if a not in ARCHS]
            if bad:
                raise AuditError(f"--models: unknown model {bad[0]!r}; use relu, attn or both (relu,attn)")
            if len(set(arch_list)) != len(arch_list):
                raise AuditError("--models lists a model twice; give each once")
            ntr = preset_value(n_train, p, "n_train")
            if ntr < 2:
                raise AuditError(f"--n-train must be >= 2, got {ntr}")
            m = preset_value(width, p, "width")
            if m < 1:
                raise AuditError(f"--width must be a positive integer, got {m}")
            saved_models = saved.load() if model else {}  # fails now, before data are read: unreadable checkpoints
            if loss is None:
                recorded = {lm.loss for lm in saved_models.values() if lm.loss}
                loss = recorded.pop() if len(recorded) == 1 else "mse"
            loss_name = loss.strip().lower()
            lr_value = lr if lr is not None else (DEFAULT_ADAM_LR if opt_name == "adam" else p["lr"])
            train_cfg = TrainConfig(loss=loss_name, lr=lr_value, steps=preset_value(steps, p, "steps"),
                                    loss_tol=None if match_auto else match_target, record_every=10)
            recipe = None
            if opt_name != "gd" and not model:
                from attnaudit.core.fit import Recipe

                recipe = Recipe(optimizer=opt_name, lr=lr_value, batch_size=batch_size, steps=train_cfg.steps,
                                loss=loss_name, seed=seed)
            elif batch_size is not None:
                raise AuditError("--batch-size applies to --optimizer sgd or adam (gd uses every row at every step); drop it")
            patterns = tuple(parse_list(params, str, "--params")) if params is not None else None
            config = LandscapeConfig(
                loss=loss_name, directions=directions.strip().lower(), points=points, span=span, grid=grid,
                keep_1d_params=keep_1d_params, params=patterns, top_k=top_k, hutchinson_samples=hutchinson_samples,
                basin_directions=basin_directions, basin_factor=basin_factor, seed=seed,
                dtype=dtype.strip().lower(),
            )
            dev = resolve_device(device)
            labels = list(saved_models) if model else list(arch_list)
            saved_tasks = None
            rows_note = None
            try:
                for lm in saved_models.values():  # a --params typo fails before the data are read
                    check_selector(lm.module, config.params)
                opts.check_writable((PNG_NAME,))
                ds_name = source.dataset if source.dataset is not None else (None if source.data is not None else p["dataset"])
                split_name = preset_value(source.split, p, "split")
                spec = source.spec(seed, n=ntr, stratify=True, dataset=ds_name, split=split_name)

                t0 = time.perf_counter()
                ds = None
                if saved_models:
                    from attnaudit.models.checkpoints import fit_to_data, recorded_split
                    from attnaudit.data import subset

                    full = load_dataset(dataclasses.replace(spec, n=None, stratify=False))
                    rebuilt = recorded_split(full, saved_models)
                    if rebuilt is not None:
                        ds = subset(rebuilt[0], min(ntr, rebuilt[0].n), seed)
                        rows_note = {"rows": "checkpoint split", "detail": f"{ds.n} of the checkpoint's {rebuilt[0].n} "
                                     "training rows (its split rebuilt; training-data fingerprint matched)", "recorded_split": rebuilt[2]}
                if ds is None:
                    try:
                        ds = load_dataset(spec)
                    except AuditError as exc:
                        if "--n " in str(exc):
                            raise AuditError(str(exc).replace("--n ", "--n-train ").replace("lower --n", "lower --n-train")) from None
                        raise
                if ds.y is None:
                    raise AuditError(f"{ds.name} has no labels; the loss landscape needs labelled data")
                if saved_models:
                    fitted = {label: fit_to_data(lm, ds) for label, lm in saved_models.items()}
                    saved_tasks = {label: _on_device(lm.task(loss=loss_name), dev) for label, lm in fitted.items()}
                load_time = time.perf_counter() - t0
                if not opts.quiet:
                    what = (f"saved model(s) {', '.join(labels)}" if model else
                            f"models {','.join(labels)}, width {m}, {opt_name} {train_cfg.steps} steps, lr {train_cfg.lr:g}"
                            + (f", batch {batch_size}" if batch_size else "") + (f", {n_seeds} seeds" if n_seeds > 1 else ""))
                    opts.console.print(f"landscape: {ds.name} ({split_name}), n={ds.n}, {what}", highlight=False)
                steps_per_model = 0 if model else (recipe.total_steps(ds.n) if recipe is not None else train_cfg.steps)
                total = run_work_units(config, len(labels) * n_seeds, steps_per_model)
                with progress(opts, "landscape", total, "GD steps and Hessian/loss evaluations") as advance:
                    run = run_landscape(
                        dataclasses.replace(ds, X=ds.X.to(dev), y=ds.y.to(dev)), config,
                        models=None if model else arch_list, width=m, train_config=None if model else train_cfg,
                        seed=seed, saved=saved_tasks, seeds=None if model else tuple(range(seed, seed + n_seeds)),
                        recipe=recipe, match_loss_auto=match_auto,
                        saved_info={label: {"source": lm.source.get("path") or lm.source.get("factory"), "checkpoint": lm.source,
                                            **({"audit_rows": rows_note} if rows_note else {})}
                                    for label, lm in saved_models.items()},
                        progress=advance,
                    )
            except ParameterSelectionError as exc:
                raise AuditError(f"--params: {exc}") from None
            timings = {"load": load_time, **run.timings, "total": time.perf_counter() - t0}

            out = run.to_dict()
            report = build_report(
                SCHEMA,
                inputs={
                    "preset": key,
                    "dataset": ds_name if source.data is None else None,
                    "data": source.data,
                    "split": split_name,
                    "classes": source.classes,
                    "preprocess": source.preprocess,
                    "n_train": ntr,
                    "models": list(labels),
                    "saved_models": model,
                    "width": None if model else m,
                    "training": None if model else dataclasses.asdict(train_cfg),
                    "optimizer": None if model else (recipe.to_dict() if recipe is not None else {"optimizer": "gd", "lr": train_cfg.lr, "batch_size": None, "steps": train_cfg.steps, "loss": loss_name}),
                    "seeds": None if model else n_seeds,
                    "match_loss": match_target,
                    "match_loss_resolution": run.match_loss_resolution,
                    "loss_comparable_within": 0.10,
                    "landscape": dataclasses.asdict(config),
                },
                seeds={"base_seed": seed, "model_seed": None if model else seed, "subset_seed": seed, "landscape": config.seeds(),
                       "model_seeds": None if model else list(range(seed, seed + n_seeds))},
                device=dev,
                dtype=config.dtype,
                timings=timings,
                results={"dataset": ds.info, "models": out["models"], "gd_stability_bound": out["gd_stability_bound"],
                         "optimizer": out["optimizer"]},
                warnings=list(run.warnings),
                verdicts=list(run.verdicts),
            )
            renderables: list = build_tables(run.results, run.training if not model else {}, run.lr, run=run)
            renderables.extend(Text(f"- {v}") for v in run.verdicts)
            renderables.extend(Text(f"warning: {w}", style="yellow") for w in run.warnings)
            title = f"{ds.name}: n={ds.n}, {loss_name}, directions {config.directions}, seed {seed}"
            emit(opts, report, renderables, plot=lambda path: plot_landscape(run.results, path, title), png_name=PNG_NAME)
