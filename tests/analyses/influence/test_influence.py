"""Influence estimators against independent ground truth.

Ground truths used here: leave-one-out retraining to tight convergence with our own numpy
Newton / closed-form solvers (not the code under test), torch.autograd.functional.hessian,
numpy eigenvalues and plain autograd loops.
"""

from __future__ import annotations
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from attnaudit.core.engine import Engine
from attnaudit.core.task import Inputs, Task
from attnaudit.errors import AuditError
from attnaudit.analyses.influence.paths import PATH_FAST_TWOLAYER_HEAD, PATH_GENERIC
from attnaudit.analyses.influence.influence import (
    ESTIMATORS,
    InfluenceConfig,
    batched_cg,
    compute_influence,
    influence_memory,
    influence_sweep,
    resolve_tracked,
    tracin_weights,
)
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import TrainConfig, train

F64 = torch.float64  # every tensor built here is float64 explicitly: no global default dtype


def _blobs(n, d, c, seed, spread=1.2):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(c, d)) * spread
    y = rng.integers(0, c, size=n)
    X = centers[y] + rng.normal(size=(n, d))
    return X, y


# ---------------------------------------------------------------- independent solvers (numpy)
def _softmax(Z):
    Z = Z - Z.max(1, keepdims=True)
    E = np.exp(Z)
    return E / E.sum(1, keepdims=True)


def _newton_logreg(F, y, c, lam, weights=None, W0=None, iters=60):
    """argmin_W (1/n) sum_i w_i ce(W f_i, y_i) + lam/2 ||W||^2, Newton in float64 (W: c x p)."""
    n, p = F.shape
    w = np.ones(n) if weights is None else weights
    Y = np.eye(c)[y]
    W = np.zeros((c, p)) if W0 is None else W0.copy()
    for _ in range(iters):
        P = _softmax(F @ W.T)
        G = ((P - Y) * w[:, None]).T @ F / n + lam * W
        # H[(k,j),(l,m)] = (1/n) sum_i w_i (p_ik d_kl - p_ik p_il) f_ij f_im + lam
        A = np.einsum("ik,kl->ikl", P, np.eye(c)) - np.einsum("ik,il->ikl", P, P)
        H = np.einsum("i,ikl,ij,im->kjlm", w, A, F, F).reshape(c * p, c * p) / n + lam * np.eye(c * p)
        step = np.linalg.solve(H, G.reshape(-1)).reshape(c, p)
        W = W - step
        if np.abs(step).max() < 1e-14:
            break
    return W


def _ce_sum(F, y, W):
    Z = F @ W.T
    m = Z.max(1, keepdims=True)
    lse = (m + np.log(np.exp(Z - m).sum(1, keepdims=True)))[:, 0]
    return float((lse - Z[np.arange(len(y)), y]).sum())


def _ridge(F, Y, lam, weights=None):
    """argmin_A (1/(2n)) sum_i w_i ||F_i A - Y_i||^2 + lam/2 ||A||^2 (closed form)."""
    n, p = F.shape
    w = np.ones(n) if weights is None else weights
    return np.linalg.solve(F.T @ (F * w[:, None]) / n + lam * np.eye(p), F.T @ (Y * w[:, None]) / n)


def _loo_correlation(predicted, actual):
    return float(np.corrcoef(predicted, actual)[0, 1])


# ---------------------------------------------------------------- leave-one-out
@pytest.mark.parametrize("estimator", ["exact", "last-layer", "cg"])
def test_influence_predicts_leave_one_out_logistic_regression(estimator):
    n, d, c, lam = 80, 4, 3, 0.02
    X, y = _blobs(n, d, c, seed=1)
    Xt, yt = _blobs(40, d, c, seed=2)
    W = _newton_logreg(X, y, c, lam)
    model = nn.Linear(d, c, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(W))
    # L2 regularisation lam/2 ||W||^2 adds lam I to the Hessian: exactly the damping.
    res = compute_influence(
        model,
        torch.from_numpy(X),
        torch.from_numpy(y),
        torch.from_numpy(Xt),
        torch.from_numpy(yt),
        InfluenceConfig(estimator=estimator, damping=lam, cg_tol=1e-12),
        loss="ce",
    )
    infl = res.total.numpy()
    base = _ce_sum(Xt, yt, W)
    top = np.argsort(-np.abs(infl))[:25]
    actual = []
    for j in top:
        w = np.ones(n)
        w[j] = 0.0  # removal with the 1/n normalisation kept: epsilon = -1/n exactly
        actual.append(_ce_sum(Xt, yt, _newton_logreg(X, y, c, lam, weights=w, W0=W)) - base)
    predicted = -infl[top] / n
    assert _loo_correlation(predicted, np.array(actual)) >= 0.95
    # sign, not just correlation: the predicted change has the same sign as the actual one for most points
    assert np.mean(np.sign(predicted) == np.sign(actual)) >= 0.9


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_last_layer_predicts_leave_one_out_with_frozen_features(loss):
    n, d, c, m, lam = 70, 5, 3, 12, 0.01
    X, y = _blobs(n, d, c, seed=3)
    Xt, yt = _blobs(30, d, c, seed=4)
    X, Xt = X / 3, Xt / 3
    Xtr_t = torch.from_numpy(X)
    net = build_model(ModelSpec("relu", d, m, c, seed=0), Xtr_t)
    train(net, Xtr_t, torch.from_numpy(y), TrainConfig(loss=loss, lr=0.5, steps=50))
    # features computed independently of the model code: relu(X W^T / sqrt(d)) / sqrt(m)
    Wn = net.W.detach().numpy()
    F = np.maximum(X @ Wn.T / np.sqrt(d), 0) / np.sqrt(m)
    Ft = np.maximum(Xt @ Wn.T / np.sqrt(d), 0) / np.sqrt(m)
    Y, Yt = np.eye(c)[y], np.eye(c)[yt]
    if loss == "ce":
        A = _newton_logreg(F, y, c, lam).T  # (m, c)

        def test_loss(A_):
            return _ce_sum(Ft, yt, A_.T)

        def refit(w):
            return _newton_logreg(F, y, c, lam, weights=w, W0=A.T).T
    else:
        A = _ridge(F, Y, lam)

        def test_loss(A_):
            return float(0.5 * ((Ft @ A_ - Yt) ** 2).sum())

        def refit(w):
            return _ridge(F, Y, lam, weights=w)

    with torch.no_grad():
        net.a.copy_(torch.from_numpy(A))
    res = compute_influence(
        net,
        Xtr_t,
        torch.from_numpy(y),
        torch.from_numpy(Xt),
        torch.from_numpy(yt),
        InfluenceConfig(estimator="last-layer", damping=lam),
        loss=loss,
    )
    infl = res.total.numpy()
    top = np.argsort(-np.abs(infl))[:20]
    base = test_loss(A)
    actual = []
    for j in top:
        w = np.ones(n)
        w[j] = 0.0
        actual.append(test_loss(refit(w)) - base)
    assert _loo_correlation(-infl[top] / n, np.array(actual)) >= 0.95


# ---------------------------------------------------------------- agreement between estimators
def _small_net(arch="relu", n=40, d=4, c=3, m=6, steps=150, seed=0):
    X, y = _blobs(n, d, c, seed=seed)
    Xt, yt = _blobs(12, d, c, seed=seed + 10)
    X, y, Xt, yt = (torch.from_numpy(v) for v in (X / 3, y, Xt / 3, yt))
    net = build_model(ModelSpec(arch, d, m, c, seed=seed), X)
    tr = train(net, X, y, TrainConfig(lr=1.0, steps=steps, checkpoint_every=25))
    return net, X, y, Xt, yt, tr


def test_exact_last_layer_cg_agree_when_only_the_last_layer_exists():
    X, y = _blobs(50, 4, 3, seed=5)
    Xt, yt = _blobs(10, 4, 3, seed=6)
    X, y, Xt, yt = (torch.from_numpy(v) for v in (X, y, Xt, yt))
    model = nn.Linear(4, 3, bias=False).double()
    train(model, X, y, TrainConfig(loss="ce", lr=0.5, steps=100))
    out = {
        est: compute_influence(
            model, X, y, Xt, yt, InfluenceConfig(estimator=est, damping=0.01, per_test=True, cg_tol=1e-12), loss="ce"
        )
        for est in ("exact", "last-layer", "cg")
    }
    for est in ("last-layer", "cg"):
        torch.testing.assert_close(out[est].per_test, out["exact"].per_test, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(out[est].total, out["exact"].total, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(out["exact"].per_test.sum(1), out["exact"].total)


def test_feature_cached_last_layer_equals_generic_path_on_a_wrapped_module():
    net, X, y, Xt, yt, _ = _small_net("attn")
    cached = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="last-layer", damping=0.01))
    assert cached.path == PATH_FAST_TWOLAYER_HEAD and cached.diagnostics["path"] == PATH_FAST_TWOLAYER_HEAD
    net.W.requires_grad_(False)  # now 'all' trainable parameters = the output layer

    class Wrapped(nn.Module):  # hides the TwoLayerNet type, so the generic engine path runs
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    generic = compute_influence(Wrapped(net), X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=0.01))
    assert generic.tracked == ["inner.a"]
    assert generic.path == PATH_GENERIC
    torch.testing.assert_close(cached.total, generic.total, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("arch", ["relu", "attn"])
def test_cg_converges_to_exact_on_small_network(arch):
    net, X, y, Xt, yt, _ = _small_net(arch)
    probe = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=0.0 + 1e-3))
    damping = max(0.0, -probe.diagnostics["min_eigenvalue"]) + 0.02  # positive definite by construction
    ex = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=damping, per_test=True))
    cg = compute_influence(
        net, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=damping, per_test=True, cg_tol=1e-10)
    )
    assert cg.diagnostics["converged"] and cg.diagnostics["relative_residual_max"] <= 1e-9
    assert cg.diagnostics["iterations"] <= cg.n_params
    torch.testing.assert_close(cg.per_test, ex.per_test, rtol=1e-6, atol=1e-9)


def test_dense_hessian_and_eigenvalues_match_autograd():
    net, X, y, *_ = _small_net("relu", m=5)
    d, m = net.spec.d_in, net.spec.width
    Y = torch.nn.functional.one_hot(y, 3).double()

    def loss_flat(theta):  # the model written out by hand
        W = theta[: m * d].view(m, d)
        a = theta[m * d :].view(m, 3)
        f = torch.relu(X @ W.T / d**0.5) @ a / m**0.5
        return 0.5 * ((f - Y) ** 2).sum(1).mean()

    theta0 = torch.cat([net.W.detach().reshape(-1), net.a.detach().reshape(-1)])
    H_ref = torch.autograd.functional.hessian(loss_flat, theta0)
    engine = Engine(Task(net, 3, "mse"), dtype=F64)  # the Hessian influence's exact estimator decomposes
    H = engine.hvp_operator(X, engine.targets(y), chunk=7).dense(block=4)
    torch.testing.assert_close(H, H_ref, rtol=1e-9, atol=1e-12)
    res = compute_influence(net, X, y, X[:3], y[:3], InfluenceConfig(estimator="exact", damping=0.1))
    ev = np.linalg.eigvalsh(H_ref.numpy())
    assert res.diagnostics["min_eigenvalue"] == pytest.approx(ev[0], abs=1e-10)
    assert res.diagnostics["max_eigenvalue"] == pytest.approx(ev[-1], rel=1e-10)
    assert res.diagnostics["damped_min_eigenvalue"] == pytest.approx(ev[0] + 0.1, abs=1e-10)


# ---------------------------------------------------------------- sign convention
@pytest.mark.parametrize("estimator", ["exact", "last-layer", "cg", "tracin"])
def test_copy_of_the_test_point_is_helpful_for_every_estimator(estimator):
    net, X, y, Xt, yt, tr = _small_net("relu")
    x0, y0 = X[:1], y[:1]  # the test point is training sample 0 itself
    probe = compute_influence(net, X, y, x0, y0, InfluenceConfig(estimator="exact", damping=1e-3))
    damping = max(0.0, -probe.diagnostics["min_eigenvalue"]) + 0.02
    res = compute_influence(
        net,
        X,
        y,
        x0,
        y0,
        InfluenceConfig(estimator=estimator, damping=damping),
        checkpoints=tr.checkpoints,
        checkpoint_weights=tracin_weights(len(tr.checkpoints), 25, tr.steps_run, 1.0),
    )
    assert res.total[0] < 0  # negative = helpful: up-weighting it lowers its own loss
    assert bool(res.helpful[0])


# ---------------------------------------------------------------- tracin
def test_tracin_matches_autograd_loop():
    net, X, y, Xt, yt, tr = _small_net("attn", steps=60)
    weights = tracin_weights(len(tr.checkpoints), 25, tr.steps_run, 1.0)
    assert weights == [25.0, 25.0, 10.0, 0.0]  # steps 0-24, 25-49, 50-59; the final snapshot (step 60) weighs 0
    res = compute_influence(
        net,
        X,
        y,
        Xt,
        yt,
        InfluenceConfig(estimator="tracin", per_test=True),
        checkpoints=tr.checkpoints,
        checkpoint_weights=weights,
    )
    import copy

    from attnaudit.core.training import per_sample_loss

    work = copy.deepcopy(net)
    expected = torch.zeros(len(X), len(Xt), dtype=F64)
    for ckpt, w in zip(tr.checkpoints, weights):
        work.load_state_dict({**work.state_dict(), **ckpt})

        def g(x, t):
            loss = per_sample_loss(work(x[None]), t[None], "mse").sum()
            return torch.cat([v.reshape(-1) for v in torch.autograd.grad(loss, list(work.parameters()))])

        Gtr = torch.stack([g(X[i], y[i]) for i in range(len(X))])
        Gte = torch.stack([g(Xt[i], yt[i]) for i in range(len(Xt))])
        expected -= w * Gtr @ Gte.T
    torch.testing.assert_close(res.per_test, expected, rtol=1e-9, atol=1e-12)
    assert res.damping is None


def test_tracin_weights_edge_cases():
    assert tracin_weights(4, 10, 30, 0.5) == [5.0, 5.0, 5.0, 0.0]
    assert tracin_weights(2, 10, 7, 1.0) == [7.0, 0.0]


# ---------------------------------------------------------------- memory, chunks, refusals
def test_chunks_and_memory_budget_do_not_change_the_answer():
    net, X, y, Xt, yt, _ = _small_net("relu")
    ref = compute_influence(
        net, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=0.05, per_test=True, cg_tol=1e-12)
    )
    small = compute_influence(
        net, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=0.05, per_test=True, cg_tol=1e-12, chunk_size=3)
    )
    P = ref.n_params
    fixed = influence_memory("cg", P, len(X), len(Xt), True, 1)["total"] - P * 8
    mem = ref.diagnostics["memory_estimate_bytes"]
    act = mem["activations"] / min(ref.diagnostics["chunk_size"], len(X))  # measured activation bytes per sample
    assert act > 0  # the generic path measures the model's own activations
    tight_mb = (fixed + 4 * (2 * 8 * P + act)) / 2**20  # leaves room for a chunk of 4 samples
    budget = compute_influence(
        net,
        X,
        y,
        Xt,
        yt,
        InfluenceConfig(estimator="cg", damping=0.05, per_test=True, cg_tol=1e-12, memory_budget_mb=tight_mb),
    )
    assert small.diagnostics["chunk_size"] == 3 and budget.diagnostics["chunk_size"] == 4
    for r in (small, budget):
        torch.testing.assert_close(r.per_test, ref.per_test, rtol=1e-8, atol=1e-11)
    assert ref.diagnostics["memory_estimate_bytes"]["total"] > 0


def test_exact_refuses_above_parameter_budget():
    net, X, y, Xt, yt, _ = _small_net("relu")
    with pytest.raises(AuditError, match="last-layer or cg"):
        compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", max_exact_params=10))


def test_singular_hessian_without_damping_is_refused():
    net, X, y, Xt, yt, _ = _small_net("relu", n=5, m=20)  # 20 features, 5 samples: rank-deficient
    with pytest.raises(AuditError, match="singular"):
        compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="last-layer", damping=0.0))


def test_indefinite_damped_hessian_is_reported():
    net, X, y, Xt, yt, _ = _small_net("relu")
    res = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=1e-6))
    assert res.diagnostics["min_eigenvalue"] < 0  # a trained ReLU net is non-convex here
    assert not res.diagnostics["positive_definite"] and res.diagnostics["n_negative_eigenvalues"] > 0
    assert any("not positive definite" in w for w in res.warnings)


def test_batched_cg_against_numpy_and_negative_curvature():
    rng = np.random.default_rng(0)
    M = rng.normal(size=(30, 30))
    A = torch.from_numpy(M @ M.T + 0.5 * np.eye(30))
    B = torch.from_numpy(rng.normal(size=(3, 30)))
    B[1] = 0.0  # a zero right-hand side is solved by x = 0 at once
    Xs, diag = batched_cg(lambda V: V @ A, B, 1e-12, 200)
    ref = np.linalg.solve(A.numpy(), B.numpy().T).T
    np.testing.assert_allclose(Xs.numpy(), ref, rtol=1e-8, atol=1e-10)
    assert diag["converged"] and not diag["negative_curvature"]
    indefinite = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=F64))
    _, bad = batched_cg(lambda V: V @ indefinite, torch.tensor([[1.0, 1.0, 1.0]], dtype=F64), 1e-10, 10)
    assert bad["negative_curvature"] and not bad["converged"]


def test_damping_sweep_reuses_one_decomposition():
    net, X, y, Xt, yt, _ = _small_net("relu")
    cfg = InfluenceConfig(estimator="last-layer")
    sweep = influence_sweep(net, X, y, Xt, yt, cfg, loss="mse", n_classes=3, dampings=[0.01, 0.1])
    for r, dmp in zip(sweep, [0.01, 0.1]):
        single = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="last-layer", damping=dmp))
        torch.testing.assert_close(r.total, single.total)
        assert r.damping == dmp


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(estimator="newton"),
        dict(damping=-1.0),
        dict(damping=float("nan")),
        dict(cg_tol=0.0),
        dict(estimator="last-layer", params="all"),
        dict(chunk_size=0),
    ],
)
def test_bad_config_rejected(kwargs):
    with pytest.raises(AuditError):
        InfluenceConfig(**kwargs)


# ---------------------------------------------------------------- the core: paths, selectors, any module
@pytest.mark.parametrize("arch,loss", [("relu", "mse"), ("attn", "ce")])
def test_generic_path_equals_fast_path_for_every_estimator(arch, loss):
    net, X, y, Xt, yt, tr = _small_net(arch)
    weights = tracin_weights(len(tr.checkpoints), 25, tr.steps_run, 1.0)
    for est in (
        e for e in ESTIMATORS if e not in ("kfac", "ekfac")
    ):  # K-FAC needs nn.Linear layers: tests/analyses/influence/test_kfac.py
        out = {}
        for fast in (True, False):
            cfg = InfluenceConfig(
                estimator=est, params="head", damping=0.05, per_test=True, cg_tol=1e-13, fast_path=fast
            )
            out[fast] = compute_influence(
                net, X, y, Xt, yt, cfg, loss=loss, checkpoints=tr.checkpoints, checkpoint_weights=weights
            )
        assert out[True].path == PATH_FAST_TWOLAYER_HEAD and out[False].path == PATH_GENERIC, est
        assert out[True].tracked == out[False].tracked == ["a"] and out[True].n_params == 6 * 3
        torch.testing.assert_close(out[True].per_test, out[False].per_test, rtol=1e-8, atol=1e-13)
        torch.testing.assert_close(out[True].total, out[False].total, rtol=1e-8, atol=1e-13)
    # 'all' has no fast path: the generic engine runs
    assert compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact"), loss=loss).path == PATH_GENERIC


def _mlp(dtype=F64, dropout=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layers = [nn.Linear(3, 4), nn.Tanh()] + ([nn.Dropout(0.5)] if dropout else []) + [nn.Linear(4, 2)]
    net = nn.Sequential(*layers).to(dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return net


def _mlp_data(n=30, nt=8):
    X, y = _blobs(n, 3, 2, seed=11)
    Xt, yt = _blobs(nt, 3, 2, seed=12)
    return (torch.from_numpy(v) for v in (X / 2, y, Xt / 2, yt))


def test_head_of_a_sequential_is_its_last_linear_layer_and_last_layer_influence_by_hand():
    net = _mlp()
    X, y, Xt, yt = _mlp_data()
    cfg = InfluenceConfig(estimator="last-layer", damping=0.05, per_test=True)
    assert resolve_tracked(Task(net, 2), cfg, X) == ["2.weight", "2.bias"]  # not the bias alone
    res = compute_influence(net, X, y, Xt, yt, cfg)
    assert res.tracked == ["2.weight", "2.bias"] and res.n_params == 10
    report = res.to_dict()
    assert report["tracked_parameters"] == ["2.weight", "2.bias"] and report["n_params"] == 10
    assert (
        report["diagnostics"]["parameter_selector"] == "head"
        and report["path"] == "fast: nn.Linear head, cached features"
    )
    generic = compute_influence(net, X, y, Xt, yt, dataclasses.replace(cfg, fast_path=False))
    assert generic.path == PATH_GENERIC
    # by hand (numpy): f = h W2^T + b2 with h = tanh(X W1^T + b1); MSE Hessian over (W2, b2) = mean J^T J
    W1, b1, W2, b2 = (t.detach().numpy() for t in net.parameters())

    def jac_and_residual(Xn, yn):
        h = np.tanh(Xn @ W1.T + b1)
        f = h @ W2.T + b2
        J = np.zeros((len(Xn), 2, 10))
        for k in range(2):
            J[:, k, k * 4 : (k + 1) * 4] = h  # d f_k / d W2[k, :] (row-major weight first, then bias)
            J[:, k, 8 + k] = 1.0
        return J, f - np.eye(2)[yn]

    J, r = jac_and_residual(X.numpy(), y.numpy())
    Jt, rt = jac_and_residual(Xt.numpy(), yt.numpy())
    H = np.einsum("nkp,nkq->pq", J, J) / len(X)
    g_train = np.einsum("nkp,nk->np", J, r)
    g_test = np.einsum("nkp,nk->np", Jt, rt)
    expected = -g_train @ np.linalg.solve(H + 0.05 * np.eye(10), g_test.T)
    np.testing.assert_allclose(res.per_test.numpy(), expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(generic.per_test.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_params_last_removed_in_0_2_0_is_refused():
    """params='last' (an older name for 'head') was removed in 0.2.0; it is now a module name that does not exist."""
    with pytest.raises(AuditError, match="last"):
        resolve_tracked(Task(_mlp(), 2), InfluenceConfig(estimator="exact", params="last"))


def test_dropout_model_is_audited_in_eval_mode_and_left_in_training_mode():
    net = _mlp(dropout=True)
    net.train()
    X, y, Xt, yt = _mlp_data()
    cfg = InfluenceConfig(estimator="exact", damping=0.1, per_test=True)
    first = compute_influence(net, X, y, Xt, yt, cfg)
    second = compute_influence(net, X, y, Xt, yt, cfg)
    assert torch.equal(first.per_test, second.per_test)
    assert net.training and all(m.training for m in net.modules())
    # eval mode = dropout is the identity: the same numbers as the net without the dropout layer
    plain = nn.Sequential(net[0], net[1], net[3])
    torch.testing.assert_close(
        first.per_test, compute_influence(plain, X, y, Xt, yt, cfg).per_test, rtol=1e-12, atol=1e-14
    )


def test_float32_module_is_not_modified_by_float64_influence():
    import copy

    net = _mlp(dtype=torch.float32)
    X, y, Xt, yt = _mlp_data()
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}
    flags = [p.requires_grad for p in net.parameters()]
    res = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=0.1, dtype="float64"))
    for k, v in net.state_dict().items():
        assert v.dtype == torch.float32
        assert v.numpy().tobytes() == before[k].numpy().tobytes()
    assert [p.requires_grad for p in net.parameters()] == flags and net.training
    assert res.total.dtype == F64 and res.diagnostics["dtype"] == "float64"
    # float32 values are exact in float64: the same numbers as on a float64 copy
    ref = compute_influence(copy.deepcopy(net).double(), X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=0.1))
    torch.testing.assert_close(res.total, ref.total, rtol=1e-12, atol=1e-14)


def test_train_and_test_rows_must_match():
    net = _mlp()
    X, y, Xt, yt = _mlp_data()
    with pytest.raises(AuditError, match="same data"):
        compute_influence(net, X, y, torch.cat([Xt, Xt], 1), yt, InfluenceConfig(estimator="exact"))


class _TinyAttention(nn.Module):
    """Images (B, 1, 4, 4) as 4 tokens of 4 features; softmax attention with trainable Q/K/V
    through the fused scaled_dot_product_attention, mean-pooled, linear head."""

    def __init__(self, c=3, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.q, self.k, self.v, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, c)
        self.double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.7)

    def forward(self, x):
        t = x[:, 0]
        att = torch.nn.functional.scaled_dot_product_attention(self.q(t), self.k(t), self.v(t))
        return self.head(att.mean(1))


def _attention_reference(theta, names, shapes, X):
    """The same model written out by hand: explicit softmax(Q K^T / 2) V, no SDPA."""
    p, i = {}, 0
    for n, s in zip(names, shapes):
        k = int(np.prod(s))
        p[n] = theta[i : i + k].view(s)
        i += k
    t = X.view(-1, 4, 4)
    Q, K, V = (t @ p[f"{m}.weight"].T + p[f"{m}.bias"] for m in ("q", "k", "v"))
    A = torch.softmax(Q @ K.transpose(1, 2) / 2.0, dim=-1)
    return (A @ V).mean(1) @ p["head.weight"].T + p["head.bias"]


def test_every_estimator_on_an_image_attention_module_against_a_hand_written_reference():
    model = _TinyAttention()
    task = Task(model, 3, "ce", Inputs("images", (1, 4, 4)))
    gen = torch.Generator().manual_seed(5)
    X, Xt = torch.rand(24, 16, generator=gen, dtype=F64), torch.rand(6, 16, generator=gen, dtype=F64)
    y, yt = torch.randint(0, 3, (24,), generator=gen), torch.randint(0, 3, (6,), generator=gen)
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def ce(theta, Xs, ys):  # per-sample cross-entropy of the hand-written model
        return torch.nn.functional.cross_entropy(_attention_reference(theta, names, shapes, Xs), ys, reduction="none")

    H = torch.autograd.functional.hessian(lambda th: ce(th, X, y).mean(), theta0)
    damping = max(0.0, -float(torch.linalg.eigvalsh(H)[0])) + 0.05
    G = torch.stack(
        [torch.func.grad(lambda th: ce(th, X[i : i + 1], y[i : i + 1]).sum())(theta0) for i in range(len(X))]
    )
    g_test = torch.func.grad(lambda th: ce(th, Xt, yt).sum())(theta0)
    expected = -G @ torch.linalg.solve(H + damping * torch.eye(len(theta0), dtype=F64), g_test)

    exact = compute_influence(task, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=damping))
    cg = compute_influence(task, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=damping, cg_tol=1e-12))
    assert exact.n_params == len(theta0) == 75 and exact.path == PATH_GENERIC
    torch.testing.assert_close(exact.total, expected, rtol=1e-8, atol=1e-11)
    torch.testing.assert_close(cg.total, expected, rtol=1e-7, atol=1e-10)
    assert cg.diagnostics["converged"]

    idx = torch.arange(60, 75)  # head.weight (3 x 4) and head.bias (3) come last in theta
    assert names[-2:] == ["head.weight", "head.bias"]
    Hh = H[idx][:, idx]
    expected_head = -G[:, idx] @ torch.linalg.solve(Hh + damping * torch.eye(len(idx), dtype=F64), g_test[idx])
    last = compute_influence(task, X, y, Xt, yt, InfluenceConfig(estimator="last-layer", damping=damping))
    assert last.tracked == ["head.weight", "head.bias"] and last.n_params == 15
    torch.testing.assert_close(last.total, expected_head, rtol=1e-8, atol=1e-11)

    # tracin over two hand-made checkpoints
    ckpts = [{n: p.detach() + 0.1 * j for n, p in model.named_parameters()} for j in (1, 2)]
    tr = compute_influence(
        task, X, y, Xt, yt, InfluenceConfig(estimator="tracin"), checkpoints=ckpts, checkpoint_weights=[0.5, 2.0]
    )
    ref = torch.zeros(len(X), dtype=F64)
    for ck, w in zip(ckpts, [0.5, 2.0]):
        th = torch.cat([ck[n].reshape(-1) for n in names])
        Gc = torch.stack(
            [torch.func.grad(lambda t: ce(t, X[i : i + 1], y[i : i + 1]).sum())(th) for i in range(len(X))]
        )
        ref -= w * Gc @ torch.func.grad(lambda t: ce(t, Xt, yt).sum())(th)
    torch.testing.assert_close(tr.total, ref, rtol=1e-9, atol=1e-12)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), theta0)  # module untouched


# --------------------------------------------------------------------------- nn.Linear head fast path
class _TinyAttentionNet(torch.nn.Module):
    """Tokens from rows, one softmax attention (nn.MultiheadAttention), LayerNorm, mean pool, Linear head."""

    def __init__(self, after=None, tie: bool = False):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Linear(4, 6)
        self.attn = torch.nn.MultiheadAttention(6, 2, batch_first=True)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 3)
        if tie:
            self.extra = torch.nn.Linear(6, 3)
            self.extra.weight = self.head.weight  # the features would depend on the head's weight
        self.after = after

    def forward(self, x):
        t = self.embed(x.reshape(x.shape[0], 4, 4))
        if hasattr(self, "extra"):
            t = t + self.extra(t).sum(-1, keepdim=True)
        h, _ = self.attn(t, t, t, need_weights=False)
        out = self.head(self.norm(t + h).mean(1))
        return out if self.after is None else self.after(out)


def _tiny_data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 16, generator=g, dtype=torch.float64)
    return X, torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("estimator", ["exact", "cg"])
def test_linear_head_fast_path_matches_generic(estimator):
    from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
    from attnaudit.analyses.influence.paths import PATH_FAST_LINEAR_HEAD

    net = _TinyAttentionNet()
    X, y = _tiny_data()
    Xt, yt = _tiny_data(10, seed=1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    results = {}
    for fast in (True, False):
        cfg = InfluenceConfig(estimator=estimator, params="head", damping=1e-2, fast_path=fast, per_test=True)
        results[fast] = compute_influence(net, X, y, Xt, yt, cfg, loss="ce", n_classes=3)
    assert results[True].path == PATH_FAST_LINEAR_HEAD and results[False].path == PATH_GENERIC
    torch.testing.assert_close(results[True].total, results[False].total, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(results[True].per_test, results[False].per_test, rtol=1e-8, atol=1e-12)
    assert results[True].tracked == ["head.weight", "head.bias"]
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k  # the user's module is untouched


@pytest.mark.parametrize("variant", ["softmax after the head", "tied weights", "not only the head"])
def test_linear_head_fast_path_declines(variant):
    from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence

    X, y = _tiny_data()
    Xt, yt = _tiny_data(6, seed=2)
    net = (
        _TinyAttentionNet(after=torch.nn.Softmax(-1))
        if variant == "softmax after the head"
        else _TinyAttentionNet(tie=variant == "tied weights")
    )
    params = "head.*,norm.*" if variant == "not only the head" else "head"
    res = compute_influence(
        net, X, y, Xt, yt, InfluenceConfig(estimator="exact", params=params), loss="ce", n_classes=3
    )
    assert res.path == PATH_GENERIC


# ---------------------------------------------------------------- solvers: Cholesky vs eigendecomposition
def test_negative_eigenvalue_count_by_inertia_matches_numpy():
    from attnaudit.analyses.influence.influence import count_negative_eigenvalues

    gen = np.random.default_rng(7)
    for P, n_neg in ((1, 1), (5, 0), (40, 13), (120, 60), (200, 199)):
        Q, _ = np.linalg.qr(gen.standard_normal((P, P)))
        ev = np.concatenate([-gen.uniform(0.01, 3.0, n_neg), gen.uniform(0.01, 3.0, P - n_neg)])
        H = torch.from_numpy((Q * ev) @ Q.T)
        H = 0.5 * (H + H.T)
        assert count_negative_eigenvalues(H) == int((np.linalg.eigvalsh(H.numpy()) < 0).sum()) == n_neg
    # a shift moves the threshold: eigenvalues below -shift only
    H = torch.diag(torch.tensor([-2.0, -0.5, 0.1, 1.0], dtype=F64))
    assert count_negative_eigenvalues(H, shift=1.0) == 1


@pytest.mark.parametrize("P, method", [(300, "eigvalsh"), (1100, "lanczos")])
def test_extreme_eigenvalues_of_a_hessian_with_a_cluster_near_zero(P, method):
    """The two ends of a spectrum like a cross-entropy Hessian's (a few large eigenvalues, the
    rest clustered within 1e-4 of 0, some negative), by the dense path and, above 1,024
    parameters, by Lanczos: numpy's eigvalsh's ends to 1e-9 of the largest."""
    from attnaudit.analyses.influence.estimators.exact import _extreme_eigenvalues

    gen = np.random.default_rng(P)
    Q, _ = np.linalg.qr(gen.standard_normal((P, P)))
    ev = np.concatenate([gen.uniform(1.0, 10.0, 12), [-0.3], 1e-4 * gen.standard_normal(P - 13)])
    H = 0.5 * ((Q * ev) @ Q.T + ((Q * ev) @ Q.T).T)
    lo, hi, used = _extreme_eigenvalues(torch.from_numpy(H))
    ref = np.linalg.eigvalsh(H)
    assert used == method
    assert lo == pytest.approx(ref[0], abs=1e-9 * ref[-1]) and hi == pytest.approx(ref[-1], rel=1e-9)


def test_cholesky_and_eigh_solvers_agree_on_a_positive_definite_system():
    net, X, y, Xt, yt, _ = _small_net("relu")
    probe = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=1e-3, solver="eigh"))
    damping = max(0.0, -probe.diagnostics["min_eigenvalue"]) + 0.02
    runs = {
        s: compute_influence(
            net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=damping, per_test=True, solver=s)
        )
        for s in ("cholesky", "eigh", "auto")
    }
    assert runs["cholesky"].diagnostics["solver"] == runs["auto"].diagnostics["solver"] == "cholesky"
    assert runs["eigh"].diagnostics["solver"] == "eigh"
    torch.testing.assert_close(runs["cholesky"].per_test, runs["eigh"].per_test, rtol=1e-10, atol=1e-13)
    # the Cholesky path's diagnostics against numpy's eigenvalues of the same dense Hessian
    engine = Engine(Task(net, 3, "mse"), dtype=F64)
    ev = np.linalg.eigvalsh(engine.hvp_operator(X, engine.targets(y)).dense().numpy())
    d = runs["cholesky"].diagnostics
    assert d["min_eigenvalue"] == pytest.approx(ev[0], abs=1e-10)
    assert d["max_eigenvalue"] == pytest.approx(ev[-1], rel=1e-10)
    assert d["positive_definite"] is True
    tol = len(ev) * np.finfo(float).eps * max(abs(ev[0]), abs(ev[-1]))
    assert d["n_negative_eigenvalues"] == int((ev < -tol).sum()) == runs["eigh"].diagnostics["n_negative_eigenvalues"]
    assert d["damped_condition_number"] == pytest.approx((ev[-1] + damping) / (ev[0] + damping), rel=1e-8)


def test_indefinite_system_falls_back_to_eigh_and_a_sweep_uses_eigh():
    net, X, y, Xt, yt, _ = _small_net("relu")
    res = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=1e-6))
    assert res.diagnostics["min_eigenvalue"] < -1e-6  # the trained ReLU net is non-convex here
    assert res.diagnostics["solver"].startswith("eigh") and "not positive definite" in res.diagnostics["solver"]
    assert not res.diagnostics["positive_definite"]
    sweep = influence_sweep(net, X, y, Xt, yt, InfluenceConfig(estimator="exact"), dampings=[0.05, 0.1])
    assert [r.diagnostics["solver"] for r in sweep] == ["eigh", "eigh"]
    single = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=0.1))
    torch.testing.assert_close(single.total, sweep[1].total, rtol=1e-10, atol=1e-13)


def test_unknown_solver_is_refused():
    with pytest.raises(AuditError, match="solver"):
        InfluenceConfig(estimator="exact", solver="lu")
