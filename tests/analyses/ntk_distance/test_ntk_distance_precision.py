"""ntk-distance at a lower precision: the kernel block's float64 spot check tells float32 from
bfloat16, the kernel movement in float32 matches float64's, a checkpoint's report records both,
and the training dtype's option is --train-dtype (--dtype still parses)."""

from __future__ import annotations

import copy

import pytest
import torch

from attnaudit.analyses.ntk_distance.movement import kernel_movement, kernel_precision_check
from attnaudit.analyses.ntk_distance.run import NtkDistanceRequest
from attnaudit.analyses.registry import run
from attnaudit.core.fit import Recipe, fit
from attnaudit.data import DataSpec, load_dataset
from attnaudit.models.builtin import save_model
from attnaudit.models.vit import ViT, ViTSpec


@pytest.fixture(scope="module")
def vits():
    """A tiny float64 ViT on 8x8 digits (1,474 parameters) before and after 10 GD steps, and its rows."""
    ds = load_dataset(DataSpec(dataset="digits"))
    X, y = ds.X[:60], ds.y[:60]
    net = ViT(ViTSpec("vit", (1, 8, 8), 10, depth=2, dim=8, heads=2, patch=4, mlp_ratio=2, seed=0), dtype=torch.float64)
    init = copy.deepcopy(net)
    fit(net, X, y, Recipe("gd", 0.05, steps=10, loss="mse"))
    return init, net, X, y


def test_the_kernel_check_tells_float32_from_bfloat16(vits):
    _, net, X, _ = vits
    f32 = kernel_precision_check(net, X, torch.float32)
    bf16 = kernel_precision_check(net, X, torch.bfloat16)
    f64 = kernel_precision_check(net, X, torch.float64)
    for c in (f32, bf16):
        assert c.subsample == {"rows": 8, "outputs": 10}  # the first 8 rows, all 10 logits
    assert f32.precision == "float32" and bf16.precision == "bfloat16"
    # measured: 8.9e-8 (float32, near its unit round-off 6e-8) and 3.8e-3 (bfloat16, near 2^-9 = 2e-3)
    assert 0 < f32.relative_error < 1e-4 and f32.agrees and f32.warning is None
    assert 1e-4 < bf16.relative_error < 0.1 and bf16.relative_error > 100 * f32.relative_error
    assert bf16.agrees  # inside bfloat16's stated tolerance (relative error <= 0.1, Spearman >= 0.9)
    assert f64.relative_error == 0.0  # the same float64 computation twice


def test_kernel_movement_in_float32_matches_float64(vits):
    init, net, X, y = vits
    lo = kernel_movement(init, net, X[:20], y[:20], dtype=torch.float32)
    hi = kernel_movement(init, net, X[:20], y[:20])  # float64, the default
    assert hi.headline > 0.1  # the model moved (measured: 0.66)
    rel = abs(lo.headline / hi.headline - 1)
    assert 0 < rel < 1e-4, rel  # measured: 1e-8; not 0: the Jacobians really ran in float32
    for name in ("movement_trace", "kernel_distance", "norm_ratio"):
        assert getattr(lo, name) == pytest.approx(getattr(hi, name), rel=1e-4, abs=1e-7), name


def test_a_checkpoints_report_records_the_precision_and_its_check(vits, tmp_path):
    _, net, _, _ = vits
    path = tmp_path / "vit.safetensors"
    save_model(net, path, metadata={"init_seed": 0})
    n_params = sum(p.numel() for p in net.parameters())
    reports = {
        p: run(NtkDistanceRequest(checkpoint=(str(path),), kernel_points=16, n_test=20, precision=p))
        for p in ("float32", "float64", "auto")
    }
    lo = reports["float32"].results["models"]["vit"]
    assert lo["precision"]["asked"] == "float32" and lo["precision"]["used"] == "float32"
    check = lo["precision_check"]
    assert check["precision"] == "float32" and check["agrees"] is True and 0 < check["relative_error"] < 1e-4
    assert not any("precision check" in w for w in reports["float32"].report.get("warnings") or [])
    hi = reports["float64"].results["models"]["vit"]
    assert hi["precision"]["used"] == "float64" and not hi["precision_check"]  # no check in float64
    # the movement itself ran in float32: close to float64's, not equal to it
    assert lo["movement"]["movement"] == pytest.approx(hi["movement"]["movement"], rel=1e-4)
    assert lo["movement"]["movement"] != hi["movement"]["movement"]
    auto = reports["auto"].results["models"]["vit"]["precision"]
    assert auto["used"] == "float64" and f"{n_params:,}" in auto["reason"] and n_params == 1474


def test_train_dtype_is_the_option_and_dtype_its_deprecated_spelling():
    old = NtkDistanceRequest.from_argv(["--dtype", "float32", "--models", "relu"])
    new = NtkDistanceRequest.from_argv(["--train-dtype", "float32", "--models", "relu"])
    assert old == new and old.dtype == "float32"
    argv = old.to_argv()
    assert "--train-dtype" in argv and "--dtype" not in argv
    assert argv[argv.index("--train-dtype") + 1] == "float32"
    assert NtkDistanceRequest.flag_of("dtype") == "--train-dtype"
    # the kernels' precision is a separate option
    both = NtkDistanceRequest.from_argv(["--train-dtype", "float64", "--precision", "float32"])
    assert (both.dtype, both.precision) == ("float64", "float32")
    assert NtkDistanceRequest.from_argv(both.to_argv()) == both
    assert NtkDistanceRequest().precision == "auto"


def test_a_float32_kernel_of_a_wide_language_model_is_summed_in_float64():
    """A 2-layer, width-256 GPT-2's document log-likelihood eNTK in float32 against float64: its
    Jacobians agree to 5e-7, and the kernel, contracted over 1.7 M parameters, must too (a float32
    matrix product of them was 3.6e-4 off; at GPT-2-small size 1.6e-2)."""
    transformers = pytest.importorskip("transformers")
    from attnaudit.analyses.ntk_distance.language import document_rows, likelihood_task
    from attnaudit.core.lm_rows import pack_rows, targets_for
    from attnaudit.core.task import NextTokenLoss, Task
    from attnaudit.models.hf_causal import HFCausalLM

    V, L = 500, 32
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=L, n_embd=256, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=2, eos_token_id=2
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
        ids = torch.randint(3, V, (8, L))
    lm = HFCausalLM(model, pad_token_id=0, vocab_size=V, max_length=L)
    attention = torch.ones(8, L, dtype=torch.long)
    rows = document_rows(pack_rows(ids, attention), targets_for(ids, attention))
    check = kernel_precision_check(
        likelihood_task(Task(lm, V, NextTokenLoss(), lm.audit_inputs())), rows, torch.float32
    )
    assert check.spearman == pytest.approx(1.0)
    assert check.relative_error < 1e-6  # measured 1.0e-7
