"""`attnaudit ntk-distance`: thin CLI over :mod:`attnaudit.ntk_distance`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..cli_common import (
    DeviceOpt,
    SeedOpt,
    cli_errors,
    emit,
    parse_list,
    progress,
)
from ..cli_options import DataOptions, OutputBundle, bundled
from ..errors import AuditError

PNG_NAME = "ntk_distance.png"


def _model_filename(arch: str, width: int, seed: int) -> str:
    return f"{arch}_m{width}_seed{seed}.safetensors"


def register(app: typer.Typer) -> None:
    @app.command("ntk-distance")
    @bundled(source=DataOptions, out=OutputBundle)
    def ntk_distance_command(
        source: DataOptions,
        out: OutputBundle,
        preset: Annotated[str, typer.Option("--preset", help="quick (default; digits in about a minute) or paper (MNIST-size: n_train 500, widths 16-4096, 3 seeds). Explicit options override it.")] = "quick",
        models: Annotated[str, typer.Option("--models", help="Models to sweep: relu (2L-ReLU), attn (MLP-Attn), comma-separated.")] = "relu,attn",
        widths: Annotated[Optional[str], typer.Option("--widths", help="Hidden widths, e.g. 16,64,256,1024,4096 (default: preset).")] = None,
        seeds: Annotated[Optional[int], typer.Option("--seeds", help="Number of initialisation seeds per width: seed, seed+1, ... (default: preset).")] = None,
        n_train: Annotated[Optional[int], typer.Option("--n-train", help="Training points (default: preset).")] = None,
        n_test: Annotated[Optional[int], typer.Option("--n-test", help="Held-out points (default: preset).")] = None,
        steps: Annotated[Optional[int], typer.Option("--steps", help="Full-batch GD steps (default: preset).")] = None,
        lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate (default: the rule lr = lr_fraction * 2n / lambda_max(Theta_inf)).")] = None,
        lr_fraction: Annotated[float, typer.Option("--lr-fraction", help="Fraction of the stable step 2n/lambda_max used when --lr is not given.")] = 0.5,
        loss: Annotated[str, typer.Option("--loss", help="mse (closed-form kernel predictor) or ce (linearized GD iterated in function space).")] = "mse",
        parametrization: Annotated[str, typer.Option("--parametrization", help="ntk or standard.")] = "ntk",
        init: Annotated[str, typer.Option("--init", help="antisymmetric (f_0 = 0) or standard.")] = "antisymmetric",
        attn_scaling: Annotated[str, typer.Option("--attn-scaling", help="Scale of the attention context: rms, spectral or none.")] = "rms",
        predictor: Annotated[str, typer.Option("--predictor", help="discrete (exact for GD steps) or continuous (gradient flow for time lr*steps).")] = "discrete",
        dtype: Annotated[Optional[str], typer.Option("--dtype", help="Training dtype for every width: float64 or float32 (default: float64; the paper preset uses float32 from width 1024). Kernels and metrics are always float64.")] = None,
        kernel_points: Annotated[Optional[int], typer.Option("--kernel-points", help="Training points used for the kernel-movement metrics (default: all).")] = None,
        save_models: Annotated[Optional[str], typer.Option("--save-models", help="Folder to save every trained network (safetensors + JSON side-car).")] = None,
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
    ) -> None:
        """Distance of finite 2L-ReLU / MLP-Attn networks from their NTK predictor across widths."""
        from ..data import check_seed, data_fingerprint, holdout_split, load_dataset
        from ..device import resolve_device, resolve_dtype
        from ..models import save_model
        from ..ntk_distance import PRESETS, SCHEMA, NTKDistanceConfig, build_tables, plot_ntk_distance, run_ntk_distance
        from ..report import build_report, check_target

        with cli_errors(out.debug):
            opts = out.options()
            key = preset.strip().lower()
            if key not in PRESETS:
                raise AuditError(f"unknown --preset {preset!r}; use {' or '.join(PRESETS)}")
            base = PRESETS[key]
            model_list = tuple(parse_list(models, str, "--models"))
            width_list = tuple(parse_list(widths, int, "--widths")) if widths is not None else base["widths"]
            n_seeds = base["n_seeds"] if seeds is None else seeds
            if n_seeds < 1:
                raise AuditError(f"--seeds must be >= 1, got {n_seeds}")
            check_seed(seed, "--seed", count=n_seeds)
            ntr = base["n_train"] if n_train is None else n_train
            nte = base["n_test"] if n_test is None else n_test
            if ntr < 2:
                raise AuditError(f"--n-train must be >= 2, got {ntr}")
            if nte < 1:
                raise AuditError(f"--n-test must be >= 1, got {nte}")
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
            try:
                ds = load_dataset(spec)
            except AuditError as exc:
                # the data layer speaks of --n; here the row count is --n-train + --n-test
                if "--n " in str(exc):
                    raise AuditError(
                        f"--n-train {ntr} + --n-test {nte} = {ntr + nte} rows: "
                        + str(exc).replace("lower --n", "lower --n-train/--n-test")
                    ) from None
                raise
            if ds.y is None:
                raise AuditError(f"{ds.name} has no labels; ntk-distance trains classifiers, so give labelled data")
            train_ds, test_ds = holdout_split(ds, ntr, nte, seed, stratify=True)
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
            with progress(opts, "ntk-distance", total) as advance:
                result = run_ntk_distance(
                    train_ds.X.to(dev), train_ds.y.to(dev), test_ds.X.to(dev), test_ds.y.to(dev), ds.n_classes, config,
                    progress=lambda: advance(1), on_model=on_model if save_dir is not None else None,
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
