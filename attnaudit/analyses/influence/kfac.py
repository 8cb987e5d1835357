"""Kronecker-factored curvature (K-FAC and EK-FAC) of the linear layers of any module.

For a linear layer y = W a (+ b) inside a model f trained on the mean loss
(1/n) sum_i l(f(x_i), y_i), the Gauss-Newton block of the layer's parameters is

    GGN = (1/n) sum_i sum_k vec(G_ik) vec(G_ik)^T,   G_ik = sum_t s_ikt a_it^T,

where a_it is the layer's input at token t of sample i (a constant 1 appended for the bias)
and s_ikt = d(f_i . L_i[:, k]) / d y_it is the back-propagated k-th column of a square root
of the loss's output Hessian, L_i L_i^T = d^2 l / d f^2 (MSE: L = I; cross-entropy:
L = diag(sqrt p) - p sqrt(p)^T, since diag(p) - p p^T = L L^T). These columns are computed
exactly, one backward pass each (no sampled labels), so the factors carry no Monte-Carlo
noise. Flattening G row-major, vec(s a^T) = s (x) a, so

* **K-FAC**: GGN ~ S (x) A with A = (1/(n T)) sum_it a a^T and S = (1/n) sum_ikt s s^T (the
  "expand" convention for T tokens; exact for one sample, and for the output layer under MSE
  where S is the identity). (S (x) A + lambda I)^-1 vec(V) = vec(Q_S [(Q_S^T V Q_A) /
  (Lambda_S Lambda_A^T + lambda)] Q_A^T) with the eigendecompositions of A and S.
* **EK-FAC** (George et al. 2018): the same eigenbases, but the eigenvalues replaced by the
  second moments of the gradients in that basis, Lambda*_ol = (1/n) sum_ik
  ((Q_S^T G_ik Q_A)_ol)^2 -- the best diagonal fit in the Kronecker eigenbasis, which makes
  the approximation exact on the diagonal of the rotated GGN.

Damping: absolute lambda, or relative ``"<m>x"`` = m times the mean eigenvalue of each
layer's Lambda (K-FAC: Lambda_S Lambda_A^T; EK-FAC: Lambda*). Covered: ``nn.Linear`` modules
whose weight (and bias) are all tracked, and the two projections of a self-attention
``nn.MultiheadAttention`` (its packed ``in_proj`` as one linear layer E -> 3E, and
``out_proj``). That module applies them inside its functional forward without calling
``out_proj``, so hooks cannot see them; while the factors are fitted, a temporary forward hook
replaces the module's output by the same computation written with visible projections,
checked against the module's own output (a mismatch is refused, never silently used). An
``nn.Conv2d`` (one group, zero padding) is a linear layer on its unfolded input patches, with
the output positions as tokens (Grosse & Martens' KFC; a ViT's patch embedding is the case
stride = kernel). Transformers' ``Conv1D`` (GPT-2's projections, y = x W + b with W stored
(d_in, d_out)) is a linear layer whose weight is read transposed. Every other tracked parameter (embeddings, norms, other convolutions,
``nn.Linear`` subclasses, attention with ``add_bias_kv``/``add_zero_attn`` or separate k/v
dimensions) is listed in ``excluded``
and left out of the influence (its block is treated as absent), with a warning from the
caller.

Causal language models (:class:`~attnaudit.core.task.NextTokenLoss`, logits (B, L, V)): the
per-document loss l_i = sum_t w_t CE_t / W_i, W_i = max(1, sum_t w_t), has a block-diagonal
output Hessian, H_t = (w_t / W_i)(diag p_t - p_t p_t^T), whose root is taken per position
(:func:`output_hessian_root`); the tokens of the covariances are the real tokens (the model's
``token_mask``; padding never enters A). The exact columns cost one backward pass per position
and vocabulary column, so a language model's ``auto`` curvature is the sampled Fisher (one label
drawn per weighted position, all in one pass; kronfluence's choice) and ``ggn`` is refused above
:data:`EXACT_LM_COLUMNS` passes.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from attnaudit.core.contraction import contract
from attnaudit.core.engine import Engine, ranges
from attnaudit.core.precision import tensor_bits
from attnaudit.core.lm_rows import split_targets
from attnaudit.core.task import CrossEntropyLoss, MSELoss, NextTokenLoss
from attnaudit.analyses.request import FieldError, literal
from attnaudit.errors import AuditError
from attnaudit.runtime.atomic import write_bytes_atomic

KINDS = ("kfac", "ekfac")


@dataclass
class LinearBlock:
    """One covered linear layer: its module path, parameter names and Kronecker factors."""

    path: str
    weight: str
    bias: str | None
    d_in: int
    d_out: int
    A: torch.Tensor | None = None  # (d_in + bias, d_in + bias)
    S: torch.Tensor | None = None  # (d_out, d_out)
    QA: torch.Tensor | None = None
    QS: torch.Tensor | None = None
    lamA: torch.Tensor | None = None
    lamS: torch.Tensor | None = None
    corrected: torch.Tensor | None = None  # (d_out, d_in + bias): EK-FAC eigenvalues
    #: where the layer's activations come from: an ``nn.Linear`` module (``"linear"``), the
    #: packed input / output projection of the ``nn.MultiheadAttention`` at ``module``, or an
    #: ``nn.Embedding`` read as a linear layer on one-hot rows (``"embedding"``; d_in the table's
    #: rows, d_out its width; the weight is stored transposed, (d_in, d_out); the projected
    #: estimator only: K-FAC's A would be d_in x d_in)
    source: str = "linear"
    module: str = ""
    padding_idx: int | None = None  # embedding: the row that never receives a gradient

    @property
    def width_in(self) -> int:
        return self.d_in + (1 if self.bias else 0)

    @property
    def transposed(self) -> bool:
        """Whether the weight is stored (d_in, d_out), the transpose of ``nn.Linear``'s (d_out, d_in):
        an embedding table, or transformers' ``Conv1D`` (GPT-2's projections, y = x W + b)."""
        return self.source in ("embedding", "conv1d")

    def eigenvalues(self, kind: str) -> torch.Tensor:
        if kind == "ekfac":
            assert self.corrected is not None  # fitted (or loaded) with the factors
            return self.corrected
        assert self.lamS is not None and self.lamA is not None  # fitted (or loaded) with the factors
        return self.lamS[:, None] * self.lamA[None, :]


@dataclass
class KroneckerFactors:
    """The fitted factors of every covered layer, and what was left out."""

    kind: str
    blocks: list[LinearBlock]
    excluded: list[str]
    n_samples: int
    names: list[str]  # covered parameter names, in the engine's order
    diagnostics: dict = field(default_factory=dict)

    def memory_bytes(self) -> int:
        return kfac_memory_bytes(self.blocks, keep_covariances=all(b.A is not None for b in self.blocks))

    def precondition(self, grads: torch.Tensor, engine: Engine, damping: float | str) -> torch.Tensor:
        """(F + lambda I)^-1 applied to each row of ``grads`` (k, P) over ``engine.names``
        (rows of parameters outside the covered layers come back as zeros)."""
        out = torch.zeros_like(grads, dtype=torch.float64)
        offsets = dict(zip(engine.names, _offsets(engine)))
        for b in self.blocks:
            o_w, n_w = offsets[b.weight]
            V = as_linear_layout(b, grads[:, o_w : o_w + n_w].to(torch.float64))
            if b.bias:
                o_b, n_b = offsets[b.bias]
                V = torch.cat([V, grads[:, o_b : o_b + n_b].to(torch.float64)[:, :, None]], 2)
            lam = b.eigenvalues(self.kind)
            d = resolve_damping(damping, lam)
            QS, QA = b.QS, b.QA
            assert QS is not None and QA is not None  # fitted (or loaded) with the factors
            rotated = QS.T @ V @ QA
            solved = QS @ (rotated / (lam + d)) @ QA.T
            out[:, o_w : o_w + n_w] = from_linear_layout(b, solved[:, :, : b.d_in])
            if b.bias:
                out[:, o_b : o_b + n_b] = solved[:, :, b.d_in]
        return out.to(grads.dtype)


def as_linear_layout(block: LinearBlock, flat: torch.Tensor) -> torch.Tensor:
    """(..., d_out, d_in): rows of a layer's flattened weight (..., d_in d_out) in ``nn.Linear``'s layout."""
    if block.transposed:
        return flat.reshape(*flat.shape[:-1], block.d_in, block.d_out).transpose(-1, -2)
    return flat.reshape(*flat.shape[:-1], block.d_out, block.d_in)


def from_linear_layout(block: LinearBlock, W: torch.Tensor) -> torch.Tensor:
    """(..., d_in d_out): matrices (..., d_out, d_in) in ``nn.Linear``'s layout flattened like the weight."""
    if block.transposed:
        W = W.transpose(-1, -2)
    return W.reshape(*W.shape[:-2], -1)


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear layers: weight (d_in, d_out),
    y = x W + b), recognised by class without importing transformers."""
    cls = type(module)
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__.startswith("transformers.")
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and isinstance(bias, torch.Tensor)
    )


def resolve_damping(damping: float | str, eigenvalues: torch.Tensor) -> float:
    """Absolute damping, or ``"<m>x"``: m times the mean of the layer's eigenvalues."""
    if isinstance(damping, str):
        return float(damping[:-1]) * float(eigenvalues.mean())
    return float(damping)


def _offsets(engine: Engine) -> list[tuple[int, int]]:
    out, start = [], 0
    for k in engine.numels:
        out.append((start, k))
        start += k
    return out


def linear_blocks(engine: Engine) -> tuple[list[LinearBlock], list[str]]:
    """The ``nn.Linear`` modules whose parameters are all tracked by ``engine``, and the
    tracked parameter names no such module covers."""
    return linear_modules(engine.module, engine.names)


def linear_modules(module: nn.Module, names: Sequence[str]) -> tuple[list[LinearBlock], list[str]]:
    """The ``nn.Linear`` submodules of ``module`` whose parameters are all in ``names``, and
    the names no such submodule covers (in the order of ``names``)."""
    tracked = set(names)
    blocks: list[LinearBlock] = []
    covered: set[str] = set()

    def prefixed(path: str, name: str) -> str:
        return f"{path}.{name}" if path else name

    def add(block: LinearBlock) -> None:
        if block.weight in tracked and (block.bias is None or block.bias in tracked):
            blocks.append(block)
            covered.update({block.weight} | ({block.bias} if block.bias else set()))

    for path, sub in module.named_modules():
        if type(sub) is nn.Linear:
            add(
                LinearBlock(
                    path,
                    prefixed(path, "weight"),
                    prefixed(path, "bias") if sub.bias is not None else None,
                    sub.in_features,
                    sub.out_features,
                )
            )
        elif is_hf_conv1d(sub):
            d_in, d_out = sub.weight.shape
            add(
                LinearBlock(
                    path, prefixed(path, "weight"), prefixed(path, "bias"), int(d_in), int(d_out), source="conv1d"
                )
            )
        elif type(sub) is nn.Conv2d and sub.groups == 1 and sub.padding_mode == "zeros":
            add(
                LinearBlock(
                    path,
                    prefixed(path, "weight"),
                    prefixed(path, "bias") if sub.bias is not None else None,
                    sub.in_channels * sub.kernel_size[0] * sub.kernel_size[1],
                    sub.out_channels,
                    source="conv2d",
                )
            )
        elif isinstance(sub, nn.MultiheadAttention) and _factorable_attention(sub):
            E = sub.embed_dim
            add(
                LinearBlock(
                    prefixed(path, "in_proj"),
                    prefixed(path, "in_proj_weight"),
                    prefixed(path, "in_proj_bias") if sub.in_proj_bias is not None else None,
                    E,
                    3 * E,
                    source="mha-in",
                    module=path,
                )
            )
            add(
                LinearBlock(
                    prefixed(path, "out_proj"),
                    prefixed(path, "out_proj.weight"),
                    prefixed(path, "out_proj.bias") if sub.out_proj.bias is not None else None,
                    E,
                    E,
                    source="mha-out",
                    module=path,
                )
            )
    excluded = [n for n in names if n not in covered]
    return blocks, excluded


def _conv_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(B, L, C kh kw): the input patch under each of the L output positions, in the order of
    ``conv.weight.view(out_channels, -1)``, so the convolution is ``patches @ W^T + b``."""
    import torch.nn.functional as F

    if x.dim() != 4:
        raise AuditError(
            f"K-FAC covers batched nn.Conv2d inputs (4-D), got shape {tuple(x.shape)}; leave the "
            "layer's parameters out (params), or use the cg estimator"
        )
    padding: int | tuple[int, ...]
    if isinstance(conv.padding, str):  # "valid", or "same" (stride 1), which may pad one more on the right
        if conv.padding == "same":
            pads = []
            for k, d in zip(reversed(conv.kernel_size), reversed(conv.dilation)):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            x = F.pad(x, pads)
        padding = 0
    else:
        padding = conv.padding
    patches = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)
    return patches.transpose(1, 2)


def _factorable_attention(mha: nn.MultiheadAttention) -> bool:
    """Whether :func:`_attention_with_visible_projections` reproduces this module: packed
    q/k/v weights of one dimension, no extra key/value biases, no zero-attention row."""
    return bool(mha._qkv_same_embed_dim) and mha.bias_k is None and mha.bias_v is None and not mha.add_zero_attn


def _attention_with_visible_projections(mha: nn.MultiheadAttention, args: tuple, kwargs: dict):
    """The output of ``mha(*args, **kwargs)`` recomputed with its projections as separate
    tensors: returns ``(outputs, (x, qkv, attended, out))`` where ``outputs`` is what the module
    returns and x -> qkv (in_proj) and attended -> out (out_proj) are (B, T, .) views of the two
    linear layers' inputs and outputs. Self-attention only (query, key and value the same
    tensor), batched inputs, eval mode (no dropout)."""
    import torch.nn.functional as F

    names = (
        "query",
        "key",
        "value",
        "key_padding_mask",
        "need_weights",
        "attn_mask",
        "average_attn_weights",
        "is_causal",
    )
    defaults = (None, None, None, None, True, None, True, False)
    bound: dict[str, Any] = dict(zip(names, defaults))
    bound.update(zip(names, args))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if not (q is k and k is v):
        raise AuditError(
            "K-FAC covers nn.MultiheadAttention as self-attention (query, key and value the same "
            "tensor); this model calls it with different ones: leave its parameters out (params), "
            "or use the cg estimator"
        )
    if q.dim() != 3:
        raise AuditError(
            f"K-FAC covers batched nn.MultiheadAttention inputs (3-D), got shape {tuple(q.shape)}; leave "
            "its parameters out (params), or use the cg estimator"
        )
    x = q if mha.batch_first else q.transpose(0, 1)  # (B, T, E)
    B, T, E = x.shape
    H = mha.num_heads
    qkv = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    heads = qkv.view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
    scores = heads[0] @ heads[1].transpose(-2, -1) / math.sqrt(E // H)
    mask = bound["attn_mask"]
    if mask is not None:
        mask = mask.view(B, H, T, T) if mask.dim() == 3 else mask
        scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    pad = bound["key_padding_mask"]
    if pad is not None:
        pad = pad[:, None, None, :]
        scores = scores.masked_fill(pad, float("-inf")) if pad.dtype == torch.bool else scores + pad
    probs = torch.softmax(scores, -1)
    attended = (probs @ heads[2]).transpose(1, 2).reshape(B, T, E)
    out = F.linear(attended, mha.out_proj.weight, mha.out_proj.bias)
    weights = None
    if bound["need_weights"]:
        weights = probs.mean(1) if bound["average_attn_weights"] else probs
    return (out if mha.batch_first else out.transpose(0, 1), weights), (x, qkv, attended, out)


def position_weights(loss, logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    """(B, L) float64: w_t / max(1, sum_t w_t), each position's share of a document's next-token loss
    (:class:`~attnaudit.core.task.NextTokenLoss`), or None for a loss of one output per sample."""
    if not isinstance(loss, NextTokenLoss):
        return None
    if targets is None:
        raise AuditError("a language model's output Hessian needs its targets (the loss weights of the positions)")
    weights = split_targets(targets)[1].to(device=logits.device, dtype=torch.float64)
    return weights / weights.sum(-1, keepdim=True).clamp(min=1.0)


def _softmax_root(logits: torch.Tensor) -> torch.Tensor:
    """(..., c, c): diag(sqrt p) - p sqrt(p)^T, a square root of diag(p) - p p^T (p = softmax)."""
    p = torch.softmax(logits.detach(), -1)
    sq = p.sqrt()
    return torch.diag_embed(sq) - p[..., :, None] * sq[..., None, :]


def output_hessian_root(loss, logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """L with L L^T = d^2 l / d f^2 for each row: (B, c, c) for a classifier (MSE: I; cross-entropy:
    diag(sqrt p) - p sqrt(p)^T). A language model's loss (logits (B, L, V), ``targets`` (B, 2L))
    has a block-diagonal Hessian over positions, H_t = (w_t / W)(diag p_t - p_t p_t^T) with
    W = max(1, sum_t w_t): its root is given per position, (B, L, V, V), sqrt(w_t / W) times the
    softmax root (zero where w_t = 0)."""
    share = position_weights(loss, logits, targets)
    if share is not None:
        return _softmax_root(logits) * share.sqrt().to(logits.dtype)[:, :, None, None]
    B, c = logits.shape
    if isinstance(loss, MSELoss):
        return torch.eye(c, dtype=logits.dtype, device=logits.device).expand(B, c, c)
    if isinstance(loss, CrossEntropyLoss):
        return _softmax_root(logits)
    raise AuditError(f"K-FAC needs the output Hessian of the loss; {type(loss).__name__} has no closed form here")


def _softmax_columns(logits: torch.Tensor) -> torch.Tensor:
    """(N, c, c - 1) roots of diag(p) - p p^T for logits (N, c) in c - 1 columns: the Hessian
    annihilates the all-ones vector, so with Q (c, c - 1) an orthonormal basis of its complement,
    L = Q V sqrt(lambda) where V diag(lambda) V^T = Q^T H Q (one small eigendecomposition per
    row, float64)."""
    c = logits.shape[-1]
    p = torch.softmax(logits.detach().to(torch.float64), -1)
    H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    basis = torch.eye(c, dtype=torch.float64, device=p.device)
    basis[:, 0] = 1.0
    Q = torch.linalg.qr(basis)[0][:, 1:]  # (c, c - 1), orthogonal to the ones vector
    lam, V = torch.linalg.eigh(Q.T @ H @ Q)
    return (Q @ (V * lam.clamp(min=0.0).sqrt()[:, None, :])).to(logits.dtype)


def _output_hessian_columns(loss, logits: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """L with L L^T = d^2 l / d f^2 for each row in the fewest columns, one backward pass each in
    the K-FAC fit: (B, c, r) for a classifier (cross-entropy: r = c - 1, :func:`_softmax_columns`;
    two classes: one column instead of two; MSE: the identity, c columns); a language model's
    per position, (B, L, V, V - 1), scaled by sqrt(w_t / W) (:func:`output_hessian_root`)."""
    share = position_weights(loss, logits, targets)
    if share is not None:
        B, L, V = logits.shape
        roots = _softmax_columns(logits.reshape(B * L, V)).reshape(B, L, V, V - 1)
        return roots * share.sqrt().to(logits.dtype)[:, :, None, None]
    B, c = logits.shape
    if not isinstance(loss, CrossEntropyLoss) or c < 2:
        return output_hessian_root(loss, logits)
    return _softmax_columns(logits)


def _sampled_column(
    loss, logits: torch.Tensor, gen: torch.Generator, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, c, 1) one random column per row whose outer product has the output Hessian as its
    mean: the loss gradient at a label drawn from the model (the true Fisher; kronfluence's
    default). MSE: r ~ N(0, I); cross-entropy: p - onehot(y), y ~ softmax(f). A language model's
    (B, L, V, 1): sqrt(w_t / W)(p_t - onehot(y_t)), y_t ~ softmax(f_t) drawn independently at each
    position of nonzero weight (row by row, position by position: padding draws nothing, so the
    draws do not depend on how far the rows are padded); independent zero-mean blocks, so the
    mean outer product is the block-diagonal Hessian."""
    share = position_weights(loss, logits, targets)
    if share is not None:
        B, L, V = logits.shape
        p = torch.softmax(logits.detach().to(torch.float64), -1).cpu()
        live = (share > 0).cpu()
        v = torch.zeros(B, L, V, dtype=torch.float64)
        if bool(live.any()):
            drawn = torch.multinomial(p[live], 1, generator=gen).flatten()
            scale = share.cpu()[live].sqrt()[:, None]
            v[live] = (p[live] - torch.nn.functional.one_hot(drawn, V).to(torch.float64)) * scale
        return v.to(device=logits.device, dtype=logits.dtype)[..., None]
    B, c = logits.shape
    if isinstance(loss, MSELoss):
        v = torch.randn(B, c, generator=gen, dtype=torch.float64)
    elif isinstance(loss, CrossEntropyLoss):
        p = torch.softmax(logits.detach().to(torch.float64), -1)
        y = torch.multinomial(p.cpu(), 1, generator=gen).flatten()
        v = p.cpu() - torch.nn.functional.one_hot(y, c).to(torch.float64)
    else:
        raise AuditError(f"K-FAC needs the output Hessian of the loss; {type(loss).__name__} has no closed form here")
    return v.to(device=logits.device, dtype=logits.dtype)[:, :, None]


def _label_column(loss, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, c, 1): the loss gradient at the true labels (the empirical Fisher): MSE f - t,
    cross-entropy softmax(f) - t; a language model's (B, L, V, 1), dl/df = (w_t / W)(softmax(f_t) -
    onehot(next_t)) by autograd of its own loss."""
    f = logits.detach()
    if isinstance(loss, NextTokenLoss):
        f = f.clone().requires_grad_(True)
        with torch.enable_grad():
            (v,) = torch.autograd.grad(loss.per_sample(f, targets).sum(), f)
        return v[..., None]
    if isinstance(loss, MSELoss):
        v = f - targets
    elif isinstance(loss, CrossEntropyLoss):
        v = torch.softmax(f, -1) - targets
    else:
        raise AuditError(f"K-FAC needs the loss gradient in closed form; {type(loss).__name__} has none here")
    return v.to(logits.dtype)[:, :, None]


#: a language model's exact Gauss-Newton columns (``curvature="ggn"``): at most this many backward
#: passes per chunk, (positions with a loss weight) x (V - 1); above, the sampled Fisher
EXACT_LM_COLUMNS = 256


def backward_seeds(loss, logits: torch.Tensor, columns: torch.Tensor) -> tuple[int, Callable[[int], torch.Tensor]]:
    """(count, seed): the backward passes of K-FAC's fit for output columns ``columns`` (what
    :func:`_output_hessian_columns`, :func:`_sampled_column` or :func:`_label_column` return), each
    seed(j) a tensor shaped like the logits whose product with them is back-propagated. A
    classifier's columns (B, c, r) are r seeds. A language model's (B, L, V, r): one column (a
    sampled or empirical one, r = 1) is one seed over every position at once; the exact
    Gauss-Newton columns are one seed per (position, column), since positions summed into one pass
    would add cross terms between them; positions without a loss weight in the chunk are skipped
    (their columns are zero). More than :data:`EXACT_LM_COLUMNS` passes are refused."""
    r = columns.shape[-1]
    if logits.ndim == 2 or r == 1:
        return r, lambda j: columns[..., j].to(logits.dtype)
    live = [t for t in range(columns.shape[1]) if bool(columns[:, t].ne(0).any())]
    count = len(live) * r
    if count > EXACT_LM_COLUMNS:
        raise AuditError(
            f"the exact Gauss-Newton curvature of a language model takes one backward pass per position and "
            f"vocabulary column, {len(live)} x {r} = {count:,} here (at most {EXACT_LM_COLUMNS}); use curvature "
            "fisher (sampled, one pass) or empirical"
        )

    def seed(j: int) -> torch.Tensor:
        t, k = live[j // r], j % r
        out = torch.zeros_like(logits)
        out[:, t] = columns[:, t, :, k].to(logits.dtype)
        return out

    return count, seed


def dense_gauss_newton(
    engine: Engine, X: torch.Tensor, budget_bytes: int = 256 * 2**20, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """The exact Gauss-Newton matrix of the mean loss over ``X``, the matrix K-FAC approximates:
    G = (1/n) sum_i J_i^T H_i J_i (P x P, float64), J_i the per-sample Jacobian of the logits
    over the engine's tracked parameters and H_i = L_i L_i^T the loss's output Hessian. Built
    from (L_i^T J_i) in row chunks whose Jacobians fit ``budget_bytes``; n c P^2 flops. A language
    model's J_i is (L V, P) and its H_i block-diagonal over positions (:func:`output_hessian_root`,
    which needs the ``targets``): one row's Jacobian must fit the budget, else this is refused."""
    rows_all = engine.rows(X)
    n, P, c = rows_all.shape[0], engine.n_params, engine.n_classes
    sequence = engine.loss.logits_ndim == 3
    if sequence:
        if targets is None:
            raise AuditError("the Gauss-Newton matrix of a language model needs the documents' targets")
        targets = engine._as_targets(targets)
        c = targets.shape[1] // 2 * engine.n_classes  # L positions x V
    G = torch.zeros(P, P, dtype=torch.float64, device=engine.device)
    per_row = max(1, 3 * 8 * c * P)  # J, its float64 copy and L^T J
    if sequence and per_row > budget_bytes:
        raise AuditError(
            f"the exact Gauss-Newton matrix of this language model needs one document's Jacobian over {c:,} "
            f"logits (positions x vocabulary) and {P:,} parameters, {per_row / 2**20:,.0f} MiB, above the "
            f"{budget_bytes / 2**20:,.0f} MiB it may use; use the projected or ekfac estimator"
        )
    step = max(1, min(n, budget_bytes // per_row))
    for a, b in ranges(n, step):
        rows = rows_all[a:b]
        J = engine.jacobian(rows).to(torch.float64)  # (B, c, P)
        with torch.no_grad(), engine.context():
            logits = engine.apply(engine.theta.detach(), rows)
        tgt = None if targets is None else targets[a:b]
        L = output_hessian_root(engine.loss, logits, tgt).to(device=J.device, dtype=torch.float64)
        if sequence:  # (B, L, V, V) roots per position: M_(t,k) = sum_v L[t, v, k] J[(t, v)]
            M = torch.einsum("btvk,btvp->btkp", L, J.reshape(b - a, *L.shape[1:3], P)).reshape(-1, P)
        else:  # (B, c, c)
            M = torch.einsum("bck,bcp->bkp", L, J).reshape(-1, P)
        G.addmm_(M.T, M)
    return G.div_(max(n, 1))


def capture_activations(
    engine: Engine, blocks: list[LinearBlock], rows: torch.Tensor, overrides: dict[str, torch.Tensor] | None = None
):
    """Logits of ``rows`` and, per block, the layer's inputs and outputs (B, T, .); ``overrides``
    go to :meth:`Engine.apply`."""
    modules = dict(engine.module.named_modules())
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    hooks = []

    def once(path: str) -> None:
        # a layer applied twice in one forward (shared weights) has a sum of two Kronecker
        # products as its block; keeping only the last call's activations would be wrong
        if path in inputs:
            raise AuditError(
                f"K-FAC: the layer {path or 'at the model root'!r} runs more than once per forward pass "
                "(shared weights), which its Kronecker factors cannot represent; leave its parameters "
                "out (params), or use the cg estimator"
            )

    def hook_for(path: str, source: str):
        def hook(module, args, out):
            once(path)
            inputs[path] = _conv_patches(module, args[0]) if source == "conv2d" else args[0]
            outputs[path] = out

        return hook

    def attention_hook_for(path: str, parts: dict[str, LinearBlock]):
        def hook(module, args, kwargs, out):
            for part in parts.values():
                once(part.path)
            replaced, (x, qkv, attended, projected) = _attention_with_visible_projections(module, args, kwargs)
            mine, theirs = replaced[0], out[0]
            tol = 1e-10 if theirs.dtype == torch.float64 else 1e-4
            gap = float((mine - theirs).detach().abs().max()) if mine.shape == theirs.shape else math.inf
            if not gap <= tol * (1.0 + float(theirs.detach().abs().max())):
                raise AuditError(
                    f"K-FAC could not reproduce the nn.MultiheadAttention at {path or 'the model root'!r} "
                    f"(largest difference {gap:.3g}); leave its parameters out (params), or use "
                    "the cg estimator"
                )
            if "mha-in" in parts:
                inputs[parts["mha-in"].path], outputs[parts["mha-in"].path] = x, qkv
            if "mha-out" in parts:
                inputs[parts["mha-out"].path], outputs[parts["mha-out"].path] = attended, projected
            return replaced

        return hook

    def embedding_hook_for(path: str, batch: int):
        def hook(module, args, out):
            once(path)
            ids = args[0]
            if batch > 1 and ids.dim() >= 1 and ids.shape[0] == 1:
                # one row of ids for the whole batch (position embeddings), broadcast later: an
                # expanded output carries each row's own gradient, and the sums it enters are unchanged
                out = out.expand(batch, *out.shape[1:])
                ids = ids.expand(batch, *ids.shape[1:])
            inputs[path], outputs[path] = ids, out
            return out

        return hook

    attention: dict[str, dict[str, LinearBlock]] = {}
    for b in blocks:
        if b.source == "embedding":
            hooks.append(modules[b.path].register_forward_hook(embedding_hook_for(b.path, int(rows.shape[0]))))
        elif b.source in ("linear", "conv2d", "conv1d"):
            hooks.append(modules[b.path].register_forward_hook(hook_for(b.path, b.source)))
        else:
            attention.setdefault(b.module, {})[b.source] = b
    for path, parts in attention.items():
        hooks.append(modules[path].register_forward_hook(attention_hook_for(path, parts), with_kwargs=True))
    try:
        theta = engine.theta.detach().requires_grad_(True)  # so every layer output is in the graph
        logits = engine.apply(theta, rows, overrides)
    finally:
        for h in hooks:
            h.remove()
    return logits, inputs, outputs


def _real_tokens(engine: Engine, rows: torch.Tensor) -> torch.Tensor | None:
    """(B, L) bool, the real tokens at the positions the model runs on ``rows`` (text models
    with a padding mask: their ``token_mask``), or None."""
    mask_of = getattr(engine.module, "token_mask", None)
    if not callable(mask_of):
        return None
    keep = mask_of(engine.inputs(rows))
    return None if keep is None else keep.to(rows.device)


def token_keep(keep: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """The real-token mask (B, L) of a layer that runs on T positions per row: ``keep`` itself
    (T = L), its first T columns when the model dropped the trailing columns that are padding in
    every row (``trim_padding``; T < L and no real token after T), else None (a layer whose
    positions are not the tokens: patches, a pooled head)."""
    if keep is None:
        return None
    if T == keep.shape[1]:
        return keep
    if T < keep.shape[1] and not bool(keep[:, T:].any()):
        return keep[:, :T]
    return None


def token_rows(t: torch.Tensor, B: int) -> torch.Tensor:
    """(B, T, d) view of a layer's activations (T = 1 for flat rows)."""
    return t.reshape(B, -1, t.shape[-1])


def output_token_rows(block: LinearBlock, t: torch.Tensor, B: int) -> torch.Tensor:
    """(B, T, d_out) view of a layer's output (a convolution's channels come first, its
    positions are the tokens)."""
    if block.source == "conv2d":
        return t.reshape(B, block.d_out, -1).transpose(1, 2)
    return token_rows(t, B)


#: per-sample matrices formed at once when adding up squares (bounds the transient memory)
SQUARES_ROWS = 16


def _add_squared_rotated(out: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> None:
    """out += sum_b (u_b^T v_b)^2 (elementwise) for u (B, T, o), v (B, T, i): the per-sample
    matrices come from one batched product per group of :data:`SQUARES_ROWS` samples, contiguous
    (B, o, i), squared in place and summed over the samples (a strided layout, which einsum can
    return, made the reduction several times slower than the product). The products at u's and
    v's dtype (the precision policy), each group's sum added to ``out`` (float64)."""
    for a, b in ranges(u.shape[0], SQUARES_ROWS):
        G = torch.bmm(u[a:b].transpose(1, 2), v[a:b])
        out += G.square_().sum(0).to(out.dtype)


def _add_gram(out: torch.Tensor, rows: torch.Tensor) -> None:
    """out += rows^T rows for rows (m, d): the product at the rows' dtype (float32 under the
    precision policy: a chunk of m = B T tokens' sum), added to ``out`` (float64) across chunks.
    Held in float64 whatever the engine's dtype, the factor fits of a DeiT-tiny-size model ran
    at float64's speed."""
    if rows.dtype == out.dtype:
        out.addmm_(rows.T, rows)
    else:
        out += (rows.T @ rows).to(out.dtype)


def shared_weights(module: nn.Module, blocks: Sequence[LinearBlock]) -> list[str]:
    """The covered parameters that the module also uses under another name (tied weights):
    their per-sample gradient is not the covered layer's outer product alone."""
    covered = {b.weight for b in blocks} | {b.bias for b in blocks if b.bias}
    seen: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return sorted(n for names in seen.values() if len(names) > 1 for n in names if n in covered)


def layer_gradient_scores(
    engine: Engine, blocks: Sequence[LinearBlock], transformed: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """(B, k): g_i . transformed[:, j] for the per-sample loss gradients g_i of ``rows`` restricted
    to the covered layers, without forming g_i over all parameters.

    ``transformed`` (P, k) over ``engine.names`` (rows of parameters outside ``blocks`` are not
    read: K-FAC's preconditioned vectors are zero there). One forward pass and one backward pass of
    the summed loss to the layers' outputs give, per layer, the inputs a (B, T, d_in) and the
    output gradients s (B, T, d_out); the weight gradient of sample i is sum_t s_it a_it^T (one
    batched product per group of :data:`SQUARES_ROWS` samples), the bias gradient sum_t s_it, and
    their products with the layer's rows of ``transformed`` are added up layer by layer (one
    matrix product each), so memory stays at one group's per-layer gradients."""
    offsets = dict(zip(engine.names, _offsets(engine)))
    rows, targets = engine.rows(rows), engine._as_targets(targets)
    B = rows.shape[0]
    with engine.context(), torch.enable_grad():
        logits, ins, outs = capture_activations(engine, list(blocks), rows)
        loss = engine.loss.per_sample(logits, targets).sum()
        grads = torch.autograd.grad(loss, [outs[b.path] for b in blocks])
    # the sums over each layer's parameters are taken in float64 whatever the precision (kernel
    # and score sums stay float64: attnaudit.core.contraction)
    out = torch.zeros(B, transformed.shape[1], dtype=torch.float64, device=transformed.device)
    for b, g in zip(blocks, grads):
        a = token_rows(ins[b.path].detach(), B).to(transformed.dtype)
        s = output_token_rows(b, g.detach(), B).to(transformed.dtype)
        o_w, n_w = offsets[b.weight]
        W = transformed[o_w : o_w + n_w]  # (d_out d_in, k), row-major like the weight
        for r0, r1 in ranges(B, SQUARES_ROWS):
            G = torch.bmm(s[r0:r1].transpose(1, 2), a[r0:r1])  # (r, d_out, d_in)
            out[r0:r1] += contract(from_linear_layout(b, G).reshape(r1 - r0, -1), W.T)
        if b.bias:
            o_b, n_b = offsets[b.bias]
            out += contract(s.sum(1), transformed[o_b : o_b + n_b].T)
    return out.to(transformed.dtype)


CURVATURES = ("auto", "ggn", "fisher", "empirical")
#: ``auto`` takes the exact Gauss-Newton columns up to this many outputs, sampled Fisher above
EXACT_COLUMNS_UP_TO = 32


def resolve_curvature(curvature: str, engine: Engine) -> str:
    """K-FAC's curvature for ``auto``: the exact Gauss-Newton columns up to
    :data:`EXACT_COLUMNS_UP_TO` outputs, the sampled Fisher above and for a language model
    (whose exact columns cost one backward pass per position and vocabulary column)."""
    if curvature != "auto":
        return curvature
    if engine.loss.logits_ndim == 3 or engine.n_classes > EXACT_COLUMNS_UP_TO:
        return "fisher"
    return "ggn"


def _decompose(blocks: Sequence[LinearBlock], tokens_seen: dict[str, int], n: int, keep_covariances: bool) -> None:
    """Each block's summed covariances made means (A over its ``tokens_seen``, S over the ``n``
    rows) and decomposed, A = Q_A diag(lam_A) Q_A^T and S likewise (eigenvalues clamped at 0);
    A and S are freed unless ``keep_covariances``."""
    for b in blocks:
        A, S = b.A, b.S
        assert A is not None and S is not None  # accumulated by the fit
        A /= tokens_seen[b.path]
        S /= n
        # contiguous: the same memory layout whether fitted here or read from a cache, so the
        # products (and the scores) are bitwise the same either way
        # decomposed in float64 whatever the engine's precision (the precision policy), kept in its dtype
        b.lamA, b.QA = (t.to(A.dtype).contiguous() for t in torch.linalg.eigh(A.to(torch.float64)))
        b.lamS, b.QS = (t.to(S.dtype).contiguous() for t in torch.linalg.eigh(S.to(torch.float64)))
        b.lamA.clamp_(min=0.0)
        b.lamS.clamp_(min=0.0)
        if not keep_covariances:
            b.A = b.S = None
            del A, S


def fit_factors(
    engine: Engine,
    X: torch.Tensor,
    kind: str = "ekfac",
    *,
    chunk: int = 256,
    curvature: str = "auto",
    seed: int = 0,
    targets: torch.Tensor | None = None,
    keep_covariances: bool = True,
) -> KroneckerFactors:
    """Fit the Kronecker factors (and, for EK-FAC, the corrected eigenvalues) of the linear
    layers tracked by ``engine`` on the rows ``X`` (the model is evaluated at the engine's
    parameters, in eval mode; nothing is modified). Two passes over X for EK-FAC, one for K-FAC.

    ``curvature``: ``ggn``, the Gauss-Newton matrix from the c exact columns of the output
    Hessian's square root (c - 1 backward passes per batch for cross-entropy, c for MSE; no
    sampling noise); ``fisher``, one
    column per sample drawn from the model's predictive distribution (``seed``; one backward
    pass; the same matrix in expectation, kronfluence's default); ``empirical``, the loss
    gradient at the true labels (``targets``, one-hot rows; the empirical Fisher, kronfluence's
    ``use_empirical_fisher``); ``auto``: ggn up to :data:`EXACT_COLUMNS_UP_TO` outputs, fisher
    above and for every language model (:func:`resolve_curvature`). A language model (logits
    (B, L, V), :class:`~attnaudit.core.task.NextTokenLoss`) needs its ``targets`` whatever the
    curvature (their weights scale each position's block of the output Hessian); its ggn takes
    one backward pass per position and vocabulary column (:func:`backward_seeds`, refused above
    :data:`EXACT_LM_COLUMNS`), its fisher draws one label per weighted position, all in one pass;
    its covariances sum over real tokens only (the model's ``token_mask``). ``keep_covariances=False`` frees each layer's A and S
    once decomposed (only the factor cache and the tests read them; preconditioning uses
    their eigenvectors and eigenvalues): the peak is then :func:`kfac_memory_bytes` with
    ``keep_covariances=False``."""
    if kind not in KINDS:
        raise AuditError(f"unknown curvature {kind!r}; use one of {', '.join(KINDS)}")
    if curvature not in CURVATURES:
        raise AuditError(f"unknown K-FAC curvature {curvature!r}; use one of {', '.join(CURVATURES)}")
    curvature = resolve_curvature(curvature, engine)
    if curvature == "empirical" and targets is None:
        raise AuditError("the empirical Fisher needs the training labels (targets)")
    if engine.loss.logits_ndim == 3 and targets is None:
        raise AuditError("K-FAC on a language model needs the documents' targets (their loss weights)")
    targets_all = None if targets is None else engine._as_targets(targets)
    blocks, excluded = linear_blocks(engine)
    if not blocks:
        raise AuditError(
            "K-FAC covers nn.Linear, nn.Conv2d, transformers Conv1D and nn.MultiheadAttention layers, and none of the "
            "tracked parameters belongs to one; use the cg or exact estimator, or track such layers (params)"
        )
    rows_all = engine.rows(X)
    n = rows_all.shape[0]
    # text: the factors are sums over rows; neighbours in length run at their own longest sequence
    order, spans = engine.sorted_spans(rows_all, chunk)
    if order is not None:
        rows_all = rows_all[order]
        targets_all = None if targets_all is None else targets_all[order]
    for b in blocks:
        b.A = torch.zeros(b.width_in, b.width_in, dtype=torch.float64, device=engine.device)
        b.S = torch.zeros(b.d_out, b.d_out, dtype=torch.float64, device=engine.device)
    tokens_seen = {b.path: 0 for b in blocks}
    gen = torch.Generator().manual_seed(int(seed))

    def passes(rows: torch.Tensor, tgt: torch.Tensor | None):
        """Per block: inputs a (B, T, w) with bias column, and per output column k the
        back-propagated s (B, T, d_out)."""
        B = rows.shape[0]
        logits, ins, outs = capture_activations(engine, blocks, rows)
        if curvature == "ggn":
            L = _output_hessian_columns(engine.loss, logits, tgt)
        elif curvature == "empirical":
            assert tgt is not None  # the empirical Fisher is refused above without targets
            L = _label_column(engine.loss, logits, tgt)
        else:
            L = _sampled_column(engine.loss, logits, gen, tgt)
        count, seed_of = backward_seeds(engine.loss, logits, L)
        acts, real = {}, {}
        keep = _real_tokens(engine, rows)
        for b in blocks:
            a = token_rows(ins[b.path].detach(), B)  # the engine's dtype: products below, float64 sums
            if b.bias:
                a = torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=a.dtype, device=a.device)], 2)
            mask = token_keep(keep, a.shape[1])
            if mask is not None:
                # a layer applied per token: padding positions carry no gradient (their
                # output gradients are zero), so A averages over the real tokens only
                a = a * mask[:, :, None].to(a.dtype)
                real[b.path] = int(mask.sum())
            acts[b.path] = a
        out_list = [outs[b.path] for b in blocks]
        for k in range(count):
            target = (logits * seed_of(k)).sum()
            grads = torch.autograd.grad(target, out_list, retain_graph=k + 1 < count)
            yield (
                acts,
                real,
                {b.path: output_token_rows(b, g.detach(), B) for b, g in zip(blocks, grads)},
            )

    with engine.context(), torch.enable_grad():
        for a0, b0 in spans:
            first = True
            for acts, real, sgrads in passes(rows_all[a0:b0], None if targets_all is None else targets_all[a0:b0]):
                for b in blocks:
                    A, S = b.A, b.S
                    assert A is not None and S is not None  # zeroed above
                    # sums over samples and tokens as one matrix product each (B T rows)
                    if first:
                        a = acts[b.path].reshape(-1, b.width_in)
                        _add_gram(A, a)
                        tokens_seen[b.path] += real.get(b.path, a.shape[0])
                    _add_gram(S, sgrads[b.path].reshape(-1, b.d_out))
                first = False
    _decompose(blocks, tokens_seen, n, keep_covariances)
    if kind == "ekfac":
        gen.manual_seed(int(seed) + 1)  # fresh draws for the second pass
        for b in blocks:
            b.corrected = torch.zeros(b.d_out, b.width_in, dtype=torch.float64, device=engine.device)
        bases = {}  # the eigenbases at the captures' dtype: the rotations are products, the sums float64
        for b in blocks:
            assert b.QA is not None and b.QS is not None  # decomposed above
            bases[b.path] = (b.QA.to(engine.dtype), b.QS.to(engine.dtype))
        with engine.context(), torch.enable_grad():
            for a0, b0 in spans:
                rotated_acts: dict[str, torch.Tensor] = {}
                for acts, _, sgrads in passes(rows_all[a0:b0], None if targets_all is None else targets_all[a0:b0]):
                    for b in blocks:
                        # Q_S^T G Q_A with G = sum_t s_t a_t^T, rotating the tokens first (B T d^2
                        # flops instead of B d^3 for the per-sample matrices)
                        QA, QS = bases[b.path]
                        if b.path not in rotated_acts:
                            rotated_acts[b.path] = acts[b.path] @ QA
                        corrected = b.corrected
                        assert corrected is not None  # zeroed above
                        _add_squared_rotated(corrected, sgrads[b.path] @ QS, rotated_acts[b.path])
        for b in blocks:
            corrected = b.corrected
            assert corrected is not None  # accumulated above
            corrected /= n
    covered = [nm for nm in engine.names if nm not in set(excluded)]
    return KroneckerFactors(
        kind,
        blocks,
        excluded,
        n,
        covered,
        {
            "curvature": curvature,
            "seed": int(seed) if curvature == "fisher" else None,
            "layers": [b.path for b in blocks],
            "factor_shapes": {b.path: [b.width_in, b.d_out] for b in blocks},
        },
    )


def gradient_entries_per_row(module: nn.Module, blocks: Sequence[LinearBlock]) -> int | None:
    """Per-sample gradient entries one row holds at once while K-FAC runs: the largest covered
    layer's weight and bias (the fit, the eigenvalue correction and the training scores are
    layer-wise), or None when a covered weight is tied to another module's (the training
    scores then stream per-sample gradients over all parameters) or nothing is covered."""
    if not blocks or shared_weights(module, list(blocks)):
        return None
    return max(b.d_out * b.width_in for b in blocks)


def capture_entries_per_row(engine: Engine, blocks: Sequence[LinearBlock], rows: torch.Tensor) -> int:
    """Float64 numbers one row holds at once, beyond its autograd graph, while K-FAC fits its
    factors and scores training rows: per covered layer, over its T tokens, the captured inputs
    (bias column included) and their rotation into the eigenbasis, and one output column's
    gradients and their rotation, 2 T (w_in + d_out). T is read from one probe row (the
    longest, for text that drops trailing padding)."""
    if not blocks:
        return 0
    probe = rows[engine.longest_first(rows)[:1]]
    with torch.no_grad(), engine.context():
        _, ins, _ = capture_activations(engine, list(blocks), engine.rows(probe))
    return sum(2 * token_rows(ins[b.path], 1).shape[1] * (b.width_in + b.d_out) for b in blocks)


def kfac_memory_bytes(blocks: Sequence[LinearBlock], keep_covariances: bool = True) -> int:
    """Peak bytes of the factors of ``blocks`` (float64): A, Q_A, S, Q_S and the EK-FAC
    eigenvalues; without the covariances (:func:`fit_factors` ``keep_covariances=False``), the
    accumulated A and S of every layer turn into Q_A and Q_S one layer at a time, so the peak is
    the eigenvectors, the eigenvalues and one layer's A and S in flight."""
    if keep_covariances:
        return 8 * sum(2 * b.width_in**2 + 2 * b.d_out**2 + b.d_out * b.width_in for b in blocks)
    square = [b.width_in**2 + b.d_out**2 for b in blocks]
    return 8 * (sum(square) + max(square, default=0) + sum(b.d_out * b.width_in for b in blocks))


# ----------------------------------------------------------------------------- cache on disk
CACHE_FORMAT = "attnaudit.kfac-factors/3"  # /2: convolutions and attention projections; /3: content sha256


def factors_fingerprint(engine: Engine, rows: torch.Tensor, kind: str, curvature: str, seed: int) -> str:
    """sha256 over what the factors depend on: the tracked parameters (names, shapes, dtype,
    values), the model's class, the training rows, the estimator, curvature and seed."""
    import hashlib

    h = hashlib.sha256()
    h.update(f"{CACHE_FORMAT}|{type(engine.module).__qualname__}|{kind}|{curvature}|{seed}|{engine.dtype}".encode())
    for name, shape in zip(engine.names, engine.shapes):
        h.update(f"{name}{tuple(shape)}".encode())
    h.update(tensor_bits(engine.theta).tobytes())
    for name in sorted(engine.frozen):
        t = engine.frozen[name]
        h.update(name.encode())
        h.update(tensor_bits(t).tobytes())
    h.update(str(engine.loss.name).encode())
    h.update(tensor_bits(rows).tobytes())
    return h.hexdigest()


def save_factors(factors: KroneckerFactors, path: str | Path, fingerprint: str) -> None:
    """Write the factors to ``path`` (safetensors, atomically) with the fingerprint they belong to."""
    import json

    from safetensors.torch import save

    tensors, layers = {}, []
    for i, b in enumerate(factors.blocks):
        for key in ("A", "S", "QA", "QS", "lamA", "lamS", "corrected"):
            value = getattr(b, key)
            if value is not None:
                tensors[f"{i}.{key}"] = value.detach().cpu().contiguous()
        layers.append(
            {
                "path": b.path,
                "weight": b.weight,
                "bias": b.bias,
                "d_in": b.d_in,
                "d_out": b.d_out,
                "source": b.source,
                "module": b.module,
            }
        )
    meta = {
        "format": CACHE_FORMAT,
        "fingerprint": fingerprint,
        "content_sha256": tensors_sha256(tensors),
        "kind": factors.kind,
        "n_samples": factors.n_samples,
        "excluded": factors.excluded,
        "names": factors.names,
        "layers": layers,
        "diagnostics": factors.diagnostics,
    }
    write_bytes_atomic(path, save(tensors, metadata={"attnaudit": json.dumps(meta)}))


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order (a factor cache
    entry's content; the malleability run key)."""
    import hashlib

    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        # flat: a 0-dim tensor (a buffer such as a step counter) has no byte view of its own
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load_factors(path: str | Path, fingerprint: str, device: torch.device | str = "cpu") -> KroneckerFactors:
    """The factors in ``path``, refused (AuditError) unless they were fitted for ``fingerprint``
    (the same model, parameters, training rows, estimator, curvature and seed) and their tensors
    match the sha256 stored with them (a damaged entry is never trusted)."""
    import json

    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("attnaudit", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is refused the same way
        raise AuditError(
            f"K-FAC cache {path} is not a factors file ({exc.__class__.__name__}); delete it or use "
            "another --cache folder"
        ) from None
    if meta.get("format") != CACHE_FORMAT:
        raise AuditError(f"K-FAC cache {path} has format {meta.get('format')!r}, not {CACHE_FORMAT}; delete it")
    if meta.get("fingerprint") != fingerprint:
        raise AuditError(
            f"K-FAC cache {path} was fitted for another model or data (fingerprint "
            f"{str(meta.get('fingerprint'))[:12]} vs {fingerprint[:12]}); it is not used: delete it or "
            "use another --cache folder"
        )
    if meta.get("content_sha256") != tensors_sha256(tensors):
        raise AuditError(f"K-FAC cache {path} does not match its sha256 (damaged); delete it")
    blocks = []
    for i, layer in enumerate(meta["layers"]):
        b = LinearBlock(
            layer["path"],
            layer["weight"],
            layer["bias"],
            int(layer["d_in"]),
            int(layer["d_out"]),
            source=str(layer.get("source", "linear")),
            module=str(layer.get("module", "")),
        )
        for key in ("A", "S", "QA", "QS", "lamA", "lamS", "corrected"):
            if f"{i}.{key}" in tensors:
                setattr(b, key, tensors[f"{i}.{key}"].to(device))
        blocks.append(b)
    diagnostics = dict(meta.get("diagnostics", {}), cache="loaded")
    return KroneckerFactors(
        meta["kind"], blocks, list(meta["excluded"]), int(meta["n_samples"]), list(meta["names"]), diagnostics
    )


def cached_factors(
    engine: Engine,
    rows: torch.Tensor,
    kind: str,
    *,
    chunk: int,
    curvature: str,
    seed: int,
    cache_dir: str | Path | None,
    targets: torch.Tensor | None = None,
) -> KroneckerFactors:
    """:func:`fit_factors`, reading and writing ``cache_dir`` when given (one file per fingerprint)."""
    if cache_dir is None:  # nothing is saved: A and S are freed once decomposed
        return fit_factors(
            engine, rows, kind, chunk=chunk, curvature=curvature, seed=seed, targets=targets, keep_covariances=False
        )
    resolved = resolve_curvature(curvature, engine)
    key = factors_fingerprint(engine, engine.rows(rows), kind, resolved, seed)
    # the labels enter the curvature (a language model's targets weigh every curvature's positions)
    if (resolved == "empirical" or engine.loss.logits_ndim == 3) and targets is not None:
        import hashlib

        key = hashlib.sha256((key + targets.detach().cpu().contiguous().numpy().tobytes().hex()).encode()).hexdigest()
    folder = Path(cache_dir)
    if folder.exists() and not folder.is_dir():
        raise FieldError("cache_dir", "{name} " + literal(folder) + " is a file; give a folder (created if missing)")
    path = folder / f"{kind}-{key[:24]}.safetensors"
    damaged = None
    if path.is_file():
        try:
            return load_factors(path, key, engine.device)
        except AuditError as exc:  # damaged, truncated or foreign: reported, recomputed, rewritten
            damaged = str(exc).split(";")[0]
            print(f"warning: {damaged}; recomputing the factors and rewriting the entry", file=sys.stderr)
    factors = fit_factors(engine, rows, kind, chunk=chunk, curvature=resolved, seed=seed, targets=targets)
    folder.mkdir(parents=True, exist_ok=True)
    save_factors(factors, path, key)
    factors.diagnostics["cache"] = f"written {path.name}" + (
        f" (replacing a damaged entry: {damaged})" if damaged else ""
    )
    return factors
