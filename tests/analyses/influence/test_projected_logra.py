"""``--estimator projected`` (LoGra / TRAK): projected per-sample gradients through each linear
layer's inputs and output gradients, the Gauss-Newton (or empirical Fisher) curvature in the
projected space, reuse of projected rows across calls.

Independent truth: per-sample Jacobians and gradients by plain autograd on the module (one
sample at a time), the dense Gauss-Newton matrix and the dense projection matrix R formed
whole, solved with torch.linalg.solve."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnaudit.analyses.influence.estimators import projected as pj
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.core.engine import Engine
from attnaudit.core.task import Inputs, Task
from attnaudit.errors import AuditError
from attnaudit.models.vit import ViT, ViTSpec

F64 = torch.float64
DAMPING = 0.01


def _setup(n=40, n_test=6, seed=0):
    """A tiny ViT (P = 811: linear layers, LayerNorms and a position embedding), CE, 3 classes."""
    spec = ViTSpec("vit", (1, 8, 8), 3, depth=1, dim=8, heads=2, patch=4, mlp_ratio=2, seed=seed)
    model = ViT(spec, dtype=F64).eval()
    task = Task(model, 3, "ce", Inputs(kind="images", shape=(1, 8, 8)))
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n + n_test, 64, generator=g, dtype=F64)
    y = torch.randint(0, 3, (n + n_test,), generator=g)
    return model, task, X[:n], y[:n], X[n:], y[n:]


def _dense_truth(model, X, y, Xt, yt, R=None, curvature="ggn"):
    """-(R^T g_i) . (R^T C R + lambda R^T R)^-1 R^T g_test for every pair, everything dense:
    C the GGN (1/n) sum J^T H J or the empirical Fisher (1/n) sum g g^T; R = I by default."""
    params = dict(model.named_parameters())
    names = list(params)
    shapes = [params[k].shape for k in names]
    flat0 = torch.cat([params[k].detach().reshape(-1) for k in names])
    P = flat0.numel()

    def logits_of(flat, x):
        parts = torch.split(flat, [math.prod(s) for s in shapes])
        state = {k: p.view(s) for k, p, s in zip(names, parts, shapes)}
        return torch.func.functional_call(model, state, (x.reshape(1, 1, 8, 8),))[0]

    def per_sample(Xs, ys):
        J, G, H = [], [], []
        for x, t in zip(Xs, ys):
            Ji = torch.autograd.functional.jacobian(lambda f: logits_of(f, x), flat0)  # (c, P)
            z = logits_of(flat0, x).detach()
            p = torch.softmax(z, -1)
            G.append(Ji.T @ (p - nn.functional.one_hot(t, 3).to(F64)))
            J.append(Ji)
            H.append(torch.diag(p) - torch.outer(p, p))
        return J, torch.stack(G), H

    J, G, H = per_sample(X, y)
    _, Gt, _ = per_sample(Xt, yt)
    if curvature == "ggn":
        C = sum(Ji.T @ Hi @ Ji for Ji, Hi in zip(J, H)) / len(J)
    else:
        C = G.T @ G / len(J)
    R = torch.eye(P, dtype=F64) if R is None else R
    A = R.T @ C @ R + DAMPING * (R.T @ R)
    Z = torch.linalg.solve(A, (Gt @ R).T)  # (k, n_test)
    return -(G @ R) @ Z, P


def _projected(task, X, y, Xt, yt, k, **kw):
    cfg = InfluenceConfig(estimator="projected", proj_dim=k, damping=DAMPING, per_test=True, params="all", **kw)
    return compute_influence(task, X, y, Xt, yt, cfg)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def _fresh_cache():
    pj.clear_row_cache()
    yield
    pj.clear_row_cache()


@pytest.mark.parametrize("curvature", ["ggn", "empirical"])
def test_full_dimension_is_exact_against_dense_autograd_and_the_exact_estimator(curvature):
    model, task, X, y, Xt, yt = _setup()
    truth, P = _dense_truth(model, X, y, Xt, yt, curvature=curvature)
    res = _projected(task, X, y, Xt, yt, P + 10, curvature=curvature)
    assert res.diagnostics["proj_dim_used"] == P and res.diagnostics["curvature"] == curvature
    assert _rel(res.per_test, truth) < 1e-10  # measured 2e-14 (ggn)
    if curvature == "ggn":  # and the library's own exact GGN influence
        exact = compute_influence(
            task,
            X,
            y,
            Xt,
            yt,
            InfluenceConfig(estimator="exact", curvature="ggn", damping=DAMPING, per_test=True, params="all"),
        )
        assert _rel(res.per_test, exact.per_test) < 1e-10


def test_compressed_projection_equals_the_dense_galerkin_system_and_the_full_gradient_path():
    """At k < P the factored path (activations and output gradients projected per layer, never
    the per-sample gradient) equals the dense formula with R formed whole."""
    model, task, X, y, Xt, yt = _setup()
    k = 200
    res = _projected(task, X, y, Xt, yt, k)
    eng = Engine(task, dtype=F64, names=[n for n, _ in model.named_parameters()])
    proj = pj.projection_for(eng, k, seed=0)
    R = proj.dense()
    assert R.shape[1] == res.diagnostics["proj_dim_used"] <= k
    truth, _ = _dense_truth(model, X, y, Xt, yt, R=R)
    assert _rel(res.per_test, truth) < 1e-9
    # the same projection applied to full per-sample gradients (fast_path=False)
    full = _projected(task, X, y, Xt, yt, k, fast_path=False)
    assert _rel(full.per_test, res.per_test) < 1e-12
    # every linear layer is compressed on at least one side, the other parameters by signs
    layout = res.diagnostics["projection_layout"]
    assert layout["other_dim"] >= 1 and "pos_embed" in layout["other_parameters"]


def test_error_against_exact_ggn_falls_with_k():
    """Measured on the tiny ViT (P = 811), the default layer split: relative error 0.87, 0.80,
    0.33, 0.25 at k = 50, 100, 200, 400 (least-squares log-log slope -0.67; the params split:
    0.92, 0.86, 0.75, 0.43, slope -0.35), 0.26 at k = 600 (every linear layer then whole, the
    rest of the error from the sign-projected norms and position embedding) and 2e-14 at k = P."""
    model, task, X, y, Xt, yt = _setup()
    truth, P = _dense_truth(model, X, y, Xt, yt)
    ks = [50, 100, 200, 400]
    errs = [_rel(_projected(task, X, y, Xt, yt, k).per_test, truth) for k in ks]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    lx = torch.log(torch.tensor(ks, dtype=F64))
    ly = torch.log(torch.tensor(errs, dtype=F64))
    slope = float(((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum())
    assert slope < -0.2, (slope, errs)
    assert errs[-1] < 0.5


def test_projected_rows_are_reused_for_the_same_model_and_recomputed_for_changed_rows():
    model, task, X, y, Xt, yt = _setup()
    first = _projected(task, X, y, Xt, yt, 200)
    assert first.diagnostics["projected_rows_computed"] == 40 and first.diagnostics["projected_rows_reused"] == 0
    again = _projected(task, X, y, Xt, yt, 200)
    assert again.diagnostics["projected_rows_reused"] == 40 and again.diagnostics["projected_rows_computed"] == 0
    torch.testing.assert_close(again.per_test, first.per_test, rtol=1e-12, atol=0)
    # a perturbed training set on the same model (--protocol static): only the changed rows
    Xp = X.clone()
    Xp[:5] += 0.05
    partial = _projected(task, Xp, y, Xt, yt, 200)
    assert partial.diagnostics["projected_rows_computed"] == 5
    assert partial.diagnostics["projected_rows_reused"] == 35
    pj.clear_row_cache()
    fresh = _projected(task, Xp, y, Xt, yt, 200)
    assert fresh.diagnostics["projected_rows_reused"] == 0
    torch.testing.assert_close(partial.per_test, fresh.per_test, rtol=1e-10, atol=1e-14)
    # another model (other weights) never reads the first model's rows
    with torch.no_grad():
        model.head.weight.add_(0.1)
    other = _projected(task, X, y, Xt, yt, 200)
    assert other.diagnostics["projected_rows_reused"] == 0


def test_test_rows_are_projected_once_per_model_and_again_for_new_rows_or_weights(monkeypatch):
    """The test side (R^T grad l of each test row, the 'empirical' rows) is reused by later runs on
    the same model and test rows, as a static malleability run scores one test set against its
    clean and perturbed training sets; new test rows and other weights are projected afresh, and
    the scores equal a run that projected everything itself."""
    model, task, X, y, Xt, yt = _setup()
    projected_test_rows: list[int] = []
    real = pj.projected_rows

    def counted(engine, proj, rows, targets, curvature):
        if curvature == "empirical":  # the training rows here use ggn (3 classes)
            projected_test_rows.append(int(rows.shape[0]))
        return real(engine, proj, rows, targets, curvature)

    monkeypatch.setattr(pj, "projected_rows", counted)
    first = _projected(task, X, y, Xt, yt, 200)
    Xp = X.clone()
    Xp[:5] += 0.05
    perturbed = _projected(task, Xp, y, Xt, yt, 200)
    assert sum(projected_test_rows) == 6
    _projected(task, X, y, Xt[:3], yt[:3], 200)  # a subset in between (the float64 check's float32 side)
    _projected(task, Xp, y, Xt, yt, 200)
    assert sum(projected_test_rows) == 6  # the subset evicted none of the other rows
    Xt2 = Xt.clone()
    Xt2[0] += 0.1
    _projected(task, X, y, Xt2, yt, 200)
    assert sum(projected_test_rows) == 7  # the changed test row only
    pj.clear_row_cache()
    fresh = _projected(task, Xp, y, Xt, yt, 200)
    assert sum(projected_test_rows) == 13
    torch.testing.assert_close(perturbed.per_test, fresh.per_test, rtol=1e-10, atol=1e-14)
    assert first.per_test.shape == fresh.per_test.shape
    with torch.no_grad():
        model.head.weight.add_(0.1)
    _projected(task, X, y, Xt, yt, 200)
    assert sum(projected_test_rows) == 19  # other weights: every test row again


def test_relative_damping_and_a_damping_sweep_reuse_one_decomposition():
    model, task, X, y, Xt, yt = _setup()
    from attnaudit.analyses.influence.influence import influence_sweep

    cfg = InfluenceConfig(estimator="projected", proj_dim=300, per_test=True, params="all")
    a, b = influence_sweep(task, X, y, Xt, yt, cfg, dampings=[0.01, "0.1x"])
    assert a.damping == pytest.approx(0.01)
    assert b.damping == pytest.approx(0.1 * b.diagnostics["lambda_max"])
    single = _projected(task, X, y, Xt, yt, 300)
    torch.testing.assert_close(a.per_test, single.per_test, rtol=1e-10, atol=0)


def test_galerkin_keeps_the_hessian_variant_and_fisher_is_refused():
    model, task, X, y, Xt, yt = _setup(n=20, n_test=3)
    P = sum(p.numel() for p in model.parameters())
    cfg = dict(damping=0.5, per_test=True, params="all")
    exact = compute_influence(task, X, y, Xt, yt, InfluenceConfig(estimator="exact", **cfg)).per_test
    res = compute_influence(
        task, X, y, Xt, yt, InfluenceConfig(estimator="projected", proj_dim=P, curvature="galerkin", **cfg)
    )
    assert res.diagnostics["hessian_vector_products"] == P
    assert _rel(res.per_test, exact) < 1e-7
    with pytest.raises(AuditError, match="projected takes"):
        InfluenceConfig(estimator="projected", curvature="fisher")
    with pytest.raises(AuditError, match="curvature galerkin is for estimator projected"):
        InfluenceConfig(estimator="kfac", curvature="galerkin")


def test_a_model_without_linear_layers_projects_everything_by_signs():
    """The built-in relu net holds bare parameters: all of them go through the sign projection."""
    torch.manual_seed(0)

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(5, 6, dtype=F64) * 0.5)
            self.a = nn.Parameter(torch.randn(6, 3, dtype=F64) * 0.5)

        def forward(self, x):
            return torch.tanh(x @ self.W) @ self.a

    model = Bare()
    X, y = torch.randn(30, 5, dtype=F64), torch.randint(0, 3, (30,))
    Xt, yt = torch.randn(4, 5, dtype=F64), torch.randint(0, 3, (4,))
    cfg = dict(damping=DAMPING, per_test=True)
    exact = compute_influence(
        model, X, y, Xt, yt, InfluenceConfig(estimator="exact", curvature="ggn", **cfg), loss="ce"
    )
    full = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="projected", proj_dim=48, **cfg), loss="ce")
    assert _rel(full.per_test, exact.per_test) < 1e-10
    part = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="projected", proj_dim=16, **cfg), loss="ce")
    assert part.diagnostics["proj_dim_used"] == 16 and part.diagnostics["projection_layout"]["layers"] == {}


def test_the_layer_split_gives_every_layer_an_equal_square_share_and_water_fills():
    from attnaudit.analyses.influence.projection import allocate

    # LoGra's layout: an MLP 785 -> 32 -> 10 at k = 128 gets 8 x 8 per layer (the params split
    # gave the 330-parameter head a single dimension)
    assert allocate(128, [(785, 32), (33, 10)], 0) == ([(8, 8), (8, 8)], 0)
    assert allocate(128, [(785, 32), (33, 10)], 0, "params")[0][1] == (1, 1)
    # a layer smaller than its share is kept whole, the rest goes to the others: 6 of 100 to the
    # 2 x 3 layer, 94 left -> k_out = floor(sqrt(94)) = 9, k_in = 94 // 9 = 10
    assert allocate(100, [(100, 100), (2, 3)], 0) == ([(10, 9), (2, 3)], 0)
    # other parameters take a share like a layer's, plus what the layers leave
    dims, k_other = allocate(30, [(4, 2)], 50)
    assert dims == [(4, 2)] and k_other == 22
    with pytest.raises(ValueError, match="unknown projection split"):
        allocate(10, [(4, 4)], 0, "bogus")


def test_proj_split_reaches_the_projection_and_an_unknown_one_is_refused():
    model, task, X, y, Xt, yt = _setup()
    layer = _projected(task, X, y, Xt, yt, 200)
    params = _projected(task, X, y, Xt, yt, 200, proj_split="params")
    assert layer.diagnostics["projection_layout"]["split"] == "layer"
    assert params.diagnostics["projection_layout"]["split"] == "params"
    assert layer.diagnostics["projection_layout"]["layers"] != params.diagnostics["projection_layout"]["layers"]
    with pytest.raises(AuditError, match="unknown proj_split"):
        InfluenceConfig(estimator="projected", proj_split="bogus")


@pytest.mark.parametrize("per_test", [True, False])
def test_the_test_side_projected_from_activations_equals_full_test_gradients_through_r(per_test):
    """The fast path never forms the (n_test, P) test gradients: it projects the test rows like
    the training rows. fast_path=False applies R to the full test gradients instead."""
    model, task, X, y, Xt, yt = _setup()
    cfg = dict(estimator="projected", proj_dim=150, damping=DAMPING, per_test=per_test, params="all")
    fast = compute_influence(task, X, y, Xt, yt, InfluenceConfig(**cfg))
    pj.clear_row_cache()
    ref = compute_influence(task, X, y, Xt, yt, InfluenceConfig(**cfg, fast_path=False))
    a, b = (fast.per_test, ref.per_test) if per_test else (fast.total, ref.total)
    assert _rel(a, b) < 1e-11


def test_slice_start_finds_views_of_the_training_rows_and_nothing_else():
    whole = torch.arange(40.0).reshape(10, 4)
    assert pj._slice_start(whole[3:7], whole) == 3
    assert pj._slice_start(whole, whole) == 0
    assert pj._slice_start(whole[3:7].clone(), whole) is None  # same content, other memory: hashed instead
    assert pj._slice_start(whole[:, :2], whole) is None
    assert pj._slice_start(whole[3:7], whole[2:]) == 1
    assert pj._slice_start(whole[1:3], whole[2:]) is None  # before the start of whole


def test_layernorms_and_the_position_embedding_take_their_rows_from_the_shared_backward_passes():
    """The tiny ViT's LayerNorm scales/shifts and its position embedding are covered by the
    fast structures (and the k >= P test above checks the result against dense autograd)."""
    model, task, X, y, Xt, yt = _setup()
    res = _projected(task, X, y, Xt, yt, 200)
    fast = set(res.diagnostics["other_parameters_from_backward"])
    assert {"pos_embed", "blocks.0.norm1.weight", "blocks.0.norm1.bias", "norm.weight", "norm.bias"} <= fast
    assert res.diagnostics["other_parameters_by_jacobian"] == []


class _Indexed(nn.Module):
    """A parameter read through an index (``scale[0]``): a batched copy would give every sample
    copy 0, the same logits and wrong per-sample gradients; a LayerNorm over a batch-second
    layout breaks the per-sample sum the same way. Verification must send both to the
    per-sample Jacobians."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.inp = nn.Linear(5, 6, dtype=F64)
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(1, 6, generator=g, dtype=F64))
        self.norm = nn.LayerNorm(3, dtype=F64)
        self.out = nn.Linear(6, 3, dtype=F64)
        with torch.no_grad():
            self.norm.weight.add_(0.2 * torch.randn(3, generator=g, dtype=F64))

    def forward(self, x):
        h = torch.tanh(self.inp(x)) * self.scale[0]
        h = self.norm(h.reshape(-1, 2, 3).transpose(0, 1)).transpose(0, 1).reshape(-1, 6)  # batch second
        return self.out(h)


def test_a_parameter_the_structures_do_not_fit_goes_to_the_jacobians_and_stays_exact():
    model = _Indexed()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(30, 5, generator=g, dtype=F64), torch.randint(0, 3, (30,), generator=g)
    Xt, yt = torch.randn(4, 5, generator=g, dtype=F64), torch.randint(0, 3, (4,), generator=g)
    cfg = dict(damping=DAMPING, per_test=True, params="all", curvature="ggn")
    exact = compute_influence(model, X, y, Xt, yt, InfluenceConfig(estimator="exact", **cfg), loss="ce")
    res = compute_influence(
        model, X, y, Xt, yt, InfluenceConfig(estimator="projected", proj_dim=10**4, **cfg), loss="ce"
    )
    assert set(res.diagnostics["other_parameters_by_jacobian"]) == {"scale", "norm.weight", "norm.bias"}
    assert _rel(res.per_test, exact.per_test) < 1e-10


def test_the_cli_refuses_an_unknown_proj_split_in_one_line(capsys):
    from conftest import run_cli

    assert run_cli("malleability", "--estimator", "projected", "--proj-split", "bogus", "--preset", "quick") == 2
    err = capsys.readouterr().err
    assert "unknown --proj-split 'bogus'; use layer or params" in err and "Traceback" not in err


def test_the_memory_estimate_counts_the_projected_rows_and_the_row_cache():
    from attnaudit.analyses.influence.influence import influence_memory

    mem = influence_memory("projected", 10_000, 300, 10, True, 64, proj_dim=512, n_classes=10)
    # 300 projected gradients of 512 floats, and the cache: 300 rows x (10 + 1) x 512 floats
    assert mem["projected_rows"] == 300 * 512 * 8 + 300 * 11 * 512 * 8
    assert mem["projected_curvature"] == (3 * 512**2 + 2 * 64 * 10_000) * 8
    assert influence_memory("ekfac", 10_000, 300, 10, True, 64)["projected_rows"] == 0
