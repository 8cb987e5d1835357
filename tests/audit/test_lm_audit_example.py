"""examples/lm/make_lm_checkpoint.py end to end: a causal LM, its base, its tokenizer, documents and the
audit file run through the library (every analysis of the file on a language model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "lm" / "make_lm_checkpoint.py"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_language_model_audit_example_runs(tmp_path, arch):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "ex"), "--arch", arch],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("lm-checkpoint-gate:"))
    checks = int(line.split(" of ")[1].split()[0])
    assert f"{checks} of {checks} checks passed (exit 0)" in line, out.stdout[-2000:]
    assert checks >= 2
    assert (tmp_path / "ex" / "lm" / "tokenizer.json").is_file()
