"""`attnaudit alignment`: options -> :func:`attnaudit.analyses.alignment.alignment.run_alignment` -> report.

Sign conventions of the report (see attnaudit/analyses/alignment/alignment.py and docs/alignment.md): every
``*_advantage_attn`` is relu minus attn for errors and attn minus relu for CKA, so a
positive value always means attention does better; a ``*_contrast`` is the advantage on the
principal target minus that on the random (or trailing) one, positive = the paper's claim.
"""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from attnaudit.cli.common import DeviceOpt, SeedOpt, cli_errors, emit, parse_list, preset_value, progress
from attnaudit.cli.options import ANALYSIS, PROTOCOL, DataOptions, ManualCommand, OutputBundle, bundled
from attnaudit.errors import AuditError


def register(app: typer.Typer) -> None:
    @app.command("alignment", cls=ManualCommand,
                 epilog="Example: attnaudit alignment --preset quick --json alignment.json --png alignment.png")
    @bundled(source=DataOptions.defaults(dataset=None, split=None, preprocess="center"), out=OutputBundle)
    def alignment_command(
        source: DataOptions,
        out: OutputBundle,
        preset: Annotated[str, typer.Option("--preset", help="quick (default; digits, n_train 500, about a minute on 2 CPU cores) or paper (MNIST train split, n_train 1000; pass --split test for the test-only copy). Explicit options override it.", rich_help_panel=PROTOCOL)] = "quick",
        n_train: Annotated[Optional[int], typer.Option("--n-train", help="Training rows per seed (a seeded, stratified split; default from --preset).", rich_help_panel=PROTOCOL)] = None,
        n_test: Annotated[Optional[int], typer.Option("--n-test", help="Test rows per seed, disjoint from the training rows (default from --preset).", rich_help_panel=PROTOCOL)] = None,
        n_seeds: Annotated[int, typer.Option("--seeds", help="Seeds seed, seed+1, ...: each sets the split, the target's random weights and directions, and the nets' init.", rich_help_panel=PROTOCOL)] = 5,
        width: Annotated[Optional[int], typer.Option("--width", help="Hidden width of the trained nets (default from --preset).", rich_help_panel=PROTOCOL)] = None,
        steps: Annotated[Optional[int], typer.Option("--steps", help="Full-batch GD step budget to reach the matched loss (default from --preset).", rich_help_panel=PROTOCOL)] = None,
        lr: Annotated[Optional[float], typer.Option("--lr", help="GD learning rate of both nets (default: --lr-fraction * 2n / lambda_max of each model's analytic NTK).", rich_help_panel=PROTOCOL)] = None,
        lr_fraction: Annotated[float, typer.Option("--lr-fraction", help="Fraction of GD's stability bound 2n / lambda_max used when --lr is not given.", rich_help_panel=PROTOCOL)] = 0.5,
        match_loss: Annotated[Optional[float], typer.Option("--match-loss", help="Matched training loss: GD stops at this relative training MSE ||f - y||^2/||y||^2; a net that does not reach it is flagged and left out of the net comparisons (default from --preset: 0.1).", rich_help_panel=PROTOCOL)] = None,
        nets: Annotated[bool, typer.Option("--nets/--no-nets", help="Train the finite nets too (--no-nets: kernel regression and CKA only).", rich_help_panel=PROTOCOL)] = True,
        targets: Annotated[Optional[str], typer.Option("--targets", help="Targets, comma-separated: principal, trailing, random, labels (default all).", rich_help_panel=ANALYSIS)] = None,
        k: Annotated[int, typer.Option("--k", help="Directions per designed target (top-k, trailing-k or k random).", rich_help_panel=ANALYSIS)] = 5,
        ridge: Annotated[float, typer.Option("--ridge", help="Kernel ridge relative to the kernel's mean eigenvalue: lambda = ridge * trace(K) / n.", rich_help_panel=ANALYSIS)] = 1e-3,
        attn_scaling: Annotated[str, typer.Option("--attn-scaling", help="MLP-Attn context scaling: rms (default, as the models), spectral or none.", rich_help_panel=ANALYSIS)] = "rms",
        rank_tol: Annotated[Optional[float], typer.Option("--rank-tol", help="Relative tolerance of the numerical rank that bounds the trailing directions (default max(n,d)*eps).", rich_help_panel=ANALYSIS)] = None,
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
    ) -> None:
        """Does the attention kernel lower the approximation error on targets aligned with the data's
        principal modes? Kernel ridge and trained-net errors, and CKA, of 2L-ReLU and MLP-Attn."""
        from attnaudit.analyses.alignment.alignment import PNG_NAME, PRESETS, SCHEMA, TARGETS, AlignmentConfig, build_tables, plot_alignment, run_alignment
        from attnaudit.data import check_seed, load_dataset
        from attnaudit.runtime.device import resolve_device
        from attnaudit.report.envelope import build_report

        with cli_errors(out.debug):
            opts = out.options()
            key = preset.strip().lower()
            if key not in PRESETS:
                raise AuditError(f"unknown --preset {preset!r}; use {' or '.join(PRESETS)}")
            p = PRESETS[key]
            if n_seeds < 1:
                raise AuditError(f"--seeds must be a positive integer, got {n_seeds}")
            check_seed(seed, "--seed", count=n_seeds)
            target_list = tuple(t.strip().lower() for t in parse_list(targets, str, "--targets")) if targets is not None else TARGETS
            config = AlignmentConfig(
                k=k, ridge=ridge, targets=target_list, seeds=tuple(range(seed, seed + n_seeds)),
                n_train=preset_value(n_train, p, "n_train"), n_test=preset_value(n_test, p, "n_test"),
                width=preset_value(width, p, "width"), steps=preset_value(steps, p, "steps"), lr=lr,
                lr_fraction=lr_fraction, match_loss=preset_value(match_loss, p, "match_loss"), nets=nets, attn_scaling=attn_scaling.strip().lower(),
                rank_tol=rank_tol,
            )
            dev = resolve_device(device)
            opts.check_writable((PNG_NAME,))
            ds_name = source.dataset if source.dataset is not None else (None if source.data is not None else p["dataset"])
            split_name = preset_value(source.split, p, "split")
            t0 = time.perf_counter()
            ds = load_dataset(source.spec(seed, n=None, dataset=ds_name, split=split_name))
            load_s = time.perf_counter() - t0
            if not opts.quiet:
                opts.console.print(
                    f"alignment: {ds.name} ({split_name}), {ds.n} rows, d={ds.d}; n_train {config.n_train}, n_test "
                    f"{config.n_test}, k {config.k}, ridge {config.ridge:g}, "
                    + (f"nets width {config.width}, <= {config.steps} GD steps to relative MSE {config.match_loss:g}, "
                       if config.nets else "kernels only, ")
                    + f"{n_seeds} seed(s)", highlight=False)
            with progress(opts, "alignment", len(config.seeds), "seeds") as advance:
                result = run_alignment(ds, config, device=dev, progress=advance)
            timings = {"load": load_s, **result.timings, "total": time.perf_counter() - t0}
            report = build_report(
                SCHEMA,
                inputs={
                    **source.inputs(),
                    "dataset": ds_name if source.data is None else None,
                    "split": split_name,
                    "preset": key,
                    "n_train": config.n_train,
                    "n_test": config.n_test,
                    "seeds": n_seeds,
                    **{k_: v for k_, v in config.to_dict().items() if k_ not in ("n_train", "n_test", "seeds")},
                },
                seeds={"base_seed": seed, "seeds": list(config.seeds),
                       "rule": "seed s: holdout split seed s, target weights/directions numpy default_rng([s, 0xA11]), "
                               "net init seed s (both models)"},
                device=dev,
                dtype="float64",
                timings=timings,
                results={"dataset": ds.info, **result.to_dict()},
                warnings=result.warnings,
                verdicts=result.verdicts(),
            )
            title = (f"{ds.name}: n_train {config.n_train}, n_test {config.n_test}, k {config.k}, ridge {config.ridge:g}, "
                     f"{len(config.seeds)} seeds")
            emit(opts, report, build_tables(result), plot=lambda path: plot_alignment(result, path, title), png_name=PNG_NAME)
