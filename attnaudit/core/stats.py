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

Coverage of each procedure is measured by simulation (tests/core/test_interval_coverage.py,
benchmarks/bench_coverage.py; docs/findings.md gives the figures). :func:`decide` turns an
interval into a verdict: supported or contradicted only when the interval lies entirely on
one side of the null value and rests on at least :data:`MIN_SEEDS` seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as _np

#: Per-seed values: a sequence or a numpy array.
ArrayLike = Sequence | _np.ndarray

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


def _finite(values: Sequence | _np.ndarray) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def t_quantile(confidence: float, df: int) -> float:
    """Two-sided Student-t quantile t((1 + confidence) / 2, df)."""
    from scipy.stats import t  # scipy.stats takes about 1 s to import: only when a quantile is needed

    return float(t.ppf(0.5 + confidence / 2.0, df))


def _binomial_half_cdf(r: int, n: int) -> float:
    """P(Bin(n, 1/2) <= r), summed exactly in integers."""
    if r < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(r, n) + 1)) / 2**n


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


# ----------------------------------------------------------------------------- verdict tests
# The scorecard's verdicts rest on tests whose error rate holds whatever the seed distribution
# (docs/findings.md, "The rules"): a few seeds cannot show that a seed distribution is normal,
# and the seeds the runs produce are often skewed or zero-inflated (a training either
# reshuffles its influence ranking or it does not).
#
# * Bounded per-seed values (flip rates in [0, 1], their paired differences in [-1, 1]): the
#   mean, by a betting test (Waudby-Smith & Ramdas 2023, "Estimating means of bounded random
#   variables by betting"). Its capital is a nonnegative product whose expectation is <= 1
#   under the null for any distribution on the range, so 1 / capital is a valid p-value (Markov).
#   No test valid for every distribution on [0, 1] can do much better with k seeds: a mass q
#   at the far end of the range goes unseen with probability (1 - q)^k, which is why these
#   tests need about log(1 / alpha) / log(1 + effect) seeds (the power it costs).
# * Unbounded per-seed values (log-log slopes, log ratios of eigenvalues, differences of
#   errors): the median seed, by the exact sign test and its order-statistic interval, exact
#   for every continuous seed distribution. No interval for the *mean* of an unbounded
#   statistic holds for every distribution at any k (Bahadur & Savage 1956).
#
#: One-sided level of every verdict test (the 95 % two-sided interval's tail).
ALPHA = (1.0 - CONFIDENCE) / 2.0
#: Largest share of the capital a betting test stakes on one seed (keeps 1 - c of it when a seed
#: lands at the far end of the range).
BET_CAP = 0.9
#: Orderings of the seeds averaged by the betting test (an average of e-values is an e-value,
#: and it makes the result depend on the seeds' values, not on their order).
BET_ORDERINGS = 8
#: Grid of the betting intervals (means in [0, 1], and t = theta / (1 + theta) for ratios).
_GRID = 4001


def _orderings(k: int) -> _np.ndarray:
    """Index arrays of up to :data:`BET_ORDERINGS` orderings: the k rotations, then their reversals."""
    rots = [[(s + i) % k for i in range(k)] for s in range(k)]
    rots += [r[::-1] for r in rots]
    return _np.array(rots[: max(1, min(BET_ORDERINGS, 2 * k))], dtype=int)


def _capital(x: _np.ndarray, m: _np.ndarray) -> _np.ndarray:
    """Betting capital against H0: E[X] <= m for X in [0, 1], averaged over orderings.

    ``x``: (..., k) values in [0, 1]; ``m``: null means, broadcast against x's leading axes
    (shape (...,) or (G, 1...) for a grid). The bet on seed i is lambda_i (x_i - m) with the
    predictable plug-in lambda_i = min(c / m, sqrt(2 log(1 / alpha) / (k sigma_{i-1}^2)))
    (sigma_{i-1}^2 the running variance of the seeds before i, started at 1/4)."""
    x = _np.clip(_np.asarray(x, dtype=float), 0.0, 1.0)
    m = _np.asarray(m, dtype=float)
    k = x.shape[-1]
    total = _np.zeros(_np.broadcast_shapes(x.shape[:-1], m.shape))
    orders = _orderings(k)
    for order in orders:
        xs = x[..., order]
        cap = _np.ones_like(total)
        s1 = _np.zeros(x.shape[:-1])
        s2 = _np.full(x.shape[:-1], 0.25)
        for i in range(k):
            mu = (0.5 + s1) / (i + 1.0)
            var = s2 / (i + 1.0)
            lam = _np.sqrt(2.0 * math.log(1.0 / ALPHA) / (k * var))
            lam = _np.minimum(lam, BET_CAP / _np.maximum(m, 1e-12))
            cap = cap * (1.0 + lam * (xs[..., i] - m))
            s1 = s1 + xs[..., i]
            s2 = s2 + (xs[..., i] - mu) ** 2
        total = total + cap
    return total / len(orders)


def _bet_p(x: _np.ndarray, m: _np.ndarray) -> _np.ndarray:
    """One-sided p-value of H0: E[X] <= m, X in [0, 1] (1 / capital, capped at 1; m <= 0 with a
    positive value observed rejects outright, m >= 1 never)."""
    m = _np.asarray(m, dtype=float)
    p = _np.minimum(1.0, 1.0 / _np.maximum(_capital(x, _np.clip(m, 1e-12, 1.0)), 1e-300))
    p = _np.where(m >= 1.0, 1.0, p)
    return _np.where((m <= 0.0) & (_np.asarray(x).max(axis=-1) > 0), 0.0, p)


def bounded_mean_p(values: ArrayLike, null: float, side: str, low: float = 0.0, high: float = 1.0) -> float:
    """One-sided betting p-value for the mean of per-seed values in [low, high]: side "above"
    tests H0: mean <= null against mean > null, "below" the mirror image."""
    v = _np.array(_finite(values), dtype=float)
    if v.size == 0:
        return 1.0
    x, m = (v - low) / (high - low), (null - low) / (high - low)
    if side == "below":
        x, m = 1.0 - x, 1.0 - m
    return float(_bet_p(x, _np.array(m)))


def _grid_bounds(p_above: _np.ndarray, p_below: _np.ndarray, grid: _np.ndarray, alpha: float):
    """Conservative ends of {m : neither one-sided test rejects} on a grid (None: unbounded there)."""
    keep = (p_above > alpha) & (p_below > alpha)
    if not keep.any():  # cannot happen for a valid pair of tests; report no interval rather than an empty one
        return None, None
    first, last = int(_np.argmax(keep)), len(keep) - 1 - int(_np.argmax(keep[::-1]))
    lo = grid[first - 1] if first > 0 else None
    hi = grid[last + 1] if last < len(grid) - 1 else None
    return lo, hi


def bounded_mean_interval(
    values: ArrayLike, low: float = 0.0, high: float = 1.0, confidence: float = CONFIDENCE
) -> Interval:
    """Betting interval of the mean of per-seed values in [low, high]: every mean that neither
    one-sided betting test rejects at (1 - confidence) / 2, valid for any seed distribution."""
    v = _np.array(_finite(values), dtype=float)
    method = "betting (bounded mean)"
    if v.size == 0:
        return Interval(None, None, None, method, confidence, 0, "no finite values")
    alpha = (1.0 - confidence) / 2.0
    grid = _np.linspace(0.0, 1.0, _GRID)
    x = (v - low) / (high - low)
    pa = _bet_p(x[None, :], grid)
    pb = _bet_p(1.0 - x[None, :], 1.0 - grid)
    lo, hi = _grid_bounds(pa, pb, grid, alpha)
    scale = high - low
    return Interval(
        float(v.mean()),
        low if lo is None else float(low + scale * lo),
        high if hi is None else float(low + scale * hi),
        method,
        confidence,
        int(v.size),
    )


def _ratio_x(a: _np.ndarray, b: _np.ndarray, t: _np.ndarray) -> _np.ndarray:
    """(1 - t) a + t (1 - b) in [0, 1]: its mean is <= t exactly when E[a] / E[b] <= t / (1 - t)."""
    t = _np.asarray(t, dtype=float)[..., None]
    return (1.0 - t) * a + t * (1.0 - b)


def bounded_ratio_p(num: ArrayLike, den: ArrayLike, null: float, side: str) -> float:
    """One-sided betting p-value for E[num] / E[den] against ``null`` (both rates in [0, 1], paired
    by seed): "above" tests H0: E[num] - null E[den] <= 0, "below" the mirror image."""
    a, b = _pairs(num, den)
    if a.size == 0:
        return 1.0
    t = null / (1.0 + null)
    x = _ratio_x(a, b, _np.array(t))
    if side == "below":
        return float(_bet_p(1.0 - x, _np.array(1.0 - t)))
    return float(_bet_p(x, _np.array(t)))


def _pairs(num: ArrayLike, den: ArrayLike) -> tuple[_np.ndarray, _np.ndarray]:
    pairs = [
        (float(x), float(y))
        for x, y in zip(num, den)
        if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))
    ]
    a = _np.clip(_np.array([p[0] for p in pairs]), 0.0, 1.0)
    b = _np.clip(_np.array([p[1] for p in pairs]), 0.0, 1.0)
    return a, b


def bounded_ratio_interval(num: ArrayLike, den: ArrayLike, confidence: float = CONFIDENCE) -> Interval:
    """Interval of E[num] / E[den] for paired per-seed rates in [0, 1], by inverting the betting
    test of E[num - theta den] = 0 (the construction of Fieller's interval with a test that holds
    for any seed distribution and any correlation between the two). Where ``den`` is 0 on every
    seed there is no point estimate, and the lower end comes from how large E[den] could still
    be (its own betting bound, inside the paired test); the upper end is None (unbounded) when
    no ratio, however large, is rejected."""
    a, b = _pairs(num, den)
    method = "betting (paired ratio)"
    k = int(a.size)
    if k == 0:
        return Interval(None, None, None, method, confidence, 0, "no finite pairs")
    est = float(a.mean() / b.mean()) if b.mean() > 0 else None
    alpha = (1.0 - confidence) / 2.0
    t = _np.linspace(0.0, 1.0, _GRID)[:-1]  # theta = t / (1 - t) in [0, inf)
    x = _ratio_x(a, b, t)
    pa = _bet_p(x, t)
    pb = _bet_p(1.0 - x, 1.0 - t)
    lo, hi = _grid_bounds(pa, pb, t, alpha)
    note = "" if est is not None else "the denominator is 0 on every seed: no point estimate"
    low = 0.0 if lo is None else float(lo / (1.0 - lo))
    high = None if hi is None else float(hi / (1.0 - hi))
    return Interval(est, low, high, method, confidence, k, note)


def sign_p(values: ArrayLike, null: float, side: str) -> float:
    """Exact one-sided sign-test p-value for the median seed: side "above" tests H0: median <= null
    (P(Bin(n, 1/2) >= the number of seeds above null), seeds equal to null left out)."""
    v = _finite(values)
    up = sum(x > null for x in v)
    down = sum(x < null for x in v)
    hits = up if side == "above" else down
    n = up + down
    if n == 0:
        return 1.0
    return _binomial_half_cdf(n - hits, n)  # P(X >= hits) = P(X <= n - hits) at p = 1/2


def median_interval(values: ArrayLike, confidence: float = CONFIDENCE) -> Interval:
    """Distribution-free interval of the median seed: order statistics [x_(r), x_(k+1-r)] with the
    largest r whose exact coverage 1 - 2 P(Bin(k, 1/2) <= r - 1) is >= ``confidence``.

    With too few seeds for that (k <= 5 at 95 %) both ends are None and the note says how many
    seeds the interval needs; the estimate is the sample median."""
    v = sorted(_finite(values))
    method = "order statistics (median seed)"
    k = len(v)
    if k == 0:
        return Interval(None, None, None, method, confidence, 0, "no finite values")
    med = float(_np.median(v))
    tail = (1.0 - confidence) / 2.0
    r = 0
    while r + 1 <= k // 2 and _binomial_half_cdf(r, k) <= tail:
        r += 1
    if r == 0:
        need = next(n for n in range(k, 64) if _binomial_half_cdf(0, n) <= tail)
        return Interval(
            med, None, None, method, confidence, k, f"{k} seed(s): an exact {confidence:.0%} interval needs {need}"
        )
    cover = 1.0 - 2.0 * _binomial_half_cdf(r - 1, k)
    return Interval(med, v[r - 1], v[k - r], method, confidence, k, f"exact coverage {cover:.4f}")


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given): controls the family-wise error
    at any level for any dependence between the tests."""
    p = [min(1.0, max(0.0, float(x))) for x in p_values]
    order = sorted(range(len(p)), key=lambda i: p[i])
    out = [1.0] * len(p)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def seeds_for_power(
    per_seed: Sequence,
    p_value: Callable[[_np.ndarray], float],
    alpha: float,
    power: float = 0.8,
    max_seeds: int = 100,
    reps: int = 100,
    seed: int = 0,
) -> int | None:
    """Fewest seeds at which ``p_value`` (of an array of per-seed values) is <= ``alpha`` in at least
    ``power`` of the runs, when seeds are drawn from the observed ones (their effect and
    dispersion, resampled with replacement; a fixed generator, so the answer is reproducible).
    None when ``max_seeds`` are not enough (or there is nothing to resample)."""
    vals = [v for v in per_seed if v is not None]
    if len(vals) < 2:
        return None
    data = _np.array(vals, dtype=float)  # (seeds,) or (seeds, columns) of paired units
    rng = _np.random.default_rng(seed)

    def enough(n: int) -> bool:
        idx = rng.integers(0, len(vals), size=(reps, n))
        allowed = (1.0 - power) * reps  # misses that still leave the power reached: stop at the next one
        misses = 0
        for row in idx:
            misses += p_value(data[row]) > alpha
            if misses > allowed:
                return False
        return True

    lo, hi = 1, 2
    while not enough(hi):
        lo, hi = hi, 2 * hi
        if hi > max_seeds:
            if not enough(max_seeds):
                return None
            hi = max_seeds
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if enough(mid):
            hi = mid
        else:
            lo = mid
    return hi
