"""benchmarks/compare_reports.py finds a changed number, key or string and ignores timings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_reports.py"


def _module():
    spec = importlib.util.spec_from_file_location("compare_reports", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_differences_are_found_and_timings_ignored():
    diff = _module().differences
    a = {"results": {"kappa": [1.0, 2.0], "verdict": "falls"}, "timings_s": {"total": 3.0}}
    assert diff(a, {"results": {"kappa": [1.0, 2.0 + 1e-6], "verdict": "falls"}, "timings_s": {"total": 9.0}}) == []
    assert diff(a, {"results": {"kappa": [1.0, 2.01], "verdict": "falls"}}) == ["/results/kappa[1]: 2.0 vs 2.01"]
    assert diff(a, {"results": {"kappa": [1.0], "verdict": "rises"}}) == [
        "/results/kappa: 2 vs 1 items",
        "/results/verdict: 'falls' vs 'rises'",
    ]
    assert diff({"x": 1}, {"y": 1}) == ["/x: only in the first", "/y: only in the second"]
