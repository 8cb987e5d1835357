"""The claims scorecard (issue 14, item 10): every row on digits, verdict rules on synthetic reports."""

from __future__ import annotations

import json

import pytest

from attnaudit import claims as C

SMALL = {
    "kappa": ["--n", "300"],
    "ntk-distance": ["--widths", "16,64", "--seeds", "2", "--n-train", "60", "--n-test", "30", "--steps", "60"],
    "malleability": ["--n-train", "60", "--n-test", "20", "--seeds", "2", "--steps", "80", "--top-k", "10",
                     "--attacks", "pgd,random"],
    "landscape": ["--n-train", "100", "--steps", "100", "--width", "32"],
}


def test_quick_scorecard_on_digits_produces_every_row(tmp_path, monkeypatch):
    from attnaudit.cli import main

    real_plan = C.plan

    def small_plan(mode, data_args, seed):
        runs, variants = real_plan(mode, data_args, seed)
        return [C.RunSpec(r.id, r.command, (*r.args, *SMALL[r.command]), r.purpose) for r in runs], variants

    monkeypatch.setattr(C, "plan", small_plan)
    out = tmp_path / "claims.json"
    with pytest.raises(SystemExit) as info:
        main(["--threads", "1", "claims", "--quick", "-q", "--json", str(out), "--png", str(tmp_path / "c.png")])
    assert info.value.code == 0
    report = json.loads(out.read_text())
    assert report["schema"] == C.SCHEMA
    rows = report["results"]["claims"]
    assert len(rows) == 6
    assert all(r["verdict"] in C.VERDICTS and r["why"] for r in rows)
    assert {r["run"] for r in rows} == {"kappa", "ntk", "malleability", "landscape"}
    variants = report["results"]["protocol_variants"]
    assert variants[0]["variant"] == "preset protocol" and len(variants) >= 3
    assert (tmp_path / "c.png").stat().st_size > 0
    # a row's command reproduces its number: rerun the kappa command and read the same value
    kappa_run = next(r for r in report["results"]["runs"] if r["id"] == "kappa")
    again = tmp_path / "kappa.json"
    args = kappa_run["command"].split()[1:]
    with pytest.raises(SystemExit) as info:
        main([*args, "-q", "--json", str(again)])
    assert info.value.code == 0
    amp = json.loads(again.read_text())["results"]["amplification_check"]
    assert rows[0]["value"] == pytest.approx(amp["log10_predicted_kappa_cubed"], rel=0, abs=0)


def _ntk_report(relu_slopes, attn_slopes, acc=0.9):
    cells = [{"model": m, "net_train_acc": acc} for m in ("relu", "attn")]
    return {"results": {"n_classes": 10, "n_train": 200, "cells": cells,
                        "models": {"relu": {"slope_per_seed": relu_slopes}, "attn": {"slope_per_seed": attn_slopes}}}}


def test_ntk_verdicts_follow_the_slope_intervals():
    rows = C.claim_ntk(_ntk_report([-0.30, -0.35, -0.32], [-0.05, -0.04, -0.06]), "cmd")
    assert [r.verdict for r in rows] == ["supported", "supported"]
    rows = C.claim_ntk(_ntk_report([0.10, -0.10, 0.05], [-0.30, -0.36, -0.33]), "cmd")
    assert rows[0].verdict == "not resolved"  # 2L-ReLU slope interval includes 0
    rows = C.claim_ntk(_ntk_report([-0.10, -0.12, -0.11], [-0.50, -0.52, -0.49]), "cmd")
    assert rows[1].verdict == "contradicted"  # attention approaches faster than ReLU
    rows = C.claim_ntk(_ntk_report([-0.3, -0.3], [-0.1, -0.1], acc=0.11), "cmd")
    assert [r.verdict for r in rows] == ["not testable here"] * 2
    assert "chance" in rows[1].why


def _mall_report(ratio, lo, hi, relu_beats=True, attn_beats=True, acc=0.95):
    def row(model, flip, beats):
        return {"model": model, "attack": "pgd", "eps": 0.3, "damping": 0.001, "flip_rate": {"mean": flip},
                "floors": {"random": {"mean": 0.01, "exceeded": beats}}}
    return {"results": {
        "config": {"attacks": ["pgd", "random"], "eps": [0.3], "damping": [0.001]}, "n_train": 300,
        "dataset": {"class_counts": {str(i): 30 for i in range(10)}},
        "summary": [row("relu", 0.1, relu_beats), row("attn", 0.1 * ratio, attn_beats)],
        "ratios": [{"numerator": "attn", "denominator": "relu", "attack": "pgd", "eps": 0.3, "damping": 0.001,
                    "ratio": ratio, "ci_low": lo, "ci_high": hi}],
        "training": [{"model": m, "role": "clean", "train_accuracy": acc} for m in ("relu", "attn")],
    }}


@pytest.mark.parametrize("args, verdict", [
    ((3.0, 1.5, 6.0), "supported"),
    ((3.0, 1.5, 6.0, True, False), "not resolved"),  # attn does not beat its noise control
    ((0.4, 0.1, 0.7), "contradicted"),
    ((0.4, 0.1, 0.7, False, True), "not resolved"),  # relu's flips are inside the noise
    ((1.2, 0.6, 2.0), "not resolved"),
    ((3.0, 1.5, 6.0, True, True, 0.10), "not testable here"),  # trained to chance
])
def test_malleability_verdicts(args, verdict):
    assert C.claim_malleability(_mall_report(*args), "cmd").verdict == verdict


def _land_report(loss, lam, trace, se=0.01, acc=0.95):
    return {"results": {"dataset": {"class_counts": {str(i): 10 for i in range(10)}}, "models": {
        m: {"n_samples": 500, "loss": loss[i], "accuracy": acc, "top_eigenvalues": {"eigenvalues": [lam[i]]},
            "trace": {"estimate": trace[i], "stderr": se}} for i, m in enumerate(("relu", "attn"))}}}


def test_landscape_gate_and_tolerance():
    assert C.claim_landscape(_land_report((0.10, 0.30), (2.0, 1.0), (5.0, 2.0)), "c").verdict == "not testable here"
    assert C.claim_landscape(_land_report((0.10, 0.105), (2.0, 1.0), (5.0, 2.0)), "c").verdict == "supported"
    assert C.claim_landscape(_land_report((0.10, 0.105), (1.0, 2.0), (2.0, 5.0)), "c").verdict == "contradicted"
    assert C.claim_landscape(_land_report((0.10, 0.105), (2.0, 1.0), (5.0, 4.99)), "c").verdict == "not resolved"
    assert C.claim_landscape(_land_report((0.10, 0.105), (2.0, 1.0), (5.0, 2.0), acc=0.1), "c").verdict == \
        "not testable here"


@pytest.mark.parametrize("raw, verdict", [("verified", "supported"), ("mismatch", "contradicted"),
                                          ("beyond-float64-precision", "not resolved")])
def test_kappa_verdicts(raw, verdict):
    report = {"results": {"amplification_check": {"verdict": raw, "log10_predicted_kappa_cubed": 9.0},
                          "gram": {"rank_deficient": False},
                          "width_estimates": [{"label": "2L-ReLU: kappa_d(G)^6 n ln n", "log10_required_width": 20.0},
                                              {"label": "MLP-Attn: kappa_d(G~)^6 n ln n", "log10_required_width": 50.0}]}}
    rows = C.claim_kappa(report, "cmd")
    assert rows[0].verdict == verdict
    assert rows[1].verdict == "supported"


def test_unknown_mode_is_refused():
    from attnaudit.errors import AuditError

    with pytest.raises(AuditError, match="--quick or --full"):
        C.plan("medium", [], 0)
