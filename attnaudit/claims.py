"""The claims scorecard: the paper's claims as hypotheses, each tested by one documented run.

``attnaudit claims`` runs the four analyses (through the commands themselves, so every row
has a command line that reproduces it) and reads one verdict per claim:

* **supported**: the measured interval lies on the claim's side;
* **contradicted**: it lies on the other side;
* **not resolved**: the interval straddles the boundary, or a control says the effect is
  inside the noise;
* **not testable here**: the protocol cannot test it on these data (a model at chance, a
  rank-deficient Gram, a comparison whose gate fails), with why.

A second table runs the malleability comparison under protocol variants (eps, damping,
optimizer and loss, input scale) so a reader sees which conclusion survives which choice.
The rules are stated in :data:`RULES` and docs/findings.md; no threshold is tuned to make a
claim come out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import AuditError

SCHEMA = "attnaudit.claims/1"
VERDICTS = ("supported", "contradicted", "not resolved", "not testable here")
MODES = ("quick", "full")
Z95 = 1.959963984540054

RULES = {
    "interval": "slopes: mean +- 2 sd / sqrt(k) over k seeds (the per-seed range when k < 3 is reported too); ratios: "
                "the bootstrap interval of malleability; traces: estimate +- 1.96 stderr",
    "chance": "a model whose training accuracy is below 1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n)) learned nothing; "
              "claims about it are not testable here",
    "comparable": "landscape comparisons need training losses within 10 % of each other",
}


@dataclass(frozen=True)
class RunSpec:
    """One command line of the scorecard."""

    id: str
    command: str
    args: tuple[str, ...]
    purpose: str


@dataclass
class ClaimRow:
    claim: str
    paper: str
    measured: str
    value: float | None
    interval: list | None
    verdict: str
    why: str
    run: str
    command: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class VariantRow:
    variant: str
    options: str
    flip_relu: float | None
    flip_attn: float | None
    ratio: float | None
    interval: list | None
    above_floor: dict
    reading: str
    command: str
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ClaimsResult:
    mode: str
    claims: list[ClaimRow]
    variants: list[VariantRow]
    runs: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def verdicts(self) -> list[str]:
        counts = {v: sum(c.verdict == v for c in self.claims) for v in VERDICTS}
        head = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
        robust = [v for v in self.variants if v.error is None]
        orders = {v.reading for v in robust}
        tail = (f"; the malleability ordering reads the same under all {len(robust)} protocol variants ({orders.pop()})"
                if len(orders) == 1 and robust else
                f"; the malleability ordering changes across the {len(robust)} protocol variants" if robust else "")
        return [f"claims scorecard ({self.mode}): {head}{tail}"] + [f"{c.claim}: {c.verdict.upper()}: {c.why}"
                                                                   for c in self.claims]

    def to_dict(self) -> dict:
        return {"mode": self.mode, "rules": RULES, "claims": [c.to_dict() for c in self.claims],
                "protocol_variants": [v.to_dict() for v in self.variants], "runs": self.runs}


# ----------------------------------------------------------------------------- the plan
def _has_choice(command: str, option: str, value: str) -> bool:
    """Whether this build's command accepts ``--option value`` (variants added by newer options)."""
    from .audit.commands import option_params

    if option.replace("-", "_") not in option_params(command):
        return False
    if option == "preprocess":
        from .data import PREPROCESS

        return value in PREPROCESS
    return True


def plan(mode: str, data_args: list[str], seed: int) -> tuple[list[RunSpec], list[tuple[str, str]]]:
    """The scorecard's runs, and (variant name, run id) of the protocol variants."""
    if mode not in MODES:
        raise AuditError(f"unknown scorecard mode {mode!r}; use --quick or --full")
    preset = "quick" if mode == "quick" else "paper"
    common = [*data_args, "--seed", str(seed)]
    runs = [
        RunSpec("kappa", "kappa", (*common,), "amplification kappa(G~) = kappa(G)^3 and the width scale"),
        RunSpec("ntk", "ntk-distance", ("--preset", preset, *common), "distance to the NTK predictor vs width"),
        RunSpec("malleability", "malleability", ("--preset", preset, *common), "attn / relu flip-rate ratio with controls"),
        RunSpec("landscape", "landscape", ("--preset", preset, *common), "relative sharpness of the minima"),
    ]
    variants = [("preset protocol", "malleability")]
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
        runs.append(RunSpec(rid, "malleability", ("--preset", preset, *common, *args), f"protocol variant: {name}"))
        variants.append((name, rid))
    return runs, variants


# ----------------------------------------------------------------------------- reading the reports
def _interval_of_slopes(per_seed: list) -> tuple[float, float, float] | None:
    vals = [v for v in per_seed or [] if v is not None and math.isfinite(v)]
    if not vals:
        return None
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    half = 2 * sd / math.sqrt(len(vals))
    return mean, mean - half, mean + half


def _chance(acc: float | None, c: int, n: int) -> bool:
    if acc is None or not c or not n:
        return False
    p = 1.0 / c
    return acc < p + max(0.05, 2 * math.sqrt(p * (1 - p) / n))


def _n_classes(results: dict) -> int:
    counts = (results.get("dataset") or {}).get("class_counts") or {}
    return len(counts) or int(results.get("n_classes") or 10)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}"


def claim_kappa(report: dict, command: str) -> list[ClaimRow]:
    r = report["results"]
    amp = r.get("amplification_check") or {}
    gram = r.get("gram") or {}
    verdict_raw = amp.get("verdict")
    if verdict_raw == "verified":
        verdict, why = "supported", (f"measured kappa(G~) matches kappa(G)^3 (relative error "
                                     f"{_fmt(amp.get('relative_error'))} within the error budget)")
    elif verdict_raw == "mismatch":
        verdict, why = "contradicted", "the measured kappa(G~) differs from kappa(G)^3 beyond the float64 error budget"
    else:
        verdict, why = "not resolved", (f"kappa^3 = {_fmt(amp.get('predicted_kappa_cubed'))} is beyond float64's relative "
                                        "precision, so G~ cannot be measured directly; the identity lambda(G~) = lambda(G)^3 "
                                        "is exact algebra (top eigenvalue agrees to "
                                        f"{_fmt(amp.get('top_eigenvalue_relative_error'))})")
    rows = [ClaimRow("kappa(G~) = kappa(G)^3 (linearized attention cubes the condition number)",
                     "exact identity for f_att(X) = X X^T X", f"log10 kappa^3 = {_fmt(amp.get('log10_predicted_kappa_cubed'))}",
                     amp.get("log10_predicted_kappa_cubed"), None, verdict, why, "kappa", command)]
    widths = {("relu" if w["label"].startswith("2L-ReLU") else "attn", "numerical rank" in w["label"]): w
              for w in r.get("width_estimates") or []}
    deficient = bool(gram.get("rank_deficient"))
    relu = widths.get(("relu", deficient)) or {}
    attn = widths.get(("attn", deficient)) or {}
    lr_, la = relu.get("log10_required_width"), attn.get("log10_required_width")
    if lr_ is None or la is None:
        verdict, why = "not testable here", "the width scale is undefined (kappa infinite)"
    else:
        basis = (f"at the numerical rank {gram.get('numerical_rank')} of {gram.get('min_n_d')} (kappa_d itself is infinite: "
                 "the Gram is rank deficient)" if deficient else "with kappa_d")
        verdict = "supported" if la > lr_ and la > 5 else "contradicted"
        why = (f"width scale kappa^6 n ln n: 10^{lr_:.1f} for 2L-ReLU, 10^{la:.1f} with attention ({basis}); far beyond "
               "any trainable width (10^5)" if verdict == "supported" else
               f"the width scale with attention (10^{la:.1f}) is not above the ReLU one (10^{lr_:.1f})")
    rows.append(ClaimRow("attention raises the width the NTK regime needs (m = Omega(kappa^6 n log n))",
                         "m >> 1e24 on MNIST, >> 1e29 on CIFAR-10",
                         f"log10 m: relu {_fmt(lr_)}, attn {_fmt(la)}", la, None, verdict, why, "kappa", command))
    return rows


def claim_ntk(report: dict, command: str) -> list[ClaimRow]:
    r = report["results"]
    models = r.get("models") or {}
    c, n = r.get("n_classes"), r.get("n_train")
    rows = []
    out = {}
    for arch in ("relu", "attn"):
        m = models.get(arch)
        cells = [x for x in r.get("cells") or [] if x.get("model") == arch]
        acc = max((x.get("net_train_acc") or 0.0) for x in cells) if cells else None
        out[arch] = (m, _interval_of_slopes((m or {}).get("slope_per_seed")), _chance(acc, c, n), acc)
    m, iv, chance, acc = out["relu"]
    if m is None or iv is None:
        verdict, why, val = "not testable here", "no finished cells for 2L-ReLU", None
    elif chance:
        verdict, why, val = "not testable here", f"2L-ReLU stayed at chance (train accuracy {acc:.0%})", iv[0]
    elif iv[2] < 0:
        verdict, why, val = "supported", f"slope {iv[0]:.2f} [{iv[1]:.2f}, {iv[2]:.2f}] < 0 (kernel regime about -0.5)", iv[0]
    elif iv[1] > 0:
        verdict, why, val = "contradicted", f"slope {iv[0]:.2f} [{iv[1]:.2f}, {iv[2]:.2f}] > 0: the distance grows", iv[0]
    else:
        verdict, why, val = "not resolved", f"slope {iv[0]:.2f} [{iv[1]:.2f}, {iv[2]:.2f}] includes 0", iv[0]
    rows.append(ClaimRow("2L-ReLU approaches its NTK predictor as width grows", "distance falls monotonically with width",
                         f"log-log slope {_fmt(val)}", val, None if iv is None else [iv[1], iv[2]], verdict, why, "ntk",
                         command))
    ma, iva, chance_a, acc_a = out["attn"]
    if ma is None or iva is None:
        verdict, why, val = "not testable here", "no finished cells for MLP-Attn", None
    elif chance_a:
        verdict, why, val = "not testable here", (f"MLP-Attn stayed at chance (train accuracy {acc_a:.0%}): a small or "
                                                  "flat distance of a model that learned nothing is no evidence"), iva[0]
    else:
        val = iva[0]
        if iva[1] > 0 or (iva[1] <= 0 <= iva[2]):
            verdict = "supported"
            why = f"MLP-Attn slope {iva[0]:.2f} [{iva[1]:.2f}, {iva[2]:.2f}] does not show a fall with width"
        elif iv is not None and not chance and iva[1] > iv[2]:
            verdict = "supported"
            why = (f"MLP-Attn falls ({iva[0]:.2f} [{iva[1]:.2f}, {iva[2]:.2f}]) but clearly more slowly than 2L-ReLU "
                   f"({iv[0]:.2f} [{iv[1]:.2f}, {iv[2]:.2f}]): it stays farther from its kernel regime")
        elif iv is not None and iva[2] < iv[1]:
            verdict = "contradicted"
            why = f"MLP-Attn approaches faster than 2L-ReLU (slopes {iva[0]:.2f} vs {iv[0]:.2f}, intervals apart)"
        else:
            verdict = "not resolved"
            why = (f"MLP-Attn falls (slope {iva[0]:.2f} [{iva[1]:.2f}, {iva[2]:.2f}]) and its interval overlaps "
                   f"2L-ReLU's" + ("" if iv is None else f" ({iv[0]:.2f} [{iv[1]:.2f}, {iv[2]:.2f}])"))
    rows.append(ClaimRow("MLP-Attn stays far from its NTK predictor (non-convergent NTK dynamics)",
                         "non-monotone on MNIST, rising on CIFAR-10", f"log-log slope {_fmt(val)}", val,
                         None if iva is None else [iva[1], iva[2]], verdict, why, "ntk", command))
    return rows


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

    def match(row, key="model"):
        return (row.get("attack") == attack and row.get("eps") is not None and eps is not None
                and math.isclose(float(row["eps"]), float(eps)) and row.get("damping") == damping)

    flips = {row["model"]: row for row in r.get("summary") or [] if match(row)}
    ratio = next((row for row in r.get("ratios") or [] if match(row) and row.get("numerator") == "attn"
                  and row.get("denominator") == "relu"), None)
    training = r.get("training") or []
    n, c = r.get("n_train"), _n_classes(r)
    accs = {}
    for row in training:
        if row.get("role") == "clean":
            accs.setdefault(row["model"], []).append(row.get("train_accuracy"))
    chance = {m: _chance(sum(v) / len(v), c, n or 0) for m, v in accs.items() if v}
    return {"attack": attack, "eps": eps, "damping": damping, "flips": flips, "ratio": ratio, "chance": chance}


def _floor_reading(row: dict) -> bool | None:
    floors = (row or {}).get("floors") or {}
    rnd = floors.get("sign") or floors.get("random")
    return None if rnd is None else bool(rnd.get("exceeded"))


def claim_malleability(report: dict, command: str) -> ClaimRow:
    nums = _malleability_numbers(report)
    name = "attention is more malleable: attn / relu flip-rate ratio > 1"
    paper = "MNIST PGD eps 0.3: MLP-Attn 28.9 %, 2L-ReLU 3.3 %; 2-9x overall"
    if "error" in nums:
        return ClaimRow(name, paper, "n/a", None, None, "not testable here", nums["error"], "malleability", command)
    ratio = nums["ratio"] or {}
    val, lo, hi = ratio.get("ratio"), ratio.get("ci_low"), ratio.get("ci_high")
    fr = {m: (nums["flips"].get(m) or {}).get("flip_rate", {}).get("mean") for m in ("relu", "attn")}
    measured = (f"{nums['attack']} eps {nums['eps']}: attn {_fmt(fr['attn'])}, relu {_fmt(fr['relu'])}, "
                f"ratio {_fmt(val)} [{_fmt(lo)}, {_fmt(hi)}]")
    at_chance = [m for m, v in nums["chance"].items() if v]
    above = {m: _floor_reading(nums["flips"].get(m)) for m in ("relu", "attn")}
    if at_chance:
        verdict, why = "not testable here", f"{', '.join(at_chance)} trained to chance accuracy"
    elif val is None or lo is None or hi is None:
        verdict, why = "not resolved", "the ratio is undefined (a zero flip rate in the denominator across resamples)"
    elif lo > 1 and above["attn"] is False:
        verdict, why = "not resolved", "attn flips more, but not beyond the random-noise control of the same radius"
    elif lo > 1:
        verdict, why = "supported", f"ratio interval [{lo:.2f}, {hi:.2f}] lies above 1 and the attack beats the noise control"
    elif hi < 1 and above["relu"] is False:
        verdict, why = "not resolved", "relu flips more, but not beyond the random-noise control of the same radius"
    elif hi < 1:
        verdict, why = "contradicted", (f"ratio interval [{lo:.2f}, {hi:.2f}] lies below 1 and relu's flips beat the noise "
                                        "control: relu is the more malleable here")
    else:
        verdict, why = "not resolved", f"ratio interval [{lo:.2f}, {hi:.2f}] includes 1"
    return ClaimRow(name, paper, measured, val, [lo, hi], verdict, why, "malleability", command)


def claim_landscape(report: dict, command: str) -> ClaimRow:
    r = report["results"]
    models = r.get("models") or {}
    name = "2L-ReLU ends in sharper minima than MLP-Attn (higher lambda_max and trace)"
    paper = "2L-ReLU sharp, narrow minima; MLP-Attn wider, flatter basins"
    relu, attn = models.get("relu"), models.get("attn")
    if relu is None or attn is None:
        return ClaimRow(name, paper, "n/a", None, None, "not testable here", "the run did not train both models",
                        "landscape", command)
    lam = {m: (models[m].get("top_eigenvalues") or {}).get("eigenvalues", [None])[0] for m in ("relu", "attn")}
    tr = {m: (models[m].get("trace") or {}) for m in ("relu", "attn")}
    loss = {m: models[m].get("loss") for m in ("relu", "attn")}
    acc = {m: models[m].get("accuracy") for m in ("relu", "attn")}
    n = relu.get("n_samples") or 0
    measured = (f"lambda_max relu {_fmt(lam['relu'])} vs attn {_fmt(lam['attn'])}; trace {_fmt(tr['relu'].get('estimate'))} "
                f"vs {_fmt(tr['attn'].get('estimate'))}; loss {_fmt(loss['relu'])} vs {_fmt(loss['attn'])}")
    value = lam["relu"] / lam["attn"] if lam["relu"] and lam["attn"] else None
    at_chance = [m for m in ("relu", "attn") if _chance(acc[m], _n_classes(r), n)]
    if at_chance:
        return ClaimRow(name, paper, measured, value, None, "not testable here",
                        f"{', '.join(at_chance)} trained to chance accuracy (a flat landscape of a model that learned "
                        "nothing is no evidence)", "landscape", command)
    if loss["relu"] is None or loss["attn"] is None or max(loss.values()) > 1.1 * min(loss.values()):
        return ClaimRow(name, paper, measured, value, None, "not testable here",
                        f"the training losses differ by more than 10 % ({_fmt(loss['relu'])} vs {_fmt(loss['attn'])}): "
                        "sharpness at different losses is not comparable; rerun landscape with --match-loss",
                        "landscape", command)
    t_r, t_a = tr["relu"].get("estimate"), tr["attn"].get("estimate")
    se = math.hypot(tr["relu"].get("stderr") or 0.0, tr["attn"].get("stderr") or 0.0)
    diff = None if t_r is None or t_a is None else t_r - t_a
    lam_side = None if value is None else value > 1
    if diff is None or abs(diff) <= Z95 * se:
        verdict, why = "not resolved", f"the trace difference {_fmt(diff)} is within 1.96 standard errors ({_fmt(Z95 * se)})"
    elif (diff > 0) == lam_side:
        verdict = "supported" if lam_side else "contradicted"
        why = (f"both lambda_max (ratio relu/attn {_fmt(value)}) and trace (difference {_fmt(diff)}, > 1.96 se) "
               f"say {'relu' if lam_side else 'attn'} is the sharper")
    else:
        verdict, why = "not resolved", "lambda_max and trace disagree on which minimum is sharper"
    return ClaimRow(name, paper, measured, value, None if diff is None else [diff - Z95 * se, diff + Z95 * se],
                    verdict, why, "landscape", command)


def variant_row(name: str, report: dict | None, command: str, error: str | None) -> VariantRow:
    if report is None:
        return VariantRow(name, command.split(" --seed ")[-1], None, None, None, None, {}, "n/a", command, error)
    nums = _malleability_numbers(report)
    if "error" in nums:
        return VariantRow(name, "", None, None, None, None, {}, "n/a", command, nums["error"])
    ratio = nums["ratio"] or {}
    val, lo, hi = ratio.get("ratio"), ratio.get("ci_low"), ratio.get("ci_high")
    fr = {m: (nums["flips"].get(m) or {}).get("flip_rate", {}).get("mean") for m in ("relu", "attn")}
    above = {m: _floor_reading(nums["flips"].get(m)) for m in ("relu", "attn")}
    if any(nums["chance"].values()):
        reading = "a model at chance"
    elif lo is None or hi is None:
        reading = "undefined ratio"
    elif lo > 1:
        reading = "attn more malleable" if above["attn"] is not False else "within the noise control"
    elif hi < 1:
        reading = "relu more malleable" if above["relu"] is not False else "within the noise control"
    else:
        reading = "not resolved"
    return VariantRow(name, "", fr["relu"], fr["attn"], val, [lo, hi], above, reading, command)


def score(mode: str, reports: dict[str, dict | None], errors: dict[str, str], commands: dict[str, str],
          variants: list[tuple[str, str]]) -> ClaimsResult:
    """Every claim row and variant row from the runs' reports (a failed run gives 'not testable here')."""
    claims: list[ClaimRow] = []
    readers = {"kappa": claim_kappa, "ntk": claim_ntk, "malleability": claim_malleability, "landscape": claim_landscape}
    titles = {"kappa": ["kappa(G~) = kappa(G)^3", "attention raises the NTK width scale"],
              "ntk": ["2L-ReLU approaches its NTK predictor", "MLP-Attn stays far from its NTK predictor"],
              "malleability": ["attention is more malleable"], "landscape": ["2L-ReLU ends in sharper minima"]}
    for rid, read in readers.items():
        if reports.get(rid) is None:
            for title in titles[rid]:
                claims.append(ClaimRow(title, "", "n/a", None, None, "not testable here",
                                       f"the run failed: {errors.get(rid)}", rid, commands[rid]))
            continue
        got = read(reports[rid], commands[rid])
        claims.extend(got if isinstance(got, list) else [got])
    rows = [variant_row(name, reports.get(rid), commands[rid], errors.get(rid)) for name, rid in variants]
    return ClaimsResult(mode, claims, rows)
