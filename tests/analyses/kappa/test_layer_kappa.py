"""`kappa --checkpoint`: per-layer conditioning of real transformers (attnaudit.analyses.kappa.layers).

Ground truth is always computed here, independently: activations captured by this file's
own forward hooks on its own float64 copy of the model, attention maps rebuilt by hand from
the projection weights, spectra from numpy (eigvalsh of X X^T, svd of A), the eNTK from an
explicit per-sample, per-output autograd loop.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from attnaudit.cli import app
from attnaudit.core.task import Inputs, Task
from attnaudit.errors import AuditError
from attnaudit.analyses.kappa.discovery import find_attention_layers
from attnaudit.analyses.kappa.entk import entk_gram
from attnaudit.analyses.kappa.layers import LayerKappaConfig, analyse_layers
from attnaudit.analyses.kappa.spread import Spread
from attnaudit.models.vit import Attention, ViT, ViTSpec

EPS = np.finfo(np.float64).eps
runner = CliRunner()


# --------------------------------------------------------------------------- independent helpers


def np_gram_kappa(T: np.ndarray) -> tuple[float, float, int]:
    """(kappa_d, kappa at numerical rank, rank) of G = T T^T for tokens T (N, D), numpy only.

    Rank rule: eigenvalues above max(N, D) eps lambda_max; kappa_d infinite below min(N, D).
    """
    N, D = T.shape
    lam = np.linalg.eigvalsh(T @ T.T)[::-1]
    tol = max(N, D) * EPS * lam[0]
    rank = int(np.sum(lam > tol))
    k = min(N, D)
    kd = math.inf if rank < k else lam[0] / lam[k - 1]
    return kd, lam[0] / lam[rank - 1], rank


def np_matrix_kappa(A: np.ndarray) -> tuple[float, int]:
    """(s_max / s_min or inf, numpy matrix_rank) of a square attention map."""
    s = np.linalg.svd(A, compute_uv=False)
    rank = int(np.linalg.matrix_rank(A))  # tol = s_max * max(M, N) * eps
    return (math.inf if rank < min(A.shape) else s[0] / s[-1]), rank


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def capture(module: nn.Module, names: list[str], run) -> dict:
    """(input, output) of each named submodule in one forward pass, with this file's own hooks."""
    got: dict = {}
    handles = []
    for name in names:
        sub = module.get_submodule(name)

        def hook(m, args, kwargs, out, name=name):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("query"))
            got[name] = (x.detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone())

        handles.append(sub.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            run(module)
    finally:
        for h in handles:
            h.remove()
    return got


def randomise(module: nn.Module, std: float, seed: int) -> nn.Module:
    """Weights far from the tiny init, so attention maps are far from uniform (LayerNorms kept as they are)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.LayerNorm):
                continue
            for p in sub.parameters(recurse=False):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return module


def assert_same_kappa(summary, expected: list[tuple[float, float, int]]) -> None:
    """A SpectrumSummary against per-sample (kappa_d, kappa_r, rank) computed here."""
    kd = np.array([e[0] for e in expected])
    kr = np.array([e[1] for e in expected])
    rank = np.array([e[2] for e in expected])
    np.testing.assert_array_equal(summary.rank, rank)
    np.testing.assert_array_equal(np.isinf(summary.kappa_full), np.isinf(kd))
    fin = np.isfinite(kd)
    np.testing.assert_allclose(summary.kappa_full[fin], kd[fin], rtol=1e-7)
    np.testing.assert_allclose(summary.kappa_rank, kr, rtol=1e-7)


def rows(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --------------------------------------------------------------------------- built-in ViT


@pytest.mark.parametrize("arch", ["vit", "vit-linear"])
def test_builtin_vit_layers_match_hand_computation(arch):
    spec = ViTSpec(arch=arch, image_shape=(1, 8, 8), n_out=10, depth=2, dim=8, heads=2, patch=2, seed=0)
    model = randomise(ViT(spec), 0.4, 1)  # float32, as a user's checkpoint would be
    X = rows(12, 64, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = analyse_layers(model, X, LayerKappaConfig(n=12))
    # the user's module is untouched: same dtype, same values
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k])
    assert [layer.name for layer in result.layers] == ["blocks.0.attn", "blocks.1.attn"]
    assert all(layer.kind == "builtin" for layer in result.layers)

    twin = copy.deepcopy(model).double().eval()
    got = capture(twin, ["blocks.0.attn", "blocks.1.attn"], lambda m: m(X.reshape(12, 1, 8, 8)))
    for layer in result.layers:
        h, out = (t.numpy() for t in got[layer.name])
        assert layer.tokens == 16 and layer.features_in == 8
        # tokens 16 > dim 8, and LayerNorm centres every token: rank 7 of 8, kappa_d infinite
        assert_same_kappa(layer.input, [np_gram_kappa(h[i]) for i in range(12)])
        assert layer.input.rank_deficient == 12 and np.isinf(layer.input.spread().median)
        assert_same_kappa(layer.output, [np_gram_kappa(out[i]) for i in range(12)])
        # attention maps by hand from the q/k weights
        attn = twin.get_submodule(layer.name)
        q = h @ attn.q.weight.detach().numpy().T + attn.q.bias.detach().numpy()
        k = h @ attn.k.weight.detach().numpy().T + attn.k.bias.detach().numpy()
        assert layer.heads is not None and len(layer.heads) == 2
        for head in range(2):
            qh, kh = q[:, :, head * 4 : (head + 1) * 4], k[:, :, head * 4 : (head + 1) * 4]
            scores = qh @ kh.transpose(0, 2, 1)
            A = scores / (2.0 * 16) if arch == "vit-linear" else softmax(scores / 2.0)
            expected = [np_matrix_kappa(A[i]) for i in range(12)]
            summary = layer.heads[head]
            np.testing.assert_array_equal(summary.rank, [e[1] for e in expected])
            kd = np.array([e[0] for e in expected])
            np.testing.assert_array_equal(np.isinf(summary.kappa_full), np.isinf(kd))
            np.testing.assert_allclose(summary.kappa_full[np.isfinite(kd)], kd[np.isfinite(kd)], rtol=1e-7)
            if arch == "vit-linear":  # q k^T of head dim 4: rank 4 of 16, never a round-off kappa
                assert (summary.rank == 4).all() and np.isinf(summary.kappa_full).all()
        # medians over samples, against numpy on the per-sample values computed here
        logs = np.log10([np_gram_kappa(out[i])[0] for i in range(12)])
        if np.isfinite(logs).all():
            assert layer.output.spread().median == pytest.approx(np.median(logs), rel=1e-9)
            assert layer.output.spread().p10 == pytest.approx(np.quantile(logs, 0.1), rel=1e-9)


# --------------------------------------------------------------------------- nn.MultiheadAttention


class MHAModel(nn.Module):
    """Image rows as 8 tokens, one nn.MultiheadAttention (called without weights), mean pool, head."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, num_heads=2, batch_first=batch_first)
        self.head = nn.Linear(16, 3)

    def forward(self, images: torch.Tensor) -> dict:
        t = self.embed(images[:, 0])  # (B, 8, 16)
        if not self.batch_first:
            t = t.transpose(0, 1)
        mixed, _ = self.attn(t, t, t, need_weights=False)
        if not self.batch_first:
            mixed = mixed.transpose(0, 1)
        return {"logits": self.head(mixed.mean(1))}


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_matches_hand_computation(batch_first):
    torch.manual_seed(0)
    model = randomise(MHAModel(batch_first), 0.5, 2).eval()
    X = rows(10, 64, 1)
    task = Task(model, 3, "ce", Inputs(kind="images", shape=(1, 8, 8)))
    result = analyse_layers(task, X, LayerKappaConfig(n=10))
    assert [(layer.name, layer.kind) for layer in result.layers] == [("attn", "multihead")]
    layer = result.layers[0]

    twin = copy.deepcopy(model).double().eval()
    got = capture(twin, ["attn"], lambda m: m(X.reshape(10, 1, 8, 8)))
    x, out = (t.numpy() for t in got["attn"])
    if not batch_first:
        x, out = x.transpose(1, 0, 2), out.transpose(1, 0, 2)
    assert_same_kappa(layer.input, [np_gram_kappa(x[i]) for i in range(10)])
    assert_same_kappa(layer.output, [np_gram_kappa(out[i]) for i in range(10)])
    W = twin.attn.in_proj_weight.detach().numpy()
    b = twin.attn.in_proj_bias.detach().numpy()
    q, k = x @ W[:16].T + b[:16], x @ W[16:32].T + b[16:32]
    for head in range(2):
        sl = slice(8 * head, 8 * (head + 1))
        A = softmax(q[:, :, sl] @ k[:, :, sl].transpose(0, 2, 1) / math.sqrt(8))
        expected = [np_matrix_kappa(A[i]) for i in range(10)]
        kd = np.array([e[0] for e in expected])
        assert np.isfinite(kd).all()
        np.testing.assert_allclose(layer.heads[head].kappa_full, kd, rtol=1e-7)


# --------------------------------------------------------------------------- Hugging Face ViT


def test_tiny_hugging_face_vit(tmp_path):
    transformers = pytest.importorskip("transformers")
    from attnaudit.models.checkpoints import load_checkpoint

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=10,
    )
    hf = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():  # maps far from uniform
        gen = torch.Generator().manual_seed(3)
        for name, p in hf.named_parameters():
            if "q_proj" in name or "k_proj" in name or "query" in name or "key" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.8)
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_checkpoint(tmp_path / "hf")
    found = find_attention_layers(loaded.module)
    assert [(f.name, f.kind) for f in found] == [("model.vit.layers.0.attention", "projections")]

    X = rows(9, 64, 2)
    implementation = loaded.module.model.config._attn_implementation
    result = analyse_layers(loaded, X, LayerKappaConfig(n=9))
    layer = result.layers[0]
    assert layer.tokens == 5 and layer.features_in == 16  # 4 patches + the class token
    # the user's model is not switched to eager nor converted (only the analysis copy is)
    assert loaded.module.model.config._attn_implementation == implementation != "eager"
    assert next(loaded.module.parameters()).dtype == torch.float32
    assert torch.nn.functional.softmax.__module__ == "torch.nn.functional"  # the float64 softmax wrapper is gone

    twin = copy.deepcopy(loaded.module).double().eval()  # its own attention implementation (sdpa)
    name = "model.vit.layers.0.attention"
    got = capture(twin, [name], lambda m: m(X.reshape(9, 1, 8, 8)))
    h, out = (t.numpy() for t in got[name])
    assert_same_kappa(layer.input, [np_gram_kappa(h[i]) for i in range(9)])
    assert_same_kappa(layer.output, [np_gram_kappa(out[i]) for i in range(9)])
    att = twin.get_submodule(name)
    q = h @ att.q_proj.weight.detach().numpy().T + att.q_proj.bias.detach().numpy()
    k = h @ att.k_proj.weight.detach().numpy().T + att.k_proj.bias.detach().numpy()
    assert layer.heads is not None and len(layer.heads) == 2
    for head in range(2):
        sl = slice(8 * head, 8 * (head + 1))
        A = softmax(q[:, :, sl] @ k[:, :, sl].transpose(0, 2, 1) / math.sqrt(8))
        kd = np.array([np_matrix_kappa(A[i])[0] for i in range(9)])
        assert np.isfinite(kd).all()
        np.testing.assert_allclose(layer.heads[head].kappa_full, kd, rtol=1e-7)


# --------------------------------------------------------------------------- linearized identity attention


class LinearIdentity(nn.Module):
    """Tokens (N, D) -> linearized attention with W_Q = W_K = W_V = W_O = I, one head -> mean -> head.

    Its output is G X / (sqrt(D) N) with G = X X^T, whose Gram is G^3 / (D N^2).
    """

    def __init__(self, N: int, D: int):
        super().__init__()
        self.N, self.D = N, D
        self.attn = Attention(D, 1, linear=True, dtype=torch.float64)
        with torch.no_grad():
            for lin in (self.attn.q, self.attn.k, self.attn.v, self.attn.proj):
                lin.weight.copy_(torch.eye(D, dtype=torch.float64))
                lin.bias.zero_()
        self.head = nn.Linear(D, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x.reshape(-1, self.N, self.D)).mean(1))


def tokens_with_kappa(B: int, N: int, D: int, kappa_gram: float, seed: int) -> torch.Tensor:
    """B token matrices (N x D, N <= D) whose Gram has condition number exactly kappa_gram."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(B):
        U, _ = np.linalg.qr(rng.standard_normal((N, N)))
        V, _ = np.linalg.qr(rng.standard_normal((D, N)))
        s = np.logspace(0, -0.5 * math.log10(kappa_gram), N)
        out.append((U * s) @ V.T)
    return torch.tensor(np.stack(out).reshape(B, N * D))


def test_linearized_identity_attention_cubes_kappa():
    N, D, B = 6, 8, 5
    model = LinearIdentity(N, D)
    # kappa(G) = 1e3: kappa(G~) = 1e9, well inside float64 (limit 1 / (8 eps) = 5.6e14)
    res = analyse_layers(Task(model, 3), tokens_with_kappa(B, N, D, 1e3, 0), LayerKappaConfig(n=B))
    layer = res.layers[0]
    np.testing.assert_allclose(layer.input.kappa_full, 1e3, rtol=1e-9)
    np.testing.assert_allclose(layer.output.kappa_full, 1e9, rtol=1e-5)
    np.testing.assert_allclose(layer.amplification.exponent, 3.0, atol=1e-6)
    assert layer.amplification.beyond_precision == 0
    # kappa(G) = 1e6: kappa(G~) = 1e18 is beyond float64; it is said so, and never printed as a number
    res = analyse_layers(Task(model, 3), tokens_with_kappa(B, N, D, 1e6, 1), LayerKappaConfig(n=B))
    layer = res.layers[0]
    np.testing.assert_allclose(layer.input.kappa_full, 1e6, rtol=1e-6)
    assert layer.amplification.beyond_precision == B
    assert np.isinf(layer.output.kappa_full).all() and layer.output.rank_deficient == B
    assert np.isposinf(layer.amplification.exponent).all()
    assert "beyond float64 precision" in " ".join(res.verdicts)


# --------------------------------------------------------------------------- eNTK Gram


def explicit_entk(model: nn.Module, X: torch.Tensor) -> np.ndarray:
    """(1/c) sum_a J_a J_a^T from one autograd.grad call per sample and output (float64 copy)."""
    twin = copy.deepcopy(model).double().eval()
    params = [p for p in twin.parameters() if p.requires_grad]
    J = []
    for i in range(X.shape[0]):
        logits = twin(X[i : i + 1].reshape(1, 1, 8, 8))[0]
        J.append(
            torch.stack(
                [
                    torch.cat([g.reshape(-1) for g in torch.autograd.grad(logits[a], params, retain_graph=True)])
                    for a in range(logits.shape[0])
                ]
            )
        )
    J = torch.stack(J).numpy()  # (n, c, P)
    return np.einsum("iap,jap->ij", J, J) / J.shape[1]


def test_entk_gram_equals_explicit_jacobian_products():
    spec = ViTSpec(arch="vit", image_shape=(1, 8, 8), n_out=4, depth=1, dim=8, heads=2, patch=4, seed=0)
    model = randomise(ViT(spec), 0.3, 4)
    X = rows(7, 64, 3)
    K_ref = explicit_entk(model, X)
    P = sum(p.numel() for p in model.parameters())
    for budget in (1 << 30, 2 * 4 * P * 8 * 2):  # all Jacobians cached / chunks of 2 rows, upper triangle only
        K, n_params, c, chunk = entk_gram(model, X, budget)
        assert (n_params, c) == (P, 4)
        if budget < 1 << 30:
            assert chunk == 2  # 4 chunks, upper block triangle: the uncached path
        np.testing.assert_allclose(K, K_ref, rtol=1e-10, atol=1e-12 * np.abs(K_ref).max())
    with pytest.raises(AuditError, match="out of reach"):  # not even two samples' Jacobians fit
        entk_gram(model, X, 4 * P * 8)
    res = analyse_layers(model, X, LayerKappaConfig(n=7, gram="entk"))
    lam = np.linalg.eigvalsh(K_ref)[::-1]
    assert res.entk.report.numerical_rank == 7
    assert res.entk.report.kappa_full == pytest.approx(lam[0] / lam[-1], rel=1e-7)


# --------------------------------------------------------------------------- statistics and detection


def test_spread_quantiles_keep_infinities_honest():
    vals = np.array([0.3, 1.7, 2.2, 5.0, 9.1])
    s = Spread.of(vals)
    assert (s.median, s.p10, s.p90) == pytest.approx((np.median(vals), np.quantile(vals, 0.1), np.quantile(vals, 0.9)))
    s = Spread.of([1.0, 2.0, math.inf, math.inf])  # half rank deficient: the median is infinite
    assert math.isinf(s.median) and s.n_plus_infinite == 2 and s.p10 == pytest.approx(1.3)
    s = Spread.of([1.0, 2.0, 3.0, math.inf, math.inf, math.nan])
    assert s.median == 3.0 and s.n_undefined == 1 and s.n == 5  # exact rank position: no inf * 0 = NaN
    assert Spread.of([1.0, math.inf]).to_dict()["nonfinite"] == {"median": "+inf", "p10": "+inf", "p90": "+inf"}
    assert Spread.of([1.0, 2.0, 3.0, 4.0, math.inf]).to_dict()["nonfinite"] == {"p90": "+inf"}


def test_detection_nesting_patterns_and_errors():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Attention(8, 2, linear=False)
            self.mlp = nn.Linear(8, 8)

    class OuterAttention(nn.Module):  # owns q/k itself and holds another attention inside
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
            self.sub = nn.MultiheadAttention(8, 2)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Wrapper()
            self.b = OuterAttention()
            self.c = nn.MultiheadAttention(8, 2)

    net = Net()
    assert [(f.name, f.kind) for f in find_attention_layers(net)] == [
        ("a.inner", "builtin"),
        ("b", "projections"),
        ("c", "multihead"),
    ]
    assert [(f.name, f.kind) for f in find_attention_layers(net, ["a.inner", "a.m*", "c"])] == [
        ("a.inner", "builtin"),
        ("a.mlp", "selected"),
        ("c", "multihead"),
    ]
    assert [f.name for f in find_attention_layers(net, ["a.*"])] == [  # fnmatch: * crosses dots
        "a.inner",
        "a.inner.q",
        "a.inner.k",
        "a.inner.v",
        "a.inner.proj",
        "a.mlp",
    ]
    with pytest.raises(AuditError, match="no module matches 'blocks"):
        find_attention_layers(net, ["blocks.*"])
    with pytest.raises(AuditError, match=r"no attention layer found.*candidates: 0, 1"):
        find_attention_layers(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    with pytest.raises(AuditError, match="unknown gram"):
        LayerKappaConfig(gram="ntk")


# --------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from attnaudit.models.builtin import save_model

    spec = ViTSpec(arch="vit", image_shape=(1, 8, 8), n_out=10, depth=2, dim=8, heads=2, patch=2, seed=0)
    model = randomise(ViT(spec), 0.3, 5)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_model(model, path)
    return path, model


def test_cli_checkpoint_table_json_and_figure(tiny_checkpoint, tmp_path):
    from attnaudit.data import DataSpec, load_dataset

    path, model = tiny_checkpoint
    png = tmp_path / "layers.png"
    result = runner.invoke(
        app, ["kappa", "--checkpoint", str(path), "--n", "40", "--gram", "entk", "--json", "-", "--png", str(png)]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["schema"] == "attnaudit.kappa-layers/1"
    assert png.stat().st_size > 1000
    res = payload["results"]["models"]["tiny"]
    assert res["samples"] == 40 and [la["name"] for la in res["layers"]] == ["blocks.0.attn", "blocks.1.attn"]
    assert res["entk"]["gram"]["n"] == 40 and res["entk"]["parameters"] == sum(p.numel() for p in model.parameters())
    # the same 40 digits rows (default data set, seed 0), captured here: output kappa medians agree
    ds = load_dataset(DataSpec(dataset="digits", n=40, seed=0))
    twin = copy.deepcopy(model).double().eval()
    got = capture(twin, ["blocks.0.attn", "blocks.1.attn"], lambda m: m(ds.X.double().reshape(40, 1, 8, 8)))
    for la in res["layers"]:
        h, out = (t.numpy() for t in got[la["name"]])
        kin = [np_gram_kappa(h[i]) for i in range(40)]
        kout = [np_gram_kappa(out[i]) for i in range(40)]
        assert la["input_gram"]["rank_deficient_samples"] == sum(math.isinf(k[0]) for k in kin) == 40
        assert la["input_gram"]["log10_kappa"]["nonfinite"] == {"median": "+inf", "p10": "+inf", "p90": "+inf"}
        assert la["input_gram"]["log10_kappa_at_numerical_rank"]["median"] == pytest.approx(
            np.median(np.log10([k[1] for k in kin])), rel=1e-8
        )
        assert la["output_gram"]["rank_deficient_samples"] == sum(math.isinf(k[0]) for k in kout)
        assert la["input_gram"]["per_sample"]["numerical_rank"] == [k[2] for k in kin]

    # the per-layer table is printed for people
    shown = runner.invoke(app, ["kappa", "--checkpoint", str(path), "--n", "16", "--layers", "blocks.1.*"])
    assert shown.exit_code == 0, shown.output
    assert (
        "per-layer kappa" in shown.stdout and "blocks.1.attn.q" in shown.stdout and "blocks.0.attn " not in shown.stdout
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "nothing.*"], "candidates"),
        (["--gram", "hessian"], "--gram"),
        (["--n", "8,16"], "one batch size"),
        (["--seeds", "2"], "--seeds"),
    ],
)
def test_cli_bad_options_exit_2(tiny_checkpoint, args, message):
    path, _ = tiny_checkpoint
    result = runner.invoke(app, ["kappa", "--checkpoint", str(path), "--n", "8", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_cli_layer_options_need_a_model():
    result = runner.invoke(app, ["kappa", "--layers", "blocks.*"])
    assert result.exit_code == 2 and "checkpoint or a factory" in result.output
