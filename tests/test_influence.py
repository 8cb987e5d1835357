"""Influence estimators against independent ground truth.

Ground truths used here: leave-one-out retraining to tight convergence with our own numpy
Newton / closed-form solvers (not the code under test), torch.autograd.functional.hessian,
numpy eigenvalues and plain autograd loops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from attnaudit.errors import AuditError
from attnaudit.influence import (
    InfluenceConfig,
    batched_cg,
    compute_influence,
    dense_hessian,
    influence_memory,
    influence_sweep,
    make_task,
    tracin_weights,
)
from attnaudit.models import ModelSpec, build_model
from attnaudit.training import TrainConfig, train

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
        model, torch.from_numpy(X), torch.from_numpy(y), torch.from_numpy(Xt), torch.from_numpy(yt),
        InfluenceConfig(estimator=estimator, damping=lam, cg_tol=1e-12), loss="ce",
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
        net, Xtr_t, torch.from_numpy(y), torch.from_numpy(Xt), torch.from_numpy(yt),
        InfluenceConfig(estimator="last-layer", damping=lam), loss=loss,
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
        est: compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator=est, damping=0.01, per_test=True, cg_tol=1e-12), loss="ce")
        for est in ("exact", "last-layer", "cg")
    }
    for est in ("last-layer", "cg"):
        torch.testing.assert_close(out[est].per_test, out["exact"].per_test, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(out[est].total, out["exact"].total, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(out["exact"].per_test.sum(1), out["exact"].total)


def test_feature_cached_last_layer_equals_generic_path():
    net, X, y, Xt, yt, _ = _small_net("attn")
    cached = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="last-layer", damping=0.01))
    assert "cached" in cached.diagnostics["task"]
    net.W.requires_grad_(False)  # now 'all' trainable parameters = the output layer

    class Wrapped(nn.Module):  # hides the TwoLayerNet type, so the generic functional_call path runs
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    generic = compute_influence(Wrapped(net), X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=0.01))
    assert generic.tracked == ["inner.a"]
    assert "functional_call" in generic.diagnostics["task"]
    torch.testing.assert_close(cached.total, generic.total, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("arch", ["relu", "attn"])
def test_cg_converges_to_exact_on_small_network(arch):
    net, X, y, Xt, yt, _ = _small_net(arch)
    probe = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=0.0 + 1e-3))
    damping = max(0.0, -probe.diagnostics["min_eigenvalue"]) + 0.02  # positive definite by construction
    ex = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="exact", damping=damping, per_test=True))
    cg = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=damping, per_test=True, cg_tol=1e-10))
    assert cg.diagnostics["converged"] and cg.diagnostics["relative_residual_max"] <= 1e-9
    assert cg.diagnostics["iterations"] <= cg.n_params
    torch.testing.assert_close(cg.per_test, ex.per_test, rtol=1e-6, atol=1e-9)


def test_dense_hessian_and_eigenvalues_match_autograd():
    net, X, y, *_ = _small_net("relu", m=5)
    task = make_task(net, "mse", 3, "all")
    d, m = net.spec.d_in, net.spec.width
    Y = torch.nn.functional.one_hot(y, 3).double()

    def loss_flat(theta):  # the model written out by hand
        W = theta[: m * d].view(m, d)
        a = theta[m * d :].view(m, 3)
        f = torch.relu(X @ W.T / d**0.5) @ a / m**0.5
        return 0.5 * ((f - Y) ** 2).sum(1).mean()

    H_ref = torch.autograd.functional.hessian(loss_flat, task.theta.clone())
    H = dense_hessian(task, task.prepare(X), task.targets(y), chunk=7, hvp_batch=4)
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
        net, X, y, x0, y0, InfluenceConfig(estimator=estimator, damping=damping), checkpoints=tr.checkpoints,
        checkpoint_weights=tracin_weights(len(tr.checkpoints), 25, tr.steps_run, 1.0),
    )
    assert res.total[0] < 0  # negative = helpful: up-weighting it lowers its own loss
    assert bool(res.helpful[0])


# ---------------------------------------------------------------- tracin
def test_tracin_matches_autograd_loop():
    net, X, y, Xt, yt, tr = _small_net("attn", steps=60)
    weights = tracin_weights(len(tr.checkpoints), 25, tr.steps_run, 1.0)
    assert weights == [25.0, 25.0, 10.0, 0.0]  # steps 0-24, 25-49, 50-59; the final snapshot (step 60) weighs 0
    res = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="tracin", per_test=True), checkpoints=tr.checkpoints, checkpoint_weights=weights)
    import copy

    from attnaudit.training import per_sample_loss

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
    ref = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=0.05, per_test=True, cg_tol=1e-12))
    small = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=0.05, per_test=True, cg_tol=1e-12, chunk_size=3))
    P = ref.n_params
    fixed = influence_memory("cg", P, len(X), len(Xt), True, 1)["total"] - P * 8
    tight_mb = (fixed + 4 * 2 * 8 * P) / 2**20  # leaves room for a chunk of 4 samples
    budget = compute_influence(net, X, y, Xt, yt, InfluenceConfig(estimator="cg", damping=0.05, per_test=True, cg_tol=1e-12, memory_budget_mb=tight_mb))
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
    [dict(estimator="newton"), dict(damping=-1.0), dict(damping=float("nan")), dict(cg_tol=0.0), dict(estimator="last-layer", params="all"), dict(chunk_size=0)],
)
def test_bad_config_rejected(kwargs):
    with pytest.raises(AuditError):
        InfluenceConfig(**kwargs)
