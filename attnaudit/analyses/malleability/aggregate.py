"""Aggregation over seeds: per model, attack, eps and damping the summaries of the stability
metrics, the floors every adversarial flip rate is read against (the training-randomness
control and random noise of the same radius), the flip-rate ratios between models (paired by
seed, Fieller), the ranking across eps/damping, the loss gate and which models did not train.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnaudit.analyses.malleability.attacks import ADVERSARIAL
from attnaudit.analyses.malleability.config import LM_LOSS, MalleabilityConfig
from attnaudit.analyses.malleability.stability import distinct_replicates, ratio_summary, summarize, value_at_k


METRICS = ("flip_rate", "spearman", "top_k_overlap", "perturbed_test_accuracy")
#: a language model's stand-ins for the accuracies (it has none): losses and perplexities
LM_METRICS = ("perturbed_test_loss", "perturbed_test_perplexity")
LM_ATTACK_METRICS = (
    "clean_model_loss_on_clean_train",
    "clean_model_loss_on_perturbed_train",
    "clean_model_perplexity_on_clean_train",
    "clean_model_perplexity_on_perturbed_train",
)


def summary_cells(config: MalleabilityConfig) -> list[tuple[str, float | None]]:
    out: list[tuple[str, float | None]] = []
    for a in config.attacks:
        if a == "none":
            out.append((a, 0.0))
        else:
            out.extend((a, e) for e in config.eps)
    if config.controls:
        out.append((config.control, None))
    return out


def aggregate(
    config: MalleabilityConfig, runs: list[dict], controls: list[dict], status: list[dict] | None = None
) -> tuple[list[dict], list[dict]]:
    cf = config.confidence
    top_ks = config.top_ks
    assert top_ks is not None  # MalleabilityConfig.__post_init__ sets it
    shares = {"flip_rate": True, "top_k_overlap": True}
    untrained = {r["model"] for r in (status or []) if r["untrained"]}
    by_key: dict[tuple, dict] = {}
    for attack, eps in summary_cells(config):
        for damping in config.damping:
            for model in config.models:
                if attack == config.control:
                    rows = [r for r in controls if r["model"] == model and r["damping"] == damping]
                else:
                    rows = [
                        r
                        for r in runs
                        if r["model"] == model and r["attack"] == attack and r["eps"] == eps and r["damping"] == damping
                    ]
                rows.sort(key=lambda r: config.seeds.index(r["seed"]))
                rows, copies = distinct_replicates(rows)
                entry: dict[str, Any] = {
                    "model": model,
                    "attack": attack,
                    "eps": eps,
                    "damping": damping,
                    "estimator": config.estimator,
                    "seeds": [r["seed"] for r in rows],
                }
                if copies:
                    entry["same_inputs"] = copies
                if attack == config.control and rows:
                    entry["degenerate"] = all(r.get("same_as_clean") for r in rows)
                language = config.loss == LM_LOSS
                for metric in METRICS + (LM_METRICS if language else ()):
                    entry[metric] = summarize(
                        [r.get(metric) for r in rows], cf, config.top_k if shares.get(metric) else None
                    )
                if attack != config.control and language:
                    for metric in LM_ATTACK_METRICS:
                        entry[metric] = summarize([r.get(metric) for r in rows], cf)
                if attack != config.control:
                    entry["clean_model_accuracy_on_perturbed_train"] = summarize(
                        [r["clean_model_accuracy_on_perturbed_train"] for r in rows], cf
                    )
                    entry["perturbation_norm_mean"] = (
                        float(np.mean([r["perturbation_norm_mean"] for r in rows])) if rows else None
                    )
                    for key in ("perturbation_linf_mean", "perturbation_l2_mean"):
                        vals = [r[key] for r in rows if r.get(key) is not None]
                        entry[key] = float(np.mean(vals)) if vals else None
                    for key in ("perturbation_linf_max", "perturbation_l2_max"):
                        vals = [r[key] for r in rows if r.get(key) is not None]
                        entry[key] = float(np.max(vals)) if vals else None
                abs_vals = [r["damping_abs"] for r in rows if r.get("damping_abs") is not None]
                entry["damping_abs_mean"] = float(np.mean(abs_vals)) if abs_vals else None
                entry["top_k"] = config.top_k
                entry["by_top_k"] = [
                    {
                        "top_k": k,
                        "flip_rate": summarize([value_at_k(r, k, "flip_rate") for r in rows], cf, k),
                        "top_k_overlap": summarize([value_at_k(r, k, "top_k_overlap") for r in rows], cf, k),
                    }
                    for k in top_ks
                ]
                entry["untrained"] = model in untrained
                by_key[(model, attack, eps, damping)] = entry
    # floors: read every adversarial flip rate against the training-randomness control and random noise of the same radius
    for (model, attack, eps, damping), entry in by_key.items():
        if attack not in ADVERSARIAL:
            continue
        rc = config.random_control_for(attack)
        sources = ((config.control, (model, config.control, None, damping)), ("random", (model, rc, eps, damping)))

        def floors_of(get) -> dict:
            floors = {}
            for name, key in sources:
                other = by_key.get(key)
                if other is None or get(other)["mean"] is None or other.get("degenerate"):
                    continue  # a control that reproduced the clean run is no floor
                lo = get(entry)["ci_low"]
                floors[name] = {
                    "mean": get(other)["mean"],
                    "ci_high": get(other)["ci_high"],
                    # conservative reading: the intervals do not overlap
                    "exceeded": bool(
                        lo is not None and get(other)["ci_high"] is not None and lo > get(other)["ci_high"]
                    ),
                    "attack": key[1],
                }
            return floors

        entry["floors"] = floors_of(lambda e: e["flip_rate"])
        for j, k_entry in enumerate(entry["by_top_k"]):
            k_entry["floors"] = floors_of(lambda e, j=j: e["by_top_k"][j]["flip_rate"])
    ratios = []
    base = config.models[0]
    for attack, eps in summary_cells(config):
        for damping in config.damping:
            den_entry = by_key[(base, attack, eps, damping)]
            for model in config.models[1:]:
                num_entry = by_key[(model, attack, eps, damping)]
                common = [s for s in num_entry["seeds"] if s in den_entry["seeds"]]

                def paired(get, k):
                    num = [get(num_entry)["values"][num_entry["seeds"].index(s)] for s in common]
                    den = [get(den_entry)["values"][den_entry["seeds"].index(s)] for s in common]
                    return {**ratio_summary(num, den, cf, trials=(k, k)), "seeds": common}

                by_k = [
                    {"top_k": k, **paired(lambda e, j=j: e["by_top_k"][j]["flip_rate"], k)}
                    for j, k in enumerate(top_ks)
                ]
                ratios.append(
                    {
                        "numerator": model,
                        "denominator": base,
                        "attack": attack,
                        "eps": eps,
                        "damping": damping,
                        **paired(lambda e: e["flip_rate"], config.top_k),
                        "top_k": config.top_k,
                        "by_top_k": by_k,
                        "untrained": [m for m in (model, base) if m in untrained],
                    }
                )
    return list(by_key.values()), ratios


def sensitivity(config: MalleabilityConfig, summary: list[dict]) -> dict:
    """Model ranking by mean flip rate in every (eps, damping) cell, per attack; does it hold?"""
    out: dict = {"by_attack": [], "ranking_stable": True}
    for attack in [a for a in config.attacks if a != "none"]:
        cells: list[dict[str, Any]] = []
        for eps in config.eps:
            for damping in config.damping:
                means = {}
                for row in summary:
                    if row["attack"] == attack and row["eps"] == eps and row["damping"] == damping:
                        means[row["model"]] = row["flip_rate"]["mean"]
                order = sorted(
                    means, key=lambda m: (-(means[m] if means[m] is not None else -1), config.models.index(m))
                )
                cells.append({"eps": eps, "damping": damping, "flip_rate": means, "ranking": order})
        # ties count as no reversal: compare strict orderings only
        rankings = {tuple(c["ranking"]) for c in cells if len(set(c["flip_rate"].values())) == len(c["flip_rate"])}
        stable = len(rankings) <= 1
        out["ranking_stable"] &= stable
        out["by_attack"].append({"attack": attack, "cells": cells, "ranking_stable": stable})
    return out


def loss_gate(config: MalleabilityConfig, training: list[dict], ratios: list[dict]) -> None:
    """Add ``loss_gate`` to every ratio row: the two models' mean clean training losses and
    whether they are within ``config.loss_gap_factor`` of each other. A ratio of flip rates
    at very different training losses compares two training outcomes, not two models, so
    readers (``claims``, the verdicts) do not compare across a failed gate."""
    clean = [r for r in training if r["role"] == "clean" and r.get("final_loss") is not None]
    means = {
        m: float(np.mean([r["final_loss"] for r in clean if r["model"] == m])) for m in {r["model"] for r in clean}
    }
    for row in ratios:
        a, b = means.get(row["numerator"]), means.get(row["denominator"])
        if a is None or b is None:
            row["loss_gate"] = {
                "numerator_loss": a,
                "denominator_loss": b,
                "loss_ratio": None,
                "factor": config.loss_gap_factor,
                "comparable": None,
            }
            continue
        lo, hi = min(a, b), max(a, b)
        ratio = hi / lo if lo > 0 else (1.0 if hi == 0 else math.inf)
        row["loss_gate"] = {
            "numerator_loss": a,
            "denominator_loss": b,
            "loss_ratio": ratio if math.isfinite(ratio) else None,
            "factor": config.loss_gap_factor,
            "comparable": bool(ratio <= config.loss_gap_factor),
        }


def untrained_threshold(n_classes: int, n_train: int) -> tuple[float, float]:
    """(chance, threshold): a model whose training accuracy is below the threshold
    1/c + max(0.05, 2 sqrt((1/c)(1 - 1/c)/n_train)) is called untrained (within a few points,
    or two binomial standard errors, of chance)."""
    chance = 1.0 / n_classes
    return chance, chance + max(0.05, 2.0 * math.sqrt(chance * (1.0 - chance) / max(n_train, 1)))


def model_status(config: MalleabilityConfig, training: list[dict], n_classes: int, n_train: int) -> list[dict]:
    """Per model: chance, the untrained threshold, its clean training accuracy (mean and per seed), and the flag."""
    if config.loss == LM_LOSS:  # no accuracy, no chance level: nothing says a language model did not train
        rule = "not applicable: a language model has no accuracy (see its losses and perplexities)"
        return [
            {"model": m, "chance": None, "threshold": None, "train_accuracy_mean": None}
            | {"train_accuracy_by_seed": [], "untrained": False, "rule": rule}
            for m in config.models
        ]
    chance, threshold = untrained_threshold(n_classes, n_train)
    out = []
    for m in config.models:
        accs = [r["train_accuracy"] for r in training if r["model"] == m and r["role"] == "clean"]
        mean = float(np.mean(accs)) if accs else None
        out.append(
            {
                "model": m,
                "chance": chance,
                "threshold": threshold,
                "train_accuracy_mean": mean,
                "train_accuracy_by_seed": [float(a) for a in accs],
                "untrained": bool(mean is not None and mean < threshold),
                "rule": "train accuracy < 1/c + max(0.05, 2 sqrt((1/c)(1-1/c)/n_train))",
            }
        )
    return out


def untrained_text(st: dict) -> str:
    return (
        f"{st['model']} did not train (clean train accuracy {100 * st['train_accuracy_mean']:.1f}% against chance "
        f"{100 * st['chance']:.1f}%, below the {100 * st['threshold']:.1f}% threshold)"
    )
