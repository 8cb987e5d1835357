"""`attnaudit kappa`: thin CLI over :mod:`attnaudit.kappa`."""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Optional

import typer

from ..cli_common import DeviceOpt, SeedOpt, cli_errors, emit, parse_list, progress
from ..cli_options import DataOptions, OutputBundle, bundled
from ..errors import AuditError


def register(app: typer.Typer) -> None:
    @app.command("kappa")
    @bundled(data=DataOptions, out=OutputBundle)
    def kappa_command(
        data: DataOptions,
        out: OutputBundle,
        n: Annotated[Optional[str], typer.Option("--n", help="Subset size, or a list (64,128,256) for a sweep; default: all rows.")] = None,
        seeds: Annotated[int, typer.Option("--seeds", help="Number of random subsets per n (seeds seed, seed+1, ...).")] = 1,
        stratify: Annotated[bool, typer.Option("--stratify", help="Draw subsets stratified by class.")] = False,
        rank_tol: Annotated[Optional[float], typer.Option("--rank-tol", help="Relative rank tolerance (default max(n,d)*eps, numpy's matrix_rank rule).")] = None,
        direct_check: Annotated[bool, typer.Option("--direct-check/--no-direct-check", help="Measure kappa(G~) from f_att(X) directly.")] = True,
        seed: SeedOpt = 0,
        device: DeviceOpt = "auto",
    ) -> None:
        """Gram spectrum, condition numbers, linearized-attention amplification and NTK width scale."""
        from ..device import resolve_device
        from ..data import check_seed, load_dataset
        from ..kappa import SCHEMA, KappaConfig, analyse_kappa, build_tables, plot_kappa, summarise_sweep, sweep_cell
        from ..report import build_report

        with cli_errors(out.debug):
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
            with progress(opts, "kappa", len(ns) * len(seed_list)) as advance:
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
