"""The influence estimator registry (attnaudit.analyses.influence.estimators): a new estimator
is one class and one registration, and runs through influence_sweep like the built-in ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnaudit.analyses.influence import influence as I
from attnaudit.analyses.influence.estimators import ESTIMATORS, Estimator, Solution, absolute_damping, register
from attnaudit.errors import AuditError

F64 = torch.float64


@pytest.fixture
def toy():
    """Identity curvature: influence = -g_test . g_train / (1 + damping)."""

    @register
    class GradientDot(Estimator):
        name = "toy-gradient-dot"

        def solve(self, state, damping):
            return Solution(state.context.test_grads / (1 + absolute_damping(damping, None)), float(damping))

    yield GradientDot
    ESTIMATORS.pop(GradientDot.name)


def _data():
    gen = torch.Generator().manual_seed(0)
    X, Xt = torch.randn(20, 4, generator=gen, dtype=F64), torch.randn(6, 4, generator=gen, dtype=F64)
    y, yt = torch.randint(0, 3, (20,), generator=gen), torch.randint(0, 3, (6,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    return model, X, y, Xt, yt


def _grads(model, X, y):
    """Per-sample gradients of the cross-entropy over every parameter, (n, P), by plain autograd."""
    rows = []
    for x, t in zip(X, y):
        loss = F.cross_entropy(model(x[None]), t[None], reduction="sum")
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))]))
    return torch.stack(rows)


def test_a_registered_toy_estimator_runs_through_influence_sweep(toy):
    model, X, y, Xt, yt = _data()
    results = I.influence_sweep(
        model, X, y, Xt, yt, I.InfluenceConfig(estimator=toy.name, per_test=True), loss="ce", dampings=[0.0, 1.0]
    )
    G_tr, G_te = _grads(model, X, y), _grads(model, Xt, yt)
    expected = -(G_tr @ G_te.T)  # (n_train, n_test)
    assert [r.damping for r in results] == [0.0, 1.0]
    torch.testing.assert_close(results[0].per_test, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(results[0].total, expected.sum(1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(results[1].per_test, expected / 2, rtol=1e-10, atol=1e-12)
    assert results[0].estimator == toy.name and results[0].n_params == G_tr.shape[1]
    # the shared memory estimate knows the toy (no structures of its own) and keeps every estimator's keys
    mem = results[0].diagnostics["memory_estimate_bytes"]
    assert mem["hessian_and_eigenvectors"] == mem["cg_vectors"] == 0
    assert mem["transformed_test_gradients"] == G_tr.shape[1] * len(Xt) * 2 * 8


def test_every_registered_estimator_is_accepted_by_influence_config(toy):
    assert I.ESTIMATORS is ESTIMATORS
    assert list(ESTIMATORS)[:7] == ["exact", "last-layer", "cg", "tracin", "kfac", "ekfac", "projected"]
    for name, cls in ESTIMATORS.items():
        assert cls.name == name
        assert I.InfluenceConfig(estimator=name).estimator == name
    with pytest.raises(
        AuditError, match=f"use one of exact, last-layer, cg, tracin, kfac, ekfac, projected, {toy.name}"
    ):
        I.InfluenceConfig(estimator="no-such-estimator")


def test_register_refuses_a_second_class_under_a_taken_name():
    class Other(Estimator):
        name = "cg"

    with pytest.raises(ValueError, match="already registered"):
        register(Other)
    assert ESTIMATORS["cg"] is not Other
