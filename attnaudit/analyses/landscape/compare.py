"""Comparing models' landscapes: the paper's hypothesis read with its diagnostics.

The paper's hypothesis: 2L-ReLU ends in sharper, narrower minima than MLP-Attn. It is
stated as supported or not per measure only when

* both models are present and trained (a model whose training accuracy is within a few
  points of chance, below 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n)), learned nothing: its flat
  landscape is no evidence, so no claim is made about it);
* their training losses are comparable: within 10 % of each other (``LOSS_MISMATCH_RATIO``
  = 1.1, the larger over the smaller; train to a common loss with ``--match-loss``);
* the difference is larger than its tolerance: over seeds (``--seeds`` k >= 2) Student's
  t(0.975, k - 1) standard errors of the difference, each model's standard error being that
  of its mean over the k seeds (sd / sqrt(k), at least the estimator's own error /
  sqrt(k)); with one seed 2 of the estimator's own errors (Lanczos residual for lambda_max,
  Hutchinson standard error for the trace, the spread over half-lines for the basin width).
  Inside the tolerance the verdict reads "not resolved";
* at least 3 seeds (``attnaudit.core.stats.MIN_SEEDS``) stand behind it: a difference beyond the
  tolerance over fewer seeds reads "not resolved" too, since the spread over initialisations
  is then barely or not at all measured.

Every diagnostic that limits a number (Lanczos not converged, censored basin half-lines,
negative curvature, the GD stability bound) becomes a warning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from attnaudit.core.stats import CONFIDENCE, MIN_SEEDS, t_quantile
from attnaudit.analyses.landscape.analysis import LandscapeResult

#: Training losses whose ratio (larger / smaller) exceeds this are not comparable for sharpness (10 %).
LOSS_MISMATCH_RATIO = 1.1
# lambda_1 above this share of GD's stability bound 2/lr: the optimiser, not the model, may cap it
EOS_SHARE = 0.8
#: Differences smaller than this many standard errors of the difference read "not resolved".
RESOLVE_SE = 2.0


def _ratio(num: float, den: float) -> str:
    """num/den to 3 digits, or "undefined" when den is 0 (e.g. a flat landscape)."""
    return f"{num / den:.3g}" if den != 0 else "undefined"


def untrained_threshold(n_classes: int, n_train: int) -> tuple[float, float]:
    """(chance, threshold) with chance = 1/c and threshold = chance + max(0.05, 2 sqrt(chance (1 - chance) / n))."""
    c = max(int(n_classes), 1)
    chance = 1.0 / c
    return chance, chance + max(0.05, 2.0 * math.sqrt(chance * (1.0 - chance) / max(int(n_train), 1)))


def untrained_status(
    accuracies: Mapping[str, Sequence[float | None]], n_classes: int | None, n_train: int
) -> dict[str, dict]:
    """Per model: chance, threshold, mean training accuracy over seeds, and ``untrained`` (mean below the threshold).

    ``n_classes``: classes present in the training labels; None (a language model's documents) or
    no accuracy (None, a language model's) gives no verdict (``untrained`` None).
    """
    out = {}
    for label, accs in accuracies.items():
        vals = [float(a) for a in accs if a is not None and math.isfinite(a)]
        mean = sum(vals) / len(vals) if vals else float("nan")
        if n_classes is None or not vals:
            out[label] = {"chance": None, "threshold": None, "train_accuracy": mean, "untrained": None}
            continue
        chance, threshold = untrained_threshold(n_classes, n_train)
        out[label] = {
            "chance": chance,
            "threshold": threshold,
            "train_accuracy": mean,
            "untrained": bool(mean < threshold),
        }
    return out


def loss_mismatch_warning(
    losses: dict[str, float], ratio: float = LOSS_MISMATCH_RATIO, saved: bool = False
) -> str | None:
    """A warning when the models' training losses differ by more than ``ratio`` (larger / smaller; else None)."""
    finite = {k: v for k, v in losses.items() if math.isfinite(v)}
    if len(finite) < 2:
        return None
    lo_k = min(finite, key=finite.__getitem__)
    hi_k = max(finite, key=finite.__getitem__)
    lo, hi = finite[lo_k], finite[hi_k]
    if lo <= 0 or hi / lo > ratio:
        r = "inf" if lo <= 0 else f"{hi / lo:.3g}"
        return (
            f"training losses differ {r}x ({hi_k} {hi:.4g} vs {lo_k} {lo:.4g}), more than the {100 * (ratio - 1):.0f} % "
            f"within which sharpness is comparable; "
            + (
                "train the checkpoints to comparable losses"
                if saved
                else "rerun with --match-loss L (full-batch GD), or adjust --steps/--lr"
            )
        )
    return None


def _seed_values(
    label: str, results: Mapping[str, LandscapeResult], seed_results: Mapping[str, Sequence[LandscapeResult]] | None
) -> list[LandscapeResult]:
    runs = list((seed_results or {}).get(label) or [])
    return runs if runs else [results[label]]


def _mean_se(values: Sequence[float], own_se: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) over seeds: sd/sqrt(k), never below the estimator's own error/sqrt(k)."""
    k = len(values)
    mean = sum(values) / k
    own = math.sqrt(sum(e * e for e in own_se) / k) if own_se else 0.0
    if k < 2:
        return mean, own
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1))
    return mean, max(sd, own) / math.sqrt(k)


def measure_stats(runs: Sequence[LandscapeResult]) -> dict[str, tuple[float, float]]:
    """(mean, standard error) per measure over the seeds' results (see the module docstring)."""
    lam = [r.eigen.eigenvalues[0] for r in runs]
    # Lanczos residuals are relative to the spectral scale: absolute error ~ residual * lambda_max
    lam_err = [abs(r.eigen.residuals[0]) * abs(r.eigen.eigenvalues[0]) if r.eigen.residuals else 0.0 for r in runs]
    return {
        "lambda_max": _mean_se(lam, lam_err),
        "trace": _mean_se([r.trace.estimate for r in runs], [r.trace.stderr for r in runs]),
        "basin": _mean_se([r.basin.width for r in runs], [r.basin.stderr for r in runs]),
    }


def _compare(
    name: str,
    r_stat: tuple[float, float],
    a_stat: tuple[float, float],
    k: int,
    sharper_if_larger: bool,
    what: str,
    fmt: str = "{:.4g}",
    extra: str = "",
) -> str:
    (mr, se_r), (ma, se_a) = r_stat, a_stat
    factor = t_quantile(CONFIDENCE, k - 1) if k > 1 else RESOLVE_SE
    tol = factor * math.hypot(se_r, se_a)
    diff = mr - ma
    where = "mean over %d seeds" % k if k > 1 else "1 seed"
    basis = (
        f"t(0.975, {k - 1}) = {factor:.2f} SE of the difference, SE = sd over seeds / sqrt(k)"
        if k > 1
        else "2 SE of the difference from the estimator's own error; one seed: the spread over initialisations is not measured, use --seeds"
    )
    head = (
        f"{name} ({where}{extra}): relu {fmt.format(mr)} +- {se_r:.2g}, attn {fmt.format(ma)} +- {se_a:.2g}; "
        f"difference {diff:+.4g}, tolerance {tol:.2g} ({basis}); "
    )
    if abs(diff) <= tol:
        return head + "difference within the tolerance: not resolved"
    if k < MIN_SEEDS:
        return head + (
            f"beyond the tolerance, but {k} seed{'s' if k > 1 else ''} cannot carry a verdict (at least "
            f"{MIN_SEEDS}; pass --seeds {MIN_SEEDS}): not resolved"
        )
    holds = (diff > 0) if sharper_if_larger else (diff < 0)
    return head + _support(holds, what)


def compare_landscapes(
    results: dict[str, LandscapeResult],
    training: dict[str, dict],
    lr: float | None = None,
    match_loss: float | None = None,
    saved: bool = False,
    *,
    seed_results: Mapping[str, Sequence[LandscapeResult]] | None = None,
    n_classes: int | None = None,
    loss_ratio: float = LOSS_MISMATCH_RATIO,
) -> tuple[list[str], list[str]]:
    """(verdicts, warnings) comparing the models' sharpness, read with its diagnostics.

    ``results``: one result per model (the first seed's); ``seed_results``: every seed's
    result per model (``--seeds``), from which the compared means and their tolerances come;
    ``n_classes``: classes present in the training labels, which turns on the untrained rule
    (None: not applied). See the module docstring for the rules.
    """
    verdicts: list[str] = []
    warnings: list[str] = []
    runs = {k: _seed_values(k, results, seed_results) for k in results}
    losses = {k: sum(r.loss for r in v) / len(v) for k, v in runs.items()}
    mismatch = loss_mismatch_warning(losses, ratio=loss_ratio, saved=saved)
    if mismatch:
        warnings.append(mismatch)
    n_train = next(iter(results.values())).n_samples if results else 0
    status = untrained_status({k: [r.accuracy for r in v] for k, v in runs.items()}, n_classes, n_train)
    untrained = [k for k, st in status.items() if st["untrained"]]
    for label in untrained:
        st = status[label]
        warnings.append(
            f"{label} is untrained: training accuracy {100 * st['train_accuracy']:.1f}% is within a few points of chance "
            f"({100 * st['chance']:.0f}%; threshold {100 * st['threshold']:.1f}%); its landscape is no evidence about "
            "the paper's hypothesis, so no claim is made about it"
        )
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
        k = min(len(runs["relu"]), len(runs["attn"]))
        if untrained:
            accs = ", ".join(f"{m} {100 * status[m]['train_accuracy']:.1f}%" for m in untrained)
            verdicts.append(
                f"relu vs attn: no claim — {' and '.join(untrained)} untrained (training accuracy {accs}, within a few "
                f"points of chance {100 * status[untrained[0]]['chance']:.0f}%): a flat or sharp landscape of a model that "
                "learned nothing is no evidence; train longer, raise --lr or check the inputs (--preprocess ntk-scale)"
            )
        elif mismatch:
            verdicts.append(
                "relu vs attn: not compared, the training losses differ by more than "
                f"{100 * (loss_ratio - 1):.0f} % (see warnings); rerun with --match-loss"
            )
        else:
            sr, sa = measure_stats(runs["relu"]), measure_stats(runs["attn"])
            lam_r, lam_a = sr["lambda_max"][0], sa["lambda_max"][0]
            verdicts.append(
                _compare(
                    "lambda_max",
                    sr["lambda_max"],
                    sa["lambda_max"],
                    k,
                    True,
                    "relu sharper",
                    extra=f"; attn/relu {_ratio(lam_a, lam_r)}",
                )
            )
            verdicts.append(_compare("trace", sr["trace"], sa["trace"], k, True, "relu sharper"))
            width = f"basin width (alpha at {r.basin.factor:g}x loss)"
            if r.basin.censored or a.basin.censored:
                verdicts.append(
                    _compare(width, sr["basin"], sa["basin"], k, False, "attn wider").split("; difference")[0]
                    + "; not resolved (censored half-lines: the widths are lower bounds)"
                )
            else:
                verdicts.append(_compare(width, sr["basin"], sa["basin"], k, False, "attn wider", "{:.3g}"))
            verdicts.append(
                f"top-1 share of the trace: relu {r.top_share[0]:.3g}, attn {a.top_share[0]:.3g} "
                f"(trace / lambda_max: relu {r.trace_over_top:.3g}, attn {a.trace_over_top:.3g} directions)"
            )
    elif saved and len(results) > 1:
        base = list(results)[0]
        for label, text in zip(list(results)[1:], _pairwise(results, bool(mismatch))):
            idle = [m for m in (label, base) if m in untrained]
            verdicts.append(
                f"{label} vs {base}: no claim — {' and '.join(idle)} untrained (training accuracy within a "
                "few points of chance; see warnings)"
                if idle
                else text
            )
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
            + (
                "; the training losses differ (see warnings), so sharpness is not comparable as it stands"
                if mismatch
                else ""
            )
        )
    return out


def _support(holds: bool, what: str) -> str:
    return (
        f"{what}: consistent with the paper's hypothesis (2L-ReLU sharp, MLP-Attn flat)"
        if holds
        else f"not {what}: contradicts the paper's hypothesis (2L-ReLU sharp, MLP-Attn flat) on this measure"
    )


SEED_FIELDS = ("loss", "accuracy", "lambda_max", "trace", "trace_stderr", "basin_width", "basin_stderr")


def seed_record(seed: int, r: LandscapeResult) -> dict:
    """The headline numbers of one seed's analysis (per-seed values of the per-model JSON)."""
    return {
        "seed": seed,
        "loss": r.loss,
        "accuracy": r.accuracy,
        "lambda_max": r.eigen.eigenvalues[0] if r.eigen.eigenvalues else float("nan"),
        "top_eigenvalues": list(r.eigen.eigenvalues),
        "trace": r.trace.estimate,
        "trace_stderr": r.trace.stderr,
        "basin_width": r.basin.width,
        "basin_stderr": r.basin.stderr,
        "basin_censored": r.basin.censored,
    }


def seed_summary(records: Sequence[dict]) -> dict:
    """Per-seed values with mean and sd (ddof 1; 0 for one seed) of each headline number."""
    import math

    mean: dict[str, float | None] = {}
    sd: dict[str, float | None] = {}
    for key in SEED_FIELDS:
        vals = [float(rec[key]) for rec in records if rec.get(key) is not None and math.isfinite(rec[key])]
        if not vals:
            mean[key] = sd[key] = None
            continue
        m = sum(vals) / len(vals)
        mean[key] = m
        sd[key] = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {
        "n_seeds": len(records),
        "values": list(records),
        "mean": mean,
        "sd": sd,
        "note": "the model's other fields (loss, accuracy, top_eigenvalues, trace, basin, surfaces) are the first "
        "seed's; the comparison uses the mean over seeds with its standard error",
    }
