"""Comparing models' landscapes: the paper's hypothesis read with its diagnostics.

The paper's hypothesis: 2L-ReLU ends in sharper, narrower minima than MLP-Attn. It is
stated as supported or not per measure only when both models are present and their
training losses are comparable; every diagnostic that limits a number (Lanczos not
converged, censored basin half-lines, negative curvature, the GD stability bound) becomes
a warning.
"""

from __future__ import annotations

import math

from .analysis import LandscapeResult

#: Models whose training losses differ by more than this factor are not comparable for sharpness.
LOSS_MISMATCH_RATIO = 2.0
# lambda_1 above this share of GD's stability bound 2/lr: the optimiser, not the model, may cap it
EOS_SHARE = 0.8


def _ratio(num: float, den: float) -> str:
    """num/den to 3 digits, or "undefined" when den is 0 (e.g. a flat landscape)."""
    return f"{num / den:.3g}" if den != 0 else "undefined"


def loss_mismatch_warning(losses: dict[str, float], ratio: float = LOSS_MISMATCH_RATIO, saved: bool = False) -> str | None:
    """A warning when the models' training losses differ by more than ``ratio`` (else None)."""
    finite = {k: v for k, v in losses.items() if math.isfinite(v)}
    if len(finite) < 2:
        return None
    lo_k = min(finite, key=finite.get)
    hi_k = max(finite, key=finite.get)
    lo, hi = finite[lo_k], finite[hi_k]
    if lo <= 0 or hi / lo > ratio:
        r = "inf" if lo <= 0 else f"{hi / lo:.3g}"
        return (
            f"training losses differ {r}x ({hi_k} {hi:.4g} vs {lo_k} {lo:.4g}): sharpness is only comparable "
            f"at comparable loss; " + ("train the checkpoints to comparable losses" if saved else "rerun with --match-loss L")
        )
    return None


def compare_landscapes(
    results: dict[str, LandscapeResult], training: dict[str, dict], lr: float | None = None,
    match_loss: float | None = None, saved: bool = False,
) -> tuple[list[str], list[str]]:
    """(verdicts, warnings) comparing the models' sharpness, read with its diagnostics.

    The paper's hypothesis (2L-ReLU in sharper, narrower minima than MLP-Attn) is stated as
    supported or not per measure only when both models are present and their training
    losses are comparable (ratio <= LOSS_MISMATCH_RATIO).
    """
    verdicts: list[str] = []
    warnings: list[str] = []
    losses = {k: r.loss for k, r in results.items()}
    mismatch = loss_mismatch_warning(losses, saved=saved)
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
    elif saved and len(results) > 1:
        verdicts.extend(_pairwise(results, bool(mismatch)))
    return verdicts, warnings


def _pairwise(results: dict[str, LandscapeResult], mismatch: bool) -> list[str]:
    """Each saved model against the first one: lambda_max, trace (in its standard errors)
    and basin width (in its standard errors). No hypothesis is attached: the labels are the
    user's models, not the paper's two reference nets."""
    labels = list(results)
    base_label, base = labels[0], results[labels[0]]
    out = []
    for label in labels[1:]:
        r = results[label]
        lam_b, lam = base.eigen.eigenvalues[0], r.eigen.eigenvalues[0]
        diff = r.trace.estimate - base.trace.estimate
        se = math.hypot(r.trace.stderr, base.trace.stderr)
        z = abs(diff) / se if se > 0 else math.inf
        se_w = math.hypot(r.basin.stderr, base.basin.stderr)
        censored = r.basin.censored or base.basin.censored
        if censored:
            width = "not resolved (censored half-lines: lower bounds)"
        elif se_w > 0 and abs(r.basin.width - base.basin.width) >= 2 * se_w:
            width = f"{'wider' if r.basin.width > base.basin.width else 'narrower'} ({r.basin.width:.3g} vs {base.basin.width:.3g})"
        else:
            width = f"within 2 SE ({r.basin.width:.3g} vs {base.basin.width:.3g})"
        out.append(
            f"{label} vs {base_label}: lambda_max {lam:.4g} vs {lam_b:.4g} ({label}/{base_label} {_ratio(lam, lam_b)}); "
            f"trace {r.trace.estimate:.4g} vs {base.trace.estimate:.4g} "
            + (f"({'larger' if diff > 0 else 'smaller'}, {z:.1f} SE)" if z >= 2 else "(within 2 SE)")
            + f"; basin width {width}"
            + ("; the training losses differ (see warnings), so sharpness is not comparable as it stands" if mismatch else "")
        )
    return out


def _support(holds: bool, what: str) -> str:
    return (
        f"{what}: consistent with the paper's hypothesis (2L-ReLU sharp, MLP-Attn flat)"
        if holds
        else f"not {what}: contradicts the paper's hypothesis (2L-ReLU sharp, MLP-Attn flat) on this measure"
    )
