"""`attnaudit kappa` end to end: defaults, JSON on stdout, real MNIST, files, error exits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from attnaudit.cli import app

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
HAS_MNIST = (SHARED / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists()
runner = CliRunner()


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


def test_json_to_stdout_is_the_only_stdout(tmp_path):
    proc = run_cli("kappa", "--n", "300", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)  # fails if anything else was printed to stdout
    assert payload["schema"] == "attnaudit.kappa/1"
    assert payload["seeds"]["subset_seeds"] == [0]
    assert payload["environment"]["torch"]
    assert "analysis" in payload["timings_s"]


@pytest.mark.skipif(not HAS_MNIST, reason="../shared/data/MNIST not present")
def test_real_mnist_sweep_json_has_finite_kappa_and_width():
    result = runner.invoke(
        app,
        ["kappa", "--dataset", "mnist", "--split", "test", "--data-dir", str(SHARED), "--n", "128", "--seeds", "3", "--json", "-"],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    res = payload["results"]
    assert res["gram"]["numerical_rank"] == 128
    assert res["gram"]["kappa_d"] is not None and np.isfinite(res["gram"]["kappa_d"])
    assert res["width_estimates"][0]["log10_required_width"] > 5
    cells = res["sweep"]["cells"]
    assert len(cells) == 3 and all(c["kappa_d"] is not None for c in cells)
    assert len({c["kappa_d"] for c in cells}) == 3  # three different subsets
    assert res["amplification_check"]["verdict"] == "verified"


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
    assert gram["kappa_at_numerical_rank"] > 0


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
    "args,needle",
    [
        (["--dataset", "imagenet"], "unknown"),
        (["--dataset", "mnist", "--data-dir", "/nonexistent/x"], "--download"),
        (["--n", "abc"], "--n"),
        (["--n", "0"], "--n"),
        (["--seeds", "0"], "--seeds"),
        (["--rank-tol", "5"], "--rank-tol"),
        (["--data", "/nonexistent/file.npz"], "file.npz"),
        (["--device", "tpu"], "--device"),
        (["--png", "/tmp/x.jpg"], ".png"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    result = runner.invoke(app, ["kappa", *args])
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert needle in text
    assert "Traceback" not in text
    assert len(text.splitlines()) <= 2  # one message (rich may wrap a long line once)


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
