"""Stability of influence under perturbation, per comparison and over seeds.

One comparison (clean vs perturbed influence, sample i staying sample i): the flip rate among
the top-k samples by clean |influence| (a sign change; an exact zero is not a flip), Spearman's
rank correlation and the top-k overlap. Over seeds: mean, sample standard deviation and
Student's t interval (shares floored at the binomial variance of the top-k items), and ratios
of flip rates with Fieller's interval; a seed that repeats an earlier one bit for bit counts once.
"""

from __future__ import annotations

import numpy as np

from attnaudit.core.stats import mean_interval, proportion_interval, ratio_interval
from attnaudit.errors import AuditError


def top_k_indices(values, k: int) -> np.ndarray:
    """Indices of the k largest |values| (ties broken by index, so the choice is reproducible)."""
    v = np.abs(np.asarray(values, dtype=np.float64))
    return np.argsort(-v, kind="stable")[: min(k, v.size)]


def flip_rate(clean, perturbed, top_k: int) -> float:
    """Share of the top-k samples by clean |influence| whose influence changes sign."""
    c, p = np.asarray(clean, dtype=np.float64), np.asarray(perturbed, dtype=np.float64)
    if c.shape != p.shape:
        raise AuditError(f"clean and perturbed influence differ in length ({c.size} vs {p.size})")
    idx = top_k_indices(c, top_k)
    return float(np.mean(c[idx] * p[idx] < 0)) if idx.size else float("nan")


def stability(clean, perturbed, top_k: int) -> dict:
    """Flip rate, Spearman correlation and top-k overlap of two influence vectors."""
    from scipy.stats import spearmanr

    c, p = np.asarray(clean, dtype=np.float64), np.asarray(perturbed, dtype=np.float64)
    k = min(top_k, c.size)
    idx_c, idx_p = top_k_indices(c, k), top_k_indices(p, k)
    if np.ptp(c) == 0 or np.ptp(p) == 0:
        rho = None  # a constant vector has no ranking
    else:
        rho = float(spearmanr(c, p).statistic)
    return {
        "flip_rate": flip_rate(c, p, k),
        "n_flipped": int(np.sum(c[idx_c] * p[idx_c] < 0)),
        "top_k": int(k),
        "spearman": rho,
        "top_k_overlap": len(set(idx_c.tolist()) & set(idx_p.tolist())) / k if k else float("nan"),
        "clean_helpful_in_top_k": int(np.sum(c[idx_c] < 0)),
    }


def stability_by_k(clean, perturbed, top_ks) -> dict:
    """:func:`stability` at the first k (its keys), plus ``by_top_k``: flip rate, flips and
    overlap at every k."""
    first = stability(clean, perturbed, top_ks[0])
    by = []
    for k in top_ks:
        st = first if k == top_ks[0] else stability(clean, perturbed, k)
        by.append(
            {key: st[key] for key in ("top_k", "flip_rate", "n_flipped", "top_k_overlap", "clean_helpful_in_top_k")}
        )
    return {**first, "by_top_k": by}


def summarize(values, confidence: float = 0.95, trials: int | None = None) -> dict:
    """Mean, sample std and interval of per-seed values (None = undefined).

    ``trials``: the values are shares of that many items (a flip rate over the top-k, a
    top-k overlap): Student's t over seeds with the binomial variance floor
    (:func:`attnaudit.core.stats.proportion_interval`); otherwise the plain Student-t interval.
    One seed gives no interval (both ends None)."""
    v = [float(x) for x in values if x is not None and np.isfinite(x)]
    iv = proportion_interval(v, trials, confidence) if trials else mean_interval(v, confidence)
    if not v:
        return {
            "mean": None,
            "std": None,
            "ci_low": None,
            "ci_high": None,
            "n": 0,
            "values": list(values),
            "interval_method": iv.method,
        }
    return {
        "mean": float(np.mean(v)),
        "std": float(np.std(v, ddof=1)) if len(v) > 1 else None,
        "ci_low": iv.low,
        "ci_high": iv.high,
        "n": len(v),
        "values": v,
        "interval_method": iv.method,
    }


def ratio_summary(numerator, denominator, confidence: float = 0.95, trials: tuple[int, int] | None = None) -> dict:
    """Ratio of mean flip rates (paired by seed) with Fieller's interval over seeds.

    ``ratio`` is None when the denominator's mean is 0. ``ci_high`` None means the interval
    is unbounded above (the denominator is not clearly above 0): every seed is kept, none
    dropped. ``trials``: top-k of numerator and denominator (binomial variance floors).
    See :func:`attnaudit.core.stats.ratio_interval`."""
    a, b = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    iv = ratio_interval(a.tolist(), b.tolist(), confidence, trials=trials)
    return {
        "ratio": iv.estimate,
        "ci_low": iv.low,
        "ci_high": iv.high,
        "unbounded_high": bool(a.size > 1 and iv.high is None),
        "interval_method": iv.method,
        "n": int(a.size),
        "numerator_values": a.tolist(),
        "denominator_values": b.tolist(),
        "note": iv.note,
    }


def distinct_replicates(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rows that are independent replicates, and the others as [{"seed", "as_seed"}].

    A seed whose comparison ran on bitwise the inputs of an earlier seed's (the same
    ``inputs_sha256``: model, clean and perturbed rows, estimator) repeats it exactly -- a
    deterministic attack on a fixed model and rows varies nothing with the seed -- so it is no
    second sample: counting it would shrink an interval by sqrt(2) for no new information.
    Rows without a key (TracIn) are always kept."""
    first: dict[str, int] = {}
    kept, copies = [], []
    for r in rows:
        key = r.get("inputs_sha256")
        if key is not None and key in first:
            copies.append({"seed": r["seed"], "as_seed": first[key]})
            continue
        if key is not None:
            first[key] = r["seed"]
        kept.append(r)
    return kept, copies


def value_at_k(row: dict, k: int, key: str):
    """``row[key]`` at top-k ``k`` (from its ``by_top_k``; the row's own value when it has none)."""
    for item in row.get("by_top_k") or ():
        if item["top_k"] == k:
            return item[key]
    return row.get(key) if row.get("top_k") == k else None
