"""benchmarks/gpu/check.sh cannot rot: its smallest form runs here on the CPU (two independent
runs of each analysis compared through the same code as the CPU-vs-GPU comparison)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_script_runs_end_to_end_on_the_cpu(tmp_path):
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "TINY": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["schema"] == "attnaudit.gpu-check/1" and report["ok"] is True and report["device"] == "cpu"
    assert [s["command"] for s in report["stages"]] == ["kappa", "ntk-distance", "malleability", "landscape"]
    for stage in report["stages"]:
        assert stage["agreement"] and all(a["ok"] for a in stage["agreement"])
        assert stage["seconds"]["cpu"] > 0 and stage["seconds"]["device"] > 0
    assert "RATIO gpu_check_speedup=" in out.stdout


@pytest.mark.parametrize(
    "a,b,kind,tol,ok",
    [
        (100.0, 100.05, "rel", 1e-3, True),
        (100.0, 100.2, "rel", 1e-3, False),
        (0.2, 0.25, "abs", 0.1, True),
        (0.2, 0.35, "abs", 0.1, False),
        (57, 57, "exact", 0.0, True),
        (57, 56, "exact", 0.0, False),
        (None, 1.0, "rel", 1e-3, False),
        (None, None, "rel", 1e-3, True),
    ],
)
def test_a_disagreement_beyond_its_tolerance_is_flagged(a, b, kind, tol, ok):
    assert _check_module()._agree(a, b, kind, tol)[1] is ok


def test_the_cuda_check_refuses_cleanly_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _check_module().main(["--device", "cuda", "--size", "tiny", "--out", "/nonexistent"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_a_check_past_its_deadline_skips_stages_says_so_and_fails(tmp_path):
    # deadline 0: every stage would start after it, so none runs; the JSON still says what was
    # skipped, and a check that measured nothing is not "ok"
    assert _check_module().main(["--device", "cpu", "--size", "tiny", "--out", str(tmp_path), "--deadline", "0"]) == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["stages"] == [] and report["ok"] is False
    assert report["skipped"] == ["kappa", "ntk-distance", "malleability", "landscape"]
