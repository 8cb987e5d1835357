"""Issue 14 (malleability): each protocol option changes what it should and nothing else.

Every check compares against something computed here independently: the data themselves
(sign noise), numpy's eigvalsh of an explicit Hessian (relative damping), a plain
training run (optimizer, per-model lr), the split's own row checksums (resample-data),
the untrained rule written out by hand, and hand recomputation of the flip rate per k.
Tiny digits problems: the whole file runs in well under a minute.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from attnaudit.analyses.malleability.attacks import AttackConfig, perturb
from attnaudit.errors import AuditError
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence, parse_damping
from attnaudit.analyses.malleability.aggregate import untrained_threshold
from attnaudit.analyses.malleability.config import MalleabilityConfig, parse_per_model
from attnaudit.analyses.malleability.malleability import run_malleability
from attnaudit.analyses.malleability.stability import stability
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import TrainConfig, loss_value, train

runner = CliRunner()
TINY = [
    "--n-train",
    "60",
    "--n-test",
    "20",
    "--width",
    "8",
    "--steps",
    "20",
    "--pgd-steps",
    "2",
    "--seeds",
    "2",
    "--quiet",
    "--json",
    "-",
]


@pytest.fixture(scope="module")
def app():
    from attnaudit.cli import app

    return app


SMALL = dict(width=8, steps=25, lr=2.0, top_k=10, pgd_steps=2)


def _cli(app, *args) -> dict:
    res = runner.invoke(app, ["malleability", *TINY, *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# ---------------------------------------------------------------- sign noise
@pytest.mark.parametrize("clip", [True, False])
def test_sign_noise_is_eps_on_every_unclipped_coordinate(digits, clip):
    X, y, _, _ = digits
    eps = 0.3
    model = torch.nn.Linear(X.shape[1], 10).double()
    cfg = AttackConfig("sign", eps, clip_min=0.0 if clip else None, clip_max=1.0 if clip else None, seed=3)
    res = perturb(model, X, y, cfg)
    x, delta = X.numpy(), (res.X_adv - X).numpy()
    mag = np.abs(delta)
    # independently of the code: a coordinate cannot be clipped when x - eps >= 0 and x + eps <= 1
    interior = (x >= eps) & (x <= 1 - eps) if clip else np.ones_like(x, dtype=bool)
    assert interior.sum() > 100
    assert np.allclose(mag[interior], eps, rtol=0, atol=1e-12)  # |delta| = eps on every unclipped coordinate
    # everywhere, delta is one of the two signed steps, clipped to [0, 1]
    up = (np.clip(x + eps, 0, 1) if clip else x + eps) - x
    down = (np.clip(x - eps, 0, 1) if clip else x - eps) - x
    assert np.all(np.isclose(delta, up, atol=1e-12) | np.isclose(delta, down, atol=1e-12))
    if clip:
        assert (x + delta).min() >= 0.0 and (x + delta).max() <= 1.0 and (~interior).any()
    # fair signs: about half positive where both steps are possible
    share = np.mean(delta[interior] > 0)
    assert 0.4 < share < 0.6
    # the reported norms are those of the perturbation actually applied
    linf, l2 = mag.max(1), np.sqrt((delta**2).sum(1))
    d = res.to_dict()
    assert d["perturbation_linf_mean"] == pytest.approx(linf.mean()) and d["perturbation_linf_max"] == pytest.approx(
        linf.max()
    )
    assert d["perturbation_l2_mean"] == pytest.approx(l2.mean()) and d["perturbation_l2_max"] == pytest.approx(l2.max())
    if not clip:
        assert d["perturbation_l2_mean"] == pytest.approx(eps * math.sqrt(X.shape[1]))


def test_sign_noise_l2_has_norm_eps_and_uniform_is_smaller(digits):
    X, y, _, _ = digits
    model = torch.nn.Linear(X.shape[1], 10).double()
    res = perturb(model, X, y, AttackConfig("sign", 2.0, norm="l2", seed=1))
    delta = (res.X_adv - X).numpy()
    assert np.allclose(np.linalg.norm(delta, axis=1), 2.0)
    assert np.allclose(np.abs(delta), 2.0 / math.sqrt(X.shape[1]))  # a random corner direction
    # uniform L-inf noise is far below the radius on average; sign noise is at it
    uni = perturb(model, X, y, AttackConfig("random", 0.3, seed=1))
    sig = perturb(model, X, y, AttackConfig("sign", 0.3, seed=1))
    assert (uni.X_adv - X).abs().mean() == pytest.approx(0.15, abs=0.01)
    assert (sig.X_adv - X).abs().mean() == pytest.approx(0.3)


def test_sign_is_the_default_random_control(digits):
    X, y, Xt, yt = digits
    assert MalleabilityConfig().attacks == ("pgd", "fgsm", "mim", "sign")
    cfg = MalleabilityConfig(models=("relu",), attacks=("pgd", "sign", "random"), seeds=(0,), **SMALL)
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    pgd = next(r for r in res.summary if r["attack"] == "pgd")
    sign = next(r for r in res.summary if r["attack"] == "sign")
    assert pgd["floors"]["random"]["attack"] == "sign"
    assert pgd["floors"]["random"]["mean"] == sign["flip_rate"]["mean"]
    # without sign the uniform control is the floor, as before
    cfg2 = MalleabilityConfig(models=("relu",), attacks=("pgd", "random"), seeds=(0,), **SMALL)
    res2 = run_malleability(X, y, Xt, yt, 10, cfg2, value_range=(0.0, 1.0))
    assert next(r for r in res2.summary if r["attack"] == "pgd")["floors"]["random"]["attack"] == "random"
    # attack rows carry both norms; sign noise sits at eps in L-inf (clipping only lowers the mean)
    row = next(a for a in res.attacks if a["method"] == "sign")
    assert row["perturbation_linf_max"] == pytest.approx(0.3) and row["perturbation_l2_mean"] > 0


# ---------------------------------------------------------------- relative damping
def _explicit_head_hessian(model, X, y) -> np.ndarray:
    """Hessian of the mean training loss over the head ``a`` alone, by torch.autograd.functional."""
    a0 = model.a.detach().clone()

    def loss_of(a):
        return loss_value(torch.func.functional_call(model, {"a": a}, (X,)), y, "mse")

    H = torch.autograd.functional.hessian(loss_of, a0)
    P = a0.numel()
    return H.reshape(P, P).numpy()


@pytest.mark.parametrize("estimator", ["last-layer", "cg"])
def test_relative_damping_is_the_multiple_of_lambda_max(digits, estimator):
    X, y, Xt, yt = digits
    spec = ModelSpec("relu", X.shape[1], 4, 10, seed=0)
    model = build_model(spec, X, dtype=torch.float64)
    train(model, X, y, TrainConfig(lr=2.0, steps=20))
    lam_max = float(np.linalg.eigvalsh(_explicit_head_hessian(model, X, y))[-1])
    cfg = InfluenceConfig(estimator=estimator, damping="1e-2x", params="head" if estimator == "cg" else None)
    rel = compute_influence(model, X, y, Xt, yt, cfg)
    assert rel.diagnostics["lambda_max"] == pytest.approx(lam_max, rel=1e-6)
    assert rel.damping == pytest.approx(1e-2 * lam_max, rel=1e-6)
    assert rel.diagnostics["damping_abs"] == rel.damping and rel.diagnostics["damping_given"] == "0.01x"
    # the same numbers as the absolute damping it resolves to
    ab = compute_influence(
        model, X, y, Xt, yt, InfluenceConfig(estimator=estimator, damping=1e-2 * lam_max, params=cfg.params)
    )
    assert torch.allclose(rel.total, ab.total, rtol=1e-5, atol=1e-12)


def test_relative_damping_in_malleability_rows(digits):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(models=("relu",), attacks=("pgd",), seeds=(0,), damping=("1e-3x", 0.01), **SMALL)
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    rel = [d for d in res.influence_diagnostics if d["damping"] == "0.001x"]
    ab = [d for d in res.influence_diagnostics if d["damping"] == 0.01]
    assert rel and ab and len(rel) == len(ab)
    for d in rel:
        assert d["damping_abs"] == pytest.approx(1e-3 * d["lambda_max"]) and d["damping_relative"] == 1e-3
        assert d["lambda_max"] == pytest.approx(d["max_eigenvalue"])
    for d in ab:
        assert d["damping_abs"] == 0.01 and d["lambda_max"] > 0
    # the clean model's lambda_max equals an explicit Hessian of the same (deterministically trained) model
    model = build_model(ModelSpec("relu", X.shape[1], 8, 10, seed=0), X, dtype=torch.float64)
    train(model, X, y, TrainConfig(lr=2.0, steps=25))
    lam = float(np.linalg.eigvalsh(_explicit_head_hessian(model, X, y))[-1])
    clean = next(d for d in rel if d["role"] == "clean")
    assert clean["lambda_max"] == pytest.approx(lam, rel=1e-6)
    # summary rows keep the damping as given; run rows carry the absolute value used
    assert {r["damping"] for r in res.summary} == {"0.001x", 0.01}
    run = next(r for r in res.runs if r["damping"] == "0.001x")
    pert = next(d for d in rel if d["role"].startswith("pgd"))
    assert run["damping_abs"] == pytest.approx(pert["damping_abs"]) and run["damping_abs_clean"] == pytest.approx(
        clean["damping_abs"]
    )


def test_parse_damping():
    assert parse_damping("1e-3x") == "0.001x" and parse_damping("0.01") == 0.01 and parse_damping(0) == 0.0
    for bad in ("1e-3y", "-1x", "0x", "x", "-1", "nan"):
        with pytest.raises(AuditError):
            parse_damping(bad)


# ---------------------------------------------------------------- optimizer
def test_gd_default_is_bit_identical_and_adam_changes_training(app):
    base = _cli(app, "--models", "relu", "--attacks", "pgd,random")
    explicit = _cli(app, "--models", "relu", "--attacks", "pgd,random", "--optimizer", "gd")
    for key in ("summary", "ratios", "runs", "controls", "training", "attacks"):
        assert base["results"][key] == explicit["results"][key], key
    # the default is the plain full-batch GD of attnaudit.core.training, bit for bit
    clean = next(t for t in base["results"]["training"] if t["role"] == "clean" and t["seed"] == 0)
    assert clean["optimizer"] == "gd" and clean["lr"] == 4.0 and clean["batch_size"] is None
    adam = _cli(app, "--models", "relu", "--attacks", "pgd,random", "--optimizer", "adam", "--batch-size", "16")
    aclean = next(t for t in adam["results"]["training"] if t["role"] == "clean" and t["seed"] == 0)
    assert aclean["optimizer"] == "adam" and aclean["lr"] == 1e-3 and aclean["batch_size"] == 16
    assert aclean["data_order_seed"] == 0
    assert aclean["loss_curve"] != clean["loss_curve"] and aclean["final_loss"] != clean["final_loss"]
    assert adam["results"]["config"]["optimizer"] == "adam" and adam["inputs"]["optimizer"] == "adam"
    # the reinit control draws a new data order with its new initialisation
    reinit = next(t for t in adam["results"]["training"] if t["role"] == "reinit" and t["seed"] == 0)
    assert reinit["data_order_seed"] == 1_000_003


def test_gd_path_equals_plain_training(digits):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(models=("relu",), attacks=("none",), seeds=(0,), controls=False, **SMALL)
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    model = build_model(ModelSpec("relu", X.shape[1], 8, 10, seed=0), X, dtype=torch.float64)
    tr = train(model, X, y, TrainConfig(lr=2.0, steps=25))
    assert res.training[0]["final_loss"] == tr.final_loss  # bit-identical


def test_adam_is_deterministic_and_match_loss_stops_it(digits):
    X, y, Xt, yt = digits
    kw = dict(
        models=("relu",),
        attacks=("none",),
        seeds=(0,),
        controls=False,
        optimizer="adam",
        batch_size=16,
        **{**SMALL, "lr": 1e-2},
    )
    a = run_malleability(X, y, Xt, yt, 10, MalleabilityConfig(**kw), value_range=(0.0, 1.0))
    b = run_malleability(X, y, Xt, yt, 10, MalleabilityConfig(**kw), value_range=(0.0, 1.0))
    assert a.training == b.training and a.runs == b.runs
    target = 0.5 * (a.training[0]["loss_curve"][0][1] + a.training[0]["final_loss"])
    m = run_malleability(X, y, Xt, yt, 10, MalleabilityConfig(**{**kw, "match_loss": target}), value_range=(0.0, 1.0))
    row = m.training[0]
    assert row["reached_match_loss"] is True and row["final_loss"] <= target and row["steps_run"] < 25
    assert row["steps_run"] % 4 == 0  # checked after every epoch: 60 rows / batch 16 = 4 steps


# ---------------------------------------------------------------- per-model lr and match-loss
def test_per_model_lr_is_parsed_recorded_and_applied(digits, app):
    assert parse_per_model("relu=10,attn=8", "--lr") == {"relu": 10.0, "attn": 8.0}
    assert parse_per_model("0.5", "--lr") == 0.5
    X, y, Xt, yt = digits
    both = MalleabilityConfig(
        attacks=("none",), seeds=(0,), controls=False, **{**SMALL, "lr": {"relu": 2.0, "attn": 1.0}}
    )
    res = run_malleability(X, y, Xt, yt, 10, both, value_range=(0.0, 1.0))
    assert {t["model"]: t["lr"] for t in res.training} == {"relu": 2.0, "attn": 1.0}
    assert res.to_dict()["config"]["lr_per_model"] == {"relu": 2.0, "attn": 1.0}
    for arch, lr in (("relu", 2.0), ("attn", 1.0)):
        alone = MalleabilityConfig(models=(arch,), attacks=("none",), seeds=(0,), controls=False, **{**SMALL, "lr": lr})
        one = run_malleability(X, y, Xt, yt, 10, alone, value_range=(0.0, 1.0))
        assert one.training[0]["final_loss"] == next(t for t in res.training if t["model"] == arch)["final_loss"]
    payload = _cli(
        app, "--attacks", "none", "--no-controls", "--lr", "relu=3,attn=1.5", "--match-loss", "relu=0.3,attn=0.4"
    )
    lrs = {t["model"]: t["lr"] for t in payload["results"]["training"]}
    assert lrs == {"relu": 3.0, "attn": 1.5}
    assert {t["model"]: t["match_loss"] for t in payload["results"]["training"]} == {"relu": 0.3, "attn": 0.4}


# ---------------------------------------------------------------- resample-data
def test_resample_data_draws_rows_per_seed(app):
    fixed = _cli(app, "--models", "relu", "--attacks", "none", "--no-controls")
    resampled = _cli(app, "--models", "relu", "--attacks", "none", "--no-controls", "--resample-data")
    f, r = fixed["results"]["splits"], resampled["results"]["splits"]
    assert [s["seed"] for s in f] == [0, 1] and [s["seed"] for s in r] == [0, 1]
    assert len({s["train_indices_sha256"] for s in f}) == 1 and len({s["train_data_sha256"] for s in f}) == 1
    assert len({s["train_indices_sha256"] for s in r}) == 2 and len({s["train_data_sha256"] for s in r}) == 2
    assert [s["split_seed"] for s in r] == [0, 1] and [s["split_seed"] for s in f] == [0, 0]
    # seed 0's resampled split is the default split (split seed = --seed)
    assert r[0]["train_indices_sha256"] == f[0]["train_indices_sha256"]
    assert resampled["results"]["config"]["resample_data"] is True
    hashes = {t["seed"]: t["train_data_sha256"] for t in resampled["results"]["training"]}
    assert hashes[0] != hashes[1]


# ---------------------------------------------------------------- untrained models
def test_untrained_rule_fires_for_a_zero_step_model_only(digits):
    X, y, Xt, yt = digits
    chance, thr = untrained_threshold(10, 60)
    assert chance == 0.1 and thr == pytest.approx(0.1 + max(0.05, 2 * math.sqrt(0.09 / 60)))
    zero = MalleabilityConfig(attacks=("pgd", "sign"), seeds=(0, 1), **{**SMALL, "steps": 0})
    res = run_malleability(X, y, Xt, yt, 10, zero, value_range=(0.0, 1.0))
    accs = {
        m: np.mean([t["train_accuracy"] for t in res.training if t["model"] == m and t["role"] == "clean"])
        for m in ("relu", "attn")
    }
    assert all(a < thr for a in accs.values())
    assert res.to_dict()["untrained"] == {"relu": True, "attn": True}
    assert all(r["untrained"] for r in res.summary) and all(r["untrained"] == ["attn", "relu"] for r in res.ratios)
    model_verdicts = [v for v in res.verdicts if v.startswith(("relu ", "attn ", "flip-rate ratio"))]
    assert model_verdicts and all("no claim" in v for v in model_verdicts)
    assert not any("more malleable" in v and "no claim" not in v for v in res.verdicts)
    assert sum("did not train" in w for w in res.warnings) == 2
    trained = MalleabilityConfig(models=("relu",), attacks=("pgd",), seeds=(0,), **{**SMALL, "steps": 150})
    ok = run_malleability(X, y, Xt, yt, 10, trained, value_range=(0.0, 1.0))
    assert ok.model_status[0]["train_accuracy_mean"] > thr and ok.to_dict()["untrained"] == {"relu": False}
    assert not any("did not train" in v for v in ok.verdicts)


# ---------------------------------------------------------------- top-k list
def test_top_k_list_gives_one_value_per_k(digits):
    X, y, Xt, yt = digits
    cfg = MalleabilityConfig(models=("relu",), attacks=("pgd",), seeds=(0, 1), **{**SMALL, "top_k": (5, 10, 30)})
    assert cfg.top_k == 5 and cfg.top_ks == (5, 10, 30)
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0))
    for row in res.summary:
        assert row["top_k"] == 5 and [e["top_k"] for e in row["by_top_k"]] == [5, 10, 30]
        assert row["by_top_k"][0]["flip_rate"] == row["flip_rate"]  # the existing keys report the first k
    for run in res.runs + res.controls:
        assert [e["top_k"] for e in run["by_top_k"]] == [5, 10, 30] and run["top_k"] == 5
    pgd = next(r for r in res.summary if r["attack"] == "pgd")
    vals = {k: [next(e for e in r["by_top_k"] if e["top_k"] == k)["flip_rate"] for r in res.runs] for k in (5, 10, 30)}
    for e in pgd["by_top_k"]:
        assert e["flip_rate"]["values"] == pytest.approx(vals[e["top_k"]])
        assert set(e["floors"]) == {"reinit"}
    # the per-k value is the flip rate at that k (hand check against stability)
    s = stability(np.array([3.0, -2.0, 1.0, 0.5]), np.array([-3.0, -2.0, -1.0, 0.5]), 1)
    assert s["flip_rate"] == 1.0


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--damping", "1e-3y"], "--damping"),
        (["--lr", "relu=x"], "--lr"),
        (["--lr", "gpt=1,relu=1,attn=1"], "--lr"),
        (["--match-loss", "relu=-1"], "--match-loss"),
        (["--top-k", "10,x"], "--top-k"),
        (["--optimizer", "lbfgs"], "--optimizer"),
        (["--batch-size", "8"], "--batch-size"),
        (["--batch-size", "0", "--optimizer", "sgd"], "--batch-size"),
        (["--top-k", "10,10"], "--top-k"),
        (["--damping", "0x"], "--damping"),
    ],
)
def test_bad_values_exit_2_with_one_line(app, args, needle):
    res = runner.invoke(app, ["malleability", "--n-train", "40", "--n-test", "10", "--quiet", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output
