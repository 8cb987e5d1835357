"""kappa's eNTK Gram at a lower precision, against a Gram built here from torch.func.jacrev
Jacobians of a float64 copy of a tiny ViT, and the float64 spot check of its spectrum and kappa."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from attnaudit.analyses.kappa.entk import entk_gram, entk_result, layer_task, spectrum_precision_check
from attnaudit.analyses.kappa.run import KappaRequest
from attnaudit.analyses.registry import run
from attnaudit.models.builtin import save_model
from attnaudit.models.vit import ViT, ViTSpec

C = 4  # logits


def tiny_vit() -> ViT:
    """A float32 one-block ViT (820 parameters) with weights of std 0.3 (attention far from uniform)."""
    model = ViT(ViTSpec(arch="vit", image_shape=(1, 8, 8), n_out=C, depth=1, dim=8, heads=2, patch=4, seed=0))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for sub in model.modules():
            if not isinstance(sub, nn.LayerNorm):
                for p in sub.parameters(recurse=False):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module")
def setup():
    """The model, 20 rows in [0, 1)^64 and the Gram (1/c) sum_a J_a J_a^T from jacrev on a float64 copy."""
    model = tiny_vit()
    X = torch.rand(20, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    twin = copy.deepcopy(model).double().eval()
    params = {n: p.detach() for n, p in twin.named_parameters()}

    def logits(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(twin, p, (x.reshape(1, 1, 8, 8),))[0]

    jac = vmap(jacrev(logits), in_dims=(None, 0))(params, X)  # name -> (n, c, *shape)
    J = torch.cat([jac[n].reshape(X.shape[0], C, -1) for n in params], dim=2)  # (n, c, P)
    K = (torch.einsum("iap,jap->ij", J, J) / C).numpy()
    return model, X, K, J.shape[2]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_entk_gram_in_float32_and_float64_against_jacrev(setup):
    model, X, K_ref, P = setup
    K32, n32, c32, _ = entk_gram(model, X, dtype=torch.float32)
    K64, n64, c64, _ = entk_gram(model, X, dtype=torch.float64)
    assert (n32, c32) == (n64, c64) == (P, C) == (820, C)
    assert K32.dtype == K64.dtype == np.float64  # the Gram is kept in float64 whatever the Jacobians' dtype
    assert _rel(K64, K_ref) < 1e-10  # measured: 0
    assert 0 < _rel(K32, K_ref) < 1e-5  # measured: 1.6e-7; not 0: the Jacobians really ran in float32


def test_spectrum_check_records_both_condition_numbers(setup):
    model, X, K_ref, _ = setup
    check = spectrum_precision_check(layer_task(model, X), X, 1 << 30, None, torch.float32)
    lam = np.linalg.eigvalsh(K_ref[:16, :16])[::-1]  # the check's subsample: the first 16 rows
    assert check.subsample == {"rows": 16} and check.precision == "float32"
    assert check.extra["kappa_float64"] == pytest.approx(lam[0] / lam[-1], rel=1e-8)  # measured: 2551.5
    # float32's kappa: close to float64's, and its stated error is the two written out
    assert check.extra["kappa"] == pytest.approx(lam[0] / lam[-1], rel=1e-3)  # measured: 2.4e-5 relative
    assert check.extra["kappa_relative_error"] == pytest.approx(
        abs(check.extra["kappa"] / check.extra["kappa_float64"] - 1), rel=1e-9
    )
    assert check.relative_error < 1e-5 and check.agrees and check.warning is None  # spectrum: measured 7.4e-8
    d = check.to_dict()
    assert {"kappa", "kappa_float64", "kappa_relative_error"} <= set(d)


def test_bfloat16_kappa_disagrees_and_the_check_says_so(setup):
    model, X, _, _ = setup
    check = spectrum_precision_check(layer_task(model, X), X, 1 << 30, None, torch.bfloat16)
    # the 16-row Gram has kappa 2.6e3: bfloat16's 2^-9 round-off moves its smallest eigenvalue by far more
    # than 1e-1 relative (measured: kappa 5386 against 2551), though the spectrum's relative error is small
    assert check.relative_error < 0.1
    assert check.extra["kappa"] is None or check.extra["kappa_relative_error"] > 0.1
    assert not check.agrees and "condition number" in check.warning and "float64" in check.warning


def test_entk_result_resolves_the_precision_and_checks_only_below_float64(setup):
    model, X, _, _ = setup
    low = entk_result(model, X, 1 << 30, None, None, precision="float32")
    assert low.precision["used"] == "float32" and low.precision_check is not None
    assert low.precision_check["agrees"] is True and "kappa_float64" in low.precision_check
    for asked in ("float64", "auto"):  # 820 parameters: auto is float64
        res = entk_result(model, X, 1 << 30, None, None, precision=asked)
        assert res.precision["used"] == "float64" and res.precision_check is None
    assert "820" in entk_result(model, X, 1 << 30, None, None, precision="auto").precision["reason"]


def test_a_checkpoints_report_carries_the_check_and_warns_when_it_fails(tmp_path):
    path = tmp_path / "tiny.safetensors"
    save_model(tiny_vit(), path)
    reports = {  # the digits of classes 0-3 (the model has 4 logits)
        p: run(KappaRequest(checkpoint=(str(path),), n=(20,), gram="entk", classes="0,1,2,3", precision=p))
        for p in ("float32", "bfloat16")
    }
    f32 = reports["float32"].results["models"]["tiny"]["entk"]
    assert f32["precision"]["used"] == "float32" and f32["precision_check"]["agrees"] is True
    assert reports["float32"].results["precision"]["asked"] == "float32"
    assert not any("precision check" in w for w in reports["float32"].report["warnings"])
    # measured: float32's kappa 3954.34 against float64's 3953.98; bfloat16's 16-row Gram is singular (kappa None)
    assert f32["precision_check"]["kappa_relative_error"] < 1e-3
    bf16 = reports["bfloat16"].results["models"]["tiny"]["entk"]
    assert bf16["precision_check"]["agrees"] is False
    assert any(w.startswith("tiny: precision check") for w in reports["bfloat16"].report["warnings"])
