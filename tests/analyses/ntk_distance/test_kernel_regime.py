"""Kernel regime of trained transformers (ntk-distance --checkpoint, --arch vit,vit-linear) against
independent computations: explicit per-sample Jacobians, numpy CKA, GD of the linearized model."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch.func import functional_call
from typer.testing import CliRunner

from attnaudit.cli import app
from attnaudit.core.engine import Engine
from attnaudit.core.task import Task
from attnaudit.data import DataSpec, load_dataset
from attnaudit.errors import AuditError
from attnaudit.core.fit import Recipe, fit
from attnaudit.analyses.ntk_distance.config import SCHEMA_CHECKPOINT, SCHEMA_TRANSFORMERS
from attnaudit.analyses.ntk_distance.linearized import LinearizedModel, linearized_prediction
from attnaudit.analyses.ntk_distance.movement import (
    centered_kernel_alignment,
    entk_by_group,
    group_of,
    kernel_movement,
    parameter_groups,
)
from attnaudit.models.builtin import save_model
from attnaudit.models.vit import ViT, ViTSpec

torch.set_num_threads(1)
runner = CliRunner()


@pytest.fixture(scope="module")
def digits():
    ds = load_dataset(DataSpec(dataset="digits"))
    assert tuple(ds.feature_shape) == (8, 8)
    return ds


def tiny_vit(seed: int = 0, dim: int = 8, arch: str = "vit") -> ViT:
    return ViT(
        ViTSpec(arch, (1, 8, 8), 10, depth=2, dim=dim, heads=2, patch=4, mlp_ratio=2, seed=seed), dtype=torch.float64
    )


def trained(steps: int, lr: float = 0.05, seed: int = 0, rows: int = 60, data=None, optimizer: str = "gd"):
    X, y = data.X[:rows], data.y[:rows]
    net = tiny_vit(seed)
    init = copy.deepcopy(net)
    fit(net, X, y, Recipe(optimizer, lr, steps=steps, loss="mse"))
    return init, net


# ------------------------------------------------------------------------------- grouping


def test_grouping_rule():
    assert group_of("blocks.1.attn.q.weight") == "blocks.1"
    assert group_of("vit.encoder.layer.0.output.dense.bias") == "vit.encoder.layer.0"
    assert group_of("model.vit.layers.3.mlp.fc1.weight") == "model.vit.layers.3"
    assert group_of("vit.embeddings.cls_token") == "vit.embeddings"
    assert group_of("vit.embeddings.patch_embeddings.projection.weight") == "vit.embeddings"
    assert group_of("embed.weight") == "embed" and group_of("head.bias") == "head"
    assert group_of("pos_embed") == "pos_embed" and group_of("W") == "W"
    groups = parameter_groups([n for n, _ in tiny_vit().named_parameters()])
    assert list(groups) == ["pos_embed", "embed", "blocks.0", "blocks.1", "norm", "head"]
    assert groups["head"] == ["head.weight", "head.bias"]


# ------------------------------------------------------------------------------- movement


def test_movement_is_exactly_zero_for_a_model_against_itself(digits):
    _, net = trained(5, data=digits)
    X, y = digits.X[:20], digits.y[:20]
    for form in ("full", "trace"):
        mv = kernel_movement(net, copy.deepcopy(net), X, y, form=form)
        assert mv.movement_trace == 0.0
        assert mv.movement == (0.0 if form == "full" else None)
        assert all(g.movement_trace == 0.0 for g in mv.groups)
        assert mv.cka_init == mv.cka_trained


def test_movement_grows_with_training_steps(digits):
    X, y = digits.X[:24], digits.y[:24]
    moves = []
    for steps in (2, 8, 32):  # lr 1e-3: the movement grows about linearly in lr * steps
        init, net = trained(steps, lr=1e-3, data=digits)
        moves.append(kernel_movement(init, net, X, y).movement)
    assert 0 < moves[0] < moves[1] < moves[2], moves


def _explicit_group_kernel(model: ViT, X: torch.Tensor, names: list[str]) -> torch.Tensor:
    """sum_p dF_a(x_i)/dp dF_b(x_j)/dp over the group's parameters, from torch.autograd.functional.jacobian."""
    params = dict(model.named_parameters())
    fixed = {k: v.detach() for k, v in params.items() if k not in names}
    fixed.update({k: v for k, v in model.named_buffers()})

    def rows(x):
        def f(*tensors):
            state = {**fixed, **dict(zip(names, tensors))}
            return functional_call(model, state, (x.reshape(1, 1, 8, 8),)).squeeze(0)

        jac = torch.autograd.functional.jacobian(f, tuple(params[k].detach() for k in names))
        return torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)  # (c, P_g)

    J = torch.stack([rows(x) for x in X])  # (n, c, P_g)
    return torch.einsum("iap,jbp->ijab", J, J)


def test_group_kernels_equal_explicit_jacobian_products(digits):
    init, net = trained(10, data=digits)
    X, y = digits.X[:10].double(), digits.y[:10]
    groups = parameter_groups([n for n, _ in net.named_parameters()])
    by_group = entk_by_group(net, X, memory_bytes=4_000_000)  # small budget: panels and recomputed columns
    total = torch.zeros_like(next(iter(by_group.values())))
    for g, names in groups.items():
        ref = _explicit_group_kernel(net, X, names)
        assert torch.allclose(by_group[g], ref, rtol=1e-10, atol=1e-13), g
        total += by_group[g]
    engine = Engine(Task(net, 10, inputs=net.audit_inputs()), dtype=torch.float64)
    assert torch.allclose(total, engine.entk(X), rtol=1e-10, atol=1e-13)
    # per-group movement = the ratio of explicit group kernels (full and output-averaged)
    mv = kernel_movement(init, net, X, y)
    for g in ("blocks.1", "head"):
        K0, KT = _explicit_group_kernel(init, X, groups[g]), _explicit_group_kernel(net, X, groups[g])
        assert mv.group(g).movement == pytest.approx(((KT - K0).norm() / K0.norm()).item(), rel=1e-9)
        t0, tT = torch.einsum("ijaa->ij", K0) / 10, torch.einsum("ijaa->ij", KT) / 10
        assert mv.group(g).movement_trace == pytest.approx(((tT - t0).norm() / t0.norm()).item(), rel=1e-9)
    assert sum(g.trace_share_init for g in mv.groups) == pytest.approx(1.0, abs=1e-12)
    # size and shape of the change: ||K_T|| / ||K_0|| and the kernel distance 1 - cos(K_0, K_T)
    K0 = Engine(Task(init, 10, inputs=init.audit_inputs()), dtype=torch.float64).entk(X)
    KT = engine.entk(X)
    cos = ((K0 * KT).sum() / (K0.norm() * KT.norm())).item()
    assert mv.norm_ratio == pytest.approx((KT.norm() / K0.norm()).item(), rel=1e-10)
    assert mv.kernel_distance == pytest.approx(1 - cos, rel=1e-6, abs=1e-14)
    assert mv.movement == pytest.approx(((KT - K0).norm() / K0.norm()).item(), rel=1e-10)


def test_kernel_distance_ignores_a_change_of_scale(digits):
    """A head scaled by s scales every logit and the whole eNTK... except the head's own block; scaling every
    parameter of a homogeneous model is not available, so check the identity on the 2-layer net instead:
    f = a^T relu(W x) is 1-homogeneous in a, and a -> 2a doubles the W-block and leaves the a-block."""
    from attnaudit.models.builtin import ModelSpec, TwoLayerNet

    X = digits.X[:15].double()
    net = TwoLayerNet(ModelSpec("relu", 64, 16, 10, parametrization="standard", seed=0))
    twice = copy.deepcopy(net)
    with torch.no_grad():
        twice.a.mul_(2.0)
    mv = kernel_movement(net, twice, X, digits.y[:15])
    assert mv.group("a").movement == 0.0 and mv.group("a").kernel_distance == 0.0
    assert mv.group("W").norm_ratio == pytest.approx(4.0, rel=1e-12)  # J_W scales with a: the kernel with a^2
    assert mv.group("W").kernel_distance == pytest.approx(0.0, abs=1e-12)
    assert mv.group("W").movement == pytest.approx(3.0, rel=1e-12)


def test_memory_budget_changes_the_plan_not_the_numbers(digits):
    init, net = trained(10, data=digits)
    X, y = digits.X[:40], digits.y[:40]
    whole = kernel_movement(init, net, X, y)
    panels = kernel_movement(init, net, X, y, memory_bytes=8_000_000)
    assert whole.jacobian_passes == 1 and panels.jacobian_passes > 1
    assert panels.movement == pytest.approx(whole.movement, rel=1e-12)
    assert panels.cka_trained == pytest.approx(whole.cka_trained, rel=1e-12)
    engine = Engine(Task(net, 10, inputs=net.audit_inputs()), dtype=torch.float64)
    for form in ("full", "trace"):
        assert torch.allclose(
            engine.entk(X, form=form, memory_bytes=6_000_000), engine.entk(X, form=form), rtol=1e-12, atol=1e-14
        )
    with pytest.raises(AuditError, match="budget"):
        kernel_movement(init, net, X, y, memory_bytes=1000)


def test_a_tight_budget_shrinks_the_jacobian_sub_batch_before_the_panels(digits, monkeypatch):
    """40 rows, one row's Jacobian 10 x 1,474 x 8 bytes = 117,920 bytes, a 6 MB budget: 16-row
    sub-batches (3 x 16 rows' worth transient) would leave panels of one row, each column panel
    recomputed for every row panel (40 + 780 = 820 rows' Jacobians); 8-row sub-batches leave
    panels of 13 rows: 40 + 27 + 14 + 1 = 82 rows, still in panels."""
    _, net = trained(2, data=digits)
    X = digits.X[:40]
    engine = Engine(Task(net, 10, inputs=net.audit_inputs()), dtype=torch.float64)
    assert engine.n_params == 1474
    computed: list[tuple[int, int]] = []
    jacobian = engine.jacobian

    def counting(rows, theta=None, sub_batch=16):
        computed.append((rows.shape[0], sub_batch))
        return jacobian(rows, theta, sub_batch)

    monkeypatch.setattr(engine, "jacobian", counting)
    K = engine.entk(X, form="trace", memory_bytes=6_000_000)
    assert sum(r for r, _ in computed) == 82 and {b for _, b in computed} == {8}
    monkeypatch.undo()
    assert torch.allclose(K, engine.entk(X, form="trace"), rtol=1e-12, atol=1e-14)


def _numpy_cka(K: np.ndarray, Y: np.ndarray) -> float:
    n = K.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    L = Y @ Y.T
    Kc, Lc = H @ K @ H, H @ L @ H
    return float(np.sum(Kc * Lc) / (np.linalg.norm(Kc) * np.linalg.norm(Lc)))


def test_cka_against_numpy(digits):
    rng = np.random.default_rng(0)
    A = rng.standard_normal((30, 7))
    K = A @ A.T
    y = rng.integers(0, 4, 30)
    Y = np.eye(4)[y]
    assert centered_kernel_alignment(torch.tensor(K), torch.tensor(Y)) == pytest.approx(_numpy_cka(K, Y), rel=1e-12)
    # a kernel that is the label kernel itself aligns perfectly
    assert centered_kernel_alignment(torch.tensor(Y @ Y.T), torch.tensor(Y)) == pytest.approx(1.0, abs=1e-12)
    # the movement result's CKA = numpy CKA of the explicit output-averaged kernels
    init, net = trained(10, data=digits)
    X, yy = digits.X[:12].double(), digits.y[:12]
    mv = kernel_movement(init, net, X, yy)
    Yn = np.eye(10)[yy.numpy()]
    for model, value in ((init, mv.cka_init), (net, mv.cka_trained)):
        K = Engine(Task(model, 10, inputs=model.audit_inputs()), dtype=torch.float64).entk(X, form="trace").numpy()
        assert value == pytest.approx(_numpy_cka(K, Yn), rel=1e-10)


# ------------------------------------------------------------------------------- linearized model


def test_linearized_prediction_matches_the_network_for_a_tiny_lr(digits):
    X, y, Xt, yt = digits.X[:40], digits.y[:40], digits.X[100:130], digits.y[100:130]
    ratios = {}
    for lr in (1e-4, 1e-5):
        recipe = Recipe("gd", lr, steps=3, loss="mse")
        net = tiny_vit(1)
        init = copy.deepcopy(net)
        fit(net, X, y, recipe)
        f0 = Engine(Task(init, 10, inputs=init.audit_inputs())).logits(Xt)
        fT = Engine(Task(net, 10, inputs=net.audit_inputs())).logits(Xt)
        change = (fT - f0).pow(2).sum(1).mean().sqrt().item()
        assert change > 0
        for method in ("kernel-gd", "train"):
            lin = linearized_prediction(init, net, recipe, X, y, Xt, yt, method=method)
            assert lin.method == method and lin.kernel_gd
            ratios[lr, method] = lin.distance_rms / change
    for method in ("kernel-gd", "train"):
        # the network's move and the kernel-GD move differ at second order in lr: far below the move itself,
        # and the gap relative to the move shrinks in proportion to lr
        assert ratios[1e-5, method] < 1e-3, ratios
        assert 5 < ratios[1e-4, method] / ratios[1e-5, method] < 20, ratios


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_kernel_gd_closed_form_equals_training_the_linearized_network(digits, loss):
    X, y, Xt, yt = digits.X[:30], digits.y[:30], digits.X[200:220], digits.y[200:220]
    recipe = Recipe("gd", 0.02, steps=15, loss=loss)
    net = tiny_vit(2)
    init = copy.deepcopy(net)
    fit(net, X, y, recipe)
    a = linearized_prediction(init, net, recipe, X, y, Xt, yt, method="kernel-gd")
    b = linearized_prediction(init, net, recipe, X, y, Xt, yt, method="train")
    assert a.method == "kernel-gd" and b.method == "train"
    assert a.distance_rms == pytest.approx(b.distance_rms, rel=1e-8)
    assert a.lin_train_loss == pytest.approx(b.lin_train_loss, rel=1e-8)
    # auto picks the closed form for a small full-batch GD run, train for adam (and says it is not kernel GD)
    assert linearized_prediction(init, net, recipe, X, y, Xt, yt).method == "kernel-gd"
    adam = linearized_prediction(init, net, Recipe("adam", 1e-3, steps=2, loss=loss), X, y, Xt, yt)
    assert adam.method == "train" and not adam.kernel_gd and "not kernel gradient descent" in adam.dynamics
    with pytest.raises(AuditError, match="kernel-gd"):
        linearized_prediction(init, net, Recipe("adam", 1e-3, steps=2), X, y, Xt, yt, method="kernel-gd")
    assert not a.unstable and not b.unstable and a.lin_train_loss < a.lin_initial_loss
    # a step far above the stable one: both methods flag the linearized model as unstable
    huge = Recipe("gd", 1e3, steps=5, loss=loss)
    for method in ("kernel-gd", "train"):
        assert linearized_prediction(init, net, huge, X, y, Xt, yt, method=method).unstable, method


def test_linearized_model_is_the_first_order_expansion(digits):
    net = tiny_vit(3)
    engine = Engine(Task(net, 10, inputs=net.audit_inputs()), dtype=torch.float64)
    lin = LinearizedModel(engine)
    X = digits.X[:5].double()
    assert torch.allclose(lin(X), engine.logits(X), rtol=0, atol=1e-14)
    delta = 1e-6 * torch.randn(engine.n_params, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        lin.theta.add_(delta)
    expected = engine.logits(X) + torch.einsum("iap,p->ia", engine.jacobian(X), delta)
    assert torch.allclose(lin(X), expected, rtol=1e-10, atol=1e-14)
    assert [n for n, _ in lin.named_parameters()] == ["theta"]  # the original module is not a submodule


def test_linearized_model_gradient_is_the_jacobian_transpose_at_theta0(digits):
    """The gradient of <W, f_lin(theta)> is J(theta_0)^T W wherever theta is (f_lin is linear in
    theta): checked against the dense Jacobian, away from theta_0, in float64 and float32."""
    net = tiny_vit(3)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-4)):
        engine = Engine(Task(net, 10, inputs=net.audit_inputs()), dtype=dtype)
        lin = LinearizedModel(engine)
        X = digits.X[:4].to(dtype)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            lin.theta.add_(1e-2 * torch.randn(engine.n_params, generator=gen, dtype=dtype))
        W = torch.randn(4, 10, generator=gen, dtype=dtype)
        (lin(X) * W).sum().backward()
        J = Engine(Task(net, 10, inputs=net.audit_inputs()), dtype=torch.float64).jacobian(X.double())
        expected = torch.einsum("iap,ia->p", J, W.double())
        assert lin.theta.grad is not None and lin.theta.grad.dtype == dtype
        err = (lin.theta.grad.double() - expected).norm() / expected.norm()
        assert err < tol, (dtype, float(err))


# ------------------------------------------------------------------------------- CLI


def _save_checkpoint(path, net, metadata):
    save_model(net, path, metadata=metadata)  # float64: the rebuilt initialization is float64 too
    return path


def test_cli_checkpoint_movement_per_block_and_against_itself(tmp_path, digits):
    init, net = trained(10, data=digits)
    recipe = Recipe("gd", 0.05, steps=10, loss="mse")
    ckpt = _save_checkpoint(tmp_path / "vit.safetensors", net, {"recipe": recipe.to_dict(), "init_seed": 0})
    out = tmp_path / "r.json"
    res = runner.invoke(
        app,
        [
            "ntk-distance",
            "--checkpoint",
            str(ckpt),
            "--kernel-points",
            "16",
            "--n-test",
            "20",
            "--json",
            str(out),
            "--png",
            str(tmp_path / "f.png"),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    payload = json.loads(out.read_text())
    assert payload["schema"] == SCHEMA_CHECKPOINT
    model = payload["results"]["models"]["vit"]
    mv = model["movement"]
    assert mv["movement"] > 0 and mv["n_points"] == 16
    assert [g["group"] for g in mv["groups"]] == ["pos_embed", "embed", "blocks.0", "blocks.1", "norm", "head"]
    assert model["reference"]["kind"] == "rebuilt" and model["reference"]["init_seed"] == 0
    # no recorded training split in this side-car: no linearized model, and the report says why
    assert model["linearized"]["applicable"] is False and "training rows" in model["linearized"]["reason"]
    assert (tmp_path / "f.png").stat().st_size > 1000
    # the rebuilt initialization is the model's real initialization: against a saved copy of it, the same numbers
    init_ckpt = _save_checkpoint(tmp_path / "init.safetensors", init, {})
    res = runner.invoke(
        app,
        [
            "ntk-distance",
            "--checkpoint",
            str(ckpt),
            "--reference-checkpoint",
            str(init_ckpt),
            "--kernel-points",
            "16",
            "--n-test",
            "20",
            "--json",
            "-",
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)["results"]["models"]["vit"]["movement"]
    assert again["movement"] == pytest.approx(mv["movement"], rel=1e-12)
    # a checkpoint against itself: exactly zero, overall and per group
    res = runner.invoke(
        app,
        [
            "ntk-distance",
            "--checkpoint",
            str(ckpt),
            "--reference-checkpoint",
            str(ckpt),
            "--kernel-points",
            "16",
            "--n-test",
            "20",
            "--json",
            "-",
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    same = json.loads(res.stdout)["results"]["models"]["vit"]["movement"]
    assert same["movement"] == 0.0 and all(g["movement"] == 0.0 for g in same["groups"])


def test_cli_checkpoint_from_attnaudit_train_has_the_linearized_distance(tmp_path):
    ckpt = tmp_path / "vit.safetensors"
    res = runner.invoke(
        app,
        [
            "train",
            "--arch",
            "vit",
            "--dataset",
            "digits",
            "--dim",
            "8",
            "--heads",
            "2",
            "--depth",
            "1",
            "--optimizer",
            "gd",
            "--lr",
            "0.1",
            "--steps",
            "5",
            "--n-train",
            "120",
            "--n-test",
            "40",
            "--out",
            str(ckpt),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app,
        [
            "ntk-distance",
            "--checkpoint",
            str(ckpt),
            "--kernel-points",
            "16",
            "--n-test",
            "30",
            "--json",
            "-",
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    model = json.loads(res.stdout)["results"]["models"]["vit"]
    assert model["rows"]["rows"] == "checkpoint split"
    lin = model["linearized"]
    assert lin["applicable"] and lin["method"] == "kernel-gd" and lin["kernel_gd"]
    assert lin["n_train"] == 120 and lin["n_test"] == 30 and lin["steps"] == 5
    assert 0 <= lin["distance_rel"] < 1


def test_cli_transformer_width_sweep(tmp_path):
    out = tmp_path / "s.json"
    res = runner.invoke(
        app,
        [
            "ntk-distance",
            "--arch",
            "vit,vit-linear",
            "--widths",
            "8,16",
            "--seeds",
            "2",
            "--n-train",
            "100",
            "--n-test",
            "40",
            "--steps",
            "4",
            "--kernel-points",
            "12",
            "--json",
            str(out),
            "--png",
            str(tmp_path / "s.png"),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    payload = json.loads(out.read_text())
    assert payload["schema"] == SCHEMA_TRANSFORMERS
    res_ = payload["results"]
    assert {(c["arch"], c["width"], c["seed"]) for c in res_["cells"]} == {
        (a, w, s) for a in ("vit", "vit-linear") for w in (8, 16) for s in (0, 1)
    }
    for arch in ("vit", "vit-linear"):
        summary = res_["archs"][arch]
        for measure in ("movement", "kernel_distance", "distance"):
            assert len(summary[measure]["slope_per_seed"]) == 2 and summary[measure]["slope_mean"] is not None
            assert summary[measure]["trend"] in ("falls", "falls-non-monotone", "rises", "mixed", "no-clear-trend")
    assert "fixed at 4" in res_["config"]["heads_rule"]
    assert res_["config"]["recipe"]["optimizer"] == "adam" and res_["config"]["recipe"]["batch_size"] == 64
    assert all(c["linearized"]["method"] == "train" for c in res_["cells"])
    assert len(payload["verdicts"]) == 2 and (tmp_path / "s.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arch", "vit", "--models", "relu"], "--models"),
        (["--arch", "mlp"], "unknown --arch"),
        (["--arch", "vit", "--widths", "6"], "multiples of the 4"),
        (["--arch", "vit", "--optimizer", "sgd"], "needs --lr"),
        (["--arch", "vit", "--linearized", "bogus"], "unknown --linearized"),
        (["--linearized", "train"], "--linearized"),
        (["--optimizer", "adam"], "--optimizer"),
        (["--reference-checkpoint", "x.safetensors"], "--reference-checkpoint"),
        (["--checkpoint", "missing.safetensors"], "not found"),
    ],
)
def test_cli_bad_options_exit_2_with_one_line(args, message):
    res = runner.invoke(app, ["ntk-distance", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) == 1, res.output


def test_cli_checkpoint_refusals(tmp_path, digits):
    _, net = trained(3, data=digits)
    ckpt = _save_checkpoint(tmp_path / "vit.safetensors", net, {})
    cases = [
        (["--widths", "8"], "--widths"),
        (["--arch", "vit"], "give one of them"),
        (["--linearized", "kernel-gd"], "training recipe"),
    ]
    other = _save_checkpoint(tmp_path / "wide.safetensors", tiny_vit(0, dim=16), {})
    cases.append((["--reference-checkpoint", str(other)], "same parameters"))
    for extra, message in cases:
        res = runner.invoke(
            app, ["ntk-distance", "--checkpoint", str(ckpt), "--kernel-points", "8", "--n-test", "5", *extra]
        )
        assert res.exit_code == 2, (extra, res.output)
        assert message in res.output and "Traceback" not in res.output, (extra, res.output)


def test_sweep_verdict_needs_every_scale_free_measure_to_fall():
    from attnaudit.analyses.ntk_distance.transformers import TransformerCell
    from attnaudit.analyses.ntk_distance.verdicts import arch_summary

    def cells(move, shape, rel):
        out = []
        for seed, wobble in ((0, 1.0), (1, 1.1), (2, 0.95)):
            for w, m, k, r in zip((16, 32, 64), move, shape, rel):
                out.append(
                    TransformerCell(
                        "vit",
                        w,
                        4,
                        seed,
                        1,
                        1,
                        False,
                        0.0,
                        0.0,
                        0.0,
                        m * wobble,
                        m,
                        m,
                        k * wobble,
                        None,
                        None,
                        {},
                        {},
                        10 * r,
                        r * wobble,
                        0.0,
                    )
                )
        return out

    widths, seeds = (16, 32, 64), (0, 1, 2)
    lazy = arch_summary("vit", cells((1.0, 0.5, 0.25), (0.4, 0.2, 0.1), (0.8, 0.4, 0.2)), widths, seeds, True)
    assert lazy.approaches_kernel_regime and lazy.movement.slope_mean == pytest.approx(-1.0)
    # the same curves from two seeds carry no trend claim (a verdict needs 3 seeds)
    two = [c for c in cells((1.0, 0.5, 0.25), (0.4, 0.2, 0.1), (0.8, 0.4, 0.2)) if c.seed < 2]
    assert not arch_summary("vit", two, widths, (0, 1), True).approaches_kernel_regime
    assert "approaching the kernel regime" in lazy.verdict and "slowly" not in lazy.verdict
    # the kernel shrinks in size only: its shape change stays, so no kernel regime is claimed
    scale_only = arch_summary("vit", cells((1.0, 0.5, 0.25), (0.7, 0.7, 0.7), (0.8, 0.4, 0.2)), widths, seeds, True)
    assert not scale_only.approaches_kernel_regime and "not clearly approaching" in scale_only.verdict
    away = arch_summary("vit", cells((1.0, 0.5, 0.25), (0.4, 0.2, 0.1), (0.2, 0.4, 0.8)), widths, seeds, True)
    assert not away.approaches_kernel_regime and "moving away" in away.verdict
    slow = arch_summary("vit", cells((1.0, 0.5, 0.25), (0.4, 0.38, 0.36), (0.8, 0.4, 0.2)), widths, seeds, True)
    assert slow.approaches_kernel_regime and "slowly" in slow.verdict
