"""`attnaudit alignment`: each piece against an independent ground truth, then the CLI end to end.

Ground truths: scikit-learn's KernelRidge (precomputed kernel) for the ridge predictor; the
Monte-Carlo empirical NTK of a very wide random MLP-Attn (closed form of attnaudit.core.ntk, a
different code path than the analytic arc-cosine kernel) for the kernel used; a direct numpy
H K H formula and hand-computed values for CKA; numpy's SVD / matrix_rank for the targets;
a direct Student-t interval (scipy) for the summaries.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats as st

from attnaudit.analyses.alignment import alignment as al
from attnaudit.analyses.request import FieldError

F64 = torch.float64


@pytest.fixture(scope="module")
def rows():
    """Digits rows, pixels in [0, 1], centred like --preprocess center: 150 training, 80 test rows."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    X = X - X.mean(0)
    return (
        torch.from_numpy(X[:150]),
        torch.from_numpy(y[:150]).long(),
        torch.from_numpy(X[200:280]),
        torch.from_numpy(y[200:280]).long(),
    )


# ----------------------------------------------------------------------------- kernel ridge


def test_kernel_ridge_matches_sklearn_on_the_attention_ntk(rows):
    from sklearn.kernel_ridge import KernelRidge

    from attnaudit.core.ntk import analytic_ntk

    X, y, Xt, yt = rows
    Z, Zt = al.attention_inputs(X, Xt)
    K, Kt = analytic_ntk(Z), analytic_ntk(Zt, Z)
    Y = torch.nn.functional.one_hot(y, 10).double()
    Y = Y - Y.mean(0)
    pred, lam = al.kernel_ridge_predict(K, Kt, Y, 1e-3)
    assert lam == pytest.approx(1e-3 * np.trace(K.numpy()) / K.shape[0], rel=1e-14)
    ref = KernelRidge(alpha=lam, kernel="precomputed").fit(K.numpy(), Y.numpy()).predict(Kt.numpy())
    assert np.abs(pred.numpy() - ref).max() <= 1e-8 * np.abs(ref).max()
    # relative error, by hand
    assert al.relative_error(pred, torch.from_numpy(ref)) == pytest.approx(0.0, abs=1e-12)
    assert al.relative_error(torch.zeros(3, 1, dtype=F64), torch.ones(3, 1, dtype=F64)) == 1.0


def test_kernel_ridge_matches_sklearn_on_a_random_psd_kernel():
    from sklearn.kernel_ridge import KernelRidge

    g = np.random.default_rng(3)
    A = g.standard_normal((40, 60))
    K = A @ A.T
    B = g.standard_normal((15, 60))
    Kt = B @ A.T
    Y = g.standard_normal((40, 2))
    pred, lam = al.kernel_ridge_predict(torch.from_numpy(K), torch.from_numpy(Kt), torch.from_numpy(Y), 0.05)
    ref = KernelRidge(alpha=lam, kernel="precomputed").fit(K, Y).predict(Kt)
    np.testing.assert_allclose(pred.numpy(), ref, rtol=1e-9, atol=1e-10)


def test_kernel_ridge_on_an_indefinite_kernel_clips_negative_eigenvalues():
    """Round-off can make K + lambda I indefinite; the solver then uses the PSD part of K (checked
    against KernelRidge on the clipped kernel built with numpy)."""
    from sklearn.kernel_ridge import KernelRidge

    g = np.random.default_rng(5)
    Q, _ = np.linalg.qr(g.standard_normal((20, 20)))
    ev = np.r_[np.linspace(1.0, 10.0, 19), -5.0]
    K = (Q * ev) @ Q.T
    Kt = g.standard_normal((6, 20))
    Y = g.standard_normal((20, 1))
    solver = al.RidgeSolver(torch.from_numpy(K), torch.from_numpy(Kt), 1e-3)
    assert solver.method.startswith("eigh")
    _, pred = solver.predict(torch.from_numpy(Y))
    clipped = (Q * np.clip(ev, 0, None)) @ Q.T
    ref = KernelRidge(alpha=solver.lam, kernel="precomputed").fit(clipped, Y).predict(Kt)
    np.testing.assert_allclose(pred.numpy(), ref, rtol=1e-9, atol=1e-11)


def test_attention_inputs_are_the_models_map_and_the_rms_rule(rows):
    """f_att(x) = s (X^T X) x with the training context, s making the RMS row norm of f_att(X) that of X
    (computed here with numpy), and the same map as MLP-Attn's features_in on test points."""
    from attnaudit.models.builtin import ModelSpec, build_model

    X, _, Xt, _ = rows
    Z, Zt = al.attention_inputs(X, Xt)
    Xn, Xtn = X.numpy(), Xt.numpy()
    C = Xn.T @ Xn
    raw = Xn @ C
    s = np.sqrt((Xn**2).sum(1).mean()) / np.sqrt((raw**2).sum(1).mean())
    np.testing.assert_allclose(Zt.numpy(), s * Xtn @ C, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(np.sqrt((Z.numpy() ** 2).sum(1).mean()), np.sqrt((Xn**2).sum(1).mean()), rtol=1e-12)
    net = build_model(ModelSpec("attn", X.shape[1], 8, 1), X)
    np.testing.assert_allclose(net.features_in(Xt).detach().numpy(), Zt.numpy(), rtol=1e-10, atol=1e-13)


def test_the_attention_kernel_is_the_wide_net_limit(rows):
    """The analytic NTK on f_att inputs against the closed-form empirical NTK of a very wide random
    MLP-Attn fed the raw rows (its own features_in): the Monte-Carlo error at m = 40,000 is ~1 %."""
    from attnaudit.models.builtin import ModelSpec, build_model
    from attnaudit.core.ntk import analytic_ntk, entk_two_layer

    X, _, Xt, _ = rows
    X, Xt = X[:40], Xt[:20]
    Z, Zt = al.attention_inputs(X, Xt)
    exact = analytic_ntk(Zt, Z)
    errs = []
    for m in (1000, 40000):
        net = build_model(ModelSpec("attn", X.shape[1], m, 1, seed=1), X)
        emp = entk_two_layer(net, Xt, X, form="trace")
        errs.append(float((emp - exact).norm() / exact.norm()))
    assert errs[1] < 0.03, errs
    assert errs[1] < errs[0] / 2, errs  # shrinking like 1/sqrt(m) (sqrt(40) ~ 6)


# ----------------------------------------------------------------------------- CKA


def _numpy_cka(K, Y):
    n = K.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    Kc, Lc = H @ K @ H, H @ (Y @ Y.T) @ H
    return float((Kc * Lc).sum() / (np.linalg.norm(Kc) * np.linalg.norm(Lc)))


def test_cka_hand_values_and_invariances():
    # K = I (n = 3), y = (1, -1, 0): <H, y y^T> = 2, ||H||_F = sqrt 2, ||y y^T||_F = 2, so CKA = 1 / sqrt 2
    y = torch.tensor([[1.0], [-1.0], [0.0]], dtype=F64)
    assert al.kernel_alignment(torch.eye(3, dtype=F64), y) == pytest.approx(1 / math.sqrt(2), rel=1e-14)
    g = np.random.default_rng(0)
    Y = g.standard_normal((12, 2))
    K = torch.from_numpy(Y @ Y.T)
    assert al.kernel_alignment(K, torch.from_numpy(Y)) == pytest.approx(1.0, rel=1e-12)  # CKA(K, K) = 1
    A = g.standard_normal((12, 5))
    K2 = torch.from_numpy(A @ A.T + 3.0)  # a constant shift is removed by centring
    v = al.kernel_alignment(K2, torch.from_numpy(Y))
    assert v == pytest.approx(_numpy_cka(K2.numpy(), Y), rel=1e-12)
    assert al.kernel_alignment(7.0 * K2, torch.from_numpy(-4.0 * Y)) == pytest.approx(v, rel=1e-12)


# ----------------------------------------------------------------------------- targets


def test_targets_live_in_their_directions_and_are_normalised(rows):
    X, y, Xt, yt = rows
    k = 5
    T = al.design_targets(X, Xt, al.TARGETS, k, seed=4, y_train=y, y_test=yt)
    Xn = X.numpy()
    mu = Xn.mean(0)
    U, s, Vt = np.linalg.svd(Xn - mu, full_matrices=False)
    r = np.linalg.matrix_rank(Xn - mu)
    assert r < X.shape[1]  # digits have constant pixels: the null space exists and must be avoided
    for kind, U_k in (("principal", U[:, :k]), ("trailing", U[:, r - k : r])):
        t = T[kind].Y.numpy()[:, 0]
        resid = t - U_k @ (U_k.T @ t)
        assert np.linalg.norm(resid) / np.linalg.norm(t) < 1e-10, kind
        # the test target is the same linear function of the centred test rows
        V_k = Vt[:k].T if kind == "principal" else Vt[r - k : r].T
        P = V_k @ V_k.T
        np.testing.assert_allclose(
            T[kind].Y_test.numpy()[:, 0],
            ((Xt.numpy() - mu) @ P) @ np.linalg.lstsq((Xn - mu) @ P, t, rcond=None)[0],
            rtol=1e-6,
            atol=1e-8,
        )
    assert min(T["trailing"].singular_values) > s[0] * max(Xn.shape) * np.finfo(float).eps * 1e3
    D = T["random"].directions.numpy()
    np.testing.assert_allclose(D.T @ D, np.eye(k), atol=1e-12)
    for kind, tg in T.items():  # unit mean squared norm, zero mean on the training rows
        assert float(tg.Y.pow(2).sum(1).mean()) == pytest.approx(1.0, rel=1e-12), kind
        assert np.abs(tg.Y.numpy().mean(0)).max() < 1e-12, kind
    lab = T["labels"].Y.numpy()
    assert lab.shape[1] == len(set(y.tolist())) and (lab.argmax(1) == y.numpy()).all()
    # the data's own linear kernel is far better aligned with the principal target than with the trailing one
    lin = X @ X.T
    assert al.kernel_alignment(lin, T["principal"].Y) > 50 * al.kernel_alignment(lin, T["trailing"].Y)
    with pytest.raises(FieldError, match="k 200 exceeds the numerical rank") as err:
        al.design_targets(X, Xt, ("principal",), 200, seed=0)
    assert err.value.field == "k"


# ----------------------------------------------------------------------------- trained nets


def test_training_uses_the_projects_trainer_and_loss(rows):
    from attnaudit.models.builtin import ModelSpec, build_model
    from attnaudit.core.training import loss_value

    X, y, Xt, yt = rows
    tg = al.design_targets(X, Xt, ("principal",), 5, seed=0)["principal"]
    net = build_model(ModelSpec("relu", X.shape[1], 16, 1, seed=0), X)
    wrapped = al._RegressionResidual(net, tg.Y)
    with torch.no_grad():
        project = loss_value(wrapped(X), torch.zeros(X.shape[0], dtype=torch.long), "mse").item()
        direct = 0.5 * (net(X) - tg.Y).pow(2).sum(1).mean().item()
    assert project == pytest.approx(direct, rel=1e-13)
    fit = al.train_matched("attn", X, Xt, tg, width=64, seed=0, lr=20.0, steps=400, loss_tol=0.5 * 0.2)
    assert fit.reached and fit.train_error <= 0.2 + 1e-12 and fit.steps_run < 400
    short = al.train_matched("attn", X, Xt, tg, width=64, seed=0, lr=20.0, steps=1, loss_tol=1e-6)
    assert not short.reached and short.steps_run == 1


# ----------------------------------------------------------------------------- config and summaries


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"k": 0}, "k"),
        ({"ridge": -1.0}, "ridge"),
        ({"targets": ("principal", "bogus")}, "targets"),
        ({"match_loss": 1.5}, "match_loss"),
        ({"lr_fraction": 1.0}, "lr_fraction"),
        ({"n_test": 0}, "n_test"),
        ({"attn_scaling": "huge"}, "attn_scaling"),
        ({"lr": 0.0}, "lr"),
        ({"seeds": ()}, "seeds"),
    ],
)
def test_config_is_validated_on_construction(kwargs, field):
    with pytest.raises(FieldError) as err:
        al.AlignmentConfig(**kwargs)
    assert err.value.field == field and field in str(err.value) and "--" not in str(err.value)


def test_summaries_are_paired_t_intervals_with_the_stated_signs():
    cfg = al.AlignmentConfig(targets=("principal", "random"), seeds=(0, 1, 2, 3))
    g = np.random.default_rng(1)
    rows = []
    for s in cfg.seeds:
        for kind in cfg.targets:
            for arch in al.MODELS:
                rows.append(
                    al.SeedRow(
                        seed=s,
                        target=kind,
                        model=arch,
                        kernel_error=float(g.uniform(0, 1)),
                        kernel_train_error=0.0,
                        cka=float(g.uniform(0, 1)),
                        ridge_lambda=1.0,
                        net_error=float(g.uniform(0, 1)),
                        net_reached_loss=not (s == 2 and arch == "attn"),
                    )
                )
    summary, contrast, _ = al.summarise(rows, cfg, cfg.targets)

    def val(s, kind, arch, key):
        return next(getattr(r, key) for r in rows if (r.seed, r.target, r.model) == (s, kind, arch))

    def t_interval(v):
        v = np.asarray(v)
        h = st.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
        return v.mean() - h, v.mean() + h

    row = next(r for r in summary if r.quantity == "kernel_error_advantage_attn" and r.target == "principal")
    diff = [
        val(s, "principal", "relu", "kernel_error") - val(s, "principal", "attn", "kernel_error") for s in cfg.seeds
    ]
    assert row.per_seed == pytest.approx(diff) and row.estimate == pytest.approx(np.mean(diff))
    assert row.interval == pytest.approx(list(t_interval(diff)))
    assert row.null_value == 0.0 and row.n_seeds == 4 and row.interval_method == "paired student-t"
    ratio = next(r for r in summary if r.quantity == "kernel_log_error_ratio_attn" and r.target == "principal")
    assert ratio.per_seed == pytest.approx(
        [
            math.log(val(s, "principal", "relu", "kernel_error") / val(s, "principal", "attn", "kernel_error"))
            for s in cfg.seeds
        ]
    )
    cka = next(r for r in summary if r.quantity == "cka_advantage_attn" and r.target == "random")
    assert cka.per_seed[0] == pytest.approx(val(0, "random", "attn", "cka") - val(0, "random", "relu", "cka"))
    net = next(r for r in summary if r.quantity == "net_error_advantage_attn" and r.target == "principal")
    assert net.excluded_seeds == [2] and net.n_seeds == 3 and net.per_seed[2] is None
    con = next(r for r in contrast if r.quantity == "kernel_error_advantage_attn_contrast")
    adv_r = [val(s, "random", "relu", "kernel_error") - val(s, "random", "attn", "kernel_error") for s in cfg.seeds]
    per = [a - b for a, b in zip(diff, adv_r)]
    assert con.target == "principal-random" and con.per_seed == pytest.approx(per)
    assert con.interval == pytest.approx(list(t_interval(per)))


# ----------------------------------------------------------------------------- CLI


SMALL = ["--n-train", "120", "--n-test", "60", "--seeds", "3", "--width", "32", "--steps", "150", "--k", "3"]


def test_cli_end_to_end_writes_the_json_contract(tmp_path):
    from conftest import run_cli

    out = tmp_path / "a.json"
    png = tmp_path / "a.png"
    assert run_cli("alignment", *SMALL, "--json", str(out), "--png", str(png), "--quiet") == 0
    rep = json.loads(out.read_text())
    assert rep["schema"] == al.SCHEMA and png.stat().st_size > 1000
    assert rep["seeds"]["seeds"] == [0, 1, 2]
    inputs = rep["inputs"]
    for key in ("k", "ridge", "width", "steps", "lr", "n_train", "n_test", "target_norm", "match_loss", "loss_tol"):
        assert key in inputs, key
    res = rep["results"]
    assert len(res["per_seed"]) == 3 * 4 * 2
    row = res["per_seed"][0]
    for key in ("seed", "target", "model", "kernel_error", "net_error", "net_reached_loss", "cka", "flagged"):
        assert key in row, key
    kinds = {(r["quantity"], r["target"]) for r in res["summary"]}
    assert ("kernel_error_advantage_attn", "principal") in kinds and ("cka_advantage_attn", "labels") in kinds
    for r in res["summary"] + res["contrast"]:
        assert set(r) >= {
            "quantity",
            "target",
            "estimate",
            "interval",
            "interval_method",
            "confidence",
            "n_seeds",
            "per_seed",
            "null_value",
            "verdict",
        }
        assert len(r["interval"]) == 2 and r["null_value"] == 0.0 and r["confidence"] == 0.95
    assert {r["target"] for r in res["contrast"]} == {"principal-random", "principal-trailing"}
    assert rep["verdicts"] and rep["verdicts"][0].startswith(
        "alignment kernel_error_advantage_attn_contrast [principal-random]"
    )
    # a net that missed the loss is flagged and absent from its comparison
    for r in res["per_seed"]:
        assert r["flagged"] == (r["net_reached_loss"] is False)
    for s in res["summary"]:
        if s["quantity"] == "net_error_advantage_attn":
            missed = {r["seed"] for r in res["per_seed"] if r["target"] == s["target"] and not r["net_reached_loss"]}
            assert set(s["excluded_seeds"]) == missed


@pytest.mark.parametrize(
    "args, word",
    [
        (["--k", "0"], "--k"),
        (["--ridge", "-1"], "--ridge"),
        (["--targets", "principal,nope"], "--targets"),
        (["--preset", "huge"], "--preset"),
    ],
)
def test_cli_bad_option_exits_2_with_one_line(args, word, capsys):
    from conftest import run_cli

    assert run_cli("alignment", *args, "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and word in err


def test_run_cell_runs_alignment_in_process():
    from attnaudit.analyses.registry import run_cell

    out = run_cell({"analysis": "alignment", "args": [*SMALL, "--no-nets", "--targets", "principal,random"]})
    rep = out["report"]
    assert rep["schema"] == al.SCHEMA and rep["inputs"]["nets"] is False
    assert {r["target"] for r in rep["results"]["contrast"]} == {"principal-random"}
    assert all(r["net_error"] is None for r in rep["results"]["per_seed"])
    bad = run_cell({"analysis": "alignment", "args": ["--k", "0"]})
    assert bad["kind"] == "input" and "--k" in bad["error"]


@pytest.mark.parametrize(
    "check",
    [
        "test_every_option_sits_in_a_panel_in_the_manual_order",
        "test_plain_metavars_and_no_type_labels",
        "test_help_ends_with_an_example_that_parses",
    ],
)
def test_help_follows_the_manual_conventions(check, capsys, monkeypatch):
    """The same --help checks every other command passes (tests/cli/test_help.py), run for alignment."""
    from cli import test_help

    getattr(test_help, check)("alignment", capsys, monkeypatch)
