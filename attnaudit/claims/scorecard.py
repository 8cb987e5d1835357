"""The claims scorecard: the paper's claims as hypotheses, each tested by one documented run.

``attnaudit claims`` runs the analyses (as library requests stated by command lines, so every row has a
command line that reproduces it) and reads one verdict per claim. Every row states its
null hypothesis and the alternative (the claim), the boundary ``null_value`` between them,
the interval it is read from (method, confidence, the per-seed estimates behind it) and the
warnings of the run it comes from. The verdict is

* **supported**: the interval lies entirely on the claim's side of ``null_value``;
* **contradicted**: it lies entirely on the other side;
* **not resolved**: it includes ``null_value``, or it rests on fewer than 3 seeds, or a
  control says the effect is inside the noise;
* **not testable here**: the protocol cannot test it on these data (a model at chance in a
  cell the claim uses, training losses too far apart to compare, a quantity beyond float64),
  with why.

An interval that straddles the null is never read as support for "no effect": a claim of
"no fall" is tested against a stated margin (``slope_margin``), and supported only when the
whole interval lies above it. The interval procedures and their simulated coverage are in
:mod:`attnaudit.core.stats` and docs/findings.md. No threshold is tuned to make a claim come out.

A second table runs the malleability comparison under protocol variants (eps, damping,
optimizer and loss, input scale, loss matching) so a reader sees which conclusion survives
which choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from attnaudit.errors import AuditError
from attnaudit.core.stats import (
    CONFIDENCE,
    CONTRADICTED,
    MIN_SEEDS,
    NOT_RESOLVED,
    NOT_TESTABLE,
    SUPPORTED,
    Interval,
    decide,
    difference_interval,
    mean_interval,
    ratio_interval,
)
from attnaudit.data import PREPROCESS
from attnaudit.analyses.malleability.run import PRESETS as MALL_PRESETS
from attnaudit.analyses.registry import COMMANDS
from attnaudit.analyses.registry import request_type
from attnaudit.analyses.malleability.run import PRESETS
from attnaudit.report.envelope import Record

SCHEMA = "attnaudit.claims/2"
VERDICTS = (SUPPORTED, CONTRADICTED, NOT_RESOLVED, NOT_TESTABLE)
MODES = ("quick", "full")
#: Slopes above -SLOPE_MARGIN count as "no fall with width" (a tenfold width then shrinks the
#: distance by less than 21 %; the kernel regime's rate is -0.5).
SLOPE_MARGIN = 0.1
#: The paper compares the required width with the largest trained architectures, ~1e12
#: parameters: 1e24 (MNIST) and 1e29 (CIFAR-10) are "12-17 orders beyond".
REFERENCE_LOG10_WIDTH = 12.0
#: Seeds of every stochastic run of the scorecard (t(0.975, 4) = 2.78; 3 is the least that may decide).
DEFAULT_SEEDS = 5
#: Landscape comparisons need training losses within 10 % of each other (landscape's own gate).
LANDSCAPE_LOSS_RATIO = 1.1

RULES = {
    "verdict": (
        f"supported / contradicted only when the whole {int(100 * CONFIDENCE)} % interval lies on one side of "
        f"null_value and (seed-based intervals) rests on >= {MIN_SEEDS} seeds; otherwise not resolved"
    ),
    "intervals": (
        "seed means and slopes: Student t with k - 1 degrees of freedom; paired differences: paired Student t; "
        "flip-rate ratios: Fieller's interval for a ratio of paired means (binomial variance floor of the "
        "top-k; unbounded above, reported as null, when the denominator is not clearly above 0); kappa rows: "
        "deterministic computations with their float64 round-off bound"
    ),
    "chance": "a model whose training accuracy is below 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n)) learned nothing; "
    "claims are read only from cells (model, width, seed) above it, each judged on its own accuracy; a width "
    "at which any seed is at chance is left out for every seed and the slopes are refitted over the other "
    "widths (at least 3), so every seed is kept",
    "comparable": (
        "malleability ratios need the models' mean training losses within the run's loss-gap factor; "
        "landscape comparisons within 10 %, seed by seed"
    ),
    "no_effect": f"a claim of 'no fall' is tested against the margin -{SLOPE_MARGIN} (log-log slope), not against 0",
}


@dataclass(frozen=True)
class RunSpec:
    """One command line of the scorecard."""

    id: str
    command: str
    args: tuple[str, ...]
    purpose: str


@dataclass
class ClaimRow(Record):
    """One claim, the interval it is read from, and its verdict."""

    claim: str
    paper: str
    null: str  # H0, in words
    alternative: str  # H1 = the claim, in words
    null_value: float | None
    measured: str
    value: float | None
    interval: list | None  # [lo, hi]; None for an unbounded end
    interval_method: str
    confidence: float
    n_seeds: int
    per_seed: list
    verdict: str
    why: str
    run: str
    command: str
    warnings: list = field(default_factory=list)


@dataclass
class VariantRow(Record):
    variant: str
    options: str
    flip_relu: float | None
    flip_attn: float | None
    ratio: float | None
    interval: list | None
    interval_method: str
    n_seeds: int
    above_floor: dict
    losses_comparable: bool | None
    reading: str
    command: str
    warnings: list = field(default_factory=list)
    error: str | None = None


@dataclass
class ClaimsResult:
    mode: str
    claims: list[ClaimRow]
    variants: list[VariantRow]
    runs: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    protocol: dict = field(default_factory=dict)

    def verdicts(self) -> list[str]:
        counts = {v: sum(c.verdict == v for c in self.claims) for v in VERDICTS}
        head = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
        robust = [v for v in self.variants if v.error is None]
        orders = {v.reading for v in robust}
        tail = (
            f"; the malleability ordering reads the same under all {len(robust)} protocol variants ({orders.pop()})"
            if len(orders) == 1 and robust
            else f"; the malleability reading changes across the {len(robust)} protocol variants"
            if robust
            else ""
        )
        return [f"claims scorecard ({self.mode}): {head}{tail}"] + [
            f"{c.claim}: {c.verdict.upper()}: {c.why}" for c in self.claims
        ]

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "rules": RULES,
            "protocol": self.protocol,
            "claims": [c.to_dict() for c in self.claims],
            "protocol_variants": [v.to_dict() for v in self.variants],
            "runs": self.runs,
        }


# ----------------------------------------------------------------------------- the plan
def _has_choice(command: str, option: str, value: str) -> bool:
    """Whether this build's command accepts ``--option value`` (variants added by newer options)."""
    if not _has_option(command, option):
        return False
    if option == "preprocess":
        return value in PREPROCESS
    return True


def plan(
    mode: str, data_args: list[str], seed: int, n_seeds: int = DEFAULT_SEEDS, match_loss: float | str | None = None
) -> tuple[list[RunSpec], list[tuple[str, str]]]:
    """The scorecard's runs, and (variant name, run id) of the protocol variants.

    ``n_seeds``: seeds of every stochastic run (ntk-distance, malleability, landscape,
    alignment). ``match_loss``: a common training-loss target for malleability and landscape
    (full-batch GD stops there); the variant rows then also show the other choice."""
    if mode not in MODES:
        raise AuditError(f"unknown scorecard mode {mode!r}; use --quick or --full")
    if n_seeds < 1:
        raise AuditError(f"--seeds must be >= 1, got {n_seeds}")
    if isinstance(match_loss, str):
        if match_loss.strip().lower() not in ("auto", "none"):
            raise AuditError(f"--match-loss: {match_loss!r} is not a training loss; give a number, auto or none")
        match_loss = match_loss.strip().lower()
    elif match_loss is not None and not (math.isfinite(match_loss) and match_loss > 0):
        raise AuditError(f"--match-loss must be a positive training loss, got {match_loss}")
    preset = "quick" if mode == "quick" else "paper"
    common = [*data_args, "--seed", str(seed)]
    seeds = ("--seeds", str(n_seeds))
    ml_text = None if match_loss is None else match_loss if isinstance(match_loss, str) else f"{match_loss:g}"
    matched = ("--match-loss", ml_text) if ml_text is not None else ()
    runs = [
        RunSpec("kappa", "kappa", (*common,), "amplification kappa(G~) = kappa(G)^3 and the paper's width requirement"),
        RunSpec("ntk", "ntk-distance", ("--preset", preset, *common, *seeds), "distance to the NTK predictor vs width"),
        RunSpec(
            "malleability",
            "malleability",
            ("--preset", preset, *common, *seeds, *matched),
            "attn / relu flip-rate ratio with controls",
        ),
        RunSpec(
            "landscape",
            "landscape",
            ("--preset", preset, *common, *seeds, *matched),
            "relative sharpness of the minima",
        ),
    ]
    if _has_command("alignment"):
        runs.append(
            RunSpec(
                "alignment",
                "alignment",
                ("--preset", preset, *common, *seeds) if _has_option("alignment", "preset") else (*common, *seeds),
                "approximation error on principal-direction targets (the dual implication)",
            )
        )

    main_match = ml_text if ml_text is not None else (MALL_PRESETS.get(preset, {}).get("match_loss") or "none")
    variants = [
        (
            "preset protocol, " + ("fixed steps" if main_match == "none" else f"matched training loss ({main_match})"),
            "malleability",
        )
    ]
    extra: list[tuple[str, tuple[str, ...]]] = [
        ("eps 0.1", ("--eps", "0.1")),
        ("damping x100 (0.1)", ("--damping", "0.1")),
    ]
    if _has_choice("malleability", "optimizer", "adam"):
        extra.append(("cross-entropy, Adam lr 1e-3", ("--loss", "ce", "--optimizer", "adam", "--lr", "0.001")))
    if _has_choice("malleability", "preprocess", "ntk-scale"):
        extra.append(("inputs scaled to mean ||x||^2 = d", ("--preprocess", "ntk-scale")))
    for i, (name, args) in enumerate(extra):
        rid = f"malleability-v{i + 1}"
        runs.append(
            RunSpec(
                rid, "malleability", ("--preset", preset, *common, *seeds, *matched, *args), f"protocol variant: {name}"
            )
        )
        variants.append((name, rid))
    # loss matching as a protocol variant: the other choice from the main run's
    other = _loss_matching_variant(preset, match_loss)
    if other is not None:
        name, args = other
        rid = f"malleability-v{len(extra) + 1}"
        runs.append(
            RunSpec(rid, "malleability", ("--preset", preset, *common, *seeds, *args), f"protocol variant: {name}")
        )
        variants.append((name, rid))
    return runs, variants


def _has_command(name: str) -> bool:

    return name in COMMANDS


def _has_option(command: str, option: str) -> bool:

    return request_type(command).field_of(option) is not None


def _loss_matching_variant(preset: str, match_loss: float | str | None) -> tuple[str, tuple[str, ...]] | None:
    """The variant row that flips the loss-matching choice of the main run: fixed steps when the
    main run matches losses (``--match-loss`` given, or the preset's own ``auto``), else matched
    loss by the ``auto`` rule (every model trained to the largest loss any reaches in the budget)."""

    preset_match = PRESETS.get(preset, {}).get("match_loss") or "none"
    matches = preset_match != "none" if match_loss is None else match_loss != "none"
    if matches:
        return ("fixed steps, no loss matching", ("--match-loss", "none"))
    return ("matched training loss (auto)", ("--match-loss", "auto"))


# ----------------------------------------------------------------------------- helpers
def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}"


def _chance(acc: float | None, c: int | None, n: int | None) -> bool:
    """Whether a training accuracy is at chance by the rule in :data:`RULES` (unknown = not at chance)."""
    if acc is None or not c or not n:
        return False
    p = 1.0 / c
    return acc < p + max(0.05, 2 * math.sqrt(p * (1 - p) / n))


def _n_classes(results: dict) -> int:
    ds = results.get("dataset") or {}
    counts = ds.get("class_counts") or {}
    classes = ds.get("classes")
    if counts:
        return len(counts)
    if isinstance(classes, (list, tuple)) and classes:
        return len(classes)
    return int(results.get("n_classes") or ds.get("n_classes") or 10)


def _untestable(
    claim: str,
    paper: str,
    null: str,
    alternative: str,
    null_value: float | None,
    why: str,
    run: str,
    command: str,
    warnings: list,
    *,
    measured: str = "n/a",
    iv: Interval | None = None,
    **more: Any,
) -> ClaimRow:
    """A row this run cannot decide (:data:`NOT_TESTABLE`), saying ``why``; ``more``: as :func:`_row` takes."""
    return _row(
        claim, paper, null, alternative, null_value, measured, iv, NOT_TESTABLE, why, run, command, warnings, **more
    )


def _decided(
    claim: tuple[str, str, str, str, float],
    measured: str,
    iv: Interval,
    direction: str,
    run: str,
    command: str,
    warnings: list,
    per_seed: list,
    untestable: str | None = None,
) -> ClaimRow:
    """The row of ``claim`` (its statement: the first arguments of :func:`_row`): not testable,
    saying ``untestable``, when given; else decided from ``iv`` against the claim's null value
    (``direction``: the alternative is above or below it)."""
    if untestable is not None:
        return _untestable(*claim, untestable, run, command, warnings)
    verdict, reason = decide(iv, claim[4], direction, iv.n)
    return _row(*claim, measured, iv, verdict, reason, run, command, warnings, per_seed=per_seed)


def _row(
    claim: str,
    paper: str,
    null: str,
    alternative: str,
    null_value: float | None,
    measured: str,
    iv: Interval | None,
    verdict: str,
    why: str,
    run: str,
    command: str,
    warnings: list,
    per_seed: list | None = None,
    value: float | None = None,
    n_seeds: int | None = None,
) -> ClaimRow:
    return ClaimRow(
        claim=claim,
        paper=paper,
        null=null,
        alternative=alternative,
        null_value=null_value,
        measured=measured,
        value=value if value is not None else (None if iv is None else iv.estimate),
        interval=None if iv is None else iv.bounds,
        interval_method="none" if iv is None else iv.method,
        confidence=CONFIDENCE if iv is None else iv.confidence,
        n_seeds=(0 if iv is None else iv.n) if n_seeds is None else n_seeds,
        per_seed=list(per_seed or []),
        verdict=verdict,
        why=why,
        run=run,
        command=command,
        warnings=list(warnings),
    )


def _run_warnings(report: dict) -> list[str]:
    return [str(w) for w in report.get("warnings") or []]


# ----------------------------------------------------------------------------- kappa
def claim_kappa(report: dict, command: str) -> list[ClaimRow]:
    r = report["results"]
    warns = _run_warnings(report)
    amp = r.get("amplification_check") or {}
    gram = r.get("gram") or {}
    deficient = bool(gram.get("rank_deficient"))
    rank_note = (
        f"G is numerically rank deficient (rank {gram.get('numerical_rank')} of min(n, d) = "
        f"{gram.get('min_n_d')}): kappa_d(G) is infinite and every finite number here is read at the numerical "
        "rank"
        if deficient
        else ""
    )
    row_warns = warns + ([rank_note] if rank_note else [])
    rows = []
    verdict_raw = amp.get("verdict")
    rel, budget = amp.get("relative_error"), amp.get("error_budget")
    det = "deterministic (float64 measurement against its calibrated round-off budget)"
    name = "kappa(G~) = kappa(G)^3 (linearized attention cubes the condition number)"
    paper = "exact identity for f_att(X) = X X^T X"
    null = "the directly measured kappa(G~) differs from kappa(G)^3 by more than float64 round-off explains"
    alt = "the measured kappa(G~) equals kappa(G)^3 within the round-off budget"
    measured = f"log10 kappa^3 = {_fmt(amp.get('log10_predicted_kappa_cubed'))}; relative error {_fmt(rel)} (budget {_fmt(budget)})"
    if verdict_raw in ("verified", "mismatch") and rel is not None:
        iv = Interval(rel, rel, rel, det, CONFIDENCE, 0)
        verdict = SUPPORTED if verdict_raw == "verified" else CONTRADICTED
        why = (
            f"measured directly: relative error {_fmt(rel)} {'within' if verdict == SUPPORTED else 'beyond'} the "
            f"calibrated round-off budget {_fmt(budget)}"
        )
        rows.append(
            _row(name, paper, null, alt, budget, measured, iv, verdict, why, "kappa", command, row_warns, n_seeds=0)
        )
    else:
        why = (
            f"kappa^3 = {_fmt(amp.get('predicted_kappa_cubed'))} is beyond what a float64 measurement of G~ resolves "
            "(calibrated budget), so the identity is not measured directly here; it is exact algebra (top "
            f"eigenvalue agrees to {_fmt(amp.get('top_eigenvalue_relative_error'))})"
        )
        rows.append(
            _untestable(
                name,
                paper,
                null,
                alt,
                budget,
                why,
                "kappa",
                command,
                row_warns,
                measured=measured,
                value=amp.get("log10_predicted_kappa_cubed"),
                n_seeds=0,
            )
        )
    rows.append(_width_row(r, command, row_warns, deficient))
    return rows


def _width_row(r: dict, command: str, warns: list, deficient: bool) -> ClaimRow:
    ref = (r.get("reference_width") or {}).get("log10", REFERENCE_LOG10_WIDTH)
    name = "the width linearized attention needs, m = Omega(kappa_d(G)^6 n log n), is beyond any trainable width"
    paper = "m >> 1e24 on MNIST, >> 1e29 on CIFAR-10: 12-17 orders beyond the largest architectures (~1e12)"
    null = f"log10 m <= {ref:g} (a width within reach of the largest trained models)"
    alt = f"log10 m > {ref:g}"
    rows = r.get("width_estimates") or []
    basis = "numerical_rank" if deficient else "kappa_d"
    w = next((x for x in rows if x.get("basis") == basis), None) or (rows[-1] if rows else None)
    if w is None or w.get("log10_required_width") is None:
        return _untestable(
            name,
            paper,
            null,
            alt,
            ref,
            "the width requirement is undefined here (no finite condition number)",
            "kappa",
            command,
            warns,
            n_seeds=0,
        )
    val = float(w["log10_required_width"])
    lo, hi = w.get("log10_interval") or [val, val]
    iv = Interval(val, lo, hi, w.get("interval_method") or "float64 round-off bound", CONFIDENCE, 0)
    verdict, reason = decide(iv, ref, "above", 0, seed_based=False)
    where = (
        f"at the numerical rank {w.get('rank')} (kappa_d itself is infinite: G is rank deficient, so the formula "
        "at min(n, d) asks for an infinite width)"
        if deficient
        else "at kappa_d"
    )
    why = f"log10 m = {val:.1f} {where}, {val - ref:.1f} orders beyond 1e{ref:g}; {reason}"
    return _row(
        name,
        paper,
        null,
        alt,
        ref,
        f"log10 m = {_fmt(val)} ({w.get('label')})",
        iv,
        verdict,
        why,
        "kappa",
        command,
        warns,
        n_seeds=0,
    )


# ----------------------------------------------------------------------------- ntk-distance
#: Fewest widths a per-seed log-log slope is fitted over once widths at chance are left out.
MIN_SLOPE_WIDTHS = 3


def _loglog_slope(widths: list, values: list) -> float:
    """Least-squares slope of log(value) on log(width) (ntk-distance's per-seed slope)."""
    xs = [math.log(w) for w in widths]
    ys = [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _slopes(r: dict, arch: str, drop: frozenset = frozenset()) -> tuple[list, list, list, list]:
    """(seeds, per-seed slopes, cells at chance, widths used) of one model.

    Every cell (model, width, seed) is judged on its own training accuracy. A width at which
    any seed trained to chance is left out *for every seed*, so all slopes span the same widths
    and every seed is kept; the slopes are refitted over the remaining widths (at least
    :data:`MIN_SLOPE_WIDTHS`, else no slope). With no cell at chance they are the run's own.
    ``drop``: widths to leave out as well (a paired comparison uses the widths both models keep)."""
    seeds = list((r.get("config") or {}).get("seeds") or [])
    c, n = r.get("n_classes"), r.get("n_train")
    cells = [x for x in r.get("cells") or [] if x.get("model") == arch]
    at_chance = [x for x in cells if _chance(x.get("net_train_acc"), c, n)]
    dropped = {x.get("width") for x in at_chance} | set(drop)
    widths = sorted({x.get("width") for x in cells} - dropped)
    if not dropped:
        slopes = list(((r.get("models") or {}).get(arch) or {}).get("slope_per_seed") or [])
        if len(seeds) == len(slopes):
            keep = [(s, v) for s, v in zip(seeds, slopes) if v is not None and math.isfinite(v)]
            return [s for s, _ in keep], [v for _, v in keep], [], widths
    if len(widths) < MIN_SLOPE_WIDTHS:
        return [], [], at_chance, widths
    out_seeds, out = [], []
    for s in seeds:
        mine = {x.get("width"): x.get("distance_rms") for x in cells if x.get("seed") == s}
        vals = [mine.get(w) for w in widths]
        if all(v is not None and math.isfinite(v) and v > 0 for v in vals):
            out_seeds.append(s)
            out.append(_loglog_slope(widths, vals))
    return out_seeds, out, at_chance, widths


def _over(chance_cells: list, widths: list) -> str:
    """ ", widths a, b, c" when widths were left out (the slopes span only these), else ""."""
    return f", widths {', '.join(map(str, widths))}" if chance_cells else ""


def _chance_text(arch: str, cells: list, widths: list) -> str:
    dropped = sorted({x.get("width") for x in cells})
    return (
        f"{len(cells)} {arch} cell(s) trained to chance accuracy: "
        + ", ".join(
            f"width {x.get('width')} seed {x.get('seed')} ({100 * (x.get('net_train_acc') or 0):.0f} %)"
            for x in cells[:6]
        )
        + f"; width(s) {', '.join(map(str, dropped))} left out for every seed"
        + (
            f", slopes refitted over widths {', '.join(map(str, widths))}"
            if len(widths) >= MIN_SLOPE_WIDTHS
            else f", too few widths left (fewer than {MIN_SLOPE_WIDTHS}) for a slope"
        )
    )


def claim_ntk(report: dict, command: str, slope_margin: float = SLOPE_MARGIN) -> list[ClaimRow]:
    r = report["results"]
    warns = _run_warnings(report)
    rows = []
    rs, rv, rchance, rwidths = _slopes(r, "relu")
    as_, av, achance, awidths = _slopes(r, "attn")
    n_total = len((r.get("config") or {}).get("seeds") or [])
    # 1. 2L-ReLU approaches its predictor
    w1 = warns + ([_chance_text("relu", rchance, rwidths)] if rchance else [])
    iv = mean_interval(rv)
    name = "2L-ReLU approaches its NTK predictor as width grows"
    null, alt = "log-log slope of the distance vs width >= 0 (no approach)", "slope < 0 (the distance falls with width)"
    untestable = (
        None
        if rv
        else f"fewer than {MIN_SLOPE_WIDTHS} widths where every seed of 2L-ReLU trained above chance"
        if rchance
        else "no finished cells for 2L-ReLU"
    )
    claim = (name, "distance falls monotonically with width", null, alt, 0.0)
    measured = f"slope {iv.text()} over {iv.n} of {n_total} seeds{_over(rchance, rwidths)} (kernel regime about -0.5)"
    rows.append(_decided(claim, measured, iv, "below", "ntk", command, w1, rv, untestable))
    # 2. MLP-Attn does not approach (tested against a margin, never against 0)
    w2 = warns + ([_chance_text("attn", achance, awidths)] if achance else [])
    iva = mean_interval(av)
    name = "MLP-Attn does not approach its NTK predictor as width grows (non-convergent NTK dynamics)"
    null = f"slope <= -{slope_margin:g} (it approaches at a non-negligible rate)"
    alt = f"slope > -{slope_margin:g} (flat or rising: no approach)"
    untestable = (
        None
        if av
        else f"fewer than {MIN_SLOPE_WIDTHS} widths where every seed of MLP-Attn trained above "
        "chance (a flat distance of a model that learned nothing is no evidence)"
        if achance
        else "no finished cells for MLP-Attn"
    )
    claim = (name, "non-monotone on MNIST, rising on CIFAR-10", null, alt, -slope_margin)
    measured = f"slope {iva.text()} over {iva.n} of {n_total} seeds{_over(achance, awidths)}"
    rows.append(_decided(claim, measured, iva, "above", "ntk", command, w2, av, untestable))
    # 3. attention approaches more slowly than ReLU (paired by seed, over the widths both keep)
    both_drop = frozenset({x.get("width") for x in rchance + achance})
    if both_drop:
        rs, rv, _, _ = _slopes(r, "relu", both_drop)
        as_, av, _, _ = _slopes(r, "attn", both_drop)
    common = sorted(set(rs) & set(as_))
    da = [av[as_.index(s)] for s in common]
    dr = [rv[rs.index(s)] for s in common]
    ivd = difference_interval(da, dr)
    name = "MLP-Attn approaches its NTK predictor more slowly than 2L-ReLU"
    null, alt = "slope(attn) - slope(relu) <= 0", "slope(attn) - slope(relu) > 0"
    untestable = (
        None if common else f"fewer than {MIN_SLOPE_WIDTHS} widths where both models trained above chance in every seed"
    )
    claim = (name, "attention stays farther from its kernel regime", null, alt, 0.0)
    measured = f"slope difference {ivd.text()} over {ivd.n} paired seeds" + (
        f", widths {', '.join(map(str, sorted({x.get('width') for x in r.get('cells') or []} - both_drop)))}"
        if both_drop
        else ""
    )
    per_seed = [a - b for a, b in zip(da, dr)]
    rows.append(
        _decided(
            claim, measured, ivd, "above", "ntk", command, w1 + [w for w in w2 if w not in w1], per_seed, untestable
        )
    )
    return rows


# ----------------------------------------------------------------------------- malleability
def _main_cell(r: dict) -> tuple[str, float] | None:
    cfg = r.get("config") or {}
    attack = next((a for a in cfg.get("attacks") or [] if a not in ("none", "random", "sign")), None)
    eps = (cfg.get("eps") or [None])[0]
    return (attack, eps) if attack is not None else None


def _malleability_numbers(report: dict) -> dict:
    r = report["results"]
    cell = _main_cell(r)
    if cell is None:
        return {"error": "no adversarial attack in the run"}
    attack, eps = cell
    damping = ((r.get("config") or {}).get("damping") or [None])[0]

    def match(row):
        return (
            row.get("attack") == attack
            and row.get("eps") is not None
            and eps is not None
            and math.isclose(float(row["eps"]), float(eps))
            and row.get("damping") == damping
        )

    flips = {row["model"]: row for row in r.get("summary") or [] if match(row)}
    ratio = next(
        (
            row
            for row in r.get("ratios") or []
            if match(row) and row.get("numerator") == "attn" and row.get("denominator") == "relu"
        ),
        None,
    )
    n, c = r.get("n_train"), _n_classes(r)
    at_chance = []  # each clean training judged on its own accuracy
    for row in r.get("training") or []:
        if row.get("role") == "clean" and _chance(row.get("train_accuracy"), c, n or 0):
            at_chance.append(f"{row['model']} seed {row.get('seed')} ({100 * row['train_accuracy']:.0f} %)")
    top_k = (r.get("config") or {}).get("top_k")
    return {
        "attack": attack,
        "eps": eps,
        "damping": damping,
        "flips": flips,
        "ratio": ratio,
        "at_chance": at_chance,
        "top_k": top_k,
    }


def _floor_reading(row: dict) -> bool | None:
    floors = (row or {}).get("floors") or {}
    rnd = floors.get("sign") or floors.get("random")
    return None if rnd is None else bool(rnd.get("exceeded"))


def _ratio_interval_of(nums: dict) -> tuple[Interval | None, list]:
    """The attn / relu Fieller interval, recomputed from the per-seed flip rates the run recorded."""
    ratio = nums["ratio"] or {}
    a, b = ratio.get("numerator_values"), ratio.get("denominator_values")
    if a is None or b is None:  # a report from before the per-seed values were recorded
        fa = (nums["flips"].get("attn") or {}).get("flip_rate", {}).get("values")
        fr = (nums["flips"].get("relu") or {}).get("flip_rate", {}).get("values")
        if fa is None or fr is None or len(fa) != len(fr):
            return None, []
        a, b = fa, fr
    k = nums.get("top_k")
    iv = ratio_interval(a, b, CONFIDENCE, trials=(k, k) if k else None)
    per_seed = [{"attn": x, "relu": y} for x, y in zip(a, b)]
    return iv, per_seed


def claim_malleability(report: dict, command: str) -> ClaimRow:
    nums = _malleability_numbers(report)
    warns = _run_warnings(report)
    name = "attention is more malleable: attn / relu flip-rate ratio > 1"
    paper = "MNIST PGD eps 0.3: MLP-Attn 28.9 %, 2L-ReLU 3.3 %; 2-9x overall"
    null, alt = "attn / relu ratio of mean flip rates <= 1", "ratio > 1, and attn's attack beats the noise control"
    claim = (name, paper, null, alt, 1.0)  # what is tested: the first arguments of every row below
    if "error" in nums:
        return _untestable(*claim, nums["error"], "malleability", command, warns)
    iv, per_seed = _ratio_interval_of(nums)
    fr = {m: (nums["flips"].get(m) or {}).get("flip_rate", {}).get("mean") for m in ("relu", "attn")}
    measured = (
        f"{nums['attack']} eps {nums['eps']}: attn {_fmt(fr['attn'])}, relu {_fmt(fr['relu'])}, ratio "
        f"{'n/a' if iv is None else iv.text()}"
    )
    gate = (nums["ratio"] or {}).get("loss_gate") or {}
    above = {m: _floor_reading(nums["flips"].get(m)) for m in ("relu", "attn")}
    why = None
    if nums["at_chance"]:
        why = f"trained to chance accuracy: {', '.join(nums['at_chance'][:6])}"
    elif gate.get("comparable") is False:
        why = (
            f"the models' mean training losses ({_fmt(gate.get('numerator_loss'))} attn vs "
            f"{_fmt(gate.get('denominator_loss'))} relu) differ by more than {gate.get('factor')}x: the ratio "
            "compares two training outcomes; rerun with --match-loss"
        )
    if why is not None:
        return _untestable(*claim, why, "malleability", command, warns, measured=measured, iv=iv, per_seed=per_seed)
    if iv is None:
        why = "no per-seed flip rates to build an interval from"
        return _row(*claim, measured, None, NOT_RESOLVED, why, "malleability", command, warns)
    if iv.estimate is None and iv.low is not None:
        # the denominator's mean is 0: no point estimate, but the interval still carries the verdict
        iv = Interval(math.inf, iv.low, iv.high, iv.method, iv.confidence, iv.n, iv.note)
    verdict, reason = decide(iv, 1.0, "above", iv.n)
    if iv.estimate == math.inf:
        iv = Interval(None, iv.low, iv.high, iv.method, iv.confidence, iv.n, iv.note)
    if verdict == SUPPORTED and above["attn"] is None:
        verdict, reason = NOT_RESOLVED, reason + ", but the run has no noise control for attn's attack to beat"
    elif verdict == CONTRADICTED and above["relu"] is None:
        verdict, reason = NOT_RESOLVED, reason + ", but the run has no noise control for relu's attack to beat"
    elif verdict == SUPPORTED and above["attn"] is False:
        verdict, reason = (
            NOT_RESOLVED,
            reason + ", but attn's attacked flip rate is not beyond its random-noise control",
        )
    elif verdict == CONTRADICTED and above["relu"] is False:
        verdict, reason = (
            NOT_RESOLVED,
            reason + ", but relu's attacked flip rate is not beyond its random-noise control",
        )
    if iv.note:
        reason += f" ({iv.note})"
    row_warns = warns + _dispersion_warnings(per_seed, nums.get("top_k"))
    return _row(*claim, measured, iv, verdict, reason, "malleability", command, row_warns, per_seed=per_seed)


#: Seed dispersion rho = Var(p_seed) / (mu (1 - mu)) above which the flip-rate intervals were
#: measured to undercover (benchmarks/bench_coverage.py, docs/findings.md).
RHO_WARN = 0.1


def _dispersion_warnings(per_seed: list, top_k: int | None) -> list[str]:
    """A warning per model whose per-seed flip rates vary far beyond binomial noise: the
    moment estimate rho = (s^2 - m (1 - m) / K) / (m (1 - m)) above :data:`RHO_WARN`, where the
    simulated coverage of Fieller's interval fell to 0.78-0.86 and a true ratio of 1 read as
    above 1 in up to 20 % of runs (zero-inflated denominators)."""
    out: list[str] = []
    if not per_seed or not top_k or len(per_seed) < 2:
        return out
    for model in ("attn", "relu"):
        vals = [float(r[model]) for r in per_seed if r.get(model) is not None]
        if len(vals) < 2:
            continue
        m = sum(vals) / len(vals)
        if not 0 < m < 1:
            continue
        s2 = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
        rho = (s2 - m * (1 - m) / top_k) / (m * (1 - m))
        if rho > RHO_WARN:
            out.append(
                f"{model}'s per-seed flip rates ({', '.join(f'{v:.3g}' for v in vals)}) vary far beyond binomial "
                f"noise (dispersion rho ~ {rho:.2f} > {RHO_WARN:g}); in simulation Fieller's interval covers only "
                "0.78-0.86 there and a true ratio of 1 can read as above 1 in up to 20 % of runs "
                "(docs/findings.md): read this row's interval as optimistic"
            )
    return out


# ----------------------------------------------------------------------------- landscape
def _landscape_pairs(r: dict) -> tuple[list[dict], list[str]]:
    """Per seed: relu's and attn's lambda_max and trace, kept only where both trained above
    chance and their training losses are within 10 % (why each seed was left out)."""
    models = r.get("models") or {}
    c = _n_classes(r)
    recs = {}
    for m in ("relu", "attn"):
        entry = models.get(m) or {}
        vals = ((entry.get("seeds") or {}).get("values")) or [
            {
                "seed": 0,
                "loss": entry.get("loss"),
                "accuracy": entry.get("accuracy"),
                "lambda_max": ((entry.get("top_eigenvalues") or {}).get("eigenvalues") or [None])[0],
                "trace": (entry.get("trace") or {}).get("estimate"),
            }
        ]
        recs[m] = {v.get("seed"): (v, entry.get("n_samples")) for v in vals}
    pairs, dropped = [], []
    for s in sorted(set(recs.get("relu", {})) & set(recs.get("attn", {})), key=lambda x: (x is None, x)):
        (vr, n), (va, _) = recs["relu"][s], recs["attn"][s]
        chance = [m for m, v in (("relu", vr), ("attn", va)) if _chance(v.get("accuracy"), c, n)]
        if chance:
            dropped.append(f"seed {s}: {', '.join(chance)} at chance accuracy")
            continue
        lr_, la = vr.get("loss"), va.get("loss")
        if lr_ is None or la is None or min(lr_, la) <= 0 or max(lr_, la) / min(lr_, la) > LANDSCAPE_LOSS_RATIO:
            dropped.append(
                f"seed {s}: training losses {_fmt(lr_)} (relu) vs {_fmt(la)} (attn) differ by more than 10 %"
            )
            continue
        pairs.append({"seed": s, "relu": vr, "attn": va})
    return pairs, dropped


def claim_landscape(report: dict, command: str) -> list[ClaimRow]:
    r = report["results"]
    warns = _run_warnings(report)
    paper = "2L-ReLU sharp, narrow minima; MLP-Attn wider, flatter basins"
    models = r.get("models") or {}
    names = (
        "2L-ReLU ends in sharper minima than MLP-Attn: higher top Hessian eigenvalue",
        "2L-ReLU ends in sharper minima than MLP-Attn: higher Hessian trace",
    )
    nulls = (
        ("log(lambda_max relu / lambda_max attn) <= 0", "log ratio > 0"),
        ("trace(relu) - trace(attn) <= 0", "trace difference > 0"),
    )
    if models.get("relu") is None or models.get("attn") is None:
        return [
            _untestable(n, paper, h0, h1, 0.0, "the run did not train both models", "landscape", command, warns)
            for n, (h0, h1) in zip(names, nulls)
        ]
    pairs, dropped = _landscape_pairs(r)
    row_warns = warns + [f"left out of the comparison: {d}" for d in dropped]
    no_pairs = (
        "no seed where both models trained above chance to training losses within 10 % of each "
        "other (sharpness at different losses is not comparable; rerun with --match-loss)"
        + (f": {'; '.join(dropped[:3])}" if dropped else "")
    )
    out = []
    for name, (h0, h1), key in zip(names, nulls, ("lambda_max", "trace")):
        if not pairs:
            out.append(_untestable(name, paper, h0, h1, 0.0, no_pairs, "landscape", command, row_warns))
            continue
        if key == "lambda_max":
            per = [
                math.log(p["relu"]["lambda_max"] / p["attn"]["lambda_max"])
                for p in pairs
                if (p["relu"].get("lambda_max") or 0) > 0 and (p["attn"].get("lambda_max") or 0) > 0
            ]
            iv = mean_interval(per)
            iv = Interval(iv.estimate, iv.low, iv.high, "paired student-t (log ratio)", iv.confidence, iv.n, iv.note)
            measured = (
                f"log(lambda_max relu / attn) {iv.text()} (ratio {_fmt(math.exp(iv.estimate)) if iv.estimate is not None else 'n/a'}) "
                f"over {iv.n} seeds"
            )
        else:
            per = [
                p["relu"]["trace"] - p["attn"]["trace"]
                for p in pairs
                if p["relu"].get("trace") is not None and p["attn"].get("trace") is not None
            ]
            iv = mean_interval(per)
            iv = Interval(iv.estimate, iv.low, iv.high, "paired student-t", iv.confidence, iv.n, iv.note)
            measured = f"trace(relu) - trace(attn) {iv.text()} over {iv.n} seeds"
        verdict, reason = decide(iv, 0.0, "above", iv.n)
        out.append(
            _row(name, paper, h0, h1, 0.0, measured, iv, verdict, reason, "landscape", command, row_warns, per_seed=per)
        )
    return out


# ----------------------------------------------------------------------------- the dual implication
def claim_alignment(report: dict, command: str) -> list[ClaimRow]:
    """The paper's other half: the data-dependent kernel lowers the approximation error on
    targets aligned with the data's principal modes (more than on other targets)."""
    r = report["results"]
    warns = _run_warnings(report)
    paper = "the same data-dependent kernel reduces approximation error when the target aligns with the principal modes"
    out = []
    contrasts = {(row.get("quantity"), row.get("target")): row for row in r.get("contrast") or []}
    summary = {(row.get("quantity"), row.get("target")): row for row in r.get("summary") or []}

    def interval_of(row: dict) -> Interval:
        per = row.get("per_seed") or []
        iv = mean_interval(per)
        return Interval(
            iv.estimate, iv.low, iv.high, row.get("interval_method") or "paired student-t", iv.confidence, iv.n, iv.note
        )

    specs = [
        (
            "contrast",
            "kernel",
            "attention's kernel-regression advantage is larger on principal-direction targets than on "
            "random-direction ones",
            "advantage(principal) - advantage(random) <= 0",
            "the contrast > 0",
        ),
        (
            "summary",
            "principal",
            "on principal-direction targets MLP-Attn's kernel has the lower approximation error",
            "err(relu) - err(attn) <= 0",
            "err(relu) - err(attn) > 0",
        ),
        (
            "summary",
            "labels",
            "on the real labels MLP-Attn's kernel has the lower approximation error",
            "err(relu) - err(attn) <= 0",
            "err(relu) - err(attn) > 0",
        ),
    ]
    for kind, which, name, h0, h1 in specs:
        table = contrasts if kind == "contrast" else summary
        row = _find_alignment_row(table, which, kind)
        if row is None:
            out.append(
                _untestable(name, paper, h0, h1, 0.0, "the run reported no such quantity", "alignment", command, warns)
            )
            continue
        iv = interval_of(row)
        verdict, reason = decide(iv, float(row.get("null_value") or 0.0), "above", iv.n)
        extra = row.get("warnings") or []
        out.append(
            _row(
                name,
                paper,
                h0,
                h1,
                float(row.get("null_value") or 0.0),
                f"{row.get('quantity')} ({row.get('target')}): {iv.text()} over {iv.n} seeds",
                iv,
                verdict,
                reason,
                "alignment",
                command,
                warns + list(extra),
                per_seed=row.get("per_seed") or [],
            )
        )
    return out


def _find_alignment_row(table: dict, which: str, kind: str) -> dict | None:
    """The kernel-error row of ``which`` target (summary) or the principal-vs-random kernel contrast."""
    for (quantity, target), row in table.items():
        q = str(quantity or "")
        if "kernel" not in q or "cka" in q.lower():
            continue
        t = str(target or "")
        if kind == "contrast" and "principal" in t and "random" in t:
            return row
        if kind == "summary" and t == which:
            return row
    return None


# ----------------------------------------------------------------------------- variants and scoring
def variant_row(name: str, report: dict | None, command: str, error: str | None) -> VariantRow:
    if report is None:
        return VariantRow(
            name, command.split(" --seed ")[-1], None, None, None, None, "none", 0, {}, None, "n/a", command, [], error
        )
    nums = _malleability_numbers(report)
    warns = _run_warnings(report)
    if "error" in nums:
        return VariantRow(name, "", None, None, None, None, "none", 0, {}, None, "n/a", command, warns, nums["error"])
    iv, _ = _ratio_interval_of(nums)
    fr = {m: (nums["flips"].get(m) or {}).get("flip_rate", {}).get("mean") for m in ("relu", "attn")}
    above = {m: _floor_reading(nums["flips"].get(m)) for m in ("relu", "attn")}
    comparable = ((nums["ratio"] or {}).get("loss_gate") or {}).get("comparable")
    if nums["at_chance"]:
        reading = "a model at chance"
    elif comparable is False:
        reading = "training losses not comparable"
    elif iv is None or iv.estimate is None and iv.low is None:
        reading = "undefined ratio"
    elif iv.n < MIN_SEEDS:
        reading = f"fewer than {MIN_SEEDS} seeds"
    elif iv.side(1.0) == "above":
        reading = {
            True: "attn more malleable",
            False: "within the noise control",
            None: "attn more sensitive (no noise control)",
        }[above["attn"]]
    elif iv.side(1.0) == "below":
        reading = {
            True: "relu more malleable",
            False: "within the noise control",
            None: "relu more sensitive (no noise control)",
        }[above["relu"]]
    else:
        reading = "not resolved"
    return VariantRow(
        name,
        "",
        fr["relu"],
        fr["attn"],
        None if iv is None else iv.estimate,
        None if iv is None else iv.bounds,
        "none" if iv is None else iv.method,
        0 if iv is None else iv.n,
        above,
        comparable,
        reading,
        command,
        warns,
    )


TITLES = {
    "kappa": ["kappa(G~) = kappa(G)^3", "the width linearized attention needs is beyond any trainable width"],
    "ntk": [
        "2L-ReLU approaches its NTK predictor",
        "MLP-Attn does not approach its NTK predictor",
        "MLP-Attn approaches its NTK predictor more slowly than 2L-ReLU",
    ],
    "malleability": ["attention is more malleable"],
    "landscape": ["2L-ReLU sharper: top Hessian eigenvalue", "2L-ReLU sharper: Hessian trace"],
    "alignment": [
        "attention's kernel advantage is larger on principal-direction targets",
        "MLP-Attn's kernel has the lower error on principal-direction targets",
        "MLP-Attn's kernel has the lower error on the real labels",
    ],
}


def score(
    mode: str,
    reports: dict[str, dict | None],
    errors: dict[str, str],
    commands: dict[str, str],
    variants: list[tuple[str, str]],
    slope_margin: float = SLOPE_MARGIN,
) -> ClaimsResult:
    """Every claim row and variant row from the runs' reports (a failed run gives 'not testable here')."""
    claims: list[ClaimRow] = []
    readers: dict[str, Callable[[dict, str], ClaimRow | list[ClaimRow]]] = {
        "kappa": claim_kappa,
        "ntk": lambda rep, cmd: claim_ntk(rep, cmd, slope_margin),
        "malleability": claim_malleability,
        "landscape": claim_landscape,
        "alignment": claim_alignment,
    }
    for rid, read in readers.items():
        if rid not in commands:
            continue
        if reports.get(rid) is None:
            for title in TITLES[rid]:
                claims.append(
                    _untestable(title, "", "", "", None, f"the run failed: {errors.get(rid)}", rid, commands[rid], [])
                )
            continue
        report = reports[rid]
        assert report is not None  # checked above
        got = read(report, commands[rid])
        claims.extend(got if isinstance(got, list) else [got])
    rows = [variant_row(name, reports.get(rid), commands[rid], errors.get(rid)) for name, rid in variants]
    return ClaimsResult(mode, claims, rows)
