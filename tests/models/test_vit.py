"""Built-in ViTs (attnaudit.models.vit) and the one checkpoint format for every built-in model.

Forward passes are checked against a float64 numpy implementation written here from the
definitions (patches, LayerNorm, attention, GELU), never against the module's own code.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
from scipy.special import erf

from attnaudit.core.engine import Engine
from attnaudit.core.task import Inputs, Task, select_parameter_names
from attnaudit.errors import AuditError
from attnaudit.models.builtin import (
    BUILTIN_ARCHITECTURES,
    ModelSpec,
    TwoLayerNet,
    build_builtin,
    build_model,
    load_model,
    save_model,
)
from attnaudit.models.vit import Attention, ViT, ViTSpec, default_patch, n_parameters


def tiny_spec(arch="vit", **kw) -> ViTSpec:
    base = dict(image_shape=(2, 4, 6), n_out=3, depth=1, dim=8, heads=2, patch=2, mlp_ratio=2, seed=3)
    base.update(kw)
    return ViTSpec(arch, **base)


def images(n=3, shape=(2, 4, 6), seed=0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *shape, generator=g, dtype=dtype)


# --------------------------------------------------------------------------- numpy reference


def np_params(model: ViT) -> dict[str, np.ndarray]:
    return {k: v.detach().double().numpy() for k, v in model.state_dict().items()}


def np_linear(x, P, name):
    return x @ P[f"{name}.weight"].T + P[f"{name}.bias"]


def np_layernorm(x, P, name, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * P[f"{name}.weight"] + P[f"{name}.bias"]


def np_attention(h, P, name, heads, linear):
    """Multi-head attention of token states h (L, D) for one sample, head by head with loops."""
    L, D = h.shape
    dh = D // heads
    q, k, v = (np_linear(h, P, f"{name}.{m}") for m in "qkv")
    out = np.zeros((L, D))
    for j in range(heads):
        sl = slice(j * dh, (j + 1) * dh)
        s = q[:, sl] @ k[:, sl].T
        if linear:
            A = s / (math.sqrt(dh) * L)
        else:
            e = np.exp(s / math.sqrt(dh) - (s / math.sqrt(dh)).max(1, keepdims=True))
            A = e / e.sum(1, keepdims=True)
        out[:, sl] = A @ v[:, sl]
    return np_linear(out, P, f"{name}.proj")


def np_vit(model: ViT, x: np.ndarray) -> np.ndarray:
    spec = model.spec
    P = np_params(model)
    C, H, W = spec.image_shape
    p = spec.patch
    logits = []
    for img in x:
        tokens = []
        for r in range(H // p):  # row-major over the patch grid, channel-major inside a patch
            for c in range(W // p):
                tokens.append(img[:, r * p : (r + 1) * p, c * p : (c + 1) * p].reshape(-1))
        h = np_linear(np.stack(tokens), P, "embed") + P["pos_embed"]
        for b in range(spec.depth):
            pre = f"blocks.{b}"
            h = h + np_attention(
                np_layernorm(h, P, f"{pre}.norm1"), P, f"{pre}.attn", spec.heads, spec.arch == "vit-linear"
            )
            z = np_linear(np_layernorm(h, P, f"{pre}.norm2"), P, f"{pre}.mlp.fc1")
            z = 0.5 * z * (1 + erf(z / math.sqrt(2)))
            h = h + np_linear(z, P, f"{pre}.mlp.fc2")
        logits.append(np_linear(np_layernorm(h, P, "norm").mean(0), P, "head"))
    return np.stack(logits)


@pytest.mark.parametrize("arch", ["vit", "vit-linear"])
def test_forward_matches_a_numpy_float64_implementation(arch):
    model = ViT(tiny_spec(arch, depth=2), dtype=torch.float64)
    # the init has tiny weights; perturb so that attention is far from uniform
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.3)
    x = images()
    np.testing.assert_allclose(model(x).detach().numpy(), np_vit(model, x.numpy()), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("linear", [False, True])
def test_attention_block_by_hand(linear):
    attn = Attention(6, 3, linear, dtype=torch.float64).to_empty(device="cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    h = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    P = {k: v.numpy() for k, v in attn.state_dict().items()}
    P = {f"a.{k}": v for k, v in P.items()}
    expected = np.stack([np_attention(s, P, "a", 3, linear) for s in h.numpy()])
    np.testing.assert_allclose(attn(h).detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    w = attn.weights(h)
    assert w.shape == (2, 3, 5, 5)
    if not linear:
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))


def test_linearized_attention_averages_over_tokens():
    """The 1/N factor: repeating every token leaves each output unchanged (an average over
    tokens); without it the outputs would double. The softmax variant has the same property."""
    for linear in (True, False):
        attn = Attention(8, 2, linear, dtype=torch.float64).to_empty(device="cpu")
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
            attn.proj.bias.zero_()
            attn.v.bias.zero_()
        h = torch.randn(1, 4, 8, generator=g, dtype=torch.float64)
        once = attn(h)
        twice = attn(torch.cat([h, h], 1))
        torch.testing.assert_close(twice[:, :4], once, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(twice[:, 4:], once, rtol=1e-12, atol=1e-12)
    # numerically: linear weights times sqrt(d_h) * N are the raw scores of one head
    attn = Attention(8, 1, True, dtype=torch.float64).to_empty(device="cpu")
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    h = torch.randn(1, 6, 8, dtype=torch.float64)
    hq = h[0].numpy() @ attn.q.weight.detach().numpy().T + attn.q.bias.detach().numpy()
    hk = h[0].numpy() @ attn.k.weight.detach().numpy().T + attn.k.bias.detach().numpy()
    np.testing.assert_allclose(attn.weights(h)[0, 0].detach().numpy() * math.sqrt(8) * 6, hq @ hk.T, rtol=1e-12)


def test_mnist_size_and_structure():
    spec = ViTSpec("vit", (1, 28, 28), 10)
    model = ViT(spec)
    # embed 49*64+64, pos 16*64, per block 2 LN (2*128) + 4 projections (4*(64*64+64)) + MLP (64*128+128 + 128*64+64),
    # final LN 128, head 64*10+10
    block = 2 * 128 + 4 * (64 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64)
    assert n_parameters(model) == 49 * 64 + 64 + 16 * 64 + 2 * block + 128 + 650 == 71946
    assert spec.tokens == 16 and default_patch((1, 28, 28)) == 7 and default_patch((8, 8)) == 2
    assert isinstance(model.blocks[1].attn, Attention)
    assert isinstance(dict(model.named_modules())["blocks.0.attn"], Attention)
    assert model.head_parameter_names() == ["head.weight", "head.bias"]
    assert model.audit_inputs() == Inputs(kind="images", shape=(1, 28, 28))
    x = torch.rand(2, 784)
    assert select_parameter_names(model, "head", x, model.audit_inputs()) == ["head.weight", "head.bias"]
    attn_params = select_parameter_names(model, "blocks.*.attn.*")
    assert len(attn_params) == 16 and all(".attn." in n for n in attn_params)
    assert model(x.reshape(2, 1, 28, 28)).shape == (2, 10)
    assert TwoLayerNet(ModelSpec("relu", 4, 3, 2)).audit_inputs() == Inputs()


def test_init_is_deterministic_local_and_dtype_independent():
    state = torch.random.get_rng_state()
    a, b = ViT(tiny_spec()), ViT(tiny_spec())
    c = ViT(tiny_spec(seed=4))
    d64 = ViT(tiny_spec(), dtype=torch.float64)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG was not used
    for (name, p), q, r, s in zip(a.named_parameters(), b.parameters(), c.parameters(), d64.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(p, s.float()), name
        if name.endswith("weight") and "norm" not in name or name == "pos_embed":
            assert not torch.equal(p, r), name
            assert 0.005 < p.std().item() < 0.03 and p.abs().max().item() <= 2 * 0.02 + 1e-7
    assert next(a.parameters()).dtype == torch.float32 and next(d64.parameters()).dtype == torch.float64
    assert next(ViT(tiny_spec(), device="meta").parameters()).is_meta


def test_attention_keeps_no_state_between_calls():
    model = ViT(tiny_spec())
    attn = model.blocks[0].attn
    before = {k: type(v) for k, v in vars(attn).items() if not k.startswith("_")}
    keys = set(model.state_dict())
    model(images(dtype=torch.float32))
    assert {k: type(v) for k, v in vars(attn).items() if not k.startswith("_")} == before
    assert set(model.state_dict()) == keys and not list(attn.buffers())
    assert not attn._forward_hooks and not attn._forward_pre_hooks


@pytest.mark.parametrize("arch", ["vit", "vit-linear"])
def test_per_sample_grads_and_hvp_through_the_engine(arch):
    model = ViT(tiny_spec(arch), dtype=torch.float64)
    x = images(4)
    y = torch.tensor([0, 2, 1, 2])
    rows = x.reshape(4, -1)
    engine = Engine(Task(model, 3, "ce", model.audit_inputs()), dtype=torch.float64)
    G = engine.per_sample_grads(rows, engine.targets(y))
    ref = copy.deepcopy(model)
    params = [dict(ref.named_parameters())[n] for n in engine.names]
    loop = []
    for i in range(4):
        loss = torch.nn.functional.cross_entropy(ref(x[i : i + 1]), y[i : i + 1], reduction="sum")
        loop.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    torch.testing.assert_close(G, torch.stack(loop), rtol=1e-10, atol=1e-12)
    # the Hessian-vector product (reverse-over-reverse, no fallback needed) against double backward
    v = torch.randn(engine.n_params, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    op = engine.hvp_operator(rows, engine.targets(y))
    hv = op.matvec(v)
    assert op.mode == "reverse-over-reverse"
    loss = torch.nn.functional.cross_entropy(ref(x), y)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params, create_graph=True)])
    expected = torch.cat([t.reshape(-1) for t in torch.autograd.grad(g @ v, params)])
    torch.testing.assert_close(hv, expected, rtol=1e-9, atol=1e-11)


def _one_line_error(fn, *match):
    with pytest.raises(AuditError) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    for m in match:
        assert m in message, message
    return message


def test_spec_validation_and_json_round_trip():
    cases = [
        (dict(arch="vit-softmax"), "unknown transformer"),
        (dict(image_shape=(28, 28)), "three integers"),
        (dict(image_shape=(1, 28, 28.0)), "three integers"),
        (dict(image_shape="1,28,28"), "three integers"),
        (dict(image_shape=(0, 28, 28)), "positive"),
        (dict(dim=10, heads=4), "not divisible by heads"),
        (dict(patch=5), "does not divide the image size 28x28"),
        (dict(depth=0), "depth must be a positive"),
        (dict(depth=2.0), "depth must be an integer"),
        (dict(n_out=True), "n_out must be an integer"),
        (dict(seed=2**70), "seed must be an integer in"),
        (dict(mlp_ratio=-1), "mlp_ratio"),
    ]
    for edit, expected in cases:
        kw = {**dict(arch="vit", image_shape=(1, 28, 28), n_out=10), **edit}
        _one_line_error(lambda: ViTSpec(**kw), expected)
    spec = ViTSpec("vit-linear", [np.int64(1), 28, 28], np.int64(10), dim=np.int32(32), seed=np.int64(9))
    assert spec.image_shape == (1, 28, 28) and type(spec.n_out) is int and type(spec.dim) is int
    assert ViTSpec(**json.loads(json.dumps(asdict(spec)))) == spec


def test_build_builtin_for_every_architecture():
    X = torch.rand(30, 64, dtype=torch.float64)
    for arch in BUILTIN_ARCHITECTURES:
        model = build_builtin(arch, n_out=4, feature_shape=(8, 8), X_train=X, seed=1, width=5, patch=4, dim=16, heads=2)
        inputs = model.audit_inputs()
        out = model(inputs(X.to(next(model.parameters()).dtype)))
        assert out.shape == (30, 4)
    vit = build_builtin("vit", n_out=4, feature_shape=(3, 8, 8), patch=4)
    assert vit.spec.image_shape == (3, 8, 8) and next(vit.parameters()).dtype == torch.float32
    assert build_builtin("relu", n_out=2, feature_shape=(64,)).W.dtype == torch.float64
    _one_line_error(lambda: build_builtin("vit", n_out=4, feature_shape=(64,)), "needs image data", "64 features")
    _one_line_error(lambda: build_builtin("attn", n_out=4, feature_shape=(64,)), "attn needs the training inputs")
    _one_line_error(lambda: build_builtin("lstm", n_out=4, feature_shape=(64,)), "unknown arch")
    _one_line_error(lambda: build_builtin("vit", n_out=4, feature_shape=(8, 8), patch=3), "patch size 3", "8x8")


# --------------------------------------------------------------------------- checkpoints


def saved_model(tmp_path, arch, dtype=None):
    X = torch.rand(20, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model = build_builtin(
        arch, n_out=3, feature_shape=(1, 8, 8), X_train=X, seed=2, width=6, patch=4, dim=16, heads=2, dtype=dtype
    )
    with torch.no_grad():  # move off the initialisation so a silent re-init would be caught
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    path = tmp_path / f"{arch}.safetensors"
    save_model(model, path, metadata={"note": arch})
    return model, path, X


@pytest.mark.parametrize("arch", BUILTIN_ARCHITECTURES)
def test_save_load_round_trip_every_builtin(tmp_path, arch):
    model, path, X = saved_model(tmp_path, arch)
    side = json.loads(path.with_suffix(".safetensors.json").read_text())
    assert side["schema"] == "attnaudit.model/2" and side["arch"] == arch and side["spec"]["arch"] == arch
    assert side["metadata"] == {"note": arch}
    if arch.startswith("vit"):
        assert side["input"] == {"kind": "images", "shape": [1, 8, 8]} and side["dtype"] == "float32"
    else:
        assert side["input"] == {"kind": "flat", "shape": [64]} and side["dtype"] == "float64"
    loaded = load_model(path)
    assert type(loaded) is type(model) and loaded.spec == model.spec and loaded.metadata == {"note": arch}
    rows = X.to(next(model.parameters()).dtype)
    torch.testing.assert_close(loaded(loaded.audit_inputs()(rows)), model(model.audit_inputs()(rows)), rtol=0, atol=0)
    with pytest.raises(AuditError, match="--overwrite"):
        save_model(model, path)

    from attnaudit.models.checkpoints import load_checkpoint

    checkpoint = load_checkpoint(path)
    assert checkpoint.n_classes == 3 and checkpoint.n_features == 64 and checkpoint.inputs == model.audit_inputs()


def test_float64_vit_round_trip(tmp_path):
    model, path, X = saved_model(tmp_path, "vit-linear", dtype=torch.float64)
    loaded = load_model(path)
    assert next(loaded.parameters()).dtype == torch.float64
    torch.testing.assert_close(loaded(X.reshape(-1, 1, 8, 8)), model(X.reshape(-1, 1, 8, 8)), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["relu", "attn"])
def test_old_schema_1_side_cars_still_load(tmp_path, arch):
    model, path, X = saved_model(tmp_path, arch)
    sidecar = path.with_suffix(".safetensors.json")
    side = json.loads(sidecar.read_text())
    # exactly what the version-1 writer produced: schema, spec, dtype, metadata
    sidecar.write_text(
        json.dumps(
            {"schema": "attnaudit.model/1", "spec": side["spec"], "dtype": side["dtype"], "metadata": side["metadata"]}
        )
    )
    loaded = load_model(path)
    torch.testing.assert_close(loaded(X), model(X), rtol=0, atol=0)
    del side["metadata"]
    sidecar.write_text(json.dumps({"schema": "attnaudit.model/1", "spec": side["spec"]}))
    assert load_model(path).metadata == {}


def _rewrite(path, tensors=None, side=None):
    from safetensors.torch import save_file

    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    if side is not None:
        path.with_suffix(".safetensors.json").write_text(json.dumps(side))


def _vit_cases():
    def drop(t, s):
        del t["head.bias"]

    def extra(t, s):
        t["blocks.0.attn.cache"] = torch.zeros(3)

    def narrow(t, s):
        t["blocks.0.attn.q.weight"] = t["blocks.0.attn.q.weight"][:8].contiguous()

    def dim(t, s):
        s["spec"]["dim"] = 32

    def patch(t, s):
        s["spec"]["patch"] = 2
        s["input"]["shape"] = [1, 8, 8]

    def depth(t, s):
        s["spec"]["depth"] = 3

    def nan(t, s):
        t["head.weight"][0, 0] = float("nan")

    def half(t, s):
        t["head.weight"] = t["head.weight"].half()

    def mixed(t, s):
        t["head.weight"] = t["head.weight"].double()

    def recorded(t, s):
        s["dtype"] = "float64"

    def arch_mismatch(t, s):
        s["arch"] = "vit-linear"

    def input_mismatch(t, s):
        s["input"] = {"kind": "flat", "shape": [64]}

    def unknown_top(t, s):
        s["weights_url"] = "http://x"

    def unknown_spec(t, s):
        s["spec"]["width"] = 64

    def missing_spec(t, s):
        del s["spec"]["image_shape"]

    def bad_shape(t, s):
        s["spec"]["image_shape"] = [8, 8]

    def legacy_vit(t, s):
        s["schema"] = "attnaudit.model/1"

    return {
        "missing key": (drop, ["1 missing key(s) (head.bias)"]),
        "unexpected key": (extra, ["unexpected key(s) (blocks.0.attn.cache)"]),
        "tensor shape": (narrow, ["blocks.0.attn.q.weight", "(8, 16)", "(16, 16)"]),
        "spec dim": (dim, ["tensor pos_embed has shape (4, 16) in the file but the model expects (4, 32)"]),
        "spec patch": (patch, ["tensor pos_embed has shape (4, 16) in the file but the model expects (16, 16)"]),
        "spec depth": (depth, ["missing key(s) (blocks.2."]),
        "NaN": (nan, ["head.weight holds non-finite"]),
        "float16": (half, ["tensor head.weight has dtype float16"]),
        "mixed dtypes": (mixed, ["mix dtypes (float32, float64)"]),
        "recorded dtype": (recorded, ["records dtype float64 but the tensors are float32"]),
        "arch vs spec": (arch_mismatch, ["'arch' is 'vit-linear' but its spec describes a 'vit'"]),
        "input vs spec": (input_mismatch, ["'input'", "[1, 8, 8]"]),
        "unknown field": (unknown_top, ["unknown field(s) weights_url"]),
        "unknown spec field": (unknown_spec, ["spec has unknown field(s) width"]),
        "missing spec field": (missing_spec, ["lacks field(s) image_shape"]),
        "bad image_shape": (bad_shape, ["three integers"]),
        "vit under schema 1": (legacy_vit, ["holds only the 2-layer nets", "arch is 'vit'"]),
    }


@pytest.mark.parametrize("case", list(_vit_cases()))
def test_vit_checkpoint_mismatches_are_one_line_audit_errors(tmp_path, case):
    from safetensors.torch import load_file

    _, path, _ = saved_model(tmp_path, "vit")
    tensors = dict(load_file(str(path)))
    side = json.loads(path.with_suffix(".safetensors.json").read_text())
    edit, expected = _vit_cases()[case]
    edit(tensors, side)
    _rewrite(path, tensors=tensors, side=side)
    message = _one_line_error(lambda: load_model(path), str(path), *expected)
    assert "re-save it with attnaudit" in message or "the checkpoint is damaged" in message


def test_save_model_refuses_foreign_models_and_odd_dtypes(tmp_path):
    _one_line_error(lambda: save_model(torch.nn.Linear(2, 2), tmp_path / "x.safetensors"), "TwoLayerNet, ViT")
    _one_line_error(lambda: save_model(ViT(tiny_spec()).half(), tmp_path / "x.safetensors"), "float16")
    _one_line_error(
        lambda: save_model(ViT(tiny_spec()), tmp_path / "x.safetensors", metadata={"a": object()}), "not JSON"
    )
    assert not list(tmp_path.iterdir())
    relu = build_model(ModelSpec("relu", 4, 3, 2))
    assert save_model(relu, tmp_path / "r.safetensors").exists()
