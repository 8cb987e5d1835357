"""Per-layer conditioning of a real transformer (`attnaudit kappa --checkpoint`).

A batch of samples is run through a float64 **copy** of the model (eval mode, no gradients,
math attention kernel) with forward hooks on every attention layer. For every sample i and
layer l, with X the layer's token matrix (N tokens x D features):

* the token Gram X X^T (N x N) of the layer's **input** and of its **output**: spectrum
  from the smaller of X X^T and X^T X, numerical rank and condition numbers exactly as
  :func:`attnaudit.core.spectral.condition_report` defines them for the data (rank tolerance
  ``max(N, D) eps lambda_max``; kappa_d = lambda_1 / lambda_min(N, D), **infinite** when
  the Gram is rank deficient; kappa_r at the numerical rank);
* per head, the **attention matrix** A (N x N) itself: its singular values, kappa =
  s_max / s_min (infinite when numerically singular by numpy's ``matrix_rank`` rule,
  ``max(N, N) eps s_max``), kappa at its numerical rank;
* the measured amplification, log10 kappa(out) - log10 kappa(in), against what the
  linearized analysis predicts (kappa(out) = kappa(in)^3, i.e. log10 kappa(out) =
  3 log10 kappa(in)), and the measured exponent log10 kappa(out) / log10 kappa(in)
  (3 for linearized identity attention). A sample whose predicted kappa(in)^3 reaches
  ``1 / (max(N, D) eps)`` is counted as *beyond float64 precision*: its output Gram could
  not show such a kappa even if the prediction held;
* the paper's width formula log10(kappa^6 N ln N) (:func:`attnaudit.core.spectral.width_estimate`,
  constant omitted) evaluated on the token Gram with **N = the number of tokens** of the
  layer, from the median kappa (no round-off interval: a median over samples).

Over the batch every quantity is summarised by the median and the 10th/90th percentiles
of log10 kappa. Infinite values are kept, not dropped: they sort above every finite value,
so a median is infinite exactly when at least half the samples are rank deficient, and
the number of rank-deficient samples is always stated.

With ``gram="entk"`` the empirical NTK Gram of the whole model on the batch is added:
K = (1/c) sum_a J_a J_a^T (n x n, the mean over the c outputs of the logits' Jacobian
products, :meth:`attnaudit.core.engine.Engine.entk` ``form="trace"``, chunked to a
memory budget), its spectrum, rank (tolerance ``max(n, c P) eps lambda_max``, P tracked
parameters: K is the Gram of the n x cP stacked Jacobian) and condition numbers, and the
width scale with **n = the number of samples** -- the quantity the width theory is about.

Which modules are attention layers (:func:`find_attention_layers`):

* :class:`attnaudit.models.vit.Attention` (built-in ``vit`` / ``vit-linear``): attention maps
  from its own ``weights(h)``;
* :class:`torch.nn.MultiheadAttention`: the captured call is re-run (``module.forward``,
  hooks bypassed) with ``need_weights=True, average_attn_weights=False``: the module's own
  per-head maps;
* any other module whose class name ends in ``Attention`` (``SelfAttention`` included,
  ``CrossAttention`` excluded) and that owns query and key projections as direct children
  (``q``/``k``, ``q_proj``/``k_proj``, ``query``/``key``, ``q_lin``/``k_lin``, ``to_q``/
  ``to_k``, ``wq``/``wk``) or a fused one (``qkv``, ``in_proj``, ``c_attn``, ``Wqkv``,
  ``query_key_value``): Hugging Face's ``ViTAttention``, ``BertSelfAttention``,
  ``DistilBertSelfAttention``... Hugging Face models are switched to their ``eager``
  attention (on the copy), which returns the maps as the second output; its float32
  softmax is kept in float64 (:func:`softmax_in_input_dtype`), so maps and outputs equal
  the model's own sdpa path to float64 round-off. Any module that returns (output, maps
  (B, heads, N, N)) is read the same way. A module that does not expose its maps gets
  token Grams only, and the result says so.

A module nested inside another match is skipped (the outer one is the layer). ``layers``
glob patterns on module names override the detection and may name any module that takes
and returns token tensors (batch, tokens, features).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnaudit.analyses.kappa.capture import LayerRecord, capture_layers, float64_copy
from attnaudit.analyses.kappa.discovery import find_attention_layers
from attnaudit.analyses.kappa.entk import EntkResult, entk_result, layer_task
from attnaudit.core.precision import check_precision
from attnaudit.analyses.kappa.spread import Amplification, Spread, SpectrumSummary, fmt_log
from attnaudit.analyses.request import FieldError, literal
from attnaudit.core.spectral import EPS64, WidthEstimate, reference_width, width_estimate
from attnaudit.errors import AuditError

SCHEMA = "attnaudit.kappa-layers/1"
GRAM_KINDS = ("tokens", "entk")


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class LayerKappaConfig:
    """Options of the per-layer analysis.

    ``n``: samples analysed (when X has more rows, ``n`` are drawn without replacement
    with ``seed``); ``layers``: glob patterns on module names (None: detect attention
    layers); ``gram``: ``tokens`` (per-layer token Grams) or ``entk`` (those plus the
    empirical NTK Gram of the whole model); ``rank_tol``: relative rank tolerance (None:
    max(rows, cols) eps); ``chunk``: samples per forward pass; ``memory_bytes``: budget
    for the eNTK Jacobians; ``device``: where the float64 copy runs (None: the model's).
    """

    n: int = 256
    layers: tuple[str, ...] | None = None
    gram: str = "tokens"
    rank_tol: float | None = None
    seed: int = 0
    chunk: int = 64
    memory_bytes: int = 1 << 30
    device: str | None = None
    precision: str = "auto"  # the eNTK Gram's Jacobians (attnaudit.core.precision); token Grams are float64

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise FieldError("n", "{name} must be a positive number of samples, got " + literal(repr(self.n)))
        if self.gram not in GRAM_KINDS:
            raise FieldError("gram", "unknown {name} " + literal(repr(self.gram)) + "; use tokens or entk")
        if self.rank_tol is not None and not (0 < self.rank_tol < 1):
            raise FieldError(
                "rank_tol",
                "{name} must lie in (0, 1) (relative to the largest eigenvalue), got " + literal(self.rank_tol),
            )
        if self.chunk < 1:
            raise FieldError("chunk", "{name} must be a positive number of samples")
        if self.memory_bytes < 1:
            raise FieldError("memory_bytes", "{name} must be positive")
        if self.layers is not None:
            pats = tuple(str(p).strip() for p in self.layers if str(p).strip())
            if not pats:
                raise FieldError(
                    "layers", "{name} is empty; give module names or glob patterns such as 'blocks.*.attn'"
                )
            object.__setattr__(self, "layers", pats)


@dataclass
class LayerKappa:
    """Everything measured on one layer over the batch."""

    name: str
    kind: str
    class_name: str
    depth: int  # order in the forward pass (0 = first)
    tokens: int
    features_in: int
    features_out: int
    input: SpectrumSummary
    output: SpectrumSummary
    heads: list[SpectrumSummary] | None  # attention maps per head (singular values), None when not exposed
    attention_note: str
    amplification: Amplification
    widths: list[WidthEstimate]

    @property
    def attention_all_heads(self) -> Spread | None:
        if not self.heads:
            return None
        return Spread.of(np.concatenate([h.log10_kappa for h in self.heads]))

    def to_dict(self, per_sample: bool = True) -> dict:
        all_heads = self.attention_all_heads
        return {
            "name": self.name,
            "kind": self.kind,
            "class": self.class_name,
            "depth": self.depth,
            "tokens": self.tokens,
            "features_in": self.features_in,
            "features_out": self.features_out,
            "input_gram": self.input.to_dict(per_sample),
            "output_gram": self.output.to_dict(per_sample),
            "attention": None
            if self.heads is None
            else {
                "spectrum": "singular values of the attention matrix; kappa = s_max / s_min",
                "heads": [{"head": i, **h.to_dict(per_sample)} for i, h in enumerate(self.heads)],
                "all_heads_log10_kappa": None if all_heads is None else all_heads.to_dict(),
            },
            "attention_note": self.attention_note,
            "amplification": self.amplification.to_dict(),
            "width_estimates": [w.to_dict() for w in self.widths],
        }


@dataclass
class LayerKappaResult:
    """The per-layer analysis of one model on one batch (``to_dict()`` for JSON)."""

    label: str
    samples: int
    layers: list[LayerKappa]
    entk: EntkResult | None
    config: LayerKappaConfig
    timings: dict[str, float]
    rows: list[int] | None = None  # indices drawn from X when it had more than config.n rows
    verdicts: list[str] = field(default_factory=list)

    def to_dict(self, per_sample: bool = True) -> dict:
        return {
            "label": self.label,
            "samples": self.samples,
            "rows_drawn": self.rows,
            "width_n": "per layer: N = tokens of the layer; eNTK: n = samples",
            "reference_width": reference_width(),
            "layers": [layer.to_dict(per_sample) for layer in self.layers],
            "entk": None if self.entk is None else self.entk.to_dict(),
            "timings_s": dict(self.timings),
            "verdicts": list(self.verdicts),
        }


def _draw(X: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, list[int] | None]:
    if X.shape[0] <= n:
        return X, None
    gen = torch.Generator().manual_seed(int(seed))
    idx = torch.randperm(X.shape[0], generator=gen)[:n].sort().values
    return X[idx], idx.tolist()


def analyse_layers(
    model: Any, X: torch.Tensor, config: LayerKappaConfig = LayerKappaConfig(), label: str | None = None
) -> LayerKappaResult:
    """Per-layer kappa of ``model`` (a :class:`~attnaudit.core.task.Task`, a
    :class:`~attnaudit.models.checkpoints.LoadedModel` or a module) on flat rows ``X`` (n, d).

    The model runs as a float64 copy (the caller's module is never changed), in eval mode,
    without gradients, under :func:`attnaudit.core.engine.math_attention`, ``config.chunk``
    samples per pass. See the module docstring for what is measured.
    """

    if not isinstance(X, torch.Tensor) or X.ndim != 2 or X.shape[0] < 1:
        raise AuditError(
            f"X must be a non-empty (n, d) matrix of flat rows, got {getattr(X, 'shape', type(X).__name__)}"
        )
    t0 = time.perf_counter()
    task = layer_task(model, X)
    X, rows = _draw(X, config.n, config.seed)
    first = next((t for t in (*task.module.parameters(), *task.module.buffers()) if t.is_floating_point()), None)
    device = (
        torch.device(config.device) if config.device else (first.device if first is not None else torch.device("cpu"))
    )
    twin = float64_copy(task.module, device)
    records = capture_layers(task, twin, find_attention_layers(twin, config.layers), X, config.chunk, device)
    t_layers = time.perf_counter()
    results = [summarise_layer(rec, depth, config.rank_tol) for depth, rec in enumerate(records)]
    timings = {"layers": t_layers - t0, "spectra": time.perf_counter() - t_layers}
    entk = None
    if config.gram == "entk":
        entk = entk_result(task, X, config.memory_bytes, device, config.rank_tol, config.precision)
        timings["entk"] = entk.seconds
    timings["total"] = time.perf_counter() - t0
    result = LayerKappaResult(label or task.name, int(X.shape[0]), results, entk, config, timings, rows)
    result.verdicts = layer_verdicts(result)
    return result


def _kappa_of(log_med: float) -> float:
    """kappa from a median log10 kappa (infinite when the median is infinite or undefined)."""
    return math.inf if math.isinf(log_med) else (10.0**log_med if math.isfinite(log_med) else math.inf)


def _token_widths(s_in: SpectrumSummary, s_out: SpectrumSummary, N: int, No: int) -> list[WidthEstimate]:
    """The paper's width formula kappa^6 N ln N on the median kappa of the input and output
    token Grams (N = tokens), at kappa_d and at the numerical rank."""
    median_note = "not computed: median kappa over samples"
    tok = "m ~ kappa^6 N ln N of the token Gram (the paper's formula, N = tokens; Omega constant omitted)"
    rows = (
        (s_in.spread(), N, "input token Gram, median kappa_d: kappa^6 N ln N (N = tokens)", "kappa_d"),
        (s_in.spread_rank(), N, "input token Gram, median kappa at numerical rank (N = tokens)", "numerical_rank"),
        (s_out.spread(), No, "output token Gram, median kappa_d (N = tokens)", "kappa_d"),
        (s_out.spread_rank(), No, "output token Gram, median kappa at numerical rank (N = tokens)", "numerical_rank"),
    )
    return [
        width_estimate(_kappa_of(sp.median), n, text, basis=basis, formula=tok, interval_method=median_note)
        for sp, n, text, basis in rows
    ]


def summarise_layer(rec: LayerRecord, depth: int, rank_tol: float | None) -> LayerKappa:
    """The :class:`LayerKappa` of one captured layer (``depth``: its order in the forward pass)."""
    layer = rec.layer
    assert rec.shape_in is not None and rec.shape_out is not None  # every layer ran (capture_layers checks)
    N, D = rec.shape_in
    No, Do = rec.shape_out
    real = np.concatenate(rec.real_tokens) if rec.real_tokens else None
    s_in = SpectrumSummary.of(np.concatenate(rec.spec_in), N, D, rank_tol, real)
    s_out = SpectrumSummary.of(np.concatenate(rec.spec_out), No, Do, rank_tol, real)
    heads = None
    if rec.svals:
        sv = np.concatenate(rec.svals)  # (B, H, k)
        assert rec.maps_shape is not None  # recorded with the singular values
        L, S = rec.maps_shape
        # a square map over the padded positions is a map over the real tokens (rows and columns zeroed)
        on_real = real if real is not None and L == S == N else None
        heads = [SpectrumSummary.of(sv[:, h, :], L, S, rank_tol, on_real) for h in range(sv.shape[1])]
    if real is not None:
        # the width formula's N: a sequence's tokens, here the median real length
        N = No = max(1, int(np.median(real)))
    amp = Amplification(
        s_in.log10_kappa,
        s_out.log10_kappa,
        precision_limit_log10=-math.log10(max(No, Do) * EPS64),
    )
    note = rec.note if layer.kind != "selected" or heads is not None else "selected by --layers: token Grams only"
    return LayerKappa(
        name=layer.name,
        kind=layer.kind,
        class_name=layer.class_name,
        depth=depth,
        tokens=N,
        features_in=D,
        features_out=Do,
        input=s_in,
        output=s_out,
        heads=heads,
        attention_note=note + (f"; {rec.padding_note}" if rec.padding_note else ""),
        amplification=amp,
        widths=_token_widths(s_in, s_out, N, No),
    )


def layer_verdicts(result: LayerKappaResult) -> list[str]:
    """One line per layer (median log10 kappa in -> out, exponent, rank deficiency, attention maps) and the eNTK."""
    out = []
    for layer in result.layers:
        si, so = layer.input.spread(), layer.output.spread()
        ex = Spread.of(layer.amplification.exponent)
        over = f" over the {ex.n} samples where it is defined" if ex.n_undefined else ""
        text = (
            f"{result.label} {layer.name}: median log10 kappa of the token Gram {fmt_log(si.median)} (input) -> "
            f"{fmt_log(so.median)} (output), exponent {fmt_log(ex.median)}{over} (linearized prediction 3)"
        )
        if layer.input.rank_deficient or layer.output.rank_deficient:
            text += (
                f"; rank deficient in {layer.input.rank_deficient}/{layer.input.samples} inputs and "
                f"{layer.output.rank_deficient}/{layer.output.samples} outputs (kappa infinite there)"
            )
        if layer.amplification.beyond_precision:
            text += (
                f"; kappa(in)^3 beyond float64 precision for {layer.amplification.beyond_precision} samples "
                "(the output Gram cannot resolve it)"
            )
        if layer.heads:
            att = layer.attention_all_heads
            assert att is not None  # the layer has heads
            deficient = sum(h.rank_deficient for h in layer.heads)
            text += f"; attention matrix median log10 kappa {fmt_log(att.median)} over {len(layer.heads)} heads"
            if deficient:
                text += f" ({deficient} of {att.n} head maps numerically singular)"
        out.append(text)
    if result.entk is not None:
        r = result.entk.report
        kd = "infinite (rank deficient)" if r.rank_deficient else f"{r.kappa_full:.4g}"
        out.append(
            f"{result.label} eNTK Gram on {result.entk.n} samples: numerical rank {r.numerical_rank}/{r.k}, kappa_d {kd}, "
            f"kappa at numerical rank {r.kappa_rank:.4g}"
        )
    return out
