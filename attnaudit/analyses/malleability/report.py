"""The report's tables (rich) and figure (matplotlib) of a malleability run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnaudit.analyses.influence.influence import damping_label
from attnaudit.analyses.malleability.aggregate import summary_cells
from attnaudit.analyses.malleability.attacks import ADVERSARIAL, TOKEN_CONTROL
from attnaudit.analyses.malleability.config import LM_LOSS, MalleabilityConfig
from attnaudit.analyses.malleability.stability import top_k_indices
from attnaudit.analyses.malleability.verdicts import interval_text, ratio_interval_text

if TYPE_CHECKING:
    from attnaudit.analyses.malleability.malleability import MalleabilityResult


def build_tables(result: MalleabilityResult) -> list:
    """Rich tables: per-cell stability, model ratios, training comparability."""
    from rich.table import Table

    cfg = result.config
    assert cfg.top_ks is not None  # MalleabilityConfig.__post_init__ sets it
    t = Table(
        title=(
            f"influence malleability: flip rate among the top-{cfg.top_k} of {result.n_train} samples by clean |influence| "
            + (
                f"(other k: {', '.join(map(str, cfg.top_ks[1:]))} in the JSON's by_top_k and the verdicts) "
                if len(cfg.top_ks) > 1
                else ""
            )
            + f"({cfg.protocol}, {cfg.estimator}; mean [{int(100 * cfg.confidence)}% Student-t CI; ratios Fieller] over {len(cfg.seeds)} seed(s))"
        )
    )
    t.caption = (
        f"above floor: the flip-rate interval lies entirely above the "
        f"{cfg.random_control + '-noise' if cfg.random_control else 'random-swap' if TOKEN_CONTROL in cfg.attacks else 'random-noise'} / "
        f"{cfg.control} control's"
    )
    s = Table(title="stability and attack strength (means over seeds)")
    language = cfg.loss == LM_LOSS  # no accuracy: next-token losses stand in for it
    measure = "loss" if language else "acc"
    after = {"retrain": "retrained ", "finetune": "fine-tuned ", "static": "model "}[cfg.protocol] + measure
    strength = (
        "the attacked model's next-token loss on the clean -> perturbed training documents"
        if language
        else "the attacked model's accuracy on the perturbed training data"
    )
    held_out = "held-out next-token loss" if language else "held-out accuracy"
    s.caption = (
        f"strength: {strength}; {after}: {held_out} of "
        + {
            "retrain": "the model retrained on perturbed data",
            "finetune": "the copy fine-tuned on perturbed data",
            "static": "the saved model (static: nothing is retrained)",
        }[cfg.protocol]
    )
    floor_col = f"above floor random/{cfg.control}"
    for col in ("model", "attack", "eps", "damping", "flip rate [CI]", floor_col):
        t.add_column(col, justify="left" if col in ("model", "attack") else "right", no_wrap=col != floor_col)
    for col in ("model", "attack", "eps", "damping", "Spearman", "top-k overlap", "strength", after):
        s.add_column(col, justify="left" if col in ("model", "attack") else "right", no_wrap=col in ("model", "attack"))

    def mean(x: dict | None, pct: bool = True) -> str:
        if x is None or x["mean"] is None:
            return "-"
        return f"{100 * x['mean']:.1f}%" if pct else f"{x['mean']:.3f}"

    for row in result.summary:
        floors = row.get("floors")
        above = "-"
        if floors:
            above = "/".join(
                ("yes" if floors[k]["exceeded"] else "no") if k in floors else "-" for k in ("random", cfg.control)
            )
        key = (
            row["model"] + (" (untrained)" if row.get("untrained") else ""),
            row["attack"],
            "-" if row["eps"] is None else f"{row['eps']:g}",
            damping_label(row["damping"]),
        )
        t.add_row(*key, interval_text(row["flip_rate"]), above)
        if language:
            before, on_perturbed = (
                row.get("clean_model_loss_on_clean_train"),
                row.get("clean_model_loss_on_perturbed_train"),
            )
            shown = "-" if on_perturbed is None else f"{mean(before, pct=False)} -> {mean(on_perturbed, pct=False)}"
            held = mean(row.get("perturbed_test_loss"), pct=False)
        else:
            shown = mean(row.get("clean_model_accuracy_on_perturbed_train"))
            held = mean(row["perturbed_test_accuracy"])
        s.add_row(*key, mean(row["spearman"], pct=False), mean(row["top_k_overlap"]), shown, held)
    out = [t, s]
    if result.ratios:
        r = Table(title="flip-rate ratio between models (paired over seeds; Fieller interval, +inf = unbounded)")
        for col in ("ratio", "attack", "eps", "damping", "value", "interval", "losses comparable"):
            r.add_column(col, justify="right")
        for row in result.ratios:
            gate = (row.get("loss_gate") or {}).get("comparable")
            r.add_row(
                f"{row['numerator']}/{row['denominator']}",
                row["attack"],
                "-" if row["eps"] is None else f"{row['eps']:g}",
                damping_label(row["damping"]),
                "undefined" if row["ratio"] is None else f"{row['ratio']:.2f}",
                ratio_interval_text(row),
                {True: "yes", False: "no", None: "-"}[gate],
            )
        out.append(r)
    tr = Table(
        title={
            "retrain": "training (clean models; "
            + ("the recorded recipe re-run" if cfg.saved_models else optimizer_text(cfg))
            + ", mean over seeds"
            + ("; rows resampled per seed" if cfg.resample_data else "")
            + ")",
            "finetune": f"clean models (saved model fine-tuned {cfg.finetune_steps} steps, {cfg.finetune_optimizer} "
            f"lr {cfg.finetune_lr:g}; mean over seeds)",
            "static": "saved models as they are (no training)",
        }[cfg.protocol]
    )
    status = {r["model"]: r for r in result.model_status}
    if language:
        out.append(_language_training_table(tr, result))
        return out
    for col in ("model", "final train loss", "train acc", "test acc", "steps", "reached --match-loss", "untrained?"):
        tr.add_column(col, justify="right")
    for model in cfg.models:
        rows = [x for x in result.training if x["model"] == model and x["role"] == "clean"]
        if not rows:  # every cell of this model failed (see failed_cells)
            tr.add_row(model, "-", "-", "-", "-", "-", "-")
            continue
        reached = [x["reached_match_loss"] for x in rows]
        tr.add_row(
            model,
            f"{np.mean([x['final_loss'] for x in rows]):.4g}",
            f"{100 * np.mean([x['train_accuracy'] for x in rows]):.1f}%",
            f"{100 * np.mean([x['test_accuracy'] for x in rows]):.1f}%",
            f"{np.mean([x['steps_run'] for x in rows]):.0f}",
            "-" if reached[0] is None else f"{sum(bool(v) for v in reached)}/{len(reached)}",
            ("yes" if status[model]["untrained"] else "no") + f" (< {100 * status[model]['threshold']:.1f}%)"
            if model in status
            else "-",
        )
    out.append(tr)
    return out


def _language_training_table(tr, result: MalleabilityResult):
    """The saved language models' next-token losses and perplexities (training and held-out documents)."""
    tr.caption = "next-token cross-entropy per document (mean over documents); perplexity over all counted tokens"
    for col in ("model", "train loss", "train perplexity", "held-out loss", "held-out perplexity"):
        tr.add_column(col, justify="right")
    for model in result.config.models:
        rows = [x for x in result.training if x["model"] == model and x["role"] == "clean"]

        def avg(key: str) -> str:
            vals = [x[key] for x in rows if x.get(key) is not None]
            return f"{np.mean(vals):.4g}" if vals else "-"

        tr.add_row(model, avg("final_loss"), avg("train_perplexity"), avg("test_loss"), avg("test_perplexity"))
    return tr


def optimizer_text(cfg: MalleabilityConfig) -> str:
    lr = (
        ", ".join(f"{m} {cfg.lr_for(m):g}" for m in cfg.models)
        if isinstance(cfg.lr, dict)
        else f"{cfg.lr_for(cfg.models[0]):g}"
    )
    if cfg.optimizer == "gd":
        return f"full-batch GD, lr {lr}"
    return f"{cfg.optimizer}, lr {lr}, " + ("full batch" if cfg.batch_size is None else f"batch {cfg.batch_size}")


def plot_malleability(result: MalleabilityResult, path: str | Path, title: str = "") -> None:
    """Figure: clean vs perturbed influence per model (top-k and flips marked), flip-rate bars
    with intervals per attack and the reinit floor, and flip rate vs eps / damping when swept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result.config
    models = list(cfg.models)
    sweep = len(cfg.eps) > 1 or len(cfg.damping) > 1
    nrows = 3 if sweep else 2
    fig = plt.figure(figsize=(4.2 * max(len(models), 2), 3.8 * nrows), constrained_layout=True)
    grid = fig.add_gridspec(nrows, max(len(models), 2))
    primary = next((a for a in cfg.attacks if a in ADVERSARIAL), cfg.attacks[0])
    for j, model in enumerate(models):
        ax = fig.add_subplot(grid[0, j])
        pair = result.examples.get(model, {}).get(primary)
        if pair is None:
            ax.set_axis_off()
            continue
        c, p = pair
        idx = top_k_indices(c, cfg.top_k)
        flipped = idx[c[idx] * p[idx] < 0]
        ax.scatter(c, p, s=6, c="0.7", label="all samples")
        ax.scatter(c[idx], p[idx], s=12, c="tab:blue", label=f"top-{cfg.top_k} by clean |I|")
        ax.scatter(c[flipped], p[flipped], s=16, c="tab:red", label=f"flipped ({len(flipped)})")
        ax.axhline(0, c="k", lw=0.5)
        ax.axvline(0, c="k", lw=0.5)
        ax.set_xlabel("clean influence (negative = helpful)")
        ax.set_ylabel(f"perturbed influence ({primary})")
        ax.set_title(
            f"{model}, seed {cfg.seeds[0]}, eps={cfg.eps[0]:g}, damping={damping_label(cfg.damping[0])}", fontsize=9
        )
        ax.legend(fontsize=7, loc="best")
    ax = fig.add_subplot(grid[1, :])
    cells = [(a, e) for a, e in summary_cells(cfg) if a == cfg.control or a == "none" or e == cfg.eps[0]]
    width = 0.8 / len(models)
    for j, model in enumerate(models):
        means, lows, highs = [], [], []
        for attack, eps in cells:
            row = next(
                r
                for r in result.summary
                if r["model"] == model and r["attack"] == attack and r["eps"] == eps and r["damping"] == cfg.damping[0]
            )
            s = row["flip_rate"]
            m = s["mean"] if s["mean"] is not None else 0.0
            means.append(m)
            lows.append(m - (s["ci_low"] if s["ci_low"] is not None else m))
            highs.append((s["ci_high"] if s["ci_high"] is not None else m) - m)
        x = np.arange(len(cells)) + (j - (len(models) - 1) / 2) * width
        ax.bar(x, means, width, yerr=[lows, highs], capsize=3, label=model)
    ax.set_xticks(np.arange(len(cells)))
    ax.set_xticklabels([a if a in (cfg.control, "none") else f"{a}\neps={e:g}" for a, e in cells], fontsize=8)
    ax.set_ylabel(f"flip rate (top-{cfg.top_k})")
    ax.set_title(
        f"flip rate, mean and {int(100 * cfg.confidence)}% Student-t CI over {len(cfg.seeds)} seed(s); random and {cfg.control} are floors",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    if sweep:
        for k, (name, values) in enumerate((("eps", cfg.eps), ("damping", cfg.damping))):
            ax = fig.add_subplot(grid[2, k])
            for model in models:
                for attack in [a for a in cfg.attacks if a not in ("none",)]:
                    ys = []
                    for v in values:
                        at_eps, at_damping = (v, cfg.damping[0]) if name == "eps" else (cfg.eps[0], v)
                        row = next(
                            r
                            for r in result.summary
                            if r["model"] == model
                            and r["attack"] == attack
                            and r["eps"] == at_eps
                            and r["damping"] == at_damping
                        )
                        ys.append(row["flip_rate"]["mean"])
                    categorical = any(isinstance(v, str) for v in values)  # relative damping: one tick per value
                    xs = list(range(len(values))) if categorical else values
                    ax.plot(xs, [np.nan if y is None else y for y in ys], marker="o", label=f"{model} {attack}")
            if any(isinstance(v, str) for v in values):
                ax.set_xticks(list(range(len(values))))
                ax.set_xticklabels([damping_label(v) for v in values], fontsize=8)
            elif name == "damping" and min(float(v) for v in values) > 0:  # numbers only here
                ax.set_xscale("log")
            ax.set_xlabel(name)
            ax.set_ylabel("flip rate (mean over seeds)")
            fixed = f"damping={damping_label(cfg.damping[0])}" if name == "eps" else f"eps={cfg.eps[0]:g}"
            ax.set_title(f"flip rate vs {name} at {fixed}", fontsize=9)
            ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
