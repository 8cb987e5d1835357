"""benchmarks/soak_resume.py cannot rot: its smallest form kills a resumable sweep once or more,
resumes it to the end and finds the uninterrupted run's report, with no partial output seen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_resume.py"


def test_the_soak_script_interrupts_resumes_and_compares(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--interrupts", "1", "--workloads", "ntk", "--tiny", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = [line for line in out.stdout.splitlines() if line.startswith("SOAK ")]
    assert len(summary) == 1
    fields = dict(part.split("=") for part in summary[0].split()[1:])
    assert int(fields["interrupts"]) >= 1 and fields["identical"] == "true" and fields["partial_outputs"] == "0"
