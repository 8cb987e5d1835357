"""Warnings and verdicts: what a reader may conclude from the summaries, in words.

Each adversarial flip rate is read against its floors (above only when the intervals do not
overlap), each ratio against the loss gate, and a model that did not train makes no claim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attnaudit.analyses.influence.influence import damping_label
from attnaudit.analyses.malleability.aggregate import untrained_text
from attnaudit.analyses.malleability.attacks import ADVERSARIAL, TOKEN_CONTROL
from attnaudit.analyses.malleability.config import MalleabilityConfig
from attnaudit.core.stats import t_quantile

if TYPE_CHECKING:
    from collections.abc import Mapping


def run_warnings(
    config: MalleabilityConfig, training: list[dict], infl_warnings: dict[str, int], targets: Mapping[str, float | None]
) -> list[str]:
    """Warnings about the trainings (losses far apart, match_loss targets ``targets`` missed), the
    number of seeds, settings that do not apply, and the influence runs' own (counted)."""
    out = []
    clean = [r for r in training if r["role"] == "clean"]
    means = {
        m: float(np.mean([r["final_loss"] for r in clean if r["model"] == m]))
        for m in config.models
        if any(r["model"] == m for r in clean)
    }
    if len(means) > 1:
        lo, hi = min(means.values()), max(means.values())
        if lo > 0 and hi / lo > config.loss_gap_factor:
            accs = {m: float(np.mean([r["train_accuracy"] for r in clean if r["model"] == m])) for m in config.models}
            desc = ", ".join(f"{m} {v:.3g} (train accuracy {100 * accs[m]:.0f}%)" for m, v in means.items())
            out.append(
                f"models are compared at very different training losses ({desc}; ratio {hi / lo:.1f} > "
                f"{config.loss_gap_factor:g}); "
                + (
                    "train the checkpoints to comparable losses before comparing their flip rates"
                    if config.saved_models
                    else "pass --match-loss to train each to the same loss"
                )
            )
    if config.match_loss is not None:
        missed = [r for r in training if r["reached_match_loss"] is False]
        if missed:
            worst = max(missed, key=lambda r: r["final_loss"])
            target = targets.get(worst["model"])
            out.append(
                f"{len(missed)} of {len(training)} trainings did not reach --match-loss "
                f"{'-' if target is None else format(target, 'g')} within "
                f"{config.steps} steps (worst: {worst['model']} {worst['role']} seed {worst['seed']} at {worst['final_loss']:.3g}); "
                "raise --steps or --lr"
            )
    if len(config.seeds) == 1:
        out.append("one seed: no spread and a degenerate interval; pass several --seeds for a confidence interval")
    elif len(config.seeds) < 5:
        out.append(
            f"{len(config.seeds)} seeds: Student-t / Fieller intervals over so few seeds are wide (t(0.975, "
            f"{len(config.seeds) - 1}) = {t_quantile(0.95, len(config.seeds) - 1):.2f}); fewer than 3 seeds never resolve a verdict"
            if len(config.seeds) < 3
            else f"{len(config.seeds)} seeds: Student-t / Fieller intervals over so few seeds are wide (t(0.975, "
            f"{len(config.seeds) - 1}) = {t_quantile(0.95, len(config.seeds) - 1):.2f})"
        )
    if config.protocol == "static" and "attn" in config.models and config.attn_context != "perturbed":
        out.append("--attn-context applies to --protocol retrain only; static keeps the clean model and its context")
    for w, count in infl_warnings.items():
        out.append(f"influence ({count}x): {w}")
    return out


def summary_warnings(
    config: MalleabilityConfig,
    summary: list[dict],
    status: list[dict],
    failed: list[dict],
    n_cells: int,
    bad_seeds: set,
) -> list[str]:
    """Warnings about the summaries: controls that reproduced the clean run, seeds counted once
    (bitwise the same inputs), models that did not train, and failed cells."""
    out = []
    for row in summary:
        if row.get("degenerate"):
            out.append(
                f"{row['model']}: the {row['attack']} control reproduced the clean influence run bit for bit ("
                + (
                    "the data order changes nothing when one batch holds every row: lower --finetune-batch-size"
                    if config.protocol == "finetune"
                    else "the other initialisation trained to the same model"
                )
                + "), so its flip rate is 0 by construction and is not used as a floor"
            )
        if row.get("same_inputs"):
            again = ", ".join(str(c["seed"]) for c in row["same_inputs"])
            out.append(
                f"{row['model']}, {row['attack']}"
                + (f"@{row['eps']:g}" if row["eps"] is not None and row["attack"] != config.control else "")
                + f": seed(s) {again} ran on bitwise the inputs of seed {row['same_inputs'][0]['as_seed']} (a "
                "deterministic comparison: the same model, rows and perturbation), so they are counted once; its "
                f"summary rests on {len(row['seeds'])} distinct replicate(s)"
            )
    for st in status:
        if st["untrained"]:
            out.append(
                untrained_text(st) + "; every verdict about it makes no claim (train it longer, raise --lr, "
                "or scale the inputs)"
            )
    if failed:
        out.append(
            f"{len(failed)} of {n_cells} cells failed (listed in failed_cells); their seeds "
            f"({', '.join(map(str, sorted(bad_seeds)))}) are left out of the summaries: "
            + "; ".join(f"{f['cell']}: {f['error']}" for f in failed[:3])
        )
    return out


def ratio_interval_text(r: dict) -> str:
    """ "[1.20, 4.00]", with +inf for an unbounded upper end and n/a where there is no interval."""
    if r.get("ci_high") is None and r.get("unbounded_high"):
        return f"[{r.get('ci_low') or 0.0:.2f}, +inf]"
    if r.get("ci_low") is None or r.get("ci_high") is None:
        return "n/a"
    return f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def ratio_text(r: dict) -> str:
    """ "2.10 [1.20, 4.00]" (undefined when the denominator's mean is 0)."""
    est = f"undefined ({r['denominator']} flip rate is 0)" if r.get("ratio") is None else f"{r['ratio']:.2f}"
    return f"{est} {ratio_interval_text(r)}"


def interval_text(s: dict, pct: bool = True) -> str:
    if s["mean"] is None:
        return "n/a"
    f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.3g}")
    if s["ci_low"] is None or s["ci_high"] is None:
        return f"{f(s['mean'])} (no interval from {s['n']} seed)"
    return f"{f(s['mean'])} [{f(s['ci_low'])}, {f(s['ci_high'])}]"


def verdicts(config, summary, ratios, sensitivity, exceeded, status=None) -> list[str]:
    out = []
    status = {r["model"]: r for r in (status or [])}
    untrained = [m for m in config.models if status.get(m, {}).get("untrained")]
    for m in untrained:
        out.append(
            untrained_text(status[m]) + ": its flip rates are no evidence of stability or malleability; "
            "no claim is made about it"
        )
    for row in summary:
        if row["attack"] not in ADVERSARIAL:
            continue
        rc = config.random_control_for(row["attack"])
        floors = row.get("floors", {})
        parts = []
        for name in ("random", config.control):
            if name in floors:
                f = floors[name]
                label = (f"{rc}-noise" if rc != TOKEN_CONTROL else "random-swap") if name == "random" and rc else name
                parts.append(
                    f"{'above' if f['exceeded'] else 'not clearly above'} the {label} floor {100 * f['mean']:.1f}%"
                )
        text = (
            f"{row['model']} {row['attack']} eps={row['eps']:g} damping={damping_label(row['damping'])}: flip rate "
            f"{interval_text(row['flip_rate'])}"
        )
        if row["model"] in untrained:
            out.append(text + f" -- {row['model']} did not train: no claim")
            continue
        out.append(text + (f", {'; '.join(parts)}" if parts else ""))
        if len(config.top_ks) > 1:
            out.append(
                f"{row['model']} {row['attack']} eps={row['eps']:g} damping={damping_label(row['damping'])}: flip rate by "
                "top-k: " + ", ".join(f"k={e['top_k']} {interval_text(e['flip_rate'])}" for e in row["by_top_k"])
            )
    for r in ratios:
        if r["attack"] not in ADVERSARIAL:
            continue
        text = ratio_text(r)
        gate = r.get("loss_gate") or {}
        if gate.get("comparable") is False:
            text += (
                f" -- not compared: mean training losses {gate['numerator_loss']:.3g} vs {gate['denominator_loss']:.3g} "
                f"differ by more than {gate['factor']:g}x (train both to one loss, --match-loss)"
            )
        head = f"flip-rate ratio {r['numerator']}/{r['denominator']} ({r['attack']} eps={r['eps']:g} damping={damping_label(r['damping'])}): "
        bad = [m for m in (r["numerator"], r["denominator"]) if m in untrained]
        if bad:
            out.append(head + f"{text} -- {', '.join(bad)} did not train: no claim about which model is more malleable")
        else:
            out.append(head + text)
    if len(config.models) > 1 and (len(config.eps) > 1 or len(config.damping) > 1):
        if untrained:
            out.append(f"no ranking of models is read across eps/damping: {', '.join(untrained)} did not train")
        elif sensitivity["ranking_stable"]:
            out.append("the ranking of models by flip rate is the same at every eps and damping tried")
        else:
            flips = [s["attack"] for s in sensitivity["by_attack"] if not s["ranking_stable"]]
            out.append(
                f"the ranking of models by mean flip rate changes across eps/damping for: {', '.join(flips)} "
                "(compare the intervals before reading a reversal as real)"
            )
    for e in exceeded:
        out.append(
            f"FAIL: {e['model']} under {e['attack']} (eps={e['eps']:g}, damping={damping_label(e['damping'])}) has flip rate "
            f"{100 * e['flip_rate']:.1f}% > --max-flip-rate {100 * config.max_flip_rate:.1f}%"
            + (
                f" ({e['model']} did not train: the gate fires on the number, which says nothing about the model)"
                if e["model"] in untrained
                else ""
            )
        )
    return out
