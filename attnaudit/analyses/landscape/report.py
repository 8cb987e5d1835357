"""Presentation of landscape results: the table and the figure (no new maths)."""

from __future__ import annotations

import math
from pathlib import Path

from attnaudit.analyses.landscape.analysis import LandscapeResult
from attnaudit.analyses.landscape.compare import seed_record, seed_summary
from attnaudit.analyses.landscape.setup import LOSS_DESCRIPTIONS

SCHEMA = "attnaudit.landscape/1"
PNG_NAME = "landscape.png"


def _percent(x: float | None, sd: float | None = None) -> str:
    """An accuracy in percent (with its sd), or n/a where there is none (a language model)."""
    if x is None:
        return "n/a"
    return f"{100 * x:.1f}%" + ("" if sd is None else f" +- {100 * sd:.1f}%")


def _g(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


def build_tables(results: dict[str, LandscapeResult], training: dict[str, dict], lr: float | None, run=None) -> list:
    """One rich table, a column per model (the first seed's analysis); with ``run`` (a
    :class:`~attnaudit.analyses.landscape.run.LandscapeRun`) also the untrained flags and, for several
    seeds, the mean +- sd over seeds. A language model's accuracy reads n/a (it has no class
    labels), and the untrained flags, which read accuracy against chance, are left out."""
    from rich.table import Table

    labels = list(results)
    first = results[labels[0]]
    t = Table(title=f"loss landscape at the trained minimum (n={first.n_samples}, {first.n_params} parameters)")
    t.add_column("quantity")
    for label in labels:
        t.add_column(label, justify="right")

    def row(name: str, fn) -> None:
        t.add_row(name, *[fn(results[k], training.get(k, {})) for k in labels])

    row("training steps run", lambda r, tr: str(tr.get("steps_run", "-")))
    row("loss", lambda r, tr: LOSS_DESCRIPTIONS.get(r.loss_function, r.loss_function or "-"))
    row("training loss", lambda r, tr: _g(r.loss))
    row("training accuracy", lambda r, tr: _percent(r.accuracy))
    k = len(first.eigen.eigenvalues)
    for i in range(k):
        row(f"lambda_{i + 1}", lambda r, tr, i=i: _g(r.eigen.eigenvalues[i]) if i < len(r.eigen.eigenvalues) else "-")
    row("Lanczos steps / converged", lambda r, tr: f"{r.eigen.steps} / {'yes' if r.eigen.converged else 'NO'}")
    row("max eigen residual (rel.)", lambda r, tr: f"{max(r.eigen.residuals):.1e}")
    row("trace(H) +- SE (Hutchinson)", lambda r, tr: f"{_g(r.trace.estimate)} +- {_g(r.trace.stderr, 2)}")
    row("top-1 share of trace", lambda r, tr: _g(r.top_share[0], 3))
    row(f"top-{len(first.top_share)} share of trace", lambda r, tr: _g(r.top_share[-1], 3))
    row("trace / lambda_1", lambda r, tr: _g(r.trace_over_top, 3))
    row(
        f"basin width (alpha at {first.basin.factor:g}x loss)",
        lambda r, tr: (
            f"{_g(r.basin.width, 3)} +- {_g(r.basin.stderr, 2)}"
            + (f" ({r.basin.censored} cens.)" if r.basin.censored else "")
        ),
    )
    if lr is not None:
        t.add_row("GD stability bound 2/lr", *[_g(2.0 / lr) if k in training else "-" for k in labels])
    if run is not None and any(st.get("untrained") is not None for st in run.status.values()):

        def flag(k: str) -> str:
            st = run.status.get(k) or {}
            if st.get("untrained") is None:
                return "-"
            return (
                f"UNTRAINED (< {100 * st['threshold']:.1f}%)"
                if st["untrained"]
                else f"no (chance {100 * st['chance']:.0f}%)"
            )

        t.add_row("at chance (untrained)?", *[flag(k) for k in labels])
    tables = [t]
    if run is not None and len(run.seeds) > 1 and run.seed_results:
        st = Table(title=f"over {len(run.seeds)} seeds ({', '.join(str(s) for s in run.seeds)}): mean +- sd")
        st.add_column("quantity")
        for label in labels:
            st.add_column(label, justify="right")
        summaries = {
            k: seed_summary([seed_record(s, r) for s, r in zip(run.seeds, run.seed_results.get(k, []))]) for k in labels
        }
        for key, name in (
            ("loss", "training loss"),
            ("accuracy", "training accuracy"),
            ("lambda_max", "lambda_max"),
            ("trace", "trace(H)"),
            ("basin_width", "basin width"),
        ):
            if key == "accuracy":
                st.add_row(name, *[_percent(summaries[k]["mean"][key], summaries[k]["sd"][key]) for k in labels])
            else:
                st.add_row(
                    name, *[f"{_g(summaries[k]['mean'][key])} +- {_g(summaries[k]['sd'][key], 2)}" for k in labels]
                )
        tables.append(st)
    return tables


def plot_landscape(results: dict[str, LandscapeResult], path: str | Path, title: str = "") -> None:
    """1-D curves of all models overlaid (with each basin threshold), and a 2-D contour per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    labels = list(results)
    surfaces_2d = {k: s2 for k in labels if (s2 := results[k].surface_2d) is not None}
    with_2d = list(surfaces_2d)
    ncols = 1 + len(with_2d)
    fig, axes = plt.subplots(1, ncols, figsize=(4.8 * ncols, 4.4), squeeze=False, layout="constrained")
    ax = axes[0, 0]
    all_vals: list[float] = []
    for i, k in enumerate(labels):
        s = results[k].surface_1d
        color = f"C{i}"
        if s is not None:
            ax.plot(s.alphas, s.loss, color=color, label=f"{k} (L0={results[k].loss:.3g})")
            all_vals.extend(v for v in s.loss if math.isfinite(v))
        ax.axhline(results[k].basin.threshold, color=color, ls=":", lw=0.8)
    if all_vals and min(all_vals) > 0 and max(all_vals) / min(all_vals) > 100:
        ax.set_yscale("log")
    kind = results[labels[0]].directions.get("kind", "random")
    ax.set_xlabel("alpha (filter-normalized)" if kind == "random" else "alpha (top Hessian eigenvector, x ||theta||)")
    ax.set_ylabel("training loss")
    ax.set_title("1-D slice (dotted: basin threshold)")
    if ax.get_legend_handles_labels()[0]:  # no 1-D slice was computed: nothing to label
        ax.legend(fontsize=8)
    # one colour scale for every contour, so the panels compare directly
    grids = {k: np.asarray(surfaces_2d[k].loss, dtype=float) for k in with_2d}
    if grids:
        finite = np.concatenate([g[np.isfinite(g)].ravel() for g in grids.values()])
        lo, hi = float(finite.min()), float(finite.max())
        use_log = lo > 0 and hi / lo > 10
        # log10 of the loss when it spans decades: plain levels, readable colour-bar ticks
        tf = np.log10 if use_log else (lambda v: v)
        levels = np.linspace(tf(lo), tf(hi), 25)
        cs = None
        for j, k in enumerate(with_2d, start=1):
            s2 = surfaces_2d[k]
            axk = axes[0, j]
            A, B = np.meshgrid(s2.alphas, s2.betas, indexing="ij")
            cs = axk.contourf(A, B, tf(np.clip(grids[k], lo, hi)), levels=levels, cmap="viridis")
            thr = results[k].basin.threshold
            if lo < thr < hi:
                axk.contour(A, B, tf(grids[k]), levels=[tf(thr)], colors="w", linewidths=1.0, linestyles="solid")
            axk.plot([0], [0], "r+", ms=8)
            axk.set_title(f"{k}: loss (white: basin threshold)", fontsize=10)
            axk.set_xlabel("alpha (direction 1)")
            axk.set_ylabel("beta (direction 2)")
            axk.set_aspect("equal")
        if cs is not None:
            cb = fig.colorbar(
                cs, ax=axes[0, 1:].tolist(), shrink=0.85, label="log10 training loss" if use_log else "training loss"
            )
            cb.locator = matplotlib.ticker.MaxNLocator(7)
            cb.formatter = matplotlib.ticker.FormatStrFormatter("%.3g")
            cb.update_ticks()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
