"""Reference models and the trainer: definitions, determinism, checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnaudit.errors import AuditError
from attnaudit.models import ModelSpec, attention_context, build_model, load_model, save_model, training_data_mismatch
from attnaudit.training import TrainConfig, loss_value, per_sample_loss, train


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
    save_model(model, tmp_path / "m.safetensors", metadata={"training_data": {"name": "toy", "n": 40, "fingerprint": fp}})
    loaded = load_model(tmp_path / "m.safetensors")
    assert training_data_mismatch(loaded, "m", fp) is None
    other = data_fingerprint(X * 2, y)
    warning = training_data_mismatch(loaded, "m", other)
    assert warning is not None and fp in warning and other in warning and "toy" in warning
    save_model(model, tmp_path / "bare.safetensors")  # no provenance recorded: nothing to say
    assert training_data_mismatch(load_model(tmp_path / "bare.safetensors"), "bare", other) is None
