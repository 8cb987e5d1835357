"""Verdicts of the width sweeps: per-model (2-layer) and per-architecture (transformers) summaries.

The 2-layer sweep (:func:`summarise_model`): per seed the log-log slope of the distance to the
NTK predictor against width, their 95 % Student-t interval, the trend word and one sentence
(:func:`distance_verdict`) that never claims more than the numbers: a model at chance at every
width gets no trend claim (the untrained rule), an interval that includes 0 reads "no clear
trend", one seed gives no interval. The transformer sweep (:func:`arch_summary`): the same
trend of its kernel movement, kernel distance and relative distance to the linearized model
(:func:`width_trend`), and whether all of them fall.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from attnaudit.analyses.ntk_distance.aggregate import (
    INTERVAL_RULE,
    KERNEL_RATE,
    MONOTONE_RULE,
    increases_beyond_spread,
    loglog_slope,
    seed_stats,
    slope_interval,
    strict_json,
    trend_word,
    untrained_threshold,
)
from attnaudit.analyses.ntk_distance.cells import ArchContext, mean_pairwise_cosine
from attnaudit.analyses.ntk_distance.config import MODEL_LABELS, NTKDistanceConfig


class SeedCell(Protocol):
    """A finished cell of a width sweep, as the trends read it."""

    width: int
    seed: int
    diverged: bool


@dataclass
class ModelSummary:
    """Per-model diagnostics of the analytic kernel, the width trend and the verdict."""

    model: str
    condition_number: float
    numerical_rank: int
    top_eig_share: float
    mean_pairwise_cosine: float
    diagnostic_kernel: str
    lr_by_width: dict
    slope_per_seed: list
    slope_mean: float
    slope_std: float
    slope_of_mean: float
    movement_slope: float
    init_error_slope: float
    monotone_decreasing: bool
    trend: str
    verdict: str
    slope_interval: list = field(default_factory=list)  # [low, high]: see INTERVAL_RULE
    interval_rule: str = ""
    increases_beyond_spread: list = field(default_factory=list)  # [[w_a, w_b, rise, spread], ...]
    train_acc_by_width: dict = field(default_factory=dict)  # width -> mean net train accuracy over seeds
    untrained_by_width: dict = field(default_factory=dict)  # width -> within a few points of chance
    untrained: bool = False  # at chance at every width: no trend claim
    chance: float | None = None
    untrained_threshold: float | None = None
    # resample_data: each seed's own analytic-kernel diagnostics and lr per width (the fields
    # above are the first seed's); empty when every seed shares the rows
    kernel_by_seed: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return strict_json(asdict(self))


def distance_verdict(
    label: str,
    trend: str,
    slope_mean: float,
    slope_std: float,
    k: int,
    rel_last: float,
    w_first: int,
    w_last: int,
    d_first: float,
    d_last: float,
    *,
    interval: tuple[float, float] | None = None,
    rising: Sequence | None = None,
    untrained_widths: Sequence[int] = (),
    train_acc: dict | None = None,
    chance: float | None = None,
) -> str:
    """One sentence: the measured trend with its interval, its rate against m^-1/2, and what it means.

    Never claims more than the numbers: a model at chance at every width gets no trend claim;
    an interval that includes 0 reads "no clear trend"; one seed gives no interval, so no claim
    about the kernel regime is made from it.
    """
    accs = train_acc or {}
    if trend == "untrained":
        acc = ", ".join(f"m={w}: {100 * a:.0f}%" for w, a in accs.items())
        where = (
            "at every width"
            if not untrained_widths or len(untrained_widths) == len(accs)
            else f"at {len(untrained_widths)} of {len(accs)} widths, leaving fewer than two trained widths"
        )
        return (
            f"{label}: untrained — the network stayed within a few points of chance ({100 * (chance or 0):.0f}%) "
            f"{where} (train accuracy {acc}); its distance to the NTK predictor is no evidence about the "
            "kernel regime, so no claim is made."
        )
    if trend == "undetermined":
        return f"{label}: trend undetermined (needs at least two widths with finite distances)."
    if interval is not None and k > 1:
        spread = (
            f"{slope_mean:+.2f} ± {slope_std:.2f} over {k} seeds, interval [{interval[0]:+.2f}, {interval[1]:+.2f}]"
        )
    else:
        spread = (
            f"{slope_mean:+.2f} ± {slope_std:.2f} over {k} seeds"
            if k > 1
            else f"{slope_mean:+.2f}, 1 seed (no interval)"
        )
    factor = d_first / d_last if d_last and d_last > 0 else float("nan")
    predicted = (w_last / w_first) ** -KERNEL_RATE
    change = f"fell by a factor {factor:.3g}" if factor >= 1 else f"rose by a factor {1 / factor:.3g}"
    rate = (
        f"log-log slope {spread}, kernel regime about {KERNEL_RATE}; the distance {change} from m={w_first} "
        f"to m={w_last}, where m^-1/2 predicts a fall by a factor {predicted:.3g}; "
        f"relative distance {rel_last:.1%} at m={w_last}"
    )
    one_seed = k <= 1
    if trend == "falls":
        head = (
            f"{label}: distance to the NTK predictor falls with width, no rise between neighbouring widths beyond "
            f"the seed spread ({rate})"
        )
        if one_seed:
            claim = "a single seed gives no interval, so this is not resolved; rerun with more seeds"
        else:
            claim = (
                "approaching the kernel regime as width grows, but at less than half the m^-1/2 rate"
                if slope_mean > KERNEL_RATE / 2
                else "approaching the kernel regime as width grows"
            )
    elif trend == "falls-non-monotone":
        where = "; ".join(f"m={a}->{b} rose by {r:.3g} (seed spread {sp:.2g})" for a, b, r, sp in (rising or []))
        head = (
            f"{label}: distance falls overall but not monotonically with width ({where}{'; ' if where else ''}{rate})"
        )
        claim = "not clearly approaching the kernel regime at these widths"
    elif trend == "rises":
        head = f"{label}: distance to the NTK predictor rises with width ({rate})"
        claim = (
            "a single seed gives no interval, so this is not resolved; rerun with more seeds"
            if one_seed
            else "moving away from the kernel regime"
        )
    else:
        head = f"{label}: no clear trend of distance with width (the slope interval includes 0; {rate})"
        claim = "no evidence of approaching the kernel regime at these widths"
    if untrained_widths:
        # a distance measured on a network that learned nothing is no evidence: no regime claim from this sweep
        claim = (
            f"no claim about the kernel regime: at width(s) {', '.join(str(w) for w in untrained_widths)} the "
            "network stayed within a few points of chance ("
            + ", ".join(f"{100 * accs[w]:.0f}%" for w in untrained_widths if w in accs)
            + f" train accuracy against a chance level of {100 * (chance or 0):.0f}%), so the trend mixes trained "
            "and untrained networks"
        )
    return f"{head} — {claim}."


def summarise_model(
    arch: str,
    group: list,
    config: NTKDistanceConfig,
    ctx: ArchContext,
    lr_by_width: dict,
    n_present: int | None = None,
) -> "ModelSummary":
    """Per-model slopes and verdict from the cells that finished (a failed cell leaves its seed's slope out).

    ``n_present``: classes present in the training labels (chance = 1/n_present; 10 when not given).
    A model whose mean net training accuracy is at chance at every width gets no trend claim."""
    widths = sorted({cl.width for cl in group}, key=list(config.widths).index)
    per_seed = []
    for s in config.seeds:
        mine = {cl.width: cl.distance_rms for cl in group if cl.seed == s}
        if all(w in mine for w in widths):
            per_seed.append(loglog_slope(widths, [mine[w] for w in widths]))
    dist_stats = [seed_stats([cl.distance_rms for cl in group if cl.width == w]) for w in widths]
    mean_dist = [st["mean"] for st in dist_stats]
    sd_dist = [st["std"] for st in dist_stats]
    mean_move = [seed_stats([cl.kernel_movement for cl in group if cl.width == w])["mean"] for w in widths]
    mean_init = [seed_stats([cl.kernel_init_error for cl in group if cl.width == w])["mean"] for w in widths]
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    ordered = [mean_dist[i] for i in order]
    monotone = all(b < a for a, b in zip(ordered, ordered[1:]))
    slope_stats = seed_stats(per_seed)
    # untrained rule: mean net train accuracy per width against chance + a few points
    n_train = int(ctx.Z.shape[0])
    c = n_present or 10
    chance, threshold = untrained_threshold(c, n_train)
    acc_by_width = {w: seed_stats([cl.net_train_acc for cl in group if cl.width == w])["mean"] for w in widths}
    untrained_by_width = {w: bool(math.isfinite(a) and a < threshold) for w, a in acc_by_width.items()}
    all_untrained = bool(untrained_by_width) and all(untrained_by_width.values())
    # at chance somewhere and fewer than two trained widths left: no trend to read at all
    too_few_trained = any(untrained_by_width.values()) and sum(not u for u in untrained_by_width.values()) < 2
    rising = increases_beyond_spread(widths, mean_dist, sd_dist)
    trend = trend_word(per_seed, monotone, widths=widths, means=mean_dist, sds=sd_dist, untrained=too_few_trained)
    _, lo, hi, _k = slope_interval(per_seed)
    first, last = widths[order[0]], widths[order[-1]]
    rel_last = seed_stats([cl.distance_rel for cl in group if cl.width == last])["mean"]
    if config.parametrization == "ntk":
        diag_name = "analytic NTK on the training set (width free, NTK parametrization)"
    else:
        diag_name = f"expected NTK at width {max(config.widths)} (standard parametrization)"
    return ModelSummary(
        model=arch,
        condition_number=ctx.spec_diag["condition_number"],
        numerical_rank=ctx.spec_diag["numerical_rank"],
        top_eig_share=ctx.spec_diag["top_eig_share"],
        mean_pairwise_cosine=mean_pairwise_cosine(ctx.Z),
        diagnostic_kernel=diag_name,
        lr_by_width={str(w): lr_by_width[w] for w in config.widths},
        slope_per_seed=per_seed,
        slope_mean=slope_stats["mean"],
        slope_std=slope_stats["std"],
        slope_of_mean=loglog_slope(widths, mean_dist),
        movement_slope=loglog_slope(widths, mean_move),
        init_error_slope=loglog_slope(widths, mean_init),
        monotone_decreasing=monotone,
        trend=trend,
        verdict=distance_verdict(
            MODEL_LABELS[arch],
            trend,
            slope_stats["mean"],
            slope_stats["std"],
            len(per_seed),
            rel_last,
            first,
            last,
            mean_dist[order[0]],
            mean_dist[order[-1]],
            interval=(lo, hi),
            rising=rising,
            untrained_widths=[w for w in widths if untrained_by_width[w]],
            train_acc=acc_by_width,
            chance=chance,
        ),
        slope_interval=[lo, hi],
        interval_rule=INTERVAL_RULE + "; " + MONOTONE_RULE,
        increases_beyond_spread=rising,
        train_acc_by_width={str(w): a for w, a in acc_by_width.items()},
        untrained_by_width={str(w): u for w, u in untrained_by_width.items()},
        untrained=all_untrained,
        chance=chance,
        untrained_threshold=threshold,
    )


@dataclass
class WidthTrend:
    """One measure against width: log-log least-squares slope per seed, mean ± sd (ddof 1), the
    seed-mean curve, whether it decreases at every width step, and the trend word of the
    2-layer sweep (falls / falls-non-monotone / rises / mixed / undetermined)."""

    measure: str
    slope_per_seed: list
    slope_mean: float
    slope_std: float
    mean_by_width: list
    monotone_decreasing: bool
    trend: str

    def to_dict(self) -> dict:
        return strict_json(asdict(self))


@dataclass
class ArchSummary:
    """Width trend of one architecture and its verdict.

    ``movement``: the kernel movement (full kernel, output-averaged with form=trace);
    ``kernel_distance``: 1 - cos(Theta_0, Theta_T), the change of the kernel's shape;
    ``distance``: the *relative* distance to the linearized model (the networks' output
    scale changes with width, so the absolute distance is scale-laden; its slope is
    ``distance_rms_slope``). ``approaches_kernel_regime``: all measured trends ``falls``.
    """

    arch: str
    movement: WidthTrend
    kernel_distance: WidthTrend
    distance: WidthTrend | None
    distance_rms_slope: float
    approaches_kernel_regime: bool
    verdict: str

    def to_dict(self) -> dict:
        return strict_json(
            {
                "arch": self.arch,
                "movement": self.movement.to_dict(),
                "kernel_distance": self.kernel_distance.to_dict(),
                "distance": None if self.distance is None else self.distance.to_dict(),
                "distance_rms_slope": self.distance_rms_slope,
                "approaches_kernel_regime": self.approaches_kernel_regime,
                "verdict": self.verdict,
            }
        )


def width_trend(
    measure: str,
    cells: Sequence[SeedCell],
    key: Callable[[Any], float],
    widths: Sequence[int],
    seeds: Sequence[int],
) -> WidthTrend:
    """The trend of ``key(cell)`` against width: per seed the log-log slope over its cells that did
    not diverge, the seed-mean curve, and the trend word (:func:`~.aggregate.trend_word`)."""
    ws = sorted(widths)
    slopes = []
    for sd in seeds:
        vals = [
            next((key(c) for c in cells if c.width == w and c.seed == sd and not c.diverged), float("nan")) for w in ws
        ]
        slopes.append(loglog_slope(ws, vals))
    by_width = [seed_stats([key(c) for c in cells if c.width == w and not c.diverged]) for w in ws]
    curve = [b["mean"] for b in by_width]
    sds = [b["std"] for b in by_width]
    mono = all(math.isfinite(x) and math.isfinite(y) and y < x for x, y in zip(curve, curve[1:]))
    st = seed_stats(slopes)
    # non-monotone only for a rise beyond the seed spread; a slope interval containing 0 is no trend
    return WidthTrend(
        measure, slopes, st["mean"], st["std"], curve, mono, trend_word(slopes, mono, widths=ws, means=curve, sds=sds)
    )


TREND_WORDS = {
    "falls": "falls (no rise between neighbouring widths beyond the seed spread)",
    "falls-non-monotone": "falls overall but rises between neighbouring widths by more than the seed spread",
    "rises": "rises",
    "mixed": "has no consistent trend (seed slopes differ in sign)",
    "no-clear-trend": "shows no clear trend (the slope interval includes 0)",
    "undetermined": "is undetermined (too few finite values)",
}


def arch_summary(
    arch: str, cells: Sequence[SeedCell], widths: Sequence[int], seeds: Sequence[int], measured_distance: bool
) -> ArchSummary:
    """One architecture's trends (kernel movement, kernel distance and, when ``measured_distance``,
    the relative distance to the linearized model) and its verdict; it approaches the kernel regime
    only when every trend falls over more than one seed."""
    ws = sorted(widths)
    k = len(seeds)
    movement = width_trend("kernel movement", cells, lambda c: c.headline, ws, seeds)
    shape = width_trend("kernel distance (1 - cos)", cells, lambda c: c.kernel_distance, ws, seeds)
    distance = (
        width_trend("relative distance to the linearized model", cells, lambda c: c.distance_rel, ws, seeds)
        if measured_distance
        else None
    )
    rms_slope = (
        seed_stats(width_trend("", cells, lambda c: c.distance_rms, ws, seeds).slope_per_seed)["mean"]
        if measured_distance
        else float("nan")
    )
    trends = [t for t in (movement, shape, distance) if t is not None]
    # one seed gives no interval: no kernel-regime claim from it
    approaches = k > 1 and all(t.trend == "falls" for t in trends)

    def spread(t: WidthTrend) -> str:
        if k <= 1:
            return f"{t.slope_mean:+.2f}, 1 seed (no interval)"
        _, lo, hi, _n = slope_interval(t.slope_per_seed)
        return f"{t.slope_mean:+.2f} ± {t.slope_std:.2f} over {k} seeds, interval [{lo:+.2f}, {hi:+.2f}]"

    def describe(t: WidthTrend, fmt: str = "{:.3g}") -> str:
        return (
            f"{t.measure} {TREND_WORDS.get(t.trend, t.trend)} (slope {spread(t)}; {fmt.format(t.mean_by_width[0])} at "
            f"width {ws[0]} -> {fmt.format(t.mean_by_width[-1])} at width {ws[-1]})"
        )

    parts = [describe(movement), describe(shape)]
    if distance is not None:
        parts.append(describe(distance, "{:.1%}"))
    text = f"{arch}: " + "; ".join(parts)
    if approaches:
        slowest = max(trends, key=lambda t: t.slope_mean)
        text += " — approaching the kernel regime as it widens"
        if slowest.slope_mean > KERNEL_RATE / 2:
            text += (
                f", but slowly: {slowest.measure} falls at less than half the m^{KERNEL_RATE} rate "
                f"(slope {slowest.slope_mean:+.2f}), and at width {ws[-1]} it is still {slowest.mean_by_width[-1]:.3g}"
            )
        text += "."
    elif k > 1 and any(t.trend == "rises" for t in trends):
        rising = ", ".join(t.measure for t in trends if t.trend == "rises")
        text += f" — moving away from the kernel regime as it widens ({rising} rises)."
    elif k <= 1:
        text += " — one seed gives no interval, so no claim about the kernel regime; rerun with more seeds."
    else:
        text += " — not clearly approaching the kernel regime at these widths."
    return ArchSummary(
        arch=arch,
        movement=movement,
        kernel_distance=shape,
        distance=distance,
        distance_rms_slope=rms_slope,
        approaches_kernel_regime=approaches,
        verdict=text,
    )
