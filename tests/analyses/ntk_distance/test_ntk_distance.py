"""ntk-distance: the width sweep against independent computations, and the CLI end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnaudit.errors import AuditError
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.ntk import TwoLayerState, analytic_ntk, entk_two_layer, flatten_kernel
from attnaudit.analyses.ntk_distance.cells import kernel_metrics
from attnaudit.analyses.ntk_distance.config import SCHEMA, NTKDistanceConfig
from attnaudit.analyses.ntk_distance.report import build_tables, plot_ntk_distance
from attnaudit.analyses.ntk_distance.widths import run_ntk_distance
from attnaudit.core.training import TrainConfig, train

F64 = torch.float64


def _synthetic(n_train=40, n_test=30, d=8, c=3, seed=0):
    """Gaussian inputs, labels from a random linear teacher (independent of the code under test)."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n_train + n_test, d, generator=gen, dtype=F64)
    teacher = torch.randn(d, c, generator=gen, dtype=F64)
    y = (X @ teacher).argmax(1)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:], c


def test_config_validation():
    with pytest.raises(AuditError):
        NTKDistanceConfig(models=("relu", "gelu"))
    with pytest.raises(AuditError):
        NTKDistanceConfig(widths=(16, 33))  # odd width with antisymmetric init
    NTKDistanceConfig(widths=(16, 33), init="standard")
    with pytest.raises(AuditError):
        NTKDistanceConfig(widths=())
    with pytest.raises(AuditError):
        NTKDistanceConfig(steps=0)
    with pytest.raises(AuditError):
        NTKDistanceConfig(lr=-0.1)
    with pytest.raises(AuditError):
        NTKDistanceConfig(lr_fraction=1.0)
    with pytest.raises(AuditError):
        NTKDistanceConfig(loss="hinge")
    with pytest.raises(AuditError):
        NTKDistanceConfig(seeds=(1, 1))


def test_relu_approaches_ntk_predictor_with_width():
    """The kernel regime: distance to the NTK predictor falls with width, slope clearly negative."""
    Xtr, ytr, Xte, yte, c = _synthetic()
    cfg = NTKDistanceConfig(models=("relu",), widths=(32, 128, 512, 2048), seeds=(0, 1, 2), steps=60)
    res = run_ntk_distance(Xtr, ytr, Xte, yte, c, cfg)
    summary = res.models["relu"]
    assert summary.slope_mean < -0.3, summary
    assert all(s < -0.2 for s in summary.slope_per_seed)
    assert summary.monotone_decreasing
    assert summary.trend == "falls"
    assert "approaching the kernel regime" in summary.verdict
    # kernel movement and initial kernel error both shrink roughly like 1/sqrt(m)
    assert -0.8 < summary.init_error_slope < -0.3
    assert summary.movement_slope < -0.3
    # every model x width x seed cell present, strict JSON
    payload = res.to_dict()
    assert payload["schema"] == SCHEMA
    cells = {(cl["model"], cl["width"], cl["seed"]) for cl in payload["cells"]}
    assert cells == {("relu", w, s) for w in cfg.widths for s in cfg.seeds}
    json.dumps(payload, allow_nan=False)
    # learning-rate rule, recomputed independently: lr = 0.5 * 2n / lambda_max(Theta_inf)
    lam = torch.linalg.eigvalsh(analytic_ntk(Xtr))[-1].item()
    assert res.cells[0].lr == pytest.approx(len(ytr) / lam, rel=1e-10)
    assert not res.warnings or all("diverged" not in w for w in res.warnings)


def test_distance_matches_direct_computation():
    """Distance and kernel predictor recomputed by hand for one cell (standard init, f_0 != 0)."""
    Xtr, ytr, Xte, yte, c = _synthetic(n_train=20, n_test=10, d=5)
    cfg = NTKDistanceConfig(models=("relu",), widths=(64,), seeds=(3,), steps=15, init="standard", lr=0.5)
    res = run_ntk_distance(Xtr, ytr, Xte, yte, c, cfg)
    cell = res.cells[0]
    net = build_model(ModelSpec("relu", 5, 64, c, init="standard", seed=3))
    with torch.no_grad():
        f0, f0t = net(Xtr).clone(), net(Xte).clone()
    train(net, Xtr, ytr, TrainConfig(lr=0.5, steps=15))
    # linearized GD with the analytic kernel, iterated step by step (no spectral formula)
    K, Kt = analytic_ntk(Xtr), analytic_ntk(Xte, Xtr)
    Y = torch.nn.functional.one_hot(ytr, c).to(F64)
    f, ft = f0.clone(), f0t.clone()
    for _ in range(15):
        r = f - Y
        f, ft = f - 0.5 / 20 * K @ r, ft - 0.5 / 20 * Kt @ r
    with torch.no_grad():
        diff = net(Xte) - ft
    expected = diff.pow(2).sum(1).mean().sqrt().item()
    assert cell.distance_rms == pytest.approx(expected, rel=1e-9)
    assert cell.distance_rel == pytest.approx(expected / ft.pow(2).sum(1).mean().sqrt().item(), rel=1e-9)
    assert cell.kernel_train_acc == pytest.approx((f.argmax(1) == ytr).double().mean().item())


def test_kernel_metrics_match_full_kernel():
    """Streamed Frobenius ratios vs the explicit (n c) x (n c) kernels and projector."""
    X = _synthetic(n_train=9, d=4)[0]
    net = build_model(ModelSpec("relu", 4, 12, 3, seed=1))
    s0 = TwoLayerState.from_model(net)
    K0 = flatten_kernel(entk_two_layer(net, X))
    train(net, X, torch.arange(9) % 3, TrainConfig(lr=1.0, steps=10))
    sT = TwoLayerState.from_model(net)
    KT = flatten_kernel(entk_two_layer(net, X))
    kinf = analytic_ntk(X)
    v = torch.linalg.eigh(kinf)[1][:, -1]
    got = kernel_metrics(s0, sT, X, kinf, v)
    I3 = torch.eye(3, dtype=F64)
    A = torch.kron(kinf, I3)
    Q = torch.kron(torch.eye(9, dtype=F64) - torch.outer(v, v), I3)
    assert got["kernel_movement"] == pytest.approx(((KT - K0).norm() / K0.norm()).item(), rel=1e-10)
    assert got["kernel_init_error"] == pytest.approx(((K0 - A).norm() / A.norm()).item(), rel=1e-10)
    assert got["kernel_movement_complement"] == pytest.approx(
        ((Q @ (KT - K0) @ Q).norm() / (Q @ K0 @ Q).norm()).item(), rel=1e-10
    )
    assert got["kernel_init_error_complement"] == pytest.approx(
        ((Q @ (K0 - A) @ Q).norm() / (Q @ A @ Q).norm()).item(), rel=1e-10
    )


def test_attn_shortcut_equals_training_the_attn_model(tmp_path):
    """Training the MLP on precomputed f_att(X) == training MLP-Attn itself; saved models reproduce it."""
    Xtr, ytr, Xte, yte, c = _synthetic(n_train=15, n_test=6, d=5)
    saved = {}
    cfg = NTKDistanceConfig(models=("attn",), widths=(20,), seeds=(2,), steps=10, lr=0.3, loss="ce")
    res = run_ntk_distance(Xtr, ytr, Xte, yte, c, cfg, on_model=lambda *a: saved.setdefault(a[:3], a[3]))
    ref = build_model(ModelSpec("attn", 5, 20, c, init="antisymmetric", seed=2), Xtr)
    train(ref, Xtr, ytr, TrainConfig(loss="ce", lr=0.3, steps=10))
    got = saved[("attn", 20, 2)]
    with torch.no_grad():
        assert torch.allclose(got(Xte), ref(Xte), rtol=1e-9, atol=1e-12)
    assert math.isfinite(res.cells[0].distance_rms)
    assert res.cells[0].predictor["method"].startswith("function-space")


def test_float32_large_widths_and_rendering(tmp_path):
    Xtr, ytr, Xte, yte, c = _synthetic(n_train=20, n_test=10, d=5)
    cfg = NTKDistanceConfig(widths=(16, 64), seeds=(0,), steps=5, float32_from_width=64, kernel_points=8)
    res = run_ntk_distance(Xtr, ytr, Xte, yte, c, cfg)
    assert all(math.isfinite(cl.kernel_movement_complement) for cl in res.cells)
    assert [cl.train_dtype for cl in res.cells] == ["float64", "float32"] * 2
    assert any("float32" in w for w in res.warnings)
    tables = build_tables(res)
    assert len(tables) >= 3
    plot_ntk_distance(res, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_diverging_lr_is_reported():
    Xtr, ytr, Xte, yte, c = _synthetic(n_train=20, n_test=10, d=5)
    cfg = NTKDistanceConfig(models=("relu",), widths=(16,), seeds=(0,), steps=20, lr=500.0)
    res = run_ntk_distance(Xtr, ytr, Xte, yte, c, cfg)
    assert res.cells[0].diverged
    assert any("exceeds the stable step" in w for w in res.warnings)
    assert any("diverged" in w for w in res.warnings)
    json.dumps(res.to_dict(), allow_nan=False)


# ---------------------------------------------------------------- CLI end to end

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from attnaudit.cli import app  # noqa: E402
from attnaudit.models.builtin import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared" / "data"
HAS_MNIST = (SHARED / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists()
TINY = ["ntk-distance", "--n-train", "30", "--n-test", "20", "--widths", "8,32", "--steps", "5"]
runner = CliRunner()


def test_cli_tiny_run_writes_json_png_and_models(tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(
        app,
        [
            *TINY,
            "--seeds",
            "2",
            "--json",
            str(out),
            "--png",
            str(tmp_path / "f.png"),
            "--save-models",
            str(tmp_path / "models"),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["schema"] == SCHEMA
    res = payload["results"]
    cells = {(c["model"], c["width"], c["seed"]) for c in res["cells"]}
    assert cells == {(m, w, s) for m in ("relu", "attn") for w in (8, 32) for s in (0, 1)}
    assert all(c["distance_rms"] is not None for c in res["cells"])
    assert set(res["models"]) == {"relu", "attn"} and len(payload["verdicts"]) == 2
    assert payload["inputs"]["preset"] == "quick" and payload["inputs"]["n_train"] == 30
    assert (tmp_path / "f.png").stat().st_size > 1000
    saved = sorted((tmp_path / "models").glob("*.safetensors"))
    assert len(saved) == 8
    net = load_model(tmp_path / "models" / "attn_m32_seed1.safetensors")
    assert net.spec.arch == "attn" and net.spec.width == 32 and net.context is not None
    # refusing to overwrite saved models without --overwrite, before any compute
    again = runner.invoke(app, [*TINY, "--seeds", "2", "--save-models", str(tmp_path / "models"), "--quiet"])
    assert again.exit_code == 2 and "already exists" in again.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--models", "relu,gelu"], "unknown model"),
        (["--widths", "8,abc"], "not an integer"),
        (["--widths", "9"], "even widths"),
        (["--preset", "huge"], "unknown --preset"),
        (["--loss", "hinge"], "unknown --loss"),
        (["--n-train", "1"], "--n-train"),
        (["--lr", "-1"], "--lr"),
        (["--train-dtype", "float16"], "--train-dtype"),
        (["--seeds", "0"], "--seeds"),
        (["--parametrization", "mup"], "parametrization"),
    ],
)
def test_cli_rejects_bad_options(extra, message):
    result = runner.invoke(app, [*TINY, *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_cli_json_stdout_in_a_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "attnaudit", *TINY, "--models", "relu", "--seeds", "1", "--loss", "ce", "--json", "-"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["inputs"]["loss"] == "ce"
    assert len(payload["results"]["cells"]) == 2


def test_cli_too_many_points_is_a_clear_error_in_a_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "attnaudit", "ntk-distance", "--n-train", "1400", "--n-test", "400"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--n-train" in proc.stderr


@pytest.mark.skipif(not HAS_MNIST, reason="../shared/data/MNIST not present")
def test_cli_real_mnist_small():
    result = runner.invoke(
        app,
        [
            "ntk-distance",
            "--dataset",
            "mnist",
            "--data-dir",
            str(SHARED),
            "--split",
            "test",
            "--n-train",
            "60",
            "--n-test",
            "40",
            "--widths",
            "16,256",
            "--seeds",
            "1",
            "--steps",
            "20",
            "--json",
            "-",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    res = payload["results"]
    assert res["d"] == 784 and res["n_classes"] == 10
    # attention makes MNIST inputs nearly collinear: far larger mean cosine and top-eigenvalue share
    assert res["models"]["attn"]["mean_pairwise_cosine"] > res["models"]["relu"]["mean_pairwise_cosine"]
    assert res["models"]["attn"]["top_eig_share"] > res["models"]["relu"]["top_eig_share"]
