"""NTK engine against independent ground truth (see DESIGN.md section 4)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnaudit.core.task import Inputs, Task
from attnaudit.errors import AuditError
from attnaudit.models.builtin import ModelSpec, build_model, load_model, save_model
from attnaudit.core.ntk import (
    PATH_FAST_ENTK,
    PATH_GENERIC_ENTK,
    LinearizedGDConfig,
    TwoLayerState,
    analytic_ntk,
    analytic_ntk_parts,
    empirical_ntk,
    entk_jacobian,
    entk_two_layer,
    entk_two_layer_blocks,
    flatten_kernel,
    gd_spectral_function,
    kernel_gd_predict,
)
from attnaudit.core.training import TrainConfig, one_hot_targets, train

F64 = torch.float64


def _data(n=9, d=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=F64)


# ---------------------------------------------------------------- analytic NTK


def test_analytic_ntk_special_angles():
    """Hand-computed arc-cosine values: theta = 0, pi/2, pi."""
    d = 4
    x = torch.tensor([[3.0, 0.0, 0.0, 0.0]], dtype=F64)
    ortho = torch.tensor([[0.0, 2.0, 0.0, 0.0]], dtype=F64)
    X = torch.cat([x, ortho, -x])
    K = analytic_ntk(X)
    # theta = 0: kappa0 = kappa1 = 1/2 -> |x|^2/d
    assert K[0, 0].item() == pytest.approx(9.0 / d, rel=1e-14)
    # theta = pi/2: only the order-1 term, |x||x'|/d * 1/(2 pi)
    assert K[0, 1].item() == pytest.approx(3.0 * 2.0 / d / (2 * math.pi), rel=1e-14)
    # theta = pi: both kernels vanish
    assert abs(K[0, 2].item()) < 1e-15
    # standard parametrization at width m: d*k0 + m*k1
    Ks = analytic_ntk(X, parametrization="standard", width=100)
    assert Ks[0, 0].item() == pytest.approx(9.0 / 2 + 100 * 9.0 / d / 2, rel=1e-14)
    with pytest.raises(AuditError):
        analytic_ntk(X, parametrization="standard")


def test_analytic_ntk_keeps_precision_for_nearly_collinear_inputs():
    """theta between unit vectors at a known angle of 1e-9 (arccos of the dot would give ~1e-8 or 0)."""
    t = 1e-9
    X = torch.tensor([[1.0, 0.0], [math.cos(t), math.sin(t)]], dtype=F64)
    K = analytic_ntk_parts(X)
    kappa0 = (math.pi - t) / (2 * math.pi)
    expected_k0 = math.cos(t) / 2 * kappa0
    assert K.k0[0, 1].item() == pytest.approx(expected_k0, rel=1e-15)
    # k0(x, x) - k0(x, x') = 1/4 - cos(t)/2 (pi - t)/(2 pi) = t/(4 pi) + O(t^2): with arccos
    # of the rounded dot product (== 1.0) this difference would come out as 0
    diff = (K.k0[0, 0] - K.k0[0, 1]).item()
    assert diff == pytest.approx(t / (4 * math.pi), rel=1e-5)


def _mc_error(X, width, par, seeds):
    parts = analytic_ntk_parts(X)
    kinf = parts.kernel(par, width)
    c = 2
    errs = []
    for s in range(seeds):
        model = build_model(ModelSpec("relu", X.shape[1], width, c, parametrization=par, seed=100 + s), X)
        K = entk_two_layer(model, X)
        E = K - kinf[:, :, None, None] * torch.eye(c, dtype=F64)
        errs.append(E.norm().item() / (kinf.norm().item() * math.sqrt(c)))
    return sum(errs) / len(errs)


@pytest.mark.parametrize("par", ["ntk", "standard"])
def test_analytic_ntk_is_monte_carlo_limit(par):
    """Empirical NTK of wide random nets -> analytic, error shrinking like 1/sqrt(m)."""
    X = _data(12, 6, seed=3)
    e_small = _mc_error(X, 1000, par, seeds=20)
    e_large = _mc_error(X, 16000, par, seeds=20)
    assert e_large < 0.04
    ratio = e_small / e_large  # 1/sqrt(m) predicts sqrt(16) = 4
    assert 2.8 < ratio < 5.7, (e_small, e_large)


# ---------------------------------------------------------------- empirical NTK


def _autograd_ntk(model, X):
    """Per-sample, per-output gradients by plain autograd: the slowest, most literal ground truth."""
    rows = []
    for i in range(X.shape[0]):
        out = model(X[i : i + 1])[0]
        grads = []
        for k in range(out.shape[0]):
            g = torch.autograd.grad(out[k], list(model.parameters()), retain_graph=True)
            grads.append(torch.cat([t.reshape(-1) for t in g]))
        rows.append(torch.stack(grads))
    J = torch.stack(rows)  # (n, c, P)
    return torch.einsum("iap,jbp->ijab", J, J)


@pytest.mark.parametrize("arch", ["relu", "attn"])
@pytest.mark.parametrize("par", ["ntk", "standard"])
def test_closed_form_entk_equals_jacobian_contraction(arch, par):
    X = _data(8, 5)
    X2 = _data(5, 5, seed=1)
    model = build_model(ModelSpec(arch, 5, 14, 3, parametrization=par, seed=2), X)
    closed = entk_two_layer(model, X)
    jac = entk_jacobian(model, X)
    literal = _autograd_ntk(model, X)
    scale = closed.abs().max()
    assert (closed - jac).abs().max() <= 1e-13 * scale
    assert (closed - literal).abs().max() <= 1e-13 * scale
    # cross kernel, trace form, and chunking (tiny memory budget forces 1-row chunks)
    cross = entk_two_layer(model, X, X2, memory_bytes=1)
    cross_j = entk_jacobian(model, X, X2, memory_bytes=1)
    assert (cross - cross_j).abs().max() <= 1e-13 * cross.abs().max()
    tr = entk_two_layer(model, X, X2, form="trace")
    assert torch.allclose(tr, torch.diagonal(cross, dim1=2, dim2=3).mean(-1), rtol=1e-13, atol=0)
    assert torch.allclose(tr, entk_jacobian(model, X, X2, form="trace"), rtol=1e-12, atol=1e-15)


def test_entk_blocks_stream_the_full_kernel():
    X = _data(7, 4)
    model = build_model(ModelSpec("attn", 4, 10, 3, seed=5), X)
    full = entk_two_layer(model, X)
    Z = model.features_in(X).detach()
    seen = set()
    for k, l, block in entk_two_layer_blocks(TwoLayerState.from_model(model), Z):
        seen.add((k, l))
        assert torch.allclose(block, full[:, :, k, l], rtol=1e-13, atol=1e-15)
        assert torch.allclose(block.T, full[:, :, l, k], rtol=1e-13, atol=1e-15)
    assert seen == {(k, l) for k in range(3) for l in range(k, 3)}
    flat = flatten_kernel(full)
    assert flat[2 * 3 + 1, 4 * 3 + 2] == full[2, 4, 1, 2]
    # finite width: the off-diagonal output blocks are not zero (honest full kernel)
    assert full[:, :, 0, 1].abs().max() > 1e-3 * full[:, :, 0, 0].abs().max()


class _Difference(nn.Module):
    """Wraps a (B, 2) net; returns {"logits": out_0 - out_1}, a (B,) tensor in a dict."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> dict:
        out = self.net(x)
        return {"logits": out[:, 0] - out[:, 1]}


def test_entk_jacobian_generic_module_and_output_adapter():
    """A module with a bias and a (B,) output inside a dict (to_logits); vs literal autograd."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    X = _data(5, 3)
    K = entk_jacobian(_Difference(net), X, memory_bytes=200)
    assert K.shape == (5, 5, 1, 1)
    rows = []
    for i in range(5):
        out = net(X[i : i + 1])
        g = torch.autograd.grad(out[0, 0] - out[0, 1], list(net.parameters()))
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    J = torch.stack(rows)
    assert torch.allclose(K[:, :, 0, 0], J @ J.T, rtol=1e-12, atol=1e-14)
    # restricting to named parameters, by exact names or by the "head" selector
    K_last = entk_jacobian(net, X, params=["2.weight", "2.bias"])
    with torch.no_grad():
        h = net[1](net[0](X))
    expected = h @ h.T + 1.0
    assert torch.allclose(K_last[:, :, 0, 0], expected, rtol=1e-12)
    assert torch.allclose(K_last[:, :, 0, 1], torch.zeros(5, 5, dtype=F64))
    assert torch.equal(entk_jacobian(net, X, params="head"), K_last)
    with pytest.raises(AuditError):
        entk_jacobian(net, X, params=["nope"])
    with pytest.raises(AuditError):
        entk_jacobian(net, X, form="diag")


@pytest.mark.parametrize("arch", ["relu", "attn"])
@pytest.mark.parametrize("par", ["ntk", "standard"])
def test_empirical_ntk_fast_path_equals_engine_path(arch, par):
    """The declared closed-form fast path and the generic engine give the same kernel."""
    X = _data(7, 5)
    X2 = _data(4, 5, seed=1)
    model = build_model(ModelSpec(arch, 5, 12, 3, parametrization=par, seed=6), X)
    for form in ("full", "trace"):
        for second in (None, X2):
            fast = empirical_ntk(model, X, second, form=form)
            slow = empirical_ntk(model, X, second, form=form, fast_path=False)
            assert fast.path == PATH_FAST_ENTK and fast.fast_path_reason is None
            assert slow.path == PATH_GENERIC_ENTK and "switched off" in slow.fast_path_reason
            assert fast.kernel.shape == slow.kernel.shape and fast.kernel.dtype == F64
            assert (fast.kernel - slow.kernel).abs().max() <= 1e-13 * fast.kernel.abs().max()
    # a Task with the flat default adapter takes the fast path too
    task = Task(model, 3)
    assert empirical_ntk(task, X).path == PATH_FAST_ENTK
    # the fast path declares when it does not apply: only the head tracked, or another dtype
    head = empirical_ntk(model, X, params="head")
    assert head.path == PATH_GENERIC_ENTK and head.names == ["a"] and "not all" in head.fast_path_reason
    with torch.no_grad():
        S = model.hidden(X) * model.preactivation_scale()[1]
    assert torch.allclose(head.kernel, (S @ S.T)[:, :, None, None] * torch.eye(3, dtype=F64), rtol=1e-12, atol=1e-15)
    other = empirical_ntk(model, X, dtype=torch.float32)
    assert other.path == PATH_GENERIC_ENTK and other.kernel.dtype == torch.float32
    assert model.W.dtype == F64  # the module is never cast


def _sdpa_net(x: torch.Tensor, p: dict, training: bool = False) -> torch.Tensor:
    """Images (B, 1, 4, 4) -> four 2x2 patch tokens -> embedding -> 2-head softmax attention
    (scaled_dot_product_attention, trainable Q/K/V) -> mean pool -> dropout -> 3 logits."""
    B = x.shape[0]
    tokens = x.reshape(B, 1, 2, 2, 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, 4, 4)
    h = torch.tanh(tokens @ p["embed.weight"].T + p["embed.bias"])  # (B, 4, 6)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(B, 4, 2, 3).transpose(1, 2)  # (B, 2 heads, 4 tokens, 3)

    q, k, v = (heads(h @ p[f"{n}.weight"].T) for n in ("q", "k", "v"))
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    pooled = (h + att.transpose(1, 2).reshape(B, 4, 6)).mean(1)
    pooled = torch.nn.functional.dropout(pooled, 0.5, training)
    return pooled @ p["head.weight"].T + p["head.bias"]


class _TinyAttention(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(4, 6)
        self.q, self.k, self.v = (nn.Linear(6, 6, bias=False) for _ in range(3))
        self.head = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        assert images.shape[1:] == (1, 4, 4)
        return _sdpa_net(images, dict(self.named_parameters()), self.drop.training)


def test_engine_entk_on_sdpa_attention_with_images_equals_explicit_jacobians():
    """Engine eNTK of an SDPA attention net on (B, 1, 4, 4) images vs per-sample Jacobians by
    torch.autograd.functional.jacobian (no torch.func); the module stays in train mode."""
    model = _TinyAttention().double().train()
    X = _data(5, 16, seed=7)
    X2 = _data(3, 16, seed=8)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach() for _, p in model.named_parameters())

    def jac(rows: torch.Tensor) -> torch.Tensor:
        out = []
        for row in rows:
            image = row.reshape(1, 1, 4, 4)
            parts = torch.autograd.functional.jacobian(lambda *ps: _sdpa_net(image, dict(zip(names, ps)))[0], params)
            out.append(torch.cat([j.reshape(3, -1) for j in parts], dim=1))
        return torch.stack(out)  # (n, c, P)

    J1, J2 = jac(X), jac(X2)
    task = Task(model, 3, inputs=Inputs("images", (1, 4, 4)))
    res = empirical_ntk(task, X, X2)
    assert res.path == PATH_GENERIC_ENTK and "not a TwoLayerNet" in res.fast_path_reason
    expected = torch.einsum("iap,jbp->ijab", J1, J2)
    assert (res.kernel - expected).abs().max() <= 1e-12 * expected.abs().max()
    # symmetric kernel, chunked to one row at a time, and the trace form
    K11 = entk_jacobian(task, X, memory_bytes=1)
    assert torch.allclose(K11, torch.einsum("iap,jbp->ijab", J1, J1), rtol=1e-12, atol=1e-14)
    tr = entk_jacobian(model, X, X2, form="trace", inputs=Inputs("images", (1, 4, 4)))
    assert torch.allclose(tr, torch.einsum("iap,jap->ij", J1, J2) / 3, rtol=1e-12, atol=1e-14)
    # Q/K/V alone by glob selector
    qkv = entk_jacobian(task, X, X2, params="[qkv].weight")
    sizes = [p.numel() for p in params]
    start = sum(sizes[: names.index("q.weight")])
    sl = slice(start, start + sum(sizes[names.index("q.weight") : names.index("v.weight") + 1]))
    assert torch.allclose(qkv, torch.einsum("iap,jbp->ijab", J1[..., sl], J2[..., sl]), rtol=1e-12, atol=1e-14)
    assert model.training and model.drop.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- linearized GD predictor


class CoupledLinear(nn.Module):
    """f_k(x) = sum_p theta_p Phi[x, k, p]: linear in its parameters, with a non-block-diagonal NTK."""

    def __init__(self, p: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.theta = nn.Parameter(torch.randn(p, generator=gen, dtype=F64) * 0.3)

    def forward(self, phi: torch.Tensor) -> torch.Tensor:  # phi: (B, c, p)
        return phi @ self.theta


class SharedLinear(nn.Module):
    """f(x) = W phi(x): the NTK is phi phi^T times I_c."""

    def __init__(self, p: int, c: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.W = nn.Parameter(torch.randn(c, p, generator=gen, dtype=F64) * 0.3)

    def forward(self, phi: torch.Tensor) -> torch.Tensor:
        return phi @ self.W.T


def _phi(n, *shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=gen, dtype=F64)


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_predictor_reproduces_gd_of_linear_model_full_kernel(loss):
    n, nt, c, p = 12, 5, 3, 20
    phi, phit = _phi(n, c, p, seed=1), _phi(nt, c, p, seed=2)
    y = torch.arange(n) % c
    model = CoupledLinear(p)
    with torch.no_grad():
        f0, f0t = model(phi).clone(), model(phit).clone()
    K = entk_jacobian(model, phi)
    Kt = entk_jacobian(model, phit, phi)
    lam_max = torch.linalg.eigvalsh(flatten_kernel(K))[-1].item()
    lr, steps = 0.9 * n / lam_max, 40
    pred = kernel_gd_predict(
        K, one_hot_targets(y, c), LinearizedGDConfig(lr=lr, steps=steps, loss=loss), K_test=Kt, f0_train=f0, f0_test=f0t
    )
    result = train(model, phi, y, TrainConfig(loss=loss, lr=lr, steps=steps))
    assert result.steps_run == steps
    with torch.no_grad():
        f_gd, f_gd_t = model(phi), model(phit)
    scale = f_gd.abs().max().item()
    assert (pred.f_train - f_gd).abs().max().item() < 1e-11 * scale
    assert (pred.f_test - f_gd_t).abs().max().item() < 1e-11 * scale
    assert (f_gd - f0).abs().max().item() > 0.1  # training moved the outputs


def test_predictor_shared_kernel_discrete_and_continuous():
    n, nt, c, p = 10, 4, 2, 30
    phi, phit = _phi(n, p, seed=3), _phi(nt, p, seed=4)
    y = torch.arange(n) % c
    model = SharedLinear(p, c)
    with torch.no_grad():
        f0, f0t = model(phi).clone(), model(phit).clone()
    K, Kt = phi @ phi.T, phit @ phi.T  # kernel of a linear model: independent of entk code
    lam_max = torch.linalg.eigvalsh(K)[-1].item()
    lr, steps = 0.5 * n / lam_max, 60
    Y = one_hot_targets(y, c)
    pred = kernel_gd_predict(K, Y, LinearizedGDConfig(lr=lr, steps=steps), K_test=Kt, f0_train=f0, f0_test=f0t)
    train(model, phi, y, TrainConfig(loss="mse", lr=lr, steps=steps))
    with torch.no_grad():
        assert torch.allclose(pred.f_train, model(phi), rtol=0, atol=1e-12)
        assert torch.allclose(pred.f_test, model(phit), rtol=0, atol=1e-12)
    assert pred.stability_ratio == pytest.approx(0.5)
    assert not pred.diverges
    # continuous form: GD with a k-times smaller step and k-times more steps converges to it (error O(lr))
    cont = kernel_gd_predict(
        K, Y, LinearizedGDConfig(lr=lr, steps=steps, mode="continuous"), K_test=Kt, f0_train=f0, f0_test=f0t
    )
    errs = []
    for k in (10, 100):
        fine = kernel_gd_predict(
            K, Y, LinearizedGDConfig(lr=lr / k, steps=steps * k), K_test=Kt, f0_train=f0, f0_test=f0t
        )
        errs.append((fine.f_test - cont.f_test).abs().max().item())
    assert errs[1] < 1e-3 and 7 < errs[0] / errs[1] < 13


def test_predictor_stable_on_singular_kernel():
    """A rank-1 kernel: null directions keep f_0 + (lr T / n) times their residual, no inverse blow-up."""
    n, c = 6, 2
    v = torch.linspace(1, 2, n, dtype=F64)
    K = torch.outer(v, v)
    Y = one_hot_targets(torch.arange(n) % c, c)
    cfg = LinearizedGDConfig(lr=0.1, steps=7)
    pred = kernel_gd_predict(K, Y, cfg, K_test=K[:2])
    assert torch.isfinite(pred.f_train).all()
    # exact: iterate f <- f - (lr/n) K (f - Y) directly
    f = torch.zeros_like(Y)
    for _ in range(7):
        f = f - 0.1 / n * K @ (f - Y)
    assert torch.allclose(pred.f_train, f, rtol=0, atol=1e-14)
    assert pred.numerical_rank == 1
    g = gd_spectral_function(torch.tensor([0.0, 1e-300, 1.0], dtype=F64), lr=0.1, steps=7, n=n)
    assert g[0].item() == pytest.approx(0.7 / n, rel=1e-15)
    assert g[1].item() == pytest.approx(0.7 / n, rel=1e-12)
    assert g[2].item() == pytest.approx((1 - (1 - 0.1 / n) ** 7), rel=1e-14)
    big = kernel_gd_predict(K, Y, LinearizedGDConfig(lr=100.0, steps=3))
    assert big.diverges


def test_predictor_config_validation():
    with pytest.raises(AuditError):
        LinearizedGDConfig(lr=-1, steps=3)
    with pytest.raises(AuditError):
        LinearizedGDConfig(lr=1, steps=3, mode="euler")
    with pytest.raises(AuditError):
        kernel_gd_predict(torch.eye(3, dtype=F64), torch.zeros(4, 2, dtype=F64), LinearizedGDConfig(lr=1, steps=1))


# ---------------------------------------------------------------- models: save/load


@pytest.mark.parametrize("arch", ["relu", "attn"])
@pytest.mark.parametrize("par,init", [("ntk", "antisymmetric"), ("standard", "standard")])
def test_save_load_round_trip(tmp_path, arch, par, init):
    X = _data(10, 6)
    model = build_model(ModelSpec(arch, 6, 8, 3, parametrization=par, init=init, seed=4), X)
    train(model, X, torch.arange(10) % 3, TrainConfig(lr=0.5, steps=3))
    path = save_model(model, tmp_path / "m.safetensors", metadata={"note": "x"})
    loaded = load_model(path)
    assert loaded.spec == model.spec
    with torch.no_grad():
        assert torch.equal(loaded(X), model(X))
    assert torch.equal(entk_two_layer(loaded, X), entk_two_layer(model, X))
    with pytest.raises(AuditError):
        save_model(model, path)
    if init == "antisymmetric":
        fresh = build_model(ModelSpec(arch, 6, 8, 3, parametrization=par, init=init, seed=4), X)
        with torch.no_grad():
            # zero up to summation-order round-off (BLAS does not pair neuron j with j + m/2)
            assert fresh(X).abs().max().item() < 1e-14


def test_analytic_ntk_angles_at_gemm_speed_match_a_200_bit_reference():
    """The matrix-product angles (centred expansion + exact recompute of cancelled pairs) against
    mpmath at 200 bits, on raw and on attention-transformed digits (mean cosine 0.999)."""
    mpmath = pytest.importorskip("mpmath")
    from attnaudit.data import DataSpec, load_dataset
    from attnaudit.models.builtin import attention_context
    from attnaudit.core.ntk import _pair_angles

    X = load_dataset(DataSpec("digits", n=120)).X.to(F64)
    Z = X @ attention_context(X, "rms").to(F64)
    mpmath.mp.prec = 200
    for A in (X, Z, torch.tensor([[1.0, 0.0], [math.cos(1e-9), math.sin(1e-9)], [-1.0, 1e-12], [0.0, 0.0]], dtype=F64)):
        U = A / A.norm(dim=1, keepdim=True).clamp_min(1e-300)
        theta = _pair_angles(U, U)
        n = U.shape[0]
        pairs = [(i, j) for i in range(0, n, max(1, n // 9)) for j in range(n) if i != j][:300]
        for i, j in pairs:
            u = [mpmath.mpf(float(x)) for x in U[i]]
            v = [mpmath.mpf(float(x)) for x in U[j]]
            minus = mpmath.sqrt(sum((a - b) ** 2 for a, b in zip(u, v)))
            plus = mpmath.sqrt(sum((a + b) ** 2 for a, b in zip(u, v)))
            exact = float(2 * mpmath.atan2(minus, plus))
            assert abs(theta[i, j].item() - exact) <= 4e-15 * max(abs(exact), 1e-300), (i, j)
