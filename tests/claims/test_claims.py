"""The claims scorecard: every verdict rule on synthetic reports shaped like the runs' JSON,
checked against truths computed here independently of the module (sign-test p-values by
scipy's binomtest, order-statistic intervals by sorting by hand with the exact binomial
coverage, betting capitals by hand from the documented lambda rule, and properties any valid
betting test must have), Holm's adjustment across one scorecard, the plan's command lines,
and one end-to-end scorecard on digits."""

from __future__ import annotations

import json
import math
import shlex
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats as st

from attnaudit.claims import plan as P
from attnaudit.claims import scorecard as C
from attnaudit.claims.decision import SeedTest, adjust
from attnaudit.core.stats import Interval
from attnaudit.errors import AuditError

CONF = 0.95
LEVEL = 0.05  # the two-sided level of p_value (each one-sided test at 0.025)
RUN_WARNING = "a warning the run itself raised"
LOG_MIN_RATIO = math.log(1.05)
NOT_RES, SUP, CON, UNTEST = "not resolved", "supported", "contradicted", "not testable here"


# ----------------------------------------------------------------------------- independent references
def chance_threshold(c: int, n: int) -> float:
    """The documented rule: below 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n)) is chance."""
    p = 1.0 / c
    return p + max(0.05, 2.0 * math.sqrt(p * (1.0 - p) / n))


def sign_p(values, null: float, side: str) -> float:
    """Exact one-sided sign test by scipy: H1 median > null ("above") or < null ("below"); seeds
    equal to null are left out."""
    up = sum(v > null for v in values)
    down = sum(v < null for v in values)
    if up + down == 0:
        return 1.0
    return float(st.binomtest(up if side == "above" else down, up + down, 0.5, alternative="greater").pvalue)


def order_interval(values) -> tuple:
    """95 % interval of the median seed, by hand: sort, then [x_(r), x_(k+1-r)] with the largest r
    whose exact coverage 1 - 2 sum_{j<r} C(k, j) / 2^k is >= 0.95; (None, None) when even r = 1
    falls short (k <= 5)."""
    v = sorted(values)
    k = len(v)
    best = 0
    for r in range(1, k // 2 + 1):
        if 1.0 - 2.0 * sum(math.comb(k, j) for j in range(r)) / 2**k >= CONF:
            best = r
    return (None, None) if best == 0 else (v[best - 1], v[k - best])


def median_reading(values, null: float, claim_side: str) -> dict:
    """The documented rule for a median-seed row, from the references above: p_value = 2 min of
    the one-sided p-values; supported / contradicted need p_value <= 0.05 on that side, the
    order-statistic interval wholly on that side of null, and >= 3 seeds."""
    other = "below" if claim_side == "above" else "above"
    pc, pn = sign_p(values, null, claim_side), sign_p(values, null, other)
    lo, hi = order_interval(values)

    def wholly(side):
        if lo is None:
            return False
        return lo > null if side == "above" else hi < null

    p = min(1.0, 2 * min(pc, pn))
    verdict = NOT_RES
    if len(values) >= 3 and p <= LEVEL:
        if pc <= pn and wholly(claim_side):
            verdict = SUP
        elif pn < pc and wholly(other):
            verdict = CON
    return {"p_claim": pc, "p_contra": pn, "p_value": p, "interval": [lo, hi], "verdict": verdict}


def tost_reading(values, margin: float) -> dict:
    """The documented TOST for |median seed| < margin, from the references above."""
    pc = max(sign_p(values, -margin, "above"), sign_p(values, margin, "below"))
    pn = min(sign_p(values, -margin, "below"), sign_p(values, margin, "above"))
    lo, hi = order_interval(values)
    p = min(1.0, 2 * min(pc, pn))
    verdict = NOT_RES
    if len(values) >= 3 and p <= LEVEL and lo is not None:
        if pc <= pn and -margin < lo and hi < margin:
            verdict = SUP
        elif pn < pc and (hi < -margin or lo > margin):
            verdict = CON
    return {"p_claim": pc, "p_contra": pn, "p_value": p, "interval": [lo, hi], "verdict": verdict}


def holm_by_hand(p: list[float]) -> list[float]:
    """Holm's step-down adjustment, written out: the i-th smallest times (m - i), running max, cap 1."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    out, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def assert_reads(row, expected: dict, values) -> None:
    """The row carries the per-seed values, the p-values, the interval and the verdict of ``expected``."""
    assert row.per_seed == pytest.approx(list(values), rel=1e-10)
    assert row.n_seeds == len(values)
    assert row.test is not None
    assert row.test.p_claim == pytest.approx(expected["p_claim"], rel=1e-12)
    assert row.test.p_contra == pytest.approx(expected["p_contra"], rel=1e-12)
    assert row.p_value == pytest.approx(expected["p_value"], rel=1e-12)
    lo, hi = expected["interval"]
    assert row.interval[0] == (None if lo is None else pytest.approx(lo, rel=1e-10))
    assert row.interval[1] == (None if hi is None else pytest.approx(hi, rel=1e-10))
    assert row.verdict == expected["verdict"] and row.raw_verdict == expected["verdict"]
    assert row.interval_method.startswith("order statistics") and row.confidence == CONF


def test_the_references_agree_with_hand_worked_cases():
    """The references themselves, on cases small enough to do on paper."""
    # 6 of 6 above: P(Bin(6, 1/2) >= 6) = 1/64; 5 of 6: 7/64; a seed at the null is left out
    assert sign_p([1, 2, 3, 4, 5, 6], 0.0, "above") == pytest.approx(1 / 64)
    assert sign_p([-1, 2, 3, 4, 5, 6], 0.0, "above") == pytest.approx(7 / 64)
    assert sign_p([0, 2, 3, 4, 5, 6], 0.0, "above") == pytest.approx(1 / 32)
    # k = 6: r = 1 covers 1 - 2/64 = 0.969, r = 2 only 1 - 14/64 = 0.78; k = 10: r = 2 covers
    # 1 - 22/1024 = 0.979, r = 3 only 1 - 112/1024 = 0.89; k = 5: r = 1 covers 1 - 2/32 = 0.94 < 0.95
    assert order_interval([6, 1, 5, 2, 4, 3]) == (1, 6)
    assert order_interval(list(range(10, 0, -1))) == (2, 9)
    assert order_interval([1, 2, 3, 4, 5]) == (None, None)
    assert holm_by_hand([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])


# ----------------------------------------------------------------------------- ntk-distance
def _ntk_report(
    relu,
    attn,
    seeds=None,
    acc=None,
    diverged=(),
    widths=(16, 64, 256),
    n_train=200,
    n_classes=10,
    warnings=(),
    failed=(),
):
    """results.config.seeds, results.models[arch].slope_per_seed, results.cells, n_classes, n_train,
    failed_cells, warnings. Each cell's distance is the exact power law 0.1 w^slope of its seed, so
    a refit over any widths gives the seed's own slope back."""
    seeds = list(range(len(relu))) if seeds is None else list(seeds)
    acc = acc or {}
    slope = {"relu": dict(zip(seeds, relu)), "attn": dict(zip(seeds, attn))}
    cells = [
        {
            "model": m,
            "width": w,
            "seed": s,
            "net_train_acc": acc.get((m, w, s), 0.9),
            "distance_rms": 0.1 * w ** slope[m][s],
            **({"diverged": True} if (m, w, s) in diverged else {}),
        }
        for m in ("relu", "attn")
        for w in widths
        for s in seeds
    ]
    return {
        "schema": "attnaudit.ntk_distance/1",
        "warnings": list(warnings),
        "results": {
            "config": {"seeds": seeds, "widths": list(widths)},
            "n_train": n_train,
            "n_test": 100,
            "n_classes": n_classes,
            "cells": cells,
            "failed_cells": list(failed),
            "models": {"relu": {"slope_per_seed": list(relu)}, "attn": {"slope_per_seed": list(attn)}},
        },
    }


RELU_FALLS = [-0.42, -0.47, -0.51, -0.45, -0.40, -0.44, -0.49, -0.38, -0.46, -0.43]
ATTN_FLAT = [-0.03, 0.02, -0.01, 0.025, -0.02, 0.01, 0.0, -0.015, 0.03, 0.005]


def test_ntk_relu_row_is_the_sign_test_of_the_median_seed():
    rows = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT), "cmd")
    assert [r.role for r in rows] == ["claim", "claim", "sensitivity", "claim"]
    relu = rows[0]
    assert relu.null_value == pytest.approx(-0.1) and relu.min_effect == "slope < -0.1"
    expected = median_reading(RELU_FALLS, -0.1, "below")
    # 10 of 10 seeds below -0.1: one-sided p = 2^-10, the interval [x_(2), x_(9)] = [-0.49, -0.40]
    assert expected["p_claim"] == pytest.approx(2.0**-10) and expected["interval"] == [-0.49, -0.40]
    assert_reads(relu, expected, RELU_FALLS)
    assert relu.value == pytest.approx(np.median(RELU_FALLS)) and relu.verdict == SUP
    assert "sign test" in relu.estimand


@pytest.mark.parametrize(
    "slopes, verdict",
    [
        (RELU_FALLS[:6], SUP),  # 6 of 6 below: p = 2 / 64, the interval is [min, max]
        (RELU_FALLS[:5], NOT_RES),  # 5 seeds: p = 2 / 32 > 0.05, and no 95 % order-statistic interval
        ([0.20, 0.25, 0.31, 0.22, 0.18, 0.27, 0.24], CON),  # the distance grows with width
        ([-0.05, -0.02, -0.3, -0.4, -0.5, -0.2, -0.35, -0.6], NOT_RES),  # 6 of 8 below: p = 2 x 37/256
        ([-0.3, -0.4, -0.5, -0.2, -0.35, -0.6, -0.45, -0.05], NOT_RES),  # 7 of 8: p = 2 x 9/256 = 0.07
        ([-0.5, -0.5001], NOT_RES),  # 2 seeds, tiny spread: never a verdict
        ([0.5, 0.5001], NOT_RES),
    ],
)
def test_ntk_relu_verdicts(slopes, verdict):
    row = C.claim_ntk(_ntk_report(slopes, [0.0] * len(slopes)), "cmd")[0]
    expected = median_reading(slopes, -0.1, "below")
    assert expected["verdict"] == verdict  # the verdict the independent references give
    assert_reads(row, expected, slopes)


def test_two_seeds_never_decide_even_with_tiny_spread():
    rows = C.claim_ntk(_ntk_report([-0.5, -0.50001], [0.3, 0.30001]), "cmd")
    assert [r.verdict for r in rows] == [NOT_RES] * 4
    assert all(r.n_seeds == 2 for r in rows)
    assert rows[0].interval == [None, None]  # no interval from 2 seeds
    assert rows[0].value == pytest.approx(np.median([-0.5, -0.50001]))


@pytest.mark.parametrize(
    "slopes, verdict",
    [
        (ATTN_FLAT, SUP),  # all 10 within +-0.03: both one-sided tests at 2^-10
        ([0.3] * 10, CON),  # it moves away from its predictor
        ([-0.3] * 10, CON),  # it approaches it: "does not approach" is contradicted too
        (ATTN_FLAT[:5], NOT_RES),  # 5 seeds: no 95 % interval (and p = 2 / 32)
        ([-0.15, 0.05, -0.05, 0.10, -0.12, 0.02, -0.2, 0.0, 0.04, -0.11], NOT_RES),  # reaches past -0.1
        ([-0.05, 0.0, 0.05, -0.02, 0.03, 0.01, -0.04, 0.02, 0.04, -0.13], SUP),  # 9 of 10 inside: p = 2 x 11/1024
        ([-0.05, 0.0, 0.05, -0.02, 0.03, 0.01, -0.04, 0.02, -0.14, -0.13], NOT_RES),  # 8 of 10: p = 2 x 56/1024
    ],
)
def test_mlp_attn_row_is_an_equivalence_test_within_the_margin(slopes, verdict):
    rows = C.claim_ntk(_ntk_report(RELU_FALLS[: len(slopes)], slopes), "cmd")
    for row in rows[1:3]:  # the claim row and its sensitivity row (nothing left out here: the same values)
        assert row.equivalence_margin == pytest.approx([-0.1, 0.1]) and row.min_effect == "|slope| < 0.1"
        assert "TOST" in row.estimand
        expected = tost_reading(slopes, 0.1)
        assert expected["verdict"] == verdict
        assert_reads(row, expected, slopes)
    # a null result is no support for "no approach": an interval straddling 0 but reaching past the margin
    lo, hi = order_interval([-0.15, 0.05, -0.05, 0.10, -0.12, 0.02, -0.2, 0.0, 0.04, -0.11])
    assert lo < -0.1 < 0 < hi


def test_slope_margin_reaches_the_ntk_rows():
    slopes = [-0.20, -0.22, -0.25, -0.21, -0.24, -0.23]
    relu = RELU_FALLS[:6]
    assert C.claim_ntk(_ntk_report(relu, slopes), "cmd")[1].verdict == CON  # beyond +-0.1
    rows = C.claim_ntk(_ntk_report(relu, slopes), "cmd", slope_margin=0.3)
    assert rows[1].null_value == pytest.approx(-0.3) and rows[1].equivalence_margin == pytest.approx([-0.3, 0.3])
    assert rows[1].verdict == tost_reading(slopes, 0.3)["verdict"] == SUP
    # the relu row's boundary moves too: slope < -0.3 holds for every seed
    assert rows[0].null_value == pytest.approx(-0.3) and rows[0].verdict == SUP
    # and the difference row's: attn - relu = 0.16-0.26, above 0.1 but not above 0.3
    d = [a - r for a, r in zip(slopes, relu)]
    assert rows[3].null_value == pytest.approx(0.3)
    assert rows[3].verdict == median_reading(d, 0.3, "above")["verdict"] == CON
    assert C.claim_ntk(_ntk_report(relu, slopes), "cmd")[3].verdict == median_reading(d, 0.1, "above")["verdict"]
    # the same data, scored through score(), carry the margin too
    res = C.score("quick", {"ntk": _ntk_report(relu, slopes)}, {}, {"ntk": "cmd"}, [], slope_margin=0.3)
    assert res.claims[1].null_value == pytest.approx(-0.3) and res.claims[1].raw_verdict == SUP


def _noisy_distances(rep, seeds, widths, rng):
    dist = {
        (m, w, s): float(np.exp(rng.normal(scale=0.5)) * w ** (-0.4 if m == "relu" else 0.02))
        for m in ("relu", "attn")
        for w in widths
        for s in seeds
    }
    for cell in rep["results"]["cells"]:
        cell["distance_rms"] = dist[(cell["model"], cell["width"], cell["seed"])]
    return dist


def _fit(dist, model, ws, seeds):
    return [float(np.polyfit(np.log(ws), np.log([dist[(model, w, s)] for w in ws]), 1)[0]) for s in seeds]


def test_a_width_at_chance_in_one_seed_is_left_out_for_every_seed_and_named():
    """Every seed is kept: a width where any seed trained to chance is dropped for all seeds, and
    each seed's slope is refitted over the remaining widths (checked against numpy's polyfit)."""
    seeds = [5, 6, 7, 8, 9, 10]  # not 0-based: seeds are matched by id, not position
    widths = (16, 64, 256, 1024)
    thr = chance_threshold(10, 200)
    # seed 7 of relu is at chance in its narrowest cell only; attn's seed 8 is just above the threshold
    acc = {("relu", 16, 7): thr - 0.005, ("attn", 16, 8): thr + 0.005}
    rep = _ntk_report(RELU_FALLS[:6], ATTN_FLAT[:6], seeds=seeds, acc=acc, widths=widths)
    dist = _noisy_distances(rep, seeds, widths, np.random.default_rng(3))
    relu, attn, sens, diff = C.claim_ntk(rep, "cmd")

    kept = _fit(dist, "relu", [64, 256, 1024], seeds)
    assert_reads(relu, median_reading(kept, -0.1, "below"), kept)
    assert "widths 64, 256, 1024" in relu.measured
    assert any("chance" in w and "seed 7" in w and "width(s) 16 left out for every seed" in w for w in relu.warnings)
    # attention has no cell at chance: the run's own slopes, all 6 seeds, no chance warning
    assert attn.per_seed == pytest.approx(ATTN_FLAT[:6]) and attn.n_seeds == 6
    assert not any("chance" in w for w in attn.warnings)
    # the paired row compares both models over the widths both keep
    d = [a - r for a, r in zip(_fit(dist, "attn", [64, 256, 1024], seeds), kept)]
    assert_reads(diff, median_reading(d, 0.1, "above"), d)
    assert any("seed 7" in w for w in diff.warnings)


def test_the_sensitivity_row_keeps_chance_widths_but_never_diverged_ones():
    seeds = list(range(6))
    widths = (16, 64, 256, 1024)
    # attn: seed 1 at chance at width 16, seed 4 diverged at width 1024
    acc = {("attn", 16, 1): 0.11}
    rep = _ntk_report(RELU_FALLS[:6], ATTN_FLAT[:6], acc=acc, diverged={("attn", 1024, 4)}, widths=widths)
    dist = _noisy_distances(rep, seeds, widths, np.random.default_rng(5))
    _, attn, sens, _ = C.claim_ntk(rep, "cmd")
    main = _fit(dist, "attn", [64, 256], seeds)
    assert attn.verdict == UNTEST  # 64 and 256 only: fewer than 3 widths
    assert "fewer than 3 widths" in attn.why
    keep = _fit(dist, "attn", [16, 64, 256], seeds)  # chance kept, the diverged width still out
    assert sens.role == "sensitivity" and sens.per_seed == pytest.approx(keep, rel=1e-10)
    assert sens.per_seed != pytest.approx(main)
    assert "widths 16, 64, 256" in sens.measured
    assert any("diverged" in w and "width(s) 1024 left out for every seed" in w for w in sens.warnings)
    assert sens.verdict == tost_reading(keep, 0.1)["verdict"]


def test_a_diverged_ntk_cell_is_left_out_for_every_seed_and_named():
    seeds = list(range(7))
    widths = (16, 64, 256, 1024)
    relu = RELU_FALLS[:7]
    rep = _ntk_report(relu, ATTN_FLAT[:7], diverged={("relu", 256, 3)}, widths=widths)
    dist = _noisy_distances(rep, seeds, widths, np.random.default_rng(9))
    rows = C.claim_ntk(rep, "cmd")
    kept = _fit(dist, "relu", [16, 64, 1024], seeds)
    assert_reads(rows[0], median_reading(kept, -0.1, "below"), kept)
    assert rows[0].n_seeds == 7  # every seed kept, over the other widths
    for row in (rows[0], rows[3]):
        assert any(
            "width 256 seed 3 diverged" in w and "width(s) 256 left out for every seed" in w for w in row.warnings
        ), row.warnings
        assert "widths 16, 64, 1024" in row.measured
    d = [a - r for a, r in zip(_fit(dist, "attn", [16, 64, 1024], seeds), kept)]
    assert rows[3].per_seed == pytest.approx(d, rel=1e-10)
    # a diverged cell is no blocking condition: the rows still read their tests
    assert rows[0].test is not None and not rows[0].why.startswith("blocked")


def test_fewer_than_three_widths_above_chance_leave_no_slope():
    thr = chance_threshold(10, 200)
    acc = {("attn", 16, 1): thr - 0.01}  # of 3 widths only 64 and 256 remain
    relu, attn, sens, diff = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT, acc=acc), "cmd")
    assert relu.verdict == SUP and relu.n_seeds == 10
    assert attn.verdict == UNTEST and "fewer than 3 widths" in attn.why
    assert diff.verdict == UNTEST
    assert sens.verdict == SUP and sens.n_seeds == 10  # the sensitivity row keeps the chance cell


def test_the_chance_rule_uses_n_and_c_of_the_run():
    # n = 60, c = 10: threshold 0.1 + 2 sqrt(0.09 / 60) = 0.1775 (the 2-sd term beats 0.05)
    thr = chance_threshold(10, 60)
    assert thr == pytest.approx(0.1 + 2 * math.sqrt(0.09 / 60))
    widths = (16, 64, 256, 1024)
    for acc, dropped in ((thr - 0.002, True), (thr + 0.002, False)):
        rep = _ntk_report(RELU_FALLS[:4], ATTN_FLAT[:4], n_train=60, acc={("attn", 64, 2): acc}, widths=widths)
        attn = C.claim_ntk(rep, "cmd")[1]
        assert attn.n_seeds == 4 and any("chance" in w for w in attn.warnings) == dropped
        assert ("widths 16, 256, 1024" in attn.measured) == dropped
        assert attn.per_seed == pytest.approx(ATTN_FLAT[:4], abs=1e-12)  # an exact power law refits to itself
    # c = 2, n = 1000: threshold 0.55 (the 0.05 floor beats 2 sqrt(0.25 / 1000) = 0.032)
    thr = chance_threshold(2, 1000)
    assert thr == pytest.approx(0.55)
    rep = _ntk_report(RELU_FALLS, ATTN_FLAT, n_train=1000, n_classes=2, acc={("relu", 256, 0): 0.54}, widths=widths)
    relu = C.claim_ntk(rep, "cmd")[0]
    assert relu.n_seeds == 10
    assert any("width(s) 256 left out" in w for w in relu.warnings)


def test_every_seed_at_chance_is_not_testable():
    acc = {("attn", 16, s): 0.11 for s in range(6)}
    rows = C.claim_ntk(_ntk_report(RELU_FALLS[:6], [0.0, 0.01, -0.01, 0.02, -0.02, 0.0], acc=acc), "cmd")
    assert rows[0].verdict == SUP
    assert rows[1].verdict == UNTEST and "chance" in rows[1].why
    assert rows[3].verdict == UNTEST
    assert rows[2].verdict == SUP  # the sensitivity row keeps them, and says so in its claim
    assert "chance-level cells included" in rows[2].claim and rows[2].role == "sensitivity"


def test_paired_slope_difference_row():
    relu = [-0.40, -0.45, -0.50, -0.42, -0.47, -0.44, -0.41]
    attn = [-0.10, -0.05, -0.20, -0.08, -0.12, -0.02, -0.15]
    d = [a - r for a, r in zip(attn, relu)]
    row = C.claim_ntk(_ntk_report(relu, attn), "cmd")[3]
    assert row.null_value == pytest.approx(0.1) and row.min_effect == "difference > 0.1"
    expected = median_reading(d, 0.1, "above")
    assert expected["verdict"] == SUP
    assert_reads(row, expected, d)
    # attention falls faster than relu: contradicted
    row = C.claim_ntk(_ntk_report(attn, relu), "cmd")[3]
    assert row.verdict == median_reading([-x for x in d], 0.1, "above")["verdict"] == CON
    # a difference inside (0, 0.1] on every seed is not "more slowly" by the minimum effect
    small = [r + 0.05 for r in relu]
    row = C.claim_ntk(_ntk_report(relu, small), "cmd")[3]
    assert row.per_seed == pytest.approx([0.05] * 7) and row.verdict == CON


def test_ntk_run_warnings_reach_every_row():
    rows = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT, warnings=[RUN_WARNING]), "cmd")
    assert len(rows) == 4 and all(RUN_WARNING in r.warnings for r in rows)
    acc = {("attn", 16, s): 0.11 for s in range(10)}  # also on a not-testable row
    rows = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT, acc=acc, warnings=[RUN_WARNING]), "cmd")
    assert rows[1].verdict == UNTEST and all(RUN_WARNING in r.warnings for r in rows)


# ----------------------------------------------------------------------------- malleability
def _mall_report(
    attn,
    relu,
    ctrl_attn=None,
    ctrl_relu=None,
    *,
    seeds=None,
    top_k=30,
    comparable=True,
    acc=None,
    n_train=300,
    n_classes=10,
    floor="random",
    failed=(),
    warnings=(),
):
    """results.config, summary, ratios, training, failed_cells, n_train, dataset, shaped like a real
    malleability report: every (model, attack, eps) has a summary row with per-seed flip_rate
    values and its seeds, the noise control included (attack "sign" at the same eps and damping;
    its rows list the seeds in another order, so pairing must go by seed id), and each attack row's
    floors name the control attack. The controls are 0 on every seed unless given; every floor's
    own "exceeded" flag says True, so a reader that trusted it instead of testing would be caught."""
    k = len(attn)
    seeds = list(range(100, 100 + k)) if seeds is None else list(seeds)
    acc = acc or {}
    flips = {"attn": list(attn), "relu": list(relu)}
    ctrl = {
        "attn": [0.0] * k if ctrl_attn is None else list(ctrl_attn),
        "relu": [0.0] * k if ctrl_relu is None else list(ctrl_relu),
    }

    def summary(model, attack, vals, eps=0.3, order=None):
        idx = list(range(k)) if order is None else order
        return {
            "model": model,
            "attack": attack,
            "eps": eps,
            "damping": 0.001,
            "seeds": [seeds[i] for i in idx],
            "top_k": top_k,
            "flip_rate": {"mean": float(np.mean(vals)), "values": [vals[i] for i in idx], "n": k},
        }

    def attack_row(model, vals, eps):
        row = summary(model, "pgd", vals, eps)
        c = ctrl[model]
        row["floors"] = (
            {}
            if floor is None
            else {
                floor: {"mean": float(np.mean(c)), "ci_high": float(np.max(c)), "exceeded": True, "attack": "sign"},
                "reinit": {"mean": 0.0, "ci_high": 0.05, "exceeded": True, "attack": "reinit"},
            }
        )
        return row

    def ratio(eps, a, b):
        return {
            "numerator": "attn",
            "denominator": "relu",
            "attack": "pgd",
            "eps": eps,
            "damping": 0.001,
            "ratio": float(np.mean(a) / np.mean(b)) if np.mean(b) > 0 else None,
            "n": len(a),
            "numerator_values": list(a),
            "denominator_values": list(b),
            "seeds": seeds,
            "loss_gate": {
                "numerator_loss": 0.20,
                "denominator_loss": 0.21 if comparable else 0.60,
                "factor": 1.5,
                "comparable": comparable,
            },
        }

    decoy = [0.9] * k  # a second eps, and controls, the claim must not read as its own numbers
    backwards = list(range(k))[::-1]
    summaries = []
    for m in ("relu", "attn"):
        summaries += [
            attack_row(m, flips[m], 0.3),
            attack_row(m, decoy, 0.1),
            summary(m, "sign", ctrl[m], 0.3, order=backwards),
            summary(m, "sign", decoy, 0.1),
            summary(m, "reinit", decoy, None),
        ]
    return {
        "schema": "attnaudit.malleability/1",
        "warnings": list(warnings),
        "results": {
            "config": {"attacks": ["pgd", "sign"], "eps": [0.3, 0.1], "damping": [0.001], "top_k": top_k},
            "n_train": n_train,
            "dataset": {"class_counts": {str(i): n_train // n_classes for i in range(n_classes)}},
            "summary": summaries,
            "ratios": [ratio(0.1, decoy, [0.01] * k), ratio(0.3, attn, relu)],
            "training": [
                {"seed": s, "model": m, "role": role, "train_accuracy": acc.get((m, i, role), 0.95)}
                for i, s in enumerate(seeds)
                for m in ("relu", "attn")
                for role in ("clean", "perturbed")
            ],
            "failed_cells": list(failed),
        },
    }


ATTN20, RELU20 = [0.6] * 20, [0.2] * 20


def test_malleability_reads_the_ratio_and_the_paired_noise_controls():
    """20 seeds, every one at attn 0.6 / relu 0.2 with both controls at 0: supported."""
    row = C.claim_malleability(_mall_report(ATTN20, RELU20), "cmd")
    assert row.verdict == SUP and row.raw_verdict == SUP and row.n_seeds == 20
    assert row.null_value == pytest.approx(1.05) and row.min_effect == "ratio > 1.05"
    assert row.value == pytest.approx(3.0)
    assert row.interval_method.startswith("betting")
    lo, hi = row.interval
    assert lo > 1.05
    # the data have probability 1 under "every seed is (0.6, 0.2)", whose ratio is 3: a valid
    # level-0.025 test cannot reject 3 on them, so 3 lies inside a valid interval
    assert lo <= 3.0 and (hi is None or hi >= 3.0)
    assert row.test.p_claim <= 0.025 and row.p_value <= LEVEL
    # per seed: the two flip rates and the two controls' flip rates of that seed
    assert row.per_seed == [{"attn": 0.6, "relu": 0.2, "attn_control": 0.0, "relu_control": 0.0}] * 20
    c = row.controls["attn"]
    assert c["control"] == "sign" and c["reading"] == "beyond noise"
    assert c["per_seed"] == pytest.approx([0.6] * 20) and c["p_value"] <= 0.025 and c["interval"][0] > 0
    # relu's excess, 0.2 on every seed, is beyond the control test's reach at 20 seeds: on [-1, 1]
    # mapped to [0, 1] each bet is at most 0.9 / 0.5 x 0.1, so the capital is at most 1.18^20 = 27.4 < 40
    c = row.controls["relu"]
    assert c["control"] == "sign" and c["per_seed"] == pytest.approx([0.2] * 20)
    assert (1 + 0.9 * 0.2) ** 20 < 40 and c["p_value"] >= 1 / (1 + 0.9 * 0.2) ** 20
    assert c["reading"] == "not shown beyond noise"
    assert "sign-noise control" in row.why


@pytest.mark.parametrize(
    "kw, verdict",
    [
        ({}, SUP),
        ({"ctrl_attn": ATTN20}, NOT_RES),  # attn's attack is no more than its noise control
        ({"floor": "sign"}, SUP),  # the floors entry may be keyed by the control attack's name
        ({"ctrl_relu": RELU20}, SUP),  # relu's control does not bear on "attn more malleable"
        ({"floor": None}, NOT_RES),  # no noise control in the run: the claim cannot pass it
        ({"comparable": False}, UNTEST),
        ({"acc": {("attn", 2, "clean"): 0.12}}, UNTEST),  # one clean training at chance
        ({"acc": {("relu", 5, "perturbed"): 0.12}}, UNTEST),  # one perturbed retraining at chance
    ],
)
def test_malleability_verdicts(kw, verdict):
    row = C.claim_malleability(_mall_report(ATTN20, RELU20, **kw), "cmd")
    assert row.verdict == verdict
    if verdict == UNTEST:
        assert row.why and row.test is None and row.p_value is None
    if kw.get("floor", "random") is None:
        assert row.controls["attn"]["control"] is None and "no noise control" in row.controls["attn"]["reading"]
    if "acc" in kw:
        role = next(iter(kw["acc"]))[2]
        assert "chance" in row.why and role in row.why


def test_malleability_contradicted_needs_relu_beyond_its_control():
    row = C.claim_malleability(_mall_report(RELU20, ATTN20), "cmd")  # relu the more malleable
    assert row.verdict == CON and row.test.p_contra <= 0.025 and row.interval[1] < 1.05
    row = C.claim_malleability(_mall_report(RELU20, ATTN20, ctrl_relu=ATTN20), "cmd")
    assert row.verdict == NOT_RES and row.controls["relu"]["reading"] == "not shown beyond noise"


def test_symmetric_flip_rates_are_not_resolved():
    """attn and relu trade places seed by seed: the ratio of means is 1, no side is shown."""
    a, b = [0.3, 0.1] * 10, [0.1, 0.3] * 10
    row = C.claim_malleability(_mall_report(a, b), "cmd")
    assert row.verdict == NOT_RES and row.value == pytest.approx(1.0)
    assert row.test.p_claim > 0.025 and row.test.p_contra > 0.025
    assert row.interval[0] <= 1.0 <= (row.interval[1] or math.inf)
    # 2 seeds never decide
    row = C.claim_malleability(_mall_report([0.60, 0.61], [0.05, 0.051]), "cmd")
    assert row.verdict == NOT_RES and row.n_seeds == 2


# The betting bound: the bet on one seed is lambda (x - m) with lambda <= c / m (c = BET_CAP =
# 0.9) and x <= 1, so one seed multiplies the capital by at most 1 + c (1 - m) / m. For the ratio
# test against 1.05, m = t = 1.05 / 2.05 and (1 - m) / m = 1 / 1.05: the capital after k seeds is
# at most (1 + 0.9 / 1.05)^k, 22.1 at k = 5, below the 1 / 0.025 = 40 a rejection needs, and
# 41.1 at k = 6. So 5 seeds can never support a ratio, at any flip rates.
def _ratio_capital_bound(k: int) -> float:
    return (1.0 + 0.9 / 1.05) ** k


def test_five_seeds_never_support_a_ratio_the_betting_bound():
    assert _ratio_capital_bound(5) < 1 / 0.025 < _ratio_capital_bound(6)
    rng = np.random.default_rng(21)
    cases = [([1.0] * 5, [0.0] * 5), ([0.9] * 5, [0.1] * 5), ([1.0] * 5, [0.01] * 5)]
    cases += [(list(rng.uniform(0.5, 1.0, 5)), list(rng.uniform(0.0, 0.1, 5))) for _ in range(20)]
    for a, b in cases:
        row = C.claim_malleability(_mall_report(a, b), "cmd")
        assert row.verdict != SUP, (a, b)
        assert row.test.p_claim >= 1 / _ratio_capital_bound(5) * (1 - 1e-9), (a, b, row.test.p_claim)
    # the extreme case reaches the bound exactly (every bet at its cap)
    row = C.claim_malleability(_mall_report([1.0] * 5, [0.0] * 5), "cmd")
    assert row.test.p_claim == pytest.approx(1 / _ratio_capital_bound(5), rel=1e-9)
    # and a sixth such seed crosses it: 1 / 41.1 <= 0.025 (unadjusted)
    row = C.claim_malleability(_mall_report([1.0] * 6, [0.0] * 6), "cmd")
    assert row.test.p_claim == pytest.approx(1 / _ratio_capital_bound(6), rel=1e-9)
    assert row.verdict == SUP and row.interval[0] > 1.05


def hand_capital_two_seeds(x1: float, x2: float, m: float) -> float:
    """The documented betting capital for k = 2 values in [0, 1] against the mean m, in the order
    x1, x2: seed i is bet lambda_i (x_i - m) with lambda_i = min(0.9 / m, sqrt(2 ln(1 / 0.025) /
    (k sigma_{i-1}^2))), sigma_{i-1}^2 = (1/4 + sum_{j<i} (x_j - mu_{j-1})^2) / i the running
    variance (mu_{j-1} = (1/2 + sum_{l<j} x_l) / j the running mean)."""
    k = 2
    lam1 = min(0.9 / m, math.sqrt(2 * math.log(40.0) / (k * 0.25)))
    var1 = (0.25 + (x1 - 0.5) ** 2) / 2
    lam2 = min(0.9 / m, math.sqrt(2 * math.log(40.0) / (k * var1)))
    return (1 + lam1 * (x1 - m)) * (1 + lam2 * (x2 - m))


def test_the_control_p_value_is_the_hand_computed_betting_capital():
    """Two seeds, attn's attack minus its control 0.6 and 0.2: on [-1, 1] mapped to [0, 1] the
    values are 0.8 and 0.6 against m = 0.5; both bets sit at the cap 0.9 / 0.5 = 1.8 (the variance
    term sqrt(2 ln 40 / (2 sigma^2)) is >= 2.7 here), so the capital is (1 + 1.8 x 0.3)(1 + 1.8 x
    0.1) = 1.54 x 1.18 = 1.8172 in either order, and p = 1 / 1.8172 = 0.5503."""
    row = C.claim_malleability(_mall_report([0.6, 0.3], [0.1, 0.1], ctrl_attn=[0.0, 0.1]), "cmd")
    capital = (hand_capital_two_seeds(0.8, 0.6, 0.5) + hand_capital_two_seeds(0.6, 0.8, 0.5)) / 2
    assert capital == pytest.approx(1.54 * 1.18)
    c = row.controls["attn"]
    assert c["per_seed"] == pytest.approx([0.6, 0.2])
    assert c["p_value"] == pytest.approx(1 / capital, rel=1e-12)
    assert c["reading"] == "not shown beyond noise" and row.verdict == NOT_RES  # and 2 seeds decide nothing


def test_an_attack_no_stronger_than_its_control_is_not_shown_beyond_noise():
    """Attention's attack flips exactly as much as its sign-noise control on every seed: the
    paired control test cannot reject (every bet is on x = m, the capital stays 1), and the row is
    not supported although the ratio alone is (the same data with the control at 0 are)."""
    rep = _mall_report(ATTN20, RELU20, ctrl_attn=ATTN20)
    row = C.claim_malleability(rep, "cmd")
    c = row.controls["attn"]
    assert c["per_seed"] == [0.0] * 20 and c["excess"] == 0.0
    assert c["p_value"] == pytest.approx(1.0) and c["reading"] == "not shown beyond noise"
    assert row.verdict != SUP and row.test.p_claim == pytest.approx(1.0)
    assert C.claim_malleability(_mall_report(ATTN20, RELU20), "cmd").verdict == SUP
    assert C.variant_row("preset", rep, "cmd", None).reading == "attn more sensitive, not shown beyond noise"
    assert C.variant_row("preset", rep, "cmd", None).above_floor == {"relu": False, "attn": False}


def test_controls_are_paired_by_seed_id():
    """The control's summary row lists its seeds in another order; each seed's attack is paired
    with the same seed's control."""
    attn = [0.6 + 0.01 * i for i in range(8)]
    ctrl = [0.05 * i for i in range(8)]
    seeds = [7, 3, 11, 5, 2, 9, 4, 8]
    row = C.claim_malleability(_mall_report(attn, [0.2] * 8, ctrl_attn=ctrl, seeds=seeds), "cmd")
    assert row.controls["attn"]["per_seed"] == pytest.approx([a - c for a, c in zip(attn, ctrl)])
    assert [u["attn_control"] for u in row.per_seed] == pytest.approx(ctrl)


def test_a_zero_relu_denominator_gives_no_point_estimate_and_no_support():
    """relu flipped on no seed, attention at about 5 %: no point estimate (never a plug-in 0 or
    infinity), a finite lower end, not supported. With 30 seeds the lower end must stay <= 0.5: a
    relu whose seeds flip all (1) with probability 0.1 and none (0) otherwise has mean 0.1 and
    gives 30 zeros with probability 0.9^30 = 0.042 > 0.025, so a valid test cannot exclude
    0.05 / 0.1 = 0.5."""
    assert 0.9**30 > 0.025
    for attn in ([0.05, 0.04, 0.06, 0.05, 0.05], [0.05] * 30):
        row = C.claim_malleability(_mall_report(attn, [0.0] * len(attn)), "cmd")
        assert row.value is None
        lo, hi = row.interval
        assert lo is not None and math.isfinite(lo) and hi is None
        assert row.verdict not in (SUP, CON), attn
        assert "no point estimate" in row.why
        if len(attn) == 30:
            assert lo <= 0.5


def test_a_zero_relu_denominator_verdict_follows_the_interval():
    """Attention at about 50 % on 30 seeds, relu 0 everywhere, both controls beaten: the interval's
    lower end clears 1.05, so the verdict may be, and is, supported. (Its lower end can be at
    most 0.5 / 0.1 = 5 by the argument of the previous test.)"""
    attn = [0.48, 0.50, 0.52] * 10
    rep = _mall_report(attn, [0.0] * 30)
    row = C.claim_malleability(rep, "cmd")
    lo, hi = row.interval
    assert row.value is None and 1.05 < lo <= 5.0 and hi is None
    assert row.test.p_claim <= 0.025 and row.verdict == SUP
    assert C.variant_row("preset protocol", rep, "cmd", None).reading == "attn more malleable"


@pytest.mark.parametrize("attn", [[0.2, 0.3, 0.1], [0.50, 0.52, 0.48] * 10])
def test_a_zero_relu_denominator_is_unbounded_above_in_tables_and_json(attn):
    from rich.console import Console

    from attnaudit.claims.run import _tables

    rep = _mall_report(attn, [0.0] * len(attn))
    row = C.claim_malleability(rep, "cmd")
    assert row.interval[1] is None  # unbounded above, JSON null
    assert row.verdict != CON and row.value is None
    assert "0.00 [0.00, 0.00]" not in row.measured and "0 [0, 0]" not in row.measured
    var = C.variant_row("preset protocol", rep, "cmd", None)
    assert var.interval[1] is None and var.ratio is None
    result = C.ClaimsResult("quick", [row], [var])
    console = Console(width=250, record=True)
    for t in _tables(result):
        console.print(t)
    text = console.export_text()
    assert "+inf" in text and "0.00 [0.00, 0.00]" not in text
    json.dumps(result.to_dict(), allow_nan=False)  # no infinities in the JSON


def test_failed_malleability_seeds_block_the_verdict():
    failed = [{"cell": "attn pgd eps 0.3 seed 104", "error": "CUDA out of memory"}]
    rep = _mall_report(ATTN20, RELU20, failed=failed)
    row = C.claim_malleability(rep, "cmd")
    assert row.verdict == NOT_RES and row.raw_verdict == NOT_RES
    assert row.why.startswith("blocked") and "failed" in row.why
    assert row.test is None and row.p_value is None
    res = C.score("quick", {"malleability": rep}, {}, {"malleability": "cmd"}, [])
    assert res.claims[0].verdict == NOT_RES and res.claims[0].why.startswith("blocked")
    assert res.claims[0].p_adjusted is None
    assert C.variant_row("preset", rep, "cmd", None).reading == "failed seeds"


def test_a_not_testable_malleability_row_has_the_same_per_seed_shape_and_no_nan():
    rep = _mall_report([0.6] * 3, [0.2] * 3, floor=None, comparable=False)
    row = C.claim_malleability(rep, "cmd")
    assert row.verdict == UNTEST
    assert row.per_seed == [{"attn": 0.6, "relu": 0.2, "attn_control": None, "relu_control": None}] * 3
    json.dumps(C.ClaimsResult("quick", [row], []).to_dict(), allow_nan=False)


def test_malleability_run_warnings_reach_the_row():
    for kw in ({}, {"comparable": False}, {"acc": {("relu", 0, "clean"): 0.1}}):
        row = C.claim_malleability(_mall_report(ATTN20, RELU20, warnings=[RUN_WARNING], **kw), "cmd")
        assert RUN_WARNING in row.warnings


def test_supported_needs_a_noise_control_to_beat():
    row = C.claim_malleability(_mall_report(ATTN20, RELU20, floor=None), "cmd")
    assert row.verdict != SUP


def test_chance_rule_reads_the_class_count_of_a_class_subset_malleability():
    rep = _mall_report(ATTN20, RELU20, n_train=60, acc={("attn", 2, "clean"): 0.55})
    rep["results"]["dataset"] = {"name": "digits", "classes": [0, 1]}  # as a real --classes 0,1 report
    assert 0.55 < chance_threshold(2, 60)
    assert C.claim_malleability(rep, "cmd").verdict == UNTEST


# ----------------------------------------------------------------------------- landscape
LAM_RELU = [2.0, 2.4, 1.8, 2.2, 2.6, 2.1, 2.3, 1.9]
LAM_ATTN = [1.0, 1.5, 1.1, 0.9, 1.4, 1.2, 1.0, 1.3]
TR_RELU = [50.0, 60.0, 45.0, 55.0, 58.0, 52.0, 49.0, 57.0]
TR_ATTN = [30.0, 41.0, 33.0, 29.0, 35.0, 31.0, 36.0, 30.0]


def _land_report(
    lam=(LAM_RELU, LAM_ATTN),
    trace=(TR_RELU, TR_ATTN),
    loss=None,
    acc=None,
    n_samples=500,
    warnings=(),
    bound=100.0,
    top=None,
    stderr=0.5,
):
    """results.models.{relu,attn}.seeds.values: [{seed, loss, accuracy, lambda_max, top_eigenvalues,
    trace, trace_stderr}], n_samples; results.gd_stability_bound (2 / lr). ``top``: (model, seed) ->
    the top eigenvalues (default [lambda_max, lambda_max / 2], well inside the trace)."""
    k = len(lam[0])
    loss, acc, top = loss or {}, acc or {}, top or {}
    models = {}
    for i, m in enumerate(("relu", "attn")):
        vals = [
            {
                "seed": s,
                "loss": loss.get((m, s), 0.100),
                "accuracy": acc.get((m, s), 0.95),
                "lambda_max": lam[i][s],
                "top_eigenvalues": top.get((m, s), [lam[i][s], lam[i][s] / 2]),
                "trace": trace[i][s],
                "trace_stderr": stderr,
            }
            for s in range(k)
        ]
        models[m] = {
            "n_samples": n_samples,
            "loss": vals[0]["loss"],
            "accuracy": vals[0]["accuracy"],
            "top_eigenvalues": {"eigenvalues": [lam[i][0]]},
            "trace": {"estimate": trace[i][0]},
            "seeds": {"n_seeds": k, "values": vals},
        }
    return {
        "schema": "attnaudit.landscape/1",
        "warnings": list(warnings),
        "results": {
            "dataset": {"class_counts": {str(i): 50 for i in range(10)}},
            "gd_stability_bound": bound,
            "models": models,
        },
    }


def _logs(relu, attn, seeds=None):
    seeds = range(len(relu)) if seeds is None else seeds
    return [math.log(relu[s] / attn[s]) for s in seeds]


def test_landscape_rows_are_sign_tests_of_the_median_log_ratio():
    lam_row, tr_row = C.claim_landscape(_land_report(), "cmd")
    for row, (r, a) in ((lam_row, (LAM_RELU, LAM_ATTN)), (tr_row, (TR_RELU, TR_ATTN))):
        logs = _logs(r, a)
        assert row.null_value == pytest.approx(LOG_MIN_RATIO) and row.min_effect == "ratio > 1.05"
        expected = median_reading(logs, LOG_MIN_RATIO, "above")
        assert expected["verdict"] == SUP  # 8 of 8 above log 1.05: p = 2 / 256, interval [min, max]
        assert_reads(row, expected, logs)


@pytest.mark.parametrize("swap, verdict", [(True, CON), (False, SUP)])
def test_landscape_contradicted_when_attn_is_sharper(swap, verdict):
    lam = (LAM_ATTN, LAM_RELU) if swap else (LAM_RELU, LAM_ATTN)
    tr = (TR_ATTN, TR_RELU) if swap else (TR_RELU, TR_ATTN)
    assert [r.verdict for r in C.claim_landscape(_land_report(lam, tr), "cmd")] == [verdict] * 2


def test_a_sharpness_ratio_below_the_minimum_effect_is_contradicted():
    """relu 2 % sharper on every seed: sharper, but not by the minimum effect of 5 %."""
    lam = ([1.02 * x for x in LAM_ATTN], LAM_ATTN)
    tr = ([1.02 * x for x in TR_ATTN], TR_ATTN)
    rows = C.claim_landscape(_land_report(lam, tr), "cmd")
    assert [r.verdict for r in rows] == [CON] * 2
    assert rows[0].per_seed == pytest.approx([math.log(1.02)] * 8)


def test_landscape_straddling_and_few_seeds_are_not_resolved():
    lam = ([1.0, 1.2, 0.9, 1.1, 1.3, 1.0], [1.1, 1.0, 1.0, 1.05, 1.0, 1.2])
    tr = ([10.0, 12.0, 9.0, 11.0, 13.0, 10.0], [11.0, 10.0, 10.0, 10.5, 10.0, 12.0])
    for row, (r, a) in zip(C.claim_landscape(_land_report(lam, tr), "cmd"), (lam, tr)):
        expected = median_reading(_logs(r, a), LOG_MIN_RATIO, "above")
        assert expected["verdict"] == NOT_RES
        assert_reads(row, expected, _logs(r, a))
    # 5 seeds, every one far above: p = 2 / 32 > 0.05 and no 95 % interval
    five = (LAM_RELU[:5], LAM_ATTN[:5]), (TR_RELU[:5], TR_ATTN[:5])
    rows = C.claim_landscape(_land_report(*five), "cmd")
    assert [r.verdict for r in rows] == [NOT_RES] * 2 and all(r.interval == [None, None] for r in rows)
    two = ([2.0, 2.01], [1.0, 1.01]), ([50.0, 50.1], [30.0, 30.1])
    rows = C.claim_landscape(_land_report(*two), "cmd")
    assert [r.verdict for r in rows] == [NOT_RES] * 2 and all(r.n_seeds == 2 for r in rows)


def test_landscape_leaves_out_seeds_with_unmatched_losses_or_at_chance():
    thr = chance_threshold(10, 500)
    loss = {
        ("relu", 1): 0.100,
        ("attn", 1): 0.112,  # 12 % apart: out
        ("relu", 4): 0.100,
        ("attn", 4): 0.109,  # 9 % apart: kept
    }
    acc = {("attn", 3): thr - 0.01}  # attn at chance in seed 3 only
    rep = _land_report(loss=loss, acc=acc, warnings=[RUN_WARNING])
    lam_row, tr_row = C.claim_landscape(rep, "cmd")
    kept = [0, 2, 4, 5, 6, 7]
    for row, (r, a) in ((lam_row, (LAM_RELU, LAM_ATTN)), (tr_row, (TR_RELU, TR_ATTN))):
        logs = _logs(r, a, kept)
        assert_reads(row, median_reading(logs, LOG_MIN_RATIO, "above"), logs)
        assert RUN_WARNING in row.warnings
        assert any("seed 1" in w and "10 %" in w for w in row.warnings)
        assert any("seed 3" in w and "chance" in w for w in row.warnings)
        assert not any("seed 4" in w or "seed 0" in w for w in row.warnings)


def test_edge_of_stability_blocks_the_landscape_rows():
    """lambda_max >= 0.8 x 2 / lr in any compared seed: GD, not the minimum, set the sharpness."""
    lam = (list(LAM_RELU), LAM_ATTN)
    lam[0][2] = 3.3  # seed 2: 3.3 >= 0.8 x 4.0 = 3.2
    rows = C.claim_landscape(_land_report(lam, bound=4.0), "cmd")
    for row in rows:
        assert row.verdict == NOT_RES and row.raw_verdict == NOT_RES
        assert row.why.startswith("blocked") and "edge of stability" in row.why and "seed 2" in row.why
        assert row.test is None and row.p_value is None
    # just below the share: read as usual
    lam[0][2] = 3.1
    assert [r.verdict for r in C.claim_landscape(_land_report(lam, bound=4.0), "cmd")] == [SUP] * 2
    # a per-model bound (a report that trained the models at different rates)
    lam[0][2] = 3.3
    rows = C.claim_landscape(_land_report(lam, bound={"relu": 10.0, "attn": 4.0}), "cmd")
    assert [r.verdict for r in rows] == [SUP] * 2
    rows = C.claim_landscape(_land_report(lam, bound={"relu": 4.0, "attn": 10.0}), "cmd")
    assert all(r.why.startswith("blocked") for r in rows)
    # a seed left out of the comparison (losses 20 % apart) does not block
    loss = {("attn", 2): 0.12}
    rows = C.claim_landscape(_land_report(lam, bound=4.0, loss=loss), "cmd")
    assert [r.verdict for r in rows] == [
        median_reading(_logs(*lam, [0, 1, 3, 4, 5, 6, 7]), LOG_MIN_RATIO, "above")["verdict"]
    ] * 2
    assert not any(r.why.startswith("blocked") for r in rows)


@pytest.mark.parametrize(
    "top, trace, stderr, blocked",
    [
        ([20.0, 15.0], 31.0, 0.5, True),  # top eigenvalues 35 > trace 31 + 3 x 0.5
        ([20.0, 10.5], 31.0, 0.5, False),  # 30.5 <= 31 + 1.5
        ([20.0, 13.0], 31.0, 0.5, True),  # 33 > 32.5
        ([20.0, 13.0], 31.0, 1.0, False),  # 33 <= 31 + 3 x 1.0: within the trace estimate's error
        (None, 0.0, 0.5, True),  # a trace <= 0: not a minimum
        (None, -2.0, 0.5, True),
    ],
)
def test_not_a_minimum_blocks_the_landscape_rows(top, trace, stderr, blocked):
    """Attention's seed 5: the sum of its top Hessian eigenvalues beyond its trace by more than 3
    standard errors of the trace estimate, or a trace <= 0, means a saddle, not a minimum."""
    tr = (TR_RELU, list(TR_ATTN))
    tr[1][5] = trace
    rep = _land_report(trace=tr, top={("attn", 5): top} if top else None, stderr=stderr)
    rows = C.claim_landscape(rep, "cmd")
    for row in rows:
        assert row.why.startswith("blocked") == blocked, row.why
        if blocked:
            assert row.verdict == NOT_RES and "not a minimum" in row.why and "seed 5" in row.why
            assert row.test is None
        else:
            assert row.verdict == SUP


def test_chance_rule_reads_the_class_count_of_a_class_subset_landscape():
    rep = _land_report(acc={("attn", 2): 0.52})
    rep["results"]["dataset"] = {"name": "digits", "classes": [0, 1]}  # as a real --classes 0,1 report
    assert 0.52 < chance_threshold(2, 500)
    assert C.claim_landscape(rep, "cmd")[0].n_seeds == 7


def test_landscape_with_no_comparable_seed_is_not_testable():
    loss = {("attn", s): 0.3 for s in range(8)}
    rows = C.claim_landscape(_land_report(loss=loss, warnings=[RUN_WARNING]), "cmd")
    assert [r.verdict for r in rows] == [UNTEST] * 2
    assert all("--match-loss" in r.why and RUN_WARNING in r.warnings for r in rows)


# ----------------------------------------------------------------------------- kappa
def _kappa_report(kappa_d=(20.0, 19.5, 20.5), rank=(18.0, 17.9, 18.1), deficient=False, amp="verified", warnings=()):
    def est(basis, v, r):
        val, lo, hi = v
        return {
            "label": f"width at {basis}",
            "basis": basis,
            "rank": r,
            "log10_required_width": val,
            "log10_interval": [lo, hi],
            "interval_method": "float64 round-off bound",
        }

    return {
        "schema": "attnaudit.kappa/1",
        "warnings": list(warnings),
        "results": {
            "amplification_check": {
                "verdict": amp,
                "log10_predicted_kappa_cubed": 9.0,
                "relative_error": 1e-12 if amp == "verified" else (0.5 if amp == "mismatch" else None),
                "error_budget": 1e-9,
                "top_eigenvalue_relative_error": 1e-16,
            },
            "gram": {"rank_deficient": deficient, "numerical_rank": 58 if deficient else 64, "min_n_d": 64},
            "reference_width": {"log10": 12.0},
            "width_estimates": [est("kappa_d", kappa_d, 64), est("numerical_rank", rank, 58)],
        },
    }


@pytest.mark.parametrize(
    "kappa_d, verdict",
    [
        ((20.0, 19.5, 20.5), "supported"),
        ((10.0, 9.5, 10.5), "contradicted"),
        ((12.2, 11.8, 12.6), "not resolved"),
        ((30.0, 29.0, None), "supported"),  # unbounded above, finite lower end above 12
    ],
)
def test_kappa_width_row_against_the_reference_width(kappa_d, verdict):
    row = C.claim_kappa(_kappa_report(kappa_d=kappa_d), "cmd")[1]
    assert row.null_value == 12.0
    assert row.value == kappa_d[0] and row.interval == [kappa_d[1], kappa_d[2]]
    assert row.verdict == verdict and row.n_seeds == 0


def test_rank_deficient_g_reads_the_numerical_rank_row_with_its_caveat():
    rep = _kappa_report(kappa_d=(None, 82.0, None), rank=(10.5, 10.4, 10.6), deficient=True, warnings=[RUN_WARNING])
    amp_row, width_row = C.claim_kappa(rep, "cmd")
    assert width_row.value == 10.5 and width_row.interval == [10.4, 10.6]
    assert width_row.verdict == "contradicted"  # read from the numerical-rank row, not the kappa_d one
    for row in (amp_row, width_row):
        assert RUN_WARNING in row.warnings
        assert any("rank deficient" in w for w in row.warnings)
    # full rank: the kappa_d row, no caveat
    amp_row, width_row = C.claim_kappa(_kappa_report(), "cmd")
    assert width_row.value == 20.0 and not any("rank deficient" in w for w in width_row.warnings)


@pytest.mark.parametrize(
    "raw, verdict",
    [("verified", "supported"), ("mismatch", "contradicted"), ("beyond-float64-precision", "not testable here")],
)
def test_kappa_amplification_row(raw, verdict):
    row = C.claim_kappa(_kappa_report(amp=raw), "cmd")[0]
    assert row.verdict == verdict and row.why


# ----------------------------------------------------------------------------- alignment
def _align_report(principal, labels, contrast, warnings=(), row_warnings=()):
    def row(quantity, target, per, warns=()):
        return {
            "quantity": quantity,
            "target": target,
            "per_seed": list(per),
            "null_value": 0.0,
            "interval_method": "paired student-t",
            "confidence": 0.95,
            "warnings": list(warns),
        }

    far = [-5.0, -5.1, -4.9, -5.2, -5.0, -4.8]  # rows the claims must not read
    return {
        "schema": "attnaudit.alignment/1",
        "warnings": list(warnings),
        "results": {
            "summary": [
                row("net_log_error_ratio_attn", "principal", far),
                row("cka_advantage_attn", "principal", far),
                row("kernel_log_error_ratio_attn", "trailing", far),
                row("kernel_error_advantage_attn", "principal", far),  # the retired difference of errors
                row("kernel_log_error_ratio_attn", "principal", principal, row_warnings),
                row("kernel_log_error_ratio_attn", "labels", labels),
            ],
            "contrast": [
                row("kernel_log_error_ratio_attn_contrast", "principal-trailing", far),
                row("cka_advantage_attn_contrast", "principal-random", far),
                row("kernel_error_advantage_attn_contrast", "principal-random", far),
                row("kernel_log_error_ratio_attn_contrast", "principal-random", contrast),
            ],
        },
    }


UP = [0.10, 0.14, 0.12, 0.16, 0.11, 0.13, 0.15, 0.09]  # error ratios 1.09-1.17, above 1.05 on every seed
DOWN = [-x for x in UP]
MIXED = [0.05, -0.04, 0.02, -0.01, 0.2, 0.0, 0.08, -0.1]


def test_alignment_rows_read_the_log_error_ratios_against_log_1_05():
    for vals, verdict in ((UP, SUP), (DOWN, CON), (MIXED, NOT_RES)):
        rows = C.claim_alignment(_align_report(vals, vals, vals, warnings=[RUN_WARNING]), "cmd")
        assert len(rows) == 3
        expected = median_reading(vals, LOG_MIN_RATIO, "above")
        assert expected["verdict"] == verdict
        for row in rows:
            assert row.null_value == pytest.approx(LOG_MIN_RATIO) and row.min_effect == "error ratio > 1.05"
            assert_reads(row, expected, vals)
            assert RUN_WARNING in row.warnings
    # each row reads its own quantity (the contrast, principal, labels)
    rows = C.claim_alignment(_align_report(UP, DOWN, MIXED, row_warnings=["principal row's own warning"]), "cmd")
    assert [r.verdict for r in rows] == [NOT_RES, SUP, CON]
    assert "kernel_log_error_ratio_attn_contrast (principal-random)" in rows[0].measured
    assert "principal row's own warning" in rows[1].warnings and "principal row's own warning" not in rows[2].warnings
    # two seeds never decide
    rows = C.claim_alignment(_align_report(UP[:2], UP[:2], UP[:2]), "cmd")
    assert [r.verdict for r in rows] == [NOT_RES] * 3


def test_a_tiny_alignment_advantage_is_contradicted():
    """An error ratio of exp(1e-4) on each of 12 seeds is an advantage, but far below the minimum
    effect of 5 %: the claim (ratio > 1.05) is contradicted, never supported."""
    tiny = [1e-4] * 12
    rows = C.claim_alignment(_align_report(tiny, tiny, tiny), "cmd")
    expected = median_reading(tiny, LOG_MIN_RATIO, "above")
    assert expected["p_contra"] == pytest.approx(2.0**-12) and expected["interval"] == [1e-4, 1e-4]
    for row in rows:
        assert row.verdict == CON
        assert_reads(row, expected, tiny)


def test_alignment_missing_quantity_is_not_testable():
    rep = _align_report(UP, UP, UP)
    rep["results"]["contrast"] = [
        r for r in rep["results"]["contrast"] if r["target"] != "principal-random" or "log" not in r["quantity"]
    ]
    rows = C.claim_alignment(rep, "cmd")
    assert rows[0].verdict == UNTEST and "kernel_log_error_ratio_attn_contrast" in rows[0].why
    assert [r.verdict for r in rows[1:]] == [SUP, SUP]


# ----------------------------------------------------------------------------- Holm across one scorecard
def _nine_row_reports(k=7):
    """Reports whose nine seed-based claim rows each read p near 0.02-0.03 unadjusted: the sign-test
    rows 7 of 7 seeds on the claim's side (p = 2 / 128), malleability 8 seeds at 0.9 / 0.1."""
    return {
        "ntk": _ntk_report(RELU_FALLS[:k], ATTN_FLAT[:k]),
        "malleability": _mall_report([0.9] * 8, [0.1] * 8),
        "landscape": _land_report((LAM_RELU[:k], LAM_ATTN[:k]), (TR_RELU[:k], TR_ATTN[:k])),
        "alignment": _align_report(UP[:k], UP[:k], UP[:k]),
    }


def test_holm_across_nine_seed_based_rows_of_one_scorecard():
    reports = _nine_row_reports()
    res = C.score("quick", reports, {}, {rid: f"cmd {rid}" for rid in reports}, [])
    family = [c for c in res.claims if c.role == "claim"]
    assert len(family) == 9 and len(res.claims) == 10
    # unadjusted, every row is supported at p <= 0.05
    assert [c.raw_verdict for c in family] == [SUP] * 9
    assert all(c.p_value <= LEVEL for c in family)
    sign_rows = [c for c in family if c.run != "malleability"]
    assert all(c.p_value == pytest.approx(2 / 128) for c in sign_rows)  # binomtest: P(Bin(7, 1/2) >= 7) = 1/128
    assert 0.02 < next(c for c in family if c.run == "malleability").p_value <= LEVEL
    # Holm over the nine: the smallest p is multiplied by 9 and nothing survives
    holm = holm_by_hand([c.p_value for c in family])
    assert [c.p_adjusted for c in family] == pytest.approx(holm, rel=1e-12)
    assert min(holm) > LEVEL
    assert [c.verdict for c in family] == [NOT_RES] * 9
    for c in family:
        assert "Holm" in c.why and "unadjusted it reads supported" in c.why
        assert c.seeds_needed is not None
    # seeds that would resolve a sign-test row at Holm's strictest level 0.025 / 9 (80 % power, every
    # resampled seed on the claim's side): 2^-9 <= 0.025 / 9 < 2^-8
    assert 2.0**-9 <= 0.025 / 9 < 2.0**-8
    assert all(c.seeds_needed == 9 for c in sign_rows)
    # the sensitivity row takes the family's Bonferroni factor and stays out of the family
    sens = next(c for c in res.claims if c.role == "sensitivity")
    assert sens.p_adjusted == pytest.approx(min(1.0, 9 * sens.p_value)) and sens.verdict == NOT_RES
    assert sens.raw_verdict == SUP
    head = res.verdicts()[0]
    assert "9 not resolved (Holm-adjusted)" in head and "supported" not in head


def _stub_row(p_claim, p_contra=1.0, n=6, inside=True):
    test = SeedTest(
        [0.0] * n,
        lambda u: (p_claim, p_contra),
        lambda iv: inside,
        Interval(2.0, 1.5, 2.5, "stub", CONF, n),
        "stub estimand",
    )
    return SimpleNamespace(
        test=test, verdict=NOT_RES, raw_verdict="", why="", p_value=None, p_adjusted=None, seeds_needed=None
    )


def test_adjust_nine_rows_at_p_0_02_none_survive():
    rows = [_stub_row(0.01) for _ in range(9)]  # p_value = 2 x 0.01 = 0.02 each
    adjust(rows)
    assert all(r.p_value == pytest.approx(0.02) for r in rows)
    assert all(r.p_adjusted == pytest.approx(0.18) for r in rows)  # Holm with nine ties: 9 x 0.02
    assert [r.raw_verdict for r in rows] == [SUP] * 9
    assert [r.verdict for r in rows] == [NOT_RES] * 9
    assert all("unadjusted it reads supported" in r.why for r in rows)


def test_adjust_one_strong_row_survives_among_weak_ones():
    rows = [_stub_row(0.0005)] + [_stub_row(0.25) for _ in range(8)]  # p_value 0.001 and 0.5
    adjust(rows)
    assert rows[0].p_value == pytest.approx(0.001) and rows[0].p_adjusted == pytest.approx(0.009)
    assert rows[0].verdict == rows[0].raw_verdict == SUP
    assert all(r.p_adjusted == pytest.approx(0.5 * 8) or r.p_adjusted == 1.0 for r in rows[1:])
    assert [r.verdict for r in rows[1:]] == [NOT_RES] * 8
    # the other side: contradicted survives the same way
    rows = [_stub_row(1.0, 0.0005, inside=False)] + [_stub_row(0.25) for _ in range(8)]
    adjust(rows)
    assert rows[0].verdict == CON


def test_rows_below_three_seeds_or_without_a_test_stay_out_of_the_family():
    strong = _stub_row(0.01)  # p_value 0.02: supported only in a family of 1 or 2
    few = _stub_row(0.0001, n=2)
    none = SimpleNamespace(test=None, verdict=UNTEST, raw_verdict="", why="x", p_value=None, p_adjusted=None)
    adjust([strong, few, none])
    assert strong.p_adjusted == pytest.approx(0.02) and strong.verdict == SUP
    assert few.raw_verdict == few.verdict == NOT_RES and few.p_adjusted is None
    assert none.raw_verdict == none.verdict == UNTEST


def test_an_interval_on_the_null_keeps_a_small_p_unresolved():
    row = _stub_row(0.0001, inside=None)  # the interval touches the null value
    adjust([row])
    assert row.p_adjusted == pytest.approx(0.0002) and row.verdict == NOT_RES


def test_failed_cells_block_every_tested_row_of_a_run():
    rep = _ntk_report(RELU_FALLS, ATTN_FLAT, failed=[{"cell": "attn width 256 seed 3", "error": "nan loss"}])
    res = C.score("quick", {"ntk": rep}, {}, {"ntk": "cmd"}, [])
    assert [c.verdict for c in res.claims] == [NOT_RES] * 4
    assert all(c.why.startswith("blocked") and c.p_value is None for c in res.claims)


def test_an_unresolved_sensitivity_row_says_how_many_seeds_would_resolve_it():
    """ntk alone, 6 seeds: the three claim rows read p = 2 / 64 each, Holm (x 3) leaves them
    unresolved with seeds_needed; the sensitivity row (the same TOST, x 3 Bonferroni) is just as
    unresolved and should say the same."""
    res = C.score("quick", {"ntk": _ntk_report(RELU_FALLS[:6], ATTN_FLAT[:6])}, {}, {"ntk": "cmd"}, [])
    claims = [c for c in res.claims if c.role == "claim"]
    sens = next(c for c in res.claims if c.role == "sensitivity")
    assert all(c.verdict == NOT_RES and c.seeds_needed is not None for c in claims)
    assert sens.verdict == NOT_RES and sens.p_adjusted == pytest.approx(3 * 2 / 64)
    assert sens.seeds_needed is not None


# ----------------------------------------------------------------------------- the headline
def _claim(verdict, raw, role="claim"):
    return C.ClaimRow(
        claim="c",
        paper="",
        null="",
        alternative="",
        null_value=None,
        measured="",
        value=None,
        interval=None,
        interval_method="none",
        confidence=CONF,
        n_seeds=6,
        per_seed=[],
        verdict=verdict,
        why="w",
        run="r",
        command="cmd",
        raw_verdict=raw,
        role=role,
    )


def _variant(reading, error=None):
    return C.VariantRow(
        variant=f"v {reading}",
        options="",
        flip_relu=None,
        flip_attn=None,
        ratio=None,
        interval=None,
        interval_method="none",
        n_seeds=0,
        above_floor={},
        losses_comparable=None,
        reading=reading,
        command="cmd",
        error=error,
    )


def test_headline_counts_adjusted_verdicts_only():
    claims = [
        _claim(NOT_RES, SUP),
        _claim(NOT_RES, SUP),
        _claim(SUP, SUP),
        _claim(CON, CON),
        _claim(SUP, SUP, role="sensitivity"),  # shown, not counted
    ]
    head = C.ClaimsResult("quick", claims, []).verdicts()[0]
    assert head == "claims scorecard (quick): 1 supported, 1 contradicted, 2 not resolved (Holm-adjusted)"


@pytest.mark.parametrize(
    "readings, same",
    [
        (["attn more malleable"] * 3, True),
        (["relu more malleable"] * 2, True),
        (["attn more malleable", "attn more malleable", "not resolved"], False),
        (["attn more malleable", "relu more malleable"], False),
        (["attn more malleable", "attn more sensitive, not shown beyond noise"], False),
        (["not resolved"] * 3, False),
        ([], False),
    ],
)
def test_headline_reads_the_same_only_when_every_variant_resolves_one_ordering(readings, same):
    head = C.ClaimsResult("quick", [_claim(SUP, SUP)], [_variant(r) for r in readings]).verdicts()[0]
    assert ("reads the same under all" in head) == same, head
    if same:
        assert f"all {len(readings)} protocol variants ({readings[0]})" in head


def test_headline_does_not_read_the_same_when_a_variant_failed():
    variants = [_variant("attn more malleable"), _variant("attn more malleable"), _variant("n/a", error="run failed")]
    head = C.ClaimsResult("quick", [_claim(SUP, SUP)], variants).verdicts()[0]
    assert "reads the same under all" not in head, head


# ----------------------------------------------------------------------------- plan
def _pairs(args):
    return list(zip(args, args[1:]))


@pytest.mark.parametrize("mode", ["quick", "full"])
@pytest.mark.parametrize("n_seeds", [1, 4])
def test_plan_gives_every_stochastic_run_the_seeds(mode, n_seeds):
    runs, variants = P.plan(mode, ["--dataset", "digits"], 7, n_seeds=n_seeds)
    ids = [r.id for r in runs]
    assert {"kappa", "ntk", "malleability", "landscape"} <= set(ids)
    assert len(set(ids)) == len(ids)
    for r in runs:
        assert ("--seed", "7") in _pairs(r.args)
        if r.command != "kappa":
            assert ("--seeds", str(n_seeds)) in _pairs(r.args), r.id
    assert variants[0][1] == "malleability" and all(rid in ids for _, rid in variants)


def test_plan_includes_alignment_when_registered():
    from attnaudit.audit.commands import option_params

    try:
        option_params("alignment")
    except KeyError:
        pytest.skip("no alignment command in this build")
    runs, _ = P.plan("quick", [], 0, n_seeds=3)
    align = next(r for r in runs if r.id == "alignment")
    assert ("--seeds", "3") in _pairs(align.args)


def test_match_loss_reaches_malleability_and_landscape():
    runs, variants = P.plan("quick", [], 0, n_seeds=3, match_loss=0.05)
    by_id = {r.id: r for r in runs}
    for rid in ("malleability", "landscape"):
        assert ("--match-loss", "0.05") in _pairs(by_id[rid].args)
    for rid in ("kappa", "ntk"):
        assert "--match-loss" not in by_id[rid].args
    # every malleability variant runs at the matched loss, except the one that shows the other choice
    for name, rid in variants:
        args = by_id[rid].args
        last = [b for a, b in _pairs(args) if a == "--match-loss"]
        assert last, (name, args)
        assert last[-1] == ("none" if "no loss matching" in name else "0.05"), name
    # without --match-loss, no run but the loss-matching variant gets one
    runs, variants = P.plan("quick", [], 0, n_seeds=3)
    assert not any("--match-loss" in r.args for r in runs if r.id in ("malleability", "landscape"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "medium"}, "preset.*quick or paper"),
        ({"n_seeds": 0}, "seeds must"),
        ({"n_seeds": -2}, "seeds must"),
        ({"match_loss": 0.0}, "match_loss"),
        ({"match_loss": -0.1}, "match_loss"),
        ({"match_loss": float("nan")}, "match_loss"),
        ({"match_loss": float("inf")}, "match_loss"),
    ],
)
def test_plan_refuses_bad_settings(kwargs, match):
    args = {"mode": "quick", **kwargs}
    mode = args.pop("mode")
    with pytest.raises(AuditError, match=match):
        P.plan(mode, [], 0, **args)


@pytest.mark.parametrize(
    "extra", [["--seeds", "0"], ["--match-loss", "-1"], ["--match-loss", "0"], ["--slope-margin", "-0.1"]]
)
def test_cli_refuses_bad_settings_before_running(extra, tmp_path, capsys):
    from attnaudit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["claims", "--preset", "quick", "-q", "--json", str(tmp_path / "c.json"), *extra])
    assert info.value.code == 2
    assert extra[0] in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


# ----------------------------------------------------------------------------- end to end
SMALL = {
    "kappa": ["--n", "300"],
    "ntk-distance": ["--widths", "16,64", "--n-train", "60", "--n-test", "30", "--steps", "60"],
    "malleability": [
        "--n-train",
        "60",
        "--n-test",
        "20",
        "--steps",
        "60",
        "--top-k",
        "10",
        "--width",
        "32",
        "--pgd-steps",
        "3",
        "--attacks",
        "pgd,random",
    ],
    "landscape": ["--n-train", "100", "--steps", "100", "--width", "32", "--points", "5", "--grid", "0"],
    "alignment": ["--n-train", "60", "--n-test", "30", "--width", "32", "--steps", "100"],
}
ROW_FIELDS = {
    "claim": str,
    "paper": str,
    "null": str,
    "alternative": str,
    "measured": str,
    "interval_method": str,
    "verdict": str,
    "why": str,
    "run": str,
    "command": str,
    "confidence": float,
    "n_seeds": int,
    "per_seed": list,
    "warnings": list,
    "p_value": (float, type(None)),
    "p_adjusted": (float, type(None)),
    "raw_verdict": str,
    "seeds_needed": (int, type(None)),
    "min_effect": str,
    "estimand": str,
    "role": str,
    "controls": dict,
}


def test_quick_scorecard_on_digits_end_to_end(tmp_path, monkeypatch):
    from attnaudit.cli import main

    real_plan = P.plan
    asked = {}

    def small_plan(mode, data_args, seed, n_seeds=P.DEFAULT_SEEDS, match_loss=None, resample=True):
        asked.update(n_seeds=n_seeds, match_loss=match_loss, resample=resample)
        runs, variants = real_plan(mode, data_args, seed, n_seeds=n_seeds, match_loss=match_loss, resample=resample)
        return [P.RunSpec(r.id, r.command, (*r.args, *SMALL[r.command]), r.purpose) for r in runs], variants

    monkeypatch.setattr(P, "plan", small_plan)
    out, png = tmp_path / "claims.json", tmp_path / "c.png"
    with pytest.raises(SystemExit) as info:
        main(
            [
                "--threads",
                "1",
                "claims",
                "--preset",
                "quick",
                "--seeds",
                "3",
                "-q",
                "--json",
                str(out),
                "--png",
                str(png),
            ]
        )
    report = json.loads(out.read_text())
    failed = {r["id"]: r["error"] for r in report["results"]["runs"] if r["error"]}
    assert info.value.code == 0 and not failed, failed
    assert asked == {"n_seeds": 3, "match_loss": None, "resample": True}
    assert report["schema"] == C.SCHEMA
    res = report["results"]
    assert res["protocol"]["n_seeds"] == 3 and res["protocol"]["seeds"] == [0, 1, 2]
    runs = {r["id"]: r for r in res["runs"]}
    expected_runs = {"kappa", "ntk", "malleability", "landscape"} | (
        {"alignment"} if P._has_command("alignment") else set()
    )
    assert expected_runs <= set(runs)
    rows = res["claims"]
    assert {r["run"] for r in rows} == expected_runs
    assert len(rows) == sum(len(C.TITLES[rid]) for rid in expected_runs)
    for r in rows:
        for key, typ in ROW_FIELDS.items():
            assert isinstance(r[key], typ), (r["claim"], key, r[key])
        assert r["verdict"] in C.VERDICTS and r["why"]
        assert r["confidence"] == 0.95
        assert "null_value" in r and (r["null_value"] is None or isinstance(r["null_value"], float))
        assert r["interval"] is None or (
            isinstance(r["interval"], list)
            and len(r["interval"]) == 2
            and all(x is None or isinstance(x, float) for x in r["interval"])
        )
        assert r["command"] == runs[r["run"]]["command"]
        if r["run"] != "kappa":
            assert r["n_seeds"] <= 3
        # the run's own warnings reach the row
        for w in runs[r["run"]]["report"].get("warnings") or []:
            assert w in r["warnings"], (r["claim"], w)
    # ntk rows: the per-seed slopes are the run's, read by the sign test of the median seed (3
    # seeds: no 95 % order-statistic interval)
    ntk_rep = runs["ntk"]["report"]["results"]
    relu_row = next(r for r in rows if r["run"] == "ntk")
    if relu_row["n_seeds"] >= 2:
        assert set(relu_row["per_seed"]) <= set(ntk_rep["models"]["relu"]["slope_per_seed"])
        expected = median_reading(relu_row["per_seed"], -0.1, "below")
        assert relu_row["interval"] == expected["interval"]
        assert relu_row["p_value"] == pytest.approx(expected["p_value"])
    # Holm: the raw reading and the adjusted one; a row that is not resolved says how many seeds would resolve it
    for r in rows:
        assert r["role"] in ("claim", "sensitivity") and r["raw_verdict"] in C.VERDICTS
        if r["p_value"] is not None and r["n_seeds"] >= 3:
            assert r["p_adjusted"] is not None and r["p_adjusted"] >= r["p_value"] - 1e-15
    assert sum(r["role"] == "sensitivity" for r in rows) == 1
    mall = next(r for r in rows if r["run"] == "malleability")
    assert set(mall["controls"]) == {"attn", "relu"}
    variants = res["protocol_variants"]
    # the quick preset matches training losses and resamples the split; the variants show the other choices
    assert variants[0]["variant"] == "preset protocol, matched training loss (auto)" and len(variants) >= 3
    by_name = {v["variant"]: v for v in variants}
    assert "--match-loss none" in by_name["fixed steps, no loss matching"]["command"]
    fixed = by_name["fixed data split (seeds replicate the initialisation only)"]["command"]
    assert "--resample-data" not in fixed and "--resample-data" in variants[0]["command"]
    assert variants[0]["losses_comparable"] is not False
    assert all(v["error"] is None for v in variants)
    assert png.stat().st_size > 0
    # every run's command line names --seeds 3 where the command takes seeds
    for rid, r in runs.items():
        if rid != "kappa":
            assert "--seeds 3" in r["command"], r["command"]
    # a row's command reproduces its number: rerun the kappa and ntk commands
    for rid in ("kappa", "ntk"):
        again = tmp_path / f"{rid}.json"
        args = shlex.split(runs[rid]["command"])[1:]
        with pytest.raises(SystemExit) as info:
            main(["--threads", "1", *args, "-q", "--json", str(again)])
        assert info.value.code in (0, None)
        rerun = json.loads(again.read_text())["results"]
        if rid == "kappa":
            amp = rerun["amplification_check"]
            assert (
                amp["log10_predicted_kappa_cubed"]
                == runs["kappa"]["report"]["results"]["amplification_check"]["log10_predicted_kappa_cubed"]
            )
            kappa_rows = [r for r in rows if r["run"] == "kappa"]
            width = kappa_rows[1]
            basis = "numerical_rank" if rerun["gram"]["rank_deficient"] else "kappa_d"
            est = next(w for w in rerun["width_estimates"] if w["basis"] == basis)
            assert width["value"] == est["log10_required_width"]
        else:
            assert rerun["models"]["relu"]["slope_per_seed"] == ntk_rep["models"]["relu"]["slope_per_seed"]


def test_preset_names_the_scorecard_like_every_other_command(capsys):
    from attnaudit.claims.run import ClaimsRequest
    from attnaudit.cli import main
    from attnaudit.errors import AuditError

    def _mode(preset):
        return ClaimsRequest(preset=preset).mode

    assert _mode(None) == "quick" and _mode("quick") == "quick" and _mode("paper") == "full"
    with pytest.raises(AuditError, match="preset"):
        _mode("fast")
    with pytest.raises(SystemExit) as exc:
        main(["claims", "--quick", "-q"])  # the older spelling, removed in 0.2.0
    assert exc.value.code == 2 and "--quick" in capsys.readouterr().err
