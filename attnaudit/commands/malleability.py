"""`attnaudit malleability`: thin CLI over :mod:`attnaudit.malleability`."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer
from rich.text import Text

from ..cli_common import (
    DeviceOpt,
    cli_errors,
    emit,
    parse_list,
    preset_value,
    progress,
    refuse_training_options_for_saved_model,
)
from ..cli_options import DataOptions, OutputBundle, bundled
from ..errors import AuditError


def register(app: typer.Typer) -> None:
    @app.command("malleability")
    @bundled(source=DataOptions.defaults(dataset=None, split=None), out=OutputBundle)
    def malleability_command(
        source: DataOptions,
        out: OutputBundle,
        preset: Annotated[str, typer.Option("--preset", help="quick (digits, < 2 min) or paper (MNIST 2,000 train, PGD eps 0.3, 5 seeds, controls). Explicit options override it.")] = "quick",
        models: Annotated[Optional[str], typer.Option("--models", help="Models to compare, e.g. relu,attn (ratios are over the first).")] = None,
        attacks: Annotated[Optional[str], typer.Option("--attacks", help="pgd, fgsm, mim, random (noise control), none.")] = None,
        eps: Annotated[Optional[str], typer.Option("--eps", help="Attack radius, or a list (0.1,0.3) for a sensitivity sweep.")] = None,
        damping: Annotated[Optional[str], typer.Option("--damping", help="Hessian damping lambda in (H + lambda I)^-1, or a list.")] = None,
        seeds: Annotated[Optional[int], typer.Option("--seeds", help="Number of repeats (seeds seed, seed+1, ...): initialisation and attack randomness.")] = None,
        seed: Annotated[int, typer.Option("--seed", help="First seed; also fixes the train/test split.")] = 0,
        protocol: Annotated[Optional[str], typer.Option("--protocol", help="retrain (paper: retrain from the same init on perturbed data) or static (keep the model; the default with --model).")] = None,
        top_k: Annotated[Optional[int], typer.Option("--top-k", help="Flip rate among the top-k samples by clean |influence|.")] = None,
        estimator: Annotated[str, typer.Option("--estimator", help="exact, last-layer, cg or tracin.")] = "last-layer",
        norm: Annotated[str, typer.Option("--norm", help="linf or l2.")] = "linf",
        pgd_steps: Annotated[Optional[int], typer.Option("--pgd-steps", help="Steps of PGD and MIM.")] = None,
        step_size: Annotated[Optional[float], typer.Option("--step-size", help="PGD/MIM step (default 2.5 eps/steps for PGD, eps/steps for MIM).")] = None,
        n_train: Annotated[Optional[int], typer.Option("--n-train", help="Training samples.")] = None,
        n_test: Annotated[Optional[int], typer.Option("--n-test", help="Held-out samples whose summed loss the influence is measured on.")] = None,
        width: Annotated[Optional[int], typer.Option("--width", help="Hidden width m.")] = None,
        steps: Annotated[Optional[int], typer.Option("--steps", help="Full-batch GD steps (the budget under --match-loss).")] = None,
        lr: Annotated[Optional[float], typer.Option("--lr", help="GD learning rate.")] = None,
        loss: Annotated[str, typer.Option("--loss", help="mse or ce.")] = "mse",
        match_loss: Annotated[Optional[float], typer.Option("--match-loss", help="Train every model until its training loss reaches this value (or say it could not).")] = None,
        attn_context: Annotated[str, typer.Option("--attn-context", help="MLP-Attn under retrain: rebuild X^T X from the perturbed data (perturbed) or keep the clean one (clean).")] = "perturbed",
        controls: Annotated[Optional[bool], typer.Option("--controls/--no-controls", help="Run the reinit control (retrain on clean data from another init); off with --model.")] = None,
        model: Annotated[Optional[list[str]], typer.Option("--model", help="Audit a saved model (safetensors written by attnaudit) as it is, with --protocol static, on the data it was trained on; repeat for one relu and one attn model.")] = None,
        max_flip_rate: Annotated[Optional[float], typer.Option("--max-flip-rate", help="Exit 1 when a model's mean flip rate under an attack exceeds this share (CI gate).")] = None,
        device: DeviceOpt = "auto",
    ) -> None:
        """Influence malleability: do influence scores flip sign when the training data is perturbed?"""
        from ..data import check_seed, data_fingerprint, holdout_split, load_dataset
        from ..device import resolve_device
        from ..malleability import (
            PRESETS,
            SCHEMA,
            influence_memory_estimate,
            MalleabilityConfig,
            build_tables,
            plot_malleability,
            progress_total,
            run_malleability,
        )
        from ..report import build_report

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
            fixed = None
            if model:
                from ..models import load_model

                if models is not None:
                    raise AuditError("--model audits saved models and --models trains new ones; give one of them")
                refuse_training_options_for_saved_model(width=width, steps=steps, lr=lr, match_loss=match_loss)
                fixed = {}
                for path in model:
                    loaded = load_model(path)
                    if loaded.spec.arch in fixed:
                        raise AuditError(f"two saved {loaded.spec.arch} models given ({path}); give at most one per architecture")
                    fixed[loaded.spec.arch] = loaded
                models = ",".join(fixed)
            protocol = protocol if protocol is not None else ("static" if fixed else "retrain")
            controls = controls if controls is not None else not fixed
            kw = dict(
                models=tuple(parse_list(models, str, "--models")) if models is not None else ("relu", "attn"),
                attacks=tuple(parse_list(attacks, str, "--attacks")) if attacks is not None else ("pgd", "fgsm", "mim", "random"),
                eps=tuple(parse_list(eps, float, "--eps")) if eps is not None else tuple(p["eps"]),
                damping=tuple(parse_list(damping, float, "--damping")) if damping is not None else tuple(p["damping"]),
                seeds=tuple(range(seed, seed + n_seeds)),
                protocol=protocol,
                top_k=preset_value(top_k, p, "top_k"),
                estimator=estimator,
                norm=norm,
                pgd_steps=preset_value(pgd_steps, p, "pgd_steps"),
                step_size=step_size,
                width=preset_value(width, p, "width"),
                steps=preset_value(steps, p, "steps"),
                lr=preset_value(lr, p, "lr"),
                loss=loss,
                match_loss=match_loss,
                attn_context=attn_context,
                controls=controls,
                max_flip_rate=max_flip_rate,
            )
            config = MalleabilityConfig(**kw)  # validates every value before any data is read
            dev = resolve_device(device)
            opts.check_writable(("malleability.png",))
            ds_name = source.dataset if source.dataset is not None else (None if source.data is not None else p["dataset"])
            split_name = preset_value(source.split, p, "split")
            spec = source.spec(seed, dataset=ds_name, split=split_name)

            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            ds = load_dataset(spec)
            if ds.y is None:
                raise AuditError(f"{ds.name} has no labels; malleability needs labelled data (influence is defined on a loss)")
            train_ds, test_ds = holdout_split(ds, ntr, nte, seed=seed, stratify=True)
            timings["load"] = time.perf_counter() - t0
            memory = influence_memory_estimate(config, train_ds.d, ds.n_classes, ntr, nte, fixed)  # refuses before compute
            if not opts.quiet:
                tracked = "; ".join(f"{arch}: {', '.join(names)}" for arch, names in memory["tracked_parameter_names"].items())
                opts.console.print(
                    f"malleability: {ds.name} ({split_name}), {ntr} train / {nte} held-out, models {','.join(config.models)}, "
                    f"attacks {','.join(config.attacks)}, {len(config.seeds)} seed(s), "
                    f"{'saved models, no training' if fixed else f'{progress_total(config)} trainings'}; "
                    f"{config.estimator} influence over {memory['tracked_parameters']:,} parameters "
                    f"({tracked}) needs about "
                    f"{memory['bytes']['total'] / 2**20:,.1f} MB",
                    highlight=False,
                )
            t1 = time.perf_counter()
            with progress(opts, "malleability", progress_total(config)) as advance:
                result = run_malleability(
                    train_ds.X.to(dev), train_ds.y.to(dev), test_ds.X.to(dev), test_ds.y.to(dev), ds.n_classes, config,
                    value_range=ds.value_range, progress=advance, fixed_models=fixed,
                )
            if fixed:
                from ..models import training_data_mismatch

                fingerprint = data_fingerprint(train_ds.X, train_ds.y)
                result.warnings[:0] = [w for w in (training_data_mismatch(net, arch, fingerprint) for arch, net in fixed.items()) if w]
            timings.update({k: v for k, v in result.timings.items()})
            timings["analysis"] = time.perf_counter() - t1
            timings["total"] = time.perf_counter() - t0

            results = {
                "dataset": train_ds.info,
                "held_out": test_ds.info.get("holdout"),
                "value_range": ds.value_range,
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
                    "saved_models": list(model) if model else None,
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
            title = f"{ds.name}: {ntr} train, {config.protocol}, {config.estimator}, {config.norm}"
            emit(opts, report, renderables, plot=lambda path: plot_malleability(result, path, title), png_name="malleability.png")
            if result.exceeded:
                worst = max(result.exceeded, key=lambda e: e["flip_rate"])
                names = "; ".join(
                    f"{e['model']} under {e['attack']} (eps={e['eps']:g}, damping={e['damping']:g}): {100 * e['flip_rate']:.1f}%"
                    for e in result.exceeded
                )
                typer.echo(
                    f"flip rate above --max-flip-rate {100 * config.max_flip_rate:.1f}% for {len(result.exceeded)} cell(s), "
                    f"worst {worst['model']} under {worst['attack']}: {names}",
                    err=True,
                )
                raise typer.Exit(1)
