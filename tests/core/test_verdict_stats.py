"""Direct tests of the scorecard's verdict tests in attnaudit.core.stats ("verdict tests"): Holm's
adjustment against hand-worked numbers, the seeds a row needs, the order-statistic interval's
exact coverage, the sign test against scipy's binomtest, and the betting test's capital by hand
and its error rate by simulation. Every expected value is computed here without the module's
own helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from attnaudit.core import stats


# ----------------------------------------------------------------------------- Holm
def test_holm_hand_worked_example():
    """p = 0.01, 0.04, 0.03, 0.005. Sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06;
    0.04 x 1 = 0.04, raised to the running maximum 0.06. Back in the given order."""
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])


def test_holm_edge_cases():
    assert stats.holm([]) == []
    assert stats.holm([0.03]) == pytest.approx([0.03])  # a family of one: unadjusted
    assert stats.holm([0.02] * 9) == pytest.approx([0.18] * 9)  # ties: each 9 x 0.02
    assert stats.holm([0.001] + [0.25] * 8) == pytest.approx([0.009] + [1.0] * 8)  # capped at 1
    assert stats.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])


def test_holm_lies_between_the_raw_p_and_bonferroni():
    rng = np.random.default_rng(1)
    for _ in range(200):
        m = int(rng.integers(1, 12))
        p = list(rng.uniform(0, 0.2, m) ** 2)
        adj = stats.holm(p)
        for raw, a in zip(p, adj):
            assert raw - 1e-15 <= a <= min(1.0, m * raw) + 1e-15
        # the adjusted p-values keep the raw ones' order
        order = np.argsort(p, kind="stable")
        assert np.all(np.diff(np.array(adj)[order]) >= -1e-15)


# ----------------------------------------------------------------------------- sign test and order statistics
def test_sign_p_is_scipys_binomtest():
    rng = np.random.default_rng(2)
    for _ in range(100):
        k = int(rng.integers(1, 25))
        v = np.round(rng.normal(0.2, 1.0, k), 1)  # rounded: some seeds sit exactly on the null
        null = 0.0
        up, down = int((v > null).sum()), int((v < null).sum())
        for side, hits in (("above", up), ("below", down)):
            expected = 1.0 if up + down == 0 else st.binomtest(hits, up + down, 0.5, alternative="greater").pvalue
            assert stats.sign_p(v, null, side) == pytest.approx(expected, rel=1e-12)


def _hand_order_interval(values):
    v = sorted(values)
    k = len(v)
    best = 0
    for r in range(1, k // 2 + 1):
        if 1.0 - 2.0 * sum(math.comb(k, j) for j in range(r)) / 2**k >= 0.95:
            best = r
    return best, ((None, None) if best == 0 else (v[best - 1], v[k - best]))


@pytest.mark.parametrize(
    "k, r, coverage, note",
    [
        (6, 1, 1 - 2 / 64, "exact coverage 0.9688"),  # r = 2 would cover only 1 - 14/64 = 0.78
        (10, 2, 1 - 22 / 1024, "exact coverage 0.9785"),  # r = 3: 1 - 112/1024 = 0.89
    ],
)
def test_median_interval_states_its_exact_coverage(k, r, coverage, note):
    values = [float(x) for x in np.random.default_rng(k).permutation(np.arange(1, k + 1) ** 1.5)]
    iv = stats.median_interval(values)
    v = sorted(values)
    assert (iv.low, iv.high) == (v[r - 1], v[k - r])
    assert iv.note == note
    assert float(iv.note.split()[-1]) == pytest.approx(coverage, abs=5e-5)
    # the coverage is the binomial one: 1 - 2 P(Bin(k, 1/2) <= r - 1), by scipy
    assert coverage == pytest.approx(1 - 2 * st.binom.cdf(r - 1, k, 0.5))
    assert iv.estimate == pytest.approx(np.median(values)) and iv.n == k


def test_median_interval_matches_the_hand_sort_and_needs_six_seeds():
    rng = np.random.default_rng(3)
    for k in range(1, 40):
        values = list(rng.lognormal(0.0, 1.0, k))
        best, (lo, hi) = _hand_order_interval(values)
        iv = stats.median_interval(values)
        assert (iv.low, iv.high) == (lo, hi), k
        assert (best == 0) == (k <= 5)
    # 5 seeds: 2 x 2^-5 = 0.0625 > 0.05, so no interval, and the note says 6 would give one
    iv = stats.median_interval([1, 2, 3, 4, 5])
    assert iv.low is None and iv.high is None and "needs 6" in iv.note


# ----------------------------------------------------------------------------- the betting test by hand
def _capital_in_order(xs, m, k=None):
    """The documented rule, one ordering: seed i is bet lambda_i (x_i - m), lambda_i = min(0.9 / m,
    sqrt(2 ln(1 / 0.025) / (k sigma^2))), sigma^2 = (1/4 + sum_{j<i} (x_j - mu_{j-1})^2) / i, with
    mu_{j-1} = (1/2 + sum_{l<j} x_l) / j the running mean before seed j."""
    k = len(xs) if k is None else k
    cap, s1, s2 = 1.0, 0.0, 0.25
    for i, x in enumerate(xs):
        mu = (0.5 + s1) / (i + 1)
        var = s2 / (i + 1)
        lam = min(0.9 / m, math.sqrt(2 * math.log(40.0) / (k * var)))
        cap *= 1 + lam * (x - m)
        s1 += x
        s2 += (x - mu) ** 2
    return cap


def test_betting_capital_by_hand_two_seeds():
    """k = 2, x = 0.3 and 0.5 against m = 0.1, where the variance term binds (0.9 / m = 9):
    order (0.3, 0.5): lambda_1 = sqrt(2 ln 40 / (2 x 1/4)) = 3.841, factor 1.768; sigma^2 =
    (1/4 + 0.2^2) / 2 = 0.145, lambda_2 = sqrt(2 ln 40 / 0.29) = 5.044, factor 3.018; capital 5.336.
    Order (0.5, 0.3): 2.537 x (1 + sqrt(2 ln 40 / 0.25) x 0.2 = 2.087) = 5.293. The test averages
    the orderings (an average of e-values is one): p = 1 / 5.314 = 0.188."""
    lam1 = math.sqrt(2 * math.log(40) / (2 * 0.25))
    first = (1 + lam1 * 0.2) * (1 + math.sqrt(2 * math.log(40) / (2 * 0.145)) * 0.4)
    second = (1 + lam1 * 0.4) * (1 + math.sqrt(2 * math.log(40) / (2 * 0.125)) * 0.2)
    assert lam1 == pytest.approx(3.8413, abs=1e-4)
    assert first == pytest.approx(5.336, abs=1e-3) and second == pytest.approx(5.293, abs=1e-3)
    assert first == pytest.approx(_capital_in_order([0.3, 0.5], 0.1))
    assert stats.bounded_mean_p([0.3, 0.5], 0.1, "above") == pytest.approx(2 / (first + second), rel=1e-12)
    # one ordering is all there is when the two seeds are equal: (1 + 3.841 x 0.2)(1 + 5.044 x 0.2)
    same = (1 + lam1 * 0.2) * (1 + math.sqrt(2 * math.log(40) / (2 * 0.145)) * 0.2)
    assert stats.bounded_mean_p([0.3, 0.3], 0.1, "above") == pytest.approx(1 / same, rel=1e-12)


def test_betting_p_of_more_seeds_averages_rotations_and_reversals():
    """Up to 8 orderings: the k rotations, then their reversals (here k = 3: all 6 orderings)."""
    xs = [0.2, 0.7, 0.4]
    orders = [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]
    caps = [_capital_in_order([xs[i] for i in o], 0.3) for o in orders]
    assert stats.bounded_mean_p(xs, 0.3, "above") == pytest.approx(min(1.0, 1 / np.mean(caps)), rel=1e-12)


def test_betting_p_sides_and_ranges_map_onto_the_unit_interval():
    rng = np.random.default_rng(4)
    for _ in range(20):
        v = list(rng.uniform(-1, 1, 7))
        x = [(a + 1) / 2 for a in v]
        assert stats.bounded_mean_p(v, 0.0, "above", -1.0, 1.0) == pytest.approx(stats.bounded_mean_p(x, 0.5, "above"))
        assert stats.bounded_mean_p(x, 0.4, "below") == pytest.approx(
            stats.bounded_mean_p([1 - a for a in x], 0.6, "above")
        )
    # at the null every bet is on x = m: the capital stays 1
    assert stats.bounded_mean_p([0.5] * 10, 0.5, "above") == pytest.approx(1.0)
    assert stats.bounded_mean_p([], 0.5, "above") == 1.0


# ----------------------------------------------------------------------------- validity by simulation
def _rejection_rate(draws, null, side):
    return float(np.mean([stats.bounded_mean_p(row, null, side) <= 0.025 for row in draws]))


@pytest.mark.parametrize(
    "name, k, reps",
    [("uniform", 5, 2000), ("uniform", 10, 2000), ("uniform", 20, 1000), ("bernoulli0.3", 10, 1000)],
)
def test_bounded_mean_p_rejects_a_true_null_at_most_2_5_percent(name, k, reps):
    """Seeds at their true mean (uniform on [0, 1]: 0.5; 0/1 with P(1) = 0.3: 0.3, the two-point
    law that makes bounded tests work hardest): each one-sided test rejects at 0.025 at most 2.5 %
    of the time, up to 3 Monte Carlo standard errors (sqrt(0.025 x 0.975 / reps): 0.0035 at 2,000
    replications, 0.0049 at 1,000)."""
    rng = np.random.default_rng(5 + k)
    if name == "uniform":
        draws, mean = rng.uniform(0, 1, (reps, k)), 0.5
    else:
        draws, mean = (rng.uniform(0, 1, (reps, k)) < 0.3).astype(float), 0.3
    mcse = math.sqrt(0.025 * 0.975 / reps)
    for side in ("above", "below"):
        rate = _rejection_rate(draws, mean, side)
        assert rate <= 0.025 + 3 * mcse, (name, k, side, rate)


def test_bounded_mean_p_has_power_where_it_should():
    """Not a test that never rejects: 20 uniform seeds on [0.4, 1] (mean 0.7) against 0.5."""
    rng = np.random.default_rng(6)
    draws = rng.uniform(0.4, 1.0, (300, 20))
    assert _rejection_rate(draws, 0.5, "above") >= 0.8


# ----------------------------------------------------------------------------- seeds for power
def _sign_p_above_zero(units):
    return stats.sign_p(units, 0.0, "above")


BASE = np.array([-1.0, -0.5, 0.2, 0.5, 0.8, 1.0, 1.5, 2.0])


def test_seeds_for_power_every_seed_on_one_side():
    """Every resampled seed above 0: the sign test's p is 2^-n, <= 0.025 first at n = 6 (1/64),
    whatever the resampling."""
    assert 2.0**-6 <= 0.025 < 2.0**-5
    assert stats.seeds_for_power(list(BASE + 1.5), _sign_p_above_zero, 0.025) == 6
    # at Holm's strictest level of a family of nine, 0.025 / 9: 2^-9 <= 0.00278 < 2^-8
    assert stats.seeds_for_power(list(BASE + 1.5), _sign_p_above_zero, 0.025 / 9) == 9


def test_seeds_for_power_is_monotone_in_the_observed_effect():
    """A larger observed effect needs no more seeds: shifting every seed up (8/8, 6/8 and 5/8 of
    them above 0) can only lower each resample's p."""
    need = {shift: stats.seeds_for_power(list(BASE + shift), _sign_p_above_zero, 0.025) for shift in (1.5, 0.0, -0.3)}
    assert need[1.5] == 6
    assert need[0.0] is not None and need[1.5] <= need[0.0]
    assert need[-0.3] is None or need[0.0] <= need[-0.3]
    assert need[0.0] > 6  # two seeds of eight below 0: more than the all-above case


def test_seeds_for_power_with_no_effect_returns_none():
    """Half the seeds on each side: no number of seeds up to 200 gives 80 % power."""
    half = [-1.0, -0.5, -0.2, -0.1, 0.1, 0.2, 0.5, 1.0]
    assert stats.seeds_for_power(half, _sign_p_above_zero, 0.025) is None
    assert stats.seeds_for_power([1.0], _sign_p_above_zero, 0.025) is None  # nothing to resample
