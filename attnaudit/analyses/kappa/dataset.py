"""`attnaudit kappa`: data conditioning and what linearized attention does to it.

For data X (n x d), G = X X^T and linearized attention f_att(X) = G X with Gram G~ = G^3:

* the spectrum of G (float64, from the smaller of X X^T and X^T X, chunked when n > d);
* numerical rank r, kappa_d(G) = lambda_1 / lambda_min(n,d) (infinite when r < min(n, d)) and
  kappa_r(G) = lambda_1 / lambda_r;
* kappa(G~) measured directly from f_att(X) against kappa(G)^3, with a verdict;
* the paper's width requirement of linearized attention, m ~ kappa_d(G)^6 n ln n
  (= kappa_d(G~)^2 n ln n; constant omitted), at kappa_d and at the numerical rank, each with
  a float64 round-off interval, against the paper's reference width of 1e12;
* optionally a sweep of kappa over subset sizes and seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from attnaudit.analyses.request import FieldError, literal
from attnaudit.errors import AuditError
from attnaudit.core.spectral import (
    PAPER_LABEL,
    PAPER_RANK_LABEL,
    REFERENCE_WIDTH_LOG10,
    AmplificationCheck,
    ConditionReport,
    WidthEstimate,
    amplification_check,
    amplification_resolvable,
    attention_gram_eigenvalues,
    attention_gram_top_eigenvalue,
    condition_report,
    gram_eigenvalues,
    gram_matrix,
    log10_width_scale,
    reference_width,
    width_rows,
)

SCHEMA = "attnaudit.kappa/1"


@dataclass(frozen=True)
class KappaConfig:
    """Options of the kappa analysis. ``rank_tol`` is relative to lambda_max (None: max(n,d) eps)."""

    rank_tol: float | None = None
    direct_check: bool = True
    chunk_rows: int = 8192

    def __post_init__(self) -> None:
        if self.rank_tol is not None and not (0 < self.rank_tol < 1):
            raise FieldError(
                "rank_tol",
                "{name} must lie in (0, 1) (relative to the largest eigenvalue), got " + literal(self.rank_tol),
            )
        if self.chunk_rows < 1:
            raise FieldError("chunk_rows", "{name} must be a positive number of rows")


@dataclass
class KappaResult:
    """Conditioning of G, of G~ = G^3, the direct amplification check and width estimates."""

    base: ConditionReport
    transformed: ConditionReport  # from the exact identity lambda(G~) = lambda(G)^3
    transformed_measured: np.ndarray | None  # direct spectrum of f_att(X) f_att(X)^T
    check: AmplificationCheck | None
    widths: list[WidthEstimate]
    verdicts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "gram": self.base.to_dict(),
            "attention_gram_from_identity": self.transformed.to_dict(include_spectrum=False),
            "attention_gram_measured_eigenvalues": None
            if self.transformed_measured is None
            else self.transformed_measured.tolist(),
            "amplification_check": None if self.check is None else self.check.to_dict(),
            "reference_width": reference_width(),
            "width_estimates": [w.to_dict() for w in self.widths],
        }


def analyse_kappa(X: torch.Tensor, config: KappaConfig = KappaConfig()) -> KappaResult:
    """Full kappa analysis of one data matrix X (n x d); see the module docstring."""
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise AuditError(f"data must be a non-empty n x d matrix, got shape {tuple(X.shape)}")
    n, d = X.shape
    gram = gram_matrix(X, config.chunk_rows)  # computed once: the spectrum and the direct check share it
    lam = gram_eigenvalues(X, config.chunk_rows, gram=gram)
    base = condition_report(lam, n, d, config.rank_tol)
    # lambda_i(G~) = lambda_i(G)^3 exactly; round-off (and negative noise) are cubed too, so
    # the rank of G~ is re-detected at its own tolerance instead of assumed equal to r.
    cubed = np.sign(base.eigenvalues) * np.abs(base.eigenvalues) ** 3
    transformed = condition_report(cubed, n, d, config.rank_tol)
    measured = None
    check = None
    if config.direct_check:
        if amplification_resolvable(base):
            measured_t = attention_gram_eigenvalues(X, config.chunk_rows, gram=gram)
            measured = measured_t.cpu().numpy()
            check = amplification_check(base, measured_t)
        else:
            # below lambda_1(G~) * max(n,d) eps a measured spectrum is round-off: only its top is
            # measured (Lanczos), the full eigendecomposition of G~ is skipped
            check = amplification_check(base, attention_gram_top_eigenvalue(X, config.chunk_rows, gram=gram))
    del gram

    widths = width_rows(base)
    verdicts = []
    if base.rank_deficient:
        verdicts.append(
            f"rank deficient: numerical rank {base.numerical_rank} < min(n, d) = {base.k}; kappa_d(G) is infinite "
            f"(the {base.k}-th eigenvalue, {base.lambda_min_raw:.3g}, is round-off below the tolerance "
            f"{base.tolerance:.3g}); kappa at the numerical rank is {base.kappa_rank:.4g}"
        )
    else:
        verdicts.append(f"full rank {base.k}: kappa_d(G) = {base.kappa_full:.4g}")
    if check is not None:
        verdicts.append(f"amplification {check.verdict}: {check.explanation}")
    return KappaResult(base, transformed, measured, check, widths, verdicts)


#: The width scales a sweep reports per subset: (key, label, which kappa). Both are the paper's
#: linearized-attention requirement kappa^6 n ln n, at kappa_d and at the numerical rank.
WIDTH_SCALES = (
    ("kappa_d", PAPER_LABEL, "kappa_d"),
    ("numerical_rank", PAPER_RANK_LABEL, "kappa_rank"),
)


def _log10_width(kappa: float, n: int) -> float | None:
    """log10 of kappa^6 n ln n, None when kappa is infinite (the constant is omitted)."""
    return log10_width_scale(kappa, n)


@dataclass
class SweepCell:
    n: int
    seed: int
    numerical_rank: int
    min_n_d: int
    kappa_d: float
    kappa_rank: float

    def log10_widths(self) -> dict[str, float | None]:
        """log10 m (the paper's width requirement, constant omitted) of this subset, per :data:`WIDTH_SCALES` key."""
        return {key: _log10_width(getattr(self, which), self.n) for key, _, which in WIDTH_SCALES}

    def to_dict(self) -> dict:
        return {
            "n": self.n,
            "seed": self.seed,
            "numerical_rank": self.numerical_rank,
            "min_n_d": self.min_n_d,
            "kappa_d": None if math.isinf(self.kappa_d) else self.kappa_d,
            "kappa_d_is_infinite": math.isinf(self.kappa_d),
            "kappa_at_numerical_rank": self.kappa_rank,
            "log10_width": self.log10_widths(),
        }


@dataclass
class SweepSummary:
    """Spread of kappa over seeds at one n; kappa_d statistics only over full-rank seeds."""

    n: int
    seeds: int
    rank_deficient_seeds: int
    rank_mean: float
    kappa_d_mean: float | None
    kappa_d_std: float | None
    kappa_rank_mean: float
    kappa_rank_std: float
    log10_kappa_rank_mean: float
    log10_kappa_rank_std: float
    # log10 m per WIDTH_SCALES key over the seeds: {"median", "min", "max", "iqr", "std", "finite_seeds"}
    log10_width: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def sweep_cell(X: torch.Tensor, seed: int, config: KappaConfig) -> SweepCell:
    """kappa of one subset (spectrum only; the direct G~ check is skipped in sweeps)."""
    lam = gram_eigenvalues(X, config.chunk_rows)
    rep = condition_report(lam, X.shape[0], X.shape[1], config.rank_tol)
    return SweepCell(X.shape[0], seed, rep.numerical_rank, rep.k, rep.kappa_full, rep.kappa_rank)


def summarise_sweep(cells: Iterable[SweepCell]) -> list[SweepSummary]:
    """Mean and standard deviation (ddof=1 when >1 seed) of kappa per subset size."""
    by_n: dict[int, list[SweepCell]] = {}
    for cell in cells:
        by_n.setdefault(cell.n, []).append(cell)
    out = []
    for n in sorted(by_n):
        group = by_n[n]
        ddof = 1 if len(group) > 1 else 0
        finite = np.array([c.kappa_d for c in group if math.isfinite(c.kappa_d)])
        kr = np.array([c.kappa_rank for c in group])
        out.append(
            SweepSummary(
                n=n,
                seeds=len(group),
                rank_deficient_seeds=sum(1 for c in group if math.isinf(c.kappa_d)),
                rank_mean=float(np.mean([c.numerical_rank for c in group])),
                kappa_d_mean=float(finite.mean()) if finite.size == len(group) else None,
                kappa_d_std=float(finite.std(ddof=ddof)) if finite.size == len(group) else None,
                kappa_rank_mean=float(kr.mean()),
                kappa_rank_std=float(kr.std(ddof=ddof)),
                log10_kappa_rank_mean=float(np.log10(kr).mean()),
                log10_kappa_rank_std=float(np.log10(kr).std(ddof=ddof)),
                log10_width=_width_spread(group),
            )
        )
    return out


def _width_spread(group: list[SweepCell]) -> dict:
    """Median and spread over seeds of log10 m per width scale (only seeds where it is finite)."""
    out: dict[str, dict[str, Any]] = {}
    per_cell = [c.log10_widths() for c in group]
    for key, label, _ in WIDTH_SCALES:
        vals = np.array([w[key] for w in per_cell if w[key] is not None], dtype=float)
        if vals.size == 0:
            out[key] = {
                "label": label,
                "median": None,
                "min": None,
                "max": None,
                "iqr": None,
                "std": None,
                "finite_seeds": 0,
                "seeds": len(group),
                "orders_beyond_reference_median": None,
            }
            continue
        q1, q3 = np.percentile(vals, [25, 75])
        out[key] = {
            "label": label,
            "median": float(np.median(vals)),
            "min": float(vals.min()),
            "max": float(vals.max()),
            "iqr": float(q3 - q1),
            "std": float(vals.std(ddof=1)) if vals.size > 1 else 0.0,
            "finite_seeds": int(vals.size),
            "seeds": len(group),
            "orders_beyond_reference_median": float(np.median(vals)) - REFERENCE_WIDTH_LOG10,
        }
    return out


def _sweep_scale(s: SweepSummary) -> tuple[dict, str]:
    """The width scale of one n: at kappa_d when every seed is full rank, else at the numerical rank."""
    w = (s.log10_width or {}).get("kappa_d") or {}
    if w.get("median") is not None and w.get("finite_seeds") == w.get("seeds"):
        return w, "kappa_d"
    return (s.log10_width or {}).get("numerical_rank") or {}, "numerical rank"


def sweep_verdicts(summary: list[SweepSummary]) -> list[str]:
    """One line per n: the paper's width requirement log10 m as median [min, max] over its seeds."""
    out = []
    for s in summary:
        w, basis = _sweep_scale(s)
        if w.get("median") is None:
            part = "undefined"
        else:
            part = (
                f"{w['median']:.1f} [{w['min']:.1f}, {w['max']:.1f}] at {basis}, "
                f"{w['median'] - REFERENCE_WIDTH_LOG10:.1f} orders beyond 1e{REFERENCE_WIDTH_LOG10:.0f}"
            )
            if basis == "numerical rank":
                part += " (rank deficient seeds: kappa_d infinite, this understates the requirement)"
        out.append(
            f"width requirement of linearized attention (paper, kappa^6 n ln n) at n={s.n}, "
            f"log10 m median [min, max] over {s.seeds} seed(s): {part}"
        )
    return out


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}g}"


def _main_tables(result: KappaResult, ds_name: str) -> list:
    from rich.table import Table

    base = result.base
    t = Table(title=f"kappa: {ds_name}  (n={base.n}, d={base.d}, float64)")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("numerical rank / min(n, d)", f"{base.numerical_rank} / {base.k}")
    t.add_row("rank tolerance (abs, rel)", f"{base.tolerance:.3g}, {base.rel_tolerance:.3g}")
    t.add_row("lambda_max(G)", _fmt(base.lambda_max))
    t.add_row(f"lambda_{base.k}(G) as computed", _fmt(base.lambda_min_raw))
    t.add_row("kappa_d(G) at min(n, d)", "inf (rank deficient)" if base.rank_deficient else _fmt(base.kappa_full))
    t.add_row(f"kappa(G) at numerical rank {base.numerical_rank}", _fmt(base.kappa_rank))
    t.add_row("kappa(G~) = kappa(G)^3 at rank r", _fmt(base.kappa_rank**3))
    if result.check is not None:
        c = result.check
        t.add_row(
            "kappa(G~) measured directly", _fmt(c.measured_kappa) if c.measured_kappa is not None else "not resolvable"
        )
        t.add_row("amplification check", c.verdict)
    ref = f"1e{REFERENCE_WIDTH_LOG10:.0f}"
    w = Table(
        title=f"width requirement of linearized attention (paper): m ~ kappa_d(G)^6 n ln n = kappa(G~)^2 n ln n "
        f"(constant omitted; reference {ref}, about the largest trained models)"
    )
    w.add_column("estimate")
    w.add_column("index", justify="right")
    w.add_column("log10 m", justify="right")
    w.add_column("round-off interval", justify="right")  # of log10 m, from eigenvalues -+ max(n,d) eps lambda_1
    w.add_column(f"orders beyond {ref}", justify="right")
    for est in result.widths:
        m = est.log10_width
        lo, hi = est.interval if est.interval is not None else (None, None)
        if lo is None:
            iv = "-"
        elif m is None:
            iv = f">= {lo:.5g}"
        else:
            iv = f"-{m - lo:.2g} / +{'inf' if hi is None else f'{hi - m:.2g}'}"
        w.add_row(
            est.label,
            str(est.rank),
            _fmt(est.log10_width, 5) if est.log10_width is not None else "inf",
            iv,
            _fmt(est.gap_orders, 4) if est.gap_orders is not None else "inf",
        )
    out: list[Table | str] = [t, w]
    out.extend(f"- width row at {est.basis}: {est.caveat}" for est in result.widths if est.caveat)
    return out


def _sweep_table(summary: list[SweepSummary]):
    from rich.table import Table

    t = Table(title="kappa vs n (mean +- std over seeds); log10 m: median [min, max] over seeds")
    for col in (
        "n",
        "seeds",
        "rank-deficient",
        "mean rank",
        "kappa_d(G)",
        "kappa at numerical rank",
        "log10 kappa_r",
        "log10 m (paper, kappa^6 n ln n)",
        f"orders beyond 1e{REFERENCE_WIDTH_LOG10:.0f}",
    ):
        t.add_column(col, justify="right")

    def med(s: SweepSummary, key: str) -> str:
        w = (s.log10_width or {}).get(key) or {}
        if w.get("median") is None:
            return "inf"
        part = f" ({w['finite_seeds']}/{w['seeds']} finite)" if w["finite_seeds"] < w["seeds"] else ""
        return f"{w['median']:.1f} [{w['min']:.1f}, {w['max']:.1f}]{part}"

    def scale(s: SweepSummary) -> str:
        # kappa_d when every seed is full rank, else at the numerical rank (said so)
        _, basis = _sweep_scale(s)
        return med(s, "kappa_d") if basis == "kappa_d" else med(s, "numerical_rank") + " @rank"

    def beyond(s: SweepSummary) -> str:
        w, _ = _sweep_scale(s)
        return "inf" if w.get("median") is None else f"{w['median'] - REFERENCE_WIDTH_LOG10:.1f}"

    for s in summary:
        kd = "inf" if s.kappa_d_mean is None else f"{s.kappa_d_mean:.4g} +- {s.kappa_d_std:.2g}"
        t.add_row(
            str(s.n),
            str(s.seeds),
            f"{s.rank_deficient_seeds}/{s.seeds}",
            f"{s.rank_mean:.1f}",
            kd,
            f"{s.kappa_rank_mean:.4g} +- {s.kappa_rank_std:.2g}",
            f"{s.log10_kappa_rank_mean:.3f} +- {s.log10_kappa_rank_std:.2f}",
            scale(s),
            beyond(s),
        )
    return t


def build_tables(result: KappaResult, sweep: list[SweepSummary] | None, ds_name: str) -> list:
    """The rich tables and verdict lines printed for one kappa run (the CLI prints them as they are)."""
    tables = _main_tables(result, ds_name)
    if sweep:
        tables.append(_sweep_table(sweep))
    tables.extend(f"- {v}" for v in result.verdicts)
    return tables


def plot_kappa(result: KappaResult, sweep: list[SweepSummary] | None, path: Path, title: str = "") -> None:
    """Eigenvalue spectra of G and G~ (log scale) and, when swept, kappa against n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if sweep else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 4.2), squeeze=False)
    ax = axes[0, 0]
    base = result.base
    lam = base.eigenvalues
    r = base.numerical_rank
    idx = np.arange(1, lam.size + 1)
    # Only eigenvalues above each matrix's rank tolerance are data; the rest is round-off and
    # would stretch the axis over hundreds of meaningless decades.
    ax.semilogy(idx[:r], lam[:r], label="G = X X^T", color="tab:blue")
    ax.semilogy(idx[:r], lam[:r] ** 3, label="G~ = G^3 (identity)", color="tab:red", linestyle="--")
    tol_t = base.rel_tolerance * lam[0] ** 3
    if result.transformed_measured is not None:
        meas = result.transformed_measured
        keep = meas > tol_t
        ax.semilogy(
            idx[keep],
            meas[keep],
            label="G~ measured directly (above its tolerance)",
            color="tab:red",
            alpha=0.4,
            linewidth=4,
        )
    ax.axhline(base.tolerance, color="tab:blue", linestyle=":", linewidth=1, label="rank tolerance of G")
    ax.axhline(tol_t, color="tab:red", linestyle=":", linewidth=1, label="rank tolerance of G~")
    if r < lam.size:
        ax.axvline(r, color="grey", linestyle=":", linewidth=1, label=f"numerical rank {r} of {lam.size}")
    ax.set_xlabel("eigenvalue index")
    ax.set_ylabel("eigenvalue")
    ax.set_title("Gram spectra (round-off omitted)")
    ax.legend(fontsize=8)
    if sweep:
        ax2 = axes[0, 1]
        ns = np.array([s.n for s in sweep])
        # kappa spans decades, so the spread is shown geometrically: 10^(mean log10 +- std log10)
        centre = np.array([10**s.log10_kappa_rank_mean for s in sweep])
        lo = centre - np.array([10 ** (s.log10_kappa_rank_mean - s.log10_kappa_rank_std) for s in sweep])
        hi = np.array([10 ** (s.log10_kappa_rank_mean + s.log10_kappa_rank_std) for s in sweep]) - centre
        ax2.errorbar(ns, centre, yerr=[lo, hi], marker="o", capsize=3, label="kappa at numerical rank")
        deficient = [s for s in sweep if s.rank_deficient_seeds]
        if deficient:
            ax2.scatter(
                [s.n for s in deficient],
                [10**s.log10_kappa_rank_mean for s in deficient],
                marker="x",
                s=80,
                color="black",
                zorder=3,
                label="rank deficient (kappa_d infinite)",
            )
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.set_xlabel("n (subset size)")
        ax2.set_ylabel("condition number of G")
        ax2.set_title("kappa vs n (geometric mean, x/ std over seeds)")
        ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
