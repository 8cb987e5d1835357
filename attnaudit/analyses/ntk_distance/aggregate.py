"""Aggregation over seeds and widths, shared by the width sweeps and the checkpoint audit.

* per-seed statistics (:func:`seed_stats`: mean, sd with ddof 1, the values) and the
  summary rows of a sweep (:func:`summary_rows`);
* the width trend: log-log least-squares slope (:func:`loglog_slope`), its 95 % Student-t
  interval over seeds (:func:`slope_interval`), rises beyond the seed spread
  (:func:`increases_beyond_spread`) and the trend word (:func:`trend_word`);
* the untrained rule (:func:`untrained_threshold`) and strict JSON (:func:`strict_json`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from attnaudit.core.stats import MIN_SEEDS, mean_interval


def strict_json(obj: Any) -> Any:
    """Non-finite floats -> None so the report is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def seed_stats(values: Sequence[float]) -> dict:
    """{"mean", "std", "values"} over the finite values (sd with ddof 1; 0 for one value, NaN for none)."""
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    if not finite:
        return {"mean": float("nan"), "std": float("nan"), "values": vals}
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) if len(finite) > 1 else 0.0
    return {"mean": mean, "std": std, "values": vals}


def loglog_slope(widths: Sequence[int], values: Sequence[float]) -> float:
    """Least-squares slope of log(value) against log(width); NaN if fewer than 2 usable points."""
    pts = [(math.log(w), math.log(v)) for w, v in zip(widths, values) if v is not None and math.isfinite(v) and v > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def rms_rows(F: torch.Tensor) -> float:
    """RMS over rows of the rows' Euclidean norms, sqrt(mean_i ||F_i||^2) (NaN for no rows)."""
    return F.pow(2).sum(1).mean().sqrt().item() if F.numel() else float("nan")


def untrained_threshold(n_classes: int, n_train: int) -> tuple[float, float]:
    """(chance, threshold): training accuracy below ``threshold`` = 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n))
    is within a few points (or two binomial standard errors) of chance: the model learned nothing
    worth a verdict. ``n_classes``: classes present in the training labels."""
    c = max(int(n_classes), 1)
    chance = 1.0 / c
    return chance, chance + max(0.05, 2.0 * math.sqrt(chance * (1.0 - chance) / max(int(n_train), 1)))


def slope_interval(slopes: Sequence[float]) -> tuple[float, float, float, int]:
    """(mean, low, high, k) of the finite per-seed slopes: the 95 % Student-t interval
    mean +- t(0.975, k - 1) sd / sqrt(k) (:func:`attnaudit.core.stats.mean_interval`; the normal
    "2 sd / sqrt(k)" covers only 0.70-0.82 at k = 2-3); k = 1 gives a point (no interval)."""
    iv = mean_interval(slopes)
    if not iv.n:
        return float("nan"), float("nan"), float("nan"), 0
    assert iv.estimate is not None  # at least one finite slope
    if iv.n == 1:
        return iv.estimate, iv.estimate, iv.estimate, 1
    assert iv.low is not None and iv.high is not None  # two or more: a two-sided interval
    return iv.estimate, iv.low, iv.high, iv.n


INTERVAL_RULE = (
    "slope interval = 95 % Student-t interval mean ± t(0.975, k - 1) sd/sqrt(k) over the k seeds' "
    "log-log slopes (sd ddof 1); an interval that includes 0, or fewer than 3 seeds, reads 'no clear "
    "trend'"
)


MONOTONE_RULE = (
    "an increase of the seed-mean between neighbouring widths counts only when it exceeds the seed "
    "spread there (the larger of the two widths' sd over seeds)"
)


def increases_beyond_spread(widths: Sequence[int], means: Sequence[float], sds: Sequence[float] | None) -> list[list]:
    """[[w_a, w_b, rise, spread], ...] for neighbouring widths (sorted) where the mean rises by more
    than max(sd_a, sd_b) (with one seed, or no sds, every rise counts)."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    out = []
    for i, j in zip(order, order[1:]):
        a, b = means[i], means[j]
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            continue
        spread = 0.0
        if sds is not None:
            vals = [v for v in (sds[i], sds[j]) if v is not None and math.isfinite(v)]
            spread = max(vals) if vals else 0.0
        if b - a > spread:
            out.append([widths[i], widths[j], b - a, spread])
    return out


def trend_word(
    slopes: list[float],
    monotone: bool | None = None,
    *,
    widths: Sequence[int] | None = None,
    means: Sequence[float] | None = None,
    sds: Sequence[float] | None = None,
    untrained: bool = False,
) -> str:
    """The trend word: untrained / undetermined / no-clear-trend / falls / falls-non-monotone / rises.

    ``falls``/``rises`` only when the slope interval (:func:`slope_interval`) excludes 0;
    ``falls-non-monotone`` when it falls but the seed-mean curve rises between neighbouring
    widths by more than the seed spread there (``widths``, ``means``, ``sds``; without them the
    legacy ``monotone`` flag decides). ``untrained``: the model stayed at chance at every
    width, so no trend is claimed.
    """
    if untrained:
        return "untrained"
    mean, lo, hi, k = slope_interval(slopes)
    if not k:
        return "undetermined"
    if lo <= 0 <= hi or k < MIN_SEEDS:
        return "no-clear-trend"
    if hi < 0:
        if widths is not None and means is not None:
            rising = increases_beyond_spread(widths, means, sds)
            return "falls-non-monotone" if rising else "falls"
        return "falls" if (monotone is None or monotone) else "falls-non-monotone"
    return "rises"


KERNEL_RATE = -0.5  # distance ~ m^-1/2 in the kernel regime (kernel fluctuation and movement are O(m^-1/2))


def summary_rows(
    cells: Sequence[Any],
    by: str,
    names: Sequence[str],
    widths: Sequence[int],
    head: Callable[[list], dict],
    keys: Sequence[str],
) -> list[dict]:
    """A sweep's summary: one row per name (the cells' ``by``: model or arch) and width, with
    the number of seeds, ``head(cells of the row)`` and the mean and spread over seeds of each
    of ``keys`` (a missing value counts as NaN)."""
    rows = []
    for name in names:
        for width in widths:
            group = [c for c in cells if getattr(c, by) == name and c.width == width]
            row = {by: name, "width": width, "n_seeds": len(group), **head(group)}
            for key in keys:
                row[key] = seed_stats([getattr(c, key) if getattr(c, key) is not None else float("nan") for c in group])
            rows.append(row)
    return rows


def sweep_verdicts(summaries: Mapping[str, Any], names: Sequence[str], label: Callable[[str], str] = str) -> list[str]:
    """A sweep's verdicts: each model's (``summaries[name].verdict``), or that every cell of it failed."""
    return [summaries[n].verdict if n in summaries else f"{label(n)}: every cell failed; no verdict" for n in names]
