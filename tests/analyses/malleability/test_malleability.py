"""Malleability protocol: metrics on hand-made vectors, the pipeline's own checks (a 'none'
attack must give flip rate 0 exactly), aggregation, and the `malleability` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from typer.testing import CliRunner

from attnaudit.analyses.malleability.attacks import AttackConfig, perturb
from attnaudit.errors import AuditError
from attnaudit.analyses.malleability.config import MalleabilityConfig
from attnaudit.analyses.malleability.malleability import run_malleability
from attnaudit.analyses.malleability.planning import progress_total
from attnaudit.analyses.malleability.report import build_tables, plot_malleability
from attnaudit.analyses.malleability.stability import flip_rate, ratio_summary, stability, summarize, top_k_indices
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.report.envelope import dumps
from attnaudit.core.training import TrainConfig, train

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared" / "data"
HAS_MNIST = (SHARED / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists()
runner = CliRunner()


# ---------------------------------------------------------------- metrics by hand
def test_flip_rate_on_hand_made_vectors():
    clean = np.array([5.0, -4.0, 3.0, -2.0, 1.0, 0.5, 0.0])
    pert = np.array([-1.0, -4.0, 3.0, 2.0, -1.0, 0.5, 7.0])
    # top-4 by |clean|: samples 0 (5 -> -1, flip), 1 (same sign), 2 (same), 3 (-2 -> 2, flip)
    assert top_k_indices(clean, 4).tolist() == [0, 1, 2, 3]
    assert flip_rate(clean, pert, 4) == pytest.approx(0.5)
    assert flip_rate(clean, pert, 5) == pytest.approx(3 / 5)  # sample 4 (1 -> -1) flips too
    assert flip_rate(clean, pert, 7) == pytest.approx(3 / 7)  # an exact zero is not a flip
    assert flip_rate(clean, -clean, 6) == 1.0 and flip_rate(clean, 2 * clean, 6) == 0.0
    # ties in |clean| are broken by index: deterministic choice
    assert top_k_indices([1.0, -1.0, 1.0], 2).tolist() == [0, 1]


def test_stability_measures_by_hand():
    clean = np.array([4.0, -3.0, 2.0, -1.0, 0.5])
    pert = np.array([-0.2, -3.5, 2.5, 0.1, 4.0])
    s = stability(clean, pert, 2)
    assert s["flip_rate"] == 0.5 and s["n_flipped"] == 1 and s["top_k"] == 2
    # top-2 by |.|: clean {0, 1}, perturbed {4, 1} -> overlap 1/2
    assert s["top_k_overlap"] == pytest.approx(0.5)
    # Spearman without ties: 1 - 6 sum d^2 / (n (n^2 - 1)); ranks clean [5,1,4,2,3], pert [2,1,4,3,5]
    d = np.array([5, 1, 4, 2, 3]) - np.array([2, 1, 4, 3, 5])
    assert s["spearman"] == pytest.approx(1 - 6 * (d**2).sum() / (5 * 24))
    assert s["clean_helpful_in_top_k"] == 1  # sample 1 (negative = helpful)
    assert stability(np.ones(4), np.arange(4.0), 2)["spearman"] is None  # constant: no ranking


def test_summaries_are_student_t_intervals_over_seeds():
    vals = [0.1, 0.3, 0.2]
    s = summarize(vals, 0.90)
    assert s["mean"] == pytest.approx(0.2) and s["std"] == pytest.approx(0.1)
    # t(0.95, 2) = 2.919986: mean -+ t sd / sqrt(3), from scipy's own t-interval
    lo, hi = stats.t.interval(0.90, 2, loc=0.2, scale=0.1 / np.sqrt(3))
    assert s["ci_low"] == pytest.approx(lo, rel=1e-12) and s["ci_high"] == pytest.approx(hi, rel=1e-12)
    assert s["interval_method"] == "student-t"
    one = summarize([0.4], 0.95)
    assert one["std"] is None and one["ci_low"] is None and one["ci_high"] is None  # one seed: no interval
    # shares of K items: the per-seed variance is floored at Jeffreys' p (1 - p) / K, and the ends clipped to [0, 1]
    zeros = summarize([0.0, 0.0, 0.0], 0.95, trials=30)
    p = 0.5 / 91
    assert zeros["ci_low"] == 0.0
    assert zeros["ci_high"] == pytest.approx(stats.t.ppf(0.975, 2) * np.sqrt(p * (1 - p) / 30 / 3), rel=1e-12)


def _fieller_by_test_inversion(num, den, confidence, grid):
    """The Fieller set written as its definition: theta is inside when the paired t-test of
    mean(num - theta den) = 0 does not reject at 1 - confidence (scipy's t-test)."""
    num, den = np.asarray(num), np.asarray(den)
    inside = [t for t in grid if stats.ttest_1samp(num - t * den, 0.0).pvalue > 1 - confidence]
    return min(inside), max(inside)


def test_ratio_interval_is_fiellers_set_of_ratios_the_t_test_does_not_reject():
    rng = np.random.default_rng(5)
    den = rng.uniform(0.1, 0.5, 5)
    num = 2 * den + rng.normal(0, 0.05, 5)
    r = ratio_summary(num, den, 0.95)
    assert r["ratio"] == pytest.approx(num.sum() / den.sum(), rel=1e-12) and r["n"] == 5
    grid = np.linspace(0.0, 6.0, 6001)
    lo, hi = _fieller_by_test_inversion(num, den, 0.95, grid)
    assert r["ci_low"] == pytest.approx(lo, abs=2e-3) and r["ci_high"] == pytest.approx(hi, abs=2e-3)
    assert r["interval_method"] == "fieller" and not r["unbounded_high"]
    # a denominator indistinguishable from 0: the t-test rejects no large ratio, so the set is unbounded above
    # (reported as None, not as a finite number), and every seed is kept
    z = ratio_summary([0.2, 0.3, 0.4], [0.0, 0.05, 0.0], 0.95)
    assert z["ci_high"] is None and z["unbounded_high"] and z["n"] == 3
    assert _fieller_by_test_inversion([0.2, 0.3, 0.4], [0.0, 0.05, 0.0], 0.95, np.linspace(0, 1e4, 101))[1] == 1e4
    # all-zero denominators: the ratio is undefined, the interval still says what the data allow
    zero = ratio_summary([0.2, 0.4, 0.3], [0.0, 0.0, 0.0], 0.95, trials=(30, 30))
    assert zero["ratio"] is None and zero["ci_high"] is None and zero["ci_low"] > 1


# ---------------------------------------------------------------- protocol on small data


SMALL = dict(width=8, steps=25, lr=2.0, top_k=10, pgd_steps=3)


def test_attn_training_shortcut_equals_training_the_mlp_on_transformed_inputs(digits):
    """train() feeds MLP-Attn precomputed f_att(X); the trajectory must be that of the MLP on f_att(X)."""
    X, y, *_ = digits
    cfg = TrainConfig(lr=2.0, steps=20, checkpoint_every=7)
    a = build_model(ModelSpec("attn", 64, 8, 10, seed=3), X)
    b = build_model(ModelSpec("relu", 64, 8, 10, seed=3))
    Z = X @ a.context  # written out independently of models.features_in
    ra, rb = train(a, X, y, cfg), train(b, Z, y, cfg)
    torch.testing.assert_close(b.W, a.W, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(b.a, a.a, rtol=1e-12, atol=1e-14)
    assert ra.loss_curve == pytest.approx(rb.loss_curve, rel=1e-12)
    assert len(ra.checkpoints) == len(rb.checkpoints) and set(rb.checkpoints[0]) == {"W", "a"}


@pytest.mark.parametrize("protocol", ["retrain", "static"])
def test_no_perturbation_gives_zero_flips_and_full_structure(digits, protocol):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(
        attacks=("none", "pgd", "random"), seeds=(0, 1), damping=(1e-3, 1e-1), protocol=protocol, **SMALL
    )
    ticks = []
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0), progress=lambda k=1: ticks.append(k))
    assert sum(ticks) == progress_total(cfg) == 2 * 2 * (1 + 1 + 1 + 2)
    # deterministic GD on unchanged data reproduces the model: identical influence
    for r in res.runs:
        if r["attack"] == "none":
            assert r["flip_rate"] == 0.0 and r["spearman"] == pytest.approx(1.0) and r["top_k_overlap"] == 1.0
    assert len(res.runs) == 2 * 2 * 3 * 2  # seeds x models x attacks x dampings
    assert len(res.controls) == 2 * 2 * 2
    keys = {(s["model"], s["attack"], s["damping"]) for s in res.summary}
    assert ("attn", "reinit", 0.1) in keys and ("relu", "pgd", 1e-3) in keys
    pgd = next(s for s in res.summary if s["model"] == "relu" and s["attack"] == "pgd" and s["damping"] == 1e-3)
    assert set(pgd["floors"]) == {"reinit", "random"}
    assert all(s["degenerate"] is False for s in res.summary if s["attack"] == "reinit")  # another init: a real control
    assert pgd["clean_model_accuracy_on_perturbed_train"]["mean"] is not None
    assert {r["numerator"] for r in res.ratios} == {"attn"}
    assert len(res.sensitivity["by_attack"]) == 2  # pgd and random (none has no radius)
    text = dumps(res.to_dict())  # strict JSON
    assert json.loads(text)["sign_convention"].startswith("influence = d(test loss)")
    if protocol == "static":  # the model is never retrained
        assert {t["role"] for t in res.training} == {"clean", "reinit"}


def test_attn_context_option_changes_the_retrained_model(digits):
    X, y, Xt, yt = digits
    out = {}
    for ctx in ("perturbed", "clean"):
        cfg = MalleabilityConfig(
            models=("attn",), attacks=("pgd",), seeds=(0,), controls=False, attn_context=ctx, **SMALL
        )
        out[ctx] = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    # the protocol written out by hand: train on clean data, attack it (PGD, eps 0.3, 3 steps, seed 0,
    # clipped to [0, 1]), retrain from the same seed on the attacked data with the attention context
    # taken from the attacked (default) or the clean inputs
    spec = ModelSpec("attn", 64, 8, 10, seed=0)
    recipe = TrainConfig(lr=2.0, steps=25)
    clean = build_model(spec, X)
    clean_loss = train(clean, X, y, recipe).final_loss
    X_adv = perturb(clean, X, y, AttackConfig(method="pgd", eps=0.3, steps=3, clip_min=0.0, clip_max=1.0, seed=0)).X_adv
    expected = {}
    for ctx, context in (("perturbed", X_adv), ("clean", X)):
        expected[ctx] = train(build_model(spec, context), X_adv, y, recipe).final_loss
        rows = {t["role"]: t["final_loss"] for t in out[ctx].training}
        assert rows == {
            "clean": pytest.approx(clean_loss, rel=1e-10),
            "pgd@0.3": pytest.approx(expected[ctx], rel=1e-10),
        }
    # a different attention context is a different model, by more than the tolerance above
    assert abs(expected["perturbed"] - expected["clean"]) > 1e-6 * expected["clean"]


def test_match_loss_stops_training_and_reports(digits):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(
        models=("relu", "attn"),
        attacks=("random",),
        seeds=(0,),
        controls=False,
        match_loss=0.45,
        **{**SMALL, "steps": 40},
    )
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    for t in res.training:
        if t["reached_match_loss"]:
            assert t["final_loss"] <= 0.45 and t["steps_run"] < 40
        else:
            assert t["steps_run"] == 40
    unreachable = MalleabilityConfig(
        models=("relu",), attacks=("random",), seeds=(0,), controls=False, match_loss=1e-6, **SMALL
    )
    res2 = run_malleability(X, y, Xt, yt, 10, unreachable, value_range=(0.0, 1.0))
    assert any("did not reach --match-loss" in w for w in res2.warnings)


def test_match_loss_auto_trains_every_model_to_the_slowest_budget_loss(digits):
    """``match_loss="auto"``: L* must equal the largest clean loss of an independent
    fixed-step run (same seeds and budget), and every clean model then stops at or below it."""
    X, y, Xt, yt = digits
    kw = dict(models=("relu", "attn"), attacks=("random",), seeds=(0, 1), controls=False, **{**SMALL, "steps": 40})
    fixed = run_malleability(X, y, Xt, yt, 10, MalleabilityConfig(**kw), value_range=(0.0, 1.0))
    budget = {(t["model"], t["seed"]): t["final_loss"] for t in fixed.training if t["role"] == "clean"}
    assert all(t["steps_run"] == 40 for t in fixed.training)
    res = run_malleability(X, y, Xt, yt, 10, MalleabilityConfig(**kw, match_loss="auto"), value_range=(0.0, 1.0))
    target = max(budget.values())
    assert res.config.match_loss == "auto"  # the settings as given; the run's resolution beside them
    resolution = res.match_loss_resolution
    assert resolution["target"] == pytest.approx(target, rel=1e-12) and len(resolution["budget_runs"]) == 4
    slowest = max(budget, key=budget.get)
    assert resolution["set_by"] == f"{slowest[0]} seed {slowest[1]}"
    clean = [t for t in res.training if t["role"] == "clean"]
    assert all(t["reached_match_loss"] and t["final_loss"] <= target for t in clean)
    assert any(t["steps_run"] < 40 for t in clean)  # the faster model stopped early
    config = res.to_dict()["config"]
    assert config["match_loss_resolution"]["target"] == pytest.approx(target)
    assert config["match_loss"] == config["match_loss_per_model"]["relu"] == pytest.approx(target)


def test_tables_and_figure(digits, tmp_path):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(attacks=("pgd", "random"), seeds=(0,), eps=(0.1, 0.3), **SMALL)
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    assert len(build_tables(res)) == 4
    path = tmp_path / "m.png"
    plot_malleability(res, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(models=("relu", "gpt")),
        dict(attacks=("pgd", "cw")),
        dict(eps=(0.0,)),
        dict(damping=(-1.0,)),
        dict(top_k=0),
        dict(protocol="replay"),
        dict(attn_context="both"),
        dict(max_flip_rate=1.5),
        dict(match_loss=-1.0),
        dict(estimator="tracin", damping=(0.1, 0.01)),
        dict(seeds=(0, 0)),
        dict(lr=-1.0),
        dict(norm="l1"),
    ],
)
def test_bad_config_rejected(kwargs):
    with pytest.raises(AuditError):
        MalleabilityConfig(**kwargs)


def test_top_k_above_n_train_rejected(digits):
    X, y, Xt, yt = digits
    with pytest.raises(AuditError, match="top_k 61 exceeds"):
        run_malleability(X, y, Xt, yt, 10, MalleabilityConfig(top_k=61, seeds=(0,)), value_range=(0.0, 1.0))


# ---------------------------------------------------------------- the command
@pytest.fixture
def app():
    """The real CLI app (attnaudit/cli.py registers every command); never modified here."""
    from attnaudit.cli import app

    return app


TINY = [
    "--n-train",
    "50",
    "--n-test",
    "20",
    "--width",
    "8",
    "--steps",
    "20",
    "--top-k",
    "10",
    "--pgd-steps",
    "3",
    "--seeds",
    "2",
]


def test_cli_json_and_exit_codes(app, tmp_path):
    ok = runner.invoke(app, ["malleability", *TINY, "--attacks", "pgd,random", "--json", "-", "--quiet"])
    assert ok.exit_code == 0, ok.output
    payload = json.loads(ok.stdout)
    assert payload["schema"] == "attnaudit.malleability/1"
    res = payload["results"]
    assert res["config"]["seeds"] == [0, 1] and res["n_train"] == 50 and res["n_test"] == 20
    assert payload["inputs"]["damping"] == [0.001] and payload["inputs"]["preset"] == "quick"
    assert any(s["attack"] == "reinit" for s in res["summary"])
    top = max(s["flip_rate"]["mean"] for s in res["summary"] if s["attack"] in ("pgd", "random"))
    # gate below the worst measured flip rate: exit 1 naming the model and attack
    fail = runner.invoke(
        app, ["malleability", *TINY, "--attacks", "pgd,random", "--max-flip-rate", str(max(top - 1e-9, 0.0)), "--quiet"]
    )
    assert top > 0  # seeded, so this holds for this configuration; the gate below is then live
    assert fail.exit_code == 1, fail.output
    assert "under pgd" in fail.output or "under random" in fail.output
    passing = runner.invoke(
        app, ["malleability", *TINY, "--attacks", "pgd,random", "--max-flip-rate", "1.0", "--quiet"]
    )
    assert passing.exit_code == 0, passing.output


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--attacks", "pgd,cw"], ["--attacks", "cw"]),
        (["--eps", "0"], ["--eps"]),
        (["--eps", "a,b"], ["--eps", "'a'"]),
        (["--models", "relu,bert"], ["--models", "bert"]),
        (["--max-flip-rate", "2"], ["--max-flip-rate"]),
        (["--estimator", "newton"], ["--estimator", "newton"]),
        (["--protocol", "replay"], ["--protocol", "replay"]),
        (["--preset", "huge"], ["--preset", "huge"]),
        (["--n-train", "5000"], ["--n-train", "5000"]),
        (["--top-k", "500"], ["--top-k", "500"]),
        (["--damping", "-1"], ["--damping"]),
        (["--norm", "l3"], ["--norm", "l3"]),
        (["--seeds", "0"], ["--seeds"]),
    ],
)
def test_cli_bad_options_exit_2(app, args, needles):
    result = runner.invoke(app, ["malleability", *TINY, "--quiet", *args])
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text  # one message line
    for needle in needles:  # it names the offending flag (and value)
        assert needle in text, text


def test_cli_files_and_refusal_to_overwrite(app, tmp_path):
    args = [
        "malleability",
        *TINY,
        "--attacks",
        "fgsm",
        "--out-dir",
        str(tmp_path),
        "--quiet",
        "--estimator",
        "cg",
        "--norm",
        "l2",
        "--eps",
        "1.0",
    ]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert (tmp_path / "report.json").exists() and (tmp_path / "malleability.png").exists()
    payload = json.loads((tmp_path / "report.json").read_text())
    diag = payload["results"]["influence_diagnostics"][0]
    assert diag["estimator"] == "cg" and "converged" in diag and "iterations" in diag
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already exists" in again.output


def test_cli_subprocess_table():
    proc = subprocess.run(
        [sys.executable, "-m", "attnaudit", "malleability", *TINY, "--attacks", "pgd", "--no-controls", "--seeds", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "influence malleability" in proc.stdout and "flip rate" in proc.stdout


@pytest.mark.skipif(not HAS_MNIST, reason="../shared/data/MNIST not present")
def test_cli_real_mnist_small(app):
    result = runner.invoke(
        app,
        [
            "malleability",
            "--dataset",
            "mnist",
            "--split",
            "test",
            "--data-dir",
            str(SHARED),
            "--n-train",
            "80",
            "--n-test",
            "40",
            "--width",
            "8",
            "--steps",
            "15",
            "--top-k",
            "10",
            "--pgd-steps",
            "3",
            "--seeds",
            "1",
            "--attacks",
            "pgd,random",
            "--no-controls",
            "--json",
            "-",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)["results"]
    assert res["value_range"] == [0.0, 1.0]
    for a in res["attacks"]:
        assert a["perturbation_norm_max"] <= 0.3 + 1e-12  # the paper's L-inf radius, clipped to [0, 1]
    pgd = [a for a in res["attacks"] if a["method"] == "pgd"]
    rnd = [a for a in res["attacks"] if a["method"] == "random"]
    for p, r in zip(pgd, rnd):
        assert p["model_loss_after"] > r["model_loss_after"]


@pytest.mark.parametrize("estimator", ["exact", "tracin", "cg"])
def test_other_estimators_run_and_no_perturbation_is_stable(digits, estimator):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(
        models=("relu", "attn"),
        attacks=("none",),
        seeds=(0,),
        controls=False,
        estimator=estimator,
        damping=(0.05,),
        **{**SMALL, "width": 4},
    )
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    assert all(r["flip_rate"] == 0.0 and r["spearman"] == pytest.approx(1.0) for r in res.runs)
    assert {d["estimator"] for d in res.influence_diagnostics} == {estimator}
    if estimator == "tracin":
        every = max(1, SMALL["steps"] // cfg.tracin_checkpoints)  # 25 steps, a snapshot every 2: steps 0, 2, ..., 24
        assert all(d["checkpoints_used"] == -(-SMALL["steps"] // every) == 13 for d in res.influence_diagnostics)


def test_exact_over_budget_fails_before_training(digits):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(estimator="exact", width=200, seeds=(0,), max_exact_params=1000)
    with pytest.raises(AuditError, match="last-layer or cg"):
        run_malleability(
            X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0), progress=lambda k=1: pytest.fail("trained first")
        )


@pytest.mark.parametrize(
    "estimator,per_model", [("last-layer", 8 * 10), ("exact", 8 * (64 + 10)), ("cg", 8 * (64 + 10))]
)
def test_memory_estimate_counts_the_parameters_of_the_models_built(estimator, per_model):
    from attnaudit.analyses.malleability.planning import plan_memory

    cfg = MalleabilityConfig(
        estimator=estimator, seeds=(0,), damping=(0.05,), **SMALL
    )  # width 8, digits: d 64, 10 classes
    X = torch.rand(60, 64, dtype=torch.float64)
    est = plan_memory(cfg, X, 30, 10)
    assert est["tracked_parameters"] == per_model
    names = ["a"] if estimator == "last-layer" else ["W", "a"]
    assert est["tracked_parameter_names"] == {"relu": names, "attn": names}
    # a saved model counts as it is (its own width), not as the configured width
    saved = build_model(ModelSpec("relu", 64, 5, 10))
    cfg1 = MalleabilityConfig(models=("relu",), estimator=estimator, seeds=(0,), damping=(0.05,), **SMALL)
    assert plan_memory(cfg1, X, 30, 10, {"relu": saved})["tracked_parameters"] == per_model // 8 * 5


def test_saved_float32_model_is_audited_without_being_modified(digits):
    X, y, Xt, yt = digits
    model = build_model(ModelSpec("relu", 64, 8, 10, seed=2), dtype=torch.float32)
    train(model, X.float(), y, TrainConfig(lr=2.0, steps=20))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = MalleabilityConfig(attacks=("pgd",), seeds=(0,), protocol="static", controls=False, **SMALL)
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0), fixed_models={"relu": model})
    assert res.runs and all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert {d["path"] for d in res.influence_diagnostics} == {"fast: TwoLayerNet head, cached features"}


def test_cli_audits_a_saved_checkpoint_statically(app, tmp_path):
    """--model: a user's trained model is audited as it is (static protocol, no retraining)."""
    import json as _json

    from attnaudit.data import DataSpec, load_dataset
    from attnaudit.models.builtin import ModelSpec, build_model, save_model

    ds = load_dataset(DataSpec(dataset="digits"))
    model = build_model(ModelSpec("relu", 64, 16, 10, seed=1))
    train(model, ds.X[:200], ds.y[:200], TrainConfig(lr=4.0, steps=100))
    path = tmp_path / "relu.safetensors"
    save_model(model, path)
    weights_before = model.W.detach().clone()
    args = [
        "malleability",
        "--checkpoint",
        str(path),
        "--attacks",
        "pgd",
        "--seeds",
        "2",
        "--n-train",
        "60",
        "--n-test",
        "20",
        "--top-k",
        "10",
        "--pgd-steps",
        "3",
        "--json",
        "-",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = _json.loads(res.stdout)
    assert report["inputs"]["protocol"] == "static" and report["inputs"]["controls"] is False
    clean_rows = [r for r in report["results"]["training"] if r["role"] == "clean"]
    assert clean_rows and all(r["steps_run"] == 0 and r["source"] == "saved model" for r in clean_rows)
    assert [r["model"] for r in report["results"]["summary"]] == ["relu"]
    from attnaudit.models.builtin import load_model

    torch.testing.assert_close(load_model(path).W, weights_before)  # the checkpoint is untouched
    for extra, needle in (
        (["--protocol", "retrain"], "--protocol static"),
        (["--width", "8"], "--width"),
        (["--models", "relu"], "--models"),
        (["--estimator", "tracin"], "tracin"),
    ):
        bad = runner.invoke(app, args + extra)
        assert bad.exit_code == 2 and needle in bad.output, bad.output
    wrong = tmp_path / "wide.safetensors"
    save_model(build_model(ModelSpec("relu", 10, 4, 3)), wrong)
    mismatch = runner.invoke(app, ["malleability", "--checkpoint", str(wrong)])
    assert mismatch.exit_code == 2 and "features" in mismatch.output


def test_the_flip_rate_gate_counts_attacks_not_controls_and_ratios_carry_the_loss_gate(digits):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(attacks=("pgd", "sign"), seeds=(0, 1), max_flip_rate=0.0, **SMALL)
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    # with a limit of 0 every cell with a flip fires, but only attacked cells may: sign noise and reinit are controls
    sign_flips = [s for s in res.summary if s["attack"] == "sign" and (s["flip_rate"]["mean"] or 0) > 0]
    assert sign_flips, "the test needs a control with flips to show the gate ignores it"
    assert res.exceeded and {e["attack"] for e in res.exceeded} == {"pgd"}
    clean = {
        m: np.mean([t["final_loss"] for t in res.training if t["role"] == "clean" and t["model"] == m])
        for m in ("relu", "attn")
    }
    for r in res.ratios:
        gate = r["loss_gate"]
        assert gate["numerator_loss"] == pytest.approx(clean["attn"]) and gate["denominator_loss"] == pytest.approx(
            clean["relu"]
        )
        assert gate["comparable"] == (max(clean.values()) / min(clean.values()) <= 1.5)
        assert r["interval_method"].startswith("fieller") and len(r["numerator_values"]) == 2
