"""Summaries over a batch of per-sample condition numbers (`attnaudit kappa --checkpoint`).

Every quantity is summarised by the median and the 10th/90th percentiles of log10 kappa.
Infinite values are kept, not dropped: they sort above every finite value, so a median is
infinite exactly when at least half the samples are rank deficient, and the number of
rank-deficient samples is always stated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from attnaudit.core.spectral import ConditionReport, condition_report


def _quantile(sorted_vals: np.ndarray, q: float) -> float:
    """Linear-interpolation quantile of sorted values that may hold +-inf (never NaN from inf - inf)."""
    pos = q * (sorted_vals.size - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    a, b = float(sorted_vals[lo]), float(sorted_vals[hi])
    frac = pos - lo
    if lo == hi or frac == 0.0:
        return a
    if not (math.isfinite(a) and math.isfinite(b)):
        return b if math.isinf(b) and b > 0 else a  # an interpolation towards +inf is +inf; from -inf, -inf
    return a + frac * (b - a)


@dataclass(frozen=True)
class Spread:
    """Median and 10th/90th percentiles of one per-sample quantity (usually log10 kappa).

    +-inf values take part (they sort last / first); undefined values (NaN, e.g. the
    exponent when kappa(in) = 1) are left out and counted.
    """

    median: float
    p10: float
    p90: float
    n: int  # values summarised (finite and infinite)
    n_plus_infinite: int
    n_minus_infinite: int
    n_undefined: int

    @classmethod
    def of(cls, values: np.ndarray | Sequence[float]) -> "Spread":
        vals = np.asarray(values, dtype=np.float64).ravel()
        undefined = int(np.isnan(vals).sum())
        vals = np.sort(vals[~np.isnan(vals)])
        plus, minus = int(np.isposinf(vals).sum()), int(np.isneginf(vals).sum())
        if vals.size == 0:
            return cls(math.nan, math.nan, math.nan, 0, 0, 0, undefined)
        return cls(
            _quantile(vals, 0.5), _quantile(vals, 0.1), _quantile(vals, 0.9), int(vals.size), plus, minus, undefined
        )

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        nonfinite = {}
        for key in ("median", "p10", "p90"):
            v = getattr(self, key)
            out[key] = v if math.isfinite(v) else None
            if math.isinf(v):
                nonfinite[key] = "+inf" if v > 0 else "-inf"
        out.update(
            n=self.n,
            n_plus_infinite=self.n_plus_infinite,
            n_minus_infinite=self.n_minus_infinite,
            n_undefined=self.n_undefined,
            nonfinite=nonfinite,
        )
        return out


def log10_kappa(k: float) -> float:
    """log10 of a condition number: +inf for an infinite one, NaN for NaN or a non-positive one."""
    if math.isnan(k):
        return math.nan
    if math.isinf(k):
        return math.inf
    return math.log10(k) if k > 0 else math.nan


def _report(values: np.ndarray, rows: int, cols: int, rank_tol: float | None) -> ConditionReport | None:
    """condition_report of one spectrum; None for an all-zero matrix (no condition number)."""
    if not values.size or not float(np.max(values)) > 0:
        return None
    return condition_report(values, rows, cols, rank_tol)


@dataclass
class SpectrumSummary:
    """Rank and conditioning of one matrix per sample (a token Gram, or one head's attention map).

    ``kappa_full`` per sample: lambda_1 / lambda_min(rows, cols) (inf when rank deficient);
    ``kappa_rank``: at the numerical rank (NaN for an all-zero matrix); ``rank``: numerical rank.
    """

    rows: int
    cols: int
    kappa_full: np.ndarray
    kappa_rank: np.ndarray
    rank: np.ndarray
    zero: int  # samples whose matrix is exactly zero
    # per sample: the rows of its matrix when they differ (a padded sequence's real tokens), else None
    rows_per_sample: np.ndarray | None = None

    @classmethod
    def of(
        cls, spectra: np.ndarray, rows: int, cols: int, rank_tol: float | None, sample_rows: np.ndarray | None = None
    ) -> "SpectrumSummary":
        """Summaries of descending spectra (B, >= min(rows, cols)). ``sample_rows`` (B,): the
        matrix of sample b has only that many rows (the others were zeroed: padding), so its
        spectrum is its first min(sample_rows[b], cols) values and its rank tolerance uses them."""
        kd, kr, rk, zero = [], [], [], 0
        for b, lam in enumerate(spectra):
            n_rows = rows if sample_rows is None else int(sample_rows[b])
            lam = lam[: min(n_rows, cols)]
            rep = _report(lam, n_rows, cols, rank_tol)
            if rep is None:
                zero += 1
                kd.append(math.inf)
                kr.append(math.nan)
                rk.append(0)
            else:
                kd.append(rep.kappa_full)
                kr.append(rep.kappa_rank)
                rk.append(rep.numerical_rank)
        per = None if sample_rows is None else np.asarray(sample_rows, dtype=np.int64)
        return cls(rows, cols, np.array(kd), np.array(kr), np.array(rk, dtype=np.int64), zero, per)

    @property
    def k(self) -> int:
        return min(self.rows, self.cols)

    @property
    def k_per_sample(self) -> np.ndarray:
        """min(rows, cols) of each sample's matrix."""
        rows = self.rows_per_sample if self.rows_per_sample is not None else np.full(self.samples, self.rows)
        return np.minimum(rows, self.cols)

    @property
    def samples(self) -> int:
        return int(self.kappa_full.size)

    @property
    def rank_deficient(self) -> int:
        return int(np.count_nonzero(self.rank < self.k_per_sample))

    @property
    def log10_kappa(self) -> np.ndarray:
        return np.array([log10_kappa(k) for k in self.kappa_full])

    @property
    def log10_kappa_rank(self) -> np.ndarray:
        return np.array([log10_kappa(k) for k in self.kappa_rank])

    def spread(self) -> Spread:
        return Spread.of(self.log10_kappa)

    def spread_rank(self) -> Spread:
        return Spread.of(self.log10_kappa_rank)

    def to_dict(self, per_sample: bool = True) -> dict:
        out: dict[str, Any] = {
            "rows": self.rows,
            "cols": self.cols,
            "min_rows_cols": self.k,
            "samples": self.samples,
            "rank_deficient_samples": self.rank_deficient,
            "zero_samples": self.zero,
            "numerical_rank_min": int(self.rank.min()) if self.rank.size else None,
            "numerical_rank_median": float(np.median(self.rank)) if self.rank.size else None,
            "log10_kappa": self.spread().to_dict(),
            "log10_kappa_at_numerical_rank": self.spread_rank().to_dict(),
        }
        if self.rows_per_sample is not None:
            n = self.rows_per_sample
            out["rows_note"] = "padding excluded: each sample's matrix has its real tokens only"
            out["rows_per_sample_min_median_max"] = [int(n.min()), float(np.median(n)), int(n.max())]
        if per_sample:
            samples: dict[str, list] = {
                "kappa": [None if not math.isfinite(k) else float(k) for k in self.kappa_full],
                "kappa_is_infinite": [bool(math.isinf(k)) for k in self.kappa_full],
                "kappa_at_numerical_rank": [None if not math.isfinite(k) else float(k) for k in self.kappa_rank],
                "numerical_rank": self.rank.tolist(),
            }
            if self.rows_per_sample is not None:
                samples["rows"] = self.rows_per_sample.tolist()
            out["per_sample"] = samples
        return out


@dataclass
class Amplification:
    """Measured log10 kappa(out) against the linearized prediction 3 log10 kappa(in), per sample (kappa_d)."""

    log10_in: np.ndarray
    log10_out: np.ndarray
    precision_limit_log10: float  # log10(1 / (max(N, D) eps)) of the output Gram

    @property
    def predicted_log10_out(self) -> np.ndarray:
        return 3.0 * self.log10_in

    @property
    def measured_log10_ratio(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return self.log10_out - self.log10_in

    @property
    def exponent(self) -> np.ndarray:
        """log10 kappa(out) / log10 kappa(in): 3 for linearized identity attention; NaN when undefined."""
        out = np.full(self.log10_in.shape, math.nan)
        for i, (a, b) in enumerate(zip(self.log10_in, self.log10_out)):
            if math.isfinite(a) and a > 0:
                out[i] = b / a if math.isfinite(b) else math.inf
        return out

    @property
    def beyond_precision(self) -> int:
        """Samples whose predicted kappa(out) = kappa(in)^3 is beyond what a float64 Gram can show."""
        return int(np.count_nonzero(self.predicted_log10_out >= self.precision_limit_log10))

    def to_dict(self) -> dict:
        return {
            "prediction": "linearized attention: kappa(out) = kappa(in)^3, log10 kappa(out) = 3 log10 kappa(in)",
            "kappa": "kappa_d at min(N, D) of each token Gram (infinite when rank deficient)",
            "predicted_log10_kappa_out": Spread.of(self.predicted_log10_out).to_dict(),
            "measured_log10_kappa_out": Spread.of(self.log10_out).to_dict(),
            "measured_log10_amplification": Spread.of(self.measured_log10_ratio).to_dict(),
            "predicted_log10_amplification": Spread.of(2.0 * self.log10_in).to_dict(),
            "measured_exponent": Spread.of(self.exponent).to_dict(),
            "predicted_exponent": 3.0,
            "beyond_float64_precision_samples": self.beyond_precision,
            "precision_limit_log10_kappa": self.precision_limit_log10,
        }


def fmt_log(v: float, digits: int = 2) -> str:
    """A log10 value for text: ``-`` for NaN, ``inf``/``-inf``, else ``digits`` decimals."""
    if math.isnan(v):
        return "-"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}f}"


def spread_text(s: Spread | None, digits: int = 2) -> str:
    """``median [p10, p90]`` of a spread (``-`` when empty), with the undefined count."""
    if s is None or s.n == 0:
        return "-"
    text = f"{fmt_log(s.median, digits)} [{fmt_log(s.p10, digits)}, {fmt_log(s.p90, digits)}]"
    return text + (f" (of {s.n}; {s.n_undefined} undefined)" if s.n_undefined else "")
