"""Coverage of attnaudit.core.stats' few-seed intervals, by simulation (a fast, loose version of
benchmarks/bench_coverage.py, which runs the same processes with 2,000 replications).

Data-generating processes (each from a seeded numpy generator, so the test is deterministic):

* **seed means** (``mean_interval``; one log-log slope per seed): k = 3 or 5 i.i.d. per-seed
  values, N(0, 1) (the t-interval is exact there), Student t with 3 df (heavy tails) and
  exp(N(0, s^2)) with s = 0.5 and 1 (skewness 1.8 and 6.2; truth exp(s^2 / 2)).
* **flip rates** (``proportion_interval``, ``ratio_interval``, ``difference_interval``): seed s
  trains a model with flip probability p_s ~ Beta(mean mu, Var = rho mu (1 - mu)); the K
  audited examples give flips_s ~ Binomial(K, p_s), rate_s = flips_s / K. The relu and attn
  models of one seed share its data: their seed effects are coupled by a Gaussian copula with
  latent correlation corr = 0.5. K = 30 (quick preset) and 200 (paper preset), mu from 0.05
  to 0.9, rho = 0.01 and 0.05 for the asserted bounds (0.2 reported only). Targets: mu,
  mu_attn / mu_relu (an interval unbounded above that contains it covers it) and
  mu_attn - mu_relu.

Why realistic: the quick claims run (digits, K = 30, 3 seeds) has per-seed flip-rate sds of
2-37 points against 2-9 points of binomial noise; the moment estimate of rho over its 35 rows
has median 0.055 (mean 0.09, up to 0.26 for attn rows at low rates such as seeds 0, 0, 0.27);
the paper preset's MNIST rows (K = 200, 5 seeds, relu 39.6 % [35.4, 43.8]) are close to
binomial, rho about 0.01. benchmarks/bench_coverage.py says more.

Bounds: coverage >= 0.90 for nominal 0.95 (with 400 replications the Monte Carlo se is 0.011
at 0.95), and <= 0.99 where an exact procedure should not be conservative. They are asserted
only where the procedure meets them; where it does not, the figure measured with 2,000
replications is written next to the setting. The wrong procedures a test of this kind must
catch, mean +- 2 sd / sqrt(k) and the percentile bootstrap over seeds, run through the same
check and must fail it (measured with 2,000 replications: 0.82 and 0.68 at k = 3 on normal
seeds; 0.59 and 0.52 at worst on flip rates; 0.54 and 0.50 at worst on the ratio, against
0.95, 0.69 and 0.82 for the real procedures, whose worst cases are the rho = 0.2 settings).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import special, stats as st

from attnaudit.core import stats

REPS = 400
LOW, HIGH = 0.90, 0.99


# ---------------------------------------------------------------- data-generating processes


def seed_values(rng, dist: str, k: int, reps: int):
    if dist == "normal":
        return rng.standard_normal((reps, k)), 0.0
    if dist == "t3":
        return rng.standard_t(3, (reps, k)), 0.0
    s = float(dist[len("lognorm") :])
    return np.exp(s * rng.standard_normal((reps, k))), math.exp(s * s / 2)


def seed_rates(rng, mus, rho, corr: float, k: int, reps: int, K: int):
    """One (reps, k) array of observed flip rates per model (module docstring); ``rho``: one for
    all models or one per model."""
    rhos = tuple(rho) if isinstance(rho, tuple) else (rho,) * len(mus)
    z0 = rng.standard_normal((reps, k))
    out = []
    for j, mu in enumerate(mus):
        phi = 1.0 / rhos[j] - 1.0
        z = z0 if j == 0 else corr * z0 + math.sqrt(1 - corr * corr) * rng.standard_normal((reps, k))
        p = st.beta.ppf(special.ndtr(z), mu * phi, (1 - mu) * phi)
        out.append(rng.binomial(K, p) / K)
    return out


# ---------------------------------------------------------------- procedures: (lo, hi) per replication


def _loop(fn, *arrays):
    ivs = [fn(*(a[i].tolist() for a in arrays)) for i in range(arrays[0].shape[0])]
    return (
        np.array([iv.lo() for iv in ivs]),
        np.array([iv.hi() for iv in ivs]),
        np.array([iv.high is None for iv in ivs]),
    )


def t_mean(x, K=None):
    return _loop(stats.mean_interval, x)[:2]


def t_proportion(x, K):
    return _loop(lambda v: stats.proportion_interval(v, K), x)[:2]


def fieller(num, den, K):
    return _loop(lambda a, b: stats.ratio_interval(a, b, trials=(K, K)), num, den)[:2]


def paired_t(a, b, K=None):
    return _loop(stats.difference_interval, a, b)[:2]


def normal_2sd(x, K=None):
    """Reference (wrong) procedure: mean +- 2 sd / sqrt(k)."""
    half = 2 * x.std(1, ddof=1) / math.sqrt(x.shape[1])
    return x.mean(1) - half, x.mean(1) + half


def normal_2sd_ratio(num, den, K=None):
    """Reference (wrong) procedure: the delta method r +- 2 sd(a - r b) / (sqrt(k) mean(b))."""
    ma, mb = num.mean(1), den.mean(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = ma / mb
        half = 2 * (num - r[:, None] * den).std(1, ddof=1) / math.sqrt(num.shape[1]) / mb
    ok = mb > 0
    return np.where(ok, r - half, -np.inf), np.where(ok, r + half, np.inf)


def _weights(k: int):
    """Share of each seed in each of the k^k equally likely bootstrap resamples (the exact bootstrap)."""
    idx = np.array(list(itertools.product(range(k), repeat=k)))
    return np.stack([(idx == j).sum(1) / k for j in range(k)], axis=1)


def bootstrap_percentile(x, K=None):
    """Reference (wrong) procedure: percentile bootstrap of the mean over seeds, exact (all k^k resamples)."""
    return tuple(np.percentile(x @ _weights(x.shape[1]).T, [2.5, 97.5], axis=1))


def bootstrap_percentile_ratio(num, den, K=None):
    """Reference (wrong) procedure: paired percentile bootstrap of the ratio of means (zero
    denominators dropped; a case with no defined resample counts as covered)."""
    w = _weights(num.shape[1])
    a, b = num @ w.T, den @ w.T
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(b > 0, a / b, np.nan)
    lo, hi = np.full(len(r), -np.inf), np.full(len(r), np.inf)
    ok = np.isfinite(r).any(1)
    lo[ok], hi[ok] = np.nanpercentile(r[ok], [2.5, 97.5], axis=1)
    return lo, hi


def coverage(lohi, truth) -> float:
    lo, hi = lohi
    return float(np.mean((lo <= truth + 1e-12) & (truth - 1e-12 <= hi)))


# ---------------------------------------------------------------- the simulations


def mean_coverages(procedure, dists=("normal", "t3", "lognorm0.5", "lognorm1"), seed=11):
    rng = np.random.default_rng(seed)
    out = {}
    for dist in dists:
        for k in (3, 5):
            x, truth = seed_values(rng, dist, k, REPS)
            out[dist, k] = coverage(procedure(x), truth)
    return out


RATE_SETTINGS = [
    (mu, K, rho, k) for mu in (0.05, 0.1, 0.3, 0.5, 0.9) for K in (30, 200) for rho in (0.01, 0.05) for k in (3, 5)
]


def rate_coverages(procedure, settings=RATE_SETTINGS, seed=12):
    rng = np.random.default_rng(seed)
    out = {}
    for mu, K, rho, k in settings:
        (x,) = seed_rates(rng, (mu,), rho, 0.0, k, REPS, K)
        out[mu, K, rho, k] = coverage(procedure(x, K), mu)
    return out


# (mu_relu, mu_attn): true ratios 1, 3, 2, 9, 2, 0.75, 2, 0.5
PAIRS = ((0.05, 0.05), (0.05, 0.15), (0.1, 0.2), (0.1, 0.9), (0.3, 0.6), (0.4, 0.3), (0.45, 0.9), (0.9, 0.45))
RATIO_SETTINGS = [(pair, K, rho, k) for pair in PAIRS for K in (30, 200) for rho in (0.01, 0.05) for k in (3, 5)]


def pair_coverages(procedure, target="ratio", settings=RATIO_SETTINGS, seed=13):
    rng = np.random.default_rng(seed)
    out = {}
    for (mu_r, mu_a), K, rho, k in settings:
        relu, attn = seed_rates(rng, (mu_r, mu_a), rho, 0.5, k, REPS, K)
        truth = mu_a / mu_r if target == "ratio" else mu_a - mu_r
        out[(mu_r, mu_a), K, rho, k] = coverage(procedure(attn, relu, K), truth)
    return out


def _failing(cov: dict, low=LOW) -> dict:
    return {s: round(c, 3) for s, c in cov.items() if c < low}


# ---------------------------------------------------------------- (a) seed means


def test_mean_interval_covers_normal_seeds_and_is_not_conservative():
    cov = mean_coverages(t_mean, dists=("normal",))
    assert all(LOW <= c <= HIGH for c in cov.values()), cov  # 2,000 reps: 0.952 (k = 3), 0.948 (k = 5)


def test_mean_interval_on_heavy_tailed_and_skewed_seeds():
    cov = mean_coverages(t_mean)
    # heavy tails (t3) and mild skew (lognormal s = 0.5): the bound holds (2,000 reps: t3 0.962 /
    # 0.963; lognorm0.5 0.920 / 0.923 at k = 3 / 5)
    assert not _failing({s: c for s, c in cov.items() if s[0] in ("t3", "lognorm0.5")}), cov
    # strong skew (lognormal s = 1, skewness 6.2): the t-interval is NOT 95 % from 3-5 seeds
    # (2,000 reps: 0.824 at k = 3, 0.820 at k = 5). Only a floor against a collapse is asserted.
    assert min(cov["lognorm1", 3], cov["lognorm1", 5]) >= 0.72, cov


def test_the_seed_mean_check_fails_the_wrong_procedures():
    """mean +- 2 sd / sqrt(k) and the percentile bootstrap over 3 seeds cover 0.82 and 0.68 on normal seeds."""
    for wrong in (normal_2sd, bootstrap_percentile):
        cov = mean_coverages(wrong, dists=("normal",))
        assert cov["normal", 3] < LOW - 0.04, (wrong.__name__, cov)


# ---------------------------------------------------------------- (b) flip-rate ratio, and the difference


def test_fieller_ratio_interval_covers_the_ratio_of_mean_flip_rates():
    cov = pair_coverages(fieller)
    assert not _failing(cov), _failing(cov)  # 2,000 reps, rho <= 0.05: min 0.916 ((0.1, 0.9), K = 200, k = 5)


def test_fieller_under_strong_seed_overdispersion_is_reported_not_asserted():
    """rho = 0.2 (the zero-inflated attn rows of the quick run): with a low, skewed denominator
    (relu 0.1, attn 0.9) the interval's lower end overshoots the ratio 9: coverage 0.82-0.87
    with 2,000 replications at k = 3 and 5, although 84-100 % of the intervals correctly lie
    above 1. Elsewhere rho = 0.2 keeps >= 0.928. Only a floor against a collapse is asserted."""
    settings = [(pair, K, 0.2, k) for pair in ((0.1, 0.9), (0.3, 0.6), (0.05, 0.05)) for K in (30,) for k in (3, 5)]
    cov = pair_coverages(fieller, settings=settings, seed=14)
    assert min(cov.values()) >= 0.75, cov
    assert min(c for s, c in cov.items() if s[0] != (0.1, 0.9)) >= LOW, cov


def test_fieller_rarely_declares_a_ratio_of_one_above_one():
    """The verdict 'attention is more malleable' needs the whole interval above 1; at a true
    ratio of 1 that should happen at most 2.5 % of the time (one tail)."""
    rng = np.random.default_rng(15)
    for mu in (0.05, 0.3, 0.9):
        for K, k in ((30, 3), (200, 5)):
            relu, attn = seed_rates(rng, (mu, mu), 0.05, 0.5, k, REPS, K)
            lo, _, _ = _loop(lambda a, b: stats.ratio_interval(a, b, trials=(K, K)), attn, relu)
            assert np.mean(lo > 1) <= 0.05, (mu, K, k, np.mean(lo > 1))


@pytest.mark.xfail(
    strict=False,
    reason="known weakness of stats.ratio_interval: a skewed, zero-inflated "
    "denominator (relu seeds dispersed with rho 0.2, attn with rho 0.01) gives a false 'above 1' "
    "at a true ratio of 1 in up to 20 % of runs (benchmarks/bench_coverage.py, family 3)",
)
def test_fieller_false_above_one_when_only_the_denominator_is_overdispersed():
    """A true ratio of 1, relu and attn at 10 % and 5 %, K = 200 (paper preset), 5 seeds, relu
    seeds zero-inflated (rho 0.2), attn seeds near binomial (rho 0.01). Measured with 2,000
    replications: a false 'above 1' 0.14-0.16 (mu 0.1) and 0.20-0.22 (mu 0.05), nominal 0.025.
    Flooring each per-seed variance at the beta-binomial p (1 - p) (1/K + rho_min (1 - 1/K))
    with rho_min = 0.05 instead of the binomial p (1 - p) / K brings both to <= 0.015 (and
    the power at 2x, k = 5, K = 200, relu 10 %, from 0.49 to 0.26)."""
    rng = np.random.default_rng(18)
    K, k = 200, 5
    for mu in (0.05, 0.1):
        relu, attn = seed_rates(rng, (mu, mu), (0.2, 0.01), 0.5, k, REPS, K)
        lo, _ = fieller(attn, relu, K)
        assert np.mean(lo > 1) <= 0.05, (mu, np.mean(lo > 1))


def test_paired_difference_interval_covers():
    cov = pair_coverages(paired_t, target="difference", seed=16)
    assert not _failing(cov), _failing(cov)


def test_the_ratio_check_fails_the_wrong_procedures():
    """The delta method r +- 2 se and the paired percentile bootstrap fall to 0.54 and 0.50 (2,000 reps)."""
    for wrong in (normal_2sd_ratio, bootstrap_percentile_ratio):
        cov = pair_coverages(wrong)
        k3 = {s: c for s, c in cov.items() if s[3] == 3}
        assert min(k3.values()) < LOW - 0.05, (wrong.__name__, min(k3.values()))
        assert len(_failing(k3)) >= len(k3) // 2, (wrong.__name__, _failing(k3))


# ---------------------------------------------------------------- (c) the mean flip rate

# proportion_interval meets the bound at rho = 0.01 at every rate and at rho = 0.05 from 0.3 to
# 0.5; at rho = 0.05 the lowest rate is under it (2,000 reps: 0.888 / 0.904 at mu = 0.05,
# K = 200, k = 5 / 3; 0.92-0.94 at mu = 0.1 and 0.9) and at rho = 0.2 far under it (0.695 at
# mu = 0.05, K = 200, k = 3; 0.82-0.85 at mu = 0.1 and 0.9): the t-interval of 3-5 skewed seed
# rates, which the binomial floor does not help.
HOLDS = [s for s in RATE_SETTINGS if s[2] == 0.01 or 0.3 <= s[0] <= 0.5]


def test_proportion_interval_covers_the_mean_flip_rate():
    cov = rate_coverages(t_proportion, settings=HOLDS)
    assert not _failing(cov), _failing(cov)
    # not absurdly conservative where the floor rarely binds (K = 200, 5 seeds, mu 0.3 and 0.5: 0.946, 0.958)
    assert cov[0.5, 200, 0.05, 5] <= HIGH and cov[0.3, 200, 0.05, 5] <= HIGH, cov


def test_proportion_interval_at_low_and_high_rates_is_reported_not_asserted():
    rest = [s for s in RATE_SETTINGS if s not in HOLDS]
    cov = rate_coverages(t_proportion, settings=rest, seed=17)
    assert min(cov.values()) >= 0.84, cov  # a floor against a collapse (2,000 reps: min 0.888)


def test_the_rate_check_fails_the_wrong_procedures():
    for wrong in (normal_2sd, bootstrap_percentile):
        cov = rate_coverages(wrong, settings=HOLDS)
        assert len(_failing(cov)) >= len(cov) // 2, (wrong.__name__, _failing(cov))


@pytest.mark.parametrize("k", [3, 5])
def test_exact_bootstrap_weights(k):
    """The reference bootstrap enumerates all k^k resamples: every weight row sums to 1, each seed's mean weight is 1/k."""
    w = _weights(k)
    assert w.shape == (k**k, k)
    np.testing.assert_allclose(w.sum(1), 1.0)
    np.testing.assert_allclose(w.mean(0), 1.0 / k)


# ---------------------------------------------------------------- (d) the scorecard's verdict tests
#
# The claims scorecard reads its verdicts from tests that hold for any seed distribution
# (stats.py, "verdict tests"): betting intervals for bounded flip rates and their ratio, and the
# median seed's order-statistic interval and sign test for unbounded statistics. Their coverage
# is checked here on the seed distributions that break the t-interval: zero-inflated rates (a
# training either reshuffles its influence ranking or it does not) and skewed Beta rates, and
# log-normal slopes. Per-seed rates are drawn directly (no binomial layer: the betting tests need
# only that a rate lies in [0, 1]).

VERDICT_REPS = 200
#: sqrt(0.95 x 0.05 / 200) = 0.0154: a procedure whose coverage were exactly 0.95 would fall below
#: 0.93 in about 10 % of such runs; the betting intervals are conservative (measured with 250
#: replications of each setting below: 0.996-1.000), so the bound is far from binding, and a
#: collapse (the t-interval's 0.70-0.82 on such seeds) would fail it.
VERDICT_LOW = 0.93


def zero_inflated(rng, p_zero, a, b, shape):
    """A rate that is 0 with probability p_zero, else Beta(a, b): mean (1 - p_zero) a / (a + b)."""
    return np.where(rng.uniform(size=shape) < p_zero, 0.0, rng.beta(a, b, shape)), (1 - p_zero) * a / (a + b)


def beta_rates(rng, a, b, shape):
    return rng.beta(a, b, shape), a / (a + b)


# (name, relu draw, attn draw): relu zero-inflated 60 % (mean 0.16) against a Beta attn (0.375);
# both zero-inflated; both Beta and skewed (0.2 and 0.4)
VERDICT_DGPS = {
    "zero-inflated relu": (lambda r, s: zero_inflated(r, 0.6, 2, 3, s), lambda r, s: beta_rates(r, 3, 5, s)),
    "zero-inflated both": (lambda r, s: zero_inflated(r, 0.7, 1, 2, s), lambda r, s: zero_inflated(r, 0.3, 2, 2, s)),
    "beta": (lambda r, s: beta_rates(r, 2, 8, s), lambda r, s: beta_rates(r, 4, 6, s)),
}


def _covers(iv, truth) -> bool:
    return iv.lo() <= truth + 1e-12 and truth - 1e-12 <= iv.hi()


@pytest.mark.parametrize("k", [5, 10])
@pytest.mark.parametrize("dgp", list(VERDICT_DGPS))
def test_betting_intervals_cover_on_zero_inflated_and_beta_seeds(dgp, k):
    """bounded_ratio_interval covers E[attn] / E[relu] and bounded_mean_interval covers E[relu] (the
    zero-inflated or skewed rate) in >= 0.93 of 200 replications (Monte Carlo se 0.015 at 0.95)."""
    draw_relu, draw_attn = VERDICT_DGPS[dgp]
    rng = np.random.default_rng(31 + k)
    relu, mu_r = draw_relu(rng, (VERDICT_REPS, k))
    attn, mu_a = draw_attn(rng, (VERDICT_REPS, k))
    ratio = np.mean([_covers(stats.bounded_ratio_interval(a, b), mu_a / mu_r) for a, b in zip(attn, relu)])
    mean_r = np.mean([_covers(stats.bounded_mean_interval(b), mu_r) for b in relu])
    assert min(ratio, mean_r) >= VERDICT_LOW, (dgp, k, ratio, mean_r)


@pytest.mark.parametrize("k, r", [(6, 1), (10, 2)])
def test_median_interval_covers_the_median_seed_at_its_exact_coverage(k, r):
    """Log-normal seeds exp(N(0, 1)) (skewness 6.2), population median 1: [x_(r), x_(k+1-r)] covers
    it with probability exactly 1 - 2 P(Bin(k, 1/2) <= r - 1) (0.969 at k = 6, 0.979 at k = 10), for
    any continuous seed distribution. 2,000 replications: within 3 Monte Carlo se (0.0039, 0.0032)."""
    reps = 2000
    exact = 1 - 2 * st.binom.cdf(r - 1, k, 0.5)
    mcse = math.sqrt(exact * (1 - exact) / reps)
    x = np.exp(np.random.default_rng(40 + k).standard_normal((reps, k)))
    cov = np.mean([_covers(stats.median_interval(row), 1.0) for row in x])
    assert exact - 3 * mcse <= cov <= exact + 3 * mcse, (k, cov, exact)


@pytest.mark.parametrize("k", [7, 10])
def test_sign_p_false_rejection_rate_at_the_null(k):
    """Log-normal seeds tested against their true median 1: each one-sided sign test rejects at
    0.025 with probability P(Bin(k, 1/2) >= c) <= 0.025 (c the smallest count that rejects: 1/128
    at k = 7, 11/1024 at k = 10); 2,000 replications, within 3 Monte Carlo se of it."""
    reps = 2000
    c = next(j for j in range(k + 1) if st.binom.sf(j - 1, k, 0.5) <= 0.025)
    exact = st.binom.sf(c - 1, k, 0.5)
    assert exact <= 0.025
    mcse = math.sqrt(0.025 * 0.975 / reps)
    x = np.exp(np.random.default_rng(50 + k).standard_normal((reps, k)))
    for side in ("above", "below"):
        rate = np.mean([stats.sign_p(row, 1.0, side) <= 0.025 for row in x])
        assert rate <= 0.025 + 3 * mcse and abs(rate - exact) <= 3 * math.sqrt(exact * (1 - exact) / reps), (
            k,
            side,
            rate,
            exact,
        )
