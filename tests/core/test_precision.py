"""The precision policy (attnaudit.core.precision): ``auto``'s threshold, the rank correlation
against scipy, and the float64 comparison against numbers worked out by hand."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from attnaudit.core.precision import (
    AUTO_FLOAT64_MAX_PARAMS,
    compare,
    native_bfloat16,
    not_needed,
    resolve_precision,
    spearman,
)
from attnaudit.errors import FieldError


# ------------------------------------------------------------------------- resolve_precision
@pytest.mark.parametrize(
    "n_params, used",
    [(1, "float64"), (1_000_000, "float64"), (1_000_001, "float32"), (5_700_000, "float32"), (None, "float64")],
)
def test_auto_is_float64_up_to_a_million_parameters_and_float32_above(n_params, used):
    assert AUTO_FLOAT64_MAX_PARAMS == 1_000_000  # the documented threshold (docs, --precision help)
    p = resolve_precision("auto", n_params)
    assert (p.asked, p.used) == ("auto", used)
    assert p.dtype == {"float64": torch.float64, "float32": torch.float32}[used]
    assert p.lowered is (used != "float64")
    assert p.reason.startswith("auto")


@pytest.mark.parametrize("asked", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("n_params", [10, 50_000_000, None])
def test_an_explicit_precision_is_kept_whatever_the_model_size(asked, n_params, monkeypatch):
    monkeypatch.setattr("attnaudit.core.precision.native_bfloat16", lambda device="cpu": True)
    p = resolve_precision(asked, n_params, "cpu", heavy=("gradients",))
    assert (p.asked, p.used, p.reason, p.heavy) == (asked, asked, "asked", ("gradients",))
    assert p.dtype == {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[asked]
    d = p.to_dict()
    assert (d["asked"], d["used"], d["heavy_computations"]) == (asked, asked, ["gradients"])


def test_bfloat16_on_a_cpu_without_native_bfloat16_is_kept_with_a_warning_and_the_reason(monkeypatch):
    monkeypatch.setattr("attnaudit.core.precision.native_bfloat16", lambda device="cpu": False)
    with pytest.warns(RuntimeWarning, match="no native bfloat16"):
        p = resolve_precision("bfloat16", 10**8, "cpu")
    assert (p.asked, p.used) == ("bfloat16", "bfloat16")  # asked, so kept
    assert p.reason.startswith("asked; ") and "float32" in p.reason
    assert "no native bfloat16" in p.to_dict()["reason"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 on the same CPU: no warning
        assert resolve_precision("float32", 10**8, "cpu").reason == "asked"


def test_native_bfloat16_follows_onednn_on_the_cpu(monkeypatch):
    expected = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert native_bfloat16("cpu") is expected
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: not expected)
    assert native_bfloat16("cpu") is (not expected)


def test_spelling_is_normalised_and_auto_never_picks_bfloat16():
    assert resolve_precision(" Float32 ", 10).used == "float32"
    assert {resolve_precision("auto", n).used for n in (0, 10**6, 10**6 + 1, 10**12, None)} == {"float64", "float32"}


@pytest.mark.parametrize("bad", ["float16", "fp32", "", "double", 32])
def test_unknown_precision_is_a_field_error_on_precision(bad):
    with pytest.raises(FieldError) as err:
        resolve_precision(bad, 10)
    assert err.value.field == "precision"
    assert repr(str(bad).strip().lower()) in str(err.value) or repr(bad) in str(err.value)
    assert "float64" in str(err.value) and "auto" in str(err.value)  # the message lists the choices


def test_not_needed_names_the_precision_used():
    out = not_needed(resolve_precision("auto", None))
    assert out["status"] == "not needed" and "float64" in out["why"]


# ------------------------------------------------------------------------- spearman
@pytest.mark.parametrize("seed", range(5))
def test_spearman_equals_scipy_with_ties(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 6, size=40).astype(float)  # many ties
    b = a + rng.integers(-3, 4, size=40)  # correlated, with ties of its own
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)
    c = rng.normal(size=40)
    assert spearman(a, c) == pytest.approx(stats.spearmanr(a, c).statistic, abs=1e-12)


def test_spearman_by_hand_and_constant_input():
    # ranks [1, 2, 4, 3] vs [1, 2, 3, 4]: 1 - 6 * sum d^2 / (n (n^2 - 1)) = 1 - 6 * 2 / 60 = 0.8
    assert spearman(np.array([1.0, 2.5, 4.0, 3.0]), np.array([1.0, 2.0, 3.0, 4.0])) == pytest.approx(0.8)
    assert spearman(np.array([3.0, 2.0, 1.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(-1.0)
    assert math.isnan(spearman(np.ones(5), np.arange(5.0)))


# ------------------------------------------------------------------------- compare
def test_compare_errors_by_hand():
    low = torch.tensor([[1.0, 2.5], [4.0, 3.0]], dtype=torch.float32)
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    c = compare(low, ref, quantity="scores", precision="float32", subsample={"rows": 2}, rows=True)
    # low - ref = [0, 0.5, 1, -1]: ||.|| = sqrt(0.25 + 1 + 1) = 1.5; ||ref|| = sqrt(1 + 4 + 9 + 16) = sqrt(30)
    assert c.relative_error == pytest.approx(1.5 / math.sqrt(30), rel=1e-12)
    assert c.max_abs_error == pytest.approx(1.0, rel=1e-12)
    assert c.spearman == pytest.approx(0.8)  # over all four entries (worked out above)
    assert c.spearman_min_row == pytest.approx(-1.0)  # row 1 is reversed, row 0 in order
    assert c.agrees is False
    d = c.to_dict()
    assert d["subsample"] == {"rows": 2} and d["spearman_min_row"] == c.spearman_min_row and "warning" in d


def test_compare_agrees_for_a_tiny_perturbation_and_warns_for_a_large_one():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=200)
    tiny = ref * (1 + 1e-6 * rng.normal(size=200))
    ok = compare(tiny, ref, quantity="influence scores", precision="float32", subsample={})
    assert ok.agrees and ok.warning is None and "warning" not in ok.to_dict()
    assert ok.relative_error == pytest.approx(np.linalg.norm(tiny - ref) / np.linalg.norm(ref), rel=1e-9)
    # a 5% perturbation: Spearman stays high, the relative error (about 0.05) exceeds float32's 1e-2
    off = ref * (1 + 0.05 * rng.normal(size=200))
    bad = compare(off, ref, quantity="influence scores", precision="float32", subsample={})
    assert stats.spearmanr(off, ref).statistic > 0.99 and 0.02 < bad.relative_error < 0.1
    assert not bad.agrees
    assert bad.warning is not None and "influence scores" in bad.warning and "float64" in bad.warning
    assert bad.to_dict()["warning"] == bad.warning
    # the same numbers are within bfloat16's looser tolerance (relative error <= 0.1, Spearman >= 0.9)
    assert compare(off, ref, quantity="q", precision="bfloat16", subsample={}).agrees


def test_compare_fails_on_ranks_alone():
    # a relative error far inside the tolerance, but the order of near-equal scores scrambled
    ref = 1.0 + 1e-9 * np.arange(50.0)
    low = ref[::-1].copy()
    c = compare(low, ref, quantity="q", precision="float32", subsample={})
    assert c.relative_error < 1e-6 and c.spearman == pytest.approx(-1.0) and not c.agrees


def test_spearman_min_row_is_the_worst_rows():
    rng = np.random.default_rng(3)
    ref = rng.normal(size=(20, 30))
    ref[2] *= 1e-3  # one row of small scores...
    low = ref + 1e-4 * rng.normal(size=(20, 30))
    low[2] = ref[2] + 5e-4 * rng.normal(size=30)  # ...whose order the lower precision scrambled
    c = compare(low, ref, quantity="q", precision="float32", subsample={}, rows=True)
    per_row = [stats.spearmanr(low[i], ref[i]).statistic for i in range(20)]
    assert int(np.argmin(per_row)) == 2
    assert c.spearman_min_row == pytest.approx(per_row[2], abs=1e-12)
    assert c.spearman == pytest.approx(stats.spearmanr(low.ravel(), ref.ravel()).statistic, abs=1e-12)
    # over all scores the ranks and the relative error pass; the worst row alone fails the check
    assert c.spearman > 0.99 > c.spearman_min_row and c.relative_error < 1e-2 and not c.agrees
    assert c.warning is not None
    whole = compare(low, ref, quantity="q", precision="float32", subsample={})  # rows=False: no per-row check
    assert whole.spearman_min_row is None and "spearman_min_row" not in whole.to_dict() and whole.agrees


def test_compare_refuses_different_shapes():
    with pytest.raises(ValueError, match="shapes"):
        compare(np.ones(3), np.ones(4), quantity="q", precision="float32", subsample={})
