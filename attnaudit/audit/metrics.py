"""Named metrics of ``attnaudit audit``: which numbers of a command's JSON report a check reads.

A metric turns a report's ``results`` into observations: (labels, value) pairs, one per row
of the report it reads (a model, a (model, attack, eps) cell, a layer...). A check's
``select`` keeps the rows whose labels match; its thresholds then apply to every kept
value. Metrics are keyed by the report schema the check's options produce, so the same
name (``kernel_movement``) reads the right field of each report. ``{path: ...}`` reads any
field: a dotted path into ``results`` where ``*`` matches every key or list index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from attnaudit.errors import AuditError

Z95 = 1.959963984540054  # two-sided 95 % normal quantile, for estimate +- z * stderr

# report schemas (without version) a check can produce
KAPPA, KAPPA_LAYERS = "attnaudit.kappa", "attnaudit.kappa-layers"
NTK, NTK_CHECKPOINT, NTK_TRANSFORMERS = (
    "attnaudit.ntk-distance",
    "attnaudit.ntk-checkpoint",
    "attnaudit.ntk-transformers",
)
MALLEABILITY, LANDSCAPE = "attnaudit.malleability", "attnaudit.landscape"

Observation = tuple[dict, Any]


@dataclass(frozen=True)
class Metric:
    """One named metric: where its rows are, what labels them, how a stat becomes a number."""

    name: str
    schema: str
    labels: tuple[str, ...]
    stats: tuple[str, ...]
    rows: Callable[[dict], Iterable[tuple[dict, dict]]]  # results -> (labels, row)
    value: Callable[[dict, str], Any]  # (row, stat) -> number, None (not measured) or inf
    description: str


def _ratio_value(row: dict, stat: str) -> Any:
    """The ratio row's statistic; an upper end that Fieller's interval leaves unbounded is +inf
    (it exceeds any max:), not a missing value."""
    if stat == "ci_high" and row.get("unbounded_high"):
        return float("inf")
    return row.get("ratio" if stat == "mean" else stat)


def _get(obj: Any, *keys: Any) -> Any:
    for key in keys:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else (obj[key] if isinstance(key, int) and key < len(obj) else None)
    return obj


def _list_rows(key: str, labels: tuple[str, ...]) -> Callable:
    def rows(results: dict):
        for row in results.get(key) or []:
            yield {label: row.get(label) for label in labels}, row

    return rows


def _model_rows(key: str = "models", label: str = "model") -> Callable:
    def rows(results: dict):
        for name, row in (results.get(key) or {}).items():
            yield {label: name}, row

    return rows


def _stat_dict(field: str) -> Callable:
    """Row field holding {mean, std, ci_low, ci_high}."""
    return lambda row, stat: _get(row, field, stat)


def _plus_minus(value_path: tuple, stderr_path: tuple) -> Callable:
    """estimate, or estimate -+ 1.96 stderr for ci_low / ci_high (a normal 95 % interval)."""

    def value(row: dict, stat: str):
        est, se = _get(row, *value_path), _get(row, *stderr_path)
        if stat == "mean" or est is None:
            return est
        if se is None:
            return None
        return est - Z95 * se if stat == "ci_low" else est + Z95 * se

    return value


def _over_floor(control: str) -> Callable:
    def value(row: dict, stat: str):
        rate, floor = _get(row, "flip_rate", stat), _get(row, "floors", control, "mean")
        if floor is None:
            fix = (
                "list random in the check's attacks (e.g. attacks: pgd,random)"
                if control == "random"
                else "keep the controls on (controls: true)"
            )
            raise AuditError(f"the report has no {control} floor for this cell; {fix}")
        return None if rate is None else rate - floor

    return value


def _attacked_rows(rows: Callable) -> Callable:
    """Summary rows of real attacks (the random, sign, none and reinit rows are the controls' own cells)."""

    def attacked(results: dict):
        for labels, row in rows(results):
            if str(labels.get("attack")).lower() not in ("random", "sign", "none", "reinit"):
                yield labels, row

    return attacked


def _log10_kappa(gram_key: tuple) -> Callable:
    """log10 kappa_d of a Gram block, +inf when the report says it is rank deficient (kappa_d infinite)."""

    def value(row: dict, stat: str):
        gram = _get(row, *gram_key)
        if gram is None:
            return None
        if gram.get("kappa_d_is_infinite"):
            return math.inf
        return gram.get("log10_kappa_d")

    return value


def _kappa_width_rows(results: dict):
    # every row is the paper's linearized-attention requirement (model "attn"), at kappa_d or at
    # the numerical rank (``basis``); there is no ReLU row
    for row in results.get("width_estimates") or []:
        basis = row.get("basis")
        yield {"model": "attn", "basis": basis, "at_numerical_rank": basis == "numerical_rank"}, row


def _required_width(row: dict, stat: str):
    value = row.get("log10_required_width")
    return math.inf if value is None and row.get("kappa_is_infinite") else value


def _layer_rows(results: dict):
    for model, entry in (results.get("models") or {}).items():
        for layer in entry.get("layers") or []:
            yield (
                {"model": model, "layer": layer.get("name"), "depth": layer.get("depth"), "kind": layer.get("kind")},
                layer,
            )


def _group_rows(results: dict):
    for model, entry in (results.get("models") or {}).items():
        for group in _get(entry, "movement", "groups") or []:
            yield {"model": model, "group": group.get("group")}, group


def _headline_movement(row: dict) -> Any:
    """The full kernel's movement, or the output-averaged one when only that was formed."""
    full = row.get("movement")
    return full if full is not None else row.get("movement_trace")


M, MS, CI = ("mean",), ("mean", "std"), ("mean", "ci_low", "ci_high")
SPREAD = ("median", "p10", "p90")
_MALL_LABELS = ("model", "attack", "eps", "damping")
_SWEEP_LABELS = ("model", "width")


def _one_row(results: dict) -> list[tuple[dict, dict]]:
    return [({}, results)]  # the data kappa report is one row


def _malleability_metrics() -> list[Metric]:
    """The metrics of a malleability report: summary rows, floors, model ratios."""
    table: list[Metric] = []
    add = table.append
    mrows = _list_rows("summary", _MALL_LABELS)
    for name, what in (
        ("flip_rate", "share of the clean top-k helpful training points that leave the top k after the attack"),
        ("spearman", "Spearman rank correlation of clean and perturbed influence"),
        ("top_k_overlap", "overlap of the clean and perturbed top-k helpful sets"),
        ("perturbed_test_accuracy", "held-out accuracy of the model trained on perturbed data"),
    ):
        add(Metric(name, MALLEABILITY, _MALL_LABELS, CI + ("std",), mrows, _stat_dict(name), what))
    attacked = _attacked_rows(mrows)
    for control in ("random", "reinit"):
        add(
            Metric(
                f"flip_rate_over_{control}",
                MALLEABILITY,
                _MALL_LABELS,
                CI,
                attacked,
                _over_floor(control),
                f"flip rate (stat) minus the mean flip rate of the {control} control: the attack's effect above its floor",
            )
        )
    ratio_labels = ("numerator", "denominator", "attack", "eps", "damping")
    add(
        Metric(
            "ratio",
            MALLEABILITY,
            ratio_labels,
            CI,
            _list_rows("ratios", ratio_labels),
            _ratio_value,
            "flip-rate ratio of two models (attn / relu), Fieller interval over seeds (an unbounded upper end is inf)",
        )
    )
    return table


def _landscape_metrics() -> list[Metric]:
    """The metrics of a landscape report: one row per model."""
    table: list[Metric] = []
    add = table.append
    lrows = _model_rows()
    add(
        Metric(
            "lambda_max",
            LANDSCAPE,
            ("model",),
            M,
            lrows,
            lambda row, stat: (_get(row, "top_eigenvalues", "eigenvalues") or [None])[0],
            "largest Hessian eigenvalue of the training loss (Lanczos)",
        )
    )
    add(
        Metric(
            "trace",
            LANDSCAPE,
            ("model",),
            CI,
            lrows,
            _plus_minus(("trace", "estimate"), ("trace", "stderr")),
            "Hessian trace (Hutchinson; ci = estimate -+ 1.96 stderr)",
        )
    )
    add(
        Metric(
            "basin_width",
            LANDSCAPE,
            ("model",),
            CI,
            lrows,
            _plus_minus(("basin", "width"), ("basin", "stderr")),
            "mean radius at which the loss doubles along random directions (ci = -+ 1.96 stderr)",
        )
    )
    add(
        Metric(
            "loss", LANDSCAPE, ("model",), M, lrows, lambda row, stat: row.get("loss"), "training loss at the minimum"
        )
    )
    add(Metric("accuracy", LANDSCAPE, ("model",), M, lrows, lambda row, stat: row.get("accuracy"), "training accuracy"))
    return table


def _kappa_metrics() -> list[Metric]:
    """The metrics of a data kappa report (one row) and its width estimates."""
    table: list[Metric] = []
    add = table.append
    add(
        Metric(
            "log10_kappa",
            KAPPA,
            (),
            M,
            _one_row,
            _log10_kappa(("gram",)),
            "log10 kappa_d of the Gram X X^T (+inf when rank deficient)",
        )
    )
    add(
        Metric(
            "log10_kappa_at_rank",
            KAPPA,
            (),
            M,
            _one_row,
            lambda row, stat: _get(row, "gram", "log10_kappa_at_numerical_rank"),
            "log10 kappa of X X^T at its numerical rank",
        )
    )
    add(
        Metric(
            "log10_kappa_attention",
            KAPPA,
            (),
            M,
            _one_row,
            _log10_kappa(("attention_gram_from_identity",)),
            "log10 kappa_d of the linearized attention Gram G^3 (+inf when rank deficient)",
        )
    )
    add(
        Metric(
            "log10_required_width",
            KAPPA,
            ("model", "basis", "at_numerical_rank"),
            M,
            _kappa_width_rows,
            _required_width,
            "log10 of the paper's linearized-attention width requirement kappa^6 n ln n (model attn; basis kappa_d "
            "or numerical_rank); +inf when kappa_d is infinite",
        )
    )
    return table


def _kappa_layer_metrics() -> list[Metric]:
    """The metrics of a kappa report on a model: per layer, and the model's eNTK."""
    table: list[Metric] = []
    add = table.append
    lrows = _model_rows()
    for name, path, what in (
        ("layer_log10_kappa_in", ("input_gram", "log10_kappa"), "log10 kappa of the layer input's token Gram"),
        ("layer_log10_kappa_out", ("output_gram", "log10_kappa"), "log10 kappa of the attention output's token Gram"),
        (
            "layer_log10_kappa_attention",
            ("attention", "all_heads_log10_kappa"),
            "log10 kappa of the attention matrices",
        ),
        (
            "layer_log10_amplification",
            ("amplification", "measured_log10_amplification"),
            "measured log10 kappa(out) - log10 kappa(in)",
        ),
        (
            "layer_width_exponent",
            ("amplification", "measured_exponent"),
            "measured log kappa(out) / log kappa(in) (3 predicted)",
        ),
    ):
        add(
            Metric(
                name,
                KAPPA_LAYERS,
                ("model", "layer", "depth", "kind"),
                SPREAD,
                _layer_rows,
                (lambda p: lambda row, stat: _get(row, *p, stat))(path),
                what + " (median / p10 / p90 over samples)",
            )
        )
    add(
        Metric(
            "entk_log10_kappa",
            KAPPA_LAYERS,
            ("model",),
            M,
            lrows,
            _log10_kappa(("entk", "gram")),
            "log10 kappa_d of the whole model's eNTK Gram (needs gram: entk; +inf when rank deficient)",
        )
    )
    return table


def _ntk_metrics() -> list[Metric]:
    """The metrics of an ntk-distance width sweep of the 2-layer nets."""
    table: list[Metric] = []
    add = table.append
    lrows = _model_rows()
    add(
        Metric(
            "distance_slope",
            NTK,
            ("model",),
            M,
            lrows,
            lambda row, stat: row.get("slope_mean"),
            "log-log slope of the distance to the NTK predictor against width (kernel regime about -0.5)",
        )
    )
    add(
        Metric(
            "movement_slope",
            NTK,
            ("model",),
            M,
            lrows,
            lambda row, stat: row.get("movement_slope"),
            "log-log slope of the kernel movement against width",
        )
    )
    srows = _list_rows("summary", _SWEEP_LABELS)
    for name in ("distance_rel", "distance_rms", "kernel_movement"):
        add(Metric(name, NTK, _SWEEP_LABELS, MS, srows, _stat_dict(name), f"{name} per width (mean / std over seeds)"))
    return table


def _ntk_checkpoint_metrics() -> list[Metric]:
    """The metrics of ntk-distance on a checkpoint: kernel movement, per group too."""
    table: list[Metric] = []
    add = table.append
    lrows = _model_rows()
    add(
        Metric(
            "kernel_movement",
            NTK_CHECKPOINT,
            ("model",),
            M,
            lrows,
            lambda row, stat: _headline_movement(row.get("movement") or {}),
            "||Theta_T - Theta_0|| / ||Theta_0|| of the eNTK (full kernel; output-averaged when only that was formed)",
        )
    )
    for name, key in (("kernel_distance", "kernel_distance"), ("cka_init", "cka_init"), ("cka_trained", "cka_trained")):
        add(
            Metric(
                name,
                NTK_CHECKPOINT,
                ("model",),
                M,
                lrows,
                (lambda k: lambda row, stat: _get(row, "movement", k))(key),
                f"{name} of the eNTK at the checkpoint vs initialization",
            )
        )
    add(
        Metric(
            "linearized_distance",
            NTK_CHECKPOINT,
            ("model",),
            M,
            lrows,
            lambda row, stat: _get(row, "linearized", "distance_rel"),
            "relative distance between the network and its linearized model (needs the recipe in the side-car)",
        )
    )
    add(
        Metric(
            "group_kernel_movement",
            NTK_CHECKPOINT,
            ("model", "group"),
            M,
            _group_rows,
            lambda row, stat: _headline_movement(row),
            "kernel movement of one parameter group (block)",
        )
    )
    return table


def _ntk_transformer_metrics() -> list[Metric]:
    """The metrics of the ntk-distance transformer sweep: slopes and per-width rows."""
    table: list[Metric] = []
    add = table.append
    arows = _model_rows("archs", "arch")
    for name, key in (
        ("movement_slope", "movement"),
        ("distance_slope", "distance"),
        ("kernel_distance_slope", "kernel_distance"),
    ):
        add(
            Metric(
                name,
                NTK_TRANSFORMERS,
                ("arch",),
                M,
                arows,
                (lambda k: lambda row, stat: _get(row, k, "slope_mean"))(key),
                f"log-log slope of {key} against width",
            )
        )
    trows = _list_rows("summary", ("arch", "width"))
    for name, key in (("kernel_movement", "movement"), ("distance_rel", "distance_rel")):
        add(Metric(name, NTK_TRANSFORMERS, ("arch", "width"), MS, trows, _stat_dict(key), f"{key} per width"))
    return table


def _build() -> dict[str, dict[str, Metric]]:
    """schema -> metric name -> :class:`Metric`, every report's metrics in one table."""
    out: dict[str, dict[str, Metric]] = {}
    for metrics in (
        _malleability_metrics,
        _landscape_metrics,
        _kappa_metrics,
        _kappa_layer_metrics,
        _ntk_metrics,
        _ntk_checkpoint_metrics,
        _ntk_transformer_metrics,
    ):
        for metric in metrics():
            out.setdefault(metric.schema, {})[metric.name] = metric
    return out


METRICS: dict[str, dict[str, Metric]] = _build()


def path_observations(results: dict, path: str) -> list[Observation]:
    """Values at a dotted path with ``*`` wildcards, labelled key1, key2... by what each ``*`` matched."""
    found: list[Observation] = [({}, results)]
    for part in path.split("."):
        nxt: list[Observation] = []
        for labels, obj in found:
            if part == "*":
                items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
                for key, value in items:
                    nxt.append(({**labels, f"key{len([k for k in labels if k.startswith('key')]) + 1}": key}, value))
            elif isinstance(obj, dict) and part in obj:
                nxt.append((labels, obj[part]))
            elif isinstance(obj, list) and part.lstrip("-").isdigit() and -len(obj) <= int(part) < len(obj):
                nxt.append((labels, obj[int(part)]))
        found = nxt
    return found


def observations(metric: Metric, results: dict, stat: str) -> list[Observation]:
    """(labels, value) for every row of the metric in a report's results."""
    return [(labels, metric.value(row, stat)) for labels, row in metric.rows(results)]


def matches(labels: dict, select: dict) -> bool:
    """Whether a row's labels equal every selected value (strings case-insensitively, numbers by isclose)."""
    for key, want in select.items():
        have = labels.get(key)
        if isinstance(want, bool) or isinstance(have, bool):
            if bool(have) != bool(want) or have is None:
                return False
        elif isinstance(want, (int, float)) and isinstance(have, (int, float)):
            if not math.isclose(float(have), float(want), rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif str(have).lower() != str(want).lower():
            return False
    return True
