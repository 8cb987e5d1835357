"""The functional engine (attnaudit.core) on a small user-written transformer.

The model under test is a ViT-like module written here the way a user would write one:
float32 parameters, images (B, 1, 8, 8) cut into patches, a learned position embedding,
one pre-norm attention block whose trainable Q/K/V projections feed
``torch.nn.functional.scaled_dot_product_attention`` (2 heads), an MLP, dropout, mean
pooling and a ``head`` Linear to 3 classes.

Ground truth is computed independently of the engine: plain ``torch.autograd.grad`` loops
on a float64 deep copy of the model in eval mode, central finite differences of those
gradients, ``torch.autograd.functional.hessian`` / ``jacobian``, and the loss written
out with ``torch.nn.functional.cross_entropy``. Every second derivative of the reference
runs inside ``sdpa_kernel(SDPBackend.MATH)`` (the fused CPU kernel has no double backward).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnaudit.core.engine import Engine
from attnaudit.core.task import Inputs, Task, to_logits
from attnaudit.errors import AuditError

F64 = torch.float64
N, C = 6, 3
IMAGES = Inputs("images", (1, 8, 8))


# --------------------------------------------------------------------------- the user's model


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, p_drop: float):
        super().__init__()
        self.heads, self.p_drop = heads, p_drop
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, L, D = h.shape

        def split(t):
            return t.reshape(B, L, self.heads, D // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), dropout_p=self.p_drop if self.training else 0.0
        )
        return self.proj(a.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, p_drop: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, p_drop)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(p_drop)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.drop(self.attn(self.ln1(h)))
        return h + self.drop(self.mlp(self.ln2(h)))


class TinyViT(nn.Module):
    """(B, 1, 8, 8) -> patches -> embedding + position -> attention block -> mean pool -> head.

    ``head_first``: register the head Linear before everything else (it still runs last).
    """

    def __init__(self, patch=4, dim=8, heads=2, classes=C, p_drop=0.1, image=8, head_first=False, seed=0):
        super().__init__()
        if head_first:
            self.head = nn.Linear(dim, classes)
        self.patch, self.tokens = patch, (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(torch.zeros(1, self.tokens, dim))
        self.block = Block(dim, heads, p_drop)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(p_drop)
        if not head_first:
            self.head = nn.Linear(dim, classes)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # random values everywhere (LayerNorm affine included), float32
            for p in self.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, Ch, H, W = x.shape
        p = self.patch
        patches = x.reshape(B, Ch, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, Ch * p * p)
        h = self.block(self.embed(patches) + self.pos)
        return self.head(self.drop(self.norm(h).mean(1)))


def _data(n=N, d=64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randint(0, C, (n,), generator=gen)
    return X, y


def _onehot(y):
    return F.one_hot(y, C).to(F64)


@pytest.fixture(scope="module")
def vit():
    return TinyViT()


@pytest.fixture(scope="module")
def data():
    return _data()


@pytest.fixture(scope="module")
def engine(vit):
    return Engine(Task(vit, C, "ce", IMAGES), dtype=F64)


# --------------------------------------------------------------------------- independent references


def _reference(model):
    """Float64 deep copy in eval mode; the user's module is not touched."""
    return copy.deepcopy(model).double().eval()


def _ref_params(ref, names=None):
    named = dict(ref.named_parameters())
    names = names if names is not None else list(named)
    return names, [named[n] for n in names]


def _ref_mean_grad(ref, params, X, y):
    """Gradient of the mean cross-entropy (a tuple of tensors -> one flat vector)."""
    loss = F.cross_entropy(ref(X.reshape(-1, 1, 8, 8)), y, reduction="mean")
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def _functional(ref, names):
    """theta (flat, over ``names``) -> the reference module with those values (torch.func.functional_call)."""
    named = dict(ref.named_parameters())
    shapes = [named[n].shape for n in names]
    sizes = [named[n].numel() for n in names]

    def call(theta, x):
        parts = dict(zip(names, (t.view(s) for t, s in zip(torch.split(theta, sizes), shapes))))
        return torch.func.functional_call(ref, parts, (x,))

    theta0 = torch.cat([named[n].detach().reshape(-1) for n in names])
    return call, theta0


# --------------------------------------------------------------------------- per-sample gradients


def test_per_sample_grads_match_an_autograd_loop(vit, data, engine):
    X, y = data
    ref = _reference(vit)
    names, params = _ref_params(ref)
    assert engine.names == names  # default selector 'all', registration order
    assert engine.n_params == sum(p.numel() for p in params)
    loop = torch.stack(
        [
            torch.cat(
                [
                    g.reshape(-1)
                    for g in torch.autograd.grad(
                        F.cross_entropy(ref(X[i].reshape(1, 1, 8, 8)), y[i : i + 1], reduction="sum"), params
                    )
                ]
            )
            for i in range(N)
        ]
    )
    G = engine.per_sample_grads(X, _onehot(y))
    assert G.dtype == F64 and G.shape == loop.shape
    assert torch.allclose(G, loop, rtol=0, atol=1e-10)
    assert torch.allclose(engine.per_sample_grads(X, _onehot(y), chunk=4), loop, rtol=0, atol=1e-10)
    assert torch.allclose(engine.summed_grad(X, _onehot(y), chunk=4), loop.sum(0), rtol=0, atol=1e-10)
    # the logits themselves, against the reference forward
    assert torch.allclose(engine.logits(X), ref(X.reshape(-1, 1, 8, 8)).detach(), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- Hessian-vector products


def _fd_hvp(ref, params, X, y, v, eps=1e-5):
    """Central differences of the reference gradient of the mean loss along v."""
    sizes = [p.numel() for p in params]

    def shift(scale):
        with torch.no_grad():
            for p, part in zip(params, torch.split(v, sizes)):
                p.add_(scale * part.view_as(p))

    shift(eps)
    g_plus = _ref_mean_grad(ref, params, X, y)
    shift(-2 * eps)
    g_minus = _ref_mean_grad(ref, params, X, y)
    shift(eps)
    return (g_plus - g_minus) / (2 * eps)


@pytest.mark.parametrize("mode", ["forward-over-reverse", "reverse-over-reverse"])
def test_hvp_matches_finite_differences_of_gradients(vit, data, engine, mode):
    X, y = data
    ref = _reference(vit)
    _, params = _ref_params(ref)
    gen = torch.Generator().manual_seed(7)
    V = torch.randn(2, engine.n_params, generator=gen, dtype=F64)
    op = engine.hvp_operator(X, _onehot(y), chunk=4)  # two chunks: the sum over chunks is tested too
    op.mode = mode
    HV = op.matmat(V)
    assert op.mode == mode  # forced mode kept; forward-over-reverse works thanks to the math kernel
    with sdpa_kernel(SDPBackend.MATH):
        fd = torch.stack([_fd_hvp(ref, params, X, y, v) for v in V])
    rel = (HV - fd).norm(dim=1) / fd.norm(dim=1)
    assert rel.max() < 1e-6, rel
    assert torch.allclose(op.matvec(V[0]), HV[0], rtol=0, atol=1e-12)
    assert op.calls == 3


@pytest.mark.parametrize("mode", ["forward-over-reverse", "reverse-over-reverse"])
def test_hvp_on_the_head_matches_the_dense_autograd_hessian(vit, data, mode):
    X, y = data
    eng = Engine(Task(vit, C, "ce", IMAGES, params="head"), dtype=F64)
    assert eng.names == ["head.weight", "head.bias"]
    ref = _reference(vit)
    call, theta0 = _functional(ref, eng.names)
    with sdpa_kernel(SDPBackend.MATH):
        H = torch.autograd.functional.hessian(
            lambda t: F.cross_entropy(call(t, X.reshape(-1, 1, 8, 8)), y, reduction="mean"), theta0
        )
    op = eng.hvp_operator(X, _onehot(y))
    op.mode = mode
    HE = op.matmat(torch.eye(eng.n_params, dtype=F64))
    assert torch.allclose(HE, H, rtol=0, atol=1e-10)
    assert torch.allclose(op.dense(block=10), 0.5 * (H + H.T), rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- the empirical NTK


def _ref_jacobians(vit, X):
    ref = _reference(vit)
    call, theta0 = _functional(ref, [n for n, _ in ref.named_parameters()])
    return torch.stack(
        [torch.autograd.functional.jacobian(lambda t: call(t, x.reshape(1, 1, 8, 8)).squeeze(0), theta0) for x in X]
    )  # (n, c, P)


def test_entk_matches_explicit_jacobian_contraction(vit, data, engine):
    X, _ = data
    J = _ref_jacobians(vit, X)
    assert torch.allclose(engine.jacobian(X), J, rtol=0, atol=1e-10)
    K_ref = torch.einsum("iap,jbp->ijab", J, J)
    K = engine.entk(X)
    assert K.shape == (N, N, C, C)
    assert torch.allclose(K, K_ref, rtol=1e-10, atol=1e-10)
    Kt = engine.entk(X, form="trace")
    assert Kt.shape == (N, N)
    assert torch.allclose(Kt, torch.einsum("ijaa->ij", K_ref) / C, rtol=1e-10, atol=1e-10)
    # a rectangular block, and a tiny memory budget (chunks of one row, X2 recomputed)
    K12 = engine.entk(X[:2], X[2:], memory_bytes=1)
    assert torch.allclose(K12, K_ref[:2, 2:], rtol=1e-10, atol=1e-10)
    with pytest.raises(AuditError, match="diag"):
        engine.entk(X, form="diag")


def test_float32_rows_are_cast_to_the_engine_dtype_everywhere(data, engine):
    X, y = data
    T = _onehot(y)
    assert torch.allclose(
        engine.hvp_operator(X.float(), T).matvec(torch.ones(engine.n_params, dtype=F64)),
        engine.hvp_operator(engine.rows(X.float()), T).matvec(torch.ones(engine.n_params, dtype=F64)),
    )
    G = engine.per_sample_grads(X.float(), T)
    assert torch.equal(G, engine.per_sample_grads(engine.rows(X.float()), T))


# --------------------------------------------------------------------------- input gradients


def test_input_grads_match_finite_differences(vit, data, engine):
    X, y = data
    G = engine.input_grads(X, _onehot(y))
    assert G.shape == X.shape
    ref = _reference(vit)
    eps, i = 1e-5, 2
    E = eps * torch.eye(64, dtype=F64)
    with torch.no_grad():

        def losses(rows):
            return F.cross_entropy(ref(rows.reshape(-1, 1, 8, 8)), y[i].expand(rows.shape[0]), reduction="none")

        fd = (losses(X[i] + E) - losses(X[i] - E)) / (2 * eps)
    assert torch.allclose(G[i], fd, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------- parameter selectors


def test_head_selector_on_a_sequential():
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert Task(mlp, 2, params="head").parameter_names() == ["2.weight", "2.bias"]
    assert Task(mlp, 2, params="head").parameter_names(probe=torch.zeros(2, 3)) == ["2.weight", "2.bias"]


def test_selectors_on_the_transformer(vit):
    def names(sel, probe=None, model=vit):
        return Task(model, C, "ce", IMAGES, params=sel).parameter_names(probe)

    assert names("head") == ["head.weight", "head.bias"]
    attn = [f"block.attn.{m}.{w}" for m in ("q", "k", "v", "proj") for w in ("weight", "bias")]
    assert names("block.attn") == attn
    biases = [n for n, _ in vit.named_parameters() if n.endswith(".bias")]
    assert names("*.bias") == biases and len(biases) == 11
    # comma lists and lists, resolved in registration order, duplicates once
    assert names("head, block.attn.q.*, pos") == [
        "pos",
        "block.attn.q.weight",
        "block.attn.q.bias",
        "head.weight",
        "head.bias",
    ]
    assert names(["head", "head.bias", "pos"]) == ["pos", "head.weight", "head.bias"]
    assert names("all") == [n for n, _ in vit.named_parameters()]
    with pytest.raises(AuditError, match=r"nope\.\*"):
        names("head,nope.*")
    with pytest.raises(AuditError, match="block.atn"):
        names("block.atn")


class HeadFirst(nn.Module):
    """The logits layer registered first, run last; no parameter held by the root itself."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, C)
        self.body = TinyViT(classes=8, seed=5)  # its own 'head' is an inner Linear(8, 8) here

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def test_head_found_by_a_probe_when_registered_first():
    model = HeadFirst()
    assert next(iter(dict(model.named_parameters()))) == "head.weight"
    task = Task(model, C, "ce", IMAGES, params="head")
    X, _ = _data()
    # the probe pass finds the layer that runs last (rows in the module's own dtype)
    assert task.parameter_names(probe=X.float()) == ["head.weight", "head.bias"]
    # without a probe, the documented fallback: the last leaf module holding parameters in
    # the module tree (definition order) — here the body's inner Linear, not the logits layer
    assert task.parameter_names() == ["body.head.weight", "body.head.bias"]
    # the engine resolves 'head' with its probe rows too
    assert Engine(task, dtype=F64, probe=X.float()).names == ["head.weight", "head.bias"]


def test_head_probe_with_a_parameter_on_the_root_module():
    X, _ = _data()
    for model in (TinyViT(), TinyViT(head_first=True)):
        assert "pos" in dict(model.named_parameters(recurse=False))
        task = Task(model, C, "ce", IMAGES, params="head")
        assert task.parameter_names(probe=X.float()) == ["head.weight", "head.bias"]


def test_head_probe_with_float64_rows_on_a_float32_module():
    task = Task(HeadFirst(), C, "ce", IMAGES, params="head")
    X, _ = _data()
    assert task.parameter_names(probe=X) == ["head.weight", "head.bias"]


# --------------------------------------------------------------------------- output adapters


@dataclass
class _Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_output_adapters():
    z = torch.arange(6.0).reshape(2, 3)
    assert to_logits(z) is z
    assert to_logits((z, torch.zeros(1))) is z
    assert to_logits([z]) is z
    assert to_logits({"logits": z, "hidden": torch.zeros(2)}) is z
    assert to_logits(_Output(z)) is z
    assert to_logits(torch.ones(4)).shape == (4, 1)
    with pytest.raises(AuditError, match="pool"):
        to_logits(torch.zeros(2, 5, 3))
    with pytest.raises(AuditError, match="logits"):
        to_logits({"scores": z})


# --------------------------------------------------------------------------- eval mode, no mutation


def _snapshot(model):
    return {k: (v.dtype, v.detach().cpu().numpy().tobytes()) for k, v in model.state_dict().items()}


def test_eval_mode_and_the_users_module_untouched():
    model = TinyViT(p_drop=0.5, seed=3).train()
    flags = [m.training for m in model.modules()]
    before = _snapshot(model)
    assert all(dtype == torch.float32 for dtype, _ in before.values())
    X, y = _data(seed=4)
    T = _onehot(y)

    def untouched():
        assert model.training and [m.training for m in model.modules()] == flags
        assert _snapshot(model) == before

    eng = Engine(Task(model, C, "ce", IMAGES), dtype=F64)
    untouched()
    G1 = eng.per_sample_grads(X, T)
    untouched()
    G2 = eng.per_sample_grads(X, T)
    untouched()
    assert torch.equal(G1, G2)
    # and they are the eval-mode gradients (dropout off)
    ref = _reference(model)
    _, params = _ref_params(ref)
    g0 = torch.autograd.grad(F.cross_entropy(ref(X[:1].reshape(1, 1, 8, 8)), y[:1], reduction="sum"), params)
    assert torch.allclose(G1[0], torch.cat([g.reshape(-1) for g in g0]), rtol=0, atol=1e-10)
    for call in (
        lambda: eng.logits(X),
        lambda: eng.summed_grad(X, T),
        lambda: eng.input_grads(X, T),
        lambda: eng.hvp_operator(X, T).matvec(torch.ones(eng.n_params, dtype=F64)),
        lambda: eng.entk(X[:2], form="trace"),
        lambda: eng.probe_bytes_per_sample(X),
        lambda: Task(model, C, "ce", IMAGES, params="head").parameter_names(probe=X.float()),
        lambda: Engine(Task(model, C, "ce", IMAGES, params="head.*"), dtype=F64).theta,
    ):
        a, b = call(), call()
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b
        untouched()


# --------------------------------------------------------------------------- scaled dot-product attention


def test_math_kernel_makes_second_derivatives_work_through_sdpa(vit, data, engine):
    X, y = data
    # the engine: reverse-over-reverse HVP through SDPA, no fallback needed
    op = engine.hvp_operator(X, _onehot(y))
    v = torch.randn(engine.n_params, generator=torch.Generator().manual_seed(5), dtype=F64)
    hv = op.matvec(v)
    assert op.mode == "reverse-over-reverse"
    ref = _reference(vit)
    _, params = _ref_params(ref)
    with sdpa_kernel(SDPBackend.MATH):
        g = _ref_mean_grad_graph(ref, params, X, y)
        exact = torch.cat([t.reshape(-1) for t in torch.autograd.grad(g @ v, params)])
    assert torch.allclose(hv, exact, rtol=0, atol=1e-10)
    # without forcing the math kernel, the fused CPU kernel has no double backward
    try:
        g = _ref_mean_grad_graph(ref, params, X, y)
        torch.autograd.grad(g @ v, params)
    except (RuntimeError, NotImplementedError) as err:
        assert "scaled_dot_product" in str(err) or "not implemented" in str(err)
    else:
        pytest.skip(f"torch {torch.__version__}: SDPA's default CPU kernel has a double backward; nothing to show")


def _ref_mean_grad_graph(ref, params, X, y):
    loss = F.cross_entropy(ref(X.reshape(-1, 1, 8, 8)), y, reduction="mean")
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, create_graph=True)])


# --------------------------------------------------------------------------- memory planner


def test_probe_bytes_grow_with_tokens_and_plan_chunk_respects_the_budget():
    X, _ = _data()
    few = Engine(Task(TinyViT(patch=4), C, "ce", IMAGES), dtype=F64)  # 4 tokens
    many = Engine(Task(TinyViT(patch=2), C, "ce", IMAGES), dtype=F64)  # 16 tokens, same widths
    b4, b16 = few.probe_bytes_per_sample(X), many.probe_bytes_per_sample(X)
    assert b16 > 2 * b4 > 0
    for budget in (b16 * 10 + 7, b16 * 3, 1.0):
        chunk = many.plan_chunk(X, budget)
        assert chunk >= 1
        if budget >= b16:
            assert chunk * b16 <= budget < (chunk + 1) * b16
        else:
            assert chunk == 1  # never below one row
    extra = 1000
    chunk = many.plan_chunk(X, 10 * (b16 + extra), per_sample_extra=extra)
    assert chunk * (b16 + extra) <= 10 * (b16 + extra) and chunk == 10
    assert many.plan_chunk(X, 1e15, limit=33) == 33


# --------------------------------------------------------------------------- token inputs


class TokenModel(nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, C)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def test_token_inputs():
    model = TokenModel()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (N, 5), generator=gen)
    y = torch.randint(0, C, (N,), generator=gen)
    X = ids.to(F64)  # the data layer's flat rows: integer ids as floats
    eng = Engine(Task(model, C, "ce", Inputs("tokens", (5,))), dtype=F64)
    G = eng.per_sample_grads(X, _onehot(y))
    ref = _reference(model)
    _, params = _ref_params(ref)
    loop = torch.stack(
        [
            torch.cat(
                [
                    g.reshape(-1)
                    for g in torch.autograd.grad(
                        F.cross_entropy(ref(ids[i : i + 1]), y[i : i + 1], reduction="sum"), params
                    )
                ]
            )
            for i in range(N)
        ]
    )
    assert torch.allclose(G, loop, rtol=0, atol=1e-12)
    with pytest.raises(AuditError, match="token"):
        eng.input_grads(X, _onehot(y))


def test_saved_tensor_probe_frees_its_graph():
    """The planner's probe must not keep what it measured alive: a softmax saves its own output,
    and a pack hook that hands that output back unchanged makes a cycle the collector cannot free
    (every probe of a 124 M-parameter model then kept its weights and logits, 0.7 GiB a time)."""
    import gc
    import weakref

    from attnaudit.core.engine import saved_tensor_bytes

    theta = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    outputs: list[weakref.ref] = []

    def build() -> torch.Tensor:
        out = torch.softmax(torch.randn(32, 64, dtype=torch.float64) @ theta, -1)
        outputs.append(weakref.ref(out))
        return out.sum()

    # the product's row factor (32 x 64) and the softmax's output (32 x 64), 8 bytes each; theta is the caller's own
    assert saved_tensor_bytes(build, (theta,)) == 2 * 32 * 64 * 8
    gc.collect()
    assert outputs[0]() is None
