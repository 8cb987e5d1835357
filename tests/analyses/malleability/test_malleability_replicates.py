"""Seeds that repeat the same comparison are copies, not replicates.

In the static protocol a saved model and its rows are fixed; a deterministic attack (fgsm)
then perturbs them the same way for every seed. Truths: a run of the later seed alone (a
fresh process state, nothing reused) gives bitwise the numbers of its copy; the random
control (sign) draws new noise per seed and stays two replicates; the number of influence
computations actually made is counted by wrapping the estimator call."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnaudit.analyses.malleability.cell_tools import influence_key
from attnaudit.analyses.malleability.cells import Cell
from attnaudit.analyses.malleability.config import MalleabilityConfig
from attnaudit.analyses.malleability.malleability import run_malleability
from attnaudit.analyses.malleability.stability import distinct_replicates
from attnaudit.core.training import TrainConfig, train
from attnaudit.models.builtin import ModelSpec, build_model

SMALL = dict(width=8, steps=25, lr=2.0, top_k=10, pgd_steps=3)


@pytest.fixture
def saved_relu(digits):
    X, y, *_ = digits
    model = build_model(ModelSpec("relu", 64, 8, 10, seed=3))
    train(model, X, y, TrainConfig(lr=2.0, steps=30))
    return model


def _static(digits, model, seeds, monkeypatch, calls):
    X, y, Xt, yt = digits
    real = Cell.sweep

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(Cell, "sweep", counted)
    cfg = MalleabilityConfig(
        attacks=("fgsm", "sign"), eps=(0.1,), seeds=seeds, protocol="static", controls=False, **SMALL
    )
    return run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0), fixed_models={"relu": model})


def test_a_deterministic_attack_on_a_saved_model_is_one_replicate(digits, saved_relu, monkeypatch):
    calls: list = []
    res = _static(digits, saved_relu, (0, 1), monkeypatch, calls)
    # computed: clean once, fgsm once, sign for each seed (its noise depends on the seed)
    assert len(calls) == 4
    by_attack = {row["attack"]: row for row in res.summary}
    fgsm, sign = by_attack["fgsm"], by_attack["sign"]
    assert fgsm["seeds"] == [0] and fgsm["same_inputs"] == [{"seed": 1, "as_seed": 0}]
    assert fgsm["flip_rate"]["n"] == 1 and fgsm["flip_rate"]["ci_low"] is None  # one replicate: no interval
    assert sign["seeds"] == [0, 1] and "same_inputs" not in sign and sign["flip_rate"]["n"] == 2
    assert any("counted once" in w and "fgsm" in w for w in res.warnings)
    reused = [d for d in res.influence_diagnostics if d.get("same_inputs_as")]
    assert sorted(d["role"] for d in reused) == ["clean", "fgsm@0.1"] and all(d["seconds"] == 0.0 for d in reused)
    assert all(d["seed"] == 1 for d in reused)

    # the copy is what a fresh computation of seed 1 gives, bit for bit
    alone_calls: list = []
    alone = _static(digits, saved_relu, (1,), monkeypatch, alone_calls)
    assert len(alone_calls) == 3
    for attack in ("fgsm", "sign"):
        two = next(r for r in res.runs if r["seed"] == 1 and r["attack"] == attack)
        one = next(r for r in alone.runs if r["attack"] == attack)
        for key in ("flip_rate", "spearman", "top_k_overlap", "inputs_sha256"):
            assert two[key] == one[key], (attack, key)
    sign_runs = [r for r in res.runs if r["attack"] == "sign"]
    assert sign_runs[0]["inputs_sha256"] != sign_runs[1]["inputs_sha256"]


def test_distinct_replicates_by_hand():
    rows = [
        {"seed": 0, "inputs_sha256": "a"},
        {"seed": 1, "inputs_sha256": "a"},
        {"seed": 2, "inputs_sha256": "b"},
        {"seed": 3, "inputs_sha256": None},
        {"seed": 4, "inputs_sha256": None},
        {"seed": 5, "inputs_sha256": "b"},
    ]
    kept, copies = distinct_replicates(rows)
    assert [r["seed"] for r in kept] == [0, 2, 3, 4]
    assert copies == [{"seed": 1, "as_seed": 0}, {"seed": 5, "as_seed": 2}]


def test_a_changed_model_is_never_served_from_the_memo(digits, saved_relu, monkeypatch):
    """The memo key covers the parameters: the same rows on a model one weight apart are computed again."""
    X, y, Xt, yt = digits
    config = MalleabilityConfig(attacks=("fgsm",), seeds=(0,), protocol="static", controls=False, **SMALL)
    rows = (X, y, Xt, yt)
    key = influence_key(saved_relu, rows, config, 10, "relu")
    other = build_model(ModelSpec("relu", 64, 8, 10, seed=3))
    other.load_state_dict(saved_relu.state_dict())
    assert influence_key(other, rows, config, 10, "relu") == key
    with torch.no_grad():
        other.W[0, 0] += 1e-12
    assert influence_key(other, rows, config, 10, "relu") != key
    X2 = X.clone()
    X2[0, 0] = np.nextafter(float(X2[0, 0]), math.inf)
    assert influence_key(saved_relu, (X2, y, Xt, yt), config, 10, "relu") != key
    damped = MalleabilityConfig(
        attacks=("fgsm",), seeds=(0,), protocol="static", controls=False, damping=(1e-2,), **SMALL
    )
    assert influence_key(saved_relu, rows, damped, 10, "relu") != key


def test_a_seedless_attack_is_computed_once_and_the_copy_equals_a_fresh_one(digits, saved_relu, monkeypatch):
    """fgsm draws nothing from its seed: against the same saved model and rows it is computed for
    the first seed only, the later seed's attack row says whose perturbation it holds, and its
    numbers equal a run of that seed alone (which computes the attack afresh). sign (seeded noise)
    is computed for every seed."""
    import attnaudit.analyses.malleability.cells as cells

    attacked: list = []
    real = cells.perturb

    def counted(model, X, y, config, *args, **kwargs):
        attacked.append((config.method, config.seed))
        return real(model, X, y, config, *args, **kwargs)

    monkeypatch.setattr(cells, "perturb", counted)
    res = _static(digits, saved_relu, (0, 1), monkeypatch, [])
    assert sorted(attacked) == [("fgsm", 0), ("sign", 0), ("sign", 1)]
    rows = {(r["method"], r["seed"]): r for r in res.attacks}
    assert rows[("fgsm", 1)]["perturbation_of_seed"] == 0 and rows[("fgsm", 0)]["perturbation_of_seed"] == 0
    assert rows[("sign", 1)]["perturbation_of_seed"] == 1
    alone = _static(digits, saved_relu, (1,), monkeypatch, [])
    fresh = next(r for r in alone.attacks if r["method"] == "fgsm")
    for key in ("model_loss_after", "perturbation_linf_mean", "perturbation_l2_max"):
        assert rows[("fgsm", 1)][key] == fresh[key], key
    assert fresh["seed"] == rows[("fgsm", 1)]["seed"] == 1


def test_below_float64_a_saved_model_is_attacked_as_a_float32_copy_made_and_evaluated_once(
    digits, saved_relu, monkeypatch
):
    """precision float32: the attacks see a float32 copy of the saved (float64) model, made and
    evaluated once for both seeds; the user's model is left as it was; the recorded accuracies
    are the float32 copy's, counted here by hand."""
    import attnaudit.analyses.malleability.cells as cells

    X, y, Xt, yt = digits
    before = {k: v.clone() for k, v in saved_relu.state_dict().items()}
    dtypes, evaluations = [], []
    real_perturb, real_evaluated = cells.perturb, Cell.evaluated

    def seen(model, *args, **kwargs):
        dtypes.append(next(model.parameters()).dtype)
        return real_perturb(model, *args, **kwargs)

    def counted(self, *args, **kwargs):
        evaluations.append(self.seed)
        return real_evaluated(self, *args, **kwargs)

    monkeypatch.setattr(cells, "perturb", seen)
    monkeypatch.setattr(Cell, "evaluated", counted)
    cfg = MalleabilityConfig(
        attacks=("fgsm", "sign"),
        eps=(0.1,),
        seeds=(0, 1),
        protocol="static",
        controls=False,
        precision="float32",
        **SMALL,
    )
    res = run_malleability(X, y, Xt, yt, 10, cfg, value_range=(0.0, 1.0), fixed_models={"relu": saved_relu})
    assert dtypes and set(dtypes) == {torch.float32}
    assert evaluations == [0]  # seed 1 reuses seed 0's copy and its evaluation
    after = saved_relu.state_dict()
    assert all(after[k].dtype == torch.float64 and torch.equal(after[k], v) for k, v in before.items())
    copy32 = build_model(ModelSpec("relu", 64, 8, 10, seed=3)).float()
    copy32.load_state_dict({k: v.float() for k, v in before.items()})
    with torch.no_grad():
        by_hand = [(copy32(A.float()).argmax(1) == b).double().mean().item() for A, b in ((X, y), (Xt, yt))]
    for row in res.training:
        assert (row["train_accuracy"], row["test_accuracy"]) == pytest.approx(by_hand, abs=1e-12)
    assert "working copy" in " ".join(cfg.precision_policy.heavy)
