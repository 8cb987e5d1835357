"""Synthetic command reports from a known truth, scored by the real claims scorecard.

Shared by ``benchmarks/power_claims.py`` (error rates at the null boundaries, the family-wise
rate, power) and ``benchmarks/bench_coverage.py`` (coverage over a grid of truths). Both draw
per-seed quantities from a data-generating process whose truth is known, write them into the
JSON dicts the analyses write (the fields :mod:`attnaudit.claims.scorecard`'s readers read:
``claim_ntk``, ``claim_malleability``, ``claim_landscape``, ``claim_alignment``), pass them to
``scorecard.score(mode, reports, errors, commands, variants)`` and read the rows it returns. So
the gates (chance accuracy, loss matching, failed cells), the replicate counting, seeds left
out, the ratio with no point estimate and Holm's adjustment are the scorecard's own.

Data-generating processes
-------------------------

**Flip rates** (malleability). Per seed and stream (relu attack, attn attack, relu's and
attn's sign-noise control) a flip probability p = Q(Phi(z)): z a standard normal latent, Q the
quantile function of a zero-inflated Beta (p = 0 with probability ``zero``, else Beta with mean
``mu`` and Var = rho mu (1 - mu)). The two models of a seed are coupled by a Gaussian copula
(latent correlation ``corr``, negative allowed), each control to its model's attack (``ctrl_corr``).
A data-split effect adds one N(0, split^2) shift per seed to every stream's latent (the same
data shifts both models' logits), which leaves the copula's uniform scale, so the true mean
E[p] = E[Q(Phi(sqrt(1 + split^2) x))] is computed by quadrature. The K audited examples of a
seed flip in clusters of size c: flips = c Binomial(K / c, p) (c = 1: the beta-binomial of the
old benchmark; c > 1 inflates the within-seed variance). Truths: E[p_attn] / E[p_relu] (the
ratio row), E[p_attack] - E[p_control] (the noise controls).

**Slopes** (ntk-distance). Per seed and model d(w) = A w^beta_s exp(sigma eps_w) over widths
16, 64, 256, 1024, eps_w i.i.d. N(0, 1); beta_s = beta0 + scale e_s with e_s normal, Student t3
or a shifted log-normal (exp(s Z) - 1, right-skewed; "neglognorm": its mirror image), a share
``shared`` of it common to both models of a seed. The per-seed statistic is the least-squares
log-log slope over the widths the scorecard keeps; its population median (the sign test's
estimand) and mean (the old t-interval's) come from 200,000 Monte Carlo draws per setting, and
beta0 is shifted so that the median sits where the setting asks (medians are shift-equivariant).
Cells at chance (net_train_acc 0.1) at width 16 carry a distance 10x too large (what would make
a false "approaches" if the chance rule did not drop the width).

**Landscape** log(lambda_max relu / attn) and log(trace relu / trace attn) per seed, and
**alignment** ln(err_relu / err_attn) per seed and target (principal, random, labels; the
contrast principal - random per seed): a shift plus seed noise (relu's noise skewed and attn's
normal for the skewed settings), calibrated the same way.

**Baselines** (the retired procedures, on the same replications and the same per-seed values
the row reads): Student-t ``mean_interval`` of the per-seed statistic (its estimand is the
mean), Fieller's ``ratio_interval`` with binomial floors for the flip-rate ratio and the paired
t ``difference_interval`` for the noise control; verdict: the interval entirely on the claim's
side of the row's null value (``stats.decide``, >= 3 seeds), no multiplicity adjustment.

``seeds_needed``: the scorecard resamples the seeds of every unresolved row to say how many
seeds would resolve it (up to 200 seeds x 200 resamples of the row's own test): 10-20 s per
unresolved malleability row (16 s measured at k = 10, K = 30, against 20 ms for the rest of score()). It does not enter any verdict, interval or
p-value, so the benchmarks replace it by ``None`` unless run with ``--seeds-needed``, and print
the measured cost of one real call.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np
from scipy import optimize, special
from scipy import stats as st

from attnaudit.claims import scorecard as C
from attnaudit.core import stats

MIN_RATIO = float(getattr(C, "MIN_RATIO", 1.05))
SLOPE_MARGIN = float(getattr(C, "SLOPE_MARGIN", 0.1))
LOG_MIN = math.log(MIN_RATIO)
ALPHA = 0.025
SUPPORTED = getattr(stats, "SUPPORTED", "supported")
CONTRADICTED = getattr(stats, "CONTRADICTED", "contradicted")
ISSUED = (SUPPORTED, CONTRADICTED)
MC_DRAWS = 200_000
WIDTHS = (16, 64, 256, 1024)
N_CLASSES, N_TRAIN = 10, 500
MODE = "quick"


# ============================================================== flip-rate process
def beta_ppf(u: np.ndarray, mu: float, rho: float) -> np.ndarray:
    """Seed-level rate p = F^-1(u) of Beta with mean mu and Var = rho mu (1 - mu); rho 0: p = mu."""
    if rho <= 0:
        return np.full_like(np.asarray(u, dtype=float), mu)
    phi = 1.0 / rho - 1.0
    return st.beta.ppf(u, mu * phi, (1.0 - mu) * phi)


def seed_rates(
    rng: np.random.Generator, mus: tuple[float, ...], rho, corr: float, k: int, reps: int, K: int
) -> list[np.ndarray]:
    """Observed flip rates, one (reps, k) array per model (the old benchmarks' process): p_s from a
    Gaussian copula of Beta seed effects, flips ~ Binomial(K, p_s)."""
    rhos = tuple(rho) if isinstance(rho, (tuple, list)) else (rho,) * len(mus)
    z0 = rng.standard_normal((reps, k))
    out = []
    for j, mu in enumerate(mus):
        z = z0 if j == 0 else corr * z0 + math.sqrt(1.0 - corr * corr) * rng.standard_normal((reps, k))
        p = beta_ppf(special.ndtr(z), mu, rhos[j])
        out.append(rng.binomial(K, np.clip(p, 0.0, 1.0)) / K)
    return out


@dataclass(frozen=True)
class Rate:
    """A seed's flip probability: 0 with probability ``zero``, else Beta(mean mu, Var rho mu (1 - mu))."""

    mu: float
    rho: float = 0.05
    zero: float = 0.0

    def ppf(self, u: np.ndarray) -> np.ndarray:
        u = np.asarray(u, dtype=float)
        if self.zero <= 0:
            return beta_ppf(u, self.mu, self.rho)
        out = np.zeros_like(u)
        nz = u >= self.zero
        out[nz] = beta_ppf((u[nz] - self.zero) / (1.0 - self.zero), self.mu, self.rho)
        return out

    def mean(self, split: float = 0.0) -> float:
        """E[p] when the latent carries a N(0, split^2) shift (quadrature; exact without one)."""
        if split <= 0:
            return (1.0 - self.zero) * self.mu
        u = (np.arange(MC_DRAWS) + 0.5) / MC_DRAWS
        x = special.ndtri(u)
        return float(self.ppf(special.ndtr(math.sqrt(1.0 + split * split) * x)).mean())

    def with_mean(self, target: float, split: float = 0.0) -> "Rate":
        """The same shape with mu set so that E[p] = target."""
        if split <= 0:
            return replace(self, mu=target / (1.0 - self.zero))
        mu = optimize.brentq(lambda m: replace(self, mu=m).mean(split) - target, 1e-6, 0.999, xtol=1e-10)
        return replace(self, mu=mu)


def _latent(rng, reps, k, base=None, corr=0.0):
    z = rng.standard_normal((reps, k))
    if base is None:
        return z
    return corr * base + math.sqrt(1.0 - corr * corr) * z


def _flips(rng, p: np.ndarray, K: int, cluster: int) -> np.ndarray:
    return cluster * rng.binomial(K // cluster, np.clip(p, 0.0, 1.0)) / K


# ============================================================== slope / log-ratio noise
def draw_noise(rng: np.random.Generator, kind: str, shape) -> np.ndarray:
    """Seed noise of a kind: normal, t3, lognorm<s> (exp(s Z) - 1, right-skewed), neglognorm<s>."""
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "t3":
        return rng.standard_t(3, shape)
    m = re.fullmatch(r"(neg)?lognorm([0-9.]*)", kind)
    if m:
        s = float(m.group(2) or 1.0)
        x = np.expm1(s * rng.standard_normal(shape))
        return -x if m.group(1) else x
    raise ValueError(kind)


def ols_weights(widths) -> np.ndarray:
    """c with slope = c . log(d) for a least-squares fit of log(d) on log(w)."""
    x = np.log(np.asarray(widths, dtype=float))
    return (x - x.mean()) / ((x - x.mean()) ** 2).sum()


def loglog_slopes(widths, d: np.ndarray) -> np.ndarray:
    return np.log(d) @ ols_weights(widths)


# ============================================================== report builders
def mall_report(attn, relu, ctrl_attn, ctrl_relu, K: int, acc: dict | None = None, failed: list | None = None) -> dict:
    """A malleability report: PGD eps 0.3 summary rows with their sign-noise controls (own per-seed
    rates), the attn/relu ratio row (per-seed values, loss gate), trainings, failed cells."""
    k = len(attn)
    seeds = list(range(k))
    acc = acc or {}

    def summary(model, attack, vals):
        return {
            "model": model,
            "attack": attack,
            "eps": 0.3,
            "damping": 0.001,
            "seeds": seeds,
            "top_k": K,
            "flip_rate": {"mean": float(np.mean(vals)), "values": [float(v) for v in vals], "n": k},
            "floors": {}
            if attack == "sign"
            else {"sign": {"mean": float(np.mean(ctrl_attn if model == "attn" else ctrl_relu)), "attack": "sign"}},
        }

    mb = float(np.mean(relu))
    return {
        "schema": "attnaudit.malleability/1",
        "warnings": [],
        "results": {
            "config": {"attacks": ["pgd", "sign"], "eps": [0.3], "damping": [0.001], "top_k": K},
            "n_train": 300,
            "dataset": {"class_counts": {str(i): 30 for i in range(N_CLASSES)}},
            "summary": [
                summary("relu", "pgd", relu),
                summary("attn", "pgd", attn),
                summary("relu", "sign", ctrl_relu),
                summary("attn", "sign", ctrl_attn),
            ],
            "ratios": [
                {
                    "numerator": "attn",
                    "denominator": "relu",
                    "attack": "pgd",
                    "eps": 0.3,
                    "damping": 0.001,
                    "ratio": float(np.mean(attn)) / mb if mb > 0 else None,
                    "n": k,
                    "numerator_values": [float(v) for v in attn],
                    "denominator_values": [float(v) for v in relu],
                    "seeds": seeds,
                    "loss_gate": {"numerator_loss": 0.20, "denominator_loss": 0.21, "factor": 1.5, "comparable": True},
                }
            ],
            "training": [
                {"seed": s, "model": m, "role": role, "train_accuracy": acc.get((m, s), 0.95)}
                for s in seeds
                for m in ("relu", "attn")
                for role in ("clean", "perturbed")
            ],
            "failed_cells": list(failed or []),
        },
    }


def ntk_report(dist: dict[str, np.ndarray], acc: dict[str, np.ndarray], failed: list | None = None) -> dict:
    """An ntk-distance report: cells (model, width, seed) with distance_rms and net_train_acc, and
    the run's own per-seed slopes over every width. ``dist[m]``, ``acc[m]``: (k, widths)."""
    k = next(iter(dist.values())).shape[0]
    cells = [
        {
            "model": m,
            "width": w,
            "seed": s,
            "net_train_acc": float(acc[m][s, j]),
            "distance_rms": float(dist[m][s, j]),
            "diverged": False,
        }
        for m in ("relu", "attn")
        for j, w in enumerate(WIDTHS)
        for s in range(k)
    ]
    models = {m: {"slope_per_seed": loglog_slopes(WIDTHS, dist[m]).tolist()} for m in ("relu", "attn")}
    return {
        "schema": "attnaudit.ntk_distance/1",
        "warnings": [],
        "results": {
            "config": {"seeds": list(range(k)), "widths": list(WIDTHS)},
            "n_train": N_TRAIN,
            "n_test": 100,
            "n_classes": N_CLASSES,
            "cells": cells,
            "models": models,
            "failed_cells": list(failed or []),
        },
    }


def land_report(lam: dict, trace: dict, loss: dict, acc: dict) -> dict:
    """A landscape report: per model and seed loss, accuracy, lambda_max, trace (arrays of length k)."""
    k = len(lam["relu"])
    models = {}
    for m in ("relu", "attn"):
        vals = [
            {
                "seed": s,
                "loss": float(loss[m][s]),
                "accuracy": float(acc[m][s]),
                "lambda_max": float(lam[m][s]),
                "trace": float(trace[m][s]),
                "trace_stderr": 0.01 * float(trace[m][s]),
            }
            for s in range(k)
        ]
        models[m] = {
            "n_samples": N_TRAIN,
            "loss": vals[0]["loss"],
            "accuracy": vals[0]["accuracy"],
            "seeds": {"n_seeds": k, "values": vals},
        }
    return {
        "schema": "attnaudit.landscape/1",
        "warnings": [],
        "results": {"dataset": {"class_counts": {str(i): 50 for i in range(N_CLASSES)}}, "models": models},
    }


def align_report(principal, random_, labels) -> dict:
    """An alignment report: ln(err_relu / err_attn) per seed on principal, random and label targets,
    and the principal - random contrast per seed."""

    def row(quantity, target, per):
        return {"quantity": quantity, "target": target, "per_seed": [float(v) for v in per]}

    q = "kernel_log_error_ratio_attn"
    return {
        "schema": "attnaudit.alignment/1",
        "warnings": [],
        "results": {
            "summary": [row(q, "principal", principal), row(q, "random", random_), row(q, "labels", labels)],
            "contrast": [row(q + "_contrast", "principal-random", np.asarray(principal) - np.asarray(random_))],
        },
    }


# ============================================================== reading the rows
def _is(row, run: str, *words: str, role: str = "claim") -> bool:
    return (
        row.run == run
        and getattr(row, "role", "claim") == role
        and all(w.lower() in row.claim.lower() for w in words)
        and "[sensitivity" not in row.claim
    )


#: Row key -> (how to find it among score()'s rows, the claim's side of null_value).
ROWS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mall": (lambda r: r.run == "malleability", "above"),
    "ntk_approach": (lambda r: _is(r, "ntk", "2L-ReLU approaches"), "below"),
    "ntk_flat": (lambda r: _is(r, "ntk", "does not approach"), "inside"),
    "ntk_slower": (lambda r: _is(r, "ntk", "more slowly"), "above"),
    "land_lambda": (lambda r: _is(r, "landscape", "eigenvalue"), "above"),
    "land_trace": (lambda r: _is(r, "landscape", "trace"), "above"),
    "align_contrast": (lambda r: _is(r, "alignment", "random"), "above"),
    "align_principal": (lambda r: _is(r, "alignment", "principal-direction targets MLP-Attn"), "above"),
    "align_labels": (lambda r: _is(r, "alignment", "real labels"), "above"),
}
FAMILY = tuple(ROWS)
#: Where each row's null hypothesis ends (for the TOST row: the upper margin); checked against the rows.
BOUNDARY = {
    "mall": MIN_RATIO,
    "ntk_approach": -SLOPE_MARGIN,
    "ntk_flat": SLOPE_MARGIN,
    "ntk_slower": SLOPE_MARGIN,
    **{k: LOG_MIN for k in ROWS if k.startswith(("land_", "align_"))},
}


def find(rows: list, key: str):
    pick = ROWS[key][0]
    got = [r for r in rows if pick(r)]
    if len(got) != 1:
        raise LookupError(f"{key}: {len(got)} matching rows among {[r.claim for r in rows]}")
    return got[0]


def covers(bounds, truth: float) -> bool:
    """Whether [lo, hi] (None: unbounded end) contains the truth."""
    if bounds is None:
        return False
    lo, hi = bounds
    return (lo is None or lo <= truth + 1e-12) and (hi is None or truth - 1e-12 <= hi)


def margin_of(row) -> tuple[float, float]:
    m = getattr(row, "equivalence_margin", None)
    if m:
        return float(m[0]), float(m[1])
    d = abs(float(row.null_value)) if row.null_value is not None else SLOPE_MARGIN
    return -d, d


def baseline_verdict(iv: stats.Interval | None, row, side: str) -> str:
    """The retired rule: the interval entirely on the claim's side of the null (>= 3 seeds, no Holm)."""
    if iv is None or iv.estimate is None or iv.n < 3:
        return "not resolved"
    if side == "inside":
        lo, hi = margin_of(row)
        if iv.lo() > lo and iv.hi() < hi:
            return SUPPORTED
        return CONTRADICTED if iv.hi() < lo or iv.lo() > hi else "not resolved"
    return stats.decide(iv, float(row.null_value), side, iv.n)[0]


#: Columns of a malleability row's per-seed units (the order its test uses).
MALL_COLUMNS = ("attn", "relu", "attn_control", "relu_control")


def interval_on_claim_side(row, key: str) -> bool:
    """Whether the row's interval lies wholly on the claim's side of its null (the verdict's
    interval condition alone; for the malleability row: the ratio's, without the noise control)."""
    if row.interval is None or row.null_value is None:
        return False
    lo, hi = (
        (-math.inf if row.interval[0] is None else row.interval[0]),
        (math.inf if row.interval[1] is None else row.interval[1]),
    )
    side = ROWS[key][1]
    if side == "inside":
        a, b = margin_of(row)
        return a < lo and hi < b
    return lo > row.null_value if side == "above" else hi < row.null_value


def _units(row) -> np.ndarray:
    """The row's per-seed values as floats: (seeds,) or, for the malleability row, (seeds, 4) in
    :data:`MALL_COLUMNS` order (units given as dicts or as sequences; None: nan)."""

    def num(v):
        return float("nan") if v is None else float(v)

    out = []
    for u in row.per_seed or []:
        if isinstance(u, dict):
            out.append([num(u.get(c)) for c in MALL_COLUMNS])
        elif isinstance(u, (list, tuple)):
            out.append([num(v) for v in u])
        else:
            out.append(num(u))
    return np.array(out, dtype=float)


def control_interval(row, model: str) -> tuple[list | None, bool]:
    """The attack-minus-control interval of ``model`` from the row (``controls``), else computed here
    with ``stats.bounded_mean_interval`` on the same per-seed values (second value: computed here)."""
    c = (getattr(row, "controls", None) or {}).get(model) or {}
    if c.get("interval") is not None:
        return c["interval"], False
    u = _units(row)
    if u.ndim != 2 or u.shape[1] < 4:
        return None, True
    j = 0 if model == "attn" else 1
    ok = np.isfinite(u[:, 2 + j])
    return stats.bounded_mean_interval((u[ok, j] - u[ok, 2 + j]).tolist(), -1.0, 1.0).bounds, True


# ============================================================== tallies
@dataclass
class Tally:
    hits: dict = field(default_factory=lambda: defaultdict(int))
    n: dict = field(default_factory=lambda: defaultdict(int))
    notes: set = field(default_factory=set)

    def add(self, key: str, hit: bool) -> None:
        self.hits[key] += bool(hit)
        self.n[key] += 1

    def share(self, key: str) -> float:
        return self.hits[key] / self.n[key] if self.n[key] else float("nan")


@dataclass
class Check:
    """One interval to check: the row ``key``'s interval (``proc``) against ``truth``, and the retired
    procedure's interval against ``base_truth`` (its own estimand)."""

    proc: str
    key: str
    truth: float
    base_truth: float | None = None
    kind: str = "median"  # median (sign test / order statistics), ratio, excess_attn, excess_relu


def _baseline_interval(check: Check, row, K: int | None) -> stats.Interval | None:
    u = _units(row)
    if u.size == 0:
        return None
    if check.kind == "median":
        return stats.mean_interval(u.tolist())
    if check.kind == "ratio":
        return stats.ratio_interval(u[:, 0].tolist(), u[:, 1].tolist(), trials=(K, K))
    j = 0 if check.kind == "excess_attn" else 1
    return stats.difference_interval(u[:, j].tolist(), u[:, 2 + j].tolist())


def _new_interval(check: Check, row, tally: Tally):
    if check.kind in ("excess_attn", "excess_relu"):
        bounds, here = control_interval(row, check.kind.split("_")[1])
        if here:
            tally.notes.add(
                "the row does not expose the noise control's interval: computed here with "
                "stats.bounded_mean_interval(diffs, -1, 1) on the row's per-seed values"
            )
        return bounds
    return row.interval


# ============================================================== settings
@dataclass
class Setting:
    """A named setting: ``draw(rng, reps)`` returns per-replication reports; ``targets``: rows whose
    truth lies at (or inside) the null (a supported verdict there is false); ``checks``: intervals;
    ``purpose``: error (false_supported), coverage, abstain (verdict_issued), power."""

    name: str
    purpose: str = "error"
    targets: tuple = ()
    checks: list = field(default_factory=list)
    k: int = 10
    K: int | None = None
    info: dict = field(default_factory=dict)
    only: tuple = ()  # restrict the false-supported count to these rows (others may sit at a null too)

    def prepare(self) -> None:  # truths and calibration (once per setting)
        pass

    def draw(self, rng: np.random.Generator, reps: int) -> Iterator[dict]:
        raise NotImplementedError


@dataclass
class MallSetting(Setting):
    relu: Rate = Rate(0.1)
    attn: Rate = Rate(0.1)
    ctrl_relu: Rate | None = None  # default: a fifth of the attack's rate
    ctrl_attn: Rate | None = None
    corr: float = 0.5
    ctrl_corr: float = 0.5
    split: float = 0.0
    cluster: int = 1
    ratio: float | None = None  # set attn's mean so that E[attn] / E[relu] = ratio
    at_chance: bool = False
    failed: bool = False

    def prepare(self) -> None:
        if self.ratio is not None:
            self.attn = self.attn.with_mean(self.ratio * self.relu.mean(self.split), self.split)
        self.ctrl_relu = self.ctrl_relu or replace(self.relu, mu=self.relu.mu / 5)
        self.ctrl_attn = self.ctrl_attn or replace(self.attn, mu=self.attn.mu / 5)
        means = {n: getattr(self, n).mean(self.split) for n in ("relu", "attn", "ctrl_relu", "ctrl_attn")}
        truth = means["attn"] / means["relu"]
        self.info.update({f"E_{n}": v for n, v in means.items()}, ratio=truth)
        self.checks = [
            Check("ratio", "mall", truth, truth, "ratio"),
            Check(
                "excess_attn",
                "mall",
                means["attn"] - means["ctrl_attn"],
                means["attn"] - means["ctrl_attn"],
                "excess_attn",
            ),
            Check(
                "excess_relu",
                "mall",
                means["relu"] - means["ctrl_relu"],
                means["relu"] - means["ctrl_relu"],
                "excess_relu",
            ),
        ]
        claim_false = truth <= MIN_RATIO + 1e-9 or means["attn"] - means["ctrl_attn"] <= 1e-12
        if self.purpose == "error" and not claim_false:
            raise ValueError(f"{self.name}: the claim is true here (ratio {truth:.3f})")
        self.targets = ("mall",) if claim_false and self.purpose in ("error", "coverage") else ()

    def draw(self, rng, reps):
        k, K = self.k, self.K
        g = rng.standard_normal((reps, k)) * self.split
        zr = _latent(rng, reps, k)
        za = _latent(rng, reps, k, zr, self.corr)
        zcr = _latent(rng, reps, k, zr, self.ctrl_corr)
        zca = _latent(rng, reps, k, za, self.ctrl_corr)

        def rates(rate, z):  # the latent plus the seed's split shift (Rate.mean integrates over it)
            return _flips(rng, rate.ppf(special.ndtr(z + g)), K, self.cluster)

        relu, attn = rates(self.relu, zr), rates(self.attn, za)
        cr, ca = rates(self.ctrl_relu, zcr), rates(self.ctrl_attn, zca)
        for i in range(reps):
            acc, failed = {}, None
            if self.at_chance:
                acc[("relu" if i % 2 else "attn", int(rng.integers(k)))] = 0.10
            kk = k
            if self.failed:
                kk = k - 1  # the failed seed's cells are missing from the tables
                failed = [{"cell": f"attn seed {k - 1} pgd", "error": "RuntimeError: out of memory"}]
            yield {"malleability": mall_report(attn[i, :kk], relu[i, :kk], ca[i, :kk], cr[i, :kk], K, acc, failed)}


def _median_shift(x: np.ndarray, target: float) -> float:
    return target - float(np.median(x))


@dataclass
class NtkSetting(Setting):
    """Per-seed slopes of both models. ``relu_median``: the median per-seed statistic of relu's row;
    ``attn_median`` or ``diff_median`` (attn - relu, paired) fix attn's."""

    relu_median: float = -0.33
    attn_median: float | None = -0.04
    diff_median: float | None = None
    noise: str = "normal"
    noise_attn: str | None = None
    scale: float = 0.1
    sigma: float = 0.1
    shared: float = 0.3
    chance: str | None = None  # "relu" / "attn": some of that model's width-16 cells at chance
    failed: bool = False

    def _seed_slopes(self, rng, shape):
        """Zero-offset per-seed slopes (relu, attn) and width noise (relu, attn)."""
        h = rng.standard_normal(shape)
        a = math.sqrt(self.shared)
        b = math.sqrt(1.0 - self.shared)
        er = self.scale * (a * h + b * draw_noise(rng, self.noise, shape))
        ea = self.scale * (a * h + b * draw_noise(rng, self.noise_attn or self.noise, shape))
        wr = self.sigma * rng.standard_normal(shape + (len(WIDTHS),))
        wa = self.sigma * rng.standard_normal(shape + (len(WIDTHS),))
        return er, ea, wr, wa

    def widths_of(self, model: str | None) -> tuple:
        """Widths a row's slopes span: width 16 is left out for a model with chance cells there, and
        for the paired difference (``model`` None) when either model has them."""
        return WIDTHS[1:] if self.chance and (model is None or self.chance == model) else WIDTHS

    def prepare(self) -> None:
        rng = np.random.default_rng(12345)
        er, ea, wr, wa = self._seed_slopes(rng, (MC_DRAWS,))

        def stat(e, w, widths):
            idx = [WIDTHS.index(x) for x in widths]
            return e + w[:, idx] @ ols_weights(widths)

        sr, sa = self.widths_of("relu"), self.widths_of("attn")
        sd = self.widths_of(None)
        xr, xa = stat(er, wr, sr), stat(ea, wa, sa)
        xr_d, xa_d = stat(er, wr, sd), stat(ea, wa, sd)
        self.b_relu = _median_shift(xr, self.relu_median)
        if self.attn_median is not None:
            self.b_attn = _median_shift(xa, self.attn_median)
        else:
            self.b_attn = self.b_relu + _median_shift(xa_d - xr_d, self.diff_median)
        r, a, d = xr + self.b_relu, xa + self.b_attn, (xa_d + self.b_attn) - (xr_d + self.b_relu)
        t = {"relu": np.median(r), "attn": np.median(a), "diff": np.median(d)}
        mean = {"relu": r.mean(), "attn": a.mean(), "diff": d.mean()}
        self.info.update(
            beta0_relu=self.b_relu,
            beta0_attn=self.b_attn,
            **{f"median_{x}": v for x, v in t.items()},
            **{f"mean_{x}": v for x, v in mean.items()},
        )
        self.checks = [
            Check("slope_relu", "ntk_approach", t["relu"], mean["relu"]),
            Check("slope_attn", "ntk_flat", t["attn"], mean["attn"]),
            Check("slope_diff", "ntk_slower", t["diff"], mean["diff"]),
        ]
        d = SLOPE_MARGIN
        nulls = {
            "ntk_approach": t["relu"] >= -d - 1e-9,
            "ntk_flat": abs(t["attn"]) >= d - 1e-9,
            "ntk_slower": t["diff"] <= d + 1e-9,
        }
        if self.purpose in ("error", "coverage"):
            self.targets = tuple(key for key, null in nulls.items() if null)
            if self.purpose == "error" and not self.targets:
                raise ValueError(f"{self.name}: no row at its null")

    def draw(self, rng, reps):
        k = self.k
        er, ea, wr, wa = self._seed_slopes(rng, (reps, k))
        logw = np.log(np.array(WIDTHS, dtype=float))
        dist = {
            "relu": np.exp(np.log(2.0) + (self.b_relu + er)[..., None] * logw + wr),
            "attn": np.exp(np.log(2.0) + (self.b_attn + ea)[..., None] * logw + wa),
        }
        for i in range(reps):
            d = {m: dist[m][i].copy() for m in dist}
            acc = {m: np.full((k, len(WIDTHS)), 0.9) for m in d}
            if self.chance:
                bad = rng.random(k) < 0.3
                bad[int(rng.integers(k))] = True
                acc[self.chance][bad, 0] = 0.10
                d[self.chance][bad, 0] *= 10.0  # what a model at chance would add to a slope
            failed = [{"cell": f"relu width 1024 seed {k - 1}", "error": "diverged: nan loss"}] if self.failed else None
            yield {"ntk": ntk_report(d, acc, failed)}


@dataclass
class LandSetting(Setting):
    """Per-seed log(lambda_max relu / attn) and log(trace relu / attn) with medians ``lam`` and ``trace``;
    relu's noise of kind ``noise``, attn's normal. ``dropped``: share of seeds whose losses differ by
    30 % (left out); ``at_chance``: every attn seed at chance (the rows cannot be tested)."""

    lam: float = LOG_MIN
    trace: float = LOG_MIN
    noise: str = "normal"
    scale: float = 0.2
    dropped: float = 0.0
    at_chance: bool = False

    def _noise(self, rng, shape):
        return [self.scale * draw_noise(rng, self.noise, shape) for _ in range(2)] + [
            self.scale * rng.standard_normal(shape) for _ in range(2)
        ]

    def prepare(self) -> None:
        rng = np.random.default_rng(23456)
        nlr, ntr, nla, nta = self._noise(rng, (MC_DRAWS,))
        self.s_lam = _median_shift(nlr - nla, self.lam)
        self.s_tr = _median_shift(ntr - nta, self.trace)
        xl, xt = nlr - nla + self.s_lam, ntr - nta + self.s_tr
        self.info.update(median_lam=np.median(xl), median_trace=np.median(xt), mean_lam=xl.mean(), mean_trace=xt.mean())
        self.checks = [
            Check("logratio_lambda", "land_lambda", float(np.median(xl)), float(xl.mean())),
            Check("logratio_trace", "land_trace", float(np.median(xt)), float(xt.mean())),
        ]
        if self.purpose in ("error", "coverage"):
            self.targets = tuple(
                key for key, v in (("land_lambda", self.lam), ("land_trace", self.trace)) if v <= LOG_MIN + 1e-12
            )

    def draw(self, rng, reps):
        k = self.k
        nlr, ntr, nla, nta = self._noise(rng, (reps, k))
        base_l, base_t = 2.0, 50.0
        loss_r = 0.1 * np.exp(0.01 * rng.standard_normal((reps, k)))
        loss_a = 0.1 * np.exp(0.01 * rng.standard_normal((reps, k)))
        if self.dropped:
            loss_a = np.where(rng.random((reps, k)) < self.dropped, 1.3 * loss_a, loss_a)
        for i in range(reps):
            lam = {"relu": base_l * np.exp(self.s_lam + nlr[i]), "attn": base_l * np.exp(nla[i])}
            tr = {"relu": base_t * np.exp(self.s_tr + ntr[i]), "attn": base_t * np.exp(nta[i])}
            acc = {"relu": np.full(k, 0.95), "attn": np.full(k, 0.10 if self.at_chance else 0.95)}
            yield {"landscape": land_report(lam, tr, {"relu": loss_r[i], "attn": loss_a[i]}, acc)}


@dataclass
class AlignSetting(Setting):
    """Per-seed ln(err_relu / err_attn): principal, labels and the principal - random contrast with
    medians ``principal``, ``labels``, ``contrast`` (noise of kind ``noise``)."""

    principal: float = LOG_MIN
    labels: float = LOG_MIN
    contrast: float = LOG_MIN
    noise: str = "normal"
    scale: float = 0.2

    def prepare(self) -> None:
        rng = np.random.default_rng(34567)
        x = {t: self.scale * draw_noise(rng, self.noise, (MC_DRAWS,)) for t in ("principal", "labels", "contrast")}
        self.shift = {t: _median_shift(x[t], getattr(self, t)) for t in x}
        self.checks = [
            Check(
                f"logratio_{t}",
                f"align_{t}",
                float(np.median(x[t] + self.shift[t])),
                float((x[t] + self.shift[t]).mean()),
            )
            for t in ("contrast", "principal", "labels")
        ]
        self.info.update(
            {f"median_{c.proc}": c.truth for c in self.checks}, **{f"mean_{c.proc}": c.base_truth for c in self.checks}
        )
        if self.purpose in ("error", "coverage"):
            self.targets = tuple(
                f"align_{t}" for t in ("contrast", "principal", "labels") if getattr(self, t) <= LOG_MIN + 1e-12
            )

    def draw(self, rng, reps):
        k = self.k
        x = {
            t: self.scale * draw_noise(rng, self.noise, (reps, k)) + self.shift[t]
            for t in ("principal", "labels", "contrast")
        }
        for i in range(reps):
            p = x["principal"][i]
            yield {"alignment": align_report(p, p - x["contrast"][i], x["labels"][i])}


@dataclass
class FamilySetting(Setting):
    """Several runs in one score() call (``parts``: settings whose reports are merged)."""

    parts: list = field(default_factory=list)

    def prepare(self) -> None:
        for p in self.parts:
            p.k, p.purpose = self.k, self.purpose
            p.prepare()
        self.checks = [c for p in self.parts for c in p.checks]
        self.targets = tuple(t for p in self.parts for t in p.targets)
        self.K = next((p.K for p in self.parts if p.K), None)
        for p in self.parts:
            self.info.update({f"{p.name}.{k}": v for k, v in p.info.items()})

    def draw(self, rng, reps):
        for reports in zip(*(p.draw(rng, reps) for p in self.parts)):
            merged = {}
            for r in reports:
                merged.update(r)
            yield merged


# ============================================================== running
@contextlib.contextmanager
def seeds_needed(enabled: bool):
    """Without ``enabled``, the scorecard's advisory "seeds needed" resampling returns None (it
    changes no verdict, interval or p-value; see the module docstring)."""
    from attnaudit.claims import decision

    cls = getattr(decision, "SeedTest", None)
    if enabled or cls is None or not hasattr(cls, "seeds_needed"):
        yield
        return
    orig = cls.seeds_needed
    cls.seeds_needed = lambda self, family: None
    try:
        yield
    finally:
        cls.seeds_needed = orig


def score(reports: dict) -> list:
    commands = {rid: f"attnaudit {rid} (synthetic)" for rid in reports}
    return C.score(MODE, reports, {}, commands, []).claims


@dataclass
class Outcome:
    setting: Setting
    tally: Tally
    reps: int
    seconds: float


def run_setting(s: Setting, reps: int, rng: np.random.Generator) -> Outcome:
    s.prepare()
    if s.only:
        missing = set(s.only) - set(s.targets)
        if missing:
            raise ValueError(f"{s.name}: {sorted(missing)} not at their null")
        s.targets = tuple(s.only)
    tally = Tally()
    t0 = time.perf_counter()
    for reports in s.draw(rng, reps):
        rows = score(reports)
        got = {key: find(rows, key) for key in ROWS if any(ROWS[key][0](r) for r in rows)}
        for key in s.targets:  # the boundary the setting was calibrated to, against the row's own null value
            row = got[key]
            want = BOUNDARY[key]
            have = margin_of(row)[1] if ROWS[key][1] == "inside" else row.null_value
            if have is not None and abs(float(have) - want) > 1e-9:
                tally.notes.add(
                    f"MISMATCH: row {key} reads null value {have:.6g}, the setting's boundary is {want:.6g} "
                    "(the scorecard's MIN_RATIO / SLOPE_MARGIN changed?)"
                )
        if s.purpose == "abstain":
            tally.add("verdict_issued", any(r.verdict in ISSUED for r in got.values()))
            tally.add("raw_verdict_issued", any(getattr(r, "raw_verdict", r.verdict) in ISSUED for r in got.values()))
            continue
        if s.targets and s.purpose != "power":
            tally.add("false_supported", any(got[t].verdict == SUPPORTED for t in s.targets))
            tally.add("raw_false_supported", any(getattr(got[t], "raw_verdict", "") == SUPPORTED for t in s.targets))
            tally.add("false_interval_side", any(interval_on_claim_side(got[t], t) for t in s.targets))
            tally.add(
                "baseline_false_supported",
                any(
                    baseline_verdict(_baseline_for_target(got[t], t, s), got[t], ROWS[t][1]) == SUPPORTED
                    for t in s.targets
                ),
            )
        if "mall" in got and got["mall"].interval is not None:  # the ratio with no point estimate (relu never flipped)
            tally.add("ratio_no_estimate", got["mall"].value is None)
        if s.purpose == "power":
            for key, row in got.items():
                if any(c.key == key for c in s.checks):
                    tally.add(f"power:{key}", row.verdict == SUPPORTED)
        for c in s.checks:
            row = got.get(c.key)
            if row is None or row.interval is None:  # no interval (a row that could not be tested)
                tally.add(f"no_interval:{c.proc}", True)
                continue
            tally.add(f"coverage:{c.proc}", covers(_new_interval(c, row, tally), c.truth))
            if c.base_truth is not None:
                iv = _baseline_interval(c, row, s.K)
                if iv is not None and iv.n >= 2:
                    tally.add(f"baseline_coverage:{c.proc}", covers([iv.low, iv.high], c.base_truth))
    return Outcome(s, tally, reps, time.perf_counter() - t0)


def _baseline_for_target(row, key: str, s: Setting) -> stats.Interval | None:
    """The retired procedure's interval of a target row (the malleability row: Fieller AND the paired t
    of attn's attack minus its control, returned as the ratio interval cut to nothing when the
    control's interval does not lie above 0)."""
    if key != "mall":
        u = _units(row)
        return stats.mean_interval(u.tolist()) if u.size else None
    u = _units(row)
    if u.size == 0:
        return None
    iv = stats.ratio_interval(u[:, 0].tolist(), u[:, 1].tolist(), trials=(s.K, s.K))
    ok = np.isfinite(u[:, 2])
    ctrl = stats.difference_interval(u[ok, 0].tolist(), u[ok, 2].tolist())
    if ctrl.low is None or ctrl.low <= 0:  # the old rule also needed the attack to beat its noise floor
        return stats.Interval(iv.estimate, None, None, iv.method, iv.confidence, iv.n)
    return iv


# ============================================================== output
def mcse_bound(reps: int, level: float = ALPHA) -> float:
    return level + 3.0 * math.sqrt(level * (1 - level) / reps)


def report(outcomes: list[Outcome], t0: float, emit=print) -> dict[str, float]:
    """Print the setting lines and the closing summary; returns the RATIO values by name."""
    ratio: dict[str, float] = {}
    base: dict[str, float] = {}
    notes: set = set()
    for o in outcomes:
        s, t = o.setting, o.tally
        notes |= t.notes
        ms = 1e3 * o.seconds / max(1, o.reps)
        info = ", ".join(f"{k}={v:.4g}" for k, v in s.info.items() if isinstance(v, (int, float)))
        emit(f"# {s.name}: k={s.k}{'' if s.K is None else f' K={s.K}'} reps={o.reps} {ms:.1f} ms/rep; {info}")
        if s.purpose == "abstain":
            ratio[f"verdict_issued_{s.name}"] = t.share("verdict_issued")
            emit(f"raw_verdict_issued_{s.name}={t.share('raw_verdict_issued'):.4f}")
        if t.n["false_supported"]:
            ratio[f"false_supported_{s.name}"] = t.share("false_supported")
            emit(f"raw_false_supported_{s.name}={t.share('raw_false_supported'):.4f}")
            ratio[f"false_interval_side_{s.name}"] = t.share("false_interval_side")
            base[f"false_supported_{s.name}"] = t.share("baseline_false_supported")
        for key in sorted(t.n):
            if key.startswith("power:"):
                ratio[f"power_{s.name}_{key[6:]}"] = t.share(key)
            elif key.startswith("coverage:"):
                ratio[f"coverage_{key[9:]}_{s.name}"] = t.share(key)
            elif key.startswith("baseline_coverage:"):
                base[f"coverage_{key[18:]}_{s.name}"] = t.share(key)
            elif key == "ratio_no_estimate" and t.hits[key]:
                emit(f"# {s.name}: {t.hits[key]} of {t.n[key]} ratio rows had no point estimate (relu 0 on every seed)")
            elif key.startswith("no_interval:"):
                emit(f"# {s.name}: {t.n[key]} of {o.reps} replications gave {key[12:]} no interval (not counted)")
    for name, v in ratio.items():
        emit(f"RATIO {name}={v:.4f}")
    for name, v in base.items():
        emit(f"BASELINE {name}={v:.4f}")
    reps = min((o.reps for o in outcomes), default=1)
    fs = [v for n, v in ratio.items() if n.startswith("false_supported_")]
    cov = [v for n, v in ratio.items() if n.startswith("coverage_")]
    iss = [v for n, v in ratio.items() if n.startswith("verdict_issued_")]
    fis = [v for n, v in ratio.items() if n.startswith("false_interval_side_")]
    bfs = [v for n, v in base.items() if n.startswith("false_supported_")]
    bcov = [v for n, v in base.items() if n.startswith("coverage_")]
    for note in sorted(notes):
        emit(f"# note: {note}")
    limit = mcse_bound(reps)
    if fs:
        ratio["false_supported_max"] = max(fs)
        emit(f"RATIO false_supported_max={max(fs):.4f}")
        worst = max(
            (n for n in ratio if n.startswith("false_supported_") and n != "false_supported_max"), key=ratio.get
        )
        emit(
            f"# false_supported target <= {limit:.4f} (0.025 + 3 MCSE at {reps} reps): "
            f"{'met' if max(fs) <= limit else 'MISSED'} (worst: {worst})"
        )
    if cov:
        ratio["coverage_min"] = min(cov)
        emit(f"RATIO coverage_min={min(cov):.4f}")
        worst = min((n for n in ratio if n.startswith("coverage_") and n != "coverage_min"), key=ratio.get)
        emit(f"# coverage target >= 0.93: {'met' if min(cov) >= 0.93 else 'MISSED'} (worst: {worst})")
    if fis:
        ratio["false_interval_side_max"] = max(fis)
        emit(f"RATIO false_interval_side_max={max(fis):.4f}")
    if iss:
        ratio["verdict_issued_max"] = max(iss)
        emit(f"RATIO verdict_issued_max={max(iss):.4f}")
        emit(f"# verdict_issued target 0: {'met' if max(iss) == 0 else 'MISSED'}")
    if bfs:
        emit(f"BASELINE false_supported_max={max(bfs):.4f}")
    if bcov:
        emit(f"BASELINE coverage_min={min(bcov):.4f}")
    emit(f"wall_s={time.perf_counter() - t0:.1f}")
    return ratio


def time_seeds_needed(s: Setting, rng: np.random.Generator, emit=print) -> None:
    """Time one real score() call (seeds_needed included) on one replication of ``s``."""
    s.prepare()
    reports = next(iter(s.draw(rng, 1)))
    t = time.perf_counter()
    rows = score(reports)
    dt = time.perf_counter() - t
    with seeds_needed(False):
        t2 = time.perf_counter()
        score(reports)
        dt2 = time.perf_counter() - t2
    needed = [getattr(r, "seeds_needed", None) for r in rows if getattr(r, "test", None) is not None]
    emit(
        f"# score() on one {s.name} replication: {dt * 1e3:.0f} ms with seeds_needed (rows' seeds_needed "
        f"{needed}), {dt2 * 1e3:.1f} ms without"
    )


def parse_lines(text: str) -> dict[str, dict[str, float]]:
    """{"RATIO": {name: value}, "BASELINE": {...}} from a benchmark's output."""
    out: dict[str, dict[str, float]] = {"RATIO": {}, "BASELINE": {}}
    for line in text.splitlines():
        m = re.fullmatch(r"(RATIO|BASELINE) (\S+)=(\S+)", line.strip())
        if m:
            out[m.group(1)][m.group(2)] = float(m.group(3))
    return out


def parse_synth_args(doc: str | None, argv, default_reps: int, quick_reps: int):
    """The command line shared by power_claims.py and bench_coverage.py."""
    import argparse

    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help=f"replications per setting (default {default_reps}; --quick {quick_reps})",
    )
    ap.add_argument("--seed", type=int, default=0, help="numpy generator seed (default 0)")
    ap.add_argument("--quick", action="store_true", help="a handful of settings at a few replications")
    ap.add_argument(
        "--seeds-needed",
        action="store_true",
        help="keep the scorecard's seeds_needed resampling (up to a few seconds per unresolved malleability row)",
    )
    return ap.parse_args(argv)
