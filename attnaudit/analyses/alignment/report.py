"""Table and figure of ``attnaudit alignment`` (the protocol is :mod:`.alignment`)."""

from __future__ import annotations

import math

import numpy as np

from attnaudit.analyses.alignment.alignment import (
    MODEL_LABELS,
    MODELS,
    TARGETS,
    AlignmentResult,
    SummaryRow,
)

PNG_NAME = "alignment.png"


def _num(v, fmt: str = ".3g") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def _ci(row: SummaryRow | None) -> str:
    if row is None or row.estimate is None:
        return "-"
    lo, hi = row.interval
    return f"{row.estimate:+.2g} [{_num(lo, '+.2g') if lo is not None else '-inf'}, {_num(hi, '+.2g') if hi is not None else '+inf'}]"


def build_tables(result: AlignmentResult, title: str = "attnaudit alignment") -> list:
    """Rich tables: the kernels per target (errors, CKA, paired differences), the trained nets per
    target, the contrasts, then one line per verdict and warning."""
    from rich.table import Table
    from rich.text import Text

    cfg = result.config
    level = {(r.metric, r.target, r.model): r for r in result.levels}
    summ = {(r.quantity, r.target): r for r in result.summary}
    kinds = [t for t in TARGETS if any(r.target == t for r in result.summary)]
    kt = Table(
        title=f"{title}: kernel ridge (relative test MSE ||f - y||^2/||y||^2) and CKA; "
        "every difference > 0 = attention better"
    )
    for c in (
        "target",
        "err relu",
        "err attn",
        "Δ err relu-attn [95 % CI]",
        "ln(err relu/attn) [95 % CI]",
        "CKA relu",
        "CKA attn",
        "Δ CKA attn-relu [95 % CI]",
    ):
        kt.add_column(c, justify="left" if c == "target" else "right")
    for kind in kinds:
        kt.add_row(
            kind,
            _num(level[("kernel_error", kind, "relu")].estimate),
            _num(level[("kernel_error", kind, "attn")].estimate),
            _ci(summ.get(("kernel_error_advantage_attn", kind))),
            _ci(summ.get(("kernel_log_error_ratio_attn", kind))),
            _num(level[("cka", kind, "relu")].estimate),
            _num(level[("cka", kind, "attn")].estimate),
            _ci(summ.get(("cka_advantage_attn", kind))),
        )
    out: list = [kt]
    if cfg.nets:
        nt = Table(
            title=f"trained nets, width {cfg.width}, GD to relative training MSE {cfg.match_loss:g} "
            f"(<= {cfg.steps} steps): relative test MSE; only seeds where both reached it are compared"
        )
        for c in ("target", "err relu", "err attn", "reached relu", "reached attn", "Δ err relu-attn [95 % CI]"):
            nt.add_column(c, justify="left" if c == "target" else "right")
        for kind in kinds:
            reached = []
            for arch in MODELS:
                mine = [r for r in result.per_seed if r.target == kind and r.model == arch]
                reached.append(f"{sum(bool(r.net_reached_loss) for r in mine)}/{len(mine)}")
            nt.add_row(
                kind,
                _num(level[("net_error", kind, "relu")].estimate),
                _num(level[("net_error", kind, "attn")].estimate),
                *reached,
                _ci(summ.get(("net_error_advantage_attn", kind))),
            )
        out.append(nt)
    if result.contrast:
        ct = Table(
            title="contrast: attention's advantage on principal minus on the other target (> 0 = the paper's claim)"
        )
        for c in ("quantity", "targets", "estimate [95 % CI]", "seeds", "verdict"):
            ct.add_column(c, justify="left" if c in ("quantity", "targets", "verdict") else "right")
        for r in result.contrast:
            ct.add_row(r.quantity, r.target, _ci(r), str(r.n_seeds), r.verdict)
        out.append(ct)
    out.extend(Text(f"- {v}") for v in result.verdicts())
    out.extend(Text(f"warning: {w}", style="yellow") for w in result.warnings)
    return out


def plot_alignment(result: AlignmentResult, path, title: str) -> None:
    """Errors (kernel, nets) and CKA by target and model: per-seed points and mean +- t-interval bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("kernel_error", "kernel ridge: relative test MSE (log)"), ("cka", "CKA(K, y y^T) on training rows")]
    if result.config.nets:
        metrics.insert(1, ("net_error", "trained nets (matched loss): relative test MSE (log)"))
    kinds = [t for t in TARGETS if any(r.target == t for r in result.levels)]
    colors = {"relu": "tab:blue", "attn": "tab:orange"}
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(4.6 * (len(metrics) + 1), 4.4))
    axes = np.atleast_1d(axes)
    try:
        for ax, (metric, label) in zip(axes, metrics):
            for j, arch in enumerate(MODELS):
                offset = -0.15 if j == 0 else 0.15
                for i, kind in enumerate(kinds):
                    lv = next(r for r in result.levels if r.metric == metric and r.target == kind and r.model == arch)
                    rows = [r for r in result.per_seed if r.target == kind and r.model == arch]
                    xs = i + offset
                    for r in rows:
                        v = getattr(r, metric)
                        if v is None or not math.isfinite(v) or (metric != "cka" and v <= 0):
                            continue
                        hollow = metric == "net_error" and not r.net_reached_loss
                        ax.scatter(
                            [xs + np.random.default_rng(r.seed).uniform(-0.05, 0.05)],
                            [v],
                            s=14,
                            facecolors="none" if hollow else colors[arch],
                            edgecolors=colors[arch],
                            alpha=0.7,
                        )
                    if lv.estimate is not None:
                        lo, hi = lv.interval
                        err = None
                        if lo is not None and hi is not None:
                            low = lv.estimate - lo if metric == "cka" or lo > 0 else 0.0  # log axes: no bar below 0
                            err = [[low], [hi - lv.estimate]]
                        ax.errorbar(
                            [xs],
                            [lv.estimate],
                            yerr=err,
                            fmt="s",
                            color=colors[arch],
                            capsize=4,
                            ms=6,
                            label=MODEL_LABELS[arch] if i == 0 else None,
                        )
            ax.set_xticks(range(len(kinds)))
            ax.set_xticklabels(kinds)
            ax.set_title(label, fontsize=10)
            ax.grid(alpha=0.3)
            if metric != "cka":
                ax.set_yscale("log")
            if metric == "net_error":
                ax.text(
                    0.01,
                    0.99,
                    "hollow: did not reach the loss (not compared)",
                    transform=ax.transAxes,
                    va="top",
                    fontsize=8,
                )
        # the differences themselves: per-target advantages and the contrasts, > 0 = attention better
        ax = axes[-1]
        errs = ("kernel_error_advantage_attn", "net_error_advantage_attn")
        shown = [r for r in result.summary if r.quantity in errs] + [
            r for r in result.contrast if r.quantity.removesuffix("_contrast") in errs
        ]
        labels_x = []
        for i, row in enumerate(shown):
            color = "tab:green" if row.quantity.startswith("kernel") else "tab:purple"
            for v in row.per_seed:
                if v is not None:
                    ax.scatter([i], [v], s=10, color=color, alpha=0.5)
            if row.estimate is not None:
                lo, hi = row.interval
                err = None if lo is None or hi is None else [[row.estimate - lo], [hi - row.estimate]]
                ax.errorbar([i], [row.estimate], yerr=err, fmt="D", color=color, capsize=4, ms=5)
            labels_x.append(
                ("K " if row.quantity.startswith("kernel") else "net ") + row.target.replace("principal-", "P-")
            )
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xticks(range(len(shown)))
        ax.set_xticklabels(labels_x, rotation=60, ha="right", fontsize=7)
        ax.set_title("err_relu - err_attn (> 0: attention better); P-x: contrast", fontsize=10)
        ax.text(0.01, 0.99, "green: kernel, purple: nets", transform=ax.transAxes, va="top", fontsize=8)
        ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
