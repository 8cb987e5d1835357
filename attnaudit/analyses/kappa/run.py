"""`kappa` as a request and a run: conditioning of a data set, or of a trained model's layers.

Without a model: the Gram spectrum, condition numbers and linearized-attention amplification
of the data (:mod:`attnaudit.analyses.kappa.dataset`), optionally over subset sizes ``n`` and
``seeds`` random subsets. With a model (``checkpoint``/``factory``/``loaded_models``): the
same per attention layer on one batch (:mod:`attnaudit.analyses.kappa.layers`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from attnaudit.analyses.kappa.dataset import (
    SCHEMA,
    KappaConfig,
    analyse_kappa,
    build_tables,
    plot_kappa,
    summarise_sweep,
    sweep_cell,
    sweep_verdicts,
)
from attnaudit.analyses.kappa.discovery import find_attention_layers
from attnaudit.analyses.kappa.layers import LayerKappaConfig
from attnaudit.analyses.request import (
    ANALYSIS,
    PROTOCOL,
    DeviceField,
    FieldError,
    PrecisionField,
    Request,
    SeedCount,
    SeedField,
    field_check,
    list_of,
    option,
    redefault,
)
from attnaudit.analyses.result import Progress, Result, progress_or_silent
from attnaudit.analyses.sources import DataFields, ModelFields
from attnaudit.core.precision import closed_forms
from attnaudit.errors import AuditError, check_seed
from attnaudit.models.checkpoints import fit_to_data
from attnaudit.report.envelope import build_report
from attnaudit.runtime.device import resolve_device

#: the batch of the per-layer analysis when ``n`` is not given (all rows when the data have fewer)
LAYER_BATCH = 256


def _n_values(value, name: str) -> tuple:
    return list_of(int)(value, name)


@dataclass(frozen=True)
class KappaRequest(ModelFields, DataFields, SeedField, DeviceField, PrecisionField, SeedCount, Request):
    """What ``attnaudit kappa`` computes; every field is one option (see :class:`Option`).

    :meth:`resolve` gives the one configuration the run uses: a :class:`KappaConfig` for the
    data alone, a :class:`LayerKappaConfig` with a model.
    """

    COMMAND = "kappa"

    n: tuple[int, ...] | None = option(
        None,
        "--n",
        panel=PROTOCOL,
        parse=_n_values,
        help="Subset size, or a list (64,128,256) for a sweep; default: all rows (with a model: the batch, default 256).",
    )
    seeds: int = redefault(SeedCount, "seeds", 1, help="Number of random subsets per n (seeds seed, seed+1, ...).")
    stratify: bool = option(False, "--stratify", panel=PROTOCOL, help="Draw subsets stratified by class.")
    rank_tol: float | None = option(
        None,
        "--rank-tol",
        panel=ANALYSIS,
        kind=float,
        help="Relative rank tolerance (default max(n,d)*eps, numpy's matrix_rank rule).",
    )
    direct_check: bool = option(
        True,
        "--direct-check",
        panel=ANALYSIS,
        negative="--no-direct-check",
        help="Measure kappa(G~) from f_att(X) directly.",
    )
    layers: tuple[str, ...] | None = option(
        None,
        "--layers",
        panel=ANALYSIS,
        parse=list_of(str),
        help="With a model: analyse these modules (names or glob patterns, comma-separated, e.g. 'blocks.*.attn'); "
        "default: every attention layer found.",
    )
    gram: str | None = option(
        None,
        "--gram",
        panel=ANALYSIS,
        help="With a model: tokens (per-layer token Grams, default) or entk (also the empirical-NTK Gram of the "
        "whole model on the batch).",
    )

    def validate(self) -> None:
        self.check_precision_field()
        if self.model_given:
            if self.seeds != 1:
                raise FieldError(
                    "seeds", "{name} sweeps subsets of the data alone; with a model the batch is one draw (--n, --seed)"
                )
            if self.n is not None and len(self.n) != 1:
                raise FieldError("n", "with a model {name} is one batch size (e.g. {name} 256), not a list")
            field_check("seed", check_seed, self.seed)
            self.layer_config()  # n, layers, gram and rank_tol are checked by the configuration
            return
        if self.layers is not None or self.gram is not None:
            raise FieldError(
                "layers" if self.layers is not None else "gram",
                "{name} analyses a model's layers; give the model as a checkpoint or a factory",
            )
        if self.seeds < 1:
            raise FieldError("seeds", "{name} must be >= 1, got " + str(self.seeds))
        ns = self.n or (None,)
        if any(v is not None and v < 1 for v in ns):
            raise FieldError("n", "{name} values must be positive integers")
        if len(set(ns)) != len(ns):
            raise FieldError("n", "a value is listed twice in {name}; list each subset size once")
        field_check("seed", check_seed, self.seed, count=self.seeds)
        KappaConfig(rank_tol=self.rank_tol, direct_check=self.direct_check)  # checks rank_tol

    def layer_config(self, device: str | None = None) -> LayerKappaConfig:
        """The per-layer configuration of this request (a model given), on ``device``."""
        return LayerKappaConfig(
            n=self.n[0] if self.n is not None else LAYER_BATCH,
            layers=self.layers,
            gram=(self.gram or "tokens").strip().lower(),
            rank_tol=self.rank_tol,
            seed=self.seed,
            device=device,
            precision=self.precision,
        )

    def resolve(self) -> KappaConfig | LayerKappaConfig:
        """The configuration the run uses: with a model, the :class:`LayerKappaConfig` on the resolved
        device; for the data alone, the :class:`KappaConfig` (``n``, ``seeds`` and ``stratify``
        say which subsets it analyses)."""
        if self.model_given:
            return self.layer_config(str(resolve_device(self.device)))
        return KappaConfig(rank_tol=self.rank_tol, direct_check=self.direct_check)


def run(request: KappaRequest, *, progress: Progress | None = None, executor=None) -> Result:
    """Run ``request``; the report is the one ``attnaudit kappa --json`` writes."""
    config = request.resolve()
    if isinstance(config, LayerKappaConfig):
        return _run_layers(request, config, progress_or_silent(progress))
    return _run_data(request, config, progress_or_silent(progress))


def _run_data(request: KappaRequest, config: KappaConfig, progress: Progress) -> Result:
    """Conditioning of the data alone: the detail of the largest subset, and the sweep over ``n`` and seeds."""
    ns = list(request.n) if request.n is not None else [None]
    dev = resolve_device(request.device)
    if request.loaded_data is None:
        request.data_spec(request.seed, n=ns[0], stratify=request.stratify)  # options checked before any work

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    sweeping = len(ns) > 1 or request.seeds > 1
    seed_list = [request.seed + i for i in range(request.seeds)]
    cells = []
    detail_n = max(ns, key=lambda v: -1 if v is None else v)
    detail_ds = None
    load_s = 0.0
    with progress("kappa", len(ns) * len(seed_list), "subsets") as advance:
        for n_i in ns:
            for s in seed_list:
                tl = time.perf_counter()
                ds = request.load_data(s, n=n_i, stratify=request.stratify)
                load_s += time.perf_counter() - tl
                if n_i == detail_n and s == request.seed:
                    detail_ds = ds
                if sweeping:
                    cells.append(sweep_cell(ds.X.to(dev), s, config))
                advance(1)
    assert detail_ds is not None
    timings["load"] = load_s
    t1 = time.perf_counter()
    result = analyse_kappa(detail_ds.X.to(dev), config)
    timings["analysis"] = time.perf_counter() - t1
    summary = summarise_sweep(cells) if sweeping else None
    if summary:
        result.verdicts.extend(sweep_verdicts(summary))
    timings["total"] = time.perf_counter() - t0

    results = {"dataset": detail_ds.info, **result.to_dict()}
    results |= closed_forms(
        request.precision,
        "the data's Grams and the linearized-attention kernels",
        "a model's eNTK Jacobians: --gram entk",
    )
    if sweeping:
        results["sweep"] = {"cells": [c.to_dict() for c in cells], "summary": [s.to_dict() for s in summary or []]}
    report = build_report(
        SCHEMA,
        inputs={
            **request.data_inputs(),
            "n": ns,
            "seeds": request.seeds,
            "stratify": request.stratify,
            "rank_tol": request.rank_tol,
            "direct_check": request.direct_check,
        },
        seeds={"base_seed": request.seed, "subset_seeds": seed_list},
        device=dev,
        dtype="float64",
        timings=timings,
        results=results,
        verdicts=result.verdicts,
        request=request,
    )
    title = f"{detail_ds.name} (n={result.base.n}, d={result.base.d})"
    return Result(
        report,
        request,
        renderables=build_tables(result, summary, detail_ds.name),
        plot=lambda p: plot_kappa(result, summary, p, title),
        png_name="kappa.png",
    )


def _run_layers(request: KappaRequest, config: LayerKappaConfig, progress: Progress) -> Result:
    """Per-layer conditioning of saved models on a batch of the data."""
    from attnaudit.analyses.kappa.layer_report import PNG_NAME, build_tables, plot_layer_kappa
    from attnaudit.analyses.kappa.layers import SCHEMA, analyse_layers

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    models = request.load_models()  # every file checked before any data are read
    for lm in models.values():  # a --layers typo fails before the data are read
        find_attention_layers(lm.module, config.layers)
    try:
        ds = request.load_data(request.seed, n=config.n, stratify=request.stratify)
    except AuditError as exc:
        if request.n is not None or "rows available" not in str(exc):
            raise
        ds = request.load_data(request.seed, n=None, stratify=request.stratify)  # fewer rows than 256: take all
        config = dataclasses.replace(config, n=ds.n)
    fitted = {label: fit_to_data(lm, ds) for label, lm in models.items()}
    timings["load"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    results = []
    with progress("kappa", len(fitted), "models") as advance:
        for label, lm in fitted.items():
            results.append(analyse_layers(lm, ds.X, config, label=label))
            advance(1)
    timings["analysis"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0

    report = build_report(
        SCHEMA,
        inputs={
            **request.data_inputs(),
            "models": request.model_sources(),
            "n": config.n,
            "stratify": request.stratify,
            "layers": list(request.layers) if request.layers else None,
            "gram": config.gram,
            "rank_tol": request.rank_tol,
        },
        seeds={"base_seed": request.seed, "subset_seeds": [request.seed]},
        device=config.device,
        dtype="float64 (token Grams, spectra); eNTK Jacobians: see each model's entk.precision",
        timings=timings,
        results={
            "dataset": ds.info,
            "models": {r.label: {"source": fitted[r.label].source, **r.to_dict()} for r in results},
            "precision": {
                "asked": request.precision,
                "token_grams": "float64 always: the layers' activations are captured from a float64 copy, since "
                "their condition numbers reach beyond what float32 resolves (about 1e7)",
                "entk": "--precision (see each model's entk.precision)" if config.gram == "entk" else None,
            },
        },
        warnings=[
            f"{r.label}: {r.entk.precision_check['warning']}"
            for r in results
            if r.entk is not None and r.entk.precision_check and r.entk.precision_check.get("warning")
        ],
        verdicts=[v for r in results for v in r.verdicts],
        request=request,
    )
    title = f"{ds.name}, {ds.n} samples: " + ", ".join(r.label for r in results)
    return Result(
        report,
        request,
        renderables=build_tables(results),
        plot=lambda p: plot_layer_kappa(results, p, title),
        png_name=PNG_NAME,
    )
