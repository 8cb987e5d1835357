"""`attnaudit malleability`: thin CLI over :mod:`attnaudit.analyses.malleability.malleability`."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer
from rich.text import Text

from attnaudit.cli.common import (
    DeviceOpt,
    exit_if_cells_failed,
    cli_errors,
    emit,
    parse_list,
    preset_value,
    progress,
    refuse_training_options_for_saved_model,
)
from attnaudit.cli.options import ANALYSIS, EXECUTION, PROTOCOL, ExecutorOptions, DataOptions, ManualCommand, ModelOptions, OutputBundle, bundled
from attnaudit.errors import AuditError


def register(app: typer.Typer) -> None:
    @app.command("malleability", cls=ManualCommand, epilog="Example: attnaudit malleability --preset quick --json malleability.json")
    @bundled(source=DataOptions.defaults(dataset=None, split=None), out=OutputBundle, saved=ModelOptions,
             execution=ExecutorOptions)
    def malleability_command(
        source: DataOptions,
        out: OutputBundle,
        saved: ModelOptions,
        execution: ExecutorOptions,
        preset: Annotated[str, typer.Option("--preset", help="quick (digits, < 2 min) or paper (MNIST 2,000 train, PGD eps 0.3, 5 seeds, controls). Explicit options override it.", rich_help_panel=PROTOCOL)] = "quick",
        models: Annotated[Optional[str], typer.Option("--models", help="Models to compare, e.g. relu,attn (ratios are over the first).", rich_help_panel=PROTOCOL)] = None,
        attacks: Annotated[Optional[str], typer.Option("--attacks", help="pgd, fgsm, mim, sign (the default random control: +-eps per coordinate), random (uniform noise in the ball), none.", rich_help_panel=ANALYSIS)] = None,
        eps: Annotated[Optional[str], typer.Option("--eps", help="Attack radius, or a list (0.1,0.3) for a sensitivity sweep.", rich_help_panel=ANALYSIS)] = None,
        damping: Annotated[Optional[str], typer.Option("--damping", help="Hessian damping lambda in (H + lambda I)^-1: absolute (1e-3), or relative to the curvature (1e-3x = 1e-3 lambda_max(H), per model), or a list.", rich_help_panel=ANALYSIS)] = None,
        seeds: Annotated[Optional[int], typer.Option("--seeds", help="Number of repeats (seeds seed, seed+1, ...): initialisation, attack randomness, data order (sgd/adam) and, with --resample-data, the training rows.", rich_help_panel=PROTOCOL)] = None,
        seed: Annotated[int, typer.Option("--seed", help="First seed; also fixes the train/test split (each seed draws its own with --resample-data).", rich_help_panel=PROTOCOL)] = 0,
        protocol: Annotated[Optional[str], typer.Option("--protocol", help="retrain (paper: retrain from the same init on perturbed data), static (keep the model; the default with --checkpoint) or finetune (fine-tune copies of a checkpoint on perturbed and on clean data, --finetune-steps).", rich_help_panel=PROTOCOL)] = None,
        top_k: Annotated[Optional[str], typer.Option("--top-k", help="Flip rate among the top-k samples by clean |influence|; a list (10,30,100) reports each k (the first in the main columns).", rich_help_panel=ANALYSIS)] = None,
        estimator: Annotated[str, typer.Option("--estimator", help="exact, last-layer, cg, tracin, kfac, ekfac (Kronecker-factored, for transformers over all parameters) or projected (random sign projection, --proj-dim).", rich_help_panel=ANALYSIS)] = "last-layer",
        proj_dim: Annotated[int, typer.Option("--proj-dim", help="Dimension k of --estimator projected (capped at the tracked parameter count, where it equals exact).", rich_help_panel=ANALYSIS)] = 512,
        cache: Annotated[Optional[str], typer.Option("--cache", metavar="PATH", help="Folder keeping the fitted K-FAC/EK-FAC factors, one file per model + training-data fingerprint, reused by later runs.", rich_help_panel=EXECUTION)] = None,
        curvature: Annotated[str, typer.Option("--curvature", help="Curvature of --estimator kfac/ekfac: ggn (exact Gauss-Newton columns), fisher (labels sampled from the model, kronfluence's choice), empirical (the true labels' loss gradients) or auto (ggn up to 32 classes). With --estimator exact: auto is the Hessian, ggn the exact Gauss-Newton matrix (what K-FAC approximates).", rich_help_panel=ANALYSIS)] = "auto",
        params: Annotated[Optional[str], typer.Option("--params", help="Parameters the influence is over: head (default with last-layer), all, a module name or glob patterns (e.g. 'blocks.1.*'); exact/cg default to all.", rich_help_panel=ANALYSIS)] = None,
        finetune_steps: Annotated[int, typer.Option("--finetune-steps", help="Optimizer steps of --protocol finetune.", rich_help_panel=PROTOCOL)] = 100,
        finetune_optimizer: Annotated[Optional[str], typer.Option("--finetune-optimizer", help="gd, sgd or adam for --protocol finetune (default: the checkpoint's recorded optimizer, else adam).", rich_help_panel=PROTOCOL)] = None,
        finetune_lr: Annotated[Optional[float], typer.Option("--finetune-lr", help="Learning rate of --protocol finetune (default: the checkpoint's recorded rate, else 1e-4).", rich_help_panel=PROTOCOL)] = None,
        finetune_batch_size: Annotated[Optional[int], typer.Option("--finetune-batch-size", help="Mini-batch of --protocol finetune (default: recorded, else 64).", rich_help_panel=PROTOCOL)] = None,
        norm: Annotated[str, typer.Option("--norm", help="linf or l2.", rich_help_panel=ANALYSIS)] = "linf",
        pgd_steps: Annotated[Optional[int], typer.Option("--pgd-steps", help="Steps of PGD and MIM.", rich_help_panel=ANALYSIS)] = None,
        step_size: Annotated[Optional[float], typer.Option("--step-size", help="PGD/MIM step (default 2.5 eps/steps for PGD, eps/steps for MIM).", rich_help_panel=ANALYSIS)] = None,
        n_train: Annotated[Optional[int], typer.Option("--n-train", help="Training samples.", rich_help_panel=PROTOCOL)] = None,
        n_test: Annotated[Optional[int], typer.Option("--n-test", help="Held-out samples whose summed loss the influence is measured on.", rich_help_panel=PROTOCOL)] = None,
        width: Annotated[Optional[int], typer.Option("--width", help="Hidden width m.", rich_help_panel=PROTOCOL)] = None,
        steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (the budget under --match-loss).", rich_help_panel=PROTOCOL)] = None,
        lr: Annotated[Optional[str], typer.Option("--lr", help="Learning rate, or per model (relu=10,attn=8). Default: the preset's (4) for gd/sgd, 1e-3 for adam.", rich_help_panel=PROTOCOL)] = None,
        optimizer: Annotated[Optional[str], typer.Option("--optimizer", help="How built-in models are trained: gd (full-batch gradient descent, default), sgd or adam.", rich_help_panel=PROTOCOL)] = None,
        batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Mini-batch of --optimizer sgd/adam (default: full batch).", rich_help_panel=PROTOCOL)] = None,
        resample_data: Annotated[bool, typer.Option("--resample-data/--fixed-data", help="Each seed draws its own train/held-out rows (split seeded by that seed), so intervals include the choice of training rows.", rich_help_panel=PROTOCOL)] = False,
        loss: Annotated[Optional[str], typer.Option("--loss", help="mse or ce (default mse; a checkpoint's recorded training loss).", rich_help_panel=PROTOCOL)] = None,
        match_loss: Annotated[Optional[str], typer.Option("--match-loss", help="Train every model until its training loss reaches this value (or say it could not); per model (relu=0.1,attn=0.1); auto: every model to the largest clean loss any reaches within --steps (default of --preset quick); none: fixed steps (default of --preset paper).", rich_help_panel=PROTOCOL)] = None,
        attn_context: Annotated[str, typer.Option("--attn-context", help="MLP-Attn under retrain: rebuild X^T X from the perturbed data (perturbed) or keep the clean one (clean).", rich_help_panel=PROTOCOL)] = "perturbed",
        controls: Annotated[Optional[bool], typer.Option("--controls/--no-controls", help="Run the training-randomness control: reinit (retrain on clean data from another init) or, under finetune, reorder (fine-tune on clean data in another order); off for static.", rich_help_panel=PROTOCOL)] = None,
        max_flip_rate: Annotated[Optional[float], typer.Option("--max-flip-rate", help="Exit 1 when a model's mean flip rate under an attack exceeds this share (CI gate).", rich_help_panel=ANALYSIS)] = None,
        device: DeviceOpt = "auto",
    ) -> None:
        """Influence malleability: do influence scores flip sign when the training data is perturbed?"""
        from attnaudit.data import HoldoutRecipe, check_seed, data_fingerprint, load_dataset
        from attnaudit.runtime.device import resolve_device
        from attnaudit.core.fit import DEFAULT_ADAM_LR
        from attnaudit.analyses.malleability.malleability import (
            PRESETS,
            SCHEMA,
            influence_memory_estimate,
            MalleabilityConfig,
            build_tables,
            parse_match_loss,
            parse_per_model,
            plot_malleability,
            progress_total,
            run_malleability,
        )
        from attnaudit.report.envelope import build_report

        with cli_errors(out.debug):
            opts = out.options()
            if preset not in PRESETS:
                raise AuditError(f"unknown --preset {preset!r}; use {' or '.join(PRESETS)}")
            p = PRESETS[preset]
            n_seeds = preset_value(seeds, p, "seeds_count", len(p["seeds"]))
            if n_seeds < 1:
                raise AuditError(f"--seeds must be >= 1, got {n_seeds}")
            check_seed(seed, "--seed", count=n_seeds)
            ntr, nte = preset_value(n_train, p, "n_train"), preset_value(n_test, p, "n_test")
            for name, value in (("--n-train", ntr), ("--n-test", nte)):
                if value < 1:
                    raise AuditError(f"{name} must be a positive integer, got {value}")
            loaded: dict = {}
            if saved.given:
                if models is not None:
                    raise AuditError("--checkpoint audits saved models and --models trains new ones; give one of them")
                refuse_training_options_for_saved_model(width=width, steps=steps, lr=lr, match_loss=match_loss,
                                                        optimizer=optimizer, batch_size=batch_size)
                if resample_data:
                    raise AuditError("--resample-data draws new training rows per seed, which a saved model was not trained on; drop it")
                loaded = saved.load()  # every file checked before any data are read
                models = ",".join(loaded)
            elif protocol == "finetune":
                raise AuditError("--protocol finetune fine-tunes a saved model; give --checkpoint (or --factory)")
            protocol = protocol if protocol is not None else ("static" if loaded else "retrain")
            controls = controls if controls is not None else (not loaded or protocol != "static")
            rebuild = {}
            if loaded and protocol == "retrain":
                from attnaudit.models.checkpoints import rebuild_of

                rebuild = {label: rb for label, rb in ((label, rebuild_of(lm)) for label, lm in loaded.items()) if rb}
                missing = [label for label in loaded if label not in rebuild]
                if missing:
                    raise AuditError(
                        f"--protocol retrain re-runs a checkpoint's recorded training recipe, and {', '.join(missing)} "
                        "records none (attnaudit train writes it); audit it as it is (--protocol static) or fine-tune "
                        "it (--protocol finetune --finetune-steps N)"
                    )
            recorded = [lm.recipe or {} for lm in loaded.values()]
            if loss is None:
                losses = {lm.loss for lm in loaded.values() if lm.loss}
                loss = losses.pop() if len(losses) == 1 else "mse"
            first = recorded[0] if recorded else {}
            ft_optimizer = finetune_optimizer or (first.get("optimizer") if first.get("optimizer") in ("gd", "sgd", "adam") else "adam")
            ft_lr = finetune_lr if finetune_lr is not None else (float(first["lr"]) if isinstance(first.get("lr"), (int, float)) else 1e-4)
            ft_batch = finetune_batch_size if finetune_batch_size is not None else (
                int(first["batch_size"]) if isinstance(first.get("batch_size"), int) else 64)
            from attnaudit.analyses.influence.influence import parse_damping

            opt = optimizer if optimizer is not None else "gd"
            lr_value = parse_per_model(lr, "--lr") if lr is not None else (DEFAULT_ADAM_LR if opt == "adam" else p["lr"])
            top_ks = tuple(parse_list(top_k, int, "--top-k")) if top_k is not None else (p["top_k"],)
            kw = dict(
                models=tuple(parse_list(models, str, "--models")) if models is not None else ("relu", "attn"),
                attacks=tuple(parse_list(attacks, str, "--attacks")) if attacks is not None else ("pgd", "fgsm", "mim", "sign"),
                eps=tuple(parse_list(eps, float, "--eps")) if eps is not None else tuple(p["eps"]),
                damping=tuple(parse_damping(d) for d in parse_list(damping, str, "--damping")) if damping is not None else tuple(p["damping"]),
                seeds=tuple(range(seed, seed + n_seeds)),
                protocol=protocol,
                top_k=top_ks[0],
                top_ks=top_ks,
                estimator=estimator,
                proj_dim=proj_dim,
                curvature=curvature,
                cache_dir=cache,
                norm=norm,
                pgd_steps=preset_value(pgd_steps, p, "pgd_steps"),
                step_size=step_size,
                width=preset_value(width, p, "width"),
                steps=preset_value(steps, p, "steps"),
                lr=lr_value,
                loss=loss,
                match_loss=(parse_match_loss(match_loss) if match_loss is not None
                            else None if loaded else p.get("match_loss")),
                optimizer=opt,
                batch_size=batch_size,
                resample_data=resample_data,
                attn_context=attn_context,
                controls=controls,
                max_flip_rate=max_flip_rate,
                params=params,
                finetune_steps=finetune_steps,
                finetune_optimizer=ft_optimizer,
                finetune_lr=ft_lr,
                finetune_batch_size=ft_batch,
                saved_models=bool(loaded),
            )
            config = MalleabilityConfig(**kw)  # validates every value before any data is read
            dev = resolve_device(device)
            opts.check_writable(("malleability.png",))
            ds_name = source.dataset if source.dataset is not None else (None if source.data is not None else p["dataset"])
            split_name = preset_value(source.split, p, "split")
            spec = source.spec(seed, dataset=ds_name, split=split_name)

            executor = execution.config()
            if loaded and (executor.kind != "local" or executor.jobs > 1 or executor.resume_dir):
                raise AuditError("saved models are audited in this process; drop --executor ray / --jobs / --resume")
            executor.check_available()
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            recipe = None if loaded else HoldoutRecipe.of(spec, ntr, nte, seed, stratify=True)
            if recipe is not None:  # the rows every worker rebuilds from the recipe
                train_ds, test_ds = recipe.load()
                ds = train_ds
            else:
                ds = load_dataset(spec)
            if ds.y is None:
                raise AuditError(f"{ds.name} has no labels; malleability needs labelled data (influence is defined on a loss)")
            fixed = None
            rows_note = None
            if loaded:
                from attnaudit.models.checkpoints import audit_split, fit_to_data

                loaded = {label: fit_to_data(lm, ds) for label, lm in loaded.items()}
                fixed = {label: lm.task(loss=config.loss, params="all") for label, lm in loaded.items()}
                train_ds, test_ds, rows_note = audit_split(ds, loaded, ntr, nte, seed)
                n_classes = next(iter(fixed.values())).n_classes
            else:
                n_classes = ds.n_classes
            timings["load"] = time.perf_counter() - t0
            memory = influence_memory_estimate(config, train_ds.d, n_classes, train_ds.n, test_ds.n, fixed, train_ds.X[:1])  # refuses before compute
            if not opts.quiet:
                tracked = "; ".join(f"{arch}: {', '.join(names)}" for arch, names in memory["tracked_parameter_names"].items())
                opts.console.print(
                    f"malleability: {ds.name} ({split_name}), {train_ds.n} train / {test_ds.n} held-out, models {','.join(config.models)}, "
                    f"attacks {','.join(config.attacks)}, {len(config.seeds)} seed(s), "
                    f"{({'static': 'saved models, no training', 'finetune': f'{progress_total(config)} fine-tunings', 'retrain': f'{progress_total(config)} re-runs of the recorded recipe'}[config.protocol]) if fixed else f'{progress_total(config)} trainings'}; "
                    f"{config.estimator} influence over {memory['tracked_parameters']:,} parameters "
                    f"({tracked}) needs about "
                    f"{memory['bytes']['total'] / 2**20:,.1f} MB",
                    highlight=False,
                )
            t1 = time.perf_counter()
            with progress(opts, "malleability", progress_total(config), "trainings with influence") as advance:
                result = run_malleability(
                    train_ds.X.to(dev), train_ds.y.to(dev), test_ds.X.to(dev), test_ds.y.to(dev), n_classes, config,
                    value_range=ds.value_range, progress=advance, fixed_models=fixed, rebuild=rebuild,
                    executor=executor, data=recipe,
                )
            if fixed and rows_note["rows"] != "checkpoint split":
                from attnaudit.models.builtin import training_data_mismatch

                fingerprint = data_fingerprint(train_ds.X, train_ds.y)
                result.warnings[:0] = [w for w in (training_data_mismatch(lm, label, fingerprint) for label, lm in loaded.items()) if w]
            timings.update({k: v for k, v in result.timings.items()})
            timings["analysis"] = time.perf_counter() - t1
            timings["total"] = time.perf_counter() - t0

            results = {
                "dataset": train_ds.info,
                "held_out": test_ds.info.get("holdout"),
                "value_range": ds.value_range,
                "audit_rows": rows_note,
                "checkpoints": {label: lm.source for label, lm in loaded.items()} or None,
                **result.to_dict(),
            }
            report = build_report(
                SCHEMA,
                inputs={
                    "preset": preset,
                    "dataset": ds_name if source.data is None else None,
                    "data": source.data,
                    "split": split_name,
                    "classes": source.classes,
                    "preprocess": source.preprocess,
                    "n_train": ntr,
                    "n_test": nte,
                    **{k: v for k, v in kw.items() if k != "seeds"},
                    "loss": config.loss,
                    "saved_models": saved.sources() or None,
                    "execution": result.execution,
                },
                seeds={"seeds": list(config.seeds), "split_seed": seed, "reinit_seed_offset": 1_000_003},
                device=dev,
                dtype="float64",
                timings=timings,
                results=results,
                warnings=result.warnings,
                verdicts=result.verdicts,
            )
            renderables: list = build_tables(result)
            # Text, not markup strings: verdicts contain brackets ([low, high]) that are not rich tags.
            renderables.extend(Text(f"- {v}") for v in result.verdicts)
            renderables.extend(Text(f"warning: {w}", style="yellow") for w in result.warnings)
            title = f"{ds.name}: {train_ds.n} train, {config.protocol}, {config.estimator}, {config.norm}"
            emit(opts, report, renderables, plot=lambda path: plot_malleability(result, path, title), png_name="malleability.png")
            exit_if_cells_failed(result.failed_cells)
            if result.exceeded:
                from attnaudit.analyses.influence.influence import damping_label

                worst = max(result.exceeded, key=lambda e: e["flip_rate"])
                names = "; ".join(
                    f"{e['model']} under {e['attack']} (eps={e['eps']:g}, damping={damping_label(e['damping'])}): {100 * e['flip_rate']:.1f}%"
                    for e in result.exceeded
                )
                typer.echo(
                    f"flip rate above --max-flip-rate {100 * config.max_flip_rate:.1f}% for {len(result.exceeded)} cell(s), "
                    f"worst {worst['model']} under {worst['attack']}: {names}",
                    err=True,
                )
                raise typer.Exit(1)
