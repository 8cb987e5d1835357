"""Spectral core of `kappa` against independent dense decompositions (numpy/scipy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from attnaudit.errors import AuditError
from attnaudit.analyses.kappa.dataset import KappaConfig, analyse_kappa, summarise_sweep, sweep_cell, sweep_verdicts
from attnaudit.core.spectral import (
    EPS64,
    attention_gram_eigenvalues,
    condition_report,
    cross_gram,
    gram_eigenvalues,
    width_estimate,
)


def known_spectrum(n: int, d: int, singular_values: np.ndarray, seed: int = 0) -> np.ndarray:
    """X = U diag(s) V^T with Haar-random orthonormal factors (scipy's QR, independent of the code)."""
    rng = np.random.default_rng(seed)
    r = singular_values.size
    U, _ = scipy.linalg.qr(rng.standard_normal((n, r)), mode="economic")
    V, _ = scipy.linalg.qr(rng.standard_normal((d, r)), mode="economic")
    return (U * singular_values) @ V.T


@pytest.mark.parametrize("shape", [(30, 80), (80, 30), (50, 50)])
def test_gram_eigenvalues_match_dense_numpy(shape):
    rng = np.random.default_rng(1)
    X = rng.standard_normal(shape)
    ours = gram_eigenvalues(torch.from_numpy(X)).numpy()
    dense = np.sort(np.linalg.eigvalsh(X @ X.T))[::-1][: min(shape)]
    np.testing.assert_allclose(ours, dense, rtol=1e-10, atol=1e-10 * dense[0])


def test_chunked_cross_gram_equals_one_product():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((1003, 17))
    chunked = cross_gram(torch.from_numpy(X), chunk_rows=64).numpy()
    np.testing.assert_allclose(chunked, X.T @ X, rtol=1e-12, atol=1e-9)


def test_attention_gram_is_measured_not_assumed():
    rng = np.random.default_rng(3)
    for shape in [(20, 40), (60, 12)]:
        X = rng.standard_normal(shape)
        F = X @ X.T @ X
        dense = np.sort(np.linalg.eigvalsh(F @ F.T))[::-1][: min(shape)]
        ours = attention_gram_eigenvalues(torch.from_numpy(X), chunk_rows=7).numpy()
        np.testing.assert_allclose(ours, dense, rtol=1e-8, atol=1e-9 * dense[0])


@pytest.mark.parametrize("n,d", [(200, 40), (40, 200)])
def test_known_spectrum_recovers_exact_kappa_and_cube(n, d):
    k = min(n, d)
    kappa_x = 30.0  # singular-value ratio, so kappa(G) = 900 and kappa(G~) = 900^3
    s = np.logspace(0, -np.log10(kappa_x), k)
    X = known_spectrum(n, d, s)
    result = analyse_kappa(torch.from_numpy(X))
    assert not result.base.rank_deficient
    assert result.base.numerical_rank == k
    assert result.base.kappa_full == pytest.approx(kappa_x**2, rel=1e-9)
    assert result.check.verdict == "verified"
    assert result.check.measured_kappa == pytest.approx(kappa_x**6, rel=1e-6)
    assert result.transformed.kappa_full == pytest.approx(kappa_x**6, rel=1e-8)


def test_amplification_beyond_precision_is_said_not_measured():
    k = 40
    s = np.logspace(0, -4, k)  # kappa(G) = 1e8, kappa^3 = 1e24: far beyond float64
    X = known_spectrum(100, k, s)
    result = analyse_kappa(torch.from_numpy(X))
    assert result.base.kappa_full == pytest.approx(1e8, rel=1e-3)
    assert result.check.verdict == "beyond-float64-precision"
    assert result.check.measured_kappa is None
    assert "identity" in result.check.explanation
    # the eigendecomposition of G~ is skipped (its spectrum would be round-off below the top);
    # the top eigenvalue is still measured, by Lanczos on the same products
    assert result.transformed_measured is None
    assert result.check.top_eigenvalue_relative_error < 1e-10


def test_attention_gram_from_c_cubed_products_equals_the_row_chunked_direct_form():
    """n > d: C (C C) and the row-chunked (X C)^T (X C) are the same matrix up to round-off,
    and their spectra both match numpy on the explicit f_att(X) = X X^T X."""
    from attnaudit.core.spectral import attention_cross_gram, attention_gram_matrix

    rng = np.random.default_rng(11)
    X = rng.standard_normal((300, 25))
    Xt = torch.from_numpy(X)
    chunked = attention_cross_gram(Xt, chunk_rows=64)
    products = attention_gram_matrix(Xt)
    scale = float(chunked.abs().max())
    assert float((products - chunked).abs().max()) <= 1e-12 * scale
    F = X @ X.T @ X
    ref = np.sort(np.linalg.eigvalsh(F.T @ F))[::-1]
    ours = attention_gram_eigenvalues(Xt).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-9)


def test_constant_column_is_rank_deficient_and_kappa_d_infinite():
    rng = np.random.default_rng(4)
    X = rng.uniform(size=(120, 30))
    X[:, [0, 7]] = 0.0  # two always-zero "border pixels"
    result = analyse_kappa(torch.from_numpy(X))
    assert result.base.rank_deficient
    assert result.base.numerical_rank == np.linalg.matrix_rank(X @ X.T) == 28
    assert math.isinf(result.base.kappa_full)
    d = result.to_dict()["gram"]
    assert d["kappa_d"] is None and d["kappa_d_is_infinite"] is True
    lam = np.sort(np.linalg.eigvalsh(X @ X.T))[::-1]
    assert result.base.kappa_rank == pytest.approx(lam[0] / lam[27], rel=1e-8)
    assert any("rank deficient" in v for v in result.verdicts)
    # the width at min(n, d) is infinite, the one at the numerical rank is finite
    assert result.widths[0].log10_width is None and result.widths[1].log10_width is not None


def test_centred_data_lose_one_rank():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((25, 60))
    X -= X.mean(0)
    result = analyse_kappa(torch.from_numpy(X))
    assert result.base.numerical_rank == 24 == np.linalg.matrix_rank(X)
    assert math.isinf(result.base.kappa_full)


def test_rank_matches_numpy_matrix_rank_on_gram_across_tolerances():
    s = np.logspace(0, -7, 30)
    X = known_spectrum(60, 30, s)
    G = X @ X.T
    lam = gram_eigenvalues(torch.from_numpy(X)).numpy()
    for rel in (1e-3, 1e-6, 1e-9):
        rep = condition_report(lam, 60, 30, rank_tol=rel)
        assert rep.numerical_rank == np.linalg.matrix_rank(G, tol=rel * np.linalg.eigvalsh(G)[-1])
    default = condition_report(lam, 60, 30)
    assert default.rel_tolerance == pytest.approx(60 * EPS64)


def test_bad_rank_tolerance_and_zero_data_rejected():
    with pytest.raises(AuditError):
        KappaConfig(rank_tol=2.0)
    with pytest.raises(AuditError, match="zero"):
        analyse_kappa(torch.zeros(5, 3, dtype=torch.float64))


def test_width_estimate_in_logs():
    est = width_estimate(1e3, 1000, "x")
    assert est.log10_width == pytest.approx(18 + 3 + math.log10(math.log(1000)))
    assert est.gap_orders == pytest.approx(est.log10_width - 12)  # reference width 1e12 (the paper's)
    huge = width_estimate(1e60, 10, "overflow-safe")  # kappa^6 = 1e360 overflows a float
    assert huge.log10_width == pytest.approx(360 + 1 + math.log10(math.log(10)))
    assert width_estimate(math.inf, 10, "inf").log10_width is None


def _numpy_width(kappa: float, n: int) -> float:
    """log10(kappa^6 n ln n) in plain numpy logs (independent of attnaudit.core.spectral)."""
    return float(6 * np.log10(kappa) + np.log10(n) + np.log10(np.log(n)))


WIDTH_KEYS = {
    "label",
    "formula",
    "basis",
    "rank",
    "log10_required_width",
    "log10_interval",
    "interval_method",
    "orders_beyond_reference",
}


@pytest.mark.parametrize("n,d", [(60, 200), (300, 25)])
def test_width_rows_are_the_papers_formula_with_round_off_interval(n, d):
    k = min(n, d)
    X = known_spectrum(n, d, np.logspace(0, -2.5, k), seed=3)  # kappa(G) = 1e5, full rank
    payload = analyse_kappa(torch.from_numpy(X)).to_dict()
    rows = payload["width_estimates"]
    assert [r["basis"] for r in rows] == ["kappa_d", "numerical_rank"]
    assert all(WIDTH_KEYS <= set(r) for r in rows)
    assert "linearized attention (paper)" in rows[0]["label"] and "kappa_d(G)^6 n ln n" in rows[0]["label"]
    assert not any("ReLU" in r["label"] or "^18" in r["label"] + r["formula"] for r in rows)
    assert payload["reference_width"]["log10"] == 12 and "12-17 orders" in payload["reference_width"]["source"]
    # independent: numpy spectrum of X X^T, kappa_d = lambda_1 / lambda_k; m = kappa^6 n ln n
    lam = np.sort(np.linalg.eigvalsh(X @ X.T))[::-1]
    kappa = lam[0] / lam[k - 1]
    for row in rows:
        assert row["rank"] == k
        assert row["log10_required_width"] == pytest.approx(_numpy_width(kappa, n), abs=1e-8)
        assert row["orders_beyond_reference"] == pytest.approx(_numpy_width(kappa, n) - 12, abs=1e-8)
        assert row["interval_method"] == "float64 round-off bound"
        # eigenvalues move by at most max(n, d) eps lambda_1: lambda_1 -+ err over lambda_k +- err
        err = max(n, d) * np.finfo(np.float64).eps * lam[0]
        lo, hi = row["log10_interval"]
        assert lo == pytest.approx(_numpy_width((lam[0] - err) / (lam[k - 1] + err), n), abs=1e-8)
        assert hi == pytest.approx(_numpy_width((lam[0] + err) / (lam[k - 1] - err), n), abs=1e-8)
        assert lo < row["log10_required_width"] < hi


def test_rank_deficient_width_rows_say_unbounded_and_state_the_caveat():
    rng = np.random.default_rng(4)
    X = rng.uniform(size=(120, 30))
    X[:, [0, 7]] = 0.0
    result = analyse_kappa(torch.from_numpy(X))
    d_row, r_row = (w.to_dict() for w in result.widths)
    assert d_row["log10_required_width"] is None and d_row["orders_beyond_reference"] is None
    assert d_row["kappa_is_infinite"] is True and d_row["rank"] == 30
    lo, hi = d_row["log10_interval"]
    assert hi is None and lo is not None  # the r-th eigenvalue is within round-off of 0: no upper end
    lam = np.sort(np.linalg.eigvalsh(X.T @ X))[::-1]
    assert r_row["rank"] == 28
    assert r_row["log10_required_width"] == pytest.approx(_numpy_width(lam[0] / lam[27], 120), abs=1e-7)
    assert "rank deficient" in r_row["caveat"] and "understates" in r_row["caveat"]
    # lambda_30 is round-off (|lambda_30| <= err), so the lower end is at least (lambda_1 - err) / (2 err)
    err = 120 * np.finfo(np.float64).eps * lam[0]
    assert lo >= _numpy_width((lam[0] - err) / (2 * err), 120) - 1e-9
    assert lo > r_row["log10_interval"][0]  # unbounded kappa_d: far above the rank-r requirement


def test_main_table_states_the_papers_formula_and_reference():
    from rich.console import Console

    from attnaudit.analyses.kappa.dataset import build_tables

    X = known_spectrum(40, 90, np.logspace(0, -1, 40), seed=5)
    console = Console(record=True, width=250, file=open("/dev/null", "w"))
    for t in build_tables(analyse_kappa(torch.from_numpy(X)), None, "synthetic"):
        console.print(t)
    text = console.export_text()
    assert "linearized attention (paper): kappa_d(G)^6 n ln n" in text
    assert "reference 1e12" in text and "orders beyond 1e12" in text and "round-off interval" in text
    assert "2L-ReLU" not in text and "MLP-Attn" not in text and "^18" not in text


def test_sweep_summary_statistics():
    rng = np.random.default_rng(7)
    cells, numpy_kappa = [], {20: [], 40: []}
    for n in (20, 40):
        for seed in range(3):
            X = rng.standard_normal((n, 10))
            cells.append(sweep_cell(torch.from_numpy(X), seed, KappaConfig()))
            lam = np.linalg.eigvalsh(X.T @ X)
            numpy_kappa[n].append(lam[-1] / lam[0])
    summary = summarise_sweep(cells)
    assert [s.n for s in summary] == [20, 40]
    k20 = np.array([c.kappa_d for c in cells if c.n == 20])
    assert summary[0].kappa_d_mean == pytest.approx(k20.mean())
    assert summary[0].kappa_d_std == pytest.approx(k20.std(ddof=1))
    # more rows per column: a Gaussian matrix becomes better conditioned
    assert summary[1].kappa_d_mean < summary[0].kappa_d_mean
    # the width per seed is the paper's kappa^6 n ln n, from numpy's kappa (full rank: both bases agree)
    assert set(summary[0].log10_width) == {"kappa_d", "numerical_rank"}
    for s, n in zip(summary, (20, 40)):
        vals = [_numpy_width(kappa, n) for kappa in numpy_kappa[n]]
        for key in ("kappa_d", "numerical_rank"):
            assert s.log10_width[key]["median"] == pytest.approx(float(np.median(vals)), rel=1e-10)
            assert s.log10_width[key]["orders_beyond_reference_median"] == pytest.approx(float(np.median(vals)) - 12)
    assert all("n=20" in v or "n=40" in v for v in sweep_verdicts(summary))
    assert all("2L-ReLU" not in v and "MLP-Attn" not in v for v in sweep_verdicts(summary))


def test_float32_input_is_promoted_to_float64():
    X = known_spectrum(50, 20, np.logspace(0, -2, 20)).astype(np.float32)
    result = analyse_kappa(torch.from_numpy(X))
    lam = np.sort(np.linalg.eigvalsh(X.astype(np.float64) @ X.astype(np.float64).T))[::-1]
    assert result.base.lambda_max == pytest.approx(lam[0], rel=1e-12)
