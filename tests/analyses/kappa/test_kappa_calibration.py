"""The calibrated budget of the direct amplification check, against an mpmath reference.

Fresh cases (seeds and shapes not in benchmarks/calibrate_kappa_check.py's fit): the float64
measurement of kappa(G~) -- attnaudit's own code path -- must stay within the budget of the
exact kappa(G)^3 (exact Gram, mpmath eigenvalues at 40 digits); a case the old heuristic
refused must now be measured and verified; a case where float64 cannot resolve kappa^3 must
still be refused. So the test fails if the budget is made too tight (the first) or too loose
(this set brackets C between about 2.4, the worst fresh ratio, and 55).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mpmath")

from attnaudit.analyses.kappa.dataset import analyse_kappa  # noqa: E402
from attnaudit.core.spectral import (  # noqa: E402
    EPS64,
    amplification_resolvable,
    attention_gram_eigenvalues,
    check_budget,
    condition_report,
    gram_eigenvalues,
)

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "calibrate_kappa_check.py"
_spec = importlib.util.spec_from_file_location("calibrate_kappa_check", BENCH)
cal = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("calibrate_kappa_check", cal)  # its dataclasses look their module up there
_spec.loader.exec_module(cal)


def _old_rule_resolvable(kappa: float, n: int, d: int) -> bool:
    """The heuristic this calibration replaced (10 sqrt(max(n, d)) eps (kappa^3 + 3 kappa) < 0.1
    and kappa^3 max(n, d) eps < 1), written out here to show which cases changed."""
    budget = 10.0 * math.sqrt(max(n, d)) * EPS64 * (kappa**3 + 3.0 * kappa)
    return kappa**3 * max(n, d) * EPS64 < 1.0 and budget < 0.1


def _fresh_cases():
    yield "gauss-cliff 40x1000 k=1e3", cal.known_spectrum(40, 1000, 1e3, seed=901, decay="cliff")
    yield "gauss-geom 500x30 k=1e4", cal.known_spectrum(500, 30, 1e4, seed=902)
    yield "gauss-cliff 36x500 k=3e4", cal.known_spectrum(36, 500, 3e4, seed=903, decay="cliff")
    yield "gauss-geom 40x2000 k=2", cal.known_spectrum(40, 2000, 2.0, seed=906)
    yield "gauss-cliff 700x20 k=10", cal.known_spectrum(700, 20, 10.0, seed=907, decay="cliff")
    yield "digits-c n=32 s9", cal.digits_subset(32, 9, center=True)
    images = cal.mnist_images()
    if images is not None:
        yield "mnist n=48 s7", cal.mnist_subset(images, 48, 7, center=False)


def test_exact_gram_is_exact():
    from fractions import Fraction

    X = np.random.default_rng(5).standard_normal((4, 7)) * np.logspace(0, -25, 7)
    N, E = cal.exact_gram(X)
    for i in range(4):
        for j in range(4):
            exact = sum(Fraction(X[i, k]) * Fraction(X[j, k]) for k in range(7))
            assert Fraction(N[i][j]) * Fraction(2) ** E == exact


@pytest.mark.parametrize("name,X", list(_fresh_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_observed_error_is_within_the_budget(name, X):
    case = cal.measure(name, X)
    budget = check_budget(case.kappa, case.n, case.d)
    assert math.isfinite(case.err), name
    assert case.err <= budget, f"{name}: error {case.err:.3g} above the budget {budget:.3g}"


def test_case_the_old_rule_refused_is_now_measured_and_verified():
    # CIFAR-10-sized rows (d = 3072), kappa(G) = 2e4: the old rule gave up (its budget 0.98,
    # kappa^3 max(n,d) eps = 5.5); the calibrated budget is 30 eps kappa^3 = 0.053
    n, d, kappa = 64, 3072, 2e4
    X = cal.known_spectrum(n, d, kappa, seed=904)
    ref = cal.reference_eigenvalues(X)
    ref_kappa = float(ref[0] / ref[n - 1])
    assert ref_kappa == pytest.approx(kappa, rel=1e-9)
    assert not _old_rule_resolvable(ref_kappa, n, d)
    result = analyse_kappa(torch.from_numpy(X))
    check = result.check
    assert check.verdict == "verified", check.explanation
    assert check.error_budget < 0.1
    assert abs(check.measured_kappa - ref_kappa**3) / ref_kappa**3 <= check.error_budget
    assert result.transformed_measured is not None


def test_unresolvable_case_is_still_refused():
    # kappa(G) = 1e6: kappa^3 = 1e18 > 1 / eps; a direct measurement is noise, as the reference shows
    n, d = 32, 400
    X = cal.known_spectrum(n, d, 1e6, seed=905)
    Xt = torch.from_numpy(X)
    base = condition_report(gram_eigenvalues(Xt), n, d)
    assert not amplification_resolvable(base)
    ref = cal.reference_eigenvalues(X)
    lam_t = attention_gram_eigenvalues(Xt).numpy()
    measured = lam_t[0] / lam_t[n - 1] if lam_t[n - 1] > 0 else math.inf
    ref3 = float(ref[0] / ref[n - 1]) ** 3
    assert not abs(measured - ref3) / ref3 < 0.1  # what the check would have reported is far off
    assert analyse_kappa(Xt).check.verdict == "beyond-float64-precision"
