"""The claims scorecard: the paper's claims as hypotheses, each tested by one documented run.

``attnaudit claims`` runs the analyses (as library requests stated by command lines, so every row has a
command line that reproduces it) and reads one verdict per claim. Every row states its
null hypothesis and the alternative (the claim), the boundary ``null_value`` between them
(the claim's minimum effect of interest, ``min_effect``), the interval it is read from
(method, confidence, the per-seed estimates behind it), its p-values (raw and
Holm-adjusted) and the warnings of the run it comes from. The verdict is

* **supported**: the claim's one-sided test rejects after Holm's adjustment across the
  scorecard's seed-based rows, and the 95 % interval lies entirely on the claim's side;
* **contradicted**: the same on the other side;
* **not resolved**: neither, or fewer than 3 seeds, or a blocking condition (failed seeds,
  the edge of stability, not a minimum); the row says how many seeds would resolve it;
* **not testable here**: the protocol cannot test it on these data (a model at chance,
  training losses too far apart to compare, a quantity beyond float64, no report), with why.

The tests hold for any seed distribution (:mod:`attnaudit.claims.decision`,
:mod:`attnaudit.core.stats`): betting tests for the bounded flip rates, the sign test of the
median seed for slopes and log ratios. A claim of "no effect" is an equivalence test (TOST)
against a stated margin. No threshold is tuned to make a claim come out; the simulated error
rates and coverage are in docs/findings.md (``benchmarks/power_claims.py``,
``benchmarks/bench_coverage.py``, which score synthetic reports through this module).

A second table runs the malleability comparison under protocol variants (eps, damping,
optimizer and loss, input scale, loss matching, the data split) so a reader sees which
conclusion survives which choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import numpy as np

from attnaudit.analyses.landscape.compare import EOS_SHARE
from attnaudit.claims.decision import SeedTest, adjust
from attnaudit.core.stats import (
    CONFIDENCE,
    CONTRADICTED,
    MIN_SEEDS,
    NOT_RESOLVED,
    NOT_TESTABLE,
    SUPPORTED,
    Interval,
    bounded_mean_interval,
    bounded_mean_p,
    bounded_ratio_interval,
    bounded_ratio_p,
    decide,
    median_interval,
    sign_p,
)
from attnaudit.report.envelope import Record

SCHEMA = "attnaudit.claims/3"
VERDICTS = (SUPPORTED, CONTRADICTED, NOT_RESOLVED, NOT_TESTABLE)
#: The NTK rows' minimum effect: a log-log slope of size 0.1 (a tenfold width changes the
#: distance by 21 %; the kernel regime's rate is -0.5). "Approaches" needs slope < -0.1; "does
#: not approach" is equivalence within +-0.1; "more slowly" a slope difference > 0.1.
SLOPE_MARGIN = 0.1
#: Minimum effect of every ratio claim (flip rates, sharpness, approximation errors): 5 %.
MIN_RATIO = 1.05
#: The paper compares the required width with the largest trained architectures, ~1e12
#: parameters: 1e24 (MNIST) and 1e29 (CIFAR-10) are "12-17 orders beyond".
REFERENCE_LOG10_WIDTH = 12.0
#: Landscape comparisons need training losses within 10 % of each other (landscape's own gate).
LANDSCAPE_LOSS_RATIO = 1.1

RULES = {
    "verdict": (
        "each seed-based row has two one-sided tests (the claim's side and the other side) at the row's minimum "
        "effect; p_value = 2 min of them; Holm adjusts p_value across the scorecard's seed-based rows; supported / "
        f"contradicted only when the adjusted p <= {1 - CONFIDENCE:.2g} on that side, the {int(100 * CONFIDENCE)} % "
        f"interval excludes null_value, and >= {MIN_SEEDS} seeds; raw_verdict is the reading before Holm"
    ),
    "intervals": (
        "flip rates, their ratio and attack-minus-control excess: betting tests and intervals for bounded means "
        "(Waudby-Smith & Ramdas), valid for any seed distribution and any correlation between models; a ratio "
        "whose denominator is 0 on every seed has no point estimate and its lower end comes from how large the "
        "denominator's mean could still be; slopes, log ratios and error ratios: the median seed, exact sign test "
        "and order-statistic interval (no 95 % interval below 6 seeds); kappa rows: deterministic computations "
        "with their float64 round-off bound"
    ),
    "min_effect": (
        f"ratios (flip rates, sharpness, approximation errors) >= {MIN_RATIO} (log ratio >= log {MIN_RATIO}); "
        f"slopes: approach means slope < -{SLOPE_MARGIN}, no approach means |slope| < {SLOPE_MARGIN} (TOST), "
        f"more slowly means a slope difference > {SLOPE_MARGIN}"
    ),
    "noise_control": (
        "attention is more malleable only when the ratio test and attention's paired attack-minus-noise test both "
        "reject (an intersection-union test: p = the larger of the two); a control that does not reject reads "
        "'not shown beyond noise'"
    ),
    "blocking": (
        "a model at chance (clean or perturbed), training losses too far apart: not testable here; failed seeds, "
        "the edge of stability, not a minimum: not resolved; diverged or chance-level NTK cells: their width is "
        "left out for every seed, visibly"
    ),
    "chance": "a model whose training accuracy is below 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n)) learned nothing; "
    "claims are read only from cells (model, width, seed) above it, each judged on its own accuracy; a width "
    "at which any seed is at chance or diverged is left out for every seed and the slopes are refitted over the "
    "other widths (at least 3); a sensitivity row keeps every width",
    "comparable": (
        "malleability ratios need the models' mean training losses within the run's loss-gap factor; "
        "landscape comparisons within 10 %, seed by seed"
    ),
}


@dataclass
class ClaimRow(Record):
    """One claim, the interval and tests it is read from, and its verdict."""

    claim: str
    paper: str
    null: str  # H0, in words
    alternative: str  # H1 = the claim, in words
    null_value: float | None
    measured: str
    value: float | None
    interval: list | None  # [lo, hi]; None for an unbounded end
    interval_method: str
    confidence: float
    n_seeds: int
    per_seed: list
    verdict: str
    why: str
    run: str
    command: str
    warnings: list = field(default_factory=list)
    min_effect: str = ""
    estimand: str = ""
    role: str = "claim"  # or "sensitivity": shown, not counted in the headline nor in Holm's family
    p_value: float | None = None
    p_adjusted: float | None = None
    raw_verdict: str = ""
    seeds_needed: int | None = None
    equivalence_margin: list | None = None
    controls: dict = field(default_factory=dict)
    test: SeedTest | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "test"}


@dataclass
class VariantRow(Record):
    variant: str
    options: str
    flip_relu: float | None
    flip_attn: float | None
    ratio: float | None
    interval: list | None
    interval_method: str
    n_seeds: int
    above_floor: dict
    losses_comparable: bool | None
    reading: str
    command: str
    warnings: list = field(default_factory=list)
    error: str | None = None


#: Variant readings that resolve the ordering (the headline's "reads the same" needs all variants among them).
RESOLVED_READINGS = ("attn more malleable", "relu more malleable")


@dataclass
class ClaimsResult:
    mode: str
    claims: list[ClaimRow]
    variants: list[VariantRow]
    runs: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    protocol: dict = field(default_factory=dict)

    def verdicts(self) -> list[str]:
        main = [c for c in self.claims if c.role == "claim"]
        counts = {v: sum(c.verdict == v for c in main) for v in VERDICTS}
        head = ", ".join(f"{n} {v}" for v, n in counts.items() if n) + " (Holm-adjusted)"
        robust = list(self.variants)  # a failed variant resolves nothing
        orders = {v.reading if v.error is None else "failed" for v in robust}
        if robust and len(orders) == 1 and orders <= set(RESOLVED_READINGS):
            tail = (
                f"; the malleability ordering reads the same under all {len(robust)} protocol variants ({orders.pop()})"
            )
        elif robust and orders <= set(RESOLVED_READINGS):
            tail = f"; the malleability reading changes across the {len(robust)} protocol variants"
        elif robust:
            resolved = sum(v.reading in RESOLVED_READINGS for v in robust)
            tail = f"; {resolved} of {len(robust)} malleability protocol variants resolve an ordering"
        else:
            tail = ""
        return [f"claims scorecard ({self.mode}): {head}{tail}"] + [
            f"{c.claim}: {c.verdict.upper()}: {c.why}" for c in self.claims
        ]

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "rules": RULES,
            "protocol": self.protocol,
            "claims": [c.to_dict() for c in self.claims],
            "protocol_variants": [v.to_dict() for v in self.variants],
            "runs": self.runs,
        }


# ----------------------------------------------------------------------------- helpers
def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}"


def _chance(acc: float | None, c: int | None, n: int | None) -> bool:
    """Whether a training accuracy is at chance by the rule in :data:`RULES` (unknown = not at chance)."""
    if acc is None or not c or not n:
        return False
    p = 1.0 / c
    return acc < p + max(0.05, 2 * math.sqrt(p * (1 - p) / n))


def _n_classes(results: dict) -> int:
    ds = results.get("dataset") or {}
    counts = ds.get("class_counts") or {}
    classes = ds.get("classes")
    if counts:
        return len(counts)
    if isinstance(classes, (list, tuple)) and classes:
        return len(classes)
    return int(results.get("n_classes") or ds.get("n_classes") or 10)


def _untestable(
    claim: str,
    paper: str,
    null: str,
    alternative: str,
    null_value: float | None,
    why: str,
    run: str,
    command: str,
    warnings: list,
    *,
    measured: str = "n/a",
    iv: Interval | None = None,
    **more: Any,
) -> ClaimRow:
    """A row this run cannot decide (:data:`NOT_TESTABLE`), saying ``why``; ``more``: as :func:`_row` takes."""
    return _row(
        claim, paper, null, alternative, null_value, measured, iv, NOT_TESTABLE, why, run, command, warnings, **more
    )


def _tested(
    claim: tuple[str, str, str, str, float],
    measured: str,
    test: SeedTest,
    run: str,
    command: str,
    warnings: list,
    untestable: str | None = None,
    **more: Any,
) -> ClaimRow:
    """The row of ``claim`` (its statement: the first arguments of :func:`_row`) read from ``test``
    (the unadjusted reading; :func:`score` applies Holm); not testable, saying ``untestable``, when given."""
    if untestable is not None:
        return _untestable(*claim, untestable, run, command, warnings, **more)
    verdict, reason = test.reading(test.p_value)
    why = "; ".join(x for x in (f"{test.estimand}: {reason}", test.context) if x)
    per_seed = more.pop("per_seed", test.units)
    row = _row(*claim, measured, test.interval, verdict, why, run, command, warnings, per_seed=per_seed, **more)
    row.test, row.p_value, row.raw_verdict, row.estimand = test, test.p_value, verdict, test.estimand
    return row


def _sides(null: float, claim_side: str) -> Callable[[Interval], bool | None]:
    """Whether an interval lies on the claim's side of ``null`` (True), the other side (False), or neither."""

    def inside(iv: Interval) -> bool | None:
        side = iv.side(null)
        return None if side == "straddles" else side == claim_side

    return inside


def median_test(values: list, null: float, claim_side: str, context: str = "") -> SeedTest:
    """The median seed against ``null`` by the exact sign test (claim: the median lies ``claim_side``)."""
    other = "below" if claim_side == "above" else "above"

    def recompute(u: np.ndarray) -> tuple[float, float]:
        return sign_p(u, null, claim_side), sign_p(u, null, other)

    return SeedTest(
        list(values), recompute, _sides(null, claim_side), median_interval(values), "median seed, sign test", context
    )


def equivalence_test(values: list, margin: float, context: str = "") -> SeedTest:
    """TOST for the median seed inside (-margin, margin): the claim's p is the larger of the two
    one-sided sign tests; the other side's, the smaller of the tests for lying below -margin or
    above +margin (disjoint alternatives, so no correction is needed)."""

    def recompute(u: np.ndarray) -> tuple[float, float]:
        claim = max(sign_p(u, -margin, "above"), sign_p(u, margin, "below"))
        other = min(sign_p(u, -margin, "below"), sign_p(u, margin, "above"))
        return claim, other

    def inside(iv: Interval) -> bool | None:
        if iv.lo() > -margin and iv.hi() < margin:
            return True
        if iv.hi() < -margin or iv.lo() > margin:
            return False
        return None

    return SeedTest(list(values), recompute, inside, median_interval(values), "median seed, TOST (sign tests)", context)


def _row(
    claim: str,
    paper: str,
    null: str,
    alternative: str,
    null_value: float | None,
    measured: str,
    iv: Interval | None,
    verdict: str,
    why: str,
    run: str,
    command: str,
    warnings: list,
    per_seed: list | None = None,
    value: float | None = None,
    n_seeds: int | None = None,
    **more: Any,
) -> ClaimRow:
    return ClaimRow(
        claim=claim,
        paper=paper,
        null=null,
        alternative=alternative,
        null_value=null_value,
        measured=measured,
        value=value if value is not None else (None if iv is None else iv.estimate),
        interval=None if iv is None else iv.bounds,
        interval_method="none" if iv is None else iv.method,
        confidence=CONFIDENCE if iv is None else iv.confidence,
        n_seeds=(0 if iv is None else iv.n) if n_seeds is None else n_seeds,
        per_seed=list(per_seed or []),
        verdict=verdict,
        why=why,
        run=run,
        command=command,
        warnings=list(warnings),
        **more,
    )


def _block(row: ClaimRow, why: str, verdict: str = NOT_RESOLVED) -> ClaimRow:
    """A blocking condition: the row gives no verdict (and leaves Holm's family), saying why."""
    row.test, row.p_value, row.verdict, row.raw_verdict = None, None, verdict, verdict
    row.why = f"blocked: {why}"
    return row


def _run_warnings(report: dict) -> list[str]:
    return [str(w) for w in report.get("warnings") or []]


# ----------------------------------------------------------------------------- kappa
def claim_kappa(report: dict, command: str) -> list[ClaimRow]:
    r = report["results"]
    warns = _run_warnings(report)
    amp = r.get("amplification_check") or {}
    gram = r.get("gram") or {}
    deficient = bool(gram.get("rank_deficient"))
    rank_note = (
        f"G is numerically rank deficient (rank {gram.get('numerical_rank')} of min(n, d) = "
        f"{gram.get('min_n_d')}): kappa_d(G) is infinite and every finite number here is read at the numerical "
        "rank"
        if deficient
        else ""
    )
    row_warns = warns + ([rank_note] if rank_note else [])
    rows = []
    verdict_raw = amp.get("verdict")
    rel, budget = amp.get("relative_error"), amp.get("error_budget")
    det = "deterministic (float64 measurement against its calibrated round-off budget)"
    name = "kappa(G~) = kappa(G)^3 (linearized attention cubes the condition number)"
    paper = "exact identity for f_att(X) = X X^T X"
    null = "the directly measured kappa(G~) differs from kappa(G)^3 by more than float64 round-off explains"
    alt = "the measured kappa(G~) equals kappa(G)^3 within the round-off budget"
    measured = f"log10 kappa^3 = {_fmt(amp.get('log10_predicted_kappa_cubed'))}; relative error {_fmt(rel)} (budget {_fmt(budget)})"
    if verdict_raw in ("verified", "mismatch") and rel is not None:
        iv = Interval(rel, rel, rel, det, CONFIDENCE, 0)
        verdict = SUPPORTED if verdict_raw == "verified" else CONTRADICTED
        why = (
            f"measured directly: relative error {_fmt(rel)} {'within' if verdict == SUPPORTED else 'beyond'} the "
            f"calibrated round-off budget {_fmt(budget)}"
        )
        rows.append(
            _row(name, paper, null, alt, budget, measured, iv, verdict, why, "kappa", command, row_warns, n_seeds=0)
        )
    else:
        why = (
            f"kappa^3 = {_fmt(amp.get('predicted_kappa_cubed'))} is beyond what a float64 measurement of G~ resolves "
            "(calibrated budget), so the identity is not measured directly here; it is exact algebra (top "
            f"eigenvalue agrees to {_fmt(amp.get('top_eigenvalue_relative_error'))})"
        )
        rows.append(
            _untestable(
                name,
                paper,
                null,
                alt,
                budget,
                why,
                "kappa",
                command,
                row_warns,
                measured=measured,
                value=amp.get("log10_predicted_kappa_cubed"),
                n_seeds=0,
            )
        )
    rows.append(_width_row(r, command, row_warns, deficient))
    return rows


def _width_row(r: dict, command: str, warns: list, deficient: bool) -> ClaimRow:
    ref = (r.get("reference_width") or {}).get("log10", REFERENCE_LOG10_WIDTH)
    name = "the width linearized attention needs, m = Omega(kappa_d(G)^6 n log n), is beyond any trainable width"
    paper = "m >> 1e24 on MNIST, >> 1e29 on CIFAR-10: 12-17 orders beyond the largest architectures (~1e12)"
    null = f"log10 m <= {ref:g} (a width within reach of the largest trained models)"
    alt = f"log10 m > {ref:g}"
    rows = r.get("width_estimates") or []
    basis = "numerical_rank" if deficient else "kappa_d"
    w = next((x for x in rows if x.get("basis") == basis), None) or (rows[-1] if rows else None)
    if w is None or w.get("log10_required_width") is None:
        return _untestable(
            name,
            paper,
            null,
            alt,
            ref,
            "the width requirement is undefined here (no finite condition number)",
            "kappa",
            command,
            warns,
            n_seeds=0,
        )
    val = float(w["log10_required_width"])
    lo, hi = w.get("log10_interval") or [val, val]
    iv = Interval(val, lo, hi, w.get("interval_method") or "float64 round-off bound", CONFIDENCE, 0)
    verdict, reason = decide(iv, ref, "above", 0, seed_based=False)
    where = (
        f"at the numerical rank {w.get('rank')} (kappa_d itself is infinite: G is rank deficient, so the formula "
        "at min(n, d) asks for an infinite width)"
        if deficient
        else "at kappa_d"
    )
    others = "; ".join(
        f"{x.get('label') or x.get('basis')}: log10 m = {_fmt(x.get('log10_required_width'))}"
        for x in rows
        if x is not w
    )
    why = (
        f"computed, not measured: log10 m = {val:.1f} {where} with the Omega constant taken as 1, "
        f"{val - ref:.1f} orders beyond 1e{ref:g}; {reason}"
    )
    return _row(
        name,
        paper,
        null,
        alt,
        ref,
        f"log10 m = {_fmt(val)} ({w.get('label')})" + (f"; rank-tolerance sensitivity: {others}" if others else ""),
        iv,
        verdict,
        why,
        "kappa",
        command,
        warns,
        n_seeds=0,
        estimand="computed: kappa_d(G)^6 n ln n, Omega constant omitted",
    )


# ----------------------------------------------------------------------------- ntk-distance
#: Fewest widths a per-seed log-log slope is fitted over once excluded widths are left out.
MIN_SLOPE_WIDTHS = 3


def _loglog_slope(widths: list, values: list) -> float:
    """Least-squares slope of log(value) on log(width) (ntk-distance's per-seed slope)."""
    xs = [math.log(w) for w in widths]
    ys = [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _excluded(r: dict, cell: dict, keep_chance: bool) -> str | None:
    """Why a cell is left out (diverged always; at chance unless ``keep_chance``), else None."""
    if cell.get("diverged"):
        return "diverged"
    if not keep_chance and _chance(cell.get("net_train_acc"), r.get("n_classes"), r.get("n_train")):
        return f"at chance ({100 * (cell.get('net_train_acc') or 0):.0f} %)"
    return None


def _slopes(
    r: dict, arch: str, drop: frozenset = frozenset(), keep_chance: bool = False
) -> tuple[list, list, list, list]:
    """(seeds, per-seed slopes, excluded cells as (cell, why), widths used) of one model.

    Every cell (model, width, seed) is judged on its own: a width at which any seed diverged
    or (unless ``keep_chance``) trained to chance is left out *for every seed*, so all slopes
    span the same widths and no seed is chosen by its outcome; the slopes are refitted over the
    remaining widths (at least :data:`MIN_SLOPE_WIDTHS`, else no slope). With nothing left out
    they are the run's own. ``drop``: widths to leave out as well (a paired comparison uses the
    widths both models keep)."""
    seeds = list((r.get("config") or {}).get("seeds") or [])
    cells = [x for x in r.get("cells") or [] if x.get("model") == arch]
    excluded = [(x, why) for x in cells if (why := _excluded(r, x, keep_chance)) is not None]
    dropped = {x.get("width") for x, _ in excluded} | set(drop)
    widths = sorted({x.get("width") for x in cells} - dropped)
    if not dropped and not keep_chance:
        slopes = list(((r.get("models") or {}).get(arch) or {}).get("slope_per_seed") or [])
        if len(seeds) == len(slopes):
            keep = [(s, v) for s, v in zip(seeds, slopes) if v is not None and math.isfinite(v)]
            return [s for s, _ in keep], [v for _, v in keep], [], widths
    if len(widths) < MIN_SLOPE_WIDTHS:
        return [], [], excluded, widths
    out_seeds, out = [], []
    for s in seeds:
        mine = {x.get("width"): x.get("distance_rms") for x in cells if x.get("seed") == s}
        vals = [mine.get(w) for w in widths]
        if all(v is not None and math.isfinite(v) and v > 0 for v in vals):
            out_seeds.append(s)
            out.append(_loglog_slope(widths, vals))
    return out_seeds, out, excluded, widths


def _over(excluded: list, widths: list) -> str:
    """ ", widths a, b, c" when widths were left out (the slopes span only these), else ""."""
    return f", widths {', '.join(map(str, widths))}" if excluded else ""


def _excluded_text(arch: str, excluded: list, widths: list) -> str:
    dropped = sorted({x.get("width") for x, _ in excluded})
    return (
        f"{len(excluded)} {arch} cell(s) left out: "
        + ", ".join(f"width {x.get('width')} seed {x.get('seed')} {why}" for x, why in excluded[:6])
        + f"; width(s) {', '.join(map(str, dropped))} left out for every seed"
        + (
            f", slopes refitted over widths {', '.join(map(str, widths))}"
            if len(widths) >= MIN_SLOPE_WIDTHS
            else f", too few widths left (fewer than {MIN_SLOPE_WIDTHS}) for a slope"
        )
    )


def claim_ntk(report: dict, command: str, slope_margin: float = SLOPE_MARGIN) -> list[ClaimRow]:
    r = report["results"]
    warns = _run_warnings(report)
    rows = []
    d = slope_margin
    rs, rv, rex, rwidths = _slopes(r, "relu")
    as_, av, aex, awidths = _slopes(r, "attn")
    n_total = len((r.get("config") or {}).get("seeds") or [])
    # 1. 2L-ReLU approaches its predictor (by at least the minimum effect)
    w1 = warns + ([_excluded_text("relu", rex, rwidths)] if rex else [])
    t1 = median_test(rv, -d, "below")
    name = "2L-ReLU approaches its NTK predictor as width grows"
    null, alt = f"the median seed's log-log slope >= -{d:g} (no approach)", f"slope < -{d:g} (the distance falls)"
    untestable = (
        None
        if rv
        else f"fewer than {MIN_SLOPE_WIDTHS} widths where every seed of 2L-ReLU trained above chance without diverging"
        if rex
        else "no finished cells for 2L-ReLU"
    )
    claim = (name, "distance falls monotonically with width", null, alt, -d)
    measured = f"median slope {t1.interval.text()} over {t1.n} of {n_total} seeds{_over(rex, rwidths)} (kernel regime about -0.5)"
    rows.append(_tested(claim, measured, t1, "ntk", command, w1, untestable, min_effect=f"slope < -{d:g}"))
    # 2. MLP-Attn does not approach: equivalence within +-margin (TOST), and the same keeping every width
    w2 = warns + ([_excluded_text("attn", aex, awidths)] if aex else [])
    name = (
        "MLP-Attn does not approach its NTK predictor: its distance stays flat in width (non-convergent NTK dynamics)"
    )
    null = f"|median slope| >= {d:g} (it approaches, or moves away, at a non-negligible rate)"
    alt = f"-{d:g} < slope < {d:g} (equivalence: neither falls nor rises by more than the margin)"
    for sens in (False, True):
        seeds_, vals, ex, widths = (as_, av, aex, awidths) if not sens else _slopes(r, "attn", keep_chance=True)
        t2 = equivalence_test(vals, d)
        untestable = (
            None
            if vals
            else f"fewer than {MIN_SLOPE_WIDTHS} widths where every seed of MLP-Attn trained above chance without "
            "diverging (a flat distance of a model that learned nothing is no evidence)"
            if ex
            else "no finished cells for MLP-Attn"
        )
        label = name if not sens else name + " [sensitivity: every width kept, chance-level cells included]"
        claim = (label, "non-monotone on MNIST, rising on CIFAR-10", null, alt, -d)
        measured = f"median slope {t2.interval.text()} over {t2.n} of {n_total} seeds{_over(ex, widths)}"
        wr = warns + ([_excluded_text("attn", ex, widths)] if ex else []) if sens else w2
        rows.append(
            _tested(
                claim,
                measured,
                t2,
                "ntk",
                command,
                wr,
                untestable,
                min_effect=f"|slope| < {d:g}",
                equivalence_margin=[-d, d],
                role="sensitivity" if sens else "claim",
            )
        )
    # 3. attention approaches more slowly than ReLU (paired by seed, over the widths both keep)
    both_drop = frozenset({x.get("width") for x, _ in rex + aex})
    if both_drop:
        rs, rv, _, _ = _slopes(r, "relu", both_drop)
        as_, av, _, _ = _slopes(r, "attn", both_drop)
    common = sorted(set(rs) & set(as_))
    per_seed = [av[as_.index(s)] - rv[rs.index(s)] for s in common]
    t3 = median_test(per_seed, d, "above")
    name = "MLP-Attn approaches its NTK predictor more slowly than 2L-ReLU"
    null, alt = f"slope(attn) - slope(relu) <= {d:g}", f"slope(attn) - slope(relu) > {d:g}"
    untestable = (
        None if common else f"fewer than {MIN_SLOPE_WIDTHS} widths where both models trained above chance in every seed"
    )
    claim = (name, "attention stays farther from its kernel regime", null, alt, d)
    measured = f"median slope difference {t3.interval.text()} over {t3.n} paired seeds" + (
        f", widths {', '.join(map(str, sorted({x.get('width') for x in r.get('cells') or []} - both_drop)))}"
        if both_drop
        else ""
    )
    w3 = w1 + [w for w in w2 if w not in w1]
    rows.append(_tested(claim, measured, t3, "ntk", command, w3, untestable, min_effect=f"difference > {d:g}"))
    return rows


# ----------------------------------------------------------------------------- malleability
def _main_cell(r: dict) -> tuple[str, float] | None:
    cfg = r.get("config") or {}
    attack = next((a for a in cfg.get("attacks") or [] if a not in ("none", "random", "sign")), None)
    eps = (cfg.get("eps") or [None])[0]
    return (attack, eps) if attack is not None else None


def _control_values(r: dict, row: dict | None, seeds: list) -> tuple[str, list] | None:
    """(control name, per-seed flip rates of the random-noise control paired with ``seeds``) for
    a summary row, from the control's own summary row (same model, eps and damping)."""
    floors = (row or {}).get("floors") or {}
    floor = floors.get("sign") or floors.get("random")
    if floor is None:
        return None
    name = floor.get("attack") or ("sign" if "sign" in floors else "random")
    for other in r.get("summary") or []:
        if (
            other.get("model") == row.get("model")  # type: ignore[union-attr]
            and other.get("attack") == name
            and other.get("damping") == row.get("damping")  # type: ignore[union-attr]
            and other.get("eps") is not None
            and math.isclose(float(other["eps"]), float(row["eps"]))  # type: ignore[index]
        ):
            by_seed = dict(zip(other.get("seeds") or [], (other.get("flip_rate") or {}).get("values") or []))
            return name, [by_seed.get(s) for s in seeds]
    return None


def _malleability_numbers(report: dict) -> dict:
    r = report["results"]
    cell = _main_cell(r)
    if cell is None:
        return {"error": "no adversarial attack in the run"}
    attack, eps = cell
    damping = ((r.get("config") or {}).get("damping") or [None])[0]

    def match(row):
        return (
            row.get("attack") == attack
            and row.get("eps") is not None
            and eps is not None
            and math.isclose(float(row["eps"]), float(eps))
            and row.get("damping") == damping
        )

    flips = {row["model"]: row for row in r.get("summary") or [] if match(row)}
    ratio = next(
        (
            row
            for row in r.get("ratios") or []
            if match(row) and row.get("numerator") == "attn" and row.get("denominator") == "relu"
        ),
        None,
    )
    n, c = r.get("n_train"), _n_classes(r)
    at_chance = []  # each training judged on its own accuracy, clean and perturbed
    for row in r.get("training") or []:
        if row.get("role") in ("clean", "perturbed") and _chance(row.get("train_accuracy"), c, n or 0):
            at_chance.append(
                f"{row['model']} seed {row.get('seed')} {row.get('role')} ({100 * row['train_accuracy']:.0f} %)"
            )
    top_k = (r.get("config") or {}).get("top_k")
    return {
        "attack": attack,
        "eps": eps,
        "damping": damping,
        "flips": flips,
        "ratio": ratio,
        "at_chance": at_chance,
        "top_k": top_k,
        "failed": list(r.get("failed_cells") or []),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g} %"


def malleability_test(nums: dict) -> tuple[SeedTest | None, dict]:
    """The ratio row's test and its controls, from the per-seed rates the run recorded.

    Units per seed: (attn, relu, attn's noise control, relu's noise control). Claim side: the
    betting test of E[attn] / E[relu] > :data:`MIN_RATIO` AND attention's paired attack-minus-
    control excess > 0 (intersection-union: p = the larger); other side: the ratio < MIN_RATIO
    AND relu's excess > 0."""
    ratio = nums["ratio"] or {}
    a, b = ratio.get("numerator_values"), ratio.get("denominator_values")
    if a is None or b is None:  # a report from before the per-seed values were recorded
        fa = (nums["flips"].get("attn") or {}).get("flip_rate", {}).get("values")
        fr = (nums["flips"].get("relu") or {}).get("flip_rate", {}).get("values")
        if fa is None or fr is None or len(fa) != len(fr):
            return None, {}
        a, b = fa, fr
    ctrl = {m: (nums.get("controls") or {}).get(m) for m in ("attn", "relu")}
    ca = (ctrl.get("attn") or (None, [None] * len(a)))[1]
    cb = (ctrl.get("relu") or (None, [None] * len(a)))[1]
    nan = float("nan")
    units = [
        (float(x), float(y), nan if u is None else float(u), nan if v is None else float(v))
        for x, y, u, v in zip(a, b, ca, cb)
        if x is not None and y is not None
    ]

    def excess_p(att: np.ndarray, con: np.ndarray) -> float:
        ok = np.isfinite(con)
        return bounded_mean_p(att[ok] - con[ok], 0.0, "above", -1.0, 1.0) if ok.any() else 1.0

    def recompute(u: np.ndarray) -> tuple[float, float]:
        u = np.atleast_2d(u)
        pa = bounded_ratio_p(u[:, 0], u[:, 1], MIN_RATIO, "above")
        pb = bounded_ratio_p(u[:, 0], u[:, 1], MIN_RATIO, "below")
        return max(pa, excess_p(u[:, 0], u[:, 2])), max(pb, excess_p(u[:, 1], u[:, 3]))

    controls: dict = {}
    arr = np.array(units, dtype=float).reshape(-1, 4)
    for j, m in ((0, "attn"), (1, "relu")):
        got = ctrl.get(m)
        if got is None:
            controls[m] = {"control": None, "reading": "no noise control in the run"}
            continue
        ok = np.isfinite(arr[:, 2 + j])
        diffs = (arr[ok, j] - arr[ok, 2 + j]).tolist()
        iv = bounded_mean_interval(diffs, -1.0, 1.0)
        p = excess_p(arr[:, j], arr[:, 2 + j])
        controls[m] = {
            "control": got[0],
            "estimand": "E[attack flip rate - control flip rate], paired by seed",
            "excess": iv.estimate,
            "interval": iv.bounds,
            "interval_method": iv.method,
            "p_value": p,
            "per_seed": diffs,
            "reading": "beyond noise" if p <= (1 - CONFIDENCE) / 2 else "not shown beyond noise",
        }
    iv = bounded_ratio_interval(arr[:, 0].tolist(), arr[:, 1].tolist())
    context = []
    if iv.estimate is None and len(units):
        context.append(
            "relu flipped on no seed: the ratio has no point estimate; its lower end comes from how large relu's mean "
            "flip rate could still be given its seeds (inside the paired betting test), never from a plug-in 0"
        )
    for m in ("attn", "relu"):
        c = controls[m]
        if c.get("control"):
            context.append(
                f"{m}'s attack minus its {c['control']}-noise control: {_fmt(c['excess'])} "
                f"[{_fmt((c['interval'] or [None])[0])}, {_fmt((c['interval'] or [None, None])[1])}], {c['reading']}"
            )
    test = SeedTest(
        [list(x) for x in units],
        recompute,
        _sides(MIN_RATIO, "above"),
        iv,
        "ratio of mean flip rates (betting, paired) with the noise control",
        "; ".join(context),
    )
    return test, controls


def claim_malleability(report: dict, command: str) -> ClaimRow:
    nums = _malleability_numbers(report)
    warns = _run_warnings(report)
    name = "attention is more malleable: attn / relu flip-rate ratio > 1"
    paper = "MNIST PGD eps 0.3: MLP-Attn 28.9 %, 2L-ReLU 3.3 %; 2-9x overall"
    null = f"E[attn flip rate] / E[relu flip rate] <= {MIN_RATIO:g}, or attn's attack not beyond its noise control"
    alt = f"ratio > {MIN_RATIO:g}, and attn's attack beats its paired random-noise control"
    claim = (name, paper, null, alt, MIN_RATIO)  # what is tested: the first arguments of every row below
    more: dict[str, Any] = {"min_effect": f"ratio > {MIN_RATIO:g}"}
    if "error" in nums:
        return _untestable(*claim, nums["error"], "malleability", command, warns, **more)
    r = report["results"]
    nums["controls"] = {}
    seeds_of = (nums["ratio"] or {}).get("seeds") or (nums["flips"].get("attn") or {}).get("seeds")
    for m in ("attn", "relu"):
        row = nums["flips"].get(m)
        seeds = (row or {}).get("seeds") or seeds_of or []
        nums["controls"][m] = _control_values(r, row, list(seeds_of or seeds)) if row else None
    test, controls = malleability_test(nums)
    fr = {m: (nums["flips"].get(m) or {}).get("flip_rate", {}).get("mean") for m in ("relu", "attn")}
    measured = (
        f"{nums['attack']} eps {nums['eps']}: attn {_fmt(fr['attn'])}, relu {_fmt(fr['relu'])}, ratio "
        f"{'n/a' if test is None else test.interval.text()}"
    )
    more["controls"] = controls
    gate = (nums["ratio"] or {}).get("loss_gate") or {}
    why = None
    if nums["at_chance"]:
        why = f"trained to chance accuracy: {', '.join(nums['at_chance'][:6])}"
    elif gate.get("comparable") is False:
        why = (
            f"the models' mean training losses ({_fmt(gate.get('numerator_loss'))} attn vs "
            f"{_fmt(gate.get('denominator_loss'))} relu) differ by more than {gate.get('factor')}x: the ratio "
            "compares two training outcomes; rerun with --match-loss"
        )
    keys = ("attn", "relu", "attn_control", "relu_control")
    per = [] if test is None else [{k: (None if math.isnan(v) else v) for k, v in zip(keys, u)} for u in test.units]
    if why is not None:
        iv = None if test is None else test.interval
        return _untestable(*claim, why, "malleability", command, warns, measured=measured, iv=iv, per_seed=per, **more)
    if test is None:
        return _row(
            *claim,
            measured,
            None,
            NOT_RESOLVED,
            "no per-seed flip rates to test",
            "malleability",
            command,
            warns,
            **more,
        )
    more["per_seed"] = per
    row = _tested(claim, measured, test, "malleability", command, warns, **more)
    if nums["failed"]:
        cells = "; ".join(str(f.get("cell", f)) if isinstance(f, dict) else str(f) for f in nums["failed"][:3])
        _block(
            row,
            f"{len(nums['failed'])} cell(s) failed ({cells}); the seeds that finished are not a sample the "
            "protocol chose, so no verdict; rerun the failed seeds",
        )
    return row


# ----------------------------------------------------------------------------- landscape
def _landscape_pairs(r: dict) -> tuple[list[dict], list[str]]:
    """Per seed: relu's and attn's lambda_max and trace, kept only where both trained above
    chance and their training losses are within 10 % (why each seed was left out)."""
    models = r.get("models") or {}
    c = _n_classes(r)
    recs = {}
    for m in ("relu", "attn"):
        entry = models.get(m) or {}
        vals = ((entry.get("seeds") or {}).get("values")) or [
            {
                "seed": 0,
                "loss": entry.get("loss"),
                "accuracy": entry.get("accuracy"),
                "lambda_max": ((entry.get("top_eigenvalues") or {}).get("eigenvalues") or [None])[0],
                "top_eigenvalues": (entry.get("top_eigenvalues") or {}).get("eigenvalues"),
                "trace": (entry.get("trace") or {}).get("estimate"),
                "trace_stderr": (entry.get("trace") or {}).get("stderr"),
            }
        ]
        recs[m] = {v.get("seed"): (v, entry.get("n_samples")) for v in vals}
    pairs, dropped = [], []
    for s in sorted(set(recs.get("relu", {})) & set(recs.get("attn", {})), key=lambda x: (x is None, x)):
        (vr, n), (va, _) = recs["relu"][s], recs["attn"][s]
        chance = [m for m, v in (("relu", vr), ("attn", va)) if _chance(v.get("accuracy"), c, n)]
        if chance:
            dropped.append(f"seed {s}: {', '.join(chance)} at chance accuracy")
            continue
        lr_, la = vr.get("loss"), va.get("loss")
        if lr_ is None or la is None or min(lr_, la) <= 0 or max(lr_, la) / min(lr_, la) > LANDSCAPE_LOSS_RATIO:
            dropped.append(
                f"seed {s}: training losses {_fmt(lr_)} (relu) vs {_fmt(la)} (attn) differ by more than 10 %"
            )
            continue
        pairs.append({"seed": s, "relu": vr, "attn": va})
    return pairs, dropped


def _landscape_blocks(r: dict, pairs: list[dict], warns: list[str]) -> list[str]:
    """Why no sharpness verdict can be read: a seed at GD's edge of stability (lambda_max >= EOS_SHARE x
    2 / lr: the optimiser, not the model, sets the sharpness), or not at a minimum (the top
    eigenvalues exceed the trace by more than 3 standard errors, or a trace <= 0)."""
    out = []
    bound = r.get("gd_stability_bound")
    for p in pairs:
        for m in ("relu", "attn"):
            v = p[m]
            lam, tr = v.get("lambda_max"), v.get("trace")
            b = bound.get(m) if isinstance(bound, dict) else bound
            if b and lam is not None and lam >= EOS_SHARE * b:
                out.append(f"seed {p['seed']} {m}: edge of stability (lambda_max {lam:.3g} >= {EOS_SHARE:g} x 2/lr)")
            top = [x for x in v.get("top_eigenvalues") or [] if x is not None]
            se = v.get("trace_stderr") or 0.0
            if tr is not None and (tr <= 0 or (top and sum(top) > tr + 3 * se)):
                out.append(f"seed {p['seed']} {m}: not a minimum (top eigenvalues {sum(top):.3g} vs trace {tr:.3g})")
    for w in warns:
        if "edge of stability" in w or "not a minimum" in w:
            out.append(w)
    return out


def claim_landscape(report: dict, command: str) -> list[ClaimRow]:
    r = report["results"]
    warns = _run_warnings(report)
    paper = "2L-ReLU sharp, narrow minima; MLP-Attn wider, flatter basins"
    models = r.get("models") or {}
    names = (
        "2L-ReLU ends in sharper minima than MLP-Attn: higher top Hessian eigenvalue",
        "2L-ReLU ends in sharper minima than MLP-Attn: higher Hessian trace",
    )
    lm = math.log(MIN_RATIO)
    nulls = (
        (f"median seed's log(lambda_max relu / attn) <= log {MIN_RATIO:g}", f"log ratio > log {MIN_RATIO:g}"),
        (f"median seed's log(trace relu / trace attn) <= log {MIN_RATIO:g}", f"log ratio > log {MIN_RATIO:g}"),
    )
    more: dict[str, Any] = {"min_effect": f"ratio > {MIN_RATIO:g}"}
    if models.get("relu") is None or models.get("attn") is None:
        return [
            _untestable(n, paper, h0, h1, lm, "the run did not train both models", "landscape", command, warns, **more)
            for n, (h0, h1) in zip(names, nulls)
        ]
    pairs, dropped = _landscape_pairs(r)
    row_warns = warns + [f"left out of the comparison: {d}" for d in dropped]
    no_pairs = (
        "no seed where both models trained above chance to training losses within 10 % of each "
        "other (sharpness at different losses is not comparable; rerun with --match-loss)"
        + (f": {'; '.join(dropped[:3])}" if dropped else "")
    )
    blocks = _landscape_blocks(r, pairs, warns)
    out = []
    for name, (h0, h1), key in zip(names, nulls, ("lambda_max", "trace")):
        claim = (name, paper, h0, h1, lm)
        if not pairs:
            out.append(_untestable(*claim, no_pairs, "landscape", command, row_warns, **more))
            continue
        per = [
            math.log(p["relu"][key] / p["attn"][key])
            for p in pairs
            if (p["relu"].get(key) or 0) > 0 and (p["attn"].get(key) or 0) > 0
        ]
        t = median_test(per, lm, "above")
        measured = (
            f"log({key} relu / attn) {t.interval.text()} (median ratio "
            f"{_fmt(math.exp(t.interval.estimate)) if t.interval.estimate is not None else 'n/a'}) over {t.n} seeds"
        )
        row = _tested(claim, measured, t, "landscape", command, row_warns, **more)
        if blocks:
            _block(row, "; ".join(blocks[:4]) + ": sharpness there reflects the optimiser, not the minimum's shape")
        out.append(row)
    return out


# ----------------------------------------------------------------------------- the dual implication
#: The alignment rows read (quantity, target): ln(err_relu / err_attn) per seed of kernel ridge
#: regression; > 0: MLP-Attn has the lower error, as a factor.
ALIGNMENT_ROWS = (
    (
        "kernel_log_error_ratio_attn_contrast",
        "principal-random",
        "attention's kernel advantage is larger on principal-direction targets than on random-direction ones",
        "the median seed's ln(err_relu / err_attn) on principal minus on random targets",
    ),
    (
        "kernel_log_error_ratio_attn",
        "principal",
        "on principal-direction targets MLP-Attn's kernel has the lower approximation error",
        "the median seed's ln(err_relu / err_attn) on principal-direction targets",
    ),
    (
        "kernel_log_error_ratio_attn",
        "labels",
        "on the real labels MLP-Attn's kernel has the lower approximation error",
        "the median seed's ln(err_relu / err_attn) on the real labels",
    ),
)


def claim_alignment(report: dict, command: str) -> list[ClaimRow]:
    """The paper's other half: the data-dependent kernel lowers the approximation error on
    targets aligned with the data's principal modes (more than on other targets), by at least
    the minimum effect (a factor :data:`MIN_RATIO`)."""
    r = report["results"]
    warns = _run_warnings(report)
    paper = "the same data-dependent kernel reduces approximation error when the target aligns with the principal modes"
    lm = math.log(MIN_RATIO)
    table = {
        (row.get("quantity"), row.get("target")): row for row in (r.get("summary") or []) + (r.get("contrast") or [])
    }
    out = []
    for quantity, target, name, what in ALIGNMENT_ROWS:
        claim = (name, paper, f"{what} <= log {MIN_RATIO:g}", f"{what} > log {MIN_RATIO:g}", lm)
        more: dict[str, Any] = {"min_effect": f"error ratio > {MIN_RATIO:g}"}
        row = table.get((quantity, target))
        if row is None:
            why = f"the run reported no {quantity} row for target {target}"
            out.append(_untestable(*claim, why, "alignment", command, warns, **more))
            continue
        per = [v for v in row.get("per_seed") or [] if v is not None]
        t = median_test(per, lm, "above")
        measured = f"{quantity} ({target}): {t.interval.text()} over {t.n} seeds"
        out.append(_tested(claim, measured, t, "alignment", command, warns + list(row.get("warnings") or []), **more))
    return out


# ----------------------------------------------------------------------------- variants and scoring
def variant_row(name: str, report: dict | None, command: str, error: str | None) -> VariantRow:
    """The malleability comparison under one protocol variant, read with the claim row's own tests
    (unadjusted: the variants are a sensitivity table, not claims)."""
    if report is None:
        return VariantRow(
            name, command.split(" --seed ")[-1], None, None, None, None, "none", 0, {}, None, "n/a", command, [], error
        )
    warns = _run_warnings(report)
    row = claim_malleability(report, command)
    nums = _malleability_numbers(report)
    if "error" in nums:
        return VariantRow(name, "", None, None, None, None, "none", 0, {}, None, "n/a", command, warns, nums["error"])
    fr = {m: (nums["flips"].get(m) or {}).get("flip_rate", {}).get("mean") for m in ("relu", "attn")}
    above = {
        m: None if not row.controls.get(m, {}).get("control") else row.controls[m]["reading"] == "beyond noise"
        for m in ("relu", "attn")
    }
    comparable = ((nums["ratio"] or {}).get("loss_gate") or {}).get("comparable")
    t = row.test
    level = (1 - CONFIDENCE) / 2
    if nums["at_chance"]:
        reading = "a model at chance"
    elif comparable is False:
        reading = "training losses not comparable"
    elif nums["failed"]:
        reading = "failed seeds"
    elif t is None:
        reading = "undefined ratio"
    elif t.n < MIN_SEEDS:
        reading = f"fewer than {MIN_SEEDS} seeds"
    elif row.raw_verdict == SUPPORTED:
        reading = "attn more malleable"
    elif row.raw_verdict == CONTRADICTED:
        reading = "relu more malleable"
    elif bounded_ratio_p(_col(t, 0), _col(t, 1), MIN_RATIO, "above") <= level:
        reading = "attn more sensitive, not shown beyond noise"
    elif bounded_ratio_p(_col(t, 0), _col(t, 1), MIN_RATIO, "below") <= level:
        reading = "relu more sensitive, not shown beyond noise"
    else:
        reading = "not resolved"
    iv = None if t is None else t.interval
    return VariantRow(
        name,
        "",
        fr["relu"],
        fr["attn"],
        None if iv is None else iv.estimate,
        None if iv is None else iv.bounds,
        "none" if iv is None else iv.method,
        0 if iv is None else iv.n,
        above,
        comparable,
        reading,
        command,
        warns,
    )


def _col(test: SeedTest, j: int) -> np.ndarray:
    return np.array(test.units, dtype=float).reshape(len(test.units), -1)[:, j]


TITLES = {
    "kappa": ["kappa(G~) = kappa(G)^3", "the width linearized attention needs is beyond any trainable width"],
    "ntk": [
        "2L-ReLU approaches its NTK predictor",
        "MLP-Attn does not approach its NTK predictor",
        "MLP-Attn does not approach its NTK predictor [sensitivity: every width]",
        "MLP-Attn approaches its NTK predictor more slowly than 2L-ReLU",
    ],
    "malleability": ["attention is more malleable"],
    "landscape": ["2L-ReLU sharper: top Hessian eigenvalue", "2L-ReLU sharper: Hessian trace"],
    "alignment": [
        "attention's kernel advantage is larger on principal-direction targets",
        "MLP-Attn's kernel has the lower error on principal-direction targets",
        "MLP-Attn's kernel has the lower error on the real labels",
    ],
}


def _failed_cells_block(rows: list[ClaimRow], report: dict) -> None:
    """Rows of a run with failed cells give no verdict (the finished seeds were not chosen by the protocol)."""
    failed = (report.get("results") or {}).get("failed_cells") or []
    if not failed:
        return
    for row in rows:
        if row.test is not None:
            _block(
                row,
                f"{len(failed)} cell(s) of the run failed; rerun them (a verdict from the seeds that finished "
                "would rest on seeds chosen by outcome)",
            )


def score(
    mode: str,
    reports: dict[str, dict | None],
    errors: dict[str, str],
    commands: dict[str, str],
    variants: list[tuple[str, str]],
    slope_margin: float = SLOPE_MARGIN,
) -> ClaimsResult:
    """Every claim row and variant row from the runs' reports (a failed run gives 'not testable
    here'), with Holm's adjustment across the seed-based claim rows (sensitivity rows take the
    family's Bonferroni factor)."""
    claims: list[ClaimRow] = []
    readers: dict[str, Callable[[dict, str], ClaimRow | list[ClaimRow]]] = {
        "kappa": claim_kappa,
        "ntk": lambda rep, cmd: claim_ntk(rep, cmd, slope_margin),
        "malleability": claim_malleability,
        "landscape": claim_landscape,
        "alignment": claim_alignment,
    }
    for rid, read in readers.items():
        if rid not in commands:
            continue
        if reports.get(rid) is None:
            for title in TITLES[rid]:
                claims.append(
                    _untestable(title, "", "", "", None, f"the run failed: {errors.get(rid)}", rid, commands[rid], [])
                )
            continue
        report = reports[rid]
        assert report is not None  # checked above
        got = read(report, commands[rid])
        got = got if isinstance(got, list) else [got]
        _failed_cells_block(got, report)
        claims.extend(got)
    family = [c for c in claims if c.role == "claim"]
    adjust(family)
    m = sum(c.test is not None and c.test.n >= MIN_SEEDS for c in family)
    for c in claims:
        if c.role != "claim":
            if c.test is None or c.test.n < MIN_SEEDS:
                c.raw_verdict = c.verdict
                continue
            c.p_adjusted = min(1.0, c.test.p_value * max(1, m))
            c.verdict, reason = c.test.reading(c.p_adjusted)
            c.why = f"{c.test.estimand}: Bonferroni over the {m} seed-based rows: {reason}"
            if c.verdict == NOT_RESOLVED:
                c.seeds_needed = c.test.seeds_needed(max(1, m))
    rows = [variant_row(name, reports.get(rid), commands[rid], errors.get(rid)) for name, rid in variants]
    return ClaimsResult(mode, claims, rows)
