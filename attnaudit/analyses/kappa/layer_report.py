"""Tables and figure of the per-layer kappa (`attnaudit kappa --checkpoint`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from attnaudit.analyses.kappa.layers import LayerKappaResult
from attnaudit.analyses.kappa.spread import Spread, spread_text

PNG_NAME = "kappa_layers.png"


def build_tables(result: LayerKappaResult | Sequence[LayerKappaResult]) -> list:
    """Rich tables (per layer; attention heads; eNTK) and verdict lines for one or more models."""
    from rich.console import JustifyMethod
    from rich.table import Table
    from rich.text import Text

    results = [result] if isinstance(result, LayerKappaResult) else list(result)
    out: list = []
    for res in results:
        t = Table(
            title=Text(
                f"per-layer kappa: {res.label} on {res.samples} samples "
                "(log10 kappa of token Grams, median [p10, p90] over samples; float64)"
            )
        )
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("layer", "left"),
            ("N x D", "right"),
            ("input", "right"),
            ("output", "right"),
            ("predicted 3*in", "right"),
            ("exponent", "right"),
            ("rank-def. in/out", "right"),
            ("attention A", "right"),
            ("log10 m (in)", "right"),
        )
        for col, just in columns:
            t.add_column(col, justify=just)
        for layer in res.layers:
            amp = layer.amplification
            w = layer.widths[0]
            t.add_row(
                Text(layer.name),
                f"{layer.tokens} x {layer.features_in}",
                spread_text(layer.input.spread()),
                spread_text(layer.output.spread()),
                spread_text(Spread.of(amp.predicted_log10_out)),
                spread_text(Spread.of(amp.exponent)),
                f"{layer.input.rank_deficient}/{layer.output.rank_deficient} of {layer.input.samples}",
                spread_text(layer.attention_all_heads) if layer.heads else "n/a",
                "inf" if w.log10_width is None else f"{w.log10_width:.1f}",
            )
        out.append(t)
        with_heads = [layer for layer in res.layers if layer.heads]
        if with_heads:
            h = Table(title=Text(f"attention matrices: {res.label} (log10 s_max/s_min per head, median [p10, p90])"))
            for col in ("layer", "head", "log10 kappa", "at numerical rank", "singular maps", "rank (min/median)"):
                h.add_column(col, justify="left" if col == "layer" else "right")
            for layer in with_heads:
                for i, head in enumerate(layer.heads or []):  # not empty: with_heads
                    h.add_row(
                        Text(layer.name),
                        str(i),
                        spread_text(head.spread()),
                        spread_text(head.spread_rank()),
                        f"{head.rank_deficient}/{head.samples}",
                        f"{int(head.rank.min())}/{float(np.median(head.rank)):g} of {head.k}",
                    )
            out.append(h)
        if res.entk is not None:
            r = res.entk.report
            e = Table(title=Text(f"empirical NTK Gram: {res.label}, K = (1/c) sum_a J_a J_a^T on {r.n} samples"))
            e.add_column("quantity")
            e.add_column("value", justify="right")
            e.add_row("parameters P, outputs c", f"{res.entk.n_params:,}, {res.entk.n_outputs}")
            e.add_row("numerical rank / n", f"{r.numerical_rank} / {r.k}")
            e.add_row("kappa_d", "inf (rank deficient)" if r.rank_deficient else f"{r.kappa_full:.4g}")
            e.add_row(f"kappa at numerical rank {r.numerical_rank}", f"{r.kappa_rank:.4g}")
            for w in res.entk.widths:
                e.add_row(f"log10 m, {w.label}", "inf" if w.log10_width is None else f"{w.log10_width:.2f}")
            e.add_row("seconds", f"{res.entk.seconds:.1f}")
            out.append(e)
        out.extend(f"- {v}" for v in res.verdicts)
    return out


def plot_layer_kappa(result: LayerKappaResult | Sequence[LayerKappaResult], path: str | Path, title: str = "") -> None:
    """Kappa by depth: median log10 kappa (bars: 10th-90th percentile) of the input and output
    token Grams, the linearized prediction 3 log10 kappa(in) and the attention matrices; right
    panel: the measured exponent against 3. Infinite medians are drawn as triangles at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [result] if isinstance(result, LayerKappaResult) else list(result)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.0, 4.6))
    markers = ("o", "s", "^", "D", "v", "P")
    finite_tops = [1.0]
    series = []
    for m_i, res in enumerate(results):
        depth = np.arange(len(res.layers))
        prefix = f"{res.label}: " if len(results) > 1 else ""
        marker = markers[m_i % len(markers)]
        rows = {
            "input Gram": ([layer.input.spread() for layer in res.layers], "tab:blue", "-"),
            "output Gram": ([layer.output.spread() for layer in res.layers], "tab:red", "-"),
            "predicted 3 log10 kappa(in)": (
                [Spread.of(layer.amplification.predicted_log10_out) for layer in res.layers],
                "tab:red",
                "--",
            ),
            "attention matrix (all heads)": (
                [layer.attention_all_heads or Spread.of([]) for layer in res.layers],
                "tab:green",
                ":",
            ),
        }
        for which, color in (("input", "tab:blue"), ("output", "tab:red")):
            spreads = rows[f"{which} Gram"][0]
            if any(math.isinf(sp.median) for sp in spreads):  # kappa_d infinite: show kappa at the numerical rank too
                rows[f"{which} Gram at numerical rank"] = (
                    [getattr(layer, which).spread_rank() for layer in res.layers],
                    color,
                    "-.",
                )
        for name, (spreads, color, style) in rows.items():
            series.append((depth, spreads, color, style, marker, prefix + name))
            finite_tops.extend(s.p90 for s in spreads if math.isfinite(s.p90))
            finite_tops.extend(s.median for s in spreads if math.isfinite(s.median))
        ex = [Spread.of(layer.amplification.exponent) for layer in res.layers]
        med = np.array([s.median for s in ex])
        ok = np.isfinite(med)
        if ok.any():
            lo = med - np.array([s.p10 for s in ex])
            hi = np.array([s.p90 for s in ex]) - med
            ax2.errorbar(
                depth[ok],
                med[ok],
                yerr=[np.where(np.isfinite(lo), lo, 0)[ok], np.where(np.isfinite(hi), hi, 0)[ok]],
                marker=marker,
                capsize=3,
                label=f"{prefix}measured",
                color="tab:purple",
            )
    top = max(finite_tops) * 1.1 + 0.5
    for k, (depth, spreads, color, style, marker, label) in enumerate(series):
        med = np.array([s.median for s in spreads])
        fin = np.isfinite(med)
        if fin.any():
            lo = np.array([s.median - s.p10 if math.isfinite(s.p10) else 0.0 for s in spreads])
            hi = np.array(
                [s.p90 - s.median if math.isfinite(s.p90) and math.isfinite(s.median) else 0.0 for s in spreads]
            )
            ax.errorbar(
                depth[fin],
                med[fin],
                yerr=[lo[fin], hi[fin]],
                color=color,
                linestyle=style,
                marker=marker,
                capsize=3,
                label=label,
            )
        inf = np.isposinf(med)
        if inf.any():
            shift = 0.04 * (k - (len(series) - 1) / 2)  # side by side, not on top of each other
            ax.scatter(
                depth[inf] + shift,
                np.full(inf.sum(), top),
                marker="^",
                s=80,
                color=color,
                zorder=3,
                label=f"{label}: infinite (rank deficient)",
            )
    names = results[0].layers
    for a in (ax, ax2):
        a.set_xlim(-0.5, max(len(r.layers) for r in results) - 0.5)
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels([layer.name for layer in names], rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("layer (forward order)")
    ax.set_ylabel("log10 kappa (median, 10-90 %)")
    ax.set_title("conditioning by depth")
    ax.legend(fontsize=7)
    ax2.axhline(3.0, color="black", linestyle="--", linewidth=1, label="linearized prediction 3")
    ax2.set_xticks(np.arange(len(names)))
    ax2.set_xticklabels([layer.name for layer in names], rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("log10 kappa(out) / log10 kappa(in)")
    ax2.set_title("measured amplification exponent")
    ax2.legend(fontsize=7)
    entk = [
        (f"{r.label}: " if len(results) > 1 else "")
        + "eNTK kappa_d "
        + ("inf (rank deficient)" if r.entk.report.rank_deficient else f"{r.entk.report.kappa_full:.3g}")
        for r in results
        if r.entk is not None
    ]
    full_title = " | ".join([t for t in [title, *entk] if t])
    if full_title:
        fig.suptitle(full_title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
