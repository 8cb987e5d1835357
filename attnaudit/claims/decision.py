"""How a seed-based claim row reaches its verdict: one-sided tests, Holm, and the seeds a row needs.

Every seed-based row carries a :class:`SeedTest`: the one-sided p-value of the claim's side
(``p_claim``) and of the other side (``p_contra``), computed by a procedure whose error rate
holds for any seed distribution (:mod:`attnaudit.core.stats`: betting tests for bounded
per-seed rates, the sign test of the median seed for unbounded statistics). The row's
``p_value`` is 2 min(p_claim, p_contra) (a two-sided reading of the two one-sided tests);
Holm's procedure adjusts these across the scorecard's seed-based rows (:func:`adjust`), and

* supported: adjusted p <= 1 - :data:`~attnaudit.core.stats.CONFIDENCE` on the claim's side,
  and the row's 95 % interval excludes its null value;
* contradicted: the same on the other side;
* not resolved: otherwise, with the number of seeds that would resolve it at 80 % power
  (:func:`attnaudit.core.stats.seeds_for_power`, resampling the observed seeds).

``raw_verdict`` is the same reading without the adjustment. Rows that a blocking warning
stopped (a model at chance, failed seeds, the edge of stability, ...) carry no test and stay
out of the family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnaudit.core.stats import (
    ALPHA,
    CONFIDENCE,
    CONTRADICTED,
    MIN_SEEDS,
    NOT_RESOLVED,
    SUPPORTED,
    Interval,
    holm,
    seeds_for_power,
)

#: Power the "seeds needed" estimate asks for.
POWER = 0.8


@dataclass
class SeedTest:
    """One row's test. ``recompute(units)`` gives (p_claim, p_contra) for an array of per-seed
    units (``units``: the observed ones, resampled by the power estimate); ``inside`` says
    whether an interval lies wholly on the claim's side (True), the other side (False) or
    neither (None)."""

    units: list
    recompute: Callable[[np.ndarray], tuple[float, float]]
    inside: Callable[[Interval], bool | None]
    interval: Interval
    estimand: str
    context: str = ""
    p_claim: float = field(init=False)
    p_contra: float = field(init=False)

    def __post_init__(self) -> None:
        arr = np.array(self.units, dtype=float)
        self.p_claim, self.p_contra = self.recompute(arr)

    @property
    def p_value(self) -> float:
        """Two-sided reading of the two one-sided tests, the value Holm adjusts."""
        return min(1.0, 2.0 * min(self.p_claim, self.p_contra))

    @property
    def n(self) -> int:
        return len(self.units)

    def reading(self, p: float) -> tuple[str, str]:
        """(verdict, reason) at the (adjusted or raw) two-sided p-value ``p``."""
        level = 1.0 - CONFIDENCE
        if self.n < MIN_SEEDS:
            return NOT_RESOLVED, f"{self.n} seed(s): fewer than {MIN_SEEDS}, too few to carry a verdict"
        side = self.inside(self.interval)
        if p <= level and self.p_claim <= self.p_contra and side is True:
            return (
                SUPPORTED,
                f"p = {p:.3g} <= {level:g} on the claim's side; the interval {self.interval.text()} excludes the null",
            )
        if p <= level and self.p_contra < self.p_claim and side is False:
            return CONTRADICTED, (
                f"p = {p:.3g} <= {level:g} on the other side; the interval {self.interval.text()} excludes the null"
            )
        return (
            NOT_RESOLVED,
            f"p = {p:.3g} > {level:g}" if p > level else f"p = {p:.3g} but the interval touches the null",
        )

    def seeds_needed(self, family: int) -> int | None:
        """Seeds at which the observed direction's one-sided test reaches Holm's strictest level
        ALPHA / family in 80 % of resampled runs (None: over 100, or no direction)."""
        claim_side = self.p_claim <= self.p_contra

        def p_of(units: np.ndarray) -> float:
            pc, pn = self.recompute(np.asarray(units, dtype=float))
            return pc if claim_side else pn

        return seeds_for_power(self.units, p_of, ALPHA / max(1, family), power=POWER)


def adjust(rows: Sequence[Any]) -> None:
    """Holm across the rows that carry a test (``row.test``): sets ``p_value``, ``p_adjusted``,
    ``raw_verdict``, ``verdict``, ``why`` and, for rows left unresolved, ``seeds_needed``.

    A row without a test keeps its verdict (its ``raw_verdict`` is that verdict)."""
    tested = [r for r in rows if r.test is not None and r.test.n >= MIN_SEEDS]
    adjusted = holm([r.test.p_value for r in tested])
    for r in rows:
        if r.test is None or r.test.n < MIN_SEEDS:
            r.raw_verdict = r.verdict
    for r, p_adj in zip(tested, adjusted):
        t = r.test
        raw, _ = t.reading(t.p_value)
        verdict, reason = t.reading(p_adj)
        r.p_value, r.p_adjusted, r.raw_verdict = t.p_value, p_adj, raw
        head = f"{t.estimand}: one-sided p {t.p_claim:.3g} (claim side) / {t.p_contra:.3g} (other side)"
        holm_text = f"Holm-adjusted over {len(tested)} seed-based rows: {reason}"
        if verdict != raw:
            holm_text += f" (unadjusted it reads {raw})"
        r.verdict = verdict
        r.why = "; ".join(x for x in (head, holm_text, t.context) if x)
        if verdict == NOT_RESOLVED:
            r.seeds_needed = t.seeds_needed(len(tested))
            r.why += (
                f"; at its observed effect and spread it would need about {r.seeds_needed} seeds for 80 % power"
                if r.seeds_needed is not None
                else "; at its observed effect no number of seeds up to 100 resolves it"
            )
