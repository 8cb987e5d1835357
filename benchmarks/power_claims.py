"""Power of the claims protocol to resolve an attn/relu flip-rate ratio of 2 (and 3, 9).

The claim "attention is more malleable" is supported only when the 95 % Fieller interval of
the ratio mean(attn flip rate) / mean(relu flip rate), paired by seed, lies entirely above 1
and rests on at least 3 seeds (``attnaudit.core.stats.ratio_interval`` with binomial floors
``trials=(K, K)``, then ``attnaudit.core.stats.decide(iv, 1, "above", k)``). This script measures
how often that happens when the true ratio is 2 (the paper claims 2-9x), for relu mean rates
0.05, 0.1, 0.2, 0.3 (attn = 2x), K = 30 (quick preset) and 200 (paper preset) audited
examples, and k = 3, 5, 10 seeds. For context it also gives the power at 3x and 9x (where
the attn rate stays <= 1) and the rate of a false "supported" at a true ratio of 1.

Data-generating process (the one of benchmarks/bench_coverage.py): seed s trains each model
with a flip probability p_s ~ Beta(mean mu, Var = rho mu (1 - mu)); flips_s ~ Binomial(K, p_s);
rate_s = flips_s / K. The relu and attn models of one seed are coupled by a Gaussian copula
with latent correlation ``corr``. Defaults rho = 0.05 and corr = 0.5: rho = 0.05 is the median
moment estimate over the 35 flip-rate rows of the quick claims run (/tmp/base/claims_quick.json;
per-seed sds of 2-37 points against 2-9 points of binomial noise at K = 30), 0.01 matches the
paper preset's MNIST rows (K = 200, seed sd about 3.4 points at 40 %), 0.2 the zero-inflated
attn rows at low rates (seeds 0, 0, 0.27); the power at 2x under rho = 0.01 and 0.2 is printed
too. The correlation between the two models' seed effects cannot be estimated from 3 seeds;
0.5 is an assumption (a positive one helps a paired interval). Last, the rate of a false
"supported" at a true ratio of 1 when the two models' seeds are dispersed differently
(rho 0.2 for one, 0.01 for the other): a skewed, zero-inflated denominator makes the
interval too narrow exactly when its mean comes out low.

Output: tables, then ``RATIO power_<m>x_k<k>_K<K>_p<p>=<value>`` (p = the relu rate; the
default dispersion; m = 1 is the false-supported rate), ``RATIO power_2x_rho<rho>_k<k>_K<K>_p<p>``
for the other dispersions and ``RATIO false_supported_1x_rho<relu>_<attn>_k<k>_K<K>_p<p>``.
Monte Carlo se at 2,000 replications: at most 0.011. Run: ``python benchmarks/power_claims.py
[--reps 2000] [--rho 0.05] [--corr 0.5]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_coverage import seed_rates  # noqa: E402  (the shared data-generating process)

from attnaudit.core import stats  # noqa: E402

RELU_RATES = (0.05, 0.1, 0.2, 0.3)
KS = (30, 200)
SEEDS = (3, 5, 10)
MULTIPLIERS = (1, 2, 3, 9)


def power(rng, mu_relu: float, mult: float, K: int, k: int, rho: float, corr: float, reps: int) -> dict:
    relu, attn = seed_rates(rng, (mu_relu, mult * mu_relu), rho, corr, k, reps, K)
    supported = unbounded = 0
    lows = np.empty(reps)
    for i in range(reps):
        iv = stats.ratio_interval(attn[i].tolist(), relu[i].tolist(), trials=(K, K))
        supported += stats.decide(iv, 1.0, "above", k)[0] == stats.SUPPORTED
        unbounded += iv.high is None
        lows[i] = iv.lo()
    return dict(power=supported / reps, unbounded=unbounded / reps, median_low=float(np.median(lows)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000, help="replications per setting (default 2000)")
    ap.add_argument("--rho", type=float, default=0.05, help="seed dispersion: Var(p_s) = rho mu (1 - mu)")
    ap.add_argument("--corr", type=float, default=0.5, help="latent correlation of the two models' seed effects")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    lines: dict[str, float] = {}
    print(
        f"P(95 % Fieller interval of attn/relu entirely above 1, k >= 3): rho = {args.rho}, corr = {args.corr}, "
        f"{args.reps} replications per cell"
    )
    print("unb = share of intervals with no finite upper end; low = median lower end")
    for mult in MULTIPLIERS:
        print(f"\ntrue ratio {mult}x" + ("  (a false 'supported': nominal <= 0.025)" if mult == 1 else ""))
        print(f"{'relu':>6} {'attn':>6} {'K':>5} " + " ".join(f"{'k=' + str(k):>24}" for k in SEEDS))
        print(f"{'':>6} {'':>6} {'':>5} " + " ".join(f"{'power   unb    low':>24}" for _ in SEEDS))
        for K in KS:
            for p in RELU_RATES:
                if mult * p > 1:
                    continue
                cells = []
                for k in SEEDS:
                    r = power(rng, p, mult, K, k, args.rho, args.corr, args.reps)
                    cells.append(f"{r['power']:>8.3f} {r['unbounded']:>6.3f} {r['median_low']:>8.3f}")
                    lines[f"power_{mult}x_k{k}_K{K}_p{p:g}"] = r["power"]
                print(f"{p:>6.2f} {mult * p:>6.2f} {K:>5} " + " ".join(f"{c:>24}" for c in cells))
    for rho in (0.01, 0.2):
        if rho == args.rho:
            continue
        print(f"\ntrue ratio 2x, rho = {rho} (sensitivity to the seed dispersion)")
        print(f"{'relu':>6} {'K':>5} " + " ".join(f"{'k=' + str(k):>8}" for k in SEEDS))
        for K in KS:
            for p in RELU_RATES:
                vals = []
                for k in SEEDS:
                    v = power(rng, p, 2, K, k, rho, args.corr, args.reps)["power"]
                    vals.append(v)
                    lines[f"power_2x_rho{rho:g}_k{k}_K{K}_p{p:g}"] = v
                print(f"{p:>6.2f} {K:>5} " + " ".join(f"{v:>8.3f}" for v in vals))
    print(
        "\nfalse 'supported' at a true ratio of 1 when the two models' seeds are dispersed differently "
        "(rho_relu, rho_attn; nominal <= 0.025)"
    )
    print(f"{'rate':>6} {'K':>5} {'rho_relu':>9} {'rho_attn':>9} " + " ".join(f"{'k=' + str(k):>8}" for k in SEEDS))
    for K in KS:
        for p in RELU_RATES:
            for rhos in ((0.2, 0.01), (0.01, 0.2)):
                vals = []
                for k in SEEDS:
                    v = power(rng, p, 1, K, k, rhos, args.corr, args.reps)["power"]
                    vals.append(v)
                    lines[f"false_supported_1x_rho{rhos[0]:g}_{rhos[1]:g}_k{k}_K{K}_p{p:g}"] = v
                print(f"{p:>6.2f} {K:>5} {rhos[0]:>9g} {rhos[1]:>9g} " + " ".join(f"{v:>8.3f}" for v in vals))
    print()
    for name, v in lines.items():
        print(f"RATIO {name}={v:.4f}")
    print(f"RATIO power_wall_s={time.perf_counter() - t0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
