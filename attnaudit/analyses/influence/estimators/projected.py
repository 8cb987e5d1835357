"""``projected``: influence in a k-dimensional random projection of the per-sample gradients,
the standard way (LoGra, Choe et al. 2024; TRAK, Park et al. 2023).

Projection R (P x k, never formed; :class:`~attnaudit.analyses.influence.projection.KroneckerProjection`):
for each linear layer (``nn.Linear``, ``nn.Conv2d`` on patches, the projections of an
``nn.MultiheadAttention``, exactly the layers K-FAC covers) a per-sample weight gradient is
G_i = sum_t s_it a_it^T (a: the layer's input, with a 1 appended for the bias; s: the gradient
at its output), so its projection P_out^T G_i P_in = sum_t (P_out^T s_it)(P_in^T a_it)^T is
formed from the projected activations and output gradients alone: O(T (w_in k_in + d_out
k_out + k_in k_out)) per sample and layer, never d_out x w_in. P_in, P_out have orthonormal
columns (QR of a seeded Gaussian; the identity when k_in >= w_in or k_out >= d_out). An
``nn.Embedding`` table is a linear layer on one-hot rows
(:func:`~attnaudit.analyses.influence.projection.embedding_modules`). A table W (V x H) tied to a
bias-free linear output head (GPT-2's ``wte`` / ``lm_head``,
:func:`~attnaudit.analyses.influence.projection.tied_heads`) is ONE layer in the head's layout
with one P_out (V x k_out), P_in (H x k_in): its gradient
sum_t delta_t h_t^T + sum_t e_{id_t} g_t^T projects to sum_t (P_out^T delta_t)(P_in^T h_t)^T +
sum_t P_out[id_t]^T (P_in^T g_t)^T (``tied`` in ``projection_layout``); any other shared weight
goes with the other parameters. Every
other tracked parameter gets its per-sample gradients from the same backward passes when a
verified structure covers it (LayerNorm affines, parameters broadcast against the batch such
as position embeddings: :mod:`attnaudit.analyses.influence.other_grads`), else from
per-sample Jacobians restricted to those parameters (``vmap(jacrev)``: tied weights,
embedding tables, anything the structures do not fit), then a
:class:`~attnaudit.analyses.influence.projection.SignProjection`. The total k (``--proj-dim``)
is shared between layers by ``--proj-split``: ``layer`` (default, LoGra's layout) gives every
layer the same share as square factors k_in ~ k_out, ``params`` shares it in proportion to
parameter counts (``projection_layout`` in the diagnostics).

Curvature in the projected space, from the projected rows themselves (``--curvature``):

* ``ggn`` (``auto`` up to 32 classes; a language model: c = L V rows, one backward pass each,
  refused above ``EXACT_LM_COLUMNS``): F = (1/n) sum_i Phi_i^T H_i Phi_i with Phi_i (c x k) the
  projected Jacobian of sample i's logits (c backward passes per chunk, one per class) and
  H_i = L_i L_i^T the loss's output Hessian; the projected training gradient is
  Phi_i^T dl/df, from the same passes. This is R^T GGN R exactly.
* ``empirical`` (``auto`` above 32 classes and for language models): F = (1/n) sum_i r_i r_i^T, r_i = R^T grad l_i
  (one backward pass per chunk).
* ``galerkin``: R^T (H + lambda I) R with the true Hessian, from k
  Hessian-vector products over the training set, with R a dense random sign matrix applied
  to full per-sample gradients (cost: k HVPs, each a pass over all n training rows).

Solve: z = (F + lambda M)^-1 R^T g_test with M = R^T R (the identity on the layers'
columns), the Galerkin projection of the damped curvature: with k >= P (identity
projections) this is exact GGN / empirical-Fisher influence. One eigendecomposition of the
k x k pencil serves every damping; ``"<m>x"`` dampings are m times its largest eigenvalue.

Reuse: the projected rows of a training sample depend on the model and on that sample only.
They are kept in a process-wide cache keyed by the model's fingerprint (tracked values,
frozen tensors, loss, dtype) and the projection's settings, then by the sample's content
(row and one-hot target): a second call on the same model (``--protocol static``: the clean
and every perturbed training set) recomputes only the rows that changed, and F is summed
from the cached rows; the test rows' projected gradients are kept the same way, so the
clean and perturbed runs of one test set project it once. :data:`ROW_CACHE_BYTES` bounds what
a model's entry may hold (0 turns both caches off); :data:`CACHED_MODELS` models are kept,
least recently used dropped first.
With ``InfluenceConfig.store`` the rows are kept on disk instead, for later runs and other
processes (:mod:`attnaudit.analyses.influence.store`): rows it holds are read, the others
computed here or on Ray tasks (``store_executor``) and committed as new segments first.
"""

from __future__ import annotations

import hashlib
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import torch
from torch.func import grad, jacrev

import attnaudit.analyses.influence.estimators.base as base
from attnaudit.analyses.influence.kfac import (
    EXACT_COLUMNS_UP_TO,
    EXACT_LM_COLUMNS,
    LinearBlock,
    capture_activations,
    output_hessian_root,
    output_token_rows,
    position_weights,
    token_rows,
    factors_fingerprint,
)
from attnaudit.analyses.influence.other_grads import OtherCapture, OtherPlan, plan_other
from attnaudit.analyses.influence.projection import (
    KroneckerProjection,
    SignProjection,
    projection_for,
)
from attnaudit.analyses.influence.store import (
    GradientStore,
    SegmentArrays,
    StoreKey,
    build_progress,
    forget_verified,
    ray_map,
    segment_arrays,
)
from attnaudit.core.engine import JACOBIAN_ROWS, ranges
from attnaudit.core.precision import tensor_bits
from attnaudit.analyses.request import FieldError
from attnaudit.errors import AuditError, literal

__all__ = [
    "CACHED_MODELS",
    "ROW_CACHE_BYTES",
    "Projected",
    "ProjectedRows",
    "clear_row_cache",
    "projected_rows",
    "projection_for",
]

#: bytes of projected rows one model's cache entry may hold (0: no cache)
ROW_CACHE_BYTES = 512 * 2**20
#: models whose projected rows are kept (least recently used dropped first)
CACHED_MODELS = 2
#: per model: sample key -> (psi, r, loss) of that sample
_ROW_CACHE: OrderedDict[str, dict[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = OrderedDict()


def _remember(cache: OrderedDict, model_key: str, entries: dict) -> None:
    """Put a model's rows last in ``cache`` (most recently used), keeping :data:`CACHED_MODELS` models."""
    cache[model_key] = entries
    while len(cache) > CACHED_MODELS:
        cache.popitem(last=False)


def clear_row_cache() -> None:
    """Forget every cached projected row (training and test), every verified route, and which
    gradient store files this process has verified."""
    _ROW_CACHE.clear()
    _TEST_ROW_CACHE.clear()
    _VERIFIED_ROUTES.clear()
    forget_verified()


def resolve_curvature(curvature: str, engine: Any) -> str:
    """``auto``: the Gauss-Newton matrix up to :data:`EXACT_COLUMNS_UP_TO` classes, the empirical
    Fisher above and for a language model (whose Gauss-Newton rows cost one backward pass per
    position and vocabulary entry, :data:`EXACT_LM_COLUMNS` at most)."""
    if curvature == "auto":
        if engine.loss.logits_ndim == 3 or engine.n_classes > EXACT_COLUMNS_UP_TO:
            return "empirical"
        return "ggn"
    return curvature


def ggn_columns(engine: Any, rows: Any = None) -> int:
    """Backward passes per chunk of the ``ggn`` curvature, one per logit of a row: c for a
    classifier, L V for a language model (L from a probe row of ``rows``; the vocabulary alone
    without rows)."""
    if engine.loss.logits_ndim != 3 or rows is None:
        return int(engine.n_classes)
    return int(engine.logits(rows[:1]).shape[1:].numel())


def _other_rows(engine: Any, index: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, ggn: bool):
    """Per-sample Jacobians of the logits (B, c, m) (``ggn``) or loss gradients (B, 1, m) over
    the tracked parameters at positions ``index`` of theta, the others held at their values."""
    theta = engine.theta.detach()
    p0 = theta[index]

    def logits_one(po: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return engine.apply(theta.index_put((index,), po), row.unsqueeze(0)).squeeze(0)

    def loss_one(po: torch.Tensor, row: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return engine.loss.per_sample(logits_one(po, row).unsqueeze(0), t.unsqueeze(0)).squeeze(0)

    parts = []
    with engine.context():
        for a, b in ranges(rows.shape[0], JACOBIAN_ROWS):
            if ggn:  # (B, *logits, m): a language model's (L, V) logits flattened, position-major
                J = engine.map_rows(jacrev(logits_one), (None, 0))(p0, rows[a:b])
                parts.append(J.reshape(b - a, -1, J.shape[-1]))
            else:
                parts.append(engine.map_rows(grad(loss_one), (None, 0, 0))(p0, rows[a:b], targets[a:b])[:, None, :])
    return torch.cat(parts)


def _embedding_acts(p: Any, ids: torch.Tensor, B: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, k_in): the projected one-hot rows of an embedding's ids, P_in[id_t] (the one-hot
    rows themselves when P_in is the identity), zero at ``padding_idx`` (its row gets no gradient)."""
    return _id_rows(p.P_in, ids, p.block, B, dtype)


def _id_rows(P: torch.Tensor | None, ids: torch.Tensor, table: LinearBlock, B: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, k): rows ``P[id_t]`` of a table's side factor P (rows x k; the one-hot rows when P is
    the identity), zero at the table's ``padding_idx``: an embedding's own P_in, or a tied head's
    P_out (the table's rows are the head's outputs)."""
    ids = ids.reshape(B, -1)
    if P is not None:
        a = P.to(dtype)[ids]
    else:
        a = torch.nn.functional.one_hot(ids, table.d_in).to(dtype)
    if table.padding_idx is not None:
        a = a * (ids != table.padding_idx)[..., None].to(dtype)
    return a


def _forward_backward(
    engine: Any,
    proj: KroneckerProjection,
    rows: torch.Tensor,
    targets: torch.Tensor,
    ggn: bool,
    plan: OtherPlan,
    skip: frozenset[str] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One forward pass and c (``ggn``) or 1 backward passes: (logits, dl/df, Phi (B, c', k)
    with the layers' columns filled (except the layers at the paths ``skip``), {name: (B, c',
    numel)} for the parameters ``plan`` covers, each row's loss l_i (B,) from the same forward).
    The backward targets are logit j (``ggn``) or
    the loss (``dl . f``). An embedding the forward does not read (text fed as embeddings)
    has zero gradient: its columns are 0. A tied head's columns add its table's
    sum_t P_out[id_t]^T (P_in^T g_t)^T to its own."""
    B, k = rows.shape[0], proj.k
    layers = [p for p in proj.layers if p.block.path not in skip]
    captured = [p.block for p in layers] + [p.tied for p in layers if p.tied is not None]
    cap = OtherCapture(engine, plan, B) if plan.fast else None
    try:
        logits, ins, outs = capture_activations(engine, captured, rows, cap.overrides if cap else None)
    finally:
        if cap is not None:
            cap.remove_hooks()
    f = logits.detach().clone().requires_grad_(True)
    row_loss = engine.loss.per_sample(f, targets)
    (dl,) = torch.autograd.grad(row_loss.sum(), f)  # (B, c) or (B, L, V)
    flat = logits.reshape(B, -1)  # a language model's logits position-major: one ggn column each
    n_cols = flat.shape[1] if ggn else 1
    if ggn and logits.ndim == 3 and n_cols > EXACT_LM_COLUMNS:
        raise AuditError(
            f"the projected Gauss-Newton curvature of a language model takes one backward pass per position and "
            f"vocabulary entry, {n_cols:,} here (at most {EXACT_LM_COLUMNS}); use curvature empirical"
        )
    Phi = torch.empty(B, n_cols, k, dtype=logits.dtype, device=logits.device)
    # tied tables read by this forward, with P_out[id_t] (B, T, k_out): their output gradients go on the input side
    tables = [p for p in layers if p.tied is not None and p.tied.path in ins]
    table_rows = {p.block.path: _id_rows(p.P_out, ins[p.tied.path], p.tied, B, logits.dtype) for p in tables}
    acts = {}
    for p in list(layers):
        if p.block.path not in ins:  # an embedding never read: no gradient
            Phi[:, :, p.col : p.col + p.dim] = 0.0
            layers.remove(p)
        elif p.block.source == "embedding":
            acts[p.block.path] = _embedding_acts(p, ins[p.block.path], B, logits.dtype)
        else:
            a = token_rows(ins[p.block.path].detach(), B)
            if p.block.bias:
                a = torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=a.dtype, device=a.device)], 2)
            acts[p.block.path] = a @ p.P_in if p.P_in is not None else a  # (B, T, k_in)
    out_list = [outs[p.block.path] for p in layers] + [outs[p.tied.path] for p in tables]
    extra = cap.targets() if cap is not None else []
    other: dict[str, list[torch.Tensor]] = {}
    if out_list or extra:
        for j in range(n_cols):
            target = flat[:, j].sum() if ggn else (logits * dl).sum()
            grads = torch.autograd.grad(target, out_list + extra, retain_graph=j + 1 < n_cols, allow_unused=True)
            for p, g in zip(layers, grads):
                if g is None:  # an embedding whose output does not reach the logits
                    assert p.block.source == "embedding"  # a captured linear layer's output always does
                    Phi[:, j, p.col : p.col + p.dim] = 0.0
                    continue
                s = output_token_rows(p.block, g.detach(), B)
                if p.P_out is not None:
                    s = s @ p.P_out  # (B, T, k_out)
                Phi[:, j, p.col : p.col + p.dim] = torch.bmm(s.transpose(1, 2), acts[p.block.path]).reshape(B, -1)
            for p, g in zip(tables, grads[len(layers) : len(out_list)]):
                if g is None:  # the table's output does not reach the logits
                    continue
                u = token_rows(g.detach(), B)
                if p.P_in is not None:
                    u = u @ p.P_in  # (B, T, k_in)
                Phi[:, j, p.col : p.col + p.dim] += torch.bmm(table_rows[p.block.path].transpose(1, 2), u).reshape(
                    B, -1
                )
            if cap is not None:
                rest: list[torch.Tensor | None] = [None if g is None else g.detach() for g in grads[len(out_list) :]]
                for name, g in cap.rows(engine, rest).items():
                    other.setdefault(name, []).append(g)
    rows_of = {name: torch.stack(gs, 1) for name, gs in other.items()}
    return logits.detach(), dl, Phi, rows_of, row_loss.detach()


def _other_slices(engine: Any, proj: KroneckerProjection) -> dict[str, tuple[int, int]]:
    """Each other parameter's (start, stop) in the other-parameter vector (``proj.other_index``)."""
    out, at = {}, 0
    for name in proj.other_names:
        numel = engine.numels[engine.names.index(name)]
        out[name] = (at, at + numel)
        at += numel
    return out


def _generic_rows(
    engine: Any, proj: KroneckerProjection, names: list[str], rows: torch.Tensor, targets: torch.Tensor, ggn: bool
) -> torch.Tensor:
    """Per-sample Jacobians (B, c', m) over the other parameters ``names`` (vmap(jacrev))."""
    slices = _other_slices(engine, proj)
    index = torch.cat([proj.other_index[slice(*slices[n])] for n in names])
    return _other_rows(engine, index, rows, targets, ggn)


def _layer_rows_generic(
    engine: Any, proj: KroneckerProjection, p: Any, rows: torch.Tensor, targets: torch.Tensor, ggn: bool
) -> torch.Tensor:
    """(B, c', k_out k_in): layer ``p``'s projected columns from per-sample Jacobians over its
    weight (``vmap(jacrev)``), the route an embedding (or a tied head) takes when its ids cannot be used."""
    return proj.project_weight(p, _other_rows(engine, _weight_index(engine, p), rows, targets, ggn))


def _weight_index(engine: Any, p: Any) -> torch.Tensor:
    """The positions of layer ``p``'s weight in theta."""
    return torch.arange(p.w_offset, p.w_offset + p.block.d_in * p.block.d_out, device=engine.theta.device)


def _rows_by_autograd(
    engine: Any, index: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, ggn: bool
) -> torch.Tensor:
    """(B, c', m): per-sample logit Jacobians (``ggn``) or loss gradients over the parameters at
    positions ``index`` of theta, from plain autograd, one row and one output at a time (the
    gradient over all P, sliced): the truth the structures are verified against, in the memory
    of one P-wide gradient. ``vmap(jacrev)`` batches rows x outputs copies of theta: 4.5 GiB on
    two rows of a DistilBERT-size model (67 M parameters)."""
    theta = engine.theta.detach().requires_grad_(True)
    out = []
    for i in range(rows.shape[0]):
        logits = engine.apply(theta, rows[i : i + 1])[0]
        if ggn:
            outputs = list(logits.reshape(-1))
        else:
            f = logits.detach().clone().requires_grad_(True)
            (dl,) = torch.autograd.grad(engine.loss.per_sample(f[None], targets[i : i + 1]).sum(), f)
            outputs = [(logits * dl).sum()]
        cols = []
        for j, target in enumerate(outputs):
            (g,) = torch.autograd.grad(target, theta, retain_graph=j + 1 < len(outputs))
            cols.append(g[index])
            del g
        out.append(torch.stack(cols))
    return torch.stack(out)


def _layer_rows_by_autograd(
    engine: Any, proj: KroneckerProjection, p: Any, rows: torch.Tensor, targets: torch.Tensor, ggn: bool
) -> torch.Tensor:
    """(B, c', k_out k_in): layer ``p``'s projected columns from :func:`_rows_by_autograd` over
    its weight (a table's gradient transposed to the linear layout, then projected; a tied head's
    is the sum of both uses, in the head's layout already)."""
    return proj.project_weight(p, _rows_by_autograd(engine, _weight_index(engine, p), rows, targets, ggn))


def _capture_numbers(engine: Any, proj: KroneckerProjection, rows: torch.Tensor) -> int:
    """Numbers one row holds at once in :func:`_forward_backward` beyond the autograd graph: per
    layer, over its T tokens, the captured inputs and one output column's gradients (every
    layer's come back together) and their projections, T (w_in + d_out + k_in + k_out) (an
    embedding's inputs are its T ids; a tied head adds its table's T (1 + width + k_in + k_out)).
    T is read from the longest probe row. Measured on a
    DistilBERT-size model at 128 tokens: 175 MB a row in float64, 19 times what autograd saves
    for the forward; a planner without it put 32 rows in one chunk and peaked at 7.5 GiB."""
    if not proj.layers:
        return 0
    probe = engine.rows(rows[engine.longest_first(rows)[:1]])
    blocks = [p.block for p in proj.layers] + [p.tied for p in proj.layers if p.tied is not None]
    try:
        with torch.no_grad(), engine.context():
            _, ins, _ = capture_activations(engine, blocks, probe)
    except AuditError:  # a table read twice per forward (verification sends it to the Jacobians)
        blocks = [b for b in blocks if b.source != "embedding"]
        with torch.no_grad(), engine.context():
            _, ins, _ = capture_activations(engine, blocks, probe)

    def table_numbers(b: LinearBlock, p: Any) -> int:  # the probe row's length when the table was not captured
        T = int(ins[b.path].reshape(1, -1).shape[1]) if b.path in ins else int(probe[0].numel())
        return T * (1 + b.d_out + p.k_in + p.k_out)

    total = 0
    for p in proj.layers:
        b = p.block
        if p.tied is not None:
            total += table_numbers(p.tied, p)
        if b.source == "embedding":
            total += table_numbers(b, p)
        elif b.path in ins:
            T = int(token_rows(ins[b.path], 1).shape[1])
            total += T * (b.width_in + b.d_out + p.k_in + p.k_out)
    return total


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= tol * (1.0 + float(b.abs().max()))


def _read_columns(J: torch.Tensor, engine: Any, logits: torch.Tensor, targets: torch.Tensor, ggn: bool) -> torch.Tensor:
    """J (B, c', m) with the columns no result reads set to 0: a language model's Gauss-Newton columns
    at positions of loss weight 0, where the output Hessian's root is 0 (and dl/df too). Verification
    compares only the others: at a padding position inside a batch's width the batched forward has
    logits, the one-row truth (trimmed to its own length) zeros."""
    share = position_weights(engine.loss, logits, targets) if ggn else None
    if share is None:
        return J
    keep = (share > 0).repeat_interleave(logits.shape[-1], 1)  # (B, L V), position-major like the columns
    return J * keep[..., None].to(J.dtype)


def verify_embeddings(
    engine: Any, proj: KroneckerProjection, rows: torch.Tensor, targets: torch.Tensor, ggn: bool
) -> frozenset[str]:
    """The embedding layers (and tied heads) of ``proj`` whose columns must come from per-sample
    Jacobians: each table's columns from its ids and output gradients (a tied head's: the sum of
    the head's and its table's) are compared on ``rows`` (two are enough)
    with the projection of its per-sample gradients from plain autograd, and the logits with the
    plain forward's; a
    table that fails (other numbers, an error: read twice per forward, ids not batched) is listed."""
    tables = [p for p in proj.layers if p.block.source == "embedding" or p.tied is not None]
    if not tables:
        return frozenset()
    with torch.no_grad():
        reference = engine.apply(engine.theta.detach(), rows)
    tol = 1e-8 if engine.dtype == torch.float64 else 1e-3
    failed = set()
    for p in tables:
        others = frozenset(q.block.path for q in proj.layers if q is not p)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                logits, _, Phi, _, _ = _forward_backward(engine, proj, rows, targets, ggn, OtherPlan(), skip=others)
        except Exception:  # noqa: BLE001 - any failure of the structure sends the table to the Jacobian route
            failed.add(p.block.path)
            continue
        truth = _read_columns(
            _layer_rows_by_autograd(engine, proj, p, rows, targets, ggn), engine, logits, targets, ggn
        )
        got = _read_columns(Phi[..., p.col : p.col + p.dim], engine, logits, targets, ggn)
        if not (_close(logits, reference, tol) and _close(got, truth, tol)):
            failed.add(p.block.path)
    return frozenset(failed)


#: largest batched copy (B x numel elements) the plan makes of a parameter
BATCHED_COPY_ELEMENTS = 2**24


def verify_plan(
    engine: Any,
    proj: KroneckerProjection,
    rows: torch.Tensor,
    targets: torch.Tensor,
    ggn: bool,
    skip: frozenset[str] = frozenset(),
) -> OtherPlan:
    """The structural plan for ``proj``'s other parameters, checked on ``rows`` (two are enough)
    against per-sample Jacobians; what fails (an error, other logits, other rows) is generic."""
    plan = plan_other(engine, proj.other_names)
    embedding = {
        f"{path}.{name}" if path else name
        for path, module in engine.module.named_modules()
        if isinstance(module, torch.nn.Embedding)
        for name, _ in module.named_parameters(recurse=False)
    }
    too_big = {
        n
        for n in plan.batched
        if n in embedding or engine.numels[engine.names.index(n)] * rows.shape[0] > BATCHED_COPY_ELEMENTS
    }
    plan = plan.without(too_big)
    if not plan.fast:
        return plan
    with torch.no_grad():
        reference = engine.apply(engine.theta.detach(), rows)
    tol = 1e-8 if engine.dtype == torch.float64 else 1e-3

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return _close(a, b, tol)

    def attempt(candidate: OtherPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        try:
            # a candidate's misuse of a copy may warn before it fails: not the user's concern
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                logits, _, _, got, _ = _forward_backward(engine, proj, rows, targets, ggn, candidate, skip)
        except Exception:  # noqa: BLE001 - a copy the forward cannot take (any error) rules the candidate out
            return None
        return (logits, got) if close(logits, reference) else None

    result = attempt(plan)
    if result is None:  # a batched copy broke the forward: keep those that run alone
        keep = set()
        for name in plan.batched:
            alone = plan.without(set(plan.batched) - {name})
            if attempt(alone) is not None:
                keep.add(name)
        plan = plan.without(set(plan.batched) - keep)
        if not plan.fast:
            return plan
        result = attempt(plan)
        if result is None:
            return plan.without(set(plan.fast))
    logits, got = result
    slices, at, wrong = _other_slices(engine, proj), 0, set()
    index = torch.cat([proj.other_index[slice(*slices[n])] for n in plan.fast])
    truth = _read_columns(_rows_by_autograd(engine, index, rows, targets, ggn), engine, logits, targets, ggn)
    for name in plan.fast:
        width = slices[name][1] - slices[name][0]
        if name not in got or not close(
            _read_columns(got[name].reshape(truth.shape[0], truth.shape[1], -1), engine, logits, targets, ggn),
            truth[..., at : at + width],
        ):
            wrong.add(name)
        at += width
    return plan.without(wrong)


#: verified routes by :func:`_routes_key`, with a weak reference to the module they were verified on,
#: most recent last (a run's clean, perturbed and check influence runs build a projection each on
#: the same model)
_VERIFIED_ROUTES: OrderedDict[str, tuple[weakref.ref, frozenset[str], OtherPlan]] = OrderedDict()
VERIFIED_ROUTES_KEPT = 8


def _routes_key(engine: Any, proj: KroneckerProjection, rows: torch.Tensor, ggn: bool) -> str:
    """What a verification's outcome depends on besides the rows' values (which the routes do not
    branch on): the module object itself (its code and attributes, not only its structure; the
    entry also holds a weak reference, so a new module at a reused address does not match), the
    tracked names, the loss, the dtype and device, the projection's layout, the row width and the
    curvature columns."""
    parts = {
        "module": id(engine.module),
        "tracked": list(engine.names),
        "loss": type(engine.loss).__qualname__,
        "dtype": str(engine.dtype),
        "device": str(engine.device),
        "layout": proj.describe(),
        "row": list(rows.shape[1:]),
        "ggn": ggn,
    }
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _verify_routes(
    engine: Any, proj: KroneckerProjection, rows: torch.Tensor, targets: torch.Tensor, ggn: bool
) -> None:
    """Set ``proj``'s embedding fallback and plan for the other parameters, verified on the first
    two of ``rows``, unless already set (call inside the engine's context, with grad enabled).
    A verification made in this process for the same module and settings (:func:`_routes_key`) is reused:
    on GPT-2-small each takes about 20 s of per-parameter autograd, and a malleability run builds
    five projections of one model."""
    if proj.embedding_fallback is not None and proj.other_plan is not None:
        return
    key = _routes_key(engine, proj, rows, ggn)
    known = _VERIFIED_ROUTES.get(key)
    if known is not None and known[0]() is engine.module:
        _VERIFIED_ROUTES.move_to_end(key)
        _, fallback, plan = known
        proj.embedding_fallback = fallback if proj.embedding_fallback is None else proj.embedding_fallback
        proj.other_plan = plan if proj.other_plan is None else proj.other_plan
        return
    if proj.embedding_fallback is None:
        proj.embedding_fallback = verify_embeddings(engine, proj, rows[:2], targets[:2], ggn)
    if proj.other_plan is None:
        skip = proj.embedding_fallback
        proj.other_plan = verify_plan(engine, proj, rows[:2], targets[:2], ggn, skip) if proj.k_other else OtherPlan()
    _VERIFIED_ROUTES[key] = (weakref.ref(engine.module), proj.embedding_fallback, proj.other_plan)
    while len(_VERIFIED_ROUTES) > VERIFIED_ROUTES_KEPT:
        _VERIFIED_ROUTES.popitem(last=False)


class ProjectedRows(NamedTuple):
    """What one forward and backward pass gives per sample: ``psi`` (B, c', k), ``r`` (B, k) and
    the sample's loss at the model (B,) float64."""

    psi: torch.Tensor
    r: torch.Tensor
    loss: torch.Tensor


def projected_rows(
    engine: Any, proj: KroneckerProjection, rows: torch.Tensor, targets: torch.Tensor, curvature: str
) -> ProjectedRows:
    """(Psi (B, c', k), r (B, k), loss (B,)) for prepared rows and one-hot targets: r_i = R^T grad l_i,
    Psi_i with Psi_i^T Psi_i sample i's term of the projected curvature (``ggn``: L_i^T Phi_i,
    c' = c; ``empirical``: r_i, c' = 1) and l_i itself (float64; computed in the engine's dtype by
    the forward pass that the gradients come from). One forward pass and c (ggn) or 1 backward passes to
    the linear layers' outputs, which also give the LayerNorm and broadcast parameters'
    per-sample gradients (:mod:`attnaudit.analyses.influence.other_grads`, verified on the
    first rows a projection sees); any other parameter through per-sample Jacobians."""
    ggn = curvature == "ggn"
    with engine.context(), torch.enable_grad():
        _verify_routes(engine, proj, rows, targets, ggn)
        skip = proj.embedding_fallback
        assert skip is not None  # set by _verify_routes
        plan = proj.other_plan
        logits, dl, Phi, fast, losses = _forward_backward(engine, proj, rows, targets, ggn, plan, skip)
        for p in proj.layers:
            if p.block.path in skip:
                Phi[:, :, p.col : p.col + p.dim] = _layer_rows_generic(engine, proj, p, rows, targets, ggn)
        if proj.k_other:
            B, n_cols = Phi.shape[0], Phi.shape[1]
            J = torch.empty(B, n_cols, int(proj.other_index.numel()), dtype=Phi.dtype, device=Phi.device)
            slices = _other_slices(engine, proj)
            for name, g in fast.items():
                J[:, :, slice(*slices[name])] = g.reshape(B, n_cols, -1).to(Phi.dtype)
            if plan.generic:
                G = _generic_rows(engine, proj, plan.generic, rows, targets, ggn).to(Phi.dtype)
                at = 0
                for name in plan.generic:
                    a, b = slices[name]
                    J[:, :, a:b] = G[:, :, at : at + b - a]
                    at += b - a
            Phi[:, :, proj.other_col :] = proj.project_other(J)
    loss = losses.to(torch.float64)
    if not ggn:
        return ProjectedRows(Phi, Phi[:, 0], loss)
    L = output_hessian_root(engine.loss, logits, targets).to(Phi.dtype)  # L L^T = H
    r = torch.einsum("bc,bck->bk", dl.reshape(Phi.shape[0], -1).to(Phi.dtype), Phi)
    if L.ndim == 4:  # a language model's roots per position (B, L, V, V): block-diagonal
        B, T, V = L.shape[:3]
        psi = torch.einsum("btvj,btvk->btjk", L, Phi.reshape(B, T, V, -1))
        return ProjectedRows(psi.reshape(B, T * V, -1), r, loss)
    return ProjectedRows(torch.einsum("bcj,bck->bjk", L, Phi), r, loss)


def _row_keys(rows: torch.Tensor, targets: torch.Tensor) -> list[bytes]:
    """One content hash per (row, target): the cache's key for that sample's projected rows."""
    r = tensor_bits(rows.reshape(rows.shape[0], -1))
    t = tensor_bits(targets.reshape(targets.shape[0], -1))
    return [hashlib.sha1(r[i].data).digest() + hashlib.sha1(t[i].data).digest()[:8] for i in range(r.shape[0])]


def _slice_start(part: torch.Tensor, whole: torch.Tensor) -> int | None:
    """The first row of ``whole`` that ``part`` is a contiguous run of rows of (the same memory,
    hence the same content), or None."""
    if part.device != whole.device or part.dtype != whole.dtype or part.shape[1:] != whole.shape[1:]:
        return None
    if not (part.is_contiguous() and whole.is_contiguous()) or part.shape[0] == 0 or whole.shape[0] == 0:
        return None
    if part.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
        return None
    row = max(1, whole[0].numel())
    offset = part.storage_offset() - whole.storage_offset()
    if offset % row or not 0 <= offset // row <= whole.shape[0] - part.shape[0]:
        return None
    return int(offset // row)


# ------------------------------------------------------------------ the gradient store (InfluenceConfig.store)
def store_segment(
    engine: Any, proj: KroneckerProjection, rows: torch.Tensor, targets: torch.Tensor, curvature: str, chunk: int
) -> SegmentArrays:
    """One store segment: :func:`projected_rows` of ``rows`` in chunks of ``chunk`` from its first
    row with each row's loss, and sum_i psi_i^T psi_i in float64, summed chunk by chunk. The same
    arguments give the same bytes in any process running torch with the same number of threads."""
    k = proj.k
    curv = torch.zeros(k, k, dtype=torch.float64, device=engine.device)
    psis, rs, losses = [], [], []
    for a, b in ranges(int(rows.shape[0]), chunk):
        psi, r, loss = projected_rows(engine, proj, rows[a:b], targets[a:b], curvature)
        flat = psi.reshape(-1, k).to(torch.float64)
        curv.addmm_(flat.T, flat)
        psis.append(psi.detach().cpu())
        rs.append(r.detach().cpu())
        losses.append(loss.cpu())
    return segment_arrays(torch.cat(psis), torch.cat(rs), curv, torch.cat(losses))


def _store_task(shared: dict, rows: torch.Tensor, targets: torch.Tensor, threads: int) -> SegmentArrays:
    """A Ray task: one segment, on the engine shipped in ``shared`` with its projection rebuilt
    here (seeded) and the routes the driver verified, at the driver's number of torch threads."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    engine = shared["engine"]
    proj = projection_for(engine, shared["proj_dim"], seed=shared["seed"], split=shared["split"])
    if proj.describe() != shared["layout"]:
        raise AuditError("the projection rebuilt in a Ray worker differs from the driver's (another attnaudit there?)")
    proj.embedding_fallback, proj.other_plan = shared["embedding_fallback"], shared["other_plan"]
    return store_segment(engine, proj, rows, targets, shared["curvature"], shared["chunk"])


def _store_key(engine: Any, proj: KroneckerProjection, config: Any, fingerprint: str, curvature: str) -> StoreKey:
    if curvature == "ggn" and engine.loss.logits_ndim == 3:  # L V rows per document: L is the padded width
        raise FieldError(
            "store",
            "{name} keeps a language model's projected rows for curvature empirical (its Gauss-Newton rows depend "
            "on how far the documents are padded); use curvature empirical, or drop {name}",
        )
    cols = engine.n_classes if curvature == "ggn" else 1
    dtype = str(engine.dtype).replace("torch.", "")
    return StoreKey(fingerprint, int(config.proj_dim), proj.describe(), curvature, dtype, proj.k, cols)


def _rows_from_store(
    context: base.Context, proj: KroneckerProjection, key: StoreKey, keys: list[bytes], curvature: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(G (n, k), n F (k, k) float64, the rows' losses (n,) float64, diagnostics) from the store
    ``context.config.store``: rows
    it holds are read (memory-mapped), the others computed -- here or on Ray tasks -- and
    committed as new segments first. F adds a segment's stored curvature sum when the training
    set uses each of its rows once, else the used rows' psi^T psi (a row used twice counts twice)."""
    config, eng = context.config, context.engine
    rows, T = context.train_rows, context.train_targets
    n, k = int(rows.shape[0]), proj.k
    store = GradientStore(config.store, key)
    with store.locked():
        t0 = time.perf_counter()
        located = store.locate(keys)
        dropped = located.dropped
        first: dict[bytes, int] = {}  # a missing row's content key -> its first position
        for i, key_ in enumerate(keys):
            if key_ not in located.where and key_ not in first:
                first[key_] = i
        new_keys = list(first)
        estimate = store.check_space(len(new_keys)) if new_keys else 0
        if new_keys:
            index = torch.tensor(list(first.values()), dtype=torch.long, device=rows.device)
            with eng.context(), torch.enable_grad():  # as the in-memory path: verified on the first rows computed
                _verify_routes(eng, proj, rows[index[:2]], T[index[:2]], curvature == "ggn")
            spans = store.plan(len(new_keys))
            segments: Iterable[SegmentArrays]
            if config.store_executor == "ray":
                if eng.device.type != "cpu":
                    raise FieldError(
                        "store_executor",
                        "{name} ray builds the store on CPU workers, but this engine is on "
                        + literal(eng.device.type)
                        + "; use {name} local",
                    )
                shared = {
                    "engine": eng,
                    "proj_dim": int(config.proj_dim),
                    "seed": int(config.seed),
                    "split": str(config.proj_split),
                    "layout": proj.describe(),
                    "embedding_fallback": proj.embedding_fallback,
                    "other_plan": proj.other_plan,
                    "curvature": curvature,
                    "chunk": int(context.chunk),
                }
                jobs = ((rows[index[a:b]].cpu(), T[index[a:b]].cpu()) for a, b in spans)
                segments = ray_map(
                    _store_task,
                    shared,
                    jobs,
                    threads=torch.get_num_threads(),
                    workers=config.store_workers,
                    address=config.ray_address,
                )
            else:
                segments = (
                    store_segment(eng, proj, rows[index[a:b]], T[index[a:b]], curvature, context.chunk)
                    for a, b in spans
                )
            with build_progress(len(new_keys), estimate) as advance:
                store.build(new_keys, segments, progress=advance)
            located = store.locate(keys)
        build_s = time.perf_counter() - t0 if new_keys else 0.0
        G = torch.empty(n, k, dtype=eng.dtype, device=eng.device)
        F = torch.zeros(k, k, dtype=torch.float64, device=eng.device)
        losses = torch.empty(n, dtype=torch.float64, device=eng.device)
        by_segment: dict[int, tuple[list[int], list[int]]] = {}
        for i, key_ in enumerate(keys):
            seg, row = located.where[key_]
            positions, seg_rows = by_segment.setdefault(seg, ([], []))
            positions.append(i)
            seg_rows.append(row)
        for seg in sorted(by_segment):
            positions, seg_rows = by_segment[seg]
            at = np.asarray(seg_rows, dtype=np.int64)
            where = torch.tensor(positions, dtype=torch.long, device=eng.device)
            G[where] = store.tensor(seg, "r", at).to(eng.device)
            losses[where] = store.tensor(seg, "loss", at).to(eng.device)
            if (np.bincount(at, minlength=int(store.segments[seg]["rows"])) == 1).all():
                F += store.tensor(seg, "curvature").to(eng.device)
                continue
            for a, b in ranges(len(at), context.chunk):
                flat = store.tensor(seg, "psi", at[a:b]).reshape(-1, k).to(eng.device, torch.float64)
                F.addmm_(flat.T, flat)
        diag = {
            "store": str(store.folder),
            "store_rows_reused": sum(1 for key_ in keys if key_ not in first),
            "store_rows_computed": len(new_keys),
            "store_bytes": store.size_bytes,
            "store_bytes_estimate": estimate,
            "store_build_seconds": build_s,
            "store_executor": config.store_executor if new_keys else None,
            "store_segments_dropped": dropped,
        }
    return G, F, losses, diag


#: per model (as the row cache): test sample key -> r = R^T grad l of that sample
_TEST_ROW_CACHE: OrderedDict[str, dict[bytes, torch.Tensor]] = OrderedDict()


def _test_rows(
    eng: Any, proj: KroneckerProjection, rows: torch.Tensor, targets: torch.Tensor, chunk: int, model_key: str
) -> torch.Tensor:
    """(n_test, k) float64: each test row's projected loss gradient, one forward and one backward
    pass per chunk; rows this process projected before for the same model and projection are reused
    (a static malleability run scores the same test rows against its clean and every perturbed
    training set), within :data:`ROW_CACHE_BYTES` per model."""
    n, k = int(rows.shape[0]), proj.k
    keys = _row_keys(rows, targets)
    caching = ROW_CACHE_BYTES > 0 and n * k * eng.theta.element_size() <= ROW_CACHE_BYTES
    entries = _TEST_ROW_CACHE.pop(model_key, {}) if caching else {}
    missing = [i for i, key in enumerate(keys) if key not in entries]
    out = torch.empty(n, k, dtype=torch.float64, device=eng.device)
    for a, b in ranges(len(missing), chunk):
        idx = torch.tensor(missing[a:b], dtype=torch.long, device=rows.device)
        r = projected_rows(eng, proj, rows[idx], targets[idx], "empirical").r
        for j, i in enumerate(missing[a:b]):
            entries[keys[i]] = r[j].detach().clone()
    for i, key in enumerate(keys):
        out[i] = entries[key]
    if caching:
        # earlier test sets' rows stay while they fit: the float64 check's float32 side scores a
        # subset of the run's test rows between its clean and perturbed runs
        if len(entries) * k * eng.theta.element_size() > ROW_CACHE_BYTES:
            entries = {key: entries[key] for key in keys}
        _remember(_TEST_ROW_CACHE, model_key, entries)
    return out


@dataclass
class _ProjectedState(base.State):
    HR: torch.Tensor | None = None
    M: torch.Tensor | None = None
    Bp: torch.Tensor | None = None
    lam_max: float = 0.0
    diagnostics: dict | None = None
    # LoGra / TRAK: the pencil's eigenvectors U (k, r) and eigenvalues, the test side in that basis
    U: torch.Tensor | None = None
    evals: torch.Tensor | None = None
    coeff: torch.Tensor | None = None
    scorer: Callable | None = None


@base.register
class Projected(base.Estimator):
    """Per-sample gradients projected to k dimensions (per linear layer through its inputs and
    output gradients, LoGra's Kronecker form), the curvature built from the projected rows
    (Gauss-Newton or empirical Fisher, k x k) and solved exactly; ``--curvature galerkin``:
    the Hessian on a random sign subspace from k Hessian-vector products (see the module
    docstring). With k >= P the projections are identities and this is exact (GGN / Fisher /
    Hessian) influence."""

    name = "projected"
    curvatures = {
        "auto": "the Gauss-Newton matrix up to 32 classes, the empirical Fisher above and for language models "
        "(projected)",
        "ggn": "the exact Gauss-Newton matrix in the projected space",
        "empirical": "the empirical Fisher in the projected space",
        "galerkin": "the Hessian, Galerkin-projected from k Hessian-vector products",
    }
    # a cached-feature fast path is fine: its engine's linear layers (an nn.Linear head) are found the same way
    budget_hint = "lower proj_dim, or use the ekfac estimator"

    def __init__(self) -> None:
        self._built: tuple[Any, tuple, KroneckerProjection] | None = None

    def projection(self, engine: Any, config: Any) -> KroneckerProjection:
        """The projection of ``engine`` for ``config`` (proj_dim, seed, proj_split): built once
        (one QR per layer) and shared by the memory plan and :meth:`prepare` of one run, since
        the sweep asks one estimator instance for both."""
        key = (int(config.proj_dim), int(config.seed), str(config.proj_split))
        if self._built is None or self._built[0] is not engine or self._built[1] != key:
            proj = projection_for(engine, key[0], seed=key[1], split=key[2])
            self._built = (engine, key, proj)
        return self._built[2]

    def factor_bytes(self, engine: Any, config: Any = None) -> int:
        """The projection's own structures, measured on the engine: galerkin, two column blocks of
        R and H R (2 x 64 P numbers); otherwise the layers' orthonormal factors P_in, P_out and one
        64-column block of the sign projection of the other parameters (with its int8 signs).
        Without ``config``: the largest of the two."""
        itemsize = engine.theta.element_size()
        galerkin = 2 * 64 * engine.n_params * itemsize
        if config is None:
            return galerkin
        if resolve_curvature(config.curvature, engine) == "galerkin":
            return galerkin
        proj = self.projection(engine, config)
        factors = sum(
            (p.P_in.numel() if p.P_in is not None else 0) + (p.P_out.numel() if p.P_out is not None else 0)
            for p in proj.layers
        )
        signs = proj.other.P * min(proj.other.block, proj.other.k) if proj.other is not None else 0
        return factors * itemsize + signs * (itemsize + 1)

    def gradient_params_per_row(self, engine: Any, rows: Any = None, config: Any = None) -> int:
        """A row's working set: Phi (c' x k), the other parameters' rows (c' x n_other) and what
        :func:`_forward_backward` captures for it (:func:`_capture_numbers`); never the P-wide
        gradient, except for galerkin (R applied to full per-sample gradients) and without
        ``config``. The transient of per-sample Jacobians for parameters no structure covers
        (``vmap(jacrev)`` over JACOBIAN_ROWS rows at a time) is not counted, as before: sizing
        it per row shrank the chunks 5-fold on a BERT-shaped model whose 3.9 M-number word table
        took that route, and each chunk redraws the sign projection (4x slower)."""
        if config is None:
            return engine.n_params
        curvature = resolve_curvature(config.curvature, engine)
        if curvature == "galerkin":
            return engine.n_params
        proj = self.projection(engine, config)
        cols = ggn_columns(engine, rows) if curvature == "ggn" else 1
        n_other = int(proj.other_index.numel())
        per_row = cols * (proj.k + n_other)
        if rows is not None:
            per_row += _capture_numbers(engine, proj, rows)
        return per_row

    def test_gradient_params(self, engine: Any, config: Any = None) -> int:
        """The test side is projected like the training rows (k numbers per test column), except
        for galerkin and without ``config`` (P)."""
        if config is None or resolve_curvature(config.curvature, engine) == "galerkin":
            return engine.n_params
        return self.projection(engine, config).k

    def memory_parts(self, query: base.MemoryQuery) -> dict[str, int]:
        # F (or R^T H R), R^T R and one eigendecomposition (3 k^2), and the projection's own
        # structures (factor_bytes; not measured: galerkin's two column blocks, 2 x 64 P, the larger)
        P = query.n_params
        kp = min(query.proj_dim, P)
        # the projected training gradients (n x k) and the row cache (n x (c + 1) x k, bounded)
        cached = query.n_train * (max(query.n_classes, 1) + 1) * kp * query.itemsize
        rows = query.n_train * kp * query.itemsize + (min(cached, ROW_CACHE_BYTES) if ROW_CACHE_BYTES > 0 else 0)
        structures = query.factor_bytes if query.factor_bytes else 2 * 64 * P * query.itemsize
        return {
            "projected_curvature": 3 * kp**2 * query.itemsize + structures,
            "projected_rows": rows,
        }

    # ------------------------------------------------------------------ prepare
    def prepare(self, context: base.Context) -> base.State:
        config, eng = context.config, context.engine
        curvature = resolve_curvature(config.curvature, eng)
        if curvature == "galerkin":
            return _galerkin(context)
        proj = self.projection(eng, config)
        k = proj.k
        rows, T = context.train_rows, context.train_targets
        n = rows.shape[0]
        keys = _row_keys(rows, T)
        cols = ggn_columns(eng, rows) if curvature == "ggn" else 1
        fingerprint = factors_fingerprint(eng, rows[:0], "projected", curvature, config.seed)
        model_key = "|".join([fingerprint, str(config.proj_dim), str(proj.describe())])
        per_row = (cols + 1) * k * eng.theta.element_size()
        store_diag: dict = {}
        if getattr(config, "store", None):  # the on-disk tier (analyses.influence.store): no in-memory cache
            G, F, losses, store_diag = _rows_from_store(
                context, proj, _store_key(eng, proj, config, fingerprint, curvature), keys, curvature
            )
            n_computed, n_reused = store_diag["store_rows_computed"], store_diag["store_rows_reused"]
            caching, entries = False, {}
        else:
            caching = ROW_CACHE_BYTES > 0 and n * per_row <= ROW_CACHE_BYTES
            entries = _ROW_CACHE.pop(model_key, {}) if caching else {}
            missing = [i for i, key in enumerate(keys) if key not in entries]
            hits = [i for i, key in enumerate(keys) if key in entries]
            n_computed, n_reused = len(missing), len(hits)
            G = torch.empty(n, k, dtype=eng.dtype, device=eng.device)
            F = torch.zeros(k, k, dtype=torch.float64, device=eng.device)
            losses = torch.empty(n, dtype=torch.float64, device=eng.device)
            for a, b in ranges(len(missing), context.chunk):
                idx = torch.tensor(missing[a:b], dtype=torch.long, device=rows.device)
                psi, r, loss = projected_rows(eng, proj, rows[idx], T[idx], curvature)
                flat = psi.reshape(-1, k).to(torch.float64)
                F.addmm_(flat.T, flat)
                G[idx] = r
                losses[idx] = loss
                if caching:
                    for j, i in enumerate(missing[a:b]):
                        entries[keys[i]] = (psi[j].clone(), r[j].clone(), loss[j].clone())
            for a, b in ranges(len(hits), context.chunk):
                part = hits[a:b]
                flat = torch.cat([entries[keys[i]][0] for i in part]).to(torch.float64)
                F.addmm_(flat.T, flat)
                where = torch.tensor(part, dtype=torch.long)
                G[where] = torch.stack([entries[keys[i]][1] for i in part])
                losses[where] = torch.stack([entries[keys[i]][2] for i in part])
        F /= max(n, 1)
        if caching:
            live = set(keys)  # keep this training set's rows (and drop rows it no longer has, bounding the entry)
            _remember(_ROW_CACHE, model_key, {key: v for key, v in entries.items() if key in live})

        # the pencil (F, M): M = R^T R, its range basis W (k, r) with W^T M W = I
        M = proj.gram().to(eng.device)
        eM, VM = torch.linalg.eigh(M)
        keep = eM > k * torch.finfo(torch.float64).eps * float(eM.max())
        W = VM[:, keep] / eM[keep].sqrt()
        Fr = W.T @ F @ W
        evals, V = torch.linalg.eigh(0.5 * (Fr + Fr.T))
        U = W @ V  # (k, r): F U = M U diag(evals), U^T M U = I
        if config.fast_path:  # the test side projected like the training rows, never the (n_test, P) gradients
            Bp = _test_rows(eng, proj, context.test_rows, context.test_targets, context.chunk, model_key)
            if not config.per_test:  # the summed test loss: R^T is linear
                Bp = Bp.sum(0, keepdim=True)
        else:  # the reference the tests compare with: full test gradients through R
            Bp = proj.apply(context.test_grads).to(torch.float64)  # (k_test, k)
        coeff = Bp @ U
        lam_max = float(evals[-1])

        lookup = {key: i for i, key in enumerate(keys)}

        def score(rows_: torch.Tensor, targets_: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
            a = _slice_start(rows_, rows)  # the sweep passes slices of the training rows: no hashing
            if a is not None and _slice_start(targets_, T) == a:
                return G[a : a + rows_.shape[0]].to(S.dtype) @ S
            found = [lookup.get(key) for key in _row_keys(rows_, targets_)]
            if all(i is not None for i in found):
                R_ = G[torch.tensor(found, dtype=torch.long)]
            else:  # rows this call did not prepare: projected afresh
                R_ = projected_rows(eng, proj, eng.rows(rows_), targets_.to(eng.device, eng.dtype), curvature)[1]
            return R_.to(S.dtype) @ S

        info = {
            "lambda_max": lam_max,
            "lambda_max_method": "largest eigenvalue of the projected curvature (Ritz value on span(R))",
            "solver": "projected",
        }
        diag = {
            "proj_dim": int(config.proj_dim),
            "proj_dim_used": k,
            "projection": "per linear layer: orthonormal seeded Gaussian factors on inputs and output gradients "
            "(Kronecker, LoGra); other parameters: random signs"
            + "".join(
                f"; {p.block.weight} (tied: the head {p.block.path} and the embedding {p.tied.path}) as one layer "
                "in the head's layout, both uses' projected gradients summed"
                for p in proj.layers
                if p.tied is not None
            ),
            "projection_seed": config.seed,
            "projection_layout": proj.describe(),
            # parameters outside linear layers: per-sample gradients from the shared backward
            # passes (LayerNorm, broadcast parameters; verified) or from per-sample Jacobians
            "other_parameters_from_backward": proj.other_plan.fast if proj.other_plan is not None else None,
            "other_parameters_by_jacobian": proj.other_plan.generic if proj.other_plan is not None else None,
            # embedding tables projected from their ids and output gradients, and those verification sent to Jacobians
            "embeddings_from_ids": [
                p.block.path
                for p in proj.layers
                if p.block.source == "embedding" and p.block.path not in (proj.embedding_fallback or ())
            ],
            "embeddings_by_jacobian": sorted(proj.embedding_fallback or ()),
            # tied head -> embedding pairs projected from the head's activations and the table's ids
            "tied_heads_from_ids": {
                p.block.path: p.tied.path
                for p in proj.layers
                if p.tied is not None and p.block.path not in (proj.embedding_fallback or ())
            },
            "curvature": curvature,
            "hessian_vector_products": 0,
            "backward_passes_per_chunk": cols,
            "projected_rows_computed": n_computed,
            "projected_rows_reused": n_reused,
            "projected_min_eigenvalue": float(evals[0]),
            **store_diag,
        }
        # fast_path=False: full per-sample gradients through R (the reference the tests compare with)
        train_map = None if config.fast_path else proj.apply
        return _ProjectedState(
            context,
            info,
            train_map=train_map,
            train_losses=losses,
            lam_max=lam_max,
            diagnostics=diag,
            U=U,
            evals=evals,
            coeff=coeff,
            scorer=score,
        )

    def train_scorer(self, state: base.State):
        assert isinstance(state, _ProjectedState)  # what prepare returned
        return state.scorer  # None for galerkin: full per-sample gradients through train_map

    # ------------------------------------------------------------------ solve
    def solve(self, state: base.State, damping: float | str | None) -> base.Solution:
        assert isinstance(state, _ProjectedState)  # what prepare returned
        assert damping is not None  # uses_damping: the sweep passes every damping as given
        diagnostics = state.diagnostics
        assert diagnostics is not None  # set by prepare
        d = base.absolute_damping(damping, state.lam_max) if isinstance(damping, str) else float(damping)
        dtype = state.context.engine.dtype
        if state.U is None:  # galerkin
            HR, M, Bp = state.HR, state.M, state.Bp
            assert HR is not None and M is not None and Bp is not None  # set by prepare
            Z = torch.linalg.solve(HR + d * M, Bp.T).T  # (k_test, k)
            return base.Solution(Z.to(dtype), d, dict(diagnostics))
        U, evals, coeff = state.U, state.evals, state.coeff
        assert evals is not None and coeff is not None  # set with U
        shifted = evals + d
        scale = max(float(evals.abs().max()) if evals.numel() else 0.0, 1e-300)
        if not evals.numel() or float(shifted.abs().min()) <= 1e-12 * scale:
            raise FieldError(
                "damping",
                f"the damped projected curvature is singular (damping {d:g}, largest eigenvalue {state.lam_max:.3g}); "
                "pass {name} > 0, e.g. {name} " + f"{max(1e-3 * state.lam_max, 1e-8):.1g}",
            )
        Z = (coeff / shifted) @ U.T  # (k_test, k)
        diag = {**diagnostics, "damped_min_eigenvalue": float(shifted[0])}
        return base.Solution(Z.to(dtype), d, diag)


def _galerkin(context: base.Context) -> _ProjectedState:
    """H_R = R^T H R from k Hessian-vector products, M = R^T R (R: random signs over all P
    parameters, applied to full per-sample gradients)."""
    config, hvp, eng, B = context.config, context.hvp, context.engine, context.test_grads
    P = hvp.size
    k = min(int(config.proj_dim), P)  # more columns than parameters add nothing (R^T R would be singular)
    proj = SignProjection(P, k, seed=config.seed, dtype=eng.dtype, device=eng.device)
    HR = torch.empty(k, k, dtype=torch.float64, device=eng.device)
    M = torch.empty(k, k, dtype=torch.float64, device=eng.device)
    for j0, j1 in proj.blocks():
        Rj = proj.columns(j0, j1)
        HRj = hvp.matmat(Rj.T.contiguous()).T  # (P, b) = H R_j
        HR[:, j0:j1] = proj.apply(HRj.T).T.to(torch.float64)
        M[:, j0:j1] = proj.apply(Rj.T).T.to(torch.float64)
    HR = 0.5 * (HR + HR.T)
    M = 0.5 * (M + M.T)
    Bp = proj.apply(B).to(torch.float64)  # (k_test, k)
    # Ritz values of H on span(R): the generalised eigenvalues of (H_R, M)
    L = torch.linalg.cholesky(M)
    C = torch.linalg.solve_triangular(L, torch.linalg.solve_triangular(L, HR, upper=False).T, upper=False)
    evals = torch.linalg.eigvalsh(0.5 * (C + C.T))
    lam_max = float(evals[-1])
    info = {"lambda_max": lam_max, "lambda_max_method": "Ritz value on span(R)", "solver": "projected"}
    diag = {
        "proj_dim": int(config.proj_dim),
        "proj_dim_used": k,
        "projection": "random signs +-1/sqrt(k), seeded column blocks",
        "projection_seed": config.seed,
        "curvature": "galerkin",
        "hessian_vector_products": k,
        "projected_min_eigenvalue": float(evals[0]),
    }
    return _ProjectedState(context, info, train_map=proj.apply, HR=HR, M=M, Bp=Bp, lam_max=lam_max, diagnostics=diag)
