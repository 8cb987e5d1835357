"""Error rates of the claims scorecard's verdicts at the null boundaries, through the real scoring.

Every replication writes synthetic command reports from a known truth (benchmarks/claims_synth.py
describes the data-generating processes), passes them to ``attnaudit.claims.scorecard.score`` and
reads its rows, so gates, replicate counting, seeds left out, the ratio with no point estimate
and Holm's adjustment are the scorecard's own. The truth of each targeted row sits exactly at
its null boundary (the worst case for a false "supported"): the flip-rate ratio at
scorecard.MIN_RATIO with attention's attack far above its noise control, or the attack equal to
its control (a false "beats noise") at the paper's ratio; the NTK rows' median per-seed slope at
-SLOPE_MARGIN ("approaches"), at +-SLOPE_MARGIN (the equivalence row) and the median slope
difference at +SLOPE_MARGIN ("more slowly"); the landscape and alignment rows' median log ratio
at log MIN_RATIO. The null values are checked against each row's own ``null_value``.

Settings (k = 5 and 10 seeds): flip rates with seed dispersion rho 0.01 / 0.05 / 0.2 at K = 30
and 200 audited examples; zero-inflated seed rates (relu, attn, both; and relu at 1 % with 80 %
of seeds at 0, where the ratio often has no point estimate); mean rates 0.02 and 0.03; a
negative copula correlation; flips in clusters of 5; a data-split effect shared by both models;
20 seeds at rates of 30 % (there the noise-control test passes, so the ratio test alone guards
the boundary: at k <= 10 the control's betting test rarely rejects and keeps the malleability
row's false "supported" near 0 whatever the ratio test does); slopes with normal, shifted log-normal and t3 seed noise, and with some width-16 cells
at chance; landscape and alignment log ratios with symmetric and skewed seed noise, and
landscape seeds left out for unmatched losses. Abstention settings (failed cells, models at
chance) report how often any verdict was issued (target 0). The family-wise setting puts all
nine seed-based rows at their nulls in one score() call. Power at the paper's effect (attn
28.9 %, relu 3.3 % flips; slopes -0.33 relu, -0.04 attn) is printed for context: the
malleability and NTK runs scored together (Holm over their 4 rows).

Output, one line each: ``RATIO false_supported_<setting>`` (the Holm-adjusted ``row.verdict``;
target <= 0.025 + 3 MCSE) with ``raw_false_supported_<setting>`` (before Holm, info) and ``RATIO
false_interval_side_<setting>`` (the row's interval alone lies on the claim's side of the null:
for the malleability row the ratio's interval without the noise control);
``RATIO coverage_<procedure>_<setting>`` of every interval a verdict uses (target >= 0.93);
``RATIO verdict_issued_<setting>`` (abstention settings, target 0);
``RATIO false_supported_family_global_null``; ``RATIO power_<setting>_<row>``; ``BASELINE ...``:
the retired procedures (Student t, Fieller with binomial floors, no Holm) on the same
replications; then ``RATIO false_supported_max``, ``RATIO coverage_min``, ``RATIO
verdict_issued_max`` and the wall time. Run: ``python benchmarks/power_claims.py [--reps N]
[--seed S] [--quick] [--seeds-needed]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import claims_synth as S  # noqa: E402  (the shared data-generating processes and scoring loop)
from claims_synth import AlignSetting, FamilySetting, LandSetting, MallSetting, NtkSetting, Rate  # noqa: E402

DEFAULT_REPS = 450
QUICK_REPS = 40
PAPER = dict(relu=Rate(0.033), attn=Rate(0.289))
NOISES = ("normal", "lognorm", "t3")


def boundary_mall(name: str, k: int, K: int, **kw) -> MallSetting:
    kw.setdefault("relu", Rate(0.1))
    kw.setdefault("attn", kw["relu"])
    return MallSetting(f"{name}_K{K}_k{k}", k=k, K=K, ratio=S.MIN_RATIO, **kw)


def settings(quick: bool) -> list:
    d = S.SLOPE_MARGIN
    out: list = []
    ks = (5, 10)
    if quick:
        return [
            boundary_mall("mall_rho0.05", 10, 30),
            MallSetting("mall_ctrl_eq_attack_K200_k10", k=10, K=200, ctrl_attn=PAPER["attn"], **PAPER),
            MallSetting("mall_failed_K200_k10", purpose="abstain", k=10, K=200, failed=True, **PAPER),
            approach("ntk_approach_lognorm_k10", k=10, noise="lognorm"),
            flat("ntk_flat_hi_chance_k10", k=10, attn_median=d, chance="attn"),
            LandSetting("land_lognorm_k10", k=10, noise="lognorm"),
            AlignSetting("align_t3_k10", k=10, noise="t3"),
            family(10),
            paper(10),
        ]
    # flip rates
    for k in ks:
        for K in (30, 200):
            for rho in (0.01, 0.05, 0.2):
                out.append(boundary_mall(f"mall_rho{rho:g}", k, K, relu=Rate(0.1, rho)))
        zr, za = Rate(0.2, 0.05, 0.5), Rate(0.1, 0.05)  # zero-inflated: p_s = 0 with probability 0.5
        out += [
            boundary_mall("mall_zero_relu", k, 200, relu=zr, attn=za),
            boundary_mall("mall_zero_attn", k, 200, relu=za, attn=zr),
            boundary_mall("mall_zero_both", k, 200, relu=zr, attn=zr),
            boundary_mall("mall_mu0.02", k, 30, relu=Rate(0.02)),
            boundary_mall("mall_mu0.03", k, 30, relu=Rate(0.03)),
            # relu flips on no seed in a large share of runs: the ratio with no point estimate
            boundary_mall("mall_zero0.8_mu0.01", k, 30, relu=Rate(0.05, 0.05, 0.8)),
            boundary_mall("mall_negcorr", k, 200, corr=-0.5),
            boundary_mall("mall_cluster5", k, 30, cluster=5),
            boundary_mall("mall_split1", k, 200, split=1.0),
        ]
        for K in (30, 200):  # attention's attack no stronger than its noise control, at the paper's ratio
            out.append(MallSetting(f"mall_ctrl_eq_attack_K{K}_k{k}", k=k, K=K, ctrl_attn=PAPER["attn"], **PAPER))
    # 20 seeds at high rates: where the noise-control test passes, so the ratio test alone stands between
    # the boundary and a false "supported" (at k <= 10 the control's betting test rarely rejects)
    for K in (30, 200):
        out.append(boundary_mall("mall_hi_rho0.05", 20, K, relu=Rate(0.3)))
    # slopes, log ratios
    for k in ks:
        for noise in NOISES:
            out += [
                approach(f"ntk_approach_{noise}_k{k}", k=k, noise=noise),
                flat(f"ntk_flat_hi_{noise}_k{k}", k=k, attn_median=d, noise=noise),
                flat(f"ntk_flat_lo_{noise}_k{k}", k=k, attn_median=-d, noise=noise),
                slower(f"ntk_slower_{noise}_k{k}", k=k, noise=noise),
                LandSetting(f"land_{noise}_k{k}", k=k, noise=noise),
                AlignSetting(f"align_{noise}_k{k}", k=k, noise=noise),
            ]
        out += [
            approach(f"ntk_approach_chance_k{k}", k=k, chance="relu"),
            flat(f"ntk_flat_hi_chance_k{k}", k=k, attn_median=d, chance="attn"),
            slower(f"ntk_slower_chance_k{k}", k=k, chance="relu"),
            LandSetting(f"land_dropped_k{k}", k=k, noise="lognorm", dropped=0.25),
        ]
    # abstention: failed cells, models at chance (at the paper's effect, where a verdict would come)
    for k in ks:
        out += [
            MallSetting(f"mall_failed_K200_k{k}", purpose="abstain", k=k, K=200, failed=True, **PAPER),
            MallSetting(f"mall_chance_K200_k{k}", purpose="abstain", k=k, K=200, at_chance=True, **PAPER),
            NtkSetting(f"ntk_failed_k{k}", purpose="abstain", k=k, failed=True),
            LandSetting(f"land_chance_k{k}", purpose="abstain", k=k, lam=1.0, trace=1.0, at_chance=True),
        ]
    out.append(family(10))
    out += [paper(k) for k in (5, 10, 20)]
    return out


def approach(name: str, **kw) -> NtkSetting:
    """relu's median slope at -SLOPE_MARGIN (attn flat at 0)."""
    return NtkSetting(name, relu_median=-S.SLOPE_MARGIN, attn_median=0.0, only=("ntk_approach",), **kw)


def flat(name: str, attn_median: float, **kw) -> NtkSetting:
    """attn's median slope at one end of the equivalence margin (relu at the paper's -0.33)."""
    return NtkSetting(name, relu_median=-0.33, attn_median=attn_median, only=("ntk_flat",), **kw)


def slower(name: str, **kw) -> NtkSetting:
    """The median paired slope difference at +SLOPE_MARGIN (relu at -0.33)."""
    return NtkSetting(name, relu_median=-0.33, attn_median=None, diff_median=S.SLOPE_MARGIN, only=("ntk_slower",), **kw)


def family(k: int) -> FamilySetting:
    """All nine seed-based rows at their nulls in one score() call: the flip-rate ratio at MIN_RATIO;
    relu's and attn's median slopes at -SLOPE_MARGIN (so the slope difference's median, 0, lies
    inside its null); both landscape and all three alignment log ratios at log MIN_RATIO."""
    d = S.SLOPE_MARGIN
    return FamilySetting(
        "family_global_null",
        k=k,
        parts=[
            boundary_mall("fam_mall", k, 200),
            NtkSetting("fam_ntk", relu_median=-d, attn_median=-d),
            LandSetting("fam_land", noise="lognorm"),
            AlignSetting("fam_align", noise="normal"),
        ],
    )


def paper(k: int) -> FamilySetting:
    """The paper's effects, malleability (K = 200, rho 0.05, noise controls at a fifth of the attack)
    and ntk-distance (normal seed noise) scored together."""
    return FamilySetting(
        f"paper_k{k}",
        purpose="power",
        k=k,
        parts=[
            MallSetting("paper_mall", K=200, **PAPER),
            NtkSetting("paper_ntk", relu_median=-0.33, attn_median=-0.04),
        ],
    )


def main(argv=None) -> int:
    args = S.parse_synth_args(__doc__, argv, DEFAULT_REPS, QUICK_REPS)
    reps = args.reps or (QUICK_REPS if args.quick else DEFAULT_REPS)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    todo = settings(args.quick)
    print(
        f"claims scorecard error rates at the null boundaries: {len(todo)} settings x {reps} replications, "
        f"scored by attnaudit.claims.scorecard.score (MIN_RATIO {S.MIN_RATIO:g}, SLOPE_MARGIN {S.SLOPE_MARGIN:g}); "
        f"seeds_needed {'computed' if args.seeds_needed else 'skipped'}"
    )
    if not args.quick and not args.seeds_needed:
        S.time_seeds_needed(boundary_mall("timing_mall", 10, 30), np.random.default_rng(args.seed + 1))
    outcomes = []
    with S.seeds_needed(args.seeds_needed):
        for s in todo:
            outcomes.append(S.run_setting(s, reps, rng))
    S.report(outcomes, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
