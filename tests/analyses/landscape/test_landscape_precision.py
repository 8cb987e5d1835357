"""The landscape's float64 spot check: top eigenvalues against the Rayleigh quotients of their
eigenvectors under the float64 Hessian, checked with the eigenpairs of a dense Hessian built here
(torch.func.hessian of the mean loss over the flattened parameters), and a float32 run's report."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from attnaudit.analyses.landscape.analysis import eigen_precision_check
from attnaudit.analyses.landscape.run import LandscapeRequest
from attnaudit.analyses.landscape.setup import landscape_engine, landscape_task
from attnaudit.analyses.registry import run

F64 = torch.float64
TOP = 3


@pytest.fixture(scope="module")
def problem(digits):
    """A float64 64-6-10 tanh MLP on 40 digits rows with the MSE loss, its tracked parameter names,
    one-hot targets, and the top eigenpairs of the dense Hessian of the mean loss (descending)."""
    X, y = digits[0][:40], digits[1][:40]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    task = landscape_task(net, X, "mse")
    names = list(landscape_engine(task, X, "float64").names)  # the order of the engine's flat parameters
    assert sorted(names) == sorted(n for n, _ in net.named_parameters())
    shapes = {n: p.shape for n, p in net.named_parameters()}
    T = nn.functional.one_hot(y, 10).to(F64)

    def mean_loss(theta: torch.Tensor) -> torch.Tensor:  # (1/n) sum_i 0.5 ||f(x_i) - t_i||^2, written out here
        params, start = {}, 0
        for n in names:
            k = shapes[n].numel()
            params[n] = theta[start : start + k].view(shapes[n])
            start += k
        return (0.5 * (functional_call(net, params, (X,)) - T).pow(2).sum(1)).mean()

    theta = torch.cat([dict(net.named_parameters())[n].detach().reshape(-1) for n in names])
    H = torch.func.hessian(mean_loss)(theta)
    lam, V = torch.linalg.eigh(H)
    return task, X, T, names, lam.flip(0)[:TOP], V.flip(1)[:, :TOP]  # top eigenvalues, eigenvectors (P, k)


def test_scaled_eigenvalues_give_exactly_their_relative_error(problem):
    task, X, T, names, lam, V = problem
    assert lam[0] > lam[1] > lam[2] > 0  # distinct top eigenvalues (measured: 12.57, 8.95, 8.09)
    check = eigen_precision_check(task, X, T, V, [float(v) * (1 + 1e-3) for v in lam], 16, names)
    # the Rayleigh quotients of true eigenvectors are the true eigenvalues: || 1e-3 lam || / || lam ||
    assert check.relative_error == pytest.approx(1e-3, abs=1e-6)
    assert check.max_abs_error == pytest.approx(1e-3 * float(lam[0]), rel=1e-6)
    assert check.spearman == pytest.approx(1.0)  # a common scale keeps the order
    assert check.subsample == {"rows": 40, "eigenvalues": TOP}


def test_exact_eigenpairs_agree_to_round_off(problem):
    task, X, T, names, lam, V = problem
    check = eigen_precision_check(task, X, T, V, [float(v) for v in lam], 16, names)
    assert check.relative_error < 1e-10  # measured: 3e-16
    # a Rayleigh quotient does not depend on the eigenvectors' length
    scaled = eigen_precision_check(task, X, T, 3.0 * V, [float(v) for v in lam], 16, names)
    assert scaled.relative_error < 1e-10
    # float32-rounded eigenvectors: their Rayleigh quotients move at second order, far inside float32's tolerance
    low = eigen_precision_check(task, X, T, V.to(torch.float32), [float(v) for v in lam], 16, names)
    assert low.precision == "float32" and low.agrees and low.warning is None
    assert low.relative_error < 1e-8  # measured: 6e-16


def test_wrong_eigenvectors_are_caught(problem):
    task, X, T, names, lam, V = problem
    # the eigenvalues listed in the wrong order: the quotients of the vectors disagree with them
    check = eigen_precision_check(task, X, T, V, [float(v) for v in lam.flip(0)], 16, names)
    assert check.relative_error > 0.1 and check.spearman == pytest.approx(-1.0)
    # as a float32 run would report it: disagreement and a warning naming the quantity and float64
    low = eigen_precision_check(task, X, T, V.to(torch.float32), [float(v) for v in lam.flip(0)], 16, names)
    assert not low.agrees and "Hessian eigenvalues" in low.warning and "float64" in low.warning


# ---------------------------------------------------------------------------- the report
TINY = dict(
    n_train=120, width=16, steps=40, points=5, grid=0, eigenvalues=2, hutchinson_samples=4, basin_directions=2, seeds=1
)


def test_the_memory_budget_caps_the_lanczos_basis_and_the_run_restarts_to_the_same_eigenvalues():
    # relu width 16 on digits: 1,210 float64 parameters; 0.02 MiB x 4 holds 8 basis vectors
    full = run(LandscapeRequest(**TINY, models=("relu",), lanczos_tol=1e-9)).results["models"]["relu"]
    capped = run(LandscapeRequest(**TINY, models=("relu",), lanczos_tol=1e-9, memory_budget=0.02)).results
    eig, ref = capped["models"]["relu"]["top_eigenvalues"], full["top_eigenvalues"]
    assert ref["restarts"] == 0 and eig["basis"] < ref["steps"] and eig["restarts"] > 0
    assert eig["converged"] and ref["converged"]
    assert eig["eigenvalues"] == pytest.approx(ref["eigenvalues"], rel=1e-7)


def test_a_float32_run_records_its_precision_and_a_spot_check_per_model():
    lo = run(LandscapeRequest(**TINY, precision="float32"))
    hi = run(LandscapeRequest(**TINY, precision="float64"))
    res = lo.results
    assert res["precision"]["asked"] == "float32" and res["precision"]["used"] == "float32"
    assert lo.report["environment"]["dtype"] == "float32"
    checks = res["precision_check"]
    assert sorted(checks) == sorted(res["models"]) == ["attn", "relu"]  # one per model
    for label, c in checks.items():
        assert c["precision"] == "float32" and c["subsample"] == {"rows": 120, "eigenvalues": 2}
        assert c["agrees"] is True and "warning" not in c
        assert c["relative_error"] < 1e-5  # measured: 8e-8 (relu), 1.6e-7 (attn)
        # the float64 run's eigenvalues are an independent reference for the float32 ones
        e32 = torch.tensor(res["models"][label]["top_eigenvalues"]["eigenvalues"], dtype=F64)
        e64 = torch.tensor(hi.results["models"][label]["top_eigenvalues"]["eigenvalues"], dtype=F64)
        assert 0 < float((e32 - e64).norm() / e64.norm()) < 1e-5  # really float32, and close
    assert not any("precision check" in w for w in lo.report.get("warnings") or [])
    assert hi.results["precision_check"]["status"] == "not needed"


def test_auto_is_float64_on_the_builtin_models():
    res = run(LandscapeRequest(**TINY, models=("relu",))).results
    assert res["precision"]["asked"] == "auto" and res["precision"]["used"] == "float64"
    assert res["precision_check"]["status"] == "not needed"


def test_vectors_that_are_not_eigenvectors_fail_even_when_their_quotients_match(problem):
    """A low-precision Lanczos run can return vectors whose Rayleigh quotients are its eigenvalues
    without being eigenvectors (measured: bfloat16 on the quick landscape). Mixing the true top
    eigenvectors keeps the quotients reported exactly, yet the float64 Ritz residual exposes them."""
    task, X, T, names, lam, V = problem
    Q = torch.linalg.qr(V @ torch.tensor([[1.0, 1.0, 0.0], [1.0, -1.0, 0.0], [0.0, 0.0, 1.0]], dtype=F64))[0]
    quotients = [float(q @ (V @ torch.diag(lam) @ V.T) @ q) for q in Q.T]  # v^T H v restricted to span(V)
    check = eigen_precision_check(task, X, T, Q, quotients, 16, names)
    assert check.relative_error < 1e-10  # the quotients alone agree
    residuals = check.extra["relative_residual_float64"]
    # the mixed pair spreads over eigenvalues 12.57 and 8.95: its residual is |12.57 - 8.95| / 2 / 10.76
    assert residuals[0] == pytest.approx(float(lam[0] - lam[1]) / 2 / float(lam[0] + lam[1]) * 2, rel=1e-6)
    assert residuals[2] < 1e-10  # the third vector is an eigenvector
    assert not check.agrees and "Ritz residual" in (check.warning or "")
