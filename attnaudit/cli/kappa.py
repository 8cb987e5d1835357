"""`attnaudit kappa`: thin CLI over :mod:`attnaudit.analyses.kappa.dataset` (data) and, with a model
(``--checkpoint``/``--factory``), :mod:`attnaudit.analyses.kappa.layers` (per-layer conditioning)."""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Optional

import typer

from attnaudit.cli.common import DeviceOpt, SeedOpt, cli_errors, emit, parse_list, progress
from attnaudit.cli.options import ANALYSIS, PROTOCOL, DataOptions, ManualCommand, ModelOptions, OutputBundle, bundled
from attnaudit.errors import AuditError


def register(app: typer.Typer) -> None:
    @app.command("kappa", cls=ManualCommand, epilog="Example: attnaudit kappa --dataset digits --json kappa.json")
    @bundled(data=DataOptions, out=OutputBundle, saved=ModelOptions)
    def kappa_command(
        data: DataOptions,
        out: OutputBundle,
        saved: ModelOptions,
        n: Annotated[Optional[str], typer.Option("--n", help="Subset size, or a list (64,128,256) for a sweep; default: all rows (with a model: the batch, default 256).", rich_help_panel=PROTOCOL)] = None,
        seeds: Annotated[int, typer.Option("--seeds", help="Number of random subsets per n (seeds seed, seed+1, ...).", rich_help_panel=PROTOCOL)] = 1,
        stratify: Annotated[bool, typer.Option("--stratify", help="Draw subsets stratified by class.", rich_help_panel=PROTOCOL)] = False,
        rank_tol: Annotated[Optional[float], typer.Option("--rank-tol", help="Relative rank tolerance (default max(n,d)*eps, numpy's matrix_rank rule).", rich_help_panel=ANALYSIS)] = None,
        direct_check: Annotated[bool, typer.Option("--direct-check/--no-direct-check", help="Measure kappa(G~) from f_att(X) directly.", rich_help_panel=ANALYSIS)] = True,
        layers: Annotated[Optional[str], typer.Option("--layers", help="With a model: analyse these modules (names or glob patterns, comma-separated, e.g. 'blocks.*.attn'); default: every attention layer found.", rich_help_panel=ANALYSIS)] = None,
        gram: Annotated[Optional[str], typer.Option("--gram", help="With a model: tokens (per-layer token Grams, default) or entk (also the empirical-NTK Gram of the whole model on the batch).", rich_help_panel=ANALYSIS)] = None,
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
    ) -> None:
        """Gram spectrum, condition numbers, linearized-attention amplification (direct check with a
        calibrated round-off budget) and the paper's width requirement kappa^6 n ln n against 1e12;
        with --checkpoint, the same per attention layer of a trained transformer."""
        from attnaudit.runtime.device import resolve_device
        from attnaudit.data import check_seed, load_dataset
        from attnaudit.analyses.kappa.dataset import SCHEMA, KappaConfig, analyse_kappa, build_tables, plot_kappa, summarise_sweep, sweep_cell, sweep_verdicts
        from attnaudit.report.envelope import build_report

        with cli_errors(out.debug):
            if saved.given:
                return _layers_command(data, out, saved, n=n, seeds=seeds, stratify=stratify, rank_tol=rank_tol,
                                       layers=layers, gram=gram, seed=seed, device=device)
            if layers is not None or gram is not None:
                raise AuditError("--layers and --gram analyse a model's layers; give the model with --checkpoint (or --factory)")
            opts = out.options()
            if seeds < 1:
                raise AuditError(f"--seeds must be >= 1, got {seeds}")
            ns = parse_list(n, int, "--n") if n is not None else [None]
            if any(v is not None and v < 1 for v in ns):
                raise AuditError("--n values must be positive integers")
            if len(set(ns)) != len(ns):
                raise AuditError("a value is listed twice in --n; list each subset size once")
            check_seed(seed, "--seed", count=seeds)
            config = KappaConfig(rank_tol=rank_tol, direct_check=direct_check)
            dev = resolve_device(device)
            opts.check_writable(("kappa.png",))
            base_spec = data.spec(seed, n=ns[0], stratify=stratify)

            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            sweeping = len(ns) > 1 or seeds > 1
            seed_list = [seed + i for i in range(seeds)]
            cells = []
            detail_n = max(ns, key=lambda v: -1 if v is None else v)
            detail_ds = None
            load_s = 0.0
            with progress(opts, "kappa", len(ns) * len(seed_list), "subsets") as advance:
                for n_i in ns:
                    for s in seed_list:
                        tl = time.perf_counter()
                        ds = load_dataset(dataclasses.replace(base_spec, n=n_i, seed=s))
                        load_s += time.perf_counter() - tl
                        if n_i == detail_n and s == seed:
                            detail_ds = ds
                        if sweeping:
                            cells.append(sweep_cell(ds.X.to(dev), s, config))
                        advance(1)
            timings["load"] = load_s
            t1 = time.perf_counter()
            result = analyse_kappa(detail_ds.X.to(dev), config)
            timings["analysis"] = time.perf_counter() - t1
            summary = summarise_sweep(cells) if sweeping else None
            if summary:
                result.verdicts.extend(sweep_verdicts(summary))
            timings["total"] = time.perf_counter() - t0

            results = {"dataset": detail_ds.info, **result.to_dict()}
            if sweeping:
                results["sweep"] = {"cells": [c.to_dict() for c in cells], "summary": [s.to_dict() for s in summary]}
            report = build_report(
                SCHEMA,
                inputs={
                    **data.inputs(),
                    "n": ns,
                    "seeds": seeds,
                    "stratify": stratify,
                    "rank_tol": rank_tol,
                    "direct_check": direct_check,
                },
                seeds={"base_seed": seed, "subset_seeds": seed_list},
                device=dev,
                dtype="float64",
                timings=timings,
                results=results,
                verdicts=result.verdicts,
            )
            renderables = build_tables(result, summary, detail_ds.name)
            title = f"{detail_ds.name} (n={result.base.n}, d={result.base.d})"
            emit(opts, report, renderables, plot=lambda p: plot_kappa(result, summary, p, title), png_name="kappa.png")


def _layers_command(data: DataOptions, out: OutputBundle, saved: ModelOptions, *, n: Optional[str], seeds: int,
                    stratify: bool, rank_tol: Optional[float], layers: Optional[str], gram: Optional[str],
                    seed: int, device: str) -> None:
    """``kappa --checkpoint``: per-layer conditioning of saved models on a batch of the data."""
    from attnaudit.models.checkpoints import fit_to_data
    from attnaudit.data import check_seed, load_dataset
    from attnaudit.runtime.device import resolve_device
    from attnaudit.analyses.kappa.layers import PNG_NAME, SCHEMA, LayerKappaConfig, analyse_layers, build_tables, find_attention_layers, plot_layer_kappa
    from attnaudit.report.envelope import build_report

    opts = out.options()
    if seeds != 1:
        raise AuditError("--seeds sweeps subsets of the data alone; with a model the batch is one draw (--n, --seed)")
    ns = parse_list(n, int, "--n") if n is not None else [256]
    if len(ns) != 1:
        raise AuditError("with a model --n is one batch size (e.g. --n 256), not a list")
    patterns = tuple(parse_list(layers, str, "--layers")) if layers is not None else None
    check_seed(seed, "--seed")
    config = LayerKappaConfig(n=ns[0], layers=patterns, gram=(gram or "tokens").strip().lower(), rank_tol=rank_tol, seed=seed)
    dev = resolve_device(device)
    config = dataclasses.replace(config, device=str(dev))
    opts.check_writable((PNG_NAME,))

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    models = saved.load()  # every file checked before any data are read
    for lm in models.values():  # a --layers typo fails before the data are read
        find_attention_layers(lm.module, config.layers)
    try:
        ds = load_dataset(data.spec(seed, n=config.n, stratify=stratify))
    except AuditError as exc:
        if n is not None or "rows available" not in str(exc):
            raise
        ds = load_dataset(data.spec(seed, n=None, stratify=stratify))  # fewer rows than the default 256: take all
        config = dataclasses.replace(config, n=ds.n)
    fitted = {label: fit_to_data(lm, ds) for label, lm in models.items()}
    timings["load"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    results = []
    with progress(opts, "kappa", len(fitted), "models") as advance:
        for label, lm in fitted.items():
            results.append(analyse_layers(lm, ds.X, config, label=label))
            advance(1)
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0

    verdicts = [v for r in results for v in r.verdicts]
    report = build_report(
        SCHEMA,
        inputs={
            **data.inputs(),
            "models": saved.sources(),
            "n": config.n,
            "stratify": stratify,
            "layers": list(patterns) if patterns else None,
            "gram": config.gram,
            "rank_tol": rank_tol,
        },
        seeds={"base_seed": seed, "subset_seeds": [seed]},
        device=dev,
        dtype="float64",
        timings=timings,
        results={
            "dataset": ds.info,
            "models": {r.label: {"source": fitted[r.label].source, **r.to_dict()} for r in results},
        },
        verdicts=verdicts,
    )
    title = f"{ds.name}, {ds.n} samples: " + ", ".join(r.label for r in results)
    emit(opts, report, build_tables(results), plot=lambda p: plot_layer_kappa(results, p, title), png_name=PNG_NAME)
