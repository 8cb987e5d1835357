"""Tables, figure and verdicts for `attnaudit landscape` (presentation only, no new maths)."""

from __future__ import annotations

import math
from pathlib import Path

from .landscape import LOSS_MISMATCH_RATIO, LandscapeResult, loss_mismatch_warning

SCHEMA = "attnaudit.landscape/1"
PNG_NAME = "landscape.png"
# lambda_1 above this share of GD's stability bound 2/lr: the optimiser, not the model, may cap it
EOS_SHARE = 0.8


def _g(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


def _ratio(num: float, den: float) -> str:
    """num/den to 3 digits, or "undefined" when den is 0 (e.g. a flat landscape)."""
    return f"{num / den:.3g}" if den != 0 else "undefined"


def compare_landscapes(
    results: dict[str, LandscapeResult], training: dict[str, dict], lr: float | None = None,
    match_loss: float | None = None,
) -> tuple[list[str], list[str]]:
    """(verdicts, warnings) comparing the models' sharpness, read with its diagnostics.

    The paper's hypothesis (2L-ReLU in sharper, narrower minima than MLP-Attn) is stated as
    supported or not per measure only when both models are present and their training
    losses are comparable (ratio <= LOSS_MISMATCH_RATIO).
    """
    verdicts: list[str] = []
    warnings: list[str] = []
    losses = {k: r.loss for k, r in results.items()}
    mismatch = loss_mismatch_warning(losses)
    if mismatch:
        warnings.append(mismatch)
    for label, info in training.items():
        if match_loss is not None and info.get("reached_match_loss") is False:
            warnings.append(
                f"{label} did not reach --match-loss {match_loss:g} within {info['steps_run']} steps "
                f"(training loss {info['final_loss']:.4g}); raise --steps or --lr"
            )
    for label, r in results.items():
        e = r.eigen
        if not e.converged:
            warnings.append(
                f"{label}: Lanczos did not converge in {e.steps} steps (largest Ritz bound "
                f"{max(e.ritz_bounds):.2g} > tol {e.tol:g}); the smaller eigenvalues are approximate"
            )
        if r.basin.censored:
            warnings.append(
                f"{label}: {r.basin.censored} of {len(r.basin.radii)} basin half-lines never reached "
                f"{r.basin.factor:g}x the loss within alpha = {r.basin.max_radius:g}; the basin width is a lower bound"
            )
        if e.eigenvalues and r.top_share and r.top_share[-1] > 1 + 3 * r.top_share_stderr[-1]:
            warnings.append(
                f"{label}: the top {len(r.top_share)} eigenvalues exceed the trace estimate "
                f"(share {r.top_share[-1]:.3g}): the Hessian has sizeable negative eigenvalues, not a minimum"
            )
        if lr is not None and label in training and e.eigenvalues:
            bound = 2.0 / lr
            if e.eigenvalues[0] > EOS_SHARE * bound:
                warnings.append(
                    f"{label}: lambda_max {e.eigenvalues[0]:.3g} is {e.eigenvalues[0] / bound:.0%} of GD's stability "
                    f"bound 2/lr = {bound:.3g}: at this learning rate the optimiser caps sharpness (edge of "
                    f"stability), so it reflects --lr as much as the model; compare at a smaller --lr"
                )
    if "relu" in results and "attn" in results:
        r, a = results["relu"], results["attn"]
        if mismatch:
            verdicts.append(
                "relu vs attn: not compared, the training losses differ more than "
                f"{LOSS_MISMATCH_RATIO:g}x (see warnings); rerun with --match-loss"
            )
        else:
            lam_r, lam_a = r.eigen.eigenvalues[0], a.eigen.eigenvalues[0]
            verdicts.append(
                f"lambda_max: relu {lam_r:.4g}, attn {lam_a:.4g} (attn/relu {_ratio(lam_a, lam_r)}); "
                + _support(lam_r > lam_a, "relu sharper")
            )
            diff = r.trace.estimate - a.trace.estimate
            se = math.hypot(r.trace.stderr, a.trace.stderr)
            z = diff / se if se > 0 else math.inf * (1 if diff > 0 else -1)
            resolved = abs(z) >= 2
            verdicts.append(
                f"trace: relu {r.trace.estimate:.4g} +- {r.trace.stderr:.2g}, attn {a.trace.estimate:.4g} +- "
                f"{a.trace.stderr:.2g} (difference {abs(z):.1f} SE); "
                + (_support(diff > 0, "relu sharper") if resolved else "difference within 2 SE: not resolved")
            )
            wr, wa = r.basin.width, a.basin.width
            se_w = math.hypot(r.basin.stderr, a.basin.stderr)
            resolved_w = se_w > 0 and abs(wa - wr) >= 2 * se_w
            verdicts.append(
                f"basin width (alpha at {r.basin.factor:g}x loss): relu {wr:.3g} +- {r.basin.stderr:.2g}, attn "
                f"{wa:.3g} +- {a.basin.stderr:.2g}; "
                + (_support(wa > wr, "attn wider") if resolved_w else "difference within 2 SE: not resolved")
            )
            verdicts.append(
                f"top-1 share of the trace: relu {r.top_share[0]:.3g}, attn {a.top_share[0]:.3g} "
                f"(trace / lambda_max: relu {r.trace_over_top:.3g}, attn {a.trace_over_top:.3g} directions)"
            )
    return verdicts, warnings


def _support(holds: bool, what: str) -> str:
    return (
        f"{what}: consistent with the paper's hypothesis (2L-ReLU sharp, MLP-Attn flat)"
        if holds
        else f"not {what}: contradicts the paper's hypothesis (2L-ReLU sharp, MLP-Attn flat) on this measure"
    )


def build_tables(results: dict[str, LandscapeResult], training: dict[str, dict], lr: float | None) -> list:
    """One rich table, a column per model."""
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
    row("training loss", lambda r, tr: _g(r.loss))
    row("training accuracy", lambda r, tr: f"{100 * r.accuracy:.1f}%")
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
        lambda r, tr: f"{_g(r.basin.width, 3)} +- {_g(r.basin.stderr, 2)}" + (f" ({r.basin.censored} cens.)" if r.basin.censored else ""),
    )
    if lr is not None:
        t.add_row("GD stability bound 2/lr", *[_g(2.0 / lr) if k in training else "-" for k in labels])
    return [t]


def plot_landscape(results: dict[str, LandscapeResult], path: str | Path, title: str = "") -> None:
    """1-D curves of all models overlaid (with each basin threshold), and a 2-D contour per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    labels = list(results)
    with_2d = [k for k in labels if results[k].surface_2d is not None]
    ncols = 1 + len(with_2d)
    fig, axes = plt.subplots(1, ncols, figsize=(4.8 * ncols, 4.4), squeeze=False, layout="constrained")
    ax = axes[0, 0]
    all_vals = []
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
    ax.legend(fontsize=8)
    # one colour scale for every contour, so the panels compare directly
    grids = {k: np.asarray(results[k].surface_2d.loss, dtype=float) for k in with_2d}
    if grids:
        finite = np.concatenate([g[np.isfinite(g)].ravel() for g in grids.values()])
        lo, hi = float(finite.min()), float(finite.max())
        use_log = lo > 0 and hi / lo > 10
        # log10 of the loss when it spans decades: plain levels, readable colour-bar ticks
        tf = np.log10 if use_log else (lambda v: v)
        levels = np.linspace(tf(lo), tf(hi), 25)
        cs = None
        for j, k in enumerate(with_2d, start=1):
            s = results[k].surface_2d
            axk = axes[0, j]
            A, B = np.meshgrid(s.alphas, s.betas, indexing="ij")
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
            cb = fig.colorbar(cs, ax=axes[0, 1:].tolist(), shrink=0.85, label="log10 training loss" if use_log else "training loss")
            cb.locator = matplotlib.ticker.MaxNLocator(7)
            cb.formatter = matplotlib.ticker.FormatStrFormatter("%.3g")
            cb.update_ticks()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
