"""Presentation of the ``ntk-distance`` results: tables and figures (no new maths).

The 2-layer width sweep (:func:`build_tables`, :func:`plot_ntk_distance`), the checkpoint audit
(:func:`build_checkpoint_tables`, :func:`plot_checkpoints`) and the transformer sweep
(:func:`build_sweep_tables`, :func:`plot_sweep`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from attnaudit.analyses.ntk_distance.aggregate import KERNEL_RATE
from attnaudit.analyses.ntk_distance.checkpoint import CheckpointKernelResult
from attnaudit.analyses.ntk_distance.config import MODEL_LABELS
from attnaudit.analyses.ntk_distance.transformers import TransformerSweepResult
from attnaudit.analyses.ntk_distance.verdicts import WidthTrend
from attnaudit.analyses.ntk_distance.widths import NTKDistanceResult

PNG_NAME = "ntk_distance.png"
PNG_CHECKPOINT = "ntk_checkpoint.png"
PNG_TRANSFORMERS = "ntk_transformers.png"


@contextmanager
def _figure(path, nrows: int, ncols: int, figsize: tuple[float, float], squeeze: bool = True) -> Iterator:
    """(figure, axes) of a new matplotlib figure (Agg), written to ``path`` when the block ends, always closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=squeeze)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def _sentences(verdicts: Sequence[str], warnings: Sequence[str]) -> list:
    """The verdicts, then the warnings (in yellow), as rich texts."""
    from rich.text import Text

    return [*(Text(v) for v in verdicts), *(Text("warning: " + w, style="yellow") for w in warnings)]


def _num(x, fmt: str = "{:.3g}") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def _pm(stat: dict, fmt: str = "{:.3g}") -> str:
    mean, std = stat["mean"], stat["std"]
    if mean is None or not math.isfinite(mean):
        return "—"
    return fmt.format(mean) + ("" if not std or not math.isfinite(std) else " ± " + fmt.format(std))


def _width_series(
    axes,
    rows: list[dict],
    field: str,
    groups: Sequence[str],
    series: Callable[[str], Sequence[tuple[int, str, str, str]]],
    only_finite: bool = False,
) -> None:
    """Error bars (mean +- sd over seeds) vs width of the summary rows, one colour per group.

    For each group g (rows with ``row[field] == g``), ``series(g)`` lists (panel, statistic, style,
    label) lines; ``only_finite`` skips a line with no finite mean.
    """
    for idx, group in enumerate(groups):
        sel = sorted((r for r in rows if r[field] == group), key=lambda r: r["width"])
        w = [r["width"] for r in sel]
        for panel, key, style, label in series(group):
            mean = [r[key]["mean"] for r in sel]
            std = [r[key]["std"] for r in sel]
            if only_finite and not any(math.isfinite(m) for m in mean):
                continue
            axes[panel].errorbar(w, mean, yerr=std, fmt=style, color=f"C{idx}", capsize=3, label=label)


def _log_width_axes(axes, xlabel: str) -> None:
    """Log2 width on x, log y, a grid: the frame of every width-sweep panel."""
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)


MOVEMENT_COLUMNS = ("params", "ΔΘ/Θ₀ full", "ΔΘ/Θ₀ avg", "‖Θ_T‖/‖Θ₀‖", "1 − cos", "CKA init → trained")


def build_checkpoint_tables(results: list[CheckpointKernelResult], warnings: Sequence[str] = ()) -> list:
    """Rich renderables: one summary row per model, a per-group table per model, verdicts."""
    from rich.table import Table
    from rich.text import Text

    summary = Table(title="Kernel movement: trained model vs its initialization (empirical NTK, engine, float64)")
    for col in (
        "model",
        "reference",
        "rows",
        *MOVEMENT_COLUMNS,
        "‖f − f_lin‖ rel",
        "linearized",
        "seconds",
    ):
        summary.add_column(col, justify="left" if col in ("model", "reference", "linearized") else "right")
    out: list = [summary]
    for r in results:
        mv, lin = r.movement, r.linearized
        cka = "—" if mv.cka_init is None else f"{mv.cka_init:.3f} → {mv.cka_trained:.3f}"
        summary.add_row(
            r.label,
            str(r.reference.get("detail", r.reference.get("kind", "")))[:40],
            str(mv.n_points),
            f"{mv.n_params:,}",
            _num(mv.movement),
            _num(mv.movement_trace),
            _num(mv.norm_ratio),
            _num(mv.kernel_distance),
            cka,
            _num(lin.distance_rel, "{:.1%}") if lin.applicable else "—",
            lin.method if lin.applicable else "n/a",
            f"{r.seconds:.1f}",
        )
        groups = Table(title=f"{r.label}: per parameter group")
        for col in (
            "group",
            "params",
            "ΔΘ/Θ₀ full",
            "ΔΘ/Θ₀ avg",
            "‖Θ_T‖/‖Θ₀‖",
            "1 − cos",
            "trace share init → trained",
            "CKA init → trained",
        ):
            groups.add_column(col, justify="left" if col == "group" else "right")
        for g in mv.groups:
            groups.add_row(
                g.group,
                f"{g.n_params:,}",
                _num(g.movement),
                _num(g.movement_trace),
                _num(g.norm_ratio),
                _num(g.kernel_distance),
                f"{g.trace_share_init:.1%} → {g.trace_share_trained:.1%}",
                "—" if g.cka_init is None else f"{g.cka_init:.3f} → {g.cka_trained:.3f}",
            )
        out.append(groups)
    for r in results:
        out.append(Text(r.verdict))
        if r.linearized.applicable:
            out.append(Text(f"  linearized model of {r.label}: {r.linearized.dynamics}"))
    for w in [*warnings, *(w for r in results for w in r.warnings)]:
        out.append(Text("warning: " + w, style="yellow"))
    return out


def plot_checkpoints(results: list[CheckpointKernelResult], path) -> None:
    """PNG: per-group kernel movement (bars) and centred alignment before/after, per model."""
    k = len(results)
    with _figure(path, k, 2, (11, 3.8 * k), squeeze=False) as (_fig, axes):
        for row, r in enumerate(results):
            mv = r.movement
            names = [g.group for g in mv.groups] + ["all"]
            full = [g.movement for g in mv.groups] + [mv.movement]
            avg = [g.movement_trace for g in mv.groups] + [mv.movement_trace]
            x = list(range(len(names)))
            ax = axes[row][0]
            if mv.movement is not None:
                ax.bar([i - 0.2 for i in x], [v or 0 for v in full], width=0.4, label="full (n c)² kernel")
                ax.bar([i + 0.2 for i in x], avg, width=0.4, label="output-averaged")
            else:
                ax.bar(x, avg, width=0.6, label="output-averaged")
            ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("‖Θ_T − Θ_0‖_F / ‖Θ_0‖_F")
            ax.set_title(f"{r.label}: kernel movement per group")
            ax.legend(fontsize=8)
            ax = axes[row][1]
            if mv.cka_init is not None:
                c0 = [g.cka_init for g in mv.groups] + [mv.cka_init]
                cT = [g.cka_trained for g in mv.groups] + [mv.cka_trained]
                ax.bar([i - 0.2 for i in x], c0, width=0.4, label="at initialization")
                ax.bar([i + 0.2 for i in x], cT, width=0.4, label="trained")
                ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
                ax.set_ylabel("centred alignment with labels")
                ax.legend(fontsize=8)
            ax.set_title(f"{r.label}: kernel-label alignment (CKA)")


def build_sweep_tables(result: TransformerSweepResult) -> list:
    """Rich renderables of the transformer sweep: per arch x width table, the width trends, verdicts."""
    from rich.table import Table
    from rich.text import Text

    k = len(result.config.seeds)
    table = Table(
        title=f"Transformer width sweep (heads fixed at {result.config.heads}; mean ± sd over {k} seed(s); "
        f"kernel on {min(result.n_train, result.config.kernel_points)} training rows)"
    )
    for col in (
        "arch",
        "width",
        *MOVEMENT_COLUMNS,
        "‖f − f_lin‖ rms",
        "relative",
        "acc tr/te",
    ):
        table.add_column(col, justify="left" if col == "arch" else "right")
    for row in result.summary_rows():
        table.add_row(
            row["arch"],
            str(row["width"]) + (" ⚠" if row["diverged"] else ""),
            f"{row['n_params']:,}",
            _pm(row["movement"]),
            _pm(row["movement_trace"]),
            _pm(row["norm_ratio"]),
            _pm(row["kernel_distance"]),
            f"{_num(row['cka_init']['mean'], '{:.3f}')} → {_num(row['cka_trained']['mean'], '{:.3f}')}",
            _pm(row["distance_rms"]),
            _pm(row["distance_rel"], "{:.1%}"),
            f"{_num(row['train_acc']['mean'], '{:.1%}')}/{_num(row['test_acc']['mean'], '{:.1%}')}",
        )
    trend = Table(title="Width trend (log-log slope per seed, mean ± sd; trend word as in the 2-layer sweep)")
    for col in ("arch", "ΔΘ/Θ₀", "1 − cos", "‖f − f_lin‖ relative", "kernel regime"):
        trend.add_column(col, justify="left" if col in ("arch", "kernel regime") else "right")

    def cell(t: WidthTrend | None) -> str:
        if t is None:
            return "not measured"
        return f"{_num(t.slope_mean, '{:+.2f}')} ± {_num(t.slope_std, '{:.2f}')} ({t.trend})"

    for name in result.config.archs:
        s = result.archs[name]
        trend.add_row(
            name,
            cell(s.movement),
            cell(s.kernel_distance),
            cell(s.distance),
            "approaching" if s.approaches_kernel_regime else "not shown",
        )
    out: list = [table, trend]
    lin = next((c.linearized for c in result.cells if c.linearized.get("applicable")), None)
    if lin:
        out.append(Text(f"linearized model: {lin['dynamics']}"))
    return out + _sentences(result.verdicts(), result.warnings)


def plot_sweep(result: TransformerSweepResult, path) -> None:
    """PNG: kernel movement and distance to the linearized model vs width (log-log, sd bars)."""
    rows = result.summary_rows()
    with _figure(path, 1, 2, (11, 4.2)) as (fig, axes):
        key = "movement" if result.config.form == "full" else "movement_trace"
        _width_series(
            axes,
            rows,
            "arch",
            result.config.archs,
            lambda arch: (
                (0, key, "o-", arch),
                (0, "kernel_distance", "s--", f"{arch} 1 − cos"),
                (1, "distance_rel", "o-", arch),
            ),
            only_finite=True,
        )
        ws = sorted(result.config.widths)
        _log_width_axes(axes, "embedding dim (width)")
        for ax in axes:
            lines = [ln for ln in ax.get_lines() if len(ln.get_ydata())]
            if lines and len(ws) > 1:
                y0 = max(float(ln.get_ydata()[0]) for ln in lines)
                if math.isfinite(y0) and y0 > 0:
                    ax.plot(ws, [y0 * (v / ws[0]) ** KERNEL_RATE for v in ws], "k:", label="∝ m^-1/2")
            ax.legend(fontsize=8)
        axes[0].set_ylabel("‖Θ_T − Θ_0‖_F / ‖Θ_0‖_F  (dashed: 1 − cos(Θ_0, Θ_T))")
        axes[0].set_title("Kernel movement and change of shape")
        axes[1].set_ylabel("RMS ‖f − f_lin‖ / RMS ‖f_lin‖ (held-out)")
        axes[1].set_title("Distance to the linearized model")
        r = result.config.recipe
        fig.suptitle(
            f"{r.optimizer} lr {r.lr:g}, {r.loss}, n_train={result.n_train}, heads {result.config.heads}", fontsize=10
        )


def build_tables(result: NTKDistanceResult) -> list:
    """Rich renderables: per model x width table, then per-model diagnostics and verdicts."""
    from rich.table import Table

    n_seeds = len(result.config.seeds)
    rows = ", rows resampled per seed" if result.config.resample_data else ""
    table = Table(title=f"NTK distance (held-out n={result.n_test}, mean ± sd over {n_seeds} seed(s){rows})")
    for col in (
        "model",
        "width",
        "‖f_m − f_NTK‖ rms",
        "relative",
        "ΔΘ/Θ₀",
        "Θ₀ vs Θ∞",
        "ΔΘ/Θ₀ ⊥top",
        "Θ₀ vs Θ∞ ⊥top",
        "net acc tr/te",
        "kernel acc tr/te",
        "loss net/kernel",
    ):
        table.add_column(col, justify="right" if col not in ("model",) else "left")
    for row in result.summary_rows():
        pct = "{:.1%}"
        table.add_row(
            MODEL_LABELS[row["model"]],
            str(row["width"]) + (" ⚠" if row["diverged"] else ""),
            _pm(row["distance_rms"]),
            _pm(row["distance_rel"], pct),
            _pm(row["kernel_movement"]),
            _pm(row["kernel_init_error"]),
            _pm(row["kernel_movement_complement"]),
            _pm(row["kernel_init_error_complement"]),
            f"{row['net_train_acc']['mean']:.1%}/{row['net_test_acc']['mean']:.1%}",
            f"{row['kernel_train_acc']['mean']:.1%}/{row['kernel_test_acc']['mean']:.1%}",
            f"{row['net_train_loss']['mean']:.3g}/{row['kernel_train_loss']['mean']:.3g}",
        )
    diag = Table(title="Analytic kernel diagnostics and width trend")
    for col in (
        "model",
        "lr",
        "cond(Θ∞)",
        "rank",
        "top-eig share",
        "mean cos",
        "slope dist",
        "slope ΔΘ",
        "slope Θ₀−Θ∞",
        "trend",
    ):
        diag.add_column(col, justify="left" if col in ("model", "trend") else "right")
    for name in result.config.models:
        s = result.models[name]
        lrs = sorted(set(round(v, 12) for v in s.lr_by_width.values()))
        lr_txt = f"{lrs[0]:.4g}" if len(lrs) == 1 else f"{lrs[0]:.3g}…{lrs[-1]:.3g}"
        slope = "—" if not math.isfinite(s.slope_mean) else f"{s.slope_mean:+.2f} ± {s.slope_std:.2f}"
        diag.add_row(
            MODEL_LABELS[name],
            lr_txt,
            f"{s.condition_number:.3g}",
            f"{s.numerical_rank}/{result.n_train}",
            f"{s.top_eig_share:.1%}",
            f"{s.mean_pairwise_cosine:.4f}",
            slope,
            _num(s.movement_slope, "{:+.2f}"),
            _num(s.init_error_slope, "{:+.2f}"),
            s.trend,
        )
    out: list = [table, diag]
    return out + _sentences(result.verdicts(), result.warnings)


def plot_ntk_distance(result: NTKDistanceResult, path) -> None:
    """PNG: distance vs width and kernel movement vs width, log-log, error bars = sd over seeds."""
    rows = result.summary_rows()
    with _figure(path, 1, 2, (11, 4.2)) as (fig, axes):
        _width_series(
            axes,
            rows,
            "model",
            result.config.models,
            lambda name: (
                (0, "distance_rms", "o-", MODEL_LABELS[name]),
                (1, "kernel_movement", "o-", MODEL_LABELS[name] + " movement"),
                (1, "kernel_init_error", "s--", MODEL_LABELS[name] + " Θ₀ vs Θ∞"),
            ),
        )
        _log_width_axes(axes, "width m")
        ws = sorted(result.config.widths)
        if len(ws) > 1:
            first = [r for r in rows if r["width"] == ws[0]]
            anchor = max((r["distance_rms"]["mean"] for r in first if r["distance_rms"]["mean"]), default=None)
            if anchor and math.isfinite(anchor):
                axes[0].plot(ws, [anchor * (w / ws[0]) ** -0.5 for w in ws], "k:", label="∝ m^-1/2")
        axes[0].set_ylabel("RMS ‖f_m − f_NTK‖ (held-out)")
        axes[0].set_title("Distance to the NTK predictor")
        axes[1].set_ylabel("relative Frobenius norm")
        axes[1].set_title("Kernel movement and initial kernel error")
        axes[0].legend(fontsize=8)
        axes[1].legend(fontsize=8)
        fig.suptitle(
            f"{result.config.loss.upper()}, {result.config.steps} GD steps, n_train={result.n_train}", fontsize=10
        )
