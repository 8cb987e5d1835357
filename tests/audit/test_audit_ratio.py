"""An audit check on the attn / relu ratio's upper end: Fieller's interval may leave it
unbounded (relu flips too few to bound the ratio); that is +inf, which fails a max:, never a
missing value (an error) and never a pass."""

from __future__ import annotations

import math

from attnaudit.audit.file import CheckSpec
from attnaudit.audit.runner import CheckResult, judge, observe


def _spec(stat: str, max_: float) -> CheckSpec:
    return CheckSpec(
        0,
        "ratio",
        "malleability",
        {},
        False,
        "ratio",
        None,
        "attnaudit.malleability",
        {"numerator": "attn", "denominator": "relu", "attack": "pgd"},
        stat,
        max_,
        None,
        "lower",
        0.0,
        None,
    )


REPORT = {
    "schema": "attnaudit.malleability/1",
    "results": {
        "ratios": [
            {
                "numerator": "attn",
                "denominator": "relu",
                "attack": "pgd",
                "eps": 0.1,
                "damping": 0.001,
                "ratio": 1.6,
                "ci_low": 0.2,
                "ci_high": None,
                "unbounded_high": True,
            },
        ]
    },
}


def test_an_unbounded_upper_end_fails_a_max():
    spec = _spec("ci_high", 1.5)
    values = observe(spec, REPORT)
    assert [v["value"] for v in values] == [math.inf]
    check = CheckResult(spec, "attnaudit malleability ...", "run1")
    judge(check, values, None)
    assert check.status == "fail" and "inf > max 1.5" in check.message


def test_the_lower_end_and_the_estimate_are_read_as_they_are():
    for stat, expected, status in (("ci_low", 0.2, "pass"), ("mean", 1.6, "fail")):
        spec = _spec(stat, 1.5)
        values = observe(spec, REPORT)
        assert [v["value"] for v in values] == [expected]
        check = CheckResult(spec, "cmd", "run1")
        judge(check, values, None)
        assert check.status == status
