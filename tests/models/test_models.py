"""Reference models and the trainer: definitions, determinism, checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnaudit.errors import AuditError
from attnaudit.models.builtin import (
    ModelSpec,
    attention_context,
    build_model,
    load_model,
    save_model,
    training_data_mismatch,
)
from attnaudit.core.training import TrainConfig, loss_value, per_sample_loss, train


def data(n=40, d=12, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (n,), generator=g)
    return X, y


def test_relu_forward_matches_its_formula():
    X, _ = data()
    model = build_model(ModelSpec("relu", 12, 32, 3, seed=4))
    W, a = model.W.detach(), model.a.detach()
    expected = torch.relu(X @ W.T / math.sqrt(12)) @ a / math.sqrt(32)
    torch.testing.assert_close(model(X), expected, rtol=0, atol=1e-14)


def test_attn_applies_scaled_x_transpose_x_with_training_context():
    X, _ = data()
    model = build_model(ModelSpec("attn", 12, 32, 3, seed=4), X)
    C = X.T @ X
    # rms rule: the transformed training rows have the RMS norm of the raw rows
    Z = model.features_in(X)
    assert Z.pow(2).sum(1).mean().sqrt().item() == pytest.approx(X.pow(2).sum(1).mean().sqrt().item(), rel=1e-12)
    scale = (model.context / C).mean().item()
    torch.testing.assert_close(Z, X @ X.T @ X * scale, rtol=1e-10, atol=1e-12)
    # a new point is mapped with the training set as context, never its own
    x_new = torch.rand(1, 12, dtype=torch.float64)
    torch.testing.assert_close(model.features_in(x_new), (scale * C @ x_new.T).T)
    spectral = attention_context(X, "spectral")
    assert torch.linalg.eigvalsh(spectral)[-1].item() == pytest.approx(1.0, rel=1e-12)
    torch.testing.assert_close(attention_context(X, "none"), C)


def test_standard_and_ntk_parametrizations_agree_at_init():
    X, _ = data()
    ntk = build_model(ModelSpec("relu", 12, 64, 3, parametrization="ntk", seed=1))
    std = build_model(ModelSpec("relu", 12, 64, 3, parametrization="standard", seed=1))
    torch.testing.assert_close(ntk(X), std(X), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("arch", ["relu", "attn"])
def test_antisymmetric_init_outputs_exactly_zero(arch):
    X, _ = data()
    model = build_model(ModelSpec(arch, 12, 64, 3, init="antisymmetric", seed=2), X)
    assert model(X).abs().max().item() < 1e-13
    assert model(torch.randn(5, 12, dtype=torch.float64)).abs().max().item() < 1e-13


def test_bad_specs_rejected():
    with pytest.raises(AuditError):
        ModelSpec("lstm", 3, 4, 2)
    with pytest.raises(AuditError, match="even"):
        ModelSpec("relu", 3, 5, 2, init="antisymmetric")
    with pytest.raises(AuditError):
        build_model(ModelSpec("attn", 3, 4, 2))  # no context
    with pytest.raises(AuditError):
        TrainConfig(lr=-1)
    with pytest.raises(AuditError):
        TrainConfig(loss="hinge")


@pytest.mark.parametrize("arch", ["relu", "attn"])
def test_save_load_round_trip_and_no_silent_overwrite(tmp_path, arch):
    X, y = data()
    model = build_model(ModelSpec(arch, 12, 16, 3, seed=3), X)
    train(model, X, y, TrainConfig(steps=5, lr=0.5))
    path = tmp_path / "m.safetensors"
    save_model(model, path, metadata={"note": "test"})
    side = json.loads((tmp_path / "m.safetensors.json").read_text())
    assert side["spec"]["arch"] == arch and side["metadata"]["note"] == "test"
    loaded = load_model(path)
    torch.testing.assert_close(loaded(X), model(X), rtol=0, atol=0)
    with pytest.raises(AuditError, match="--overwrite"):
        save_model(model, path)
    save_model(model, path, overwrite=True)
    (tmp_path / "m.safetensors.json").unlink()
    with pytest.raises(AuditError, match="side-car"):
        load_model(path)


def test_training_is_deterministic_and_decreases_loss():
    X, y = data()
    curves = []
    for _ in range(2):
        model = build_model(ModelSpec("relu", 12, 32, 3, seed=5))
        result = train(model, X, y, TrainConfig(steps=50, lr=2.0))
        curves.append(result.loss_curve)
    assert curves[0] == curves[1]
    assert curves[0][-1] < 0.6 * curves[0][0]
    assert len(curves[0]) == 51


def test_gd_step_is_the_gradient_of_the_documented_loss():
    X, y = data()
    model = build_model(ModelSpec("relu", 12, 8, 3, seed=6))
    W0, a0 = model.W.detach().clone(), model.a.detach().clone()
    params = (W0.clone().requires_grad_(), a0.clone().requires_grad_())
    out = torch.relu(X @ params[0].T / math.sqrt(12)) @ params[1] / math.sqrt(8)
    target = torch.nn.functional.one_hot(y, 3).double()
    loss = ((out - target) ** 2).sum() / (2 * len(X))
    gW, ga = torch.autograd.grad(loss, params)
    train(model, X, y, TrainConfig(steps=1, lr=0.3))
    torch.testing.assert_close(model.W.detach(), W0 - 0.3 * gW)
    torch.testing.assert_close(model.a.detach(), a0 - 0.3 * ga)
    assert loss_value(out, y, "mse").item() == pytest.approx(loss.item())
    assert per_sample_loss(out, y, "ce").mean().item() == pytest.approx(loss_value(out, y, "ce").item())


def test_loss_tolerance_stops_early_and_checkpoints_are_kept():
    X, y = data()
    model = build_model(ModelSpec("relu", 12, 64, 3, seed=7))
    result = train(model, X, y, TrainConfig(steps=2000, lr=2.0, loss_tol=0.2, checkpoint_every=10))
    assert result.reached_tol is True
    assert result.final_loss <= 0.2 and result.steps_run < 2000
    assert len(result.checkpoints) >= 1
    unreachable = train(build_model(ModelSpec("relu", 12, 4, 3, seed=7)), X, y, TrainConfig(steps=3, loss_tol=1e-9))
    assert unreachable.reached_tol is False and unreachable.steps_run == 3


def test_training_data_provenance_round_trip_and_mismatch_warning(tmp_path):
    from attnaudit.data import data_fingerprint

    X, y = data()
    model = build_model(ModelSpec("relu", 12, 8, 3, seed=1))
    fp = data_fingerprint(X, y)
    assert fp == data_fingerprint(X.clone(), y.clone()) and len(fp) == 16
    assert fp != data_fingerprint(X[:-1], y[:-1]) and fp != data_fingerprint(X, (y + 1) % 3)
    save_model(
        model, tmp_path / "m.safetensors", metadata={"training_data": {"name": "toy", "n": 40, "fingerprint": fp}}
    )
    loaded = load_model(tmp_path / "m.safetensors")
    assert training_data_mismatch(loaded, "m", fp) is None
    other = data_fingerprint(X * 2, y)
    warning = training_data_mismatch(loaded, "m", other)
    assert warning is not None and fp in warning and other in warning and "toy" in warning
    save_model(model, tmp_path / "bare.safetensors")  # no provenance recorded: nothing to say
    assert training_data_mismatch(load_model(tmp_path / "bare.safetensors"), "bare", other) is None


# --------------------------------------------------------------------------- issue 8: hostile checkpoints


def _saved(tmp_path, arch="relu", dtype=torch.float64):
    """A good checkpoint (width 16, d_in 12, n_out 3) and its tensors and side-car as plain objects."""
    from safetensors.torch import load_file

    X, _ = data()
    model = build_model(ModelSpec(arch, 12, 16, 3, seed=3), X, dtype=dtype)
    path = tmp_path / "m.safetensors"
    save_model(model, path, metadata={"note": "x"})
    side = json.loads((tmp_path / "m.safetensors.json").read_text())
    return path, dict(load_file(str(path))), side


def _rewrite(path, tensors=None, side=None, side_bytes=None):
    from safetensors.torch import save_file

    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    sidecar = path.with_suffix(path.suffix + ".json")
    if side is not None:
        sidecar.write_text(json.dumps(side))
    if side_bytes is not None:
        sidecar.write_bytes(side_bytes)


def _load_error(path) -> str:
    with pytest.raises(AuditError) as err:
        load_model(path)
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    assert str(path) in message
    return message


def _bad_tensors():
    W = torch.randn(16, 12, dtype=torch.float64)
    a = torch.randn(16, 3, dtype=torch.float64)
    nan_W = W.clone()
    nan_W[3, 4] = float("nan")
    inf_a = a.clone()
    inf_a[0, 0] = float("inf")
    return {
        "no W": ({"a": a}, "no tensor W"),
        "no a": ({"W": W}, "no tensor a"),
        "int64 W": ({"W": W.to(torch.int64), "a": a}, "tensor W has dtype int64"),
        "float16 a": ({"W": W, "a": a.to(torch.float16)}, "tensor a has dtype float16"),
        "mixed dtypes": ({"W": W.float(), "a": a}, "different dtypes"),
        "NaN W": ({"W": nan_W, "a": a}, "tensor W holds non-finite"),
        "inf a": ({"W": W, "a": inf_a}, "tensor a holds non-finite"),
        "narrow W": ({"W": W[:8], "a": a}, r"tensor W has shape (8, 12) but the side-car spec (width 16"),
        "wrong d_in": ({"W": W[:, :5], "a": a}, "tensor W has shape (16, 5)"),
        "wrong n_out": ({"W": W, "a": a[:, :2]}, "tensor a has shape (16, 2)"),
        "1-D a": ({"W": W, "a": a[:, 0].contiguous()}, "tensor a has shape (16,)"),
        "extra tensor": ({"W": W, "a": a, "bias": torch.zeros(3, dtype=torch.float64)}, "unexpected tensor(s) bias"),
        "context on relu": (
            {"W": W, "a": a, "context": torch.eye(12, dtype=torch.float64)},
            "unexpected tensor(s) context",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_tensors()))
def test_bad_checkpoint_tensors_are_audit_errors(tmp_path, case):
    path, _, _ = _saved(tmp_path)
    tensors, expected = _bad_tensors()[case]
    _rewrite(path, tensors=tensors)
    message = _load_error(path)
    assert expected in message and "re-save it with attnaudit" in message


def test_attn_checkpoint_context_is_checked(tmp_path):
    path, tensors, _ = _saved(tmp_path, arch="attn")
    assert set(tensors) == {"W", "a", "context"}
    _rewrite(path, tensors={"W": tensors["W"], "a": tensors["a"]})
    assert "no tensor context" in _load_error(path)
    _rewrite(path, tensors={**tensors, "context": tensors["context"][:4, :4].contiguous()})
    assert "tensor context has shape (4, 4)" in _load_error(path)
    bad = tensors["context"].clone()
    bad[1, 1] = float("-inf")
    _rewrite(path, tensors={**tensors, "context": bad})
    assert "tensor context holds non-finite" in _load_error(path)


def test_side_car_width_differs_from_tensors(tmp_path):
    path, _, side = _saved(tmp_path)
    side["spec"]["width"] = 32
    _rewrite(path, side=side)
    message = _load_error(path)
    assert "width 32" in message and "(16, 12)" in message


def _spec_edits():
    return {
        "width text": ({"width": "abc"}, "width must be an integer"),
        "width float": ({"width": 16.0}, "width must be an integer"),
        "width bool": ({"width": True}, "width must be an integer"),
        "width negative": ({"width": -3}, "sizes must be positive"),
        "seed text": ({"seed": "0"}, "seed must be an integer"),
        "seed huge": ({"seed": 2**70}, "seed must be an integer in"),
        "arch list": ({"arch": ["relu"]}, "unknown model"),
        "arch unknown": ({"arch": "lstm"}, "unknown model 'lstm'"),
        "extra not dict": ({"extra": [1]}, "extra must be a dict"),
        "unknown key": ({"depth": 2}, "unknown field(s) depth"),
    }


@pytest.mark.parametrize("case", list(_spec_edits()))
def test_bad_side_car_spec_fields_are_audit_errors(tmp_path, case):
    path, _, side = _saved(tmp_path)
    edit, expected = _spec_edits()[case]
    side["spec"].update(edit)
    _rewrite(path, side=side)
    message = _load_error(path)
    assert expected in message and "re-save it with attnaudit" in message


def test_bad_side_car_documents_are_audit_errors(tmp_path):
    path, _, side = _saved(tmp_path)
    missing = json.loads(json.dumps(side))
    del missing["spec"]["width"]
    spec_list = dict(side, spec=[1, 2])
    cases = [
        (json.dumps([1, 2]).encode(), "JSON list"),
        (json.dumps("text").encode(), "JSON str"),
        (json.dumps(missing).encode(), "lacks field(s) width"),
        (json.dumps(spec_list).encode(), "'spec' must be an object"),
        (json.dumps(dict(side, metadata=[1])).encode(), "'metadata' must be an object"),
        (json.dumps(dict(side, schema="other/9")).encode(), "schema"),
        (json.dumps(dict(side, dtype="int64")).encode(), "dtype"),
        (json.dumps(dict(side, dtype="float32")).encode(), "records dtype float32 but the tensors are float64"),
        (b"\xff\xfe\x00 not utf-8 \x80", "not UTF-8"),
        (b'{"schema": ', "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[" * 200_000 + b"]" * 200_000, "side-car"),
        (b" " * 1_000_001 + b"{}", "bytes"),
    ]
    for raw, expected in cases:
        _rewrite(path, side_bytes=raw)
        message = _load_error(path)
        assert expected in message and "re-save it with attnaudit" in message, (raw[:30], message)


def test_garbage_or_truncated_weights_are_audit_errors(tmp_path):
    path, _, _ = _saved(tmp_path)
    good = path.read_bytes()
    for raw in (good[: len(good) // 2], b"\x00" * 7, b"garbage" * 100, b""):
        path.write_bytes(raw)
        assert "not a readable .safetensors file" in _load_error(path)


def test_spec_ints_are_checked_and_normalised():
    import numpy as np

    for bad in ({"width": "16"}, {"width": 16.0}, {"width": True}, {"d_in": None}, {"n_out": [3]}, {"seed": 1.5}):
        kwargs = {"arch": "relu", "d_in": 12, "width": 16, "n_out": 3, **bad}
        with pytest.raises(AuditError, match="must be an integer"):
            ModelSpec(**kwargs)
    spec = ModelSpec("relu", np.int64(12), np.int32(16), np.int64(3), seed=np.int64(7))
    assert type(spec.width) is int and type(spec.d_in) is int and type(spec.seed) is int
    assert json.loads(json.dumps(spec.__dict__))["width"] == 16
    with pytest.raises(AuditError, match="seed"):
        ModelSpec("relu", 12, 16, 3, seed=2**64)
    with pytest.raises(AuditError, match="seed"):
        ModelSpec("relu", 12, 16, 3, seed=10**5000)  # too long for str(): the message must not crash
    with pytest.raises(AuditError, match="positive"):
        ModelSpec("relu", 12, -(10**5000), 3)
    ModelSpec("relu", 12, 16, 3, seed=2**64 - 1)  # the largest seed torch accepts still builds
    build_model(ModelSpec("relu", 2, 2, 1, seed=2**64 - 1))


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    import os

    import safetensors.torch

    X, _ = data()
    model = build_model(ModelSpec("relu", 12, 16, 3, seed=3))
    path = tmp_path / "m.safetensors"
    save_model(model, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.safetensors.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~mask)
    before = (path.read_bytes(), (tmp_path / "m.safetensors.json").read_bytes())

    other = build_model(ModelSpec("relu", 12, 8, 3, seed=4))

    def broken_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save_file)
    with pytest.raises(AuditError, match="cannot save model .*No space left"):
        save_model(other, path, overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.safetensors.json"]
    assert (path.read_bytes(), (tmp_path / "m.safetensors.json").read_bytes()) == before

    real_replace = os.replace
    calls = []

    def failing_replace(src, dst):
        calls.append((src, dst))
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(AuditError, match="cannot save model"):
        save_model(other, path, overwrite=True)
    monkeypatch.setattr(os, "replace", real_replace)
    # both temporaries existed (side-car renamed first) and both are gone again
    assert len(calls) == 1 and str(calls[0][1]).endswith("m.safetensors.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.safetensors.json"]
    torch.testing.assert_close(load_model(path)(X), model(X), rtol=0, atol=0)

    save_model(other, path, overwrite=True)
    assert load_model(path).spec.width == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.safetensors.json"]


def test_save_into_missing_folder_is_an_audit_error(tmp_path):
    model = build_model(ModelSpec("relu", 3, 2, 1))
    with pytest.raises(AuditError, match="does not exist"):
        save_model(model, tmp_path / "nope" / "m.safetensors")
    assert not (tmp_path / "nope").exists()
