"""The claims scorecard: every verdict rule on synthetic reports shaped like the runs' JSON,
checked against intervals computed here with scipy (never claims.py's or stats.py's own
helpers), the plan's command lines, and one end-to-end scorecard on digits."""

from __future__ import annotations

import json
import math
import shlex

import numpy as np
import pytest
from scipy import stats as st

from attnaudit.claims import scorecard as C
from attnaudit.errors import AuditError

CONF = 0.95
RUN_WARNING = "a warning the run itself raised"


# ----------------------------------------------------------------------------- independent references
def t_interval(values) -> tuple[float, float]:
    """Student-t 95 % interval of the mean, by scipy."""
    v = np.asarray(values, dtype=float)
    lo, hi = st.t.interval(CONF, len(v) - 1, loc=v.mean(), scale=st.sem(v))
    return float(lo), float(hi)


def chance_threshold(c: int, n: int) -> float:
    """The documented rule: below 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n)) is chance."""
    p = 1.0 / c
    return p + max(0.05, 2.0 * math.sqrt(p * (1.0 - p) / n))


def assert_interval(row, expected, rel=1e-9):
    assert row.interval is not None and len(row.interval) == 2
    assert row.interval[0] == pytest.approx(expected[0], rel=rel, abs=1e-12)
    assert row.interval[1] == pytest.approx(expected[1], rel=rel, abs=1e-12)


# ----------------------------------------------------------------------------- ntk-distance
def _ntk_report(relu, attn, seeds=None, acc=None, widths=(16, 64, 256), n_train=200, n_classes=10, warnings=()):
    """results.config.seeds, results.models[arch].slope_per_seed, results.cells, n_classes, n_train, warnings."""
    seeds = list(range(len(relu))) if seeds is None else list(seeds)
    acc = acc or {}
    cells = [
        {"model": m, "width": w, "seed": s, "net_train_acc": acc.get((m, w, s), 0.9), "distance_rms": 0.1}
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
            "models": {"relu": {"slope_per_seed": list(relu)}, "attn": {"slope_per_seed": list(attn)}},
        },
    }


RELU_FALLS = [-0.42, -0.47, -0.51, -0.45, -0.40]
ATTN_FLAT = [-0.03, 0.02, -0.01, 0.04, -0.02]


def test_ntk_relu_row_is_the_t_interval_of_the_per_seed_slopes():
    rows = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT), "cmd")
    relu = rows[0]
    assert relu.null_value == 0.0
    assert_interval(relu, t_interval(RELU_FALLS))
    assert relu.value == pytest.approx(np.mean(RELU_FALLS))
    assert relu.per_seed == pytest.approx(RELU_FALLS)
    assert relu.n_seeds == 5 and relu.confidence == CONF
    assert relu.verdict == "supported"  # the whole interval is below 0


@pytest.mark.parametrize(
    "slopes, verdict",
    [
        ([0.20, 0.25, 0.31, 0.22], "contradicted"),  # the distance grows with width
        ([-0.30, 0.10, -0.05, 0.15], "not resolved"),  # straddles 0
        ([-0.5, -0.5001], "not resolved"),  # 2 seeds, tiny spread: never a verdict
        ([0.5, 0.5001], "not resolved"),
    ],
)
def test_ntk_relu_verdicts(slopes, verdict):
    row = C.claim_ntk(_ntk_report(slopes, [0.0] * len(slopes)), "cmd")[0]
    lo, hi = t_interval(slopes)
    assert_interval(row, (lo, hi))
    if len(slopes) >= 3:  # the verdict the independent interval gives
        assert verdict == ("supported" if hi < 0 else "contradicted" if lo > 0 else "not resolved")
    assert row.verdict == verdict


def test_two_seeds_never_decide_even_with_tiny_spread():
    rows = C.claim_ntk(_ntk_report([-0.5, -0.50001], [0.3, 0.30001]), "cmd")
    assert [r.verdict for r in rows] == ["not resolved"] * 3
    assert all(r.n_seeds == 2 for r in rows)
    # the interval is still reported, and it is the t(1) interval
    assert_interval(rows[0], t_interval([-0.5, -0.50001]))


def test_mlp_attn_row_is_tested_against_the_margin_not_zero():
    # straddles 0 AND reaches below -0.1: a null result is no support for "no fall"
    straddle = [-0.15, 0.05, -0.05, 0.10, -0.12]
    lo, hi = t_interval(straddle)
    assert lo < -0.1 < 0 < hi
    row = C.claim_ntk(_ntk_report(RELU_FALLS, straddle), "cmd")[1]
    assert row.null_value == pytest.approx(-0.1)
    assert_interval(row, (lo, hi))
    assert row.verdict == "not resolved"
    # entirely above -0.1 (it may still include 0): supported
    lo, hi = t_interval(ATTN_FLAT)
    assert -0.1 < lo < 0 < hi
    assert C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT), "cmd")[1].verdict == "supported"
    # entirely below -0.1: it approaches its predictor, the claim is contradicted
    falls = [-0.40, -0.45, -0.50]
    assert t_interval(falls)[1] < -0.1
    assert C.claim_ntk(_ntk_report(RELU_FALLS[:3], falls), "cmd")[1].verdict == "contradicted"


def test_slope_margin_reaches_the_mlp_attn_row():
    slopes = [-0.20, -0.22, -0.25, -0.21]
    lo, hi = t_interval(slopes)
    assert -0.3 < lo and hi < -0.1
    assert C.claim_ntk(_ntk_report(RELU_FALLS[:4], slopes), "cmd")[1].verdict == "contradicted"
    row = C.claim_ntk(_ntk_report(RELU_FALLS[:4], slopes), "cmd", slope_margin=0.3)[1]
    assert row.null_value == pytest.approx(-0.3) and row.verdict == "supported"
    # margin 0: an interval straddling 0 is not resolved
    assert C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT), "cmd", slope_margin=0.0)[1].verdict == "not resolved"
    # the same data, scored through score(), carry the margin too
    res = C.score("quick", {"ntk": _ntk_report(RELU_FALLS[:4], slopes)}, {}, {"ntk": "cmd"}, [], slope_margin=0.3)
    assert res.claims[1].verdict == "supported"


def test_a_width_at_chance_in_one_seed_is_left_out_for_every_seed_and_named():
    """Every seed is kept: a width where any seed trained to chance is dropped for all seeds, and
    each seed's slope is refitted over the remaining widths (checked against numpy's polyfit)."""
    seeds = [5, 6, 7, 8, 9]  # not 0-based: seeds are matched by id, not position
    widths = (16, 64, 256, 1024)
    thr = chance_threshold(10, 200)
    rng = np.random.default_rng(3)
    dist = {
        (m, w, s): float(np.exp(rng.normal(scale=0.5)) * w ** (-0.4 if m == "relu" else 0.02))
        for m in ("relu", "attn")
        for w in widths
        for s in seeds
    }
    # seed 7 of relu is at chance in its narrowest cell only; attn's seed 8 is just above the threshold
    acc = {("relu", 16, 7): thr - 0.005, ("attn", 16, 8): thr + 0.005}
    rep = _ntk_report(RELU_FALLS, ATTN_FLAT, seeds=seeds, acc=acc, widths=widths)
    for cell in rep["results"]["cells"]:
        cell["distance_rms"] = dist[(cell["model"], cell["width"], cell["seed"])]
    relu, attn, diff = C.claim_ntk(rep, "cmd")

    def fit(model, ws):
        return [float(np.polyfit(np.log(ws), np.log([dist[(model, w, s)] for w in ws]), 1)[0]) for s in seeds]

    kept = fit("relu", [64, 256, 1024])
    assert relu.per_seed == pytest.approx(kept, rel=1e-10) and relu.n_seeds == 5
    assert_interval(relu, t_interval(kept))
    assert "widths 64, 256, 1024" in relu.measured
    assert any("chance" in w and "seed 7" in w and "width(s) 16 left out for every seed" in w for w in relu.warnings)
    # attention has no cell at chance: the run's own slopes, all 5 seeds, no chance warning
    assert attn.per_seed == pytest.approx(ATTN_FLAT) and attn.n_seeds == 5
    assert not any("chance" in w for w in attn.warnings)
    # the paired row compares both models over the widths both keep
    d = [a - r for a, r in zip(fit("attn", [64, 256, 1024]), kept)]
    assert diff.per_seed == pytest.approx(d, rel=1e-10) and diff.n_seeds == 5
    assert_interval(diff, t_interval(d))
    assert any("seed 7" in w for w in diff.warnings)


def test_fewer_than_three_widths_above_chance_leave_no_slope():
    thr = chance_threshold(10, 200)
    acc = {("attn", 16, 1): thr - 0.01}  # of 3 widths only 64 and 256 remain
    relu, attn, diff = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT, acc=acc), "cmd")
    assert relu.verdict == "supported" and relu.n_seeds == 5
    assert attn.verdict == "not testable here" and "fewer than 3 widths" in attn.why
    assert diff.verdict == "not testable here"


def test_the_chance_rule_uses_n_and_c_of_the_run():
    # n = 60, c = 10: threshold 0.1 + 2 sqrt(0.09 / 60) = 0.1775 (the 2-sd term beats 0.05)
    thr = chance_threshold(10, 60)
    assert thr == pytest.approx(0.1 + 2 * math.sqrt(0.09 / 60))
    widths = (16, 64, 256, 1024)
    for acc, dropped in ((thr - 0.002, True), (thr + 0.002, False)):
        rep = _ntk_report(RELU_FALLS[:4], ATTN_FLAT[:4], n_train=60, acc={("attn", 64, 2): acc}, widths=widths)
        attn = C.claim_ntk(rep, "cmd")[1]
        assert attn.n_seeds == 4 and any("chance" in w for w in attn.warnings) == dropped
        # dropped: refitted over 16, 256, 1024 from the cells' (constant) distances, slope 0; else the run's
        assert attn.per_seed == pytest.approx([0.0] * 4 if dropped else ATTN_FLAT[:4], abs=1e-12)
    # c = 2, n = 1000: threshold 0.55 (the 0.05 floor beats 2 sqrt(0.25 / 1000) = 0.032)
    thr = chance_threshold(2, 1000)
    assert thr == pytest.approx(0.55)
    rep = _ntk_report(RELU_FALLS, ATTN_FLAT, n_train=1000, n_classes=2, acc={("relu", 256, 0): 0.54}, widths=widths)
    relu = C.claim_ntk(rep, "cmd")[0]
    assert relu.n_seeds == 5 and relu.per_seed == pytest.approx([0.0] * 5, abs=1e-12)
    assert any("width(s) 256 left out" in w for w in relu.warnings)


def test_every_seed_at_chance_is_not_testable():
    acc = {("attn", 16, s): 0.11 for s in range(3)}
    rows = C.claim_ntk(_ntk_report(RELU_FALLS[:3], [0.0, 0.01, -0.01], acc=acc), "cmd")
    assert rows[0].verdict == "supported"
    assert rows[1].verdict == "not testable here" and "chance" in rows[1].why
    assert rows[2].verdict == "not testable here"


def test_paired_slope_difference_row():
    relu = [-0.40, -0.45, -0.50, -0.42]
    attn = [-0.10, -0.05, -0.20, -0.08]
    d = [a - r for a, r in zip(attn, relu)]
    row = C.claim_ntk(_ntk_report(relu, attn), "cmd")[2]
    assert row.null_value == 0.0 and row.per_seed == pytest.approx(d)
    assert_interval(row, t_interval(d))
    assert t_interval(d)[0] > 0 and row.verdict == "supported"
    # the pairing matters: the paired interval is narrower than the unpaired one would be
    assert row.interval[1] - row.interval[0] < 2 * st.t.ppf(0.975, 3) * math.sqrt(
        np.var(attn, ddof=1) / 4 + np.var(relu, ddof=1) / 4
    )
    # attention falls faster than relu: contradicted
    row = C.claim_ntk(_ntk_report(attn, relu), "cmd")[2]
    assert row.verdict == "contradicted"


def test_ntk_run_warnings_reach_every_row():
    rows = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT, warnings=[RUN_WARNING]), "cmd")
    assert len(rows) == 3 and all(RUN_WARNING in r.warnings for r in rows)
    acc = {("attn", 16, s): 0.11 for s in range(5)}  # also on a not-testable row
    rows = C.claim_ntk(_ntk_report(RELU_FALLS, ATTN_FLAT, acc=acc, warnings=[RUN_WARNING]), "cmd")
    assert all(RUN_WARNING in r.warnings for r in rows)


# ----------------------------------------------------------------------------- malleability
ATTN_FLIPS = [0.50, 0.30, 0.70, 0.45, 0.60]
RELU_FLIPS = [0.10, 0.25, 0.15, 0.30, 0.08]


def _mall_report(
    attn,
    relu,
    top_k=30,
    attn_beats=True,
    relu_beats=True,
    comparable=True,
    acc=None,
    n_train=300,
    n_classes=10,
    floor="sign",
    warnings=(),
):
    """results.config, summary (flip_rate, floors), ratios (values, loss_gate), training, n_train, dataset."""
    seeds = list(range(len(attn)))
    acc = acc or {}

    def summary(model, vals, beats, eps=0.3):
        return {
            "model": model,
            "attack": "pgd",
            "eps": eps,
            "damping": 0.001,
            "seeds": seeds,
            "top_k": top_k,
            "flip_rate": {"mean": float(np.mean(vals)), "values": list(vals), "n": len(vals)},
            "floors": {}
            if floor is None
            else {
                floor: {"mean": 0.01, "ci_high": 0.05, "exceeded": beats, "attack": floor},
                "reinit": {"mean": 0.0, "ci_high": 0.05, "exceeded": True},
            },
        }

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

    decoy = [0.9] * len(attn)  # a second eps the claim must not read
    return {
        "schema": "attnaudit.malleability/1",
        "warnings": list(warnings),
        "results": {
            "config": {"attacks": ["pgd", "sign"], "eps": [0.3, 0.1], "damping": [0.001], "top_k": top_k},
            "n_train": n_train,
            "dataset": {"class_counts": {str(i): n_train // n_classes for i in range(n_classes)}},
            "summary": [
                summary("relu", relu, relu_beats),
                summary("attn", attn, attn_beats),
                summary("relu", decoy, True, 0.1),
                summary("attn", decoy, True, 0.1),
            ],
            "ratios": [ratio(0.1, decoy, [0.01] * len(attn)), ratio(0.3, attn, relu)],
            "training": [
                {"seed": s, "model": m, "role": role, "train_accuracy": acc.get((m, s, role), 0.95)}
                for s in seeds
                for m in ("relu", "attn")
                for role in ("clean", "perturbed")
            ],
        },
    }


def fieller_by_inversion(a, b, grid):
    """theta is in the 95 % set iff the one-sample t-test of a_i - theta b_i against 0 has p > 0.05."""
    a, b = np.asarray(a), np.asarray(b)
    return np.array([st.ttest_1samp(a - th * b, 0.0).pvalue > 0.05 for th in grid])


def jeffreys_floor(v, k):
    p = (sum(v) * k + 0.5) / (len(v) * k + 1.0)
    return p * (1 - p) / k


@pytest.mark.parametrize("top_k", [None, 30])
def test_malleability_ratio_interval_is_fiellers_set_by_test_inversion(top_k):
    # with top_k = 30 the binomial variance floor p(1 - p)/K (Jeffreys' p) is below both
    # per-seed sample variances, so the floored set equals the plain Fieller set
    if top_k:
        for v in (ATTN_FLIPS, RELU_FLIPS):
            assert np.var(v, ddof=1) > jeffreys_floor(v, top_k)
    row = C.claim_malleability(_mall_report(ATTN_FLIPS, RELU_FLIPS, top_k=top_k), "cmd")
    lo, hi = row.interval
    assert lo is not None and hi is not None
    grid = np.linspace(0.0, 40.0, 8001)
    inside = fieller_by_inversion(ATTN_FLIPS, RELU_FLIPS, grid)
    assert inside.any() and not inside[-1]  # a bounded set inside the grid
    away = (np.abs(grid - lo) > 1e-3) & (np.abs(grid - hi) > 1e-3)
    np.testing.assert_array_equal(((grid >= lo) & (grid <= hi))[away], inside[away])
    assert row.value == pytest.approx(np.mean(ATTN_FLIPS) / np.mean(RELU_FLIPS))
    assert row.null_value == 1.0 and row.n_seeds == 5
    assert row.per_seed == [{"attn": x, "relu": y} for x, y in zip(ATTN_FLIPS, RELU_FLIPS)]
    assert "fieller" in row.interval_method
    assert lo > 1 and row.verdict == "supported"


def test_the_binomial_floor_widens_identical_seeds():
    # three identical seeds: no sample variance, but the binomial one p(1 - p)/K of K = 30
    # audited examples (Jeffreys' p): the set {theta: (a - theta b)^2 <= t^2 (Va + theta^2 Vb) / k}
    a, b, k = [0.3] * 3, [0.2] * 3, 30
    va, vb = jeffreys_floor(a, k), jeffreys_floor(b, k)
    g = st.t.ppf(0.975, 2) ** 2 / 3
    grid = np.linspace(0.0, 20.0, 20001)
    inside = (0.3 - grid * 0.2) ** 2 <= g * (va + grid**2 * vb)
    row = C.claim_malleability(_mall_report(a, b, top_k=k), "cmd")
    lo, hi = row.interval
    assert inside.any() and not inside[-1]  # bounded inside the grid
    assert lo == pytest.approx(grid[inside].min(), abs=2e-3) and hi == pytest.approx(grid[inside].max(), abs=2e-3)
    assert lo < 1.5 - 0.1  # far wider than the zero-width interval the sample variance alone gives
    assert row.verdict == "not resolved"


@pytest.mark.parametrize(
    "kw, verdict",
    [
        ({}, "supported"),
        ({"attn_beats": False}, "not resolved"),  # attn's attack is inside its noise control
        ({"attn_beats": False, "floor": "random"}, "not resolved"),  # the random control counts too
        ({"relu_beats": False}, "supported"),  # relu's floor does not bear on "attn more malleable"
        ({"comparable": False}, "not testable here"),
        ({"acc": {("attn", 2, "clean"): 0.12}}, "not testable here"),  # one clean training at chance
        ({"acc": {("attn", 2, "perturbed"): 0.12}}, "supported"),  # a perturbed retraining is no clean model
    ],
)
def test_malleability_verdicts(kw, verdict):
    row = C.claim_malleability(_mall_report(ATTN_FLIPS, RELU_FLIPS, **kw), "cmd")
    assert row.verdict == verdict
    if verdict == "not testable here":
        assert row.why


def test_malleability_contradicted_needs_relu_beyond_its_floor():
    attn, relu = RELU_FLIPS, ATTN_FLIPS  # relu the more malleable
    grid = np.linspace(0, 2, 2001)
    inside = fieller_by_inversion(attn, relu, grid)
    assert grid[inside].max() < 1
    assert C.claim_malleability(_mall_report(attn, relu), "cmd").verdict == "contradicted"
    assert C.claim_malleability(_mall_report(attn, relu, relu_beats=False), "cmd").verdict == "not resolved"


def test_malleability_straddling_one_and_two_seeds_are_not_resolved():
    a, b = [0.30, 0.10, 0.25, 0.15], [0.20, 0.15, 0.22, 0.12]
    inside = fieller_by_inversion(a, b, [1.0])
    assert inside[0]
    assert C.claim_malleability(_mall_report(a, b), "cmd").verdict == "not resolved"
    row = C.claim_malleability(_mall_report([0.60, 0.61], [0.05, 0.051]), "cmd")
    assert row.verdict == "not resolved" and row.n_seeds == 2


@pytest.mark.parametrize("attn", [[0.2, 0.3, 0.1], [0.50, 0.52, 0.48]])  # attn unclear / clearly above 0
@pytest.mark.parametrize("top_k", [None, 30])
def test_a_zero_relu_denominator_is_unbounded_never_zero(top_k, attn):
    from rich.console import Console

    from attnaudit.claims.run import _tables

    rep = _mall_report(attn, [0.0, 0.0, 0.0], top_k=top_k)
    row = C.claim_malleability(rep, "cmd")
    assert row.interval[1] is None  # unbounded above, JSON null
    assert row.verdict != "contradicted" and row.value is None
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


def test_zero_denominator_verdict_follows_the_interval():
    rep = _mall_report([0.50, 0.52, 0.48], [0.0, 0.0, 0.0], top_k=30)
    row = C.claim_malleability(rep, "cmd")
    assert row.interval[0] > 1 and row.interval[1] is None
    assert C.variant_row("preset protocol", rep, "cmd", None).reading == "attn more malleable"
    assert row.verdict == "supported"  # the rule: the whole interval lies above the null value


def test_malleability_run_warnings_reach_the_row():
    for kw in ({}, {"comparable": False}, {"acc": {("relu", 0, "clean"): 0.1}}):
        row = C.claim_malleability(_mall_report(ATTN_FLIPS, RELU_FLIPS, warnings=[RUN_WARNING], **kw), "cmd")
        assert RUN_WARNING in row.warnings


def test_supported_needs_a_noise_control_to_beat():
    row = C.claim_malleability(_mall_report(ATTN_FLIPS, RELU_FLIPS, floor=None), "cmd")
    assert row.verdict != "supported"


def test_chance_rule_reads_the_class_count_of_a_class_subset_malleability():
    rep = _mall_report(ATTN_FLIPS, RELU_FLIPS, n_train=60, acc={("attn", 2, "clean"): 0.55})
    rep["results"]["dataset"] = {"name": "digits", "classes": [0, 1]}  # as a real --classes 0,1 report
    assert 0.55 < chance_threshold(2, 60)
    assert C.claim_malleability(rep, "cmd").verdict == "not testable here"


# ----------------------------------------------------------------------------- landscape
LAM_RELU = [2.0, 2.4, 1.8, 2.2, 2.6]
LAM_ATTN = [1.0, 1.5, 1.1, 0.9, 1.4]
TR_RELU = [50.0, 60.0, 45.0, 55.0, 58.0]
TR_ATTN = [30.0, 41.0, 33.0, 29.0, 35.0]


def _land_report(lam=(LAM_RELU, LAM_ATTN), trace=(TR_RELU, TR_ATTN), loss=None, acc=None, n_samples=500, warnings=()):
    """results.models.{relu,attn}.seeds.values: [{seed, loss, accuracy, lambda_max, trace}], n_samples."""
    k = len(lam[0])
    loss = loss or {}
    acc = acc or {}
    models = {}
    for i, m in enumerate(("relu", "attn")):
        vals = [
            {
                "seed": s,
                "loss": loss.get((m, s), 0.100),
                "accuracy": acc.get((m, s), 0.95),
                "lambda_max": lam[i][s],
                "trace": trace[i][s],
                "trace_stderr": 0.5,
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
        "results": {"dataset": {"class_counts": {str(i): 50 for i in range(10)}}, "models": models},
    }


def test_landscape_rows_are_paired_t_intervals_over_every_seed():
    lam_row, tr_row = C.claim_landscape(_land_report(), "cmd")
    logs = [math.log(r / a) for r, a in zip(LAM_RELU, LAM_ATTN)]
    assert lam_row.per_seed == pytest.approx(logs) and lam_row.n_seeds == 5
    assert_interval(lam_row, t_interval(logs))
    assert lam_row.null_value == 0.0 and lam_row.verdict == "supported"
    diffs = [r - a for r, a in zip(TR_RELU, TR_ATTN)]
    assert tr_row.per_seed == pytest.approx(diffs) and tr_row.n_seeds == 5
    assert_interval(tr_row, t_interval(diffs))
    assert tr_row.verdict == "supported"


@pytest.mark.parametrize("swap, verdict", [(True, "contradicted"), (False, "supported")])
def test_landscape_contradicted_when_attn_is_sharper(swap, verdict):
    lam = (LAM_ATTN, LAM_RELU) if swap else (LAM_RELU, LAM_ATTN)
    tr = (TR_ATTN, TR_RELU) if swap else (TR_RELU, TR_ATTN)
    assert [r.verdict for r in C.claim_landscape(_land_report(lam, tr), "cmd")] == [verdict] * 2


def test_landscape_straddling_and_two_seeds_are_not_resolved():
    lam = ([1.0, 1.2, 0.9, 1.1], [1.1, 1.0, 1.0, 1.05])
    tr = ([10.0, 12.0, 9.0, 11.0], [11.0, 10.0, 10.0, 10.5])
    logs = [math.log(r / a) for r, a in zip(*lam)]
    lo, hi = t_interval(logs)
    assert lo < 0 < hi
    assert [r.verdict for r in C.claim_landscape(_land_report(lam, tr), "cmd")] == ["not resolved"] * 2
    two = ([2.0, 2.01], [1.0, 1.01]), ([50.0, 50.1], [30.0, 30.1])
    rows = C.claim_landscape(_land_report(*two), "cmd")
    assert [r.verdict for r in rows] == ["not resolved"] * 2 and all(r.n_seeds == 2 for r in rows)


def test_landscape_leaves_out_seeds_with_unmatched_losses_or_at_chance():
    thr = chance_threshold(10, 500)
    loss = {
        ("relu", 1): 0.100,
        ("attn", 1): 0.112,  # 12 % apart: out
        ("relu", 4): 0.100,
        ("attn", 4): 0.109,
    }  # 9 % apart: kept
    acc = {("attn", 3): thr - 0.01}  # attn at chance in seed 3 only
    rep = _land_report(loss=loss, acc=acc, warnings=[RUN_WARNING])
    lam_row, tr_row = C.claim_landscape(rep, "cmd")
    kept = [0, 2, 4]
    logs = [math.log(LAM_RELU[s] / LAM_ATTN[s]) for s in kept]
    diffs = [TR_RELU[s] - TR_ATTN[s] for s in kept]
    assert lam_row.n_seeds == 3 and lam_row.per_seed == pytest.approx(logs)
    assert_interval(lam_row, t_interval(logs))
    assert_interval(tr_row, t_interval(diffs))
    for row in (lam_row, tr_row):
        assert RUN_WARNING in row.warnings
        assert any("seed 1" in w and "10 %" in w for w in row.warnings)
        assert any("seed 3" in w and "chance" in w for w in row.warnings)
        assert not any("seed 4" in w or "seed 0" in w for w in row.warnings)


def test_chance_rule_reads_the_class_count_of_a_class_subset_landscape():
    rep = _land_report(acc={("attn", 2): 0.52})
    rep["results"]["dataset"] = {"name": "digits", "classes": [0, 1]}  # as a real --classes 0,1 report
    assert 0.52 < chance_threshold(2, 500)
    assert C.claim_landscape(rep, "cmd")[0].n_seeds == 4


def test_landscape_with_no_comparable_seed_is_not_testable():
    loss = {("attn", s): 0.3 for s in range(5)}
    rows = C.claim_landscape(_land_report(loss=loss, warnings=[RUN_WARNING]), "cmd")
    assert [r.verdict for r in rows] == ["not testable here"] * 2
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
def _align_report(principal, labels, contrast, warnings=()):
    def row(quantity, target, per):
        return {
            "quantity": quantity,
            "target": target,
            "per_seed": list(per),
            "null_value": 0.0,
            "interval_method": "paired student-t",
            "confidence": 0.95,
        }

    far = [-5.0, -5.1, -4.9]  # rows the claims must not read
    return {
        "schema": "attnaudit.alignment/1",
        "warnings": list(warnings),
        "results": {
            "summary": [
                row("net_error_advantage_attn", "principal", far),
                row("cka_advantage_attn", "principal", far),
                row("kernel_error_advantage_attn", "trailing", far),
                row("kernel_error_advantage_attn", "principal", principal),
                row("kernel_error_advantage_attn", "labels", labels),
            ],
            "contrast": [
                row("kernel_error_advantage_attn_contrast", "principal-trailing", far),
                row("cka_advantage_attn_contrast", "principal-random", far),
                row("kernel_error_advantage_attn_contrast", "principal-random", contrast),
            ],
        },
    }


def test_alignment_verdicts_follow_the_t_interval_of_per_seed():
    up = [0.10, 0.14, 0.12, 0.16]
    down = [-0.10, -0.14, -0.12, -0.16]
    mixed = [0.05, -0.04, 0.02, -0.01]
    for vals, verdict in ((up, "supported"), (down, "contradicted"), (mixed, "not resolved")):
        rows = C.claim_alignment(_align_report(vals, vals, vals, warnings=[RUN_WARNING]), "cmd")
        assert len(rows) == 3
        for row in rows:
            assert row.verdict == verdict and row.per_seed == pytest.approx(vals) and row.null_value == 0.0
            assert_interval(row, t_interval(vals))
            assert RUN_WARNING in row.warnings
    # each row reads its own quantity (the contrast, principal, labels)
    rows = C.claim_alignment(_align_report(up, down, mixed), "cmd")
    assert [r.verdict for r in rows] == ["not resolved", "supported", "contradicted"]
    # two seeds never decide
    rows = C.claim_alignment(_align_report(up[:2], up[:2], up[:2]), "cmd")
    assert [r.verdict for r in rows] == ["not resolved"] * 3


def test_alignment_missing_quantity_is_not_testable():
    rep = _align_report([0.1] * 3, [0.1] * 3, [0.1] * 3)
    rep["results"]["contrast"] = []
    assert C.claim_alignment(rep, "cmd")[0].verdict == "not testable here"


# ----------------------------------------------------------------------------- plan
def _pairs(args):
    return list(zip(args, args[1:]))


@pytest.mark.parametrize("mode", ["quick", "full"])
@pytest.mark.parametrize("n_seeds", [1, 4])
def test_plan_gives_every_stochastic_run_the_seeds(mode, n_seeds):
    runs, variants = C.plan(mode, ["--dataset", "digits"], 7, n_seeds=n_seeds)
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
    runs, _ = C.plan("quick", [], 0, n_seeds=3)
    align = next(r for r in runs if r.id == "alignment")
    assert ("--seeds", "3") in _pairs(align.args)


def test_match_loss_reaches_malleability_and_landscape():
    runs, variants = C.plan("quick", [], 0, n_seeds=3, match_loss=0.05)
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
    runs, variants = C.plan("quick", [], 0, n_seeds=3)
    assert not any("--match-loss" in r.args for r in runs if r.id in ("malleability", "landscape"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "medium"}, "--quick or --full"),
        ({"n_seeds": 0}, "--seeds"),
        ({"n_seeds": -2}, "--seeds"),
        ({"match_loss": 0.0}, "--match-loss"),
        ({"match_loss": -0.1}, "--match-loss"),
        ({"match_loss": float("nan")}, "--match-loss"),
        ({"match_loss": float("inf")}, "--match-loss"),
    ],
)
def test_plan_refuses_bad_settings(kwargs, match):
    args = {"mode": "quick", **kwargs}
    mode = args.pop("mode")
    with pytest.raises(AuditError, match=match):
        C.plan(mode, [], 0, **args)


@pytest.mark.parametrize(
    "extra", [["--seeds", "0"], ["--match-loss", "-1"], ["--match-loss", "0"], ["--slope-margin", "-0.1"]]
)
def test_cli_refuses_bad_settings_before_running(extra, tmp_path, capsys):
    from attnaudit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["claims", "--quick", "-q", "--json", str(tmp_path / "c.json"), *extra])
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
}


def test_quick_scorecard_on_digits_end_to_end(tmp_path, monkeypatch):
    from attnaudit.cli import main

    real_plan = C.plan
    asked = {}

    def small_plan(mode, data_args, seed, n_seeds=C.DEFAULT_SEEDS, match_loss=None):
        asked.update(n_seeds=n_seeds, match_loss=match_loss)
        runs, variants = real_plan(mode, data_args, seed, n_seeds=n_seeds, match_loss=match_loss)
        return [C.RunSpec(r.id, r.command, (*r.args, *SMALL[r.command]), r.purpose) for r in runs], variants

    monkeypatch.setattr(C, "plan", small_plan)
    out, png = tmp_path / "claims.json", tmp_path / "c.png"
    with pytest.raises(SystemExit) as info:
        main(["--threads", "1", "claims", "--quick", "--seeds", "3", "-q", "--json", str(out), "--png", str(png)])
    report = json.loads(out.read_text())
    failed = {r["id"]: r["error"] for r in report["results"]["runs"] if r["error"]}
    assert info.value.code == 0 and not failed, failed
    assert asked == {"n_seeds": 3, "match_loss": None}
    assert report["schema"] == C.SCHEMA
    res = report["results"]
    assert res["protocol"]["n_seeds"] == 3 and res["protocol"]["seeds"] == [0, 1, 2]
    runs = {r["id"]: r for r in res["runs"]}
    expected_runs = {"kappa", "ntk", "malleability", "landscape"} | (
        {"alignment"} if C._has_command("alignment") else set()
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
    # ntk rows: the per-seed slopes are the run's, and the interval is their t-interval
    ntk_rep = runs["ntk"]["report"]["results"]
    relu_row = next(r for r in rows if r["run"] == "ntk")
    if relu_row["n_seeds"] >= 2:
        assert set(relu_row["per_seed"]) <= set(ntk_rep["models"]["relu"]["slope_per_seed"])
        assert relu_row["interval"] == pytest.approx(list(t_interval(relu_row["per_seed"])))
    variants = res["protocol_variants"]
    # the quick preset matches training losses, and the last variant shows the other choice
    assert variants[0]["variant"] == "preset protocol, matched training loss (auto)" and len(variants) >= 3
    assert variants[-1]["variant"] == "fixed steps, no loss matching" and "--match-loss none" in variants[-1]["command"]
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

    def _mode(preset, quick):
        return ClaimsRequest(preset=preset, quick=quick).mode

    assert _mode(None, None) == "quick" and _mode("quick", None) == "quick" and _mode("paper", None) == "full"
    assert _mode(None, False) == "full" and _mode("paper", False) == "full"  # the older --full agrees
    for bad in (("paper", True), ("quick", False), ("fast", None)):
        with pytest.raises(AuditError, match="preset"):
            _mode(*bad)
    with pytest.raises(SystemExit) as exc:
        main(["claims", "--preset", "paper", "--quick", "-q"])
    assert exc.value.code == 2 and "disagree" in capsys.readouterr().err


def test_over_dispersed_seeds_carry_a_warning_computed_from_the_per_seed_rates():
    from attnaudit.claims.scorecard import _dispersion_warnings

    # binomial-like seeds (K = 30, rates 0.30-0.37: sd 0.035 < binomial 0.085): no warning
    assert (
        _dispersion_warnings(
            [{"attn": 0.30, "relu": 0.20}, {"attn": 0.33, "relu": 0.23}, {"attn": 0.37, "relu": 0.17}], 30
        )
        == []
    )
    # zero-inflated relu (0, 0, 0.4): s^2 = 0.0533, m (1 - m) = 0.1156, binomial part 0.1156 / 200
    # -> rho = (0.0533 - 0.000578) / 0.1156 = 0.456
    w = _dispersion_warnings(
        [{"attn": 0.1, "relu": 0.0}, {"attn": 0.12, "relu": 0.0}, {"attn": 0.11, "relu": 0.4}], 200
    )
    assert len(w) == 1 and w[0].startswith("relu's") and "rho ~ 0.46" in w[0]
    assert _dispersion_warnings([], 30) == [] and _dispersion_warnings([{"attn": 0.1, "relu": 0.2}], 30) == []
