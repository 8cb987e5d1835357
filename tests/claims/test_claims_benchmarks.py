"""The claims benchmarks (benchmarks/power_claims.py, benchmarks/bench_coverage.py) in their quick
mode: every line kind they promise is printed and parseable, and a deliberately wrong scorecard
procedure (a verdict from the point estimate alone, a zero-width interval) makes them fail."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_coverage  # noqa: E402
import claims_synth  # noqa: E402
import power_claims  # noqa: E402

from attnaudit.claims import decision  # noqa: E402
from attnaudit.claims import scorecard  # noqa: E402
from attnaudit.core import stats  # noqa: E402

REPS = 30
LINE = re.compile(r"(RATIO|BASELINE) ([A-Za-z0-9_.]+)=(-?[0-9.]+(?:e-?[0-9]+)?)")


def _run(module, capsys, reps: int = REPS) -> tuple[str, dict[str, dict[str, float]]]:
    assert module.main(["--quick", "--reps", str(reps), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    for line in out.splitlines():
        if line.startswith(("RATIO", "BASELINE")):
            assert LINE.fullmatch(line), line
    parsed = claims_synth.parse_lines(out)
    for kind in parsed.values():
        for name, v in kind.items():
            assert math.isfinite(v) and 0.0 <= v <= 1.0, (name, v)
    return out, parsed


def _names(parsed, kind, prefix):
    return [n for n in parsed[kind] if n.startswith(prefix)]


def test_power_claims_quick_prints_every_line_kind(capsys):
    out, p = _run(power_claims, capsys)
    assert _names(p, "RATIO", "false_supported_mall_")
    assert _names(p, "RATIO", "false_supported_ntk_")
    assert _names(p, "RATIO", "false_supported_land_")
    assert _names(p, "RATIO", "false_supported_align_")
    assert "false_supported_family_global_null" in p["RATIO"]
    for proc in (
        "ratio",
        "excess_attn",
        "slope_relu",
        "slope_attn",
        "slope_diff",
        "logratio_lambda",
        "logratio_contrast",
    ):
        assert _names(p, "RATIO", f"coverage_{proc}_"), proc
    assert _names(p, "RATIO", "verdict_issued_mall_failed")
    assert _names(p, "RATIO", "power_paper_k10_")
    assert _names(p, "BASELINE", "false_supported_") and _names(p, "BASELINE", "coverage_")
    for name in ("false_supported_max", "coverage_min", "verdict_issued_max"):
        assert name in p["RATIO"], name
    assert re.search(r"^raw_false_supported_\S+=[0-9.]+$", out, re.M)
    assert re.search(r"^wall_s=[0-9.]+$", out, re.M)
    # every setting reads its row's own null value: no boundary mismatch
    assert "MISMATCH" not in out
    # the real scorecard at its null boundaries: no false verdicts beyond the Monte Carlo margin, and
    # the abstention settings abstain
    assert p["RATIO"]["false_supported_max"] <= claims_synth.mcse_bound(REPS)
    assert p["RATIO"]["verdict_issued_max"] == 0.0


def test_bench_coverage_quick_prints_every_line_kind(capsys):
    out, p = _run(bench_coverage, capsys)
    for proc in ("ratio", "excess_attn", "excess_relu", "slope_relu", "logratio_trace", "logratio_labels"):
        assert _names(p, "RATIO", f"coverage_{proc}_"), proc
        assert _names(p, "BASELINE", f"coverage_{proc}_"), proc
    assert _names(p, "RATIO", "false_supported_")
    assert "coverage_min" in p["RATIO"] and "false_supported_max" in p["RATIO"]
    assert "MISMATCH" not in out


def test_a_verdict_from_the_point_estimate_alone_is_caught(monkeypatch, capsys):
    """A scorecard that reads 'supported' whenever the point estimate lies on the claim's side of
    the null gives false 'supported' verdicts far above 0.025 at the null boundaries."""

    def wrong(self, p):
        est = self.interval.estimate
        if est is None:
            return stats.NOT_RESOLVED, "no estimate"
        point = dataclasses.replace(self.interval, low=est, high=est)
        if self.inside(point):
            return stats.SUPPORTED, "the estimate lies on the claim's side"
        return stats.NOT_RESOLVED, "the estimate does not"

    monkeypatch.setattr(decision.SeedTest, "reading", wrong)
    _, p = _run(power_claims, capsys)
    assert p["RATIO"]["false_supported_max"] > 0.25 > claims_synth.mcse_bound(REPS)
    assert p["RATIO"]["false_supported_family_global_null"] > 0.5


def test_a_zero_width_interval_is_caught(monkeypatch, capsys):
    """Median intervals shrunk to the sample median cover (almost) never."""
    real = stats.median_interval

    def point(values, confidence=stats.CONFIDENCE):
        iv = real(values, confidence)
        return dataclasses.replace(iv, low=iv.estimate, high=iv.estimate)

    monkeypatch.setattr(stats, "median_interval", point)
    if hasattr(scorecard, "median_interval"):
        monkeypatch.setattr(scorecard, "median_interval", point)
    _, p = _run(bench_coverage, capsys)
    assert p["RATIO"]["coverage_min"] < 0.5


@pytest.mark.parametrize("kind", ["normal", "t3", "lognorm", "neglognorm0.5"])
def test_median_calibration_puts_the_truth_on_the_boundary(kind):
    s = claims_synth.NtkSetting("x", relu_median=-0.1, attn_median=0.1, noise=kind, chance="relu")
    s.prepare()
    truths = {c.proc: c.truth for c in s.checks}
    assert truths["slope_relu"] == pytest.approx(-0.1, abs=1e-9)
    assert truths["slope_attn"] == pytest.approx(0.1, abs=1e-9)


def test_flip_rate_truths():
    r = claims_synth.Rate(0.2, 0.05, zero=0.5)
    assert r.mean() == pytest.approx(0.1)
    # the split effect's quadrature against a plain Monte Carlo draw
    import numpy as np

    rng = np.random.default_rng(0)
    z = rng.standard_normal(400_000) + rng.standard_normal(400_000)
    mc = r.ppf(claims_synth.special.ndtr(z)).mean()
    assert r.mean(split=1.0) == pytest.approx(mc, abs=2e-3)
    assert r.with_mean(0.12, split=1.0).mean(split=1.0) == pytest.approx(0.12, abs=1e-6)
