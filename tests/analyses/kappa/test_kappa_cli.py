"""`attnaudit kappa` end to end: defaults, JSON on stdout, real MNIST, files, error exits."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from attnaudit.cli import app

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared" / "data"
HAS_MNIST = (SHARED / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists()
runner = CliRunner()


def _mnist_subset(n: int, seed: int) -> np.ndarray:
    """The rows `kappa --dataset mnist --split test --n n --seed seed` analyses (same loader)."""
    from attnaudit.data import DataSpec, load_dataset

    ds = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=n, seed=seed))
    return ds.X.double().numpy()


def _gram_spectrum(X: np.ndarray) -> np.ndarray:
    """Eigenvalues of G = X X^T by numpy, largest first (independent of attnaudit.core.spectral)."""
    return np.linalg.eigvalsh(X @ X.T)[::-1]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnaudit", *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=300
    )


def test_default_run_on_digits_offline_in_a_subprocess():
    proc = run_cli("kappa")
    assert proc.returncode == 0, proc.stderr
    assert "kappa: digits" in proc.stdout
    assert "numerical rank" in proc.stdout
    # digits has always-blank pixels, so the honest answer is "rank deficient", not a noise kappa
    assert "rank deficient" in proc.stdout
    # the paper's width formula, its reference, and no ReLU / kappa^18 rows
    assert "linearized attention (paper)" in proc.stdout and "1e12" in proc.stdout
    assert "2L-ReLU" not in proc.stdout and "^18" not in proc.stdout


def test_json_to_stdout_is_the_only_stdout(tmp_path):
    proc = run_cli("kappa", "--n", "300", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)  # fails if anything else was printed to stdout
    assert payload["schema"] == "attnaudit.kappa/1"
    assert payload["seeds"]["subset_seeds"] == [0]
    assert payload["results"]["gram"]["n"] == 300 and payload["results"]["gram"]["d"] == 64
    import torch

    assert payload["environment"]["torch"] == torch.__version__  # the interpreter that ran it is this one
    t = payload["timings_s"]
    assert set(t) == {"load", "analysis", "total"}
    assert min(t.values()) >= 0 and t["total"] >= t["load"] + t["analysis"]  # total covers both


@pytest.mark.skipif(not HAS_MNIST, reason="../shared/data/MNIST not present")
def test_real_mnist_sweep_json_has_finite_kappa_and_width():
    result = runner.invoke(
        app,
        [
            "kappa",
            "--dataset",
            "mnist",
            "--split",
            "test",
            "--data-dir",
            str(SHARED),
            "--n",
            "128",
            "--seeds",
            "3",
            "--json",
            "-",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    res = payload["results"]
    # independent: numpy eigenvalues of the Gram of each subset (seeds 0, 1, 2), full rank at n = 128
    kappas = []
    for seed in (0, 1, 2):
        lam = _gram_spectrum(_mnist_subset(128, seed))
        assert lam[-1] > 1e-6 * lam[0]  # well clear of the rank tolerance: kappa is finite and stable
        kappas.append(lam[0] / lam[-1])
    assert res["gram"]["numerical_rank"] == 128 and res["gram"]["rank_deficient"] is False
    assert res["gram"]["kappa_d"] == pytest.approx(kappas[0], rel=1e-8)
    assert res["gram"]["kappa_at_numerical_rank"] == pytest.approx(kappas[0], rel=1e-8)
    # the paper's requirement for linearized attention, m = kappa_d(G)^6 n ln n (= kappa(G~)^2 n ln n),
    # about 1e25 here; full rank, so the numerical-rank row equals it. No ReLU row, no kappa^18 row.
    n = 128
    rows = res["width_estimates"]
    assert [w["basis"] for w in rows] == ["kappa_d", "numerical_rank"]
    assert rows[0]["label"] == "linearized attention (paper): kappa_d(G)^6 n ln n"
    assert not any("ReLU" in w["label"] or "MLP-Attn" in w["label"] for w in rows)
    expected = math.log10(kappas[0] ** 6 * n * math.log(n))
    assert res["reference_width"]["log10"] == 12
    lam = _gram_spectrum(_mnist_subset(128, 0))
    err = 784 * np.finfo(np.float64).eps * lam[0]  # round-off bound max(n, d) eps lambda_1
    for w in rows:
        assert w["rank"] == 128
        assert w["log10_required_width"] == pytest.approx(expected, abs=1e-7)
        assert w["orders_beyond_reference"] == pytest.approx(
            math.log10(kappas[0] ** 6 * n * math.log(n) / 1e12), abs=1e-7
        )
        lo, hi = w["log10_interval"]
        assert lo == pytest.approx(math.log10(((lam[0] - err) / (lam[-1] + err)) ** 6 * n * math.log(n)), abs=1e-6)
        assert hi == pytest.approx(math.log10(((lam[0] + err) / (lam[-1] - err)) ** 6 * n * math.log(n)), abs=1e-6)
        assert w["interval_method"] == "float64 round-off bound"
    summ = res["sweep"]["summary"][0]["log10_width"]["kappa_d"]
    assert summ["median"] == pytest.approx(
        float(np.median([math.log10(k**6 * n * math.log(n)) for k in kappas])), abs=1e-7
    )
    cells = res["sweep"]["cells"]
    assert [c["seed"] for c in cells] == [0, 1, 2]
    np.testing.assert_allclose([c["kappa_d"] for c in cells], kappas, rtol=1e-8)
    check = res["amplification_check"]
    assert check["verdict"] == "verified"
    # measured directly, against numpy's kappa^3 (independent of attnaudit.core.spectral), within its budget
    assert check["measured_kappa"] == pytest.approx(kappas[0] ** 3, rel=check["error_budget"])
    assert check["error_budget"] < 0.1


@pytest.mark.skipif(not HAS_MNIST, reason="../shared/data/MNIST not present")
def test_real_mnist_n1000_reports_rank_deficiency_not_noise():
    result = runner.invoke(
        app, ["kappa", "--dataset", "mnist", "--split", "test", "--data-dir", str(SHARED), "--n", "1000", "--json", "-"]
    )
    assert result.exit_code == 0, result.output
    gram = json.loads(result.stdout)["results"]["gram"]
    assert gram["rank_deficient"] is True
    assert gram["kappa_d"] is None and gram["kappa_d_is_infinite"] is True
    # shared/data/README.md: "a random subset of 1,000 images has numerical rank about 570 of 784"
    assert 540 <= gram["numerical_rank"] <= 600
    # independent: numpy spectrum, rank = eigenvalues above max(n, d) eps lambda_1 (the documented rule)
    lam = _gram_spectrum(_mnist_subset(1000, 0))
    rank = int((lam > 1000 * np.finfo(np.float64).eps * lam[0]).sum())
    assert gram["numerical_rank"] == rank
    # lambda_r is about 1e-11 lambda_1: float64 pins it to a relative 1e-16 x 1e11
    assert gram["kappa_at_numerical_rank"] == pytest.approx(lam[0] / lam[rank - 1], rel=1e-4)


def test_outputs_written_and_not_overwritten(tmp_path):
    out = tmp_path / "run"
    png = tmp_path / "k.png"
    args = ["kappa", "--n", "64,128", "--seeds", "2", "--out-dir", str(out), "--png", str(png), "-q"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert len(report["results"]["sweep"]["summary"]) == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = runner.invoke(app, args)
    assert again.exit_code == 2
    assert "already exists" in again.output and "--overwrite" in again.output
    forced = runner.invoke(app, args + ["--overwrite"])
    assert forced.exit_code == 0, forced.output


def test_user_file_with_centering_detects_lost_rank(tmp_path):
    X = np.random.default_rng(0).standard_normal((20, 50))
    path = tmp_path / "x.npy"
    np.save(path, X)
    result = runner.invoke(app, ["kappa", "--data", str(path), "--preprocess", "center", "--json", "-"])
    assert result.exit_code == 0, result.output
    gram = json.loads(result.stdout)["results"]["gram"]
    assert gram["numerical_rank"] == 19 and gram["rank_deficient"]


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--dataset", "imagenet"], ["--dataset", "imagenet", "unknown"]),
        (["--dataset", "mnist", "--data-dir", "/nonexistent/x"], ["--data-dir", "/nonexistent/x", "--download"]),
        (["--n", "abc"], ["--n", "'abc'"]),
        (["--n", "0"], ["--n"]),
        (["--seeds", "0"], ["--seeds"]),
        (["--rank-tol", "5"], ["--rank-tol"]),
        (["--data", "/nonexistent/file.npz"], ["--data", "/nonexistent/file.npz"]),
        (["--device", "tpu"], ["--device", "tpu"]),
        (["--png", "/tmp/x.jpg"], ["--png", "/tmp/x.jpg", ".png"]),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needles):
    result = runner.invoke(app, ["kappa", *args])
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text  # one message line
    for needle in needles:  # it names the offending flag (and value)
        assert needle in text, text


def test_nan_file_is_a_clear_error_in_a_subprocess(tmp_path):
    X = np.ones((10, 4))
    X[3, 2] = np.nan
    np.save(tmp_path / "bad.npy", X)
    proc = run_cli("kappa", "--data", str(tmp_path / "bad.npy"))
    assert proc.returncode == 2
    assert "non-finite" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_json_to_a_device_file_needs_no_overwrite_and_a_folder_is_refused(tmp_path):
    assert runner.invoke(app, ["kappa", "--n", "50", "-q", "--json", "/dev/null"]).exit_code == 0
    folder = runner.invoke(app, ["kappa", "--n", "50", "-q", "--json", str(tmp_path)])
    assert folder.exit_code == 2 and "directory" in folder.output
