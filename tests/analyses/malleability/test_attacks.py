"""Attacks against their definitions: the eps-ball, the valid range, hand-computed steps,
loss increase over the random-noise control, determinism."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnaudit.analyses.malleability.attacks import AttackConfig, perturb
from attnaudit.errors import AuditError
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import TrainConfig, per_sample_loss, train

F64 = torch.float64  # every tensor built here is float64 explicitly: no global default dtype


@pytest.fixture(scope="module")
def trained():
    from sklearn.datasets import load_digits  # bundled with scikit-learn: real images, no network

    X, y = load_digits(return_X_y=True)
    X = torch.from_numpy(X[:240] / 16.0)
    y = torch.from_numpy(y[:240]).long()
    out = {}
    for arch in ("relu", "attn"):
        net = build_model(ModelSpec(arch, 64, 32, 10, seed=0), X)
        train(net, X, y, TrainConfig(lr=1.0, steps=150))
        out[arch] = net
    return out, X, y


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("method", ["fgsm", "pgd", "mim", "random", "none"])
def test_perturbation_stays_in_ball_and_valid_range(trained, method, norm):
    nets, X, y = trained
    eps = 0.3 if norm == "linf" else 2.0
    res = perturb(
        nets["relu"], X, y, AttackConfig(method=method, eps=eps, norm=norm, steps=5, clip_min=0.0, clip_max=1.0, seed=3)
    )
    delta = (res.X_adv - X).reshape(len(X), -1)
    size = delta.abs().amax(1) if norm == "linf" else delta.norm(dim=1)
    assert float(size.max()) <= eps * (1 + 1e-12)
    assert float(res.X_adv.min()) >= 0.0 and float(res.X_adv.max()) <= 1.0
    if method == "none":
        assert torch.equal(res.X_adv, X)
        assert res.radius_max == 0.0 and res.radius_mean == 0.0
    else:
        assert res.radius_mean > 0
    if norm == "linf" and method in ("fgsm", "pgd", "mim"):
        # digits has pixels strictly inside (0, 1) far from both ends: each row moves one by the full eps
        # (the reported radius by hand is checked in test_reported_radius_by_hand)
        assert res.radius_max == pytest.approx(eps, rel=1e-12) and res.radius_mean == pytest.approx(eps, rel=1e-12)


def test_random_control_radius_without_clipping(trained):
    nets, X, y = trained
    l2 = perturb(nets["relu"], X, y, AttackConfig(method="random", eps=1.5, norm="l2", seed=1))
    torch.testing.assert_close((l2.X_adv - X).norm(dim=1), torch.full((len(X),), 1.5, dtype=F64))  # on the sphere
    assert l2.radius_max == pytest.approx(1.5, rel=1e-12) and l2.radius_mean == pytest.approx(1.5, rel=1e-12)
    li = perturb(nets["relu"], X, y, AttackConfig(method="random", eps=0.2, norm="linf", seed=1))
    d = (li.X_adv - X).flatten()
    assert float(d.abs().max()) <= 0.2 and float(d.abs().max()) > 0.19  # fills the cube
    assert abs(float(d.mean())) < 0.01  # symmetric noise


@pytest.mark.parametrize("arch", ["relu", "attn"])
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_beats_random_and_fgsm(trained, arch, norm):
    nets, X, y = trained
    eps = 0.1 if norm == "linf" else 0.8
    common = dict(eps=eps, norm=norm, clip_min=0.0, clip_max=1.0, seed=0)
    loss = {
        m: perturb(nets[arch], X, y, AttackConfig(method=m, steps=10, **common))
        for m in ("pgd", "fgsm", "random", "mim")
    }
    clean = loss["pgd"].loss_before
    assert loss["pgd"].loss_after > loss["random"].loss_after > 0
    assert loss["pgd"].loss_after >= loss["fgsm"].loss_after  # on average over the samples
    assert loss["fgsm"].loss_after > clean and loss["mim"].loss_after > clean
    # per sample too: PGD beats noise of the same radius on nearly every sample
    net = nets[arch]
    with torch.no_grad():
        lp = per_sample_loss(net(loss["pgd"].X_adv), y, "mse")
        lr = per_sample_loss(net(loss["random"].X_adv), y, "mse")
    assert float((lp > lr).double().mean()) > 0.95


def _linear_model():
    gen = torch.Generator().manual_seed(0)  # local RNG: the global one is left alone
    lin = nn.Linear(5, 3, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 5, generator=gen, dtype=F64) / 5**0.5)
    x = torch.rand(4, 5, generator=gen, dtype=F64)
    y = torch.tensor([0, 1, 2, 1])
    t = torch.nn.functional.one_hot(y, 3).double()
    return lin, x, y, t


def _grad_x(lin, x, t):  # d/dx 0.5 ||W x - t||^2 = W^T (W x - t), by hand
    W = lin.weight.detach()
    return (x @ W.T - t) @ W


def test_fgsm_and_pgd_steps_by_hand():
    lin, x, y, t = _linear_model()
    g = _grad_x(lin, x, t)
    fg = perturb(lin, x, y, AttackConfig(method="fgsm", eps=0.05, norm="linf", clip_min=0.0, clip_max=1.0))
    torch.testing.assert_close(fg.X_adv, (x + 0.05 * g.sign()).clamp(0, 1))
    fl2 = perturb(lin, x, y, AttackConfig(method="fgsm", eps=0.05, norm="l2"))
    torch.testing.assert_close(fl2.X_adv, x + 0.05 * g / g.norm(dim=1, keepdim=True))
    # two PGD steps without random start, step 0.04 inside eps 0.05: the second is projected back
    pg = perturb(lin, x, y, AttackConfig(method="pgd", eps=0.05, steps=2, step_size=0.04, random_start=False))
    d1 = 0.04 * g.sign()
    g2 = _grad_x(lin, x + d1, t)
    torch.testing.assert_close(pg.X_adv, x + (d1 + 0.04 * g2.sign()).clamp(-0.05, 0.05))


def _identity_model():
    lin = nn.Linear(3, 3, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.eye(3, dtype=F64))  # f(x) = x: the MSE input gradient is x - onehot(y)
    return lin


def test_reported_radius_by_hand():
    lin = _identity_model()
    # L-inf FGSM, eps 0.3, clipped to [0, 1]; gradients x - onehot(y):
    # row 0: (0.9, 0.95, -0.8)  -> x + 0.3 sign = (1.2, 1.25, -0.1) -> clip (1, 1, 0): |delta| = (0.1, 0.05, 0.2)
    # row 1: (-0.95, 0.85, 0.9) -> (-0.25, 1.15, 1.2) -> clip (0, 1, 1): |delta| = (0.05, 0.15, 0.1)
    x = torch.tensor([[0.9, 0.95, 0.2], [0.05, 0.85, 0.9]], dtype=F64)
    y = torch.tensor([2, 0])
    res = perturb(lin, x, y, AttackConfig(method="fgsm", eps=0.3, norm="linf", clip_min=0.0, clip_max=1.0))
    assert res.radius_max == pytest.approx(0.2, rel=1e-12) and res.radius_mean == pytest.approx(0.175, rel=1e-12)
    assert res.to_dict()["perturbation_norm_max"] == pytest.approx(0.2, rel=1e-12)
    # L2 FGSM, eps 0.3, clipped: row 0 gradient (1, 1, -0.5), norm 1.5: step (0.2, 0.2, -0.1), the first two
    # coordinates sit at 1 and stay, delta (0, 0, -0.1); row 1 gradient (0, -0.8, 0): step -0.3 from 0.2 is
    # clipped at 0, delta (0, -0.2, 0)
    x = torch.tensor([[1.0, 1.0, 0.5], [0.0, 0.2, 0.0]], dtype=F64)
    y = torch.tensor([2, 1])
    res = perturb(lin, x, y, AttackConfig(method="fgsm", eps=0.3, norm="l2", clip_min=0.0, clip_max=1.0))
    assert res.radius_max == pytest.approx(0.2, rel=1e-12) and res.radius_mean == pytest.approx(0.15, rel=1e-12)
    # without a valid range an L2 FGSM step has length exactly eps on every row
    lin, x, y, _ = _linear_model()
    res = perturb(lin, x, y, AttackConfig(method="fgsm", eps=0.05, norm="l2"))
    assert res.radius_max == pytest.approx(0.05, rel=1e-12) and res.radius_mean == pytest.approx(0.05, rel=1e-12)


def test_mim_momentum_by_hand():
    lin, x, y, t = _linear_model()
    mu, alpha, eps = 0.9, 0.02, 0.05
    res = perturb(lin, x, y, AttackConfig(method="mim", eps=eps, steps=2, step_size=alpha, momentum=mu))
    g1 = _grad_x(lin, x, t)
    m1 = g1 / g1.abs().sum(1, keepdim=True)
    d = alpha * m1.sign()
    g2 = _grad_x(lin, x + d, t)
    m2 = mu * m1 + g2 / g2.abs().sum(1, keepdim=True)
    d = (d + alpha * m2.sign()).clamp(-eps, eps)
    torch.testing.assert_close(res.X_adv, x + d)


def test_deterministic_given_seed(trained):
    nets, X, y = trained
    for method in ("pgd", "random"):
        a = perturb(nets["attn"], X, y, AttackConfig(method=method, eps=0.1, seed=7, clip_min=0.0, clip_max=1.0))
        b = perturb(
            nets["attn"], X, y, AttackConfig(method=method, eps=0.1, seed=7, clip_min=0.0, clip_max=1.0, chunk_size=50)
        )
        c = perturb(nets["attn"], X, y, AttackConfig(method=method, eps=0.1, seed=8, clip_min=0.0, clip_max=1.0))
        torch.testing.assert_close(a.X_adv, b.X_adv, rtol=0, atol=1e-13)
        assert not torch.equal(a.X_adv, c.X_adv)


def test_a_memory_budget_attacks_in_chunks_that_fit_it_with_the_same_result(trained):
    """The budget bounds one chunk's graph for the input gradient. Truth for the bytes per row:
    autograd's saved tensors counted by hand in forward passes of a frozen copy with the input
    requiring grad, at 16 rows less at 8 rows, over 8 (what each further row adds; the
    parameters' own probe, which tracks one small parameter, would see almost none of the
    activations); the perturbed rows equal the unchunked attack's."""
    import copy

    nets, X, y = trained
    net = nets["attn"]
    frozen = copy.deepcopy(net).requires_grad_(False)

    def saved_bytes(rows: int) -> int:
        saved = 0

        def pack(t):
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t

        x = X[:rows].clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            per_sample_loss(frozen(x), y[:rows], "mse").sum()
        return saved

    per_row = (saved_bytes(16) - saved_bytes(8)) / 8
    assert per_row > 0
    budget_mb = 20 * per_row / 2**20  # room for 20 rows' graphs
    whole = perturb(net, X, y, AttackConfig(method="pgd", eps=0.1, seed=3, clip_min=0.0, clip_max=1.0))
    planned = perturb(
        net, X, y, AttackConfig(method="pgd", eps=0.1, seed=3, clip_min=0.0, clip_max=1.0, memory_mb=budget_mb)
    )
    assert whole.chunk_rows == X.shape[0] and planned.chunk_rows == 20
    assert planned.to_dict()["chunk_rows"] == 20
    torch.testing.assert_close(planned.X_adv, whole.X_adv, rtol=0, atol=1e-13)
    assert planned.loss_after == pytest.approx(whole.loss_after, rel=1e-12)
    # the controls draw no gradient: their chunk is not planned
    assert perturb(net, X, y, AttackConfig(method="random", eps=0.1, memory_mb=budget_mb)).chunk_rows == X.shape[0]


def test_model_parameters_untouched(trained):
    nets, X, y = trained
    before = {k: v.clone() for k, v in nets["relu"].state_dict().items()}
    perturb(nets["relu"], X, y, AttackConfig(method="pgd", eps=0.1))
    for k, v in nets["relu"].state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.requires_grad for p in nets["relu"].parameters())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(method="cw"),
        dict(eps=0.0),
        dict(eps=-1.0),
        dict(norm="l1"),
        dict(steps=0),
        dict(step_size=-0.1),
        dict(clip_min=1.0, clip_max=0.0),
        dict(clip_min=0.0),
        dict(memory_mb=0.0),
        dict(memory_mb=float("nan")),
    ],
)
def test_bad_attack_config_rejected(kwargs):
    with pytest.raises(AuditError):
        AttackConfig(**kwargs)


def test_data_outside_valid_range_rejected(trained):
    nets, X, y = trained
    with pytest.raises(AuditError, match="valid range"):
        perturb(nets["relu"], X * 2, y, AttackConfig(method="fgsm", eps=0.1, clip_min=0.0, clip_max=1.0))


def test_range_is_checked_again_after_the_data_changes_in_place_and_for_another_range(trained):
    """A tensor that passed the range check is not re-read while unchanged; an in-place
    change, another range, or another tensor with the same values is checked afresh."""
    nets, X, y = trained
    cfg = AttackConfig(method="fgsm", eps=0.1, clip_min=0.0, clip_max=1.0)
    data = X.clone()
    perturb(nets["relu"], data, y, cfg)  # passes, remembered
    perturb(nets["relu"], data, y, cfg)
    with pytest.raises(AuditError, match="valid range"):
        perturb(nets["relu"], data, y, AttackConfig(method="fgsm", eps=0.1, clip_min=0.0, clip_max=0.5))
    data.mul_(3.0)
    with pytest.raises(AuditError, match="valid range"):
        perturb(nets["relu"], data, y, cfg)


def test_an_engine_built_once_attacks_like_the_module(trained):
    from attnaudit.analyses.malleability.attacks import attack_engine

    nets, X, y = trained
    cfg = AttackConfig(method="pgd", eps=0.1, steps=3, clip_min=0.0, clip_max=1.0, seed=1)
    engine = attack_engine(nets["attn"], X, "mse")
    once = perturb(engine, X, y, cfg)
    assert torch.equal(once.X_adv, perturb(nets["attn"], X, y, cfg).X_adv)
    assert once.loss_after == perturb(engine, X, y, cfg).loss_after


# ---------------------------------------------------------------- any module, through the core
def test_task_and_bare_module_give_identical_attacks(trained):
    from attnaudit.core.task import Task

    nets, X, y = trained
    for arch in ("relu", "attn"):
        for method in ("pgd", "mim"):
            cfg = AttackConfig(method=method, eps=0.1, steps=3, clip_min=0.0, clip_max=1.0, seed=2)
            bare = perturb(nets[arch], X, y, cfg)
            task = perturb(Task(nets[arch], 10, "mse"), X, y, cfg)
            assert torch.equal(bare.X_adv, task.X_adv) and bare.loss_after == task.loss_after


def _dropout_net(train_mode=True):
    gen = torch.Generator().manual_seed(4)
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return net.train(train_mode)


def test_attack_runs_in_eval_mode_and_leaves_the_model_as_it_was():
    net = _dropout_net()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand(16, 5, generator=gen, dtype=F64), torch.randint(0, 3, (16,), generator=gen)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    cfg = AttackConfig(method="pgd", eps=0.1, steps=4, clip_min=0.0, clip_max=1.0, seed=0)
    a, b = perturb(net, x, y, cfg), perturb(net, x, y, cfg)
    assert torch.equal(a.X_adv, b.X_adv)  # no dropout noise
    assert net.training and all(m.training for m in net.modules())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert all(p.requires_grad for p in net.parameters())
    plain = nn.Sequential(net[0], net[1], net[3])  # eval-mode dropout is the identity
    torch.testing.assert_close(a.X_adv, perturb(plain, x, y, cfg).X_adv, rtol=0, atol=0)


def test_float32_model_is_attacked_without_being_cast():
    lin, x, y, t = _linear_model()
    lin32 = nn.Linear(5, 3, bias=False)
    with torch.no_grad():
        lin32.weight.copy_(lin.weight.float())
    w_before = lin32.weight.detach().clone()
    res = perturb(lin32, x, y, AttackConfig(method="fgsm", eps=0.05, norm="linf"))
    assert lin32.weight.dtype == torch.float32 and torch.equal(lin32.weight, w_before)
    assert res.X_adv.dtype == F64
    g = _grad_x(lin, x, t)  # the float64 gradient by hand; its signs are far from zero here
    assert float(g.abs().min()) > 1e-3
    torch.testing.assert_close(res.X_adv, x + 0.05 * g.sign())


def test_image_attention_module_fgsm_by_hand():
    from attnaudit.core.task import Inputs, Task

    gen = torch.Generator().manual_seed(3)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
            self.double()
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))

        def forward(self, img):
            t = img[:, 0]
            return self.head(torch.nn.functional.scaled_dot_product_attention(self.q(t), self.k(t), self.v(t)).mean(1))

    model = Tiny()
    x, y = torch.rand(6, 16, generator=gen, dtype=F64), torch.tensor([0, 1, 2, 0, 1, 2])
    res = perturb(Task(model, 3, "ce", Inputs("images", (1, 4, 4))), x, y, AttackConfig(method="fgsm", eps=0.05))

    def loss_by_hand(rows):  # explicit softmax attention, cross-entropy
        t = rows.view(-1, 4, 4)
        Q, K, V = model.q(t), model.k(t), model.v(t)
        f = model.head((torch.softmax(Q @ K.transpose(1, 2) / 2.0, -1) @ V).mean(1))
        return torch.nn.functional.cross_entropy(f, y, reduction="sum")

    xr = x.clone().requires_grad_()
    g = torch.autograd.grad(loss_by_hand(xr), xr)[0]
    torch.testing.assert_close(res.X_adv, x + 0.05 * g.sign())
    assert res.loss_after > res.loss_before


def test_token_inputs_are_refused_for_gradient_attacks():
    from attnaudit.core.task import Inputs, Task

    emb = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(6, 2)).double()
    x, y = torch.tensor([[0.0, 1.0], [2.0, 3.0]], dtype=F64), torch.tensor([0, 1])
    with pytest.raises(AuditError, match="token ids"):
        perturb(Task(emb, 2, "ce", Inputs("tokens", (2,))), x, y, AttackConfig(method="fgsm", eps=0.1))


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_sign_control_stays_in_ball_range_and_is_deterministic(trained, norm):
    nets, X, y = trained
    eps = 0.3 if norm == "linf" else 2.0
    cfg = AttackConfig(method="sign", eps=eps, norm=norm, clip_min=0.0, clip_max=1.0, seed=3)
    res = perturb(nets["relu"], X, y, cfg)
    delta = (res.X_adv - X).reshape(len(X), -1)
    size = delta.abs().amax(1) if norm == "linf" else delta.norm(dim=1)
    assert float(size.max()) <= eps * (1 + 1e-12)
    assert float(res.X_adv.min()) >= 0.0 and float(res.X_adv.max()) <= 1.0
    assert torch.equal(perturb(nets["relu"], X, y, cfg).X_adv, res.X_adv)
    assert not torch.equal(
        perturb(
            nets["relu"], X, y, AttackConfig(method="sign", eps=eps, norm=norm, seed=4, clip_min=0.0, clip_max=1.0)
        ).X_adv,
        res.X_adv,
    )
    # the L-inf and L2 norms of the applied perturbation, reported whatever the attack's norm
    assert res.linf_max == pytest.approx(float(delta.abs().amax(1).max()))
    assert res.l2_mean == pytest.approx(float(delta.norm(dim=1).mean()))
    # sign noise of the same radius is bigger than uniform noise (the old control) on average
    uni = perturb(
        nets["relu"], X, y, AttackConfig(method="random", eps=eps, norm=norm, clip_min=0.0, clip_max=1.0, seed=3)
    )
    if norm == "linf":
        assert res.l2_mean > 1.3 * uni.l2_mean
