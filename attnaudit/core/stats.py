"""Intervals over a few seeds, and the verdict an interval can carry.

The analyses repeat a stochastic experiment (initialisation, data order, attack start) over
k seeds, with k between 3 and 5 in practice. Every interval here is built for that regime:

* :func:`mean_interval`: Student's t with k - 1 degrees of freedom (t(0.975, 2) = 4.30,
  t(0.975, 4) = 2.78), the exact interval for a normal mean; the normal "2 sd / sqrt(k)"
  covers about 0.70 at k = 2 and 0.82 at k = 3 instead of 0.95.
* :func:`proportion_interval`: the same for a share (a flip rate: flips among the top-k
  audited examples), with the per-seed variance floored at the binomial variance
  p (1 - p) / K of K audited examples. By the law of total variance a per-seed rate has
  variance p (1 - p) / K + (1 - 1/K) Var(p_seed) >= p (1 - p) / K, so the floor is a true
  lower bound; it stops three identical seeds (often all 0 %) from giving a zero-width
  interval. p is estimated with Jeffreys' (x + 1/2) / (N + 1), so it is never 0.
* :func:`ratio_interval`: Fieller's interval for a ratio of two paired means (one pair per
  seed), with the same t quantile and variance floors. It is the set of ratios theta for
  which mean(a - theta b) = 0 is not rejected by the t-test, so it keeps every resample a
  bootstrap would drop: where the denominator is not clearly above 0 the set is unbounded
  and the upper end is reported as ``None`` (unbounded), never as a finite number.
* :func:`difference_interval`: the paired t-interval of mean(a - b).

Coverage of each procedure is measured by simulation (tests/test_interval_coverage.py,
benchmarks/bench_coverage.py; docs/findings.md gives the figures). :func:`decide` turns an
interval into a verdict: supported or contradicted only when the interval lies entirely on
one side of the null value and rests on at least :data:`MIN_SEEDS` seeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from scipy import stats as _st

#: Fewest seeds from which a seed-based interval may issue supported / contradicted.
MIN_SEEDS = 3
CONFIDENCE = 0.95

SUPPORTED, CONTRADICTED, NOT_RESOLVED, NOT_TESTABLE = "supported", "contradicted", "not resolved", "not testable here"


@dataclass(frozen=True)
class Interval:
    """An estimate with a two-sided interval; ``low``/``high`` None means unbounded on that side."""

    estimate: float | None
    low: float | None
    high: float | None
    method: str
    confidence: float
    n: int
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def bounds(self) -> list:
        """[low, high] with None for an unbounded end (JSON has no infinity)."""
        return [self.low, self.high]

    def lo(self) -> float:
        return -math.inf if self.low is None else self.low

    def hi(self) -> float:
        return math.inf if self.high is None else self.high

    def side(self, null: float) -> str:
        """ "above" / "below" when the whole interval lies strictly on one side of ``null``, else "straddles"."""
        if self.lo() > null:
            return "above"
        if self.hi() < null:
            return "below"
        return "straddles"

    def text(self, fmt: str = ".3g") -> str:
        def f(v, unbounded):
            return unbounded if v is None else format(v, fmt)

        est = "n/a" if self.estimate is None else format(self.estimate, fmt)
        return f"{est} [{f(self.low, '-inf')}, {f(self.high, '+inf')}]"


def _finite(values: Sequence) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def t_quantile(confidence: float, df: int) -> float:
    """Two-sided Student-t quantile t((1 + confidence) / 2, df)."""
    return float(_st.t.ppf(0.5 + confidence / 2.0, df))


def _mean_sd(v: list[float]) -> tuple[float, float]:
    m = sum(v) / len(v)
    return m, math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0


def mean_interval(values: Sequence, confidence: float = CONFIDENCE) -> Interval:
    """Student-t interval of the mean of per-seed values: mean +- t(df = k - 1) sd / sqrt(k).

    One value gives the estimate with both ends unbounded (no spread, no interval)."""
    v = _finite(values)
    if not v:
        return Interval(None, None, None, "student-t", confidence, 0, "no finite values")
    m, sd = _mean_sd(v)
    if len(v) == 1:
        return Interval(m, None, None, "student-t", confidence, 1, "one seed: no interval")
    half = t_quantile(confidence, len(v) - 1) * sd / math.sqrt(len(v))
    return Interval(m, m - half, m + half, "student-t", confidence, len(v))


def difference_interval(a: Sequence, b: Sequence, confidence: float = CONFIDENCE) -> Interval:
    """Paired Student-t interval of mean(a_i - b_i) over the seeds where both are finite."""
    pairs = [
        (float(x), float(y))
        for x, y in zip(a, b)
        if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))
    ]
    iv = mean_interval([x - y for x, y in pairs], confidence)
    return Interval(iv.estimate, iv.low, iv.high, "paired student-t", confidence, iv.n, iv.note)


def _binomial_floor(rates: list[float], trials: int | None) -> float:
    """Lower bound p (1 - p) / K of a per-seed rate's variance (Jeffreys' estimate of p)."""
    if not trials or trials < 1:
        return 0.0
    x = sum(rates) * trials
    p = (x + 0.5) / (len(rates) * trials + 1.0)
    return p * (1.0 - p) / trials


def proportion_interval(rates: Sequence, trials: int | None, confidence: float = CONFIDENCE) -> Interval:
    """Interval of the mean of per-seed shares (each a count out of ``trials``), clipped to [0, 1].

    Student's t over seeds with the variance floored at the binomial variance (module
    docstring); ``trials`` None gives the plain t-interval of :func:`mean_interval`."""
    v = _finite(rates)
    method = "student-t, binomial variance floor" if trials else "student-t"
    if not v:
        return Interval(None, None, None, method, confidence, 0, "no finite values")
    m, sd = _mean_sd(v)
    if len(v) == 1:
        return Interval(m, None, None, method, confidence, 1, "one seed: no interval")
    var = max(sd * sd, _binomial_floor(v, trials))
    half = t_quantile(confidence, len(v) - 1) * math.sqrt(var / len(v))
    return Interval(m, max(0.0, m - half), min(1.0, m + half), method, confidence, len(v))


def ratio_interval(
    num: Sequence,
    den: Sequence,
    confidence: float = CONFIDENCE,
    trials: tuple[int | None, int | None] | None = None,
    nonnegative: bool = True,
) -> Interval:
    """Fieller's interval for mean(num) / mean(den), one (num_i, den_i) pair per seed.

    The set {theta : (a - theta b)^2 <= t^2 Var(a_i - theta b_i) / k} with a, b the means
    and t = t((1 + confidence) / 2, k - 1); ``trials`` (K_num, K_den) floors each variance at
    its binomial variance. ``nonnegative``: both quantities are >= 0 (rates), so the set is
    cut to theta >= 0. Where the set is unbounded (the denominator is not clearly above 0)
    ``high`` is None; where it is two rays its convex hull is reported (conservative)."""
    pairs = [
        (float(x), float(y))
        for x, y in zip(num, den)
        if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))
    ]
    k = len(pairs)
    method = "fieller" + (", binomial variance floor" if trials and any(trials) else "")
    if k == 0:
        return Interval(None, None, None, method, confidence, 0, "no finite pairs")
    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs]
    ma, sa = _mean_sd(a)
    mb, sb = _mean_sd(b)
    est = ma / mb if mb > 0 else None
    if k == 1:
        return Interval(est, None, None, method, confidence, 1, "one seed: no interval")
    sab = sum((x - ma) * (y - mb) for x, y in pairs) / (k - 1)
    va, vb = sa * sa, sb * sb
    if trials:
        va = max(va, _binomial_floor(a, trials[0]))
        vb = max(vb, _binomial_floor(b, trials[1]))
    bound = math.sqrt(va * vb)
    sab = max(-bound, min(bound, sab))
    g = t_quantile(confidence, k - 1) ** 2 / k
    qa = mb * mb - g * vb
    qb = -2.0 * (ma * mb - g * sab)
    qc = ma * ma - g * va
    disc = qb * qb - 4.0 * qa * qc
    floor = 0.0 if nonnegative else -math.inf
    note = ""
    if qa > 0:
        root = math.sqrt(max(disc, 0.0))
        lo, hi = (-qb - root) / (2 * qa), (-qb + root) / (2 * qa)
        lo = max(lo, floor)
        hi = max(hi, floor)
        low, high = (lo if math.isfinite(lo) else None), hi
    else:
        # the denominator is not significantly non-zero: the set is the whole line or two rays
        note = "the denominator is not clearly above 0, so the ratio has no finite upper bound"
        if disc <= 0 or qa == 0:
            low, high = (0.0 if nonnegative else None), None
            if qa == 0 and qb != 0:
                r = -qc / qb
                # a half-line: theta >= r or theta <= r
                if qb < 0:
                    low = max(r, floor) if nonnegative else r
        else:
            root = math.sqrt(disc)
            r1, r2 = sorted(((-qb - root) / (2 * qa), (-qb + root) / (2 * qa)))
            # qa < 0: the set is (-inf, r1] U [r2, inf)
            if nonnegative and r1 < 0:
                low = max(r2, 0.0)
            else:
                low = 0.0 if nonnegative else None
            high = None
    return Interval(est, low, high, method, confidence, k, note)


def decide(
    interval: Interval | None, null: float, claim_side: str, n_seeds: int | None, seed_based: bool = True
) -> tuple[str, str]:
    """(verdict, reason) for a claim that the quantity lies ``claim_side`` ("above" / "below") of ``null``.

    Supported / contradicted only when the interval lies entirely on one side of ``null`` and,
    for a seed-based interval, rests on at least :data:`MIN_SEEDS` seeds; otherwise not resolved."""
    if interval is None or interval.estimate is None:
        return NOT_RESOLVED, "no estimate"
    if seed_based and (n_seeds or 0) < MIN_SEEDS:
        return NOT_RESOLVED, (
            f"{n_seeds or 0} seed(s): fewer than {MIN_SEEDS}, too few for an interval to carry a "
            "verdict; run more seeds"
        )
    side = interval.side(null)
    other = "below" if claim_side == "above" else "above"
    ci = f"{int(round(100 * interval.confidence))} % {interval.method} interval {interval.text()}"
    if side == claim_side:
        return SUPPORTED, f"the {ci} lies entirely {claim_side} {null:g}"
    if side == other:
        return CONTRADICTED, f"the {ci} lies entirely {other} {null:g}"
    return NOT_RESOLVED, f"the {ci} includes {null:g}"
