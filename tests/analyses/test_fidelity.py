"""Issue 14 (scientific fidelity): each protocol option changes what it should and nothing
else, and no verdict says more than its numbers (untrained models, trends inside their
seed spread, landscape differences inside their tolerance). Fast: digits and synthetic
numbers only."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from attnaudit.data import DataSpec, load_dataset

runner = CliRunner()


@pytest.fixture(scope="module")
def app():
    from attnaudit.cli import app

    return app


# --------------------------------------------------------------------------- item 2: input scale


def test_ntk_scale_makes_mean_sq_norm_d_and_leaves_kappa_unchanged():
    from attnaudit.analyses.kappa.dataset import analyse_kappa

    raw = load_dataset(DataSpec(dataset="digits", n=300, seed=0, preprocess="raw"))
    scaled = load_dataset(DataSpec(dataset="digits", n=300, seed=0, preprocess="ntk-scale"))
    X = raw.X.numpy()
    # independent numpy check: one scalar s = sqrt(d / mean ||x||^2)
    s = math.sqrt(X.shape[1] / np.mean(np.sum(X**2, axis=1)))
    np.testing.assert_allclose(scaled.X.numpy(), s * X, rtol=1e-13, atol=0)
    assert np.mean(np.sum(scaled.X.numpy() ** 2, axis=1)) == pytest.approx(X.shape[1], rel=1e-12)
    assert scaled.info["preprocess"] == "ntk-scale" and scaled.info["preprocess_scale"] == pytest.approx(s, rel=1e-13)
    assert scaled.value_range == pytest.approx((0.0, s))  # the valid range scales with the data
    # the condition number (and the whole relative spectrum) is unchanged
    sv_raw = np.linalg.svd(X, compute_uv=False)
    sv_scaled = np.linalg.svd(scaled.X.numpy(), compute_uv=False)
    np.testing.assert_allclose(sv_scaled / sv_scaled[0], sv_raw / sv_raw[0], rtol=1e-9, atol=1e-15)
    k_raw = analyse_kappa(raw.X, dataclasses.replace(_kcfg(), direct_check=False)).base.kappa_rank
    k_scaled = analyse_kappa(scaled.X, dataclasses.replace(_kcfg(), direct_check=False)).base.kappa_rank
    assert k_scaled == pytest.approx(k_raw, rel=1e-8)


def _kcfg():
    from attnaudit.analyses.kappa.dataset import KappaConfig

    return KappaConfig()


def test_ntk_scale_reaches_every_command_through_the_data_options(app):
    res = runner.invoke(app, ["kappa", "--n", "200", "--preprocess", "ntk-scale", "--no-direct-check", "--json", "-"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)["results"]["dataset"]
    assert (
        info["preprocess"] == "ntk-scale"
        and info["preprocess_scale"] > 1
        and info["mean_sq_norm_after"] == pytest.approx(64)
    )


# --------------------------------------------------------------------------- item 9: kappa sweep


def test_kappa_sweep_reports_log10_width_per_n_with_median_and_spread(app):
    res = runner.invoke(app, ["kappa", "--n", "100,200", "--seeds", "3", "--no-direct-check", "--json", "-"])
    assert res.exit_code == 0, res.output
    sweep = json.loads(res.stdout)["results"]["sweep"]
    assert [s["n"] for s in sweep["summary"]] == [100, 200]
    for summ in sweep["summary"]:
        cells = [c for c in sweep["cells"] if c["n"] == summ["n"]]
        assert len(cells) == 3
        # independent recomputation of the paper's m = kappa^6 n ln n on the numerical-rank kappa
        n = summ["n"]
        for key in ("numerical_rank",):
            vals = [
                6 * math.log10(c["kappa_at_numerical_rank"]) + math.log10(n) + math.log10(math.log(n)) for c in cells
            ]
            w = summ["log10_width"][key]
            assert w["median"] == pytest.approx(float(np.median(vals)), rel=1e-12)
            assert w["min"] == pytest.approx(min(vals)) and w["max"] == pytest.approx(max(vals))
            assert w["finite_seeds"] == 3 and w["std"] == pytest.approx(float(np.std(vals, ddof=1)), rel=1e-10)
    verdicts = json.loads(res.stdout)["verdicts"]
    assert any("n=100" in v and "median" in v for v in verdicts) and any("n=200" in v for v in verdicts)


# --------------------------------------------------------------------------- item 7: NTK trend


def test_ntk_trend_no_clear_trend_when_slope_interval_includes_zero():
    from attnaudit.analyses.ntk_distance.aggregate import slope_interval, trend_word
    from attnaudit.analyses.ntk_distance.verdicts import distance_verdict

    rng = np.random.default_rng(0)
    flat = list(rng.normal(0.0, 0.05, size=4))  # slope 0 +- noise
    assert trend_word(flat) == "no-clear-trend"
    # same sign but an interval that still includes 0
    assert trend_word([-0.02, -0.3, -0.01]) == "no-clear-trend"
    mean, lo, hi, k = slope_interval([-0.02, -0.3, -0.01])
    assert k == 3 and lo < 0 < hi
    text = distance_verdict("MLP-Attn", "no-clear-trend", mean, 0.16, 3, 0.5, 16, 256, 1.0, 0.9, interval=(lo, hi))
    assert "no clear trend" in text and "approaching the kernel regime" not in text.replace(
        "no evidence of approaching", ""
    )
    # a clear fall: interval excludes 0
    assert trend_word([-0.5, -0.45, -0.55]) == "falls"
    clear = distance_verdict("MLP-Attn", "falls", -0.5, 0.05, 3, 0.1, 16, 256, 1.0, 0.25, interval=(-0.56, -0.44))
    assert "approaching the kernel regime" in clear
    # ... but not when some widths are at chance: the trend is stated, the regime claim withheld
    partial = distance_verdict(
        "MLP-Attn",
        "falls",
        -0.5,
        0.05,
        3,
        0.1,
        16,
        256,
        1.0,
        0.25,
        interval=(-0.56, -0.44),
        untrained_widths=[16],
        train_acc={16: 0.11, 64: 0.6, 256: 0.7},
        chance=0.1,
    )
    assert "no claim about the kernel regime" in partial and "approaching the kernel regime" not in partial


def test_ntk_non_monotone_only_beyond_the_seed_spread():
    from attnaudit.analyses.ntk_distance.aggregate import increases_beyond_spread, trend_word

    slopes = [-0.5, -0.45, -0.55]
    widths, sds = (16, 64, 256), (0.1, 0.1, 0.1)
    assert trend_word(slopes, widths=widths, means=(1.0, 1.05, 0.5), sds=sds) == "falls"  # rise 0.05 < spread 0.1
    assert trend_word(slopes, widths=widths, means=(1.0, 1.3, 0.5), sds=sds) == "falls-non-monotone"
    assert increases_beyond_spread(widths, (1.0, 1.3, 0.5), sds) == [[16, 64, pytest.approx(0.3), 0.1]]
    # the larger of the two widths' spreads decides
    assert trend_word(slopes, widths=widths, means=(1.0, 1.3, 0.5), sds=(0.1, 0.4, 0.1)) == "falls"


def test_transformer_sweep_verdict_reads_no_clear_trend_on_noise():
    from attnaudit.analyses.ntk_distance.transformers import TransformerCell
    from attnaudit.analyses.ntk_distance.verdicts import arch_summary

    rng = np.random.default_rng(1)
    cells = []
    for seed in range(3):
        for w in (16, 32, 64):
            m, k, r = (float(np.exp(rng.normal(0, 0.3))) for _ in range(3))
            cells.append(
                TransformerCell(
                    "vit", w, 4, seed, 1, 1, False, 0.0, 0.0, 0.0, m, m, m, k, None, None, {}, {}, 10 * r, r, 0.0
                )
            )
    summary = arch_summary("vit", cells, (16, 32, 64), (0, 1, 2), True)
    if any(t.trend == "no-clear-trend" for t in (summary.movement, summary.kernel_distance, summary.distance)):
        assert "no clear trend" in summary.verdict
    assert not summary.approaches_kernel_regime and "approaching the kernel regime as it widens" not in summary.verdict


# --------------------------------------------------------------------------- item 6: untrained models


def _landscape_cfg():
    from attnaudit.analyses.landscape import LandscapeConfig

    return LandscapeConfig(
        points=0, grid=0, top_k=1, hutchinson_samples=4, basin_directions=1, basin_points=6, lanczos_steps=20
    )


def test_untrained_rule_fires_at_zero_steps_and_not_after_training():
    from attnaudit.analyses.landscape import run_landscape
    from attnaudit.core.training import TrainConfig

    ds = load_dataset(DataSpec(dataset="digits", n=150, seed=0, stratify=True))
    idle = run_landscape(ds, _landscape_cfg(), width=16, train_config=TrainConfig(lr=4.0, steps=0))
    out = idle.to_dict()["models"]
    assert out["relu"]["untrained"] is True and out["attn"]["untrained"] is True
    assert out["relu"]["untrained_threshold"] == pytest.approx(0.1 + max(0.05, 2 * math.sqrt(0.09 / 150)))
    assert any("no claim" in v for v in idle.verdicts)
    assert not any("consistent with the paper" in v or "contradicts" in v for v in idle.verdicts)
    trained = run_landscape(
        ds, _landscape_cfg(), models=("relu",), width=16, train_config=TrainConfig(lr=4.0, steps=100)
    )
    rec = trained.to_dict()["models"]["relu"]
    assert rec["untrained"] is False and rec["accuracy"] > 0.5


def test_ntk_distance_untrained_at_every_width_makes_no_trend_claim():
    from attnaudit.data import holdout_split
    from attnaudit.analyses.ntk_distance.config import NTKDistanceConfig
    from attnaudit.analyses.ntk_distance.widths import run_ntk_distance

    full = load_dataset(DataSpec(dataset="digits"))
    tr, te = holdout_split(full, 100, 60, seed=0)
    # standard init: f_0 is random (the antisymmetric default starts at f_0 = 0, and one tiny GD step from 0
    # already points along Theta Y, a kernel-mean classifier well above chance)
    cfg = NTKDistanceConfig(
        models=("relu",), widths=(16, 64), seeds=(0, 1), steps=1, lr=1e-9, kernel_points=20, init="standard"
    )
    res = run_ntk_distance(tr.X, tr.y, te.X, te.y, 10, cfg)
    summ = res.to_dict()["models"]["relu"]
    assert summ["untrained"] is True and summ["trend"] == "untrained"
    assert set(summ["train_acc_by_width"]) == {"16", "64"} and all(summ["untrained_by_width"].values())
    assert "no claim" in summ["verdict"] and "approaching" not in summ["verdict"]


# --------------------------------------------------------------------------- item 8: landscape comparison


def _result_pair():
    from attnaudit.analyses.landscape import analyse_landscape
    from attnaudit.models.builtin import ModelSpec, build_model
    from attnaudit.core.training import TrainConfig, train

    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=g)
    model = build_model(ModelSpec("relu", 5, 6, 3, seed=1), X)
    train(model, X, y, TrainConfig(lr=0.5, steps=20))
    return analyse_landscape(model, X, y, _landscape_cfg())


def _with(base, lam, trace=None, loss=None):
    r = dataclasses.replace(base, eigen=dataclasses.replace(base.eigen, eigenvalues=(lam,)))
    if trace is not None:
        r = dataclasses.replace(r, trace=dataclasses.replace(base.trace, estimate=trace))
    if loss is not None:
        r = dataclasses.replace(r, loss=loss)
    return r


def test_landscape_comparison_not_resolved_inside_the_seed_tolerance_and_gated_at_10_percent():
    from attnaudit.analyses.landscape import compare_landscapes

    base = _result_pair()
    relu = [_with(base, 2.0), _with(base, 1.0), _with(base, 3.0)]
    attn = [_with(base, 1.5), _with(base, 2.5), _with(base, 1.0)]
    verdicts, _ = compare_landscapes({"relu": relu[0], "attn": attn[0]}, {}, seed_results={"relu": relu, "attn": attn})
    lam = next(v for v in verdicts if v.startswith("lambda_max"))
    assert "not resolved" in lam and "3 seeds" in lam and "consistent with" not in lam
    # a difference far beyond the spread is resolved
    relu_hi = [_with(base, 10.0), _with(base, 10.5), _with(base, 9.5)]
    verdicts, _ = compare_landscapes(
        {"relu": relu_hi[0], "attn": attn[0]}, {}, seed_results={"relu": relu_hi, "attn": attn}
    )
    assert "consistent with the paper" in next(v for v in verdicts if v.startswith("lambda_max"))
    # losses 15 % apart: not compared; 5 % apart: compared
    far = _with(base, 1.0, loss=base.loss * 1.15)
    verdicts, warnings = compare_landscapes({"relu": _with(base, 2.0), "attn": far}, {})
    assert len(verdicts) == 1 and "not compared" in verdicts[0] and any("10 %" in w for w in warnings)
    near = _with(base, 1.0, loss=base.loss * 1.05)
    verdicts, _ = compare_landscapes({"relu": _with(base, 2.0), "attn": near}, {})
    assert "not compared" not in verdicts[0]
    # a model at chance: no hypothesis reading, whatever the numbers
    idle = dataclasses.replace(_with(base, 0.01), accuracy=0.34)
    verdicts, warnings = compare_landscapes({"relu": _with(base, 2.0), "attn": idle}, {}, n_classes=3)
    assert len(verdicts) == 1 and "no claim" in verdicts[0] and any("untrained" in w for w in warnings)


# --------------------------------------------------------------------------- item 5: landscape --seeds, --optimizer

ANALYSIS = [
    "--n-train",
    "120",
    "--width",
    "16",
    "--steps",
    "40",
    "--points",
    "0",
    "--grid",
    "0",
    "--eigenvalues",
    "1",
    "--hutchinson-samples",
    "4",
    "--basin-directions",
    "1",
    "--quiet",
]


def test_landscape_seeds_give_per_seed_values_with_mean_and_sd(app):
    res = runner.invoke(app, ["landscape", *ANALYSIS, "--models", "relu", "--seeds", "2", "--json", "-"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    rec = payload["results"]["models"]["relu"]
    seeds = rec["seeds"]
    assert seeds["n_seeds"] == 2 and [v["seed"] for v in seeds["values"]] == [0, 1]
    lams = [v["lambda_max"] for v in seeds["values"]]
    assert lams[0] != lams[1]  # independent initialisations
    assert rec["top_eigenvalues"]["eigenvalues"][0] == lams[0]  # the existing fields are the first seed's
    assert seeds["mean"]["lambda_max"] == pytest.approx(np.mean(lams))
    assert seeds["sd"]["lambda_max"] == pytest.approx(np.std(lams, ddof=1))
    assert payload["seeds"]["model_seeds"] == [0, 1] and "untrained" in rec


def test_landscape_optimizer_adam_with_batches_is_recorded(app):
    res = runner.invoke(
        app, ["landscape", *ANALYSIS, "--models", "relu", "--optimizer", "adam", "--batch-size", "32", "--json", "-"]
    )
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    tr = payload["results"]["models"]["relu"]["training"]
    assert tr["optimizer"] == "adam" and tr["batch_size"] == 32 and tr["steps_run"] == 40 and tr["lr"] == 1e-3
    assert payload["results"]["optimizer"]["optimizer"] == "adam" and payload["results"]["gd_stability_bound"] is None
    bad = runner.invoke(app, ["landscape", "--quiet", "--steps", "1", "--batch-size", "8"])
    assert bad.exit_code == 2 and "--batch-size" in bad.output


def test_ntk_slope_interval_is_student_t_and_two_seeds_claim_no_trend():
    from scipy import stats as st

    from attnaudit.analyses.ntk_distance.aggregate import slope_interval, trend_word

    slopes = [-0.42, -0.47, -0.51]
    mean, lo, hi, k = slope_interval(slopes)
    half = st.t.ppf(0.975, 2) * np.std(slopes, ddof=1) / np.sqrt(3)  # independent: scipy's t quantile
    assert k == 3 and (lo, hi) == pytest.approx((np.mean(slopes) - half, np.mean(slopes) + half), rel=1e-12)
    assert trend_word(slopes) == "falls"
    # two seeds: however clear, no trend word beyond "no clear trend" (a verdict needs 3 seeds)
    assert trend_word([-0.5, -0.5001]) == "no-clear-trend"
