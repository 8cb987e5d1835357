"""Benchmark: coverage of attnaudit.core.stats' few-seed intervals, measured by simulation.

Every interval in :mod:`attnaudit.core.stats` claims 95 % coverage from k = 3 or 5 seeds. This
script draws many synthetic experiments from a known truth, builds each interval with the
real function of ``attnaudit.core.stats`` (a plain Python loop: one call costs about 50-70 us,
dominated by scipy's t quantile, so no re-implementation is needed and the real code is the
one measured) and counts how often it contains the truth.

Data-generating processes
-------------------------

1. **Seed-mean** (``mean_interval``; seed slopes, one log-log slope per seed): k i.i.d.
   per-seed values from

   * ``normal``: N(0, 1) (the t-interval is exact here; location and scale do not matter);
   * ``t3``: Student t with 3 degrees of freedom (heavy tails, symmetric; truth 0);
   * ``lognorm0.5`` / ``lognorm1``: exp(N(0, s^2)) with s = 0.5 (skewness 1.8) and s = 1
     (skewness 6.2), truth exp(s^2 / 2). Slopes fitted on 4-6 widths are not this skewed;
     lognorm1 is a deliberately hard case, reported, not a guarantee.

2. **Flip rate of one model** (``proportion_interval``) and **flip-rate ratio / difference of
   two models** (``ratio_interval``, ``difference_interval``): seed s trains a model whose
   flip probability is p_s ~ Beta with mean mu (the model's true mean rate) and intra-seed
   correlation rho, i.e. Var(p_s) = rho mu (1 - mu) (Beta(mu (1/rho - 1), (1 - mu)(1/rho - 1)));
   then flips_s ~ Binomial(K, p_s) over the K audited examples and rate_s = flips_s / K
   (a beta-binomial rate). The two models of one seed share the seed's data, so their
   seed effects are coupled by a Gaussian copula with latent correlation ``corr``
   (z_attn = corr z_relu + sqrt(1 - corr^2) e, p = F_Beta^-1(Phi(z))). Models and seeds are
   otherwise independent. Targets: mu (rate), mu_attn / mu_relu = E[p_attn] / E[p_relu]
   (ratio; an interval with an unbounded end that contains the truth covers it) and
   mu_attn - mu_relu (difference).

   Parameters: K = 30 (quick preset) and 200 (paper preset); k = 3 and 5; mu from 0.05 to 0.9;
   rho in {0.01, 0.05, 0.2}; corr in {0, 0.5}.

3. **Ratio with the two models dispersed differently**: as 2, but rho_relu != rho_attn (0.2 and
   0.01, both ways round), corr 0.5, k = 3, 5, 10, true ratios 1 and 2. Two different
   architectures need not vary alike over seeds (in the quick run the attn rows are the
   zero-inflated ones at low rates, the relu rows near binomial, and the other way round for
   some relu controls). Besides coverage this family reports ``above1``: at a true ratio of
   1 it is the rate of a false "attention is more malleable" verdict (nominal <= 0.025).

Why these are realistic. The quick claims run (/tmp/base/claims_quick.json: digits, K = 30,
3 seeds, 35 model x attack rows with a mean rate strictly between 0 and 1) has per-seed
flip-rate sds of 2-37 percentage points, against 2-9 points of pure binomial noise: the
moment estimate of rho, (sd^2 - m (1 - m) / K) / (m (1 - m)), has median 0.055 and mean 0.09
over those rows, up to 0.26 for the attn rows at low rates (seeds 0, 0, 0.27: a training
either flips its ranking or it does not) and 0.6 for one sign-noise row. Each estimate rests
on 2 degrees of freedom, so they are rough; rho = 0.05 is the central case, 0.2 the
zero-inflated low-rate case, 0.01 the paper preset's MNIST rows (docs/malleability.md:
relu 39.6 % [35.4, 43.8] over 5 seeds at K = 200 is a seed sd of about 3.4 points, close to
binomial). The copula correlation between the two models' seed effects is not measurable
from 3 seeds; 0 and 0.5 bracket it (the Fieller and paired intervals use the observed
covariance, so a positive correlation helps them).

Reference procedures (wrong on purpose, to show the simulation can fail a procedure):
``normal_2sd`` is mean +- 2 sd / sqrt(k) (for the ratio: the delta method r +- 2 se, se =
sd(a - r b) / (sqrt(k) mean(b))); ``bootstrap_percentile`` is the percentile bootstrap over
seeds (paired for the ratio), computed exactly over all k^k equally likely resamples (the
limit of an infinite number of bootstrap draws; resamples with a zero mean denominator are
dropped, as attnaudit.analyses.malleability.malleability's bootstrap does, and where all are, the case counts as
covered).

Output: one table per family (coverage, its Monte Carlo standard error is
sqrt(c (1 - c) / reps) = 0.005 at 2,000 reps; for the ratio also the share of Fieller
intervals with no finite upper end), then ``RATIO coverage_<procedure>=<value>`` lines: the
minimum coverage over that procedure's settings (``..._rho_le_0.05_...``: over the settings
with rho <= 0.05 only; ``..._asym_...``: family 3), and ``RATIO false_above1_max_...``: the
largest share of intervals entirely above 1 over the settings whose true ratio is <= 1. Run: ``python benchmarks/bench_coverage.py
[--reps 2000] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import numpy as np
from scipy import special, stats as st

from attnaudit.core import stats

# ------------------------------------------------------------------ data-generating processes

MEAN_DISTS = ("normal", "t3", "lognorm0.5", "lognorm1")
RATE_MUS = (0.05, 0.1, 0.3, 0.5, 0.9)
# (mu_relu, mu_attn): ratios 1, 3, 2, 9, 2, 0.75, 2, 0.5
RATIO_PAIRS = ((0.05, 0.05), (0.05, 0.15), (0.1, 0.2), (0.1, 0.9), (0.3, 0.6), (0.4, 0.3), (0.45, 0.9), (0.9, 0.45))
KS = (30, 200)
RHOS = (0.01, 0.05, 0.2)
CORRS = (0.0, 0.5)
SEEDS = (3, 5)


def seed_values(rng: np.random.Generator, dist: str, k: int, reps: int) -> tuple[np.ndarray, float]:
    """(reps, k) per-seed values of ``dist`` and its true mean."""
    if dist == "normal":
        return rng.standard_normal((reps, k)), 0.0
    if dist == "t3":
        return rng.standard_t(3, (reps, k)), 0.0
    if dist.startswith("lognorm"):
        s = float(dist[len("lognorm") :])
        return np.exp(s * rng.standard_normal((reps, k))), math.exp(s * s / 2)
    raise ValueError(dist)


def beta_ppf(u: np.ndarray, mu: float, rho: float) -> np.ndarray:
    """Seed-level rate p = F^-1(u) of Beta with mean mu and Var = rho mu (1 - mu); rho 0: p = mu."""
    if rho <= 0:
        return np.full_like(u, mu)
    phi = 1.0 / rho - 1.0
    return st.beta.ppf(u, mu * phi, (1.0 - mu) * phi)


def seed_rates(
    rng: np.random.Generator, mus: tuple[float, ...], rho, corr: float, k: int, reps: int, K: int
) -> list[np.ndarray]:
    """Observed flip rates, one (reps, k) array per model: p_s from a Gaussian copula of Beta seed
    effects (latent correlation ``corr`` between the models of one seed), flips ~ Binomial(K, p_s).
    ``rho``: one dispersion for all models, or one per model."""
    rhos = tuple(rho) if isinstance(rho, (tuple, list)) else (rho,) * len(mus)
    z0 = rng.standard_normal((reps, k))
    out = []
    for j, mu in enumerate(mus):
        z = z0 if j == 0 else corr * z0 + math.sqrt(1.0 - corr * corr) * rng.standard_normal((reps, k))
        p = beta_ppf(special.ndtr(z), mu, rhos[j])
        out.append(rng.binomial(K, np.clip(p, 0.0, 1.0)) / K)
    return out


# ------------------------------------------------------------------ procedures: (lo, hi) arrays


def _loop(fn, *arrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """lo, hi (with -inf / inf for an unbounded end) and 'no finite upper end' of the real stats function."""
    n = arrays[0].shape[0]
    lo, hi, unb = np.empty(n), np.empty(n), np.zeros(n, bool)
    for i in range(n):
        iv = fn(*(a[i].tolist() for a in arrays))
        lo[i], hi[i], unb[i] = iv.lo(), iv.hi(), iv.high is None
    return lo, hi, unb


def mean_t(x):
    return _loop(stats.mean_interval, x)[:2]


def proportion(x, K):
    return _loop(lambda v: stats.proportion_interval(v, K), x)[:2]


def fieller(num, den, K):
    return _loop(lambda a, b: stats.ratio_interval(a, b, trials=(K, K)), num, den)


def difference(a, b):
    return _loop(stats.difference_interval, a, b)[:2]


def normal_2sd(x):
    k = x.shape[1]
    m, sd = x.mean(1), x.std(1, ddof=1)
    return m - 2 * sd / math.sqrt(k), m + 2 * sd / math.sqrt(k)


def normal_2sd_ratio(num, den):
    k = num.shape[1]
    ma, mb = num.mean(1), den.mean(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = ma / mb
        se = (num - r[:, None] * den).std(1, ddof=1) / math.sqrt(k) / mb
        lo, hi = r - 2 * se, r + 2 * se
    undefined = ~(mb > 0)
    lo[undefined], hi[undefined] = -np.inf, np.inf
    return lo, hi


_WEIGHTS: dict[int, np.ndarray] = {}


def _resample_weights(k: int) -> np.ndarray:
    """(k^k, k): the share of each seed in each of the k^k equally likely bootstrap resamples."""
    if k not in _WEIGHTS:
        idx = np.array(list(itertools.product(range(k), repeat=k)))
        w = np.zeros((len(idx), k))
        for j in range(k):
            w[:, j] = (idx == j).sum(1) / k
        _WEIGHTS[k] = w
    return _WEIGHTS[k]


def bootstrap_percentile(x):
    means = x @ _resample_weights(x.shape[1]).T
    lo, hi = np.percentile(means, [2.5, 97.5], axis=1)
    return lo, hi


def bootstrap_percentile_ratio(num, den):
    w = _resample_weights(num.shape[1])
    a, b = num @ w.T, den @ w.T
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(b > 0, a / b, np.nan)
    lo, hi = np.full(len(r), -np.inf), np.full(len(r), np.inf)
    ok = np.isfinite(r).any(1)
    if ok.any():
        lo[ok], hi[ok] = np.nanpercentile(r[ok], [2.5, 97.5], axis=1)
    return lo, hi


def covered(lohi, truth: float) -> float:
    lo, hi = lohi[0], lohi[1]
    return float(np.mean((lo <= truth + 1e-12) & (truth - 1e-12 <= hi)))


# ------------------------------------------------------------------ the three families


def run_mean(reps: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for dist in MEAN_DISTS:
        for k in SEEDS:
            x, truth = seed_values(rng, dist, k, reps)
            rows.append(
                dict(
                    dist=dist,
                    k=k,
                    mean_t=covered(mean_t(x), truth),
                    normal_2sd=covered(normal_2sd(x), truth),
                    bootstrap_percentile=covered(bootstrap_percentile(x), truth),
                )
            )
    return rows


def run_rate(reps: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for mu in RATE_MUS:
        for K in KS:
            for rho in RHOS:
                for k in SEEDS:
                    (x,) = seed_rates(rng, (mu,), rho, 0.0, k, reps, K)
                    rows.append(
                        dict(
                            mu=mu,
                            K=K,
                            rho=rho,
                            k=k,
                            proportion=covered(proportion(x, K), mu),
                            normal_2sd=covered(normal_2sd(x), mu),
                            bootstrap_percentile=covered(bootstrap_percentile(x), mu),
                        )
                    )
    return rows


def _ratio_row(rng, mu_r, mu_a, K, rho, corr, k, reps, references=True) -> dict:
    relu, attn = seed_rates(rng, (mu_r, mu_a), rho, corr, k, reps, K)
    truth = mu_a / mu_r
    lo, hi, unb = fieller(attn, relu, K)
    row = dict(
        fieller=covered((lo, hi), truth),
        unbounded=float(unb.mean()),
        above1=float(np.mean(lo > 1)),
        difference=covered(difference(attn, relu), mu_a - mu_r),
    )
    if references:
        row.update(
            normal_2sd=covered(normal_2sd_ratio(attn, relu), truth),
            bootstrap_percentile=covered(bootstrap_percentile_ratio(attn, relu), truth),
        )
    return row


def run_ratio(reps: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for mu_r, mu_a in RATIO_PAIRS:
        for K in KS:
            for rho in RHOS:
                for corr in CORRS:
                    for k in SEEDS:
                        rows.append(
                            dict(
                                mu_relu=mu_r,
                                mu_attn=mu_a,
                                K=K,
                                rho=rho,
                                corr=corr,
                                k=k,
                                **_ratio_row(rng, mu_r, mu_a, K, rho, corr, k, reps),
                            )
                        )
    return rows


# the two models with different seed dispersions (one zero-inflated, one near binomial), corr 0.5
ASYM_PAIRS = ((0.05, 0.05), (0.1, 0.1), (0.2, 0.2), (0.3, 0.3), (0.1, 0.2), (0.3, 0.6))
ASYM_RHOS = ((0.2, 0.01), (0.01, 0.2))  # (rho_relu, rho_attn)
ASYM_SEEDS = (3, 5, 10)


def run_ratio_asym(reps: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for mu_r, mu_a in ASYM_PAIRS:
        for K in KS:
            for rho_r, rho_a in ASYM_RHOS:
                for k in ASYM_SEEDS:
                    rows.append(
                        dict(
                            mu_relu=mu_r,
                            mu_attn=mu_a,
                            K=K,
                            rho_relu=rho_r,
                            rho_attn=rho_a,
                            k=k,
                            **_ratio_row(rng, mu_r, mu_a, K, (rho_r, rho_a), 0.5, k, reps, references=False),
                        )
                    )
    return rows


# ------------------------------------------------------------------ output


def _table(title: str, rows: list[dict], keys: list[str]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{k:>10}" for k in keys))
    for r in rows:
        print("  ".join(f"{r[k]:>10.3f}" if isinstance(r[k], float) else f"{r[k]!s:>10}" for k in keys))


def ratio_lines(mean_rows, rate_rows, ratio_rows, asym_rows) -> dict[str, float]:
    def mn(rows, key, k, where=lambda r: True, f=min):
        vals = [r[key] for r in rows if r["k"] == k and where(r)]
        return f(vals) if vals else float("nan")

    def moderate(r):
        return r["rho"] <= 0.05

    out = {}
    for k in SEEDS:
        out[f"mean_t_k{k}"] = mn(mean_rows, "mean_t", k, lambda r: r["dist"] == "normal")
        out[f"mean_t_nonnormal_k{k}"] = mn(mean_rows, "mean_t", k, lambda r: r["dist"] != "normal")
    for k in SEEDS:
        out[f"proportion_k{k}"] = mn(rate_rows, "proportion", k)
    for k in SEEDS:
        out[f"fieller_k{k}"] = mn(ratio_rows, "fieller", k)
    for k in SEEDS:
        out[f"difference_k{k}"] = mn(ratio_rows, "difference", k)
    # the same at moderate seed dispersion only (rho <= 0.05: the quick run's median and below)
    for k in SEEDS:
        out[f"proportion_rho_le_0.05_k{k}"] = mn(rate_rows, "proportion", k, moderate)
        out[f"fieller_rho_le_0.05_k{k}"] = mn(ratio_rows, "fieller", k, moderate)
        out[f"difference_rho_le_0.05_k{k}"] = mn(ratio_rows, "difference", k, moderate)
    # the two models with different dispersions: coverage, and how often a true ratio <= 1 is
    # declared above 1 (the false "attention is more malleable"; nominal <= 0.025)
    for k in ASYM_SEEDS:
        out[f"fieller_asym_k{k}"] = mn(asym_rows, "fieller", k)
        out[f"false_above1_max_fieller_asym_k{k}"] = mn(
            asym_rows, "above1", k, lambda r: r["mu_attn"] <= r["mu_relu"], max
        )
    for k in SEEDS:
        out[f"false_above1_max_fieller_k{k}"] = mn(ratio_rows, "above1", k, lambda r: r["mu_attn"] <= r["mu_relu"], max)
    # the reference procedures on normal seed values (where mean_t is exact), then on each family
    for k in SEEDS:
        out[f"normal_2sd_k{k}"] = mn(mean_rows, "normal_2sd", k, lambda r: r["dist"] == "normal")
        out[f"bootstrap_percentile_k{k}"] = mn(mean_rows, "bootstrap_percentile", k, lambda r: r["dist"] == "normal")
    for k in SEEDS:
        out[f"normal_2sd_rate_k{k}"] = mn(rate_rows, "normal_2sd", k)
        out[f"bootstrap_percentile_rate_k{k}"] = mn(rate_rows, "bootstrap_percentile", k)
        out[f"normal_2sd_ratio_k{k}"] = mn(ratio_rows, "normal_2sd", k)
        out[f"bootstrap_percentile_ratio_k{k}"] = mn(ratio_rows, "bootstrap_percentile", k)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000, help="replications per setting (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="numpy generator seed (default 0)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    mean_rows = run_mean(args.reps, rng)
    t1 = time.perf_counter()
    rate_rows = run_rate(args.reps, rng)
    t2 = time.perf_counter()
    ratio_rows = run_ratio(args.reps, rng)
    t3 = time.perf_counter()
    asym_rows = run_ratio_asym(args.reps, rng)
    t4 = time.perf_counter()
    print(
        f"coverage of nominal 95 % intervals, {args.reps} replications per setting "
        f"(Monte Carlo se about {math.sqrt(0.95 * 0.05 / args.reps):.3f} at 0.95)"
    )
    _table(
        f"seed-mean family (mean_interval; {t1 - t0:.1f} s)",
        mean_rows,
        ["dist", "k", "mean_t", "normal_2sd", "bootstrap_percentile"],
    )
    _table(
        f"flip-rate family (proportion_interval, trials = K; {t2 - t1:.1f} s)",
        rate_rows,
        ["mu", "K", "rho", "k", "proportion", "normal_2sd", "bootstrap_percentile"],
    )
    _table(
        f"flip-rate ratio attn/relu (ratio_interval, trials = (K, K)) and difference "
        f"(difference_interval); unbounded = share with no finite upper end, above1 = share "
        f"whose low end > 1 ({t3 - t2:.1f} s)",
        ratio_rows,
        [
            "mu_relu",
            "mu_attn",
            "K",
            "rho",
            "corr",
            "k",
            "fieller",
            "unbounded",
            "above1",
            "difference",
            "normal_2sd",
            "bootstrap_percentile",
        ],
    )
    _table(
        f"flip-rate ratio, the two models' seeds dispersed differently (corr 0.5; above1 at a true "
        f"ratio of 1 is a false 'attention is more malleable'; {t4 - t3:.1f} s)",
        asym_rows,
        ["mu_relu", "mu_attn", "K", "rho_relu", "rho_attn", "k", "fieller", "unbounded", "above1", "difference"],
    )
    print()
    for name, v in ratio_lines(mean_rows, rate_rows, ratio_rows, asym_rows).items():
        print(f"RATIO {'' if name.startswith('false_') else 'coverage_'}{name}={v:.4f}")
    print(f"RATIO coverage_wall_s={t4 - t0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
