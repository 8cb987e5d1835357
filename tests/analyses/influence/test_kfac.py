"""K-FAC / EK-FAC influence (attnaudit.analyses.influence.kfac) against independent references.

* The factors and the EK-FAC eigenvalues against the Gauss-Newton block built explicitly
  from per-sample Jacobians and the loss's output Hessian (torch.func.jacrev, written out
  here, not the module's code).
* A single linear layer under MSE, where K-FAC is exact: both estimators equal exact
  influence to round-off.
* A small MLP and a small ViT: correlation with exact influence (the values measured when
  this was written, asserted with margin).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from torch import nn

from attnaudit.core import Engine, as_task
from attnaudit.core.task import Task
from attnaudit.errors import AuditError
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.analyses.influence.kfac import fit_factors
from attnaudit.core.training import TrainConfig, train

F64 = torch.float64


def _digits(n_train=240, n_test=40):
    from attnaudit.data import DataSpec, load_dataset

    tr = load_dataset(DataSpec(dataset="digits", split="train", n=n_train))
    te = load_dataset(DataSpec(dataset="digits", split="test", n=n_test))
    return tr.X.to(F64), tr.y, te.X.to(F64), te.y


def _ggn_block(model, X, y, loss, params):
    """(1/n) sum_i J_i^T H_i J_i over the named parameters: per-sample Jacobians of the logits
    by torch.func.jacrev and the loss's output Hessian by torch.func.hessian."""
    named = dict(model.named_parameters())
    frozen = {k: v.detach() for k, v in named.items()}

    def logits(theta, x):
        state = dict(frozen)
        start = 0
        for name in params:
            k = named[name].numel()
            state[name] = theta[start : start + k].view_as(named[name])
            start += k
        return torch.func.functional_call(model, state, (x[None],))[0]

    theta = torch.cat([named[n].detach().reshape(-1) for n in params])
    c = model(X[:1]).shape[1]
    G = torch.zeros(theta.numel(), theta.numel(), dtype=F64)
    for x, label in zip(X, y):
        J = torch.func.jacrev(logits)(theta, x)  # (c, P)
        f = logits(theta, x).detach()
        onehot = torch.nn.functional.one_hot(label, c).to(F64)
        if loss == "mse":
            H = torch.func.hessian(lambda z: 0.5 * ((z - onehot) ** 2).sum())(f)
        else:
            H = torch.func.hessian(lambda z: torch.logsumexp(z, 0) - (z * onehot).sum())(f)
        G += J.T @ H @ J
    return G / X.shape[0]


def test_factors_of_the_output_layer_under_mse_equal_its_gauss_newton_block():
    X, y, _, _ = _digits(60, 5)
    model = nn.Sequential(nn.Linear(64, 6, bias=False), nn.Tanh(), nn.Linear(6, 10, bias=False)).to(F64)
    eng = Engine(Task(model, 10, "mse"), dtype=F64)
    f = fit_factors(eng, X, "kfac")
    last = next(b for b in f.blocks if b.path == "2")
    assert torch.allclose(last.S, torch.eye(10, dtype=F64), atol=1e-14)  # MSE: output Hessian I
    G = _ggn_block(model, X, y, "mse", ["2.weight"])
    torch.testing.assert_close(torch.kron(last.S, last.A), G, rtol=1e-10, atol=1e-13)


def test_factors_of_a_hidden_layer_equal_the_gauss_newton_block_for_one_sample():
    X, y, _, _ = _digits(1, 1)
    model = nn.Sequential(nn.Linear(64, 5, bias=False), nn.Tanh(), nn.Linear(5, 10, bias=False)).to(F64)
    eng = Engine(Task(model, 10, "ce"), dtype=F64)
    f = fit_factors(eng, X, "kfac")
    first = next(b for b in f.blocks if b.path == "0")
    G = _ggn_block(model, X, y, "ce", ["0.weight"])
    torch.testing.assert_close(torch.kron(first.S, first.A), G, rtol=1e-9, atol=1e-12)


def test_ekfac_eigenvalues_are_the_diagonal_of_the_rotated_gauss_newton_block():
    X, y, _, _ = _digits(50, 5)
    model = nn.Sequential(nn.Linear(64, 5, bias=False), nn.Tanh(), nn.Linear(5, 10, bias=False)).to(F64)
    eng = Engine(Task(model, 10, "ce"), dtype=F64)
    f = fit_factors(eng, X, "ekfac")
    for b in f.blocks:
        torch.testing.assert_close(b.corrected, _rotated_ggn_diagonal(model, X, y, b), rtol=1e-9, atol=1e-13)


def test_a_float32_engine_fits_factors_by_float32_products_summed_in_float64(monkeypatch):
    """The precision policy's float32 engine: the covariance and eigenvalue-correction products
    run at float32 (their sums float64); the truth is the float64 Gauss-Newton block's rotated
    diagonal, written out by jacrev here, which the float32 fit matches to float32 rounding."""
    from attnaudit.analyses.influence import kfac

    X, y, _, _ = _digits(50, 5)
    model = nn.Sequential(nn.Linear(64, 5, bias=False), nn.Tanh(), nn.Linear(5, 10, bias=False)).to(F64)
    seen: list[torch.dtype] = []
    real_gram, real_squares = kfac._add_gram, kfac._add_squared_rotated
    monkeypatch.setattr(kfac, "_add_gram", lambda out, rows: seen.append(rows.dtype) or real_gram(out, rows))
    monkeypatch.setattr(kfac, "_add_squared_rotated", lambda out, u, v: seen.append(u.dtype) or real_squares(out, u, v))
    f32 = fit_factors(Engine(Task(model, 10, "ce"), dtype=torch.float32), X.float(), "ekfac")
    assert seen and set(seen) == {torch.float32}
    for b in f32.blocks:
        assert b.corrected.dtype == F64 and b.A.dtype == F64
        truth = _rotated_ggn_diagonal(model, X, y, b)  # in the float32 fit's own eigenbasis
        torch.testing.assert_close(b.corrected, truth, rtol=1e-4, atol=1e-6 * float(truth.abs().max()))


@pytest.mark.parametrize("estimator", ["kfac", "ekfac"])
def test_a_single_linear_layer_under_mse_gives_exact_influence(estimator):
    X, y, Xt, yt = _digits(200, 20)
    torch.manual_seed(0)
    model = nn.Linear(64, 10).to(F64)
    train(model, X, y, TrainConfig(loss="mse", lr=0.5, steps=100))
    cfg = dict(damping=0.01, per_test=True)
    exact = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="exact", **cfg), loss="mse")
    kron = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator=estimator, **cfg), loss="mse")
    torch.testing.assert_close(kron.per_test, exact.per_test, rtol=1e-9, atol=1e-12)
    assert kron.diagnostics["solver"] == estimator and kron.diagnostics["layers"] == [""]
    assert not kron.warnings


def test_mlp_scores_correlate_with_exact_and_ekfac_keeps_up_with_kfac():
    """Measured (digits, 240 x 40, tanh MLP 64-24-10, cross-entropy, damping 0.1): Pearson
    0.95 / 0.95, Spearman 0.86 / 0.86 for K-FAC / EK-FAC against exact influence."""
    X, y, Xt, yt = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 24), nn.Tanh(), nn.Linear(24, 10)).to(F64)
    train(model, X, y, TrainConfig(loss="ce", lr=0.5, steps=300))
    cfg = dict(damping=0.1, per_test=True)
    exact = compute_influence(
        model, X, y, Xt, yt, InfluenceConfig(estimator="exact", **cfg), loss="ce"
    ).per_test.flatten()
    scores = {}
    for est in ("kfac", "ekfac"):
        r = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator=est, **cfg), loss="ce").per_test.flatten()
        scores[est] = (pearsonr(r, exact)[0], spearmanr(r, exact)[0])
    for p, s in scores.values():
        assert p > 0.9 and s > 0.75, scores
    assert scores["ekfac"][0] >= scores["kfac"][0] - 0.02, scores


def test_vit_tokens_are_covered_and_parameters_outside_linear_layers_are_named():
    from attnaudit.models.vit import ViT, ViTSpec

    gen = torch.Generator().manual_seed(0)
    X = torch.rand(48, 64, generator=gen, dtype=F64)
    y = torch.randint(0, 3, (48,), generator=gen)
    model = ViT(ViTSpec("vit", (1, 8, 8), 3, depth=1, dim=8, heads=2, patch=4, mlp_ratio=2), dtype=F64)
    task = Task(model, 3, "ce", model.audit_inputs())
    train_cfg = dict(damping=0.05, per_test=True)
    res = compute_influence(task, X[:40], y[:40], X[40:], y[40:], InfluenceConfig(estimator="ekfac", **train_cfg))
    layers = res.diagnostics["layers"]
    assert "head" in layers and any(".attn." in p or ".mlp." in p for p in layers)
    assert "pos_embed" in res.diagnostics["excluded_parameters"] and res.warnings
    assert torch.isfinite(res.per_test).all()
    # scores against exact influence over the same (linear-layer) parameters
    names = [n for n in dict(model.named_parameters()) if n not in res.diagnostics["excluded_parameters"]]
    exact = compute_influence(
        task, X[:40], y[:40], X[40:], y[40:], InfluenceConfig(estimator="exact", params=tuple(names), **train_cfg)
    )
    p = pearsonr(res.per_test.flatten(), exact.per_test.flatten())[0]
    assert p > 0.5, p


def _rotated_ggn_diagonal(model, X, y, block):
    """diag(Q^T G Q) as (d_out, d_in [+ 1]) for the block's explicit Gauss-Newton matrix G
    (cross-entropy) and Q = Q_S (x) Q_A: what EK-FAC's eigenvalues must equal. G is built over
    vec(W) then the bias; the factors order (d_out, d_in + 1) row-major, bias last."""
    G = _ggn_block(model, X, y, "ce", [block.weight] + ([block.bias] if block.bias else []))
    width = block.d_in + (1 if block.bias else 0)
    order = [
        o * block.d_in + i if i < block.d_in else block.d_out * block.d_in + o
        for o in range(block.d_out)
        for i in range(width)
    ]
    G = G[order][:, order]
    Q = torch.kron(block.QS, block.QA)
    return torch.diagonal(Q.T @ G @ Q).reshape(block.d_out, width)


class _Tokens(nn.Module):
    """4 tokens of width 8 through torch's nn.MultiheadAttention, mean-pooled to 3 logits."""

    def __init__(self, bias=True, batch_first=True, masked=False, **mha):
        super().__init__()
        self.batch_first, self.masked = batch_first, masked
        self.embed = nn.Linear(4, 8, dtype=F64)
        self.mha = nn.MultiheadAttention(8, 2, bias=bias, batch_first=batch_first, dtype=F64, **mha)
        self.head = nn.Linear(8, 3, dtype=F64)

    def forward(self, x):
        h = torch.tanh(self.embed(x.reshape(x.shape[0], 4, 4)))
        if not self.batch_first:
            h = h.transpose(0, 1)
        masks = {}
        if self.masked:  # causal, and the last key padded in samples whose first feature is positive
            masks["attn_mask"] = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
            none = torch.zeros_like(x[:, 0], dtype=torch.bool)
            masks["key_padding_mask"] = torch.stack([none, none, none, x[:, 0] > 0], 1)  # out of place: vmap-safe
        h, _ = self.mha(h, h, h, **masks)  # need_weights left at its default (True)
        return self.head(h.mean(0 if not self.batch_first else 1))


def _token_data(n=36):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=gen, dtype=F64), torch.randint(0, 3, (n,), generator=gen)


@pytest.mark.parametrize("batch_first,masked", [(True, False), (False, True)])
def test_multihead_attention_projections_get_ekfac_eigenvalues_of_their_gauss_newton_blocks(batch_first, masked):
    """nn.MultiheadAttention applies in_proj and out_proj inside its functional forward, where
    hooks cannot see them; the factors must still be those of the explicit Gauss-Newton block:
    EK-FAC's eigenvalues are exactly its diagonal in the Kronecker eigenbasis (any number of
    tokens), with the bias as the last input column."""
    X, y = _token_data(12)
    torch.manual_seed(0)
    model = _Tokens(batch_first=batch_first, masked=masked).eval()
    eng = Engine(Task(model, 3, "ce"), dtype=F64)
    f = fit_factors(eng, X, "ekfac")
    assert [b.path for b in f.blocks] == ["embed", "mha.in_proj", "mha.out_proj", "head"] and not f.excluded
    for b in f.blocks[1:3]:
        torch.testing.assert_close(b.corrected, _rotated_ggn_diagonal(model, X, y, b), rtol=1e-9, atol=1e-13)
        assert float(b.corrected.abs().max()) > 1e-6  # the hooks saw the layer: not an empty block


def test_multihead_attention_factors_track_exact_influence_and_unsupported_forms_are_excluded():
    X, y = _token_data()
    torch.manual_seed(0)
    model = _Tokens().eval()
    cfg = dict(damping=0.1, per_test=True)
    task = Task(model, 3, "ce")
    res = compute_influence(task, X[:30], y[:30], X[30:], y[30:], InfluenceConfig(estimator="ekfac", **cfg))
    assert "mha.in_proj" in res.diagnostics["layers"] and not res.diagnostics["excluded_parameters"]
    exact = compute_influence(task, X[:30], y[:30], X[30:], y[30:], InfluenceConfig(estimator="exact", **cfg))
    assert pearsonr(res.per_test.flatten(), exact.per_test.flatten())[0] > 0.5
    # extra key/value biases change the computation: listed as excluded, with a warning
    model = _Tokens(add_bias_kv=True).eval()
    res = compute_influence(
        Task(model, 3, "ce"), X[:30], y[:30], X[30:], y[30:], InfluenceConfig(estimator="kfac", **cfg)
    )
    assert res.diagnostics["layers"] == ["embed", "head"] and res.warnings
    assert {"mha.in_proj_weight", "mha.out_proj.weight", "mha.bias_k"} <= set(res.diagnostics["excluded_parameters"])


def test_multihead_attention_used_as_cross_attention_is_refused_with_the_fix():
    class Cross(_Tokens):
        def forward(self, x):
            h = torch.tanh(self.embed(x.reshape(x.shape[0], 4, 4)))
            h, _ = self.mha(h, h * 2, h * 2)
            return self.head(h.mean(1))

    X, _ = _token_data(8)
    with pytest.raises(AuditError, match="self-attention.*params"):
        fit_factors(Engine(Task(Cross().eval(), 3, "ce"), dtype=F64), X, "kfac")


class _Convs(nn.Module):
    """A patch embedding (stride = kernel) and an overlapping padded convolution on 1x8x8
    images, then a linear head."""

    def __init__(self, padding=1):
        super().__init__()
        self.patch = nn.Conv2d(1, 3, 4, stride=4, dtype=F64)
        self.conv = nn.Conv2d(3, 2, 3, padding=padding, bias=False, dtype=F64)
        self.head = nn.Linear(2 * 2 * 2, 3, dtype=F64)

    def forward(self, x):
        h = torch.tanh(self.patch(x.reshape(-1, 1, 8, 8)))
        return self.head(torch.tanh(self.conv(h)).flatten(1))


@pytest.mark.parametrize("padding", [1, "same"])
def test_conv2d_factors_give_ekfac_eigenvalues_of_the_gauss_newton_block(padding):
    """A convolution is a linear layer on its unfolded patches, its output positions the
    tokens: EK-FAC's eigenvalues must be the diagonal of the explicit Gauss-Newton block in the
    Kronecker eigenbasis, and the K-FAC factors those of the patches (A) and of the
    per-position output gradients (S)."""
    X, y = _token_data(10)
    X = X.repeat(1, 4)  # 64 features = 1 x 8 x 8
    torch.manual_seed(0)
    model = _Convs(padding).eval()
    f = fit_factors(Engine(Task(model, 3, "ce"), dtype=F64), X, "ekfac")
    assert [b.path for b in f.blocks] == ["patch", "conv", "head"] and not f.excluded
    for b in f.blocks[:2]:
        torch.testing.assert_close(b.corrected, _rotated_ggn_diagonal(model, X, y, b), rtol=1e-9, atol=1e-13)
    # the patch embedding's A from its 4x4 patches, cut out by hand
    patches = X.reshape(10, 8, 8).unfold(1, 4, 4).unfold(2, 4, 4).reshape(10 * 4, 16)
    patches = torch.cat([patches, torch.ones(40, 1, dtype=F64)], 1)
    torch.testing.assert_close(f.blocks[0].A, patches.T @ patches / 40, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "options", [dict(padding="same"), dict(padding="valid", stride=2), dict(padding=(1, 2), stride=(2, 1), dilation=2)]
)
def test_conv_patches_times_the_weight_reproduce_the_convolution(options):
    """The unfolded patches are the convolution's linear-layer inputs: patches @ W^T + b must
    be torch's own conv output (an even kernel under "same" pads one more on the right)."""
    from attnaudit.analyses.influence.kfac import _conv_patches

    conv = nn.Conv2d(2, 3, (2, 4), dtype=F64, **options)
    x = torch.randn(2, 2, 7, 9, generator=torch.Generator().manual_seed(3), dtype=F64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "same" with an even kernel copies the input
        y = conv(x)
        out = _conv_patches(conv, x) @ conv.weight.reshape(3, -1).T + conv.bias
    torch.testing.assert_close(out.transpose(1, 2).reshape(y.shape), y, rtol=1e-13, atol=1e-13)


def test_exact_gauss_newton_influence_matches_an_independent_solve():
    """--estimator exact --curvature ggn: -grad l(test)^T (G + lambda I)^-1 grad l(train) with G
    the Gauss-Newton block built here from jacrev Jacobians and torch.func output Hessians, and
    the gradients from torch.func.grad, solved with numpy."""
    X, y = _token_data(30)
    torch.manual_seed(0)
    model = _Tokens(masked=True).eval()
    names = [n for n, _ in model.named_parameters()]
    res = compute_influence(
        Task(model, 3, "ce"),
        X[:24],
        y[:24],
        X[24:],
        y[24:],
        InfluenceConfig(estimator="exact", curvature="ggn", damping=0.05, per_test=True),
    )
    assert res.diagnostics["curvature"] == "ggn"
    G = _ggn_block(model, X[:24], y[:24], "ce", names).numpy()
    named = dict(model.named_parameters())

    def loss_grad(x, t):
        def loss(params):
            out = torch.func.functional_call(model, params, (x[None],))
            return torch.nn.functional.cross_entropy(out, t[None])

        g = torch.func.grad(loss)({k: v.detach() for k, v in named.items()})
        return torch.cat([g[n].reshape(-1) for n in names]).numpy()

    g_tr = np.stack([loss_grad(X[i], y[i]) for i in range(24)])
    g_te = np.stack([loss_grad(X[i], y[i]) for i in range(24, 30)])
    expected = -(g_tr @ np.linalg.solve(G + 0.05 * np.eye(G.shape[0]), g_te.T))  # (n_train, n_test)
    np.testing.assert_allclose(res.per_test.numpy(), expected, rtol=1e-8, atol=1e-12 * np.abs(expected).max())


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_gauss_newton_equals_the_hessian_for_the_head_where_logits_are_linear(loss):
    """Logits are linear in the head's weights, so there the Gauss-Newton matrix is the
    Hessian: the two exact paths (Jacobians vs Hessian-vector products, through the built-in
    net's cached-feature fast path) must give the same influence."""
    from attnaudit.models.builtin import ModelSpec, TwoLayerNet

    X, y, Xt, yt = _digits(80, 10)
    model = TwoLayerNet(ModelSpec("relu", 64, 16, 10))
    cfg = dict(estimator="last-layer", damping=1e-3, per_test=True)
    hess = compute_influence(model, X, y, Xt, yt, InfluenceConfig(**cfg), loss=loss)
    ggn = compute_influence(model, X, y, Xt, yt, InfluenceConfig(curvature="ggn", **cfg), loss=loss)
    assert hess.diagnostics["curvature"] == "hessian" and ggn.diagnostics["curvature"] == "ggn"
    torch.testing.assert_close(ggn.per_test, hess.per_test, rtol=1e-8, atol=1e-10 * float(hess.per_test.abs().max()))


def test_ekfac_tracks_the_gauss_newton_influence_it_approximates():
    """On a token model the Kronecker approximation is judged against exact Gauss-Newton
    influence (what it approximates); exact Hessian influence differs from both through the
    Hessian's indefinite part. Measured (this model, damping 0.05): Pearson against exact GGN
    influence 0.88 (EK-FAC), 0.77 (K-FAC), 0.81 (exact Hessian influence)."""
    X, y = _token_data(60)
    torch.manual_seed(0)
    model = _Tokens().eval()
    train(model, X[:48], y[:48], TrainConfig(loss="ce", lr=0.2, steps=60))
    task = Task(model, 3, "ce")
    run = {}
    for name, kw in {
        "ekfac": dict(estimator="ekfac"),
        "kfac": dict(estimator="kfac"),
        "ggn": dict(estimator="exact", curvature="ggn"),
        "hessian": dict(estimator="exact"),
    }.items():
        run[name] = compute_influence(
            task, X[:48], y[:48], X[48:], y[48:], InfluenceConfig(damping=0.05, per_test=True, **kw)
        ).per_test.flatten()
    r = {k: pearsonr(run[k], run["ggn"])[0] for k in ("ekfac", "kfac", "hessian")}
    assert r["ekfac"] > 0.75 and r["kfac"] > 0.65 and r["ekfac"] > r["kfac"], r


@pytest.mark.parametrize(
    "estimator,curvature,match",
    [
        ("exact", "fisher", "exact takes the Hessian .auto. or the exact Gauss-Newton"),
        ("cg", "ggn", "not cg"),
        ("projected", "fisher", "projected takes"),
        ("kfac", "galerkin", "curvature galerkin is for estimator projected"),
    ],
)
def test_a_curvature_the_estimator_does_not_use_is_refused(estimator, curvature, match):
    with pytest.raises(AuditError, match=match):
        InfluenceConfig(estimator=estimator, curvature=curvature)


def test_a_layer_applied_twice_per_forward_is_refused_not_half_counted():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.Linear(6, 6, dtype=F64)
            self.head = nn.Linear(6, 3, dtype=F64)

        def forward(self, x):
            return self.head(torch.tanh(self.mix(torch.tanh(self.mix(x)))))

    X, _ = _token_data(8)
    with pytest.raises(AuditError, match="'mix' runs more than once.*params"):
        fit_factors(Engine(Task(Twice().eval(), 3, "ce"), dtype=F64), X[:, :6], "kfac")


def test_no_linear_layer_is_refused_with_the_alternatives():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3, dtype=F64))

        def forward(self, x):
            return x @ self.w

    X = torch.randn(10, 4, dtype=F64)
    y = torch.randint(0, 3, (10,))
    with pytest.raises(AuditError, match="nn.Linear"):
        compute_influence(Bare(), X, y, X[:2], y[:2], InfluenceConfig(estimator="kfac"), loss="ce")


def test_relative_damping_is_a_multiple_of_each_layers_mean_eigenvalue():
    X, y, Xt, yt = _digits(100, 10)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).to(F64)
    res = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="ekfac", damping="0.1x"), loss="ce")
    eng = Engine(as_task(model, loss="ce", n_classes=10), dtype=F64)
    f = fit_factors(eng, X, "ekfac")
    for b in f.blocks:
        assert res.diagnostics["damping_per_layer"][b.path] == pytest.approx(0.1 * float(b.corrected.mean()), rel=1e-12)
    assert np.isfinite(res.total.numpy()).all()


def test_sampled_fisher_factors_average_to_the_exact_gauss_newton_factors():
    X, y, _, _ = _digits(80, 5)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).to(F64)
    eng = Engine(Task(model, 10, "ce"), dtype=F64)
    exact = fit_factors(eng, X, "kfac", curvature="ggn")
    draws = [fit_factors(eng, X, "kfac", curvature="fisher", seed=s) for s in range(40)]
    assert draws[0].diagnostics["curvature"] == "fisher" and exact.diagnostics["curvature"] == "ggn"
    for i, b in enumerate(exact.blocks):
        mean_S = torch.stack([d.blocks[i].S for d in draws]).mean(0)
        assert float((mean_S - b.S).norm() / b.S.norm()) < 0.1  # Monte-Carlo error of 40 x 80 draws
        torch.testing.assert_close(draws[0].blocks[i].A, b.A)  # A does not depend on the labels
    again = fit_factors(eng, X, "kfac", curvature="fisher", seed=0)
    torch.testing.assert_close(again.blocks[0].S, draws[0].blocks[0].S, rtol=0, atol=0)  # seeded
    with pytest.raises(AuditError, match="curvature"):
        InfluenceConfig(estimator="ekfac", curvature="true")


# ---------------------------------------------------------------- projected (random sign projection)
def test_sign_projection_is_seeded_blockwise_and_applies_the_full_matrix():
    from attnaudit.analyses.influence.projection import SignProjection

    proj = SignProjection(300, 100, seed=3, block=32)
    R = torch.cat([proj.columns(j0, j1) for j0, j1 in proj.blocks()], 1)
    assert R.shape == (300, 100)
    assert set(torch.unique(R * 10).tolist()) == {-1.0, 1.0}  # +-1/sqrt(100)
    G = torch.randn(7, 300, dtype=F64)
    torch.testing.assert_close(proj.apply(G), G @ R)
    torch.testing.assert_close(SignProjection(300, 100, seed=3, block=32).columns(32, 64), R[:, 32:64], rtol=0, atol=0)
    assert not torch.equal(SignProjection(300, 100, seed=4, block=32).columns(0, 32), R[:, :32])


def test_projected_equals_exact_at_full_dimension_and_its_error_falls_with_k():
    """``--curvature galerkin`` (the Hessian on a random sign subspace). Measured (digits 200 x 20, tanh MLP 64-8-10, P = 610, CE, damping 0.05): relative
    error 0.72, 0.43, 0.17 at k = 32, 128, 400; 1.4e-10 at k = P."""
    X, y, Xt, yt = _digits(200, 20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).to(F64)
    train(model, X, y, TrainConfig(loss="ce", lr=0.5, steps=200))
    P = sum(p.numel() for p in model.parameters())
    cfg = dict(damping=0.05, per_test=True)
    exact = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="exact", **cfg), loss="ce").per_test
    errors = []
    for k in (32, 128, 400, P, P + 50):
        res = compute_influence(
            model,
            X,
            y,
            Xt,
            yt,
            InfluenceConfig(estimator="projected", proj_dim=k, curvature="galerkin", **cfg),
            loss="ce",
        )
        errors.append(float((res.per_test - exact).norm() / exact.norm()))
        assert res.diagnostics["proj_dim_used"] == min(k, P)
    assert errors[0] > errors[1] > errors[2] > 1e-3
    assert errors[3] < 1e-7 and errors[4] < 1e-7


def test_factor_cache_round_trip_and_refusal_of_another_models_factors(tmp_path):
    from attnaudit.analyses.influence.kfac import factors_fingerprint, load_factors

    X, y, Xt, yt = _digits(80, 10)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).to(F64)
    cfg = dict(estimator="ekfac", damping=0.05, per_test=True, cache_dir=str(tmp_path / "cache"))
    first = compute_influence(model, X, y, Xt, yt, InfluenceConfig(**cfg), loss="ce")
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and first.diagnostics["factor_cache"].startswith("written")
    again = compute_influence(model, X, y, Xt, yt, InfluenceConfig(**cfg), loss="ce")
    assert again.diagnostics["factor_cache"] == "loaded"
    torch.testing.assert_close(again.per_test, first.per_test, rtol=0, atol=0)  # identical after reloading
    # another model (other weights) gets its own file, and the first file refuses it
    other = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).to(F64)
    compute_influence(other, X, y, Xt, yt, InfluenceConfig(**cfg), loss="ce")
    assert len(list((tmp_path / "cache").iterdir())) == 2
    eng = Engine(as_task(other, loss="ce", n_classes=10), dtype=F64)
    with pytest.raises(AuditError, match="another model or data"):
        load_factors(files[0], factors_fingerprint(eng, eng.rows(X), "ekfac", "ggn", 0))
    # other training rows: another fingerprint too
    eng_first = Engine(as_task(model, loss="ce", n_classes=10), dtype=F64)
    assert factors_fingerprint(eng_first, eng_first.rows(X), "ekfac", "ggn", 0) != factors_fingerprint(
        eng_first, eng_first.rows(X[:-1]), "ekfac", "ggn", 0
    )
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AuditError, match="not a factors file"):
        load_factors(tmp_path / "junk.safetensors", "x")


@pytest.mark.parametrize("damage", ["flip-tensor-byte", "truncate", "empty"])
def test_a_damaged_factor_cache_entry_is_reported_recomputed_and_rewritten(tmp_path, capsys, damage):
    """Each cache entry stores the sha256 of its tensors: one flipped byte inside a factor (still a
    valid safetensors file), a truncated or an empty file is one warning line, the factors are
    fitted again (the same scores as a run without the cache) and the entry is rewritten whole."""
    X, y, Xt, yt = _digits(60, 8)
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).to(F64)
    cfg = dict(estimator="ekfac", damping=0.05, per_test=True, cache_dir=str(tmp_path / "cache"))
    first = compute_influence(model, X, y, Xt, yt, InfluenceConfig(**cfg), loss="ce")
    (entry,) = (tmp_path / "cache").iterdir()
    raw = entry.read_bytes()
    if damage == "flip-tensor-byte":
        at = len(raw) - 5  # the data section closes the file: a factor's last bytes
        raw = raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1 :]
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = b""
    entry.write_bytes(raw)
    capsys.readouterr()
    again = compute_influence(model, X, y, Xt, yt, InfluenceConfig(**cfg), loss="ce")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("warning: K-FAC cache") and "recomputing" in err[0]
    assert again.diagnostics["factor_cache"].startswith("written") and "damaged" in again.diagnostics["factor_cache"]
    torch.testing.assert_close(again.per_test, first.per_test, rtol=1e-12, atol=1e-14)
    third = compute_influence(model, X, y, Xt, yt, InfluenceConfig(**cfg), loss="ce")
    assert third.diagnostics["factor_cache"] == "loaded"  # the rewritten entry is whole again


def test_audit_and_malleability_accept_the_new_estimators_and_record_which_ran(tmp_path):
    import json

    import yaml
    from conftest import run_cli

    mall = {
        "models": "relu",
        "attacks": "pgd",
        "eps": 0.1,
        "n-train": 40,
        "n-test": 20,
        "width": 8,
        "steps": 10,
        "top-k": 10,
        "pgd-steps": 2,
        "seeds": 2,
        "controls": False,
        "estimator": "projected",
        "proj-dim": 16,
    }
    doc = {
        "version": 1,
        "name": "projected",
        "seed": 0,
        "data": {"dataset": "digits"},
        "checks": [{"name": "flip", "analysis": "malleability", "options": mall, "metric": "flip_rate", "max": 1.0}],
    }
    path = tmp_path / "audit.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path / "a.json"
    assert run_cli("--threads", "1", "audit", path, "-q", "--json", out) == 0
    report = json.loads(out.read_text())["results"]["runs"][0]["report"]
    assert report["results"]["config"]["estimator"] == "projected" and report["results"]["config"]["proj_dim"] == 16
    rows = report["results"]["influence_diagnostics"]
    assert rows and all(r["estimator"] == "projected" and r["proj_dim_used"] == 16 for r in rows)
    # the built-in nets have no nn.Linear: K-FAC is refused before anything trains, with the reason
    assert run_cli("--threads", "1", "malleability", "--models", "relu", "--estimator", "ekfac", "-q") == 2


@pytest.mark.parametrize("layers", ["mlp", "conv"])
def test_agrees_with_kronfluence_ekfac_on_the_empirical_fisher(layers):
    """Same model, data, damping (0.1 x each layer's mean eigenvalue) and curvature (the true
    labels' gradients), for linear and convolutional layers: the scores agree with
    kronfluence's EK-FAC to 1e-8 relative (its sign convention is the opposite). Skipped where
    kronfluence is not installed (it comes with the [bench] extra)."""
    pytest.importorskip("kronfluence")
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task as KTask

    class Classification(KTask):
        def compute_train_loss(self, batch, model, sample=False):
            x, t = batch
            return torch.nn.functional.cross_entropy(model(x), t, reduction="sum")

        def compute_measurement(self, batch, model):
            x, t = batch
            return torch.nn.functional.cross_entropy(model(x), t, reduction="sum")

    X, y, Xt, yt = _digits(120, 15)
    torch.manual_seed(5)
    if layers == "mlp":
        model = nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10)).to(F64)
    else:  # a strided, padded convolution: its output positions are tokens on both sides
        model = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 4, 3, stride=2, padding=1),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(64, 10),
        ).to(F64)
    train(model, X, y, TrainConfig(loss="ce", lr=0.5, steps=100))
    ours = compute_influence(
        model,
        X,
        y,
        Xt,
        yt,
        InfluenceConfig(estimator="ekfac", damping="0.1x", per_test=True, curvature="empirical"),
        loss="ce",
    ).per_test
    import copy
    import tempfile

    kmodel = prepare_model(copy.deepcopy(model), Classification())
    with tempfile.TemporaryDirectory() as tmp:
        analyzer = Analyzer("t", kmodel, Classification(), output_dir=tmp, disable_tqdm=True, disable_model_save=True)
        train_ds, test_ds = torch.utils.data.TensorDataset(X, y), torch.utils.data.TensorDataset(Xt, yt)
        args = FactorArguments(
            strategy="ekfac",
            use_empirical_fisher=True,
            activation_covariance_dtype=F64,
            gradient_covariance_dtype=F64,
            lambda_dtype=F64,
        )
        analyzer.fit_all_factors("f", train_ds, per_device_batch_size=40, factor_args=args, overwrite_output_dir=True)
        analyzer.compute_pairwise_scores(
            "s",
            "f",
            test_ds,
            train_ds,
            per_device_query_batch_size=15,
            per_device_train_batch_size=40,
            overwrite_output_dir=True,
            score_args=ScoreArguments(
                damping_factor=None, score_dtype=F64, per_sample_gradient_dtype=F64, precondition_dtype=F64
            ),
        )
        theirs = -analyzer.load_pairwise_scores("s")["all_modules"].T.to(F64)
    rel = float((ours - theirs).norm() / theirs.norm())
    assert rel < 1e-7  # measured 1.05e-8 (mlp), 2.1e-8 (conv); kronfluence 1.0.1, float64 throughout


def test_a_budget_that_cannot_hold_the_factors_is_refused_with_the_alternatives():
    X, y, Xt, yt = _digits(40, 5)
    model = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 10)).to(F64)
    cfg = InfluenceConfig(estimator="ekfac", damping=0.1, memory_budget_mb=0.5)
    with pytest.raises(AuditError, match=r"kronecker factors.*params.*projected"):
        compute_influence(model, X, y, Xt, yt, cfg, loss="ce")
    with pytest.raises(AuditError, match=r"projected curvature.*proj_dim"):
        compute_influence(
            model,
            X,
            y,
            Xt,
            yt,
            InfluenceConfig(estimator="projected", proj_dim=4000, damping=0.1, memory_budget_mb=1),
            loss="ce",
        )


@pytest.mark.parametrize("c", [2, 3, 10])
def test_the_fewest_output_hessian_columns_square_to_autograds_hessian(c):
    """Cross-entropy's output Hessian from c - 1 columns; the truth is autograd's Hessian of
    the loss in the logits, row by row."""
    from attnaudit.analyses.influence.kfac import _output_hessian_columns
    from attnaudit.core.task import CrossEntropyLoss

    g = torch.Generator().manual_seed(c)
    logits = 3 * torch.randn(5, c, dtype=torch.float64, generator=g)
    logits[0, 0] = 40.0  # a confident row: most of p underflows towards 0
    L = _output_hessian_columns(CrossEntropyLoss(), logits)
    assert L.shape == (5, c, c - 1)
    for i in range(5):
        H = torch.autograd.functional.hessian(
            lambda f: torch.nn.functional.cross_entropy(f[None], torch.tensor([0])), logits[i]
        )
        assert torch.allclose(L[i] @ L[i].T, H, atol=1e-14)
