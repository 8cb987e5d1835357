"""Coverage of the claims scorecard's intervals over a grid of truths, through the real scoring.

Every replication writes synthetic command reports from a known truth (benchmarks/claims_synth.py
describes the data-generating processes), passes them to ``attnaudit.claims.scorecard.score`` and
checks whether each row's ``interval`` (None ends unbounded) contains the truth:

* ``ratio``: the malleability row's interval of E[p_attn] / E[p_relu] (betting, paired);
* ``excess_attn`` / ``excess_relu``: the attack-minus-noise-control interval of each model
  (the row's ``controls``), truth E[p_attack] - E[p_control];
* ``slope_relu`` / ``slope_attn`` / ``slope_diff``: the NTK rows' median-seed intervals, truth the
  population median of the per-seed least-squares slope (or of the paired difference) over the
  widths the row keeps (200,000 Monte Carlo draws per setting);
* ``logratio_lambda`` / ``logratio_trace`` (landscape) and ``logratio_contrast`` /
  ``logratio_principal`` / ``logratio_labels`` (alignment): the median seed's log ratio.

With 5 seeds an exact 95 % median interval does not exist and both ends are unbounded (it
covers). Grid: flip-rate pairs (relu, attn) = (3.3 %, 28.9 %) (the paper's), (10 %, 20 %),
(30 %, 15 %), (5 %, 45 %), (20 %, 20 %) at K = 30 and 200 audited examples, seed dispersion rho
0.01 / 0.05 / 0.2 (k = 10) and 0.05 (k = 5); at 2x also zero-inflated seeds (relu, attn, both),
clusters of 5 flips, a data-split effect, a negative copula correlation, mean rates 2 % / 4 %,
and a control equal to the attack; slopes (relu, attn) = (-0.5, 0.3) and (0, -0.04) with
normal, right- and left-skewed log-normal and t3 seed noise, and width-16 cells at chance;
landscape and alignment log ratios at log 2, 0 and -log 2. Where a row's truth lies in its
null the share of (Holm-adjusted) "supported" verdicts is printed too.

Output: ``RATIO coverage_<procedure>_<setting>`` (target >= 0.93; Monte Carlo se about 0.01 at
the default replications), ``RATIO false_supported_<setting>`` where a row's truth is in its null
(target <= 0.025 + 3 MCSE), ``BASELINE coverage_<procedure>_<setting>``: the retired procedures
(Student-t mean, Fieller's ratio with binomial floors, paired t difference) on the same
replications against their own estimands (means), then ``RATIO coverage_min``, ``RATIO
false_supported_max`` and the wall time. Run: ``python benchmarks/bench_coverage.py [--reps N]
[--seed S] [--quick] [--seeds-needed]``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import claims_synth as S  # noqa: E402  (the shared data-generating processes and scoring loop)
from claims_synth import AlignSetting, LandSetting, MallSetting, NtkSetting, Rate  # noqa: E402

DEFAULT_REPS = 350
QUICK_REPS = 40
PAIRS = {"paper": (0.033, 0.289), "2x": (0.1, 0.2), "half": (0.3, 0.15), "9x": (0.05, 0.45), "1x": (0.2, 0.2)}
NOISES = ("normal", "lognorm", "neglognorm", "t3")
SLOPES = {"apart": (-0.5, 0.3), "flat": (0.0, -0.04)}
LOG2 = math.log(2.0)
LOGRATIOS = {"up": LOG2, "zero": 0.0, "down": -LOG2}


def mall(name: str, pair: str, k: int, K: int, rho: float = 0.05, **kw) -> MallSetting:
    r, a = PAIRS[pair]
    kw.setdefault("relu", Rate(r, rho))
    kw.setdefault("attn", Rate(a, rho))
    return MallSetting(f"{name}_K{K}_k{k}", purpose="coverage", k=k, K=K, **kw)


def settings(quick: bool) -> list:
    if quick:
        return [
            mall("mall_2x_rho0.05", "2x", 10, 30),
            mall("mall_zero_both_2x", "2x", 5, 200, relu=Rate(0.2, 0.05, 0.5), attn=Rate(0.4, 0.05, 0.5)),
            NtkSetting(
                "ntk_apart_lognorm_k10", purpose="coverage", k=10, relu_median=-0.5, attn_median=0.3, noise="lognorm"
            ),
            LandSetting("land_zero_t3_k10", purpose="coverage", k=10, lam=0.0, trace=0.0, noise="t3"),
            AlignSetting(
                "align_up_lognorm_k10",
                purpose="coverage",
                k=10,
                principal=LOG2,
                labels=0.0,
                contrast=-LOG2,
                noise="lognorm",
            ),
        ]
    out: list = []
    for pair in PAIRS:
        for K in (30, 200):
            for rho in (0.01, 0.05, 0.2):
                out.append(mall(f"mall_{pair}_rho{rho:g}", pair, 10, K, rho))
            out.append(mall(f"mall_{pair}_rho0.05", pair, 5, K, 0.05))
    zr, za = Rate(0.2, 0.05, 0.5), Rate(0.4, 0.05, 0.5)  # zero-inflated (p_s = 0 w.p. 0.5), means 0.1 / 0.2
    for k in (5, 10):
        out += [
            mall("mall_zero_relu_2x", "2x", k, 200, relu=zr),
            mall("mall_zero_attn_2x", "2x", k, 200, attn=za),
            mall("mall_zero_both_2x", "2x", k, 200, relu=zr, attn=za),
            mall("mall_cluster5_2x", "2x", k, 30, cluster=5),
            mall("mall_split1_2x", "2x", k, 200, split=1.0),
            mall("mall_negcorr_2x", "2x", k, 200, corr=-0.5),
            mall("mall_mu0.02_2x", "2x", k, 30, relu=Rate(0.02), attn=Rate(0.04)),
            mall("mall_ctrl_eq_attack_2x", "2x", k, 200, ctrl_attn=Rate(0.2), ctrl_relu=Rate(0.1)),
        ]
    for k in (5, 10):
        for noise in NOISES:
            for name, (r, a) in SLOPES.items():
                out.append(
                    NtkSetting(
                        f"ntk_{name}_{noise}_k{k}", purpose="coverage", k=k, relu_median=r, attn_median=a, noise=noise
                    )
                )
            for name, v in LOGRATIOS.items():
                out.append(
                    LandSetting(f"land_{name}_{noise}_k{k}", purpose="coverage", k=k, lam=v, trace=-v, noise=noise)
                )
            out.append(
                AlignSetting(
                    f"align_{noise}_k{k}",
                    purpose="coverage",
                    k=k,
                    principal=LOG2,
                    labels=0.0,
                    contrast=-LOG2,
                    noise=noise,
                )
            )
        out += [
            NtkSetting(
                f"ntk_apart_chance_k{k}", purpose="coverage", k=k, relu_median=-0.5, attn_median=0.3, chance="relu"
            ),
            NtkSetting(
                f"ntk_flat_chance_k{k}", purpose="coverage", k=k, relu_median=0.0, attn_median=-0.04, chance="attn"
            ),
        ]
    return out


def main(argv=None) -> int:
    args = S.parse_synth_args(__doc__, argv, DEFAULT_REPS, QUICK_REPS)
    reps = args.reps or (QUICK_REPS if args.quick else DEFAULT_REPS)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    todo = settings(args.quick)
    print(
        f"claims scorecard interval coverage: {len(todo)} settings x {reps} replications, scored by "
        f"attnaudit.claims.scorecard.score; seeds_needed {'computed' if args.seeds_needed else 'skipped'} "
        f"(Monte Carlo se about {math.sqrt(0.95 * 0.05 / reps):.3f} at 0.95)"
    )
    outcomes = []
    with S.seeds_needed(args.seeds_needed):
        for s in todo:
            outcomes.append(S.run_setting(s, reps, rng))
    S.report(outcomes, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
