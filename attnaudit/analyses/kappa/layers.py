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

import contextlib
import copy
import fnmatch
import inspect
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from attnaudit.errors import AuditError
from attnaudit.core.spectral import (
    EPS64,
    ConditionReport,
    WidthEstimate,
    condition_report,
    reference_width,
    width_estimate,
    width_rows,
)
from attnaudit.models.vit import Attention
from attnaudit.models.checkpoints import LoadedModel
from attnaudit.core.task import Inputs, Task, as_task
from attnaudit.core.engine import Engine, ranges
from attnaudit.core.engine import math_attention
from attnaudit.core.task import to_logits

SCHEMA = "attnaudit.kappa-layers/1"
GRAM_KINDS = ("tokens", "entk")
PNG_NAME = "kappa_layers.png"

_QK_PAIRS = (("q", "k"), ("q_proj", "k_proj"), ("query", "key"), ("q_lin", "k_lin"), ("to_q", "to_k"), ("wq", "wk"))
_FUSED = ("qkv", "in_proj", "c_attn", "Wqkv", "query_key_value", "qkv_proj")
_INPUT_KEYWORDS = ("hidden_states", "query", "x", "h", "input", "inputs")


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

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise AuditError(f"--n must be a positive number of samples, got {self.n!r}")
        if self.gram not in GRAM_KINDS:
            raise AuditError(f"unknown --gram {self.gram!r}; use tokens or entk")
        if self.rank_tol is not None and not (0 < self.rank_tol < 1):
            raise AuditError(f"--rank-tol must lie in (0, 1) (relative to the largest eigenvalue), got {self.rank_tol}")
        if self.chunk < 1:
            raise AuditError("chunk must be a positive number of samples")
        if self.memory_bytes < 1:
            raise AuditError("memory_bytes must be positive")
        if self.layers is not None:
            pats = tuple(str(p).strip() for p in self.layers if str(p).strip())
            if not pats:
                raise AuditError("--layers is empty; give module names or glob patterns such as 'blocks.*.attn'")
            object.__setattr__(self, "layers", pats)


# --------------------------------------------------------------------------- finding layers


@dataclass(frozen=True)
class AttentionLayer:
    """One layer to analyse: its module name, the module and how it was recognised.

    ``kind``: ``builtin`` (attnaudit.models.vit.Attention), ``multihead`` (torch.nn.MultiheadAttention),
    ``projections`` (a ``*Attention`` module owning query/key projections, e.g. Hugging Face)
    or ``selected`` (named by ``--layers`` but not a recognised attention module: token Grams only).
    """

    name: str
    module: nn.Module
    kind: str

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


def _owns_projections(module: nn.Module) -> bool:
    children = dict(module.named_children())
    if any(q in children and k in children for q, k in _QK_PAIRS):
        return True
    if any(f in children for f in _FUSED):
        return True
    params = dict(module.named_parameters(recurse=False))
    return "in_proj_weight" in params or "qkv_weight" in params


def attention_kind(module: nn.Module) -> str | None:
    """How ``module`` is recognised as an attention layer (see :class:`AttentionLayer`), else None."""

    if isinstance(module, Attention):
        return "builtin"
    if isinstance(module, nn.MultiheadAttention):
        return "multihead"
    name = type(module).__name__
    if name.lower().endswith("attention") and "crossattention" not in name.lower() and _owns_projections(module):
        return "projections"
    return None


def _candidates(module: nn.Module, limit: int = 12) -> str:
    names = [
        n for n, m in module.named_modules() if n and re.search(r"att|attn|attention", f"{n} {type(m).__name__}", re.I)
    ]
    if not names:
        names = [n for n, _ in module.named_modules() if n]
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return shown or "(the model has no submodules)"


def find_attention_layers(module: nn.Module, patterns: Sequence[str] | None = None) -> list[AttentionLayer]:
    """The attention layers of ``module``, in registration order (see the module docstring).

    ``patterns``: glob patterns (``fnmatch``, case-sensitive) on module names, e.g.
    ``blocks.*.attn`` or ``model.vit.layers.0.attention``; every pattern must match at
    least one module. Without patterns, attention layers are detected by type; a module
    nested inside another detected layer is skipped. Raises one :class:`AuditError` line
    listing candidate module names when nothing matches.
    """
    if not isinstance(module, nn.Module):
        raise AuditError(f"expected a torch.nn.Module, got {type(module).__name__}")
    named = [(n, m) for n, m in module.named_modules()]
    if patterns:
        chosen: dict[str, nn.Module] = {}
        for pat in patterns:
            hits = [(n, m) for n, m in named if n and fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise AuditError(
                    f"--layers: no module matches {pat!r}; give module names or glob patterns; candidates: {_candidates(module)}"
                )
            chosen.update(hits)
        return [AttentionLayer(n, m, attention_kind(m) or "selected") for n, m in named if n in chosen]
    found: list[AttentionLayer] = []
    for n, m in named:
        kind = attention_kind(m)
        if kind is None:
            continue
        if any(n == f.name or (f.name == "" or n.startswith(f.name + ".")) for f in found):
            continue  # inside a layer already found
        found.append(AttentionLayer(n, m, kind))
    if not found:
        raise AuditError(
            f"no attention layer found in {type(module).__name__} (looked for attnaudit.models.vit.Attention, "
            "torch.nn.MultiheadAttention and modules named *Attention owning query/key projections); choose layers "
            f"with --layers; candidates: {_candidates(module)}"
        )
    return found


# --------------------------------------------------------------------------- statistics


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


def _log10(k: float) -> float:
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
        return np.array([_log10(k) for k in self.kappa_full])

    @property
    def log10_kappa_rank(self) -> np.ndarray:
        return np.array([_log10(k) for k in self.kappa_rank])

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
class EntkResult:
    """Conditioning of the empirical NTK Gram K = (1/c) sum_a J_a J_a^T of the whole model on the batch."""

    n: int
    n_params: int
    n_outputs: int
    report: ConditionReport
    widths: list[WidthEstimate]
    seconds: float
    chunk: int  # samples per Jacobian chunk (memory plan)
    matrix: np.ndarray = field(repr=False)

    def to_dict(self) -> dict:
        return {
            "form": "K = (1/c) sum_a J_a J_a^T: mean over the c outputs of the logits' Jacobian Grams (n x n, float64)",
            "n": self.n,
            "parameters": self.n_params,
            "outputs": self.n_outputs,
            "rank_tolerance_dims": "max(n, c * parameters) (K is the Gram of the n x cP stacked Jacobian)",
            "gram": self.report.to_dict(),
            "width_estimates": [w.to_dict() for w in self.widths],
            "seconds": self.seconds,
            "jacobian_chunk_samples": self.chunk,
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


# --------------------------------------------------------------------------- capture


def _as_tokens(t: Any, name: str, role: str, multihead: bool = False, batch_first: bool = True) -> torch.Tensor:
    """The (batch, tokens, features) tensor of a layer's input or output."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise AuditError(
            f"layer {name}: no floating-point token tensor in its {role}; choose attention layers with --layers"
        )
    if multihead:
        t = t.unsqueeze(0) if t.ndim == 2 else (t if batch_first else t.transpose(0, 1))
    if t.ndim != 3:
        raise AuditError(
            f"layer {name}: its {role} has shape {tuple(t.shape)}; per-layer kappa needs token tensors "
            "(batch, tokens, features) -- choose attention layers with --layers"
        )
    return t


def _layer_input(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    for key in _INPUT_KEYWORDS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _layer_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    for attr in ("last_hidden_state", "hidden_states"):
        if isinstance(getattr(output, attr, None), torch.Tensor):
            return getattr(output, attr)
    return None


def _mha_weights(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor:
    """Per-head maps (B, H, L, S) of one MultiheadAttention call, from the module itself."""
    bound = inspect.signature(mod.forward).bind(*args, **kwargs)
    bound.arguments["need_weights"] = True
    bound.arguments["average_attn_weights"] = False
    _, w = mod.forward(*bound.args, **bound.kwargs)  # forward, not __call__: the hooks do not fire again
    assert w is not None  # need_weights=True
    return w.unsqueeze(0) if w.ndim == 3 else w


def _attention_maps(
    layer: AttentionLayer, args: tuple, kwargs: dict, output: Any, tokens_in: torch.Tensor
) -> tuple[torch.Tensor | None, str]:
    mod = layer.module
    if layer.kind == "builtin":
        assert isinstance(mod, Attention)  # attention_kind
        return mod.weights(tokens_in), "attnaudit.models.vit.Attention.weights(h): the module's own maps"
    if layer.kind == "multihead":
        assert isinstance(mod, nn.MultiheadAttention)  # attention_kind
        return _mha_weights(mod, args, kwargs), "re-run with need_weights=True, average_attn_weights=False"
    if isinstance(output, (tuple, list)) and len(output) > 1 and isinstance(output[1], torch.Tensor):
        w = output[1]
        B, L = tokens_in.shape[0], tokens_in.shape[1]
        if w.ndim == 4 and w.shape[0] == B and w.shape[2] == L:
            return w, "returned by the module as its second output (eager attention)"
    return None, "the module does not expose its attention maps: token Grams only"


class _Record:
    """Spectra captured for one layer, chunk by chunk."""

    def __init__(self, layer: AttentionLayer):
        self.layer = layer
        self.calls = 0
        self.order: int | None = None
        self.spec_in: list[np.ndarray] = []
        self.spec_out: list[np.ndarray] = []
        self.svals: list[np.ndarray] = []
        self.shape_in: tuple[int, int] | None = None
        self.shape_out: tuple[int, int] | None = None
        self.maps_shape: tuple[int, int] | None = None
        self.note = ""
        self.real_tokens: list[np.ndarray] = []  # per sample, when padding is excluded
        self.padding_note = ""


def gram_spectra(tokens: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (B, min(N, D)) of the token Grams X_b X_b^T of tokens (B, N, D), descending, float64.

    Taken from the smaller of X X^T and X^T X (same non-zero spectrum), batched.
    """
    X = tokens.to(torch.float64)
    N, D = X.shape[-2], X.shape[-1]
    M = X @ X.transpose(-2, -1) if N <= D else X.transpose(-2, -1) @ X
    return torch.linalg.eigvalsh(_small_on_cpu(M)).flip(-1)


def _small_on_cpu(M: torch.Tensor) -> torch.Tensor:
    """A batch of small matrices moved to the CPU for its decomposition: CUDA runs a batched
    eigvalsh/svdvals of matrices above 32 x 32 as one solver call per matrix (measured on an
    H200: per-layer kappa of a DeiT-tiny on 512 images took 59 s there against 10 s on 2 CPU
    cores), while LAPACK on the CPU takes the whole batch at once. The products that form the
    matrices stay on the device."""
    return M.cpu() if M.is_cuda and M.shape[-1] <= 1024 and M.shape[-2] <= 1024 else M


def _capture(record: _Record, args: tuple, kwargs: dict, output: Any, keep: torch.Tensor | None = None) -> None:
    """Spectra of one layer's call. ``keep`` (B, L) bool: the real (non-padding) tokens of the
    batch; when the layer's tokens line up with them (L positions), padding rows of the token
    matrices and padding rows and columns of the attention maps are zeroed, so each sample's
    spectrum is its real tokens' plus zeros, which :meth:`SpectrumSummary.of` cuts off."""
    layer = record.layer
    where = layer.name
    mha = layer.kind == "multihead"
    batch_first = bool(getattr(layer.module, "batch_first", True))
    x_in = _as_tokens(_layer_input(layer.module, args, kwargs), where, "input", mha, batch_first)
    x_out = _as_tokens(_layer_output(output), where, "output", mha, batch_first)
    record.calls += 1
    record.shape_in = (x_in.shape[1], x_in.shape[2])
    record.shape_out = (x_out.shape[1], x_out.shape[2])
    maps, note = _attention_maps(layer, args, kwargs, output, x_in)
    record.note = note
    if keep is not None:
        aligned = keep.shape[0] == x_in.shape[0] and keep.shape[1] == x_in.shape[1] == x_out.shape[1]
        if aligned:
            k = keep.to(device=x_in.device, dtype=torch.float64)
            x_in = x_in.to(torch.float64) * k[:, :, None]
            x_out = x_out.to(torch.float64) * k[:, :, None]
            if maps is not None and maps.shape[-1] == maps.shape[-2] == keep.shape[1]:
                maps = maps.to(torch.float64) * k[:, None, :, None] * k[:, None, None, :]
            record.real_tokens.append(keep.sum(1).cpu().numpy())
            record.padding_note = "padding excluded: each sequence's Grams and maps over its real tokens"
        else:
            record.padding_note = (
                f"padding included: the layer's {x_in.shape[1]} tokens do not line up with the "
                f"{keep.shape[1]} input positions"
            )
    record.spec_in.append(gram_spectra(x_in).cpu().numpy())
    record.spec_out.append(gram_spectra(x_out).cpu().numpy())
    if maps is not None:
        maps = maps.to(torch.float64)
        record.maps_shape = (maps.shape[-2], maps.shape[-1])
        record.svals.append(torch.linalg.svdvals(_small_on_cpu(maps)).cpu().numpy())  # (B, H, min(L, S)), descending


@contextlib.contextmanager
def softmax_in_input_dtype() -> Iterator[None]:
    """Softmax computed in its input's dtype when a lower-precision ``dtype=`` is asked for.

    Hugging Face's eager attention (the path that returns the maps) calls
    ``softmax(scores, dtype=torch.float32)`` even for float64 scores, which would round the
    maps and the outputs of the float64 copy to float32 (measured: 8e-10 off the model's own
    sdpa output on a tiny ViT; kappa of a map above ~1e7 would be noise). Inside this context
    ``torch.nn.functional.softmax``, ``torch.softmax`` and ``Tensor.softmax`` keep float64;
    all three are restored on exit. Not thread-safe: other threads see the wrapped functions
    while it is active.
    """
    import torch.nn.functional as F

    orig_f, orig_t, orig_m = F.softmax, torch.softmax, torch.Tensor.softmax

    def keep(dtype, x):
        if dtype is not None and x.is_floating_point() and torch.finfo(dtype).bits < torch.finfo(x.dtype).bits:
            return None
        return dtype

    def f_softmax(input, dim=None, _stacklevel=3, dtype=None):
        return orig_f(input, dim=dim, dtype=keep(dtype, input))

    def t_softmax(input, dim, dtype=None):
        return orig_t(input, dim, dtype=keep(dtype, input))

    def m_softmax(self, dim, dtype=None):
        return orig_m(self, dim, dtype=keep(dtype, self))

    # patching functions and a method on purpose (restored below), which the type checker refuses
    # patched on purpose (restored below); the stubs type torch.softmax with ``out=`` and refuse method assignment
    F.softmax = f_softmax
    torch.softmax = t_softmax  # type: ignore[assignment]
    torch.Tensor.softmax = m_softmax  # type: ignore[method-assign]
    try:
        yield
    finally:
        F.softmax = orig_f
        torch.softmax = orig_t
        torch.Tensor.softmax = orig_m  # type: ignore[method-assign]


def _float64_copy(module: nn.Module, device: torch.device) -> nn.Module:
    """A float64 copy on ``device``, Hugging Face models switched to eager attention (maps returned)."""
    twin = copy.deepcopy(module)
    twin.to(device=device, dtype=torch.float64)
    for sub in twin.modules():
        setter = getattr(sub, "set_attn_implementation", None)
        if callable(setter) and hasattr(sub, "config"):
            try:
                setter("eager")
            except Exception:  # noqa: BLE001 - a model without an eager path keeps its own; maps may then be missing
                pass
    twin.eval()
    return twin


def _as_task(model: Any, X: torch.Tensor):

    if isinstance(model, LoadedModel):
        return model.task()
    if isinstance(model, Task):
        return model
    if isinstance(model, nn.Module):
        declare = getattr(model, "audit_inputs", None)  # a model's optional declaration of its inputs
        declared = declare() if callable(declare) else None
        return as_task(model, inputs=declared if declared is not None else Inputs(), probe=X[:1].to(torch.float64))
    raise AuditError(f"expected a Task, a LoadedModel or a torch.nn.Module, got {type(model).__name__}")


def _draw(X: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, list[int] | None]:
    if X.shape[0] <= n:
        return X, None
    gen = torch.Generator().manual_seed(int(seed))
    idx = torch.randperm(X.shape[0], generator=gen)[:n].sort().values
    return X[idx], idx.tolist()


# --------------------------------------------------------------------------- the analysis


def entk_gram(
    task: Any, X: torch.Tensor, memory_bytes: int = 1 << 30, device: str | torch.device | None = None
) -> tuple[np.ndarray, int, int, int]:
    """(K, P, c, chunk): the empirical NTK Gram K = (1/c) sum_a J_a J_a^T (n x n, float64) of all
    trainable parameters, from the engine's per-sample Jacobians (:meth:`Engine.jacobian`).

    Memory plan: a Jacobian takes c P 8 bytes per sample; rows go in chunks such that two
    chunks fit ``memory_bytes``. When all n Jacobians fit the budget they are computed once;
    otherwise only the upper block triangle is formed (chunk i against chunks j >= i), so
    m chunks cost m (m + 1) / 2 Jacobian passes instead of m + m^2.
    """

    task = _as_task(task, X)
    engine = Engine(task, dtype=torch.float64, device=device, probe=X[:1].to(torch.float64))
    rows = engine.rows(X)
    n = rows.shape[0]
    c = int(engine.logits(rows[:1]).shape[1])
    P = engine.n_params
    per_sample = max(1, c * P * 8)
    if 2 * per_sample > memory_bytes:
        raise AuditError(
            f"--gram entk: one sample's Jacobian ({c} outputs x {P:,} parameters, float64) takes "
            f"{per_sample / 2**30:.3g} GiB and two must fit the {memory_bytes / 2**30:.3g} GiB budget; the eNTK Gram of "
            "this model is out of reach here -- use --gram tokens"
        )
    chunk = max(1, int(memory_bytes // (2 * per_sample)))
    blocks = list(ranges(n, chunk))
    K = torch.empty(n, n, dtype=torch.float64)

    def gram(J1: torch.Tensor, J2: torch.Tensor) -> torch.Tensor:
        return (torch.einsum("iap,jap->ij", J1, J2) / c).detach().cpu()

    if n * per_sample <= memory_bytes:
        J = [engine.jacobian(rows[a:b]) for a, b in blocks]
        for i, (a1, b1) in enumerate(blocks):
            for j, (a2, b2) in enumerate(blocks[i:], start=i):
                block = gram(J[i], J[j])
                K[a1:b1, a2:b2] = block
                K[a2:b2, a1:b1] = block.T
    else:
        for i, (a1, b1) in enumerate(blocks):
            J1 = engine.jacobian(rows[a1:b1])
            K[a1:b1, a1:b1] = gram(J1, J1)
            for a2, b2 in blocks[i + 1 :]:
                block = gram(J1, engine.jacobian(rows[a2:b2]))
                K[a1:b1, a2:b2] = block
                K[a2:b2, a1:b1] = block.T
    K = 0.5 * (K + K.T)
    return K.numpy(), P, c, chunk


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
    task = _as_task(model, X)
    X, rows = _draw(X, config.n, config.seed)
    first = next((t for t in (*task.module.parameters(), *task.module.buffers()) if t.is_floating_point()), None)
    device = (
        torch.device(config.device) if config.device else (first.device if first is not None else torch.device("cpu"))
    )
    twin = _float64_copy(task.module, device)
    for part in twin.modules():
        if getattr(part, "trim_padding", False):
            # per-layer spectra are stacked over chunks at the data's full length (padding
            # is excluded by the token mask instead)
            setattr(part, "trim_padding", False)  # noqa: B010 - an attribute of HFSequenceClassifier
    layers = find_attention_layers(twin, config.layers)
    records = {layer.name: _Record(layer) for layer in layers}
    order: list[str] = []
    handles = []
    busy = [False]  # a layer's maps are recomputed inside its hook: calls made then are not the model's
    keep_now: list[torch.Tensor | None] = [None]  # the current chunk's real tokens (text models with padding)
    token_mask = getattr(twin, "token_mask", None)
    for layer in layers:
        rec = records[layer.name]

        def hook(mod, args, kwargs, output, rec=rec):
            if busy[0]:
                return
            if rec.order is None:
                rec.order = len(order)
                order.append(rec.layer.name)
            busy[0] = True
            try:
                _capture(rec, args, kwargs, output, keep_now[0])
            finally:
                busy[0] = False

        handles.append(layer.module.register_forward_hook(hook, with_kwargs=True))
    Xd = X.to(device=device, dtype=torch.float64)
    try:
        with torch.no_grad(), math_attention(), softmax_in_input_dtype():
            for a, b in ranges(Xd.shape[0], config.chunk):
                before = {k: r.calls for k, r in records.items()}
                batch = task.inputs(Xd[a:b])
                keep_now[0] = token_mask(batch) if callable(token_mask) else None
                to_logits(task.inputs.call(twin, batch))
                for name, rec in records.items():
                    ran = rec.calls - before[name]
                    if ran == 0:
                        raise AuditError(
                            f"layer {name} did not run in the model's forward pass; choose layers that run with --layers"
                        )
                    if ran > 1:
                        raise AuditError(
                            f"layer {name} runs {ran} times per forward pass (shared weights); per-layer kappa needs one call "
                            "per layer -- choose other modules with --layers"
                        )
    finally:
        for h in handles:
            h.remove()
    t_layers = time.perf_counter()

    results: list[LayerKappa] = []
    for rec in sorted(records.values(), key=lambda r: r.order if r.order is not None else 1 << 30):
        layer = rec.layer
        assert rec.shape_in is not None and rec.shape_out is not None  # every layer ran (checked above)
        N, D = rec.shape_in
        No, Do = rec.shape_out
        real = np.concatenate(rec.real_tokens) if rec.real_tokens else None
        s_in = SpectrumSummary.of(np.concatenate(rec.spec_in), N, D, config.rank_tol, real)
        s_out = SpectrumSummary.of(np.concatenate(rec.spec_out), No, Do, config.rank_tol, real)
        heads = None
        if rec.svals:
            sv = np.concatenate(rec.svals)  # (B, H, k)
            assert rec.maps_shape is not None  # recorded with the singular values
            L, S = rec.maps_shape
            # a square map over the padded positions is a map over the real tokens (rows and columns zeroed)
            on_real = real if real is not None and L == S == N else None
            heads = [SpectrumSummary.of(sv[:, h, :], L, S, config.rank_tol, on_real) for h in range(sv.shape[1])]
        if real is not None:
            # the width formula's N: a sequence's tokens, here the median real length
            N = No = max(1, int(np.median(real)))
        amp = Amplification(
            s_in.log10_kappa,
            s_out.log10_kappa,
            precision_limit_log10=-math.log10(max(No, Do) * EPS64),
        )
        med_in, med_out = s_in.spread(), s_out.spread()
        med_in_r, med_out_r = s_in.spread_rank(), s_out.spread_rank()

        def kappa_of(log_med: float) -> float:
            return math.inf if math.isinf(log_med) else (10.0**log_med if math.isfinite(log_med) else math.inf)

        median_note = "not computed: median kappa over samples"
        tok = "m ~ kappa^6 N ln N of the token Gram (the paper's formula, N = tokens; Omega constant omitted)"
        widths = [
            width_estimate(
                kappa_of(med_in.median),
                N,
                "input token Gram, median kappa_d: kappa^6 N ln N (N = tokens)",
                basis="kappa_d",
                formula=tok,
                interval_method=median_note,
            ),
            width_estimate(
                kappa_of(med_in_r.median),
                N,
                "input token Gram, median kappa at numerical rank (N = tokens)",
                basis="numerical_rank",
                formula=tok,
                interval_method=median_note,
            ),
            width_estimate(
                kappa_of(med_out.median),
                No,
                "output token Gram, median kappa_d (N = tokens)",
                basis="kappa_d",
                formula=tok,
                interval_method=median_note,
            ),
            width_estimate(
                kappa_of(med_out_r.median),
                No,
                "output token Gram, median kappa at numerical rank (N = tokens)",
                basis="numerical_rank",
                formula=tok,
                interval_method=median_note,
            ),
        ]
        results.append(
            LayerKappa(
                name=layer.name,
                kind=layer.kind,
                class_name=layer.class_name,
                depth=len(results),
                tokens=N,
                features_in=D,
                features_out=Do,
                input=s_in,
                output=s_out,
                heads=heads,
                attention_note=(
                    rec.note
                    if layer.kind != "selected" or heads is not None
                    else "selected by --layers: token Grams only"
                )
                + (f"; {rec.padding_note}" if rec.padding_note else ""),
                amplification=amp,
                widths=widths,
            )
        )
    timings = {"layers": t_layers - t0, "spectra": time.perf_counter() - t_layers}

    entk = None
    if config.gram == "entk":
        te = time.perf_counter()
        K, P, c, chunk = entk_gram(task, X, config.memory_bytes, device)
        lam = np.linalg.eigvalsh(K)[::-1]
        n = K.shape[0]
        rep = condition_report(lam, n, c * P, config.rank_tol)
        secs = time.perf_counter() - te
        entk = EntkResult(
            n=n,
            n_params=P,
            n_outputs=c,
            report=rep,
            widths=width_rows(
                rep,
                "eNTK Gram kappa_d: kappa^6 n ln n (n = samples)",
                "eNTK Gram at numerical rank (n = samples)",
                "m ~ kappa_d(K)^6 n ln n: the paper's formula evaluated on the eNTK Gram K (the paper's kappa is "
                "the input Gram's); Omega constant omitted",
                "m ~ kappa_r(K)^6 n ln n at the numerical rank r of K; Omega constant omitted",
                what="K",
            ),
            seconds=secs,
            chunk=chunk,
            matrix=K,
        )
        timings["entk"] = secs
    timings["total"] = time.perf_counter() - t0
    result = LayerKappaResult(label or task.name, int(X.shape[0]), results, entk, config, timings, rows)
    result.verdicts = _verdicts(result)
    return result


def _fmt_log(v: float, digits: int = 2) -> str:
    if math.isnan(v):
        return "-"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}f}"


def _spread_text(s: Spread | None, digits: int = 2) -> str:
    if s is None or s.n == 0:
        return "-"
    text = f"{_fmt_log(s.median, digits)} [{_fmt_log(s.p10, digits)}, {_fmt_log(s.p90, digits)}]"
    return text + (f" (of {s.n}; {s.n_undefined} undefined)" if s.n_undefined else "")


def _verdicts(result: LayerKappaResult) -> list[str]:
    out = []
    for layer in result.layers:
        si, so = layer.input.spread(), layer.output.spread()
        ex = Spread.of(layer.amplification.exponent)
        over = f" over the {ex.n} samples where it is defined" if ex.n_undefined else ""
        text = (
            f"{result.label} {layer.name}: median log10 kappa of the token Gram {_fmt_log(si.median)} (input) -> "
            f"{_fmt_log(so.median)} (output), exponent {_fmt_log(ex.median)}{over} (linearized prediction 3)"
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
            text += f"; attention matrix median log10 kappa {_fmt_log(att.median)} over {len(layer.heads)} heads"
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


# --------------------------------------------------------------------------- report


def build_tables(result: LayerKappaResult | Sequence[LayerKappaResult]) -> list:
    """Rich tables (per layer; attention heads; eNTK) and verdict lines for one or more models."""
    from rich.console import JustifyMethod
    from rich.table import Table
    from rich.text import Text

    results = [result] if isinstance(result, LayerKappaResult) else list(result)
    out: list = []
    for res in results:
        t = Table(
            title=Text(
                f"per-layer kappa: {res.label} on {res.samples} samples "
                "(log10 kappa of token Grams, median [p10, p90] over samples; float64)"
            )
        )
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("layer", "left"),
            ("N x D", "right"),
            ("input", "right"),
            ("output", "right"),
            ("predicted 3*in", "right"),
            ("exponent", "right"),
            ("rank-def. in/out", "right"),
            ("attention A", "right"),
            ("log10 m (in)", "right"),
        )
        for col, just in columns:
            t.add_column(col, justify=just)
        for layer in res.layers:
            amp = layer.amplification
            w = layer.widths[0]
            t.add_row(
                Text(layer.name),
                f"{layer.tokens} x {layer.features_in}",
                _spread_text(layer.input.spread()),
                _spread_text(layer.output.spread()),
                _spread_text(Spread.of(amp.predicted_log10_out)),
                _spread_text(Spread.of(amp.exponent)),
                f"{layer.input.rank_deficient}/{layer.output.rank_deficient} of {layer.input.samples}",
                _spread_text(layer.attention_all_heads) if layer.heads else "n/a",
                "inf" if w.log10_width is None else f"{w.log10_width:.1f}",
            )
        out.append(t)
        with_heads = [layer for layer in res.layers if layer.heads]
        if with_heads:
            h = Table(title=Text(f"attention matrices: {res.label} (log10 s_max/s_min per head, median [p10, p90])"))
            for col in ("layer", "head", "log10 kappa", "at numerical rank", "singular maps", "rank (min/median)"):
                h.add_column(col, justify="left" if col == "layer" else "right")
            for layer in with_heads:
                for i, head in enumerate(layer.heads or []):  # not empty: with_heads
                    h.add_row(
                        Text(layer.name),
                        str(i),
                        _spread_text(head.spread()),
                        _spread_text(head.spread_rank()),
                        f"{head.rank_deficient}/{head.samples}",
                        f"{int(head.rank.min())}/{float(np.median(head.rank)):g} of {head.k}",
                    )
            out.append(h)
        if res.entk is not None:
            r = res.entk.report
            e = Table(title=Text(f"empirical NTK Gram: {res.label}, K = (1/c) sum_a J_a J_a^T on {r.n} samples"))
            e.add_column("quantity")
            e.add_column("value", justify="right")
            e.add_row("parameters P, outputs c", f"{res.entk.n_params:,}, {res.entk.n_outputs}")
            e.add_row("numerical rank / n", f"{r.numerical_rank} / {r.k}")
            e.add_row("kappa_d", "inf (rank deficient)" if r.rank_deficient else f"{r.kappa_full:.4g}")
            e.add_row(f"kappa at numerical rank {r.numerical_rank}", f"{r.kappa_rank:.4g}")
            for w in res.entk.widths:
                e.add_row(f"log10 m, {w.label}", "inf" if w.log10_width is None else f"{w.log10_width:.2f}")
            e.add_row("seconds", f"{res.entk.seconds:.1f}")
            out.append(e)
        out.extend(f"- {v}" for v in res.verdicts)
    return out


def plot_layer_kappa(result: LayerKappaResult | Sequence[LayerKappaResult], path: str | Path, title: str = "") -> None:
    """Kappa by depth: median log10 kappa (bars: 10th-90th percentile) of the input and output
    token Grams, the linearized prediction 3 log10 kappa(in) and the attention matrices; right
    panel: the measured exponent against 3. Infinite medians are drawn as triangles at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [result] if isinstance(result, LayerKappaResult) else list(result)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.0, 4.6))
    markers = ("o", "s", "^", "D", "v", "P")
    finite_tops = [1.0]
    series = []
    for m_i, res in enumerate(results):
        depth = np.arange(len(res.layers))
        prefix = f"{res.label}: " if len(results) > 1 else ""
        marker = markers[m_i % len(markers)]
        rows = {
            "input Gram": ([layer.input.spread() for layer in res.layers], "tab:blue", "-"),
            "output Gram": ([layer.output.spread() for layer in res.layers], "tab:red", "-"),
            "predicted 3 log10 kappa(in)": (
                [Spread.of(layer.amplification.predicted_log10_out) for layer in res.layers],
                "tab:red",
                "--",
            ),
            "attention matrix (all heads)": (
                [layer.attention_all_heads or Spread.of([]) for layer in res.layers],
                "tab:green",
                ":",
            ),
        }
        for which, color in (("input", "tab:blue"), ("output", "tab:red")):
            spreads = rows[f"{which} Gram"][0]
            if any(math.isinf(sp.median) for sp in spreads):  # kappa_d infinite: show kappa at the numerical rank too
                rows[f"{which} Gram at numerical rank"] = (
                    [getattr(layer, which).spread_rank() for layer in res.layers],
                    color,
                    "-.",
                )
        for name, (spreads, color, style) in rows.items():
            series.append((depth, spreads, color, style, marker, prefix + name))
            finite_tops.extend(s.p90 for s in spreads if math.isfinite(s.p90))
            finite_tops.extend(s.median for s in spreads if math.isfinite(s.median))
        ex = [Spread.of(layer.amplification.exponent) for layer in res.layers]
        med = np.array([s.median for s in ex])
        ok = np.isfinite(med)
        if ok.any():
            lo = med - np.array([s.p10 for s in ex])
            hi = np.array([s.p90 for s in ex]) - med
            ax2.errorbar(
                depth[ok],
                med[ok],
                yerr=[np.where(np.isfinite(lo), lo, 0)[ok], np.where(np.isfinite(hi), hi, 0)[ok]],
                marker=marker,
                capsize=3,
                label=f"{prefix}measured",
                color="tab:purple",
            )
    top = max(finite_tops) * 1.1 + 0.5
    for k, (depth, spreads, color, style, marker, label) in enumerate(series):
        med = np.array([s.median for s in spreads])
        fin = np.isfinite(med)
        if fin.any():
            lo = np.array([s.median - s.p10 if math.isfinite(s.p10) else 0.0 for s in spreads])
            hi = np.array(
                [s.p90 - s.median if math.isfinite(s.p90) and math.isfinite(s.median) else 0.0 for s in spreads]
            )
            ax.errorbar(
                depth[fin],
                med[fin],
                yerr=[lo[fin], hi[fin]],
                color=color,
                linestyle=style,
                marker=marker,
                capsize=3,
                label=label,
            )
        inf = np.isposinf(med)
        if inf.any():
            shift = 0.04 * (k - (len(series) - 1) / 2)  # side by side, not on top of each other
            ax.scatter(
                depth[inf] + shift,
                np.full(inf.sum(), top),
                marker="^",
                s=80,
                color=color,
                zorder=3,
                label=f"{label}: infinite (rank deficient)",
            )
    names = results[0].layers
    for a in (ax, ax2):
        a.set_xlim(-0.5, max(len(r.layers) for r in results) - 0.5)
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels([layer.name for layer in names], rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("layer (forward order)")
    ax.set_ylabel("log10 kappa (median, 10-90 %)")
    ax.set_title("conditioning by depth")
    ax.legend(fontsize=7)
    ax2.axhline(3.0, color="black", linestyle="--", linewidth=1, label="linearized prediction 3")
    ax2.set_xticks(np.arange(len(names)))
    ax2.set_xticklabels([layer.name for layer in names], rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("log10 kappa(out) / log10 kappa(in)")
    ax2.set_title("measured amplification exponent")
    ax2.legend(fontsize=7)
    entk = [
        (f"{r.label}: " if len(results) > 1 else "")
        + "eNTK kappa_d "
        + ("inf (rank deficient)" if r.entk.report.rank_deficient else f"{r.entk.report.kappa_full:.3g}")
        for r in results
        if r.entk is not None
    ]
    full_title = " | ".join([t for t in [title, *entk] if t])
    if full_title:
        fig.suptitle(full_title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
