"""How far training moved a network from the kernel regime: the empirical NTK of a trained
model against the one at its initialization, per parameter group, and the distance between
the trained network and its linearized model.

Everything runs through the functional engine (:class:`attnaudit.core.engine.Engine`) on
float64 copies in eval mode, so it applies to any module (built-in ViTs and 2-layer nets,
Hugging Face models, a user's ``--factory`` module) and never touches the caller's module.
The closed forms of :mod:`attnaudit.core.ntk` stay the fast path of the 2-layer width sweep.

Kernels
-------
Rows X = ``kernel_points`` training rows; J_g(x) the per-sample Jacobian (c, P_g) of the c
logits with respect to the parameters of group g; the eNTK of group g is

    Theta_g[i, j, a, b] = J_g,a(x_i) . J_g,b(x_j),     Theta = sum_g Theta_g.

* ``movement`` = ||Theta(T) - Theta(0)||_F / ||Theta(0)||_F on the **full (n c) x (n c)
  kernel**, the definition of ``ntk-distance``'s 2-layer sweep (``kernel_movement``);
  ``movement_trace`` the same on the output-averaged (n x n) kernel (1/c) sum_a Theta[:, :, a, a]
  (the sweep's ``kernel_movement_trace``). ``form="trace"`` computes only the latter (c
  times fewer operations).
* ``norm_ratio`` = ||Theta(T)||_F / ||Theta(0)||_F and ``kernel_distance`` = 1 - <Theta(0),
  Theta(T)>_F / (||Theta(0)||_F ||Theta(T)||_F) (Fort et al. 2020), which split the movement into
  a change of size and a change of shape: a kernel that only grew has kernel distance 0 however
  large its movement (the built-in ViTs start from weights of std 0.02, so training mostly
  scales their kernel up, and the movement alone would overstate how its shape changed).
* per group, the same quantities for Theta_g, and ``trace_share`` = tr(Theta_g) / tr(Theta):
  the group's share of the kernel (groups add up to 1, since Theta = sum_g Theta_g).
* ``cka`` = centred kernel alignment of the output-averaged kernel K with the labels,
  <H K H, H L H>_F / (||H K H||_F ||H L H||_F), L = Y Y^T (Y one-hot), H = I - 11^T/n
  (Cortes et al. 2012; scale-free, so output-averaged or summed gives the same value), before
  (Theta(0)) and after (Theta(T)) training, overall and per group.

Grouping rule (:func:`group_of`): a parameter belongs to the prefix of its name up to and
including the first integer component (``blocks.1.attn.q.weight`` -> ``blocks.1``;
``vit.encoder.layer.0.output.dense.bias`` -> ``vit.encoder.layer.0``); a name without one
to its first two module components (``vit.embeddings.cls_token`` -> ``vit.embeddings``),
one for a direct child (``embed.weight`` -> ``embed``, ``head.bias`` -> ``head``), and a
parameter of the root module to itself (``pos_embed``; the 2-layer nets' ``W`` and ``a``).

Memory plan: per-sample Jacobians of both models (2 c P float64 numbers per row) are held
for all rows when they fit ``memory_bytes``, else in panels such that two panels fit, the
column panels recomputed (``jacobian_passes`` says how often each row's Jacobians were
computed). Only the upper block triangle of the symmetric kernels is formed, one matrix
product per group and block; the per-group Frobenius sums are accumulated and only the
n x n output-averaged kernels are kept.

Linearized model
----------------
f_lin(x; theta) = f(x; theta_0) + J(x; theta_0)(theta - theta_0), started at theta_0 and
trained with the checkpoint's recorded recipe on its training rows; the distance on held-out
rows is RMS_x ||f_T(x) - f_lin,T(x)||_2 (over the c outputs), relative: / RMS ||f_lin,T(x)||,
as in the 2-layer sweep. Two methods (:func:`linearized_prediction`):

* ``kernel-gd``: kernel gradient descent with the initial eNTK, in closed form
  (:func:`attnaudit.core.ntk.kernel_gd_predict`, the 2-layer sweep's predictor with the empirical
  instead of the analytic kernel): exact for full-batch ``gd`` recipes without weight decay
  (MSE closed form, CE iterated in function space). Needs the full kernel of all training
  rows, so only for small training sets.
* ``train``: the linearized network itself (:class:`LinearizedModel`, forward-mode
  ``jvp``) trained by :func:`attnaudit.core.fit.fit` with the same recipe, mini-batch order and
  steps. For ``gd`` it is the same kernel gradient descent (tested equal); for ``sgd``
  without momentum it is kernel SGD with the initial eNTK over the same mini-batches; for
  ``adam`` (and momentum or weight decay) it is the linearized model under that optimizer,
  **not** kernel gradient descent: Adam's per-parameter scaling makes the function-space
  step f <- f - lr J_0 P_t J_0^T r use a kernel that changes with its preconditioner P_t.
  It is then the lazy-training comparator (Chizat et al. 2019), and the report says so.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

from attnaudit.core.engine import Engine, ranges
from attnaudit.core.task import Inputs, Task
from attnaudit.core.linalg import centered_kernel_alignment as centered_kernel_alignment
from attnaudit.errors import AuditError
from attnaudit.core.ntk import LinearizedGDConfig, kernel_gd_predict
from attnaudit.analyses.ntk_distance.widths import (
    KERNEL_RATE,
    _cell_grid,
    _clean,
    _loglog_slope,
    _rms_rows,
    _stats,
    _summary_rows,
    _trend,
    _verdicts,
)
from attnaudit.core.engine import JACOBIAN_ROWS, JACOBIAN_TRANSIENT
from attnaudit.core.task import as_task
from attnaudit.core.fit import Recipe, fit
from attnaudit.core.task import as_loss
from attnaudit.models.checkpoints import rebuild_of
from attnaudit.models.builtin import ModelSpec, TwoLayerNet
from attnaudit.models.vit import ViT, ViTSpec
from attnaudit.analyses.ntk_distance.widths import slope_interval
from attnaudit.models.builtin import image_shape_of
from attnaudit.runtime.sweep import ExecutorConfig, cached, clear_cache, run_cells
from attnaudit.models.vit import default_patch
from attnaudit.data import HoldoutRecipe
from attnaudit.models.builtin import build_builtin
from attnaudit.models.vit import n_parameters
from attnaudit.models.vit import VIT_ARCHITECTURES
from attnaudit.report.envelope import Record

if TYPE_CHECKING:
    from attnaudit.data import HoldoutRecipe
    from attnaudit.runtime.sweep import ExecutorConfig

SCHEMA_CHECKPOINT = "attnaudit.ntk-checkpoint/1"
SCHEMA_TRANSFORMERS = "attnaudit.ntk-transformers/1"
KERNEL_FORMS = ("full", "trace")
LINEARIZED_METHODS = ("auto", "kernel-gd", "train", "off")
F64 = torch.float64
DEFAULT_MEMORY_BYTES = 2 << 30
# rows of the strips of the symmetric kernels (one matrix product per group and strip)
STRIP_ROWS = 32
# kernel-gd holds the (n c) x (n c) training kernel and its eigenvectors: at most this many n c
KERNEL_GD_MAX_OUTPUTS = 4096

MOVEMENT_DEFINITION = (
    "||Theta(T) - Theta(0)||_F / ||Theta(0)||_F of the empirical NTK on the kernel rows; movement: the full "
    "(n c) x (n c) kernel (as the 2-layer sweep's kernel_movement), movement_trace: the output-averaged n x n kernel; "
    "norm_ratio: ||Theta(T)||_F / ||Theta(0)||_F; kernel_distance: 1 - <Theta(0), Theta(T)>_F / "
    "(||Theta(0)||_F ||Theta(T)||_F) (Fort et al. 2020), of the full kernel (output-averaged with form=trace)"
)
CKA_DEFINITION = (
    "centred kernel alignment <HKH, HLH>_F / (||HKH||_F ||HLH||_F) of the output-averaged eNTK K with L = Y Y^T "
    "(one-hot labels), H = I - 11^T/n"
)
DISTANCE_DEFINITION = (
    "RMS over held-out rows of ||f_T(x) - f_lin,T(x)||_2 over the c outputs; relative: divided by RMS ||f_lin,T(x)||_2"
)


# --------------------------------------------------------------------------- parameter groups


def group_of(name: str) -> str:
    """The parameter group of a parameter name (see the module docstring)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    if len(parts) == 1:
        return name
    return ".".join(parts[: min(2, len(parts) - 1)])


def parameter_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """Parameter names grouped by :func:`group_of`, groups in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(group_of(name), []).append(name)
    return groups


def _check_groups(groups: dict[str, Sequence[str]], names: Sequence[str]) -> dict[str, list[str]]:
    known = set(names)
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    for g, members in groups.items():
        members = list(members)
        if not members:
            raise AuditError(f"parameter group {g!r} is empty")
        bad = [m for m in members if m not in known]
        if bad:
            raise AuditError(f"parameter group {g!r} names parameters not in the model: {', '.join(bad[:5])}")
        twice = [m for m in members if m in seen]
        if twice:
            raise AuditError(f"parameter(s) {', '.join(twice[:5])} are in more than one group")
        seen.update(members)
        out[str(g)] = members
    return out


# --------------------------------------------------------------------------- engines and blocks


def _engines(
    tasks: Sequence[Task], X: torch.Tensor, groups: dict[str, Sequence[str]] | None, device=None
) -> tuple[list[Engine], dict[str, list[str]], dict[str, tuple[int, int]]]:
    """float64 engines over the same parameters, ordered group by group, and each group's slice of theta."""
    probe = X[:1]
    first = tasks[0]
    names = first.parameter_names(probe)
    if not names:
        raise AuditError("the model has no trainable parameters to take an NTK over")
    shapes = dict(first.module.named_parameters())
    for other in tasks[1:]:
        other_names = other.parameter_names(probe)
        mine = {n: tuple(shapes[n].shape) for n in names}
        theirs = {n: tuple(p.shape) for n, p in other.module.named_parameters() if n in set(other_names)}
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise AuditError(
                "the two models do not have the same parameters (names and shapes), so their kernels cannot be "
                f"compared (first differences: {', '.join(f'{n} {s}' for n, s in diff)}); give the same architecture"
            )
        if other.n_classes != first.n_classes:
            raise AuditError(
                f"the two models have {first.n_classes} and {other.n_classes} outputs; give the same architecture"
            )
    grouped = _check_groups(groups, names) if groups is not None else parameter_groups(names)
    ordered = [n for members in grouped.values() for n in members]
    engines = [Engine(t, dtype=F64, device=device, names=ordered) for t in tasks]
    slices: dict[str, tuple[int, int]] = {}
    start = 0
    numel = dict(zip(engines[0].names, engines[0].numels))
    for g, members in grouped.items():
        size = sum(numel[m] for m in members)
        slices[g] = (start, start + size)
        start += size
    return engines, grouped, slices


def _upper_blocks(
    engines: Sequence[Engine], X: torch.Tensor, memory_bytes: int, c: int, counter: dict
) -> Iterator[tuple[int, int, list[torch.Tensor], list[torch.Tensor], int]]:
    """The upper block triangle of the symmetric kernels on rows X.

    Yields (row start, column start, row Jacobians, column Jacobians, k): one (rows, c, P)
    tensor per engine for each; the first k columns of a diagonal strip are the square on the
    diagonal (counted once in Frobenius sums), the rest lie above it (counted twice).
    """

    n = X.shape[0]
    P = engines[0].n_params
    per_sample = len(engines) * c * P * 8
    # the transient memory of computing one sub-batch of one model's Jacobians is budgeted too
    transient = JACOBIAN_TRANSIENT * min(JACOBIAN_ROWS, n) * c * P * 8
    avail = int(memory_bytes) - transient
    if 2 * per_sample > avail:
        raise AuditError(
            f"one row's Jacobians ({len(engines)} model(s) x {c} outputs x {P:,} parameters, float64) take "
            f"{per_sample / 2**20:.3g} MiB; two rows plus the {transient / 2**20:.3g} MiB of computing them must fit "
            f"the {memory_bytes / 2**20:.3g} MiB budget; raise the memory budget or use a smaller model"
        )

    def jac(a: int, b: int) -> list[torch.Tensor]:
        counter["rows"] = counter.get("rows", 0) + (b - a)
        return [e.jacobian(X[a:b]) for e in engines]

    panels = [(0, n)] if n * per_sample <= avail else list(ranges(n, max(1, avail // (2 * per_sample))))
    for i, (p1, q1) in enumerate(panels):
        J1 = None  # release the previous row panel before computing the next
        J1 = jac(p1, q1)
        for a, b in ranges(q1 - p1, STRIP_ROWS):
            yield p1 + a, p1 + a, [J[a:b] for J in J1], [J[a:] for J in J1], b - a
        for p2, q2 in panels[i + 1 :]:
            yield p1, p2, J1, jac(p2, q2), 0


def _product(R: torch.Tensor, C: torch.Tensor, s: int, e: int, form: str, c: int) -> torch.Tensor:
    """Group block of the kernel: (r c, m c) flat full form (row i*c + a), or (r, m) output-averaged."""
    r, m = R.shape[0], C.shape[0]
    if form == "trace":
        return torch.einsum("iap,jap->ij", R[..., s:e], C[..., s:e]) / c
    return R[..., s:e].reshape(r * c, e - s) @ C[..., s:e].reshape(m * c, e - s).T


def _trace_of(block: torch.Tensor, form: str, r: int, m: int, c: int) -> torch.Tensor:
    if form == "trace":
        return block
    return block.view(r, c, m, c).diagonal(dim1=1, dim2=3).sum(-1) / c


def _weighted_sq(block: torch.Tensor, k_cols: int) -> float:
    """Sum of squares with the first k_cols (flat) columns counted once and the rest twice."""
    return float(block[:, :k_cols].pow(2).sum()) + 2.0 * float(block[:, k_cols:].pow(2).sum())


def _fill(K: torch.Tensor, a1: int, a2: int, block: torch.Tensor) -> None:
    r, m = block.shape
    K[a1 : a1 + r, a2 : a2 + m] = block
    K[a2 : a2 + m, a1 : a1 + r] = block.T


# --------------------------------------------------------------------------- kernels layer by layer
#: rows per forward pass when the layers' inputs and output gradients are captured
LAYER_ROWS = 16


def _jacobian_plan_fits(engines: Sequence[Engine], n: int, c: int, memory_bytes: int) -> bool:
    """Whether :func:`_upper_blocks` can run: two rows' Jacobians over all parameters (of every
    model) and the transient memory of computing them fit ``memory_bytes``. When they do not
    (transformers of millions of parameters at the 2 GiB default), the kernels are summed layer by
    layer (:func:`layer_kernels`)."""
    P = engines[0].n_params
    per_sample = len(engines) * c * P * 8
    transient = JACOBIAN_TRANSIENT * min(JACOBIAN_ROWS, n) * c * P * 8
    return 2 * per_sample <= int(memory_bytes) - transient


def layer_kernels(
    engine: Engine, rows: torch.Tensor, slices: dict[str, tuple[int, int]], c: int, form: str, memory_bytes: int
) -> dict[str, torch.Tensor]:
    """Each group's eNTK on ``rows`` for one model, {group: (n c, n c) flat full form (row i c + a)
    or (n, n) output-averaged}, summed parameter tensor by parameter tensor, never holding a row's
    Jacobian over all parameters.

    A linear layer (``nn.Linear``, ``nn.Conv2d``, self-attention projections: the layers K-FAC
    covers, :func:`attnaudit.analyses.influence.kfac.linear_modules`) with inputs a_t and output
    gradients s_at = d f_a / d y_t has the per-sample Jacobian J_a = sum_t s_at a_t^T (bias: sum_t
    s_at). Memory plan (``memory_bytes`` for this model, the group kernels included): the layers
    are taken in consecutive runs whose inputs and c output gradients for all rows fit half of
    what the kernels leave; one forward and c backward passes (to the run's outputs only) per
    :data:`LAYER_ROWS` rows capture them, then each layer's Jacobians are formed for panels of
    rows (two panels in a quarter) and contracted, K_g += J_l J_l^T (one matrix product per panel
    pair, the upper triangle only). The remaining parameters (norms, embeddings, tied weights) get
    their Jacobians from :meth:`Engine.jacobian` restricted to them, in panels of rows the same
    way. Cost: one capture pass per run (a forward and c partial backward passes over all rows)
    instead of one Jacobian pass, and the same contraction work as :func:`_upper_blocks`.
    """
    from attnaudit.analyses.influence.kfac import (
        capture_activations,
        output_token_rows,
        token_rows,
        linear_modules,
        shared_weights,
    )

    n = rows.shape[0]
    dev = engine.device
    k_out = c if form == "full" else 1
    K = {g: torch.zeros(n * k_out, n * k_out, dtype=F64, device=dev) for g in slices}
    offsets, start = {}, 0
    for name, numel in zip(engine.names, engine.numels):
        offsets[name] = start
        start += numel

    def group_at(name: str) -> str:
        o = offsets[name]
        return next(g for g, (s, e) in slices.items() if s <= o < e)

    blocks, excluded = linear_modules(engine.module, engine.names)
    tied = set(shared_weights(engine.module, blocks))
    if tied:  # a tied weight's Jacobian is not its layer's outer product alone
        blocks = [b for b in blocks if b.weight not in tied and (b.bias or "") not in tied]
    covered = {b.weight for b in blocks} | {b.bias for b in blocks if b.bias}
    others = [nm for nm in engine.names if nm not in covered]
    budget = int(memory_bytes)
    fixed = len(slices) * (n * k_out) ** 2 * 8

    def add(g: str, R: torch.Tensor, C: torch.Tensor, a1: int, a2: int) -> None:
        """K_g[rows a1.., cols a2..] += R C^T for flat (rows, c, p) Jacobian panels (mirrored)."""
        r, m = R.shape[0], C.shape[0]
        if form == "trace":
            B = R.reshape(r, -1) @ C.reshape(m, -1).T / c
        else:
            B = R.reshape(r * c, -1) @ C.reshape(m * c, -1).T
        i, j = a1 * k_out, a2 * k_out
        K[g][i : i + B.shape[0], j : j + B.shape[1]] += B
        if a1 != a2:
            K[g][j : j + B.shape[1], i : i + B.shape[0]] += B.T

    def contract(splits: list[tuple[str, int, int]], make, width: int, share: int, transient: int = 0) -> None:
        """K_g += J[..., s:e] J[..., s:e]^T over all rows for each (g, s, e) of ``splits``, J
        (rows, c, width) made by ``make(a, b)`` in panels of rows, two of which (and ``transient``
        bytes per row, at most :data:`JACOBIAN_ROWS` rows) fit ``share``; the panels after the
        first row panel are made again for every row panel."""
        per_row = max(1, c * width * 8)
        panel = max(1, min(n, share // (2 * per_row + transient)))
        spans = list(ranges(n, panel))
        for i, (a1, b1) in enumerate(spans):
            R = make(a1, b1)
            for g, s, e in splits:
                add(g, R[..., s:e], R[..., s:e], a1, a1)
            for a2, b2 in spans[i + 1 :]:
                C = make(a2, b2)
                for g, s, e in splits:
                    add(g, R[..., s:e], C[..., s:e], a1, a2)
                del C
            del R

    avail = budget - fixed
    if avail <= 0:
        raise AuditError(
            f"the {len(slices)} group kernels of {n} kernel rows take {fixed / 2**20:,.1f} MiB per model, above the "
            f"{budget / 2**20:,.3g} MiB budget; raise the memory budget or use fewer kernel points"
        )
    # half of what the kernels leave holds a run of layers' inputs and output gradients for all
    # rows, a quarter the Jacobian panels, a quarter the activations of the forward passes
    share = max(1, avail // 4)

    # parameters outside the linear layers: Jacobians of panels of rows by Engine.jacobian
    if others:
        sub = Engine(engine.task, dtype=F64, device=dev, names=others)
        sub.theta = torch.cat(
            [engine.theta[offsets[nm] : offsets[nm] + engine.numels[engine.names.index(nm)]] for nm in others]
        )
        splits, start = [], 0
        for nm, numel in zip(sub.names, sub.numels):
            splits.append((group_at(nm), start, start + numel))
            start += numel
        per_row = c * sub.n_params * 8
        if 2 * per_row + JACOBIAN_TRANSIENT * per_row > 2 * share:
            raise AuditError(
                f"one row's Jacobians over the {len(others)} parameter tensor(s) outside linear layers "
                f"({sub.n_params:,} parameters) take {per_row / 2**20:,.1f} MiB; with the kernels they need a budget "
                f"of at least {(fixed + 2 * (2 + JACOBIAN_TRANSIENT) * per_row) / 2**20:,.0f} MiB, above "
                f"{budget / 2**20:,.3g} MiB; raise the memory budget or use fewer kernel points"
            )
        contract(splits, lambda a, b: sub.jacobian(rows[a:b]), sub.n_params, 2 * share, JACOBIAN_TRANSIENT * per_row)
    if not blocks:
        return K

    # the tokens of each layer, from one row (the longest, for text that drops trailing padding:
    # shorter chunks fill the leading positions, zeros after them add nothing to sum_t s_t a_t^T)
    with engine.context(), torch.no_grad():
        _, ins, outs = capture_activations(engine, blocks, rows[engine.longest_first(rows)[:1]])
    sizes = {
        b.path: (token_rows(ins[b.path], 1).shape[1], output_token_rows(b, outs[b.path], 1).shape[1]) for b in blocks
    }
    del ins, outs

    def stored(b) -> int:
        t_in, t_out = sizes[b.path]
        return n * (t_in * b.width_in + c * t_out * b.d_out) * 8

    runs: list[list] = []
    for b in blocks:
        if stored(b) > 2 * share:
            raise AuditError(
                f"the inputs and output gradients of layer {b.path} for {n} kernel rows take "
                f"{stored(b) / 2**20:,.0f} MiB, above half of what the {budget / 2**20:,.0f} MiB budget leaves "
                f"after the kernels ({fixed / 2**20:,.0f} MiB); raise the memory budget to at least "
                f"{(fixed + 2 * stored(b)) / 2**20:,.0f} MiB or use fewer kernel points"
            )
        if runs and sum(stored(x) for x in runs[-1]) + stored(b) <= 2 * share:
            runs[-1].append(b)
        else:
            runs.append([b])
    for run in runs:
        acts: dict[str, torch.Tensor] = {}
        grads: dict[str, torch.Tensor] = {}
        for b in run:
            t_in, t_out = sizes[b.path]
            acts[b.path] = torch.zeros(n, t_in, b.width_in, dtype=F64, device=dev)
            grads[b.path] = torch.zeros(n, c, t_out, b.d_out, dtype=F64, device=dev)
        with engine.context(), torch.enable_grad():
            for a0, b0 in ranges(n, LAYER_ROWS):
                logits, ins, outs = capture_activations(engine, run, rows[a0:b0])
                B = b0 - a0
                for b in run:
                    a = token_rows(ins[b.path].detach(), B)
                    if b.bias:
                        a = torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=a.dtype, device=a.device)], 2)
                    acts[b.path][a0:b0, : a.shape[1]] = a
                targets = [outs[b.path] for b in run]
                for k in range(c):
                    gs = torch.autograd.grad(logits[:, k].sum(), targets, retain_graph=k + 1 < c)
                    for b, g in zip(run, gs):
                        s_k = output_token_rows(b, g.detach(), B)
                        grads[b.path][a0:b0, k, : s_k.shape[1]] = s_k
                del logits, ins, outs, targets
        for b in run:
            a_all, s_all = acts.pop(b.path), grads.pop(b.path)

            def make(a1: int, b1: int, a_all=a_all, s_all=s_all) -> torch.Tensor:
                # (rows, c, d_out, w): sum over tokens of s a^T, for every output
                J = torch.matmul(s_all[a1:b1].transpose(-1, -2), a_all[a1:b1, None])
                return J.reshape(b1 - a1, c, -1)

            if group_at(b.weight) != (group_at(b.bias) if b.bias else group_at(b.weight)):
                raise AuditError(f"layer {b.path}: weight and bias in different parameter groups")  # pragma: no cover
            contract([(group_at(b.weight), 0, b.d_out * b.width_in)], make, b.d_out * b.width_in, share)
            del a_all, s_all
    return K


# --------------------------------------------------------------------------- alignment


# --------------------------------------------------------------------------- kernel movement


@dataclass
class GroupMovement:
    """One parameter group's kernel before and after training (see the module docstring)."""

    group: str
    n_params: int
    n_tensors: int
    movement: float | None
    movement_trace: float
    norm_ratio: float
    kernel_distance: float
    trace_share_init: float
    trace_share_trained: float
    cka_init: float | None
    cka_trained: float | None

    def to_dict(self) -> dict:
        return _clean(asdict(self))


@dataclass
class KernelMovement:
    """The eNTK at initialization vs after training on ``n_points`` rows (module docstring).

    ``kernel_init``/``kernel_trained``: the output-averaged (n, n) kernels (not in
    ``to_dict``). ``jacobian_passes``: Jacobians computed per row (1 when all fitted the
    memory budget at once).
    """

    form: str
    n_points: int
    n_classes: int
    n_params: int
    movement: float | None
    movement_trace: float
    norm_init: float
    norm_trained: float
    norm_ratio: float
    kernel_distance: float
    kernel_distance_trace: float
    cka_init: float | None
    cka_trained: float | None
    groups: list[GroupMovement]
    memory_bytes: int
    jacobian_passes: float
    seconds: float
    kernel_init: torch.Tensor | None = field(default=None, repr=False)
    kernel_trained: torch.Tensor | None = field(default=None, repr=False)

    @property
    def headline(self) -> float:
        """The full-kernel movement, or the output-averaged one when only that was computed."""
        return self.movement if self.movement is not None else self.movement_trace

    def group(self, name: str) -> GroupMovement:
        for g in self.groups:
            if g.group == name:
                return g
        raise KeyError(name)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("kernel_init", "kernel_trained", "groups")}
        out["groups"] = [g.to_dict() for g in self.groups]
        out["definition"] = MOVEMENT_DEFINITION
        out["cka_definition"] = CKA_DEFINITION
        return _clean(out)


def _as_task(model, X: torch.Tensor) -> Task:

    if isinstance(model, Task):
        return model
    inputs = model.audit_inputs() if hasattr(model, "audit_inputs") else None
    return as_task(model, inputs=inputs, probe=X)


def kernel_movement(
    task_init: "Task | nn.Module",
    task_trained: "Task | nn.Module",
    X: torch.Tensor,
    y: torch.Tensor | None = None,
    groups: dict[str, Sequence[str]] | None = None,
    *,
    form: str = "full",
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    device=None,
) -> KernelMovement:
    """Relative movement of the empirical NTK between two models of one architecture on rows X.

    ``task_init``/``task_trained``: Tasks (or modules, wrapped with their ``audit_inputs()``)
    over the same parameter names and shapes. ``y``: labels for the centred kernel alignment
    (None: no CKA). ``groups``: name -> parameter names (default: :func:`parameter_groups`).
    ``form``: ``full`` (the (n c)^2 kernel, and the output-averaged one) or ``trace`` (only the
    output-averaged one). Computed in float64 through the engine (module docstring).
    """
    if form not in KERNEL_FORMS:
        raise AuditError(f"unknown kernel form {form!r}; use full or trace")
    if X.ndim != 2 or X.shape[0] < 2:
        raise AuditError(f"kernel movement needs at least 2 rows (n, d), got shape {tuple(X.shape)}")
    t0 = time.perf_counter()
    tasks = [_as_task(task_init, X), _as_task(task_trained, X)]
    engines, grouped, slices = _engines(tasks, X, groups, device)
    rows = engines[0].rows(X)
    n = rows.shape[0]
    c = int(engines[0].logits(rows[:1]).shape[1])
    dev = engines[0].device
    keys = [*grouped, None]  # None: the whole kernel
    trace0 = {g: torch.zeros(n, n, dtype=F64, device=dev) for g in keys}
    traceT = {g: torch.zeros(n, n, dtype=F64, device=dev) for g in keys}
    acc = {g: {"t0": 0.0, "tT": 0.0, "move": 0.0} for g in keys}
    counter: dict = {}
    by_layer = not _jacobian_plan_fits(engines, n, c, memory_bytes)

    def blocks_of_kernels() -> Iterator[tuple[int, int, list[torch.Tensor], list[torch.Tensor], int]]:
        """The Jacobian blocks of :func:`_upper_blocks`, or, when the Jacobians of every row do not
        fit the budget, nothing: the kernels are then summed layer by layer below."""
        if not by_layer:
            yield from _upper_blocks(engines, rows, memory_bytes, c, counter)

    if by_layer:
        # each model's group kernels in turn (two models' kernels are held, never a row's Jacobian)
        # the second model's pass also holds the first one's kernels
        held = len(slices) * (n * (c if form == "full" else 1)) ** 2 * 8
        kernels = [layer_kernels(e, rows, slices, c, form, int(memory_bytes) - i * held) for i, e in enumerate(engines)]
        counter["rows"] = n
        kc = n * (c if form == "full" else 1)
        for g in [*grouped, None]:
            if g is None:
                B0 = torch.stack(list(kernels[0].values())).sum(0)
                BT = torch.stack(list(kernels[1].values())).sum(0)
            else:
                B0, BT = kernels[0][g], kernels[1][g]
            if form == "full":
                acc[g]["t0"] += _weighted_sq(B0, kc)
                acc[g]["tT"] += _weighted_sq(BT, kc)
                acc[g]["move"] += _weighted_sq(BT - B0, kc)
            trace0[g] = _trace_of(B0, form, n, n, c).clone()
            traceT[g] = _trace_of(BT, form, n, n, c).clone()
        del kernels, B0, BT
    for a1, a2, R, C, k in blocks_of_kernels():
        r, m = R[0].shape[0], C[0].shape[0]
        kc = k * (c if form == "full" else 1)
        S0 = ST = None

        def record(g, B0: torch.Tensor, BT: torch.Tensor) -> None:
            """Adds one block of group g's kernels (at init, trained) to its sums and trace kernels."""
            if form == "full":
                acc[g]["t0"] += _weighted_sq(B0, kc)
                acc[g]["tT"] += _weighted_sq(BT, kc)
                acc[g]["move"] += _weighted_sq(BT - B0, kc)
            _fill(trace0[g], a1, a2, _trace_of(B0, form, r, m, c))
            _fill(traceT[g], a1, a2, _trace_of(BT, form, r, m, c))

        for g, (s, e) in slices.items():
            B0 = _product(R[0], C[0], s, e, form, c)
            BT = _product(R[1], C[1], s, e, form, c)
            record(g, B0, BT)
            S0 = B0 if S0 is None else S0 + B0
            ST = BT if ST is None else ST + BT
        assert S0 is not None and ST is not None  # a model has at least one parameter group
        record(None, S0, ST)
        del R, C, S0, ST, B0, BT  # the column panel is freed before the generator computes the next one

    Y = None
    if y is not None:
        y = y.reshape(-1).long()
        if y.shape[0] != n:
            raise AuditError(f"{y.shape[0]} labels for {n} kernel rows")
        Y = torch.nn.functional.one_hot(y.to(dev), max(c, int(y.max()) + 1)).to(F64)

    def ratio(a: float, b: float) -> float:
        return math.sqrt(a / b) if b > 0 else float("nan")

    def cos_distance(move: float, t0: float, tT: float) -> float:
        """1 - <K0, KT>_F / (||K0|| ||KT||) from the three Frobenius sums, as
        (||KT - K0||^2 - (||KT|| - ||K0||)^2) / (2 ||K0|| ||KT||) (no cancellation of two cosines)."""
        n0, nT = math.sqrt(t0), math.sqrt(tT)
        return max(0.0, (move - (nT - n0) ** 2) / (2 * n0 * nT)) if n0 > 0 and nT > 0 else float("nan")

    def sums(g) -> tuple[float, float, float]:
        """(||KT - K0||^2, ||K0||^2, ||KT||^2) of the full kernel, or of the output-averaged one for form=trace."""
        if form == "full":
            return acc[g]["move"], acc[g]["t0"], acc[g]["tT"]
        return (
            float((traceT[g] - trace0[g]).pow(2).sum()),
            float(trace0[g].pow(2).sum()),
            float(traceT[g].pow(2).sum()),
        )

    def tsums(g) -> tuple[float, float, float]:
        return (
            float((traceT[g] - trace0[g]).pow(2).sum()),
            float(trace0[g].pow(2).sum()),
            float(traceT[g].pow(2).sum()),
        )

    def tmove(g) -> float:
        base = trace0[g].norm()
        return float((traceT[g] - trace0[g]).norm() / base) if float(base) > 0 else float("nan")

    def cka(K: torch.Tensor) -> float | None:
        return None if Y is None else centered_kernel_alignment(K, Y)

    tr_all0, tr_allT = float(trace0[None].trace()), float(traceT[None].trace())
    numel = dict(zip(engines[0].names, engines[0].numels))
    out_groups = [
        GroupMovement(
            group=g,
            n_params=int(sum(numel[m] for m in members)),
            n_tensors=len(members),
            movement=ratio(acc[g]["move"], acc[g]["t0"]) if form == "full" else None,
            movement_trace=tmove(g),
            norm_ratio=ratio(sums(g)[2], sums(g)[1]),
            kernel_distance=cos_distance(*sums(g)),
            trace_share_init=float(trace0[g].trace()) / tr_all0 if tr_all0 > 0 else float("nan"),
            trace_share_trained=float(traceT[g].trace()) / tr_allT if tr_allT > 0 else float("nan"),
            cka_init=cka(trace0[g]),
            cka_trained=cka(traceT[g]),
        )
        for g, members in grouped.items()
    ]
    full = form == "full"
    return KernelMovement(
        form=form,
        n_points=n,
        n_classes=c,
        n_params=engines[0].n_params,
        movement=ratio(acc[None]["move"], acc[None]["t0"]) if full else None,
        movement_trace=tmove(None),
        norm_init=math.sqrt(acc[None]["t0"]) if full else float(trace0[None].norm()),
        norm_trained=math.sqrt(acc[None]["tT"]) if full else float(traceT[None].norm()),
        norm_ratio=ratio(sums(None)[2], sums(None)[1]),
        kernel_distance=cos_distance(*sums(None)),
        kernel_distance_trace=cos_distance(*tsums(None)),
        cka_init=cka(trace0[None]),
        cka_trained=cka(traceT[None]),
        groups=out_groups,
        memory_bytes=int(memory_bytes),
        jacobian_passes=counter.get("rows", 0) / n,
        seconds=time.perf_counter() - t0,
        kernel_init=trace0[None].cpu(),
        kernel_trained=traceT[None].cpu(),
    )


def entk_by_group(
    model: "Task | nn.Module",
    X: torch.Tensor,
    groups: dict[str, Sequence[str]] | None = None,
    *,
    form: str = "full",
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    device=None,
) -> dict[str, torch.Tensor]:
    """The eNTK of each parameter group on rows X, {group: (n, n, c, c) or (n, n)}, from one
    pass of Jacobians (the machinery of :func:`kernel_movement`); the groups sum to the full
    eNTK (:meth:`Engine.entk <attnaudit.core.engine.Engine.entk>`)."""
    if form not in KERNEL_FORMS:
        raise AuditError(f"unknown kernel form {form!r}; use full or trace")
    engines, grouped, slices = _engines([_as_task(model, X)], X, groups, device)
    rows = engines[0].rows(X)
    n = rows.shape[0]
    c = int(engines[0].logits(rows[:1]).shape[1])
    shape = (n, n) if form == "trace" else (n * c, n * c)
    out = {g: torch.zeros(shape, dtype=F64, device=engines[0].device) for g in grouped}
    for a1, a2, R, C, _ in _upper_blocks(engines, rows, memory_bytes, c, {}):
        for g, (s, e) in slices.items():
            B = _product(R[0], C[0], s, e, form, c)
            k = c if form == "full" else 1
            _fill(out[g], a1 * k, a2 * k, B)
        del R, C, B
    if form == "full":
        return {g: K.view(n, c, n, c).permute(0, 2, 1, 3).contiguous() for g, K in out.items()}
    return out


# --------------------------------------------------------------------------- the linearized model


class LinearizedModel(nn.Module):
    """f_lin(x; theta) = f(x; theta_0) + J(x; theta_0) (theta - theta_0), the model linearized
    around the engine's parameters theta_0, with theta one flat trainable vector started at
    theta_0 (``torch.func.jvp`` of the engine's functional model; nothing of the original
    module is changed). It takes flat rows (the engine applies the model's input adapter) and
    trains with :func:`attnaudit.core.fit.fit` like any module; Adam, SGD and weight decay act
    elementwise, so a flat vector gets the same updates as the original tensors would."""

    def __init__(self, engine: Engine):
        super().__init__()
        self._engine = (engine,)  # a tuple: not registered as a submodule
        self.theta = nn.Parameter(engine.theta.detach().clone())

    def audit_inputs(self) -> Inputs:
        return Inputs()

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        engine = self._engine[0]
        theta0 = engine.theta
        with engine.context():
            f0, jv = torch.func.jvp(  # type: ignore[misc]  # a pair without has_aux; torch annotates the triple too
                lambda t: engine.apply(t, rows), (theta0,), (self.theta - theta0,)
            )
        return f0 + jv


@dataclass
class LinearizedResult:
    """The trained network against its linearized model on held-out rows (module docstring)."""

    method: str
    applicable: bool
    reason: str | None = None
    dynamics: str | None = None
    kernel_gd: bool = False
    n_train: int = 0
    n_test: int = 0
    steps: int = 0
    distance_rms: float = float("nan")
    distance_rel: float = float("nan")
    lin_output_rms: float = float("nan")
    distance_train_rms: float = float("nan")
    net_train_loss: float = float("nan")
    lin_train_loss: float = float("nan")
    net_test_acc: float = float("nan")
    lin_test_acc: float = float("nan")
    lin_initial_loss: float = float("nan")
    unstable: bool = False
    predictor: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["definition"] = DISTANCE_DEFINITION
        return _clean(out)


def _dynamics(recipe, method: str) -> tuple[str, bool]:
    """What the linearized model's training is, and whether it is kernel GD with the initial eNTK."""
    if recipe.optimizer == "gd" and not recipe.weight_decay:
        how = "closed form" if method == "kernel-gd" else "the linearized network trained by full-batch GD"
        return f"kernel gradient descent with the initial eNTK ({how}; exact)", True
    if recipe.optimizer == "sgd" and not recipe.momentum and not recipe.weight_decay:
        return (
            "kernel SGD with the initial eNTK over the same mini-batches (the linearized network trained by "
            "the recipe; exact)"
        ), False
    extras = [
        f"momentum {recipe.momentum:g}" if recipe.momentum else "",
        f"weight decay {recipe.weight_decay:g}" if recipe.weight_decay else "",
    ]
    what = recipe.optimizer + "".join(f", {x}" for x in extras if x)
    return (
        f"the linearized network trained by the same recipe ({what}): not kernel gradient descent with a fixed "
        "kernel, since the optimizer's per-parameter scaling changes the effective kernel during training "
        "(the lazy-training comparator)"
    ), False


def _kernel_gd_blocker(recipe, n_train: int, c: int) -> str | None:
    if recipe.optimizer != "gd":
        return f"kernel-gd is the dynamics of full-batch gd, but the recipe trains with {recipe.optimizer}"
    if recipe.weight_decay:
        return "kernel-gd has no weight decay, but the recipe uses it"
    if n_train * c > KERNEL_GD_MAX_OUTPUTS:
        return (
            f"kernel-gd needs the full ({n_train} x {c})^2 kernel of every training row and its eigenvectors "
            f"(limit n c <= {KERNEL_GD_MAX_OUTPUTS})"
        )
    return None


def linearized_prediction(
    task_init: "Task | nn.Module",
    task_trained: "Task | nn.Module",
    recipe,
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor | None = None,
    *,
    method: str = "auto",
    steps: int | None = None,
    train_dtype: torch.dtype | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    device=None,
) -> LinearizedResult:
    """The trained network's outputs against its linearized model's after the same training.

    ``recipe``: the :class:`attnaudit.core.fit.Recipe` the network was trained with on
    (``X_train``, ``y_train``) starting from ``task_init``'s parameters. ``method``:
    ``kernel-gd`` (closed form; full-batch gd without weight decay and small training sets
    only), ``train`` (the :class:`LinearizedModel` trained with the recipe), ``auto``
    (kernel-gd when it applies, else train) or ``off``. ``steps``: the steps the network
    actually ran (default: the recipe's). ``train_dtype``: the linearized model's training
    dtype for ``train`` (default float64). Network outputs and kernels are float64.
    """

    if method not in LINEARIZED_METHODS:
        raise AuditError(f"unknown --linearized {method!r}; use one of {', '.join(LINEARIZED_METHODS)}")
    if method == "off":
        return LinearizedResult(method="off", applicable=False, reason="switched off (--linearized off)")
    if not isinstance(recipe, Recipe):
        raise AuditError("the linearized prediction needs the training recipe")
    t0 = time.perf_counter()
    task_init, task_trained = _as_task(task_init, X_train), _as_task(task_trained, X_train)
    c = int(task_trained.n_classes)
    n = int(X_train.shape[0])
    blocker = _kernel_gd_blocker(recipe, n, c)
    if method == "kernel-gd" and blocker:
        raise AuditError(f"--linearized kernel-gd: {blocker}; use --linearized train")
    chosen = "kernel-gd" if method == "kernel-gd" or (method == "auto" and blocker is None) else "train"
    total = recipe.total_steps(n) if steps is None else int(steps)
    net = Engine(task_trained, dtype=F64, device=device)
    f_tr, f_te = net.logits(X_train), net.logits(X_test)
    dev = net.device
    y_dev = y_train.to(dev).long()
    Y = torch.nn.functional.one_hot(y_dev, c).to(F64)
    predictor: dict = {}
    if chosen == "kernel-gd":
        eng0 = Engine(task_init, dtype=F64, device=device)
        K = eng0.entk(X_train, memory_bytes=memory_bytes)
        Kt = eng0.entk(X_test, X_train, memory_bytes=memory_bytes)
        f0, f0t = eng0.logits(X_train), eng0.logits(X_test)
        pred = kernel_gd_predict(
            K, Y, LinearizedGDConfig(lr=recipe.lr, steps=total, loss=recipe.loss), K_test=Kt, f0_train=f0, f0_test=f0t
        )
        assert pred.f_test is not None  # K_test given
        lin_tr, lin_te = pred.f_train, pred.f_test
        predictor = pred.to_dict()
    else:
        if recipe.total_steps(n) != total:
            recipe = dataclasses.replace(recipe, steps=total, epochs=None)
        eng0 = Engine(task_init, dtype=train_dtype or F64, device=device)
        lin = LinearizedModel(eng0)
        result = fit(lin, X_train, y_train, recipe, inputs=Inputs())
        with torch.no_grad():
            lin_tr = torch.cat([lin(eng0.rows(X_train[a:b])) for a, b in ranges(n, 1024)]).to(F64)
            lin_te = torch.cat([lin(eng0.rows(X_test[a:b])) for a, b in ranges(X_test.shape[0], 1024)]).to(F64)
        predictor = {
            "steps_run": result.steps_run,
            "diverged": result.diverged,
            "dtype": str(eng0.dtype).replace("torch.", ""),
        }

    loss = as_loss(recipe.loss)
    f0_train = Engine(task_init, dtype=F64, device=device).logits(X_train)
    initial = float(loss.per_sample(f0_train, Y).mean())
    final = float(loss.per_sample(lin_tr, Y).mean())
    # the linearized model's training is unstable when its loss ends above where it started (the
    # step is too large for its kernel) or it diverged / the closed form's stability ratio is exceeded
    unstable = bool(
        not math.isfinite(final) or final > initial or predictor.get("diverged") or predictor.get("diverges")
    )
    dist = _rms_rows(f_te - lin_te)
    ref = _rms_rows(lin_te)
    dynamics, exact_kgd = _dynamics(recipe, chosen)

    def acc(F: torch.Tensor, yy: torch.Tensor) -> float:
        return float((F.argmax(1) == yy.to(F.device)).double().mean())

    return LinearizedResult(
        method=chosen,
        applicable=True,
        reason=None if method != "auto" or chosen == "kernel-gd" else f"auto chose train: {blocker}",
        dynamics=dynamics,
        kernel_gd=exact_kgd,
        n_train=n,
        n_test=int(X_test.shape[0]),
        steps=total,
        distance_rms=dist,
        distance_rel=dist / ref if ref > 0 else float("nan"),
        lin_output_rms=ref,
        distance_train_rms=_rms_rows(f_tr - lin_tr),
        net_train_loss=float(loss.per_sample(f_tr, Y).mean()),
        lin_train_loss=final,
        lin_initial_loss=initial,
        unstable=unstable,
        net_test_acc=acc(f_te, y_test) if y_test is not None else float("nan"),
        lin_test_acc=acc(lin_te, y_test) if y_test is not None else float("nan"),
        predictor=predictor,
        seconds=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------- one checkpoint


def _check_kernel_points(kernel_points: Any) -> None:
    """Refuse a bad ``--kernel-points`` (of a checkpoint audit or a transformer sweep)."""
    if not isinstance(kernel_points, int) or kernel_points < 2:
        raise AuditError(f"--kernel-points must be an integer >= 2, got {kernel_points!r}")


def _check_kernel_form(form: str, linearized: str) -> None:
    """Refuse a bad kernel form or ``--linearized`` (of a checkpoint audit or a transformer sweep)."""
    if form not in KERNEL_FORMS:
        raise AuditError(f"unknown kernel form {form!r}; use full or trace")
    if linearized not in LINEARIZED_METHODS:
        raise AuditError(f"unknown --linearized {linearized!r}; use one of {', '.join(LINEARIZED_METHODS)}")


@dataclass(frozen=True)
class CheckpointKernelConfig(Record):
    """``kernel_points``: training rows for the kernels; ``n_test``: held-out rows for the
    linearized distance; ``form``: full or trace kernel; ``linearized``: auto, kernel-gd,
    train or off; ``memory_bytes``: the Jacobian budget."""

    kernel_points: int = 256
    n_test: int = 500
    form: str = "full"
    linearized: str = "auto"
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    seed: int = 0

    def __post_init__(self) -> None:
        _check_kernel_points(self.kernel_points)
        if not isinstance(self.n_test, int) or self.n_test < 1:
            raise AuditError(f"--n-test must be a positive integer, got {self.n_test!r}")
        _check_kernel_form(self.form, self.linearized)
        if self.memory_bytes < 1:
            raise AuditError("the memory budget must be positive")


@dataclass
class CheckpointKernelResult:
    """Kernel movement (and the linearized distance) of one trained model."""

    label: str
    reference: dict
    rows: dict
    movement: KernelMovement
    linearized: LinearizedResult
    recipe: dict | None
    verdict: str
    warnings: list[str]
    seconds: float

    def to_dict(self) -> dict:
        return _clean(
            {
                "label": self.label,
                "reference": self.reference,
                "rows": self.rows,
                "movement": self.movement.to_dict(),
                "linearized": self.linearized.to_dict(),
                "recipe": self.recipe,
                "verdict": self.verdict,
                "warnings": list(self.warnings),
                "seconds": self.seconds,
            }
        )


# Reference points for reading a single movement (measured by the 2-layer sweep on MNIST,
# docs/ntk-distance.md): the full-kernel movement of 2L-ReLU after 200 GD steps.
REFERENCE_MOVEMENT = "2L-ReLU on MNIST after 200 GD steps: 1.25 at width 16, 0.03 at width 4096"


def checkpoint_verdict(label: str, mv: KernelMovement, lin: LinearizedResult) -> str:
    """One sentence: how much the kernel moved, which group most, the alignment, the linearized distance."""
    kind = "full" if mv.movement is not None else "output-averaged"
    top = max(mv.groups, key=lambda g: (g.movement if g.movement is not None else g.movement_trace) or 0.0)
    top_val = top.movement if top.movement is not None else top.movement_trace
    parts = [
        f"{label}: training moved the empirical NTK by ||Theta_T - Theta_0|| / ||Theta_0|| = {mv.headline:.3g} "
        f"({kind} kernel, {mv.n_points} training rows; in the kernel regime it stays near 0 — for scale, "
        f"{REFERENCE_MOVEMENT})"
    ]
    parts.append(
        f"its size changed by a factor {mv.norm_ratio:.3g} and its shape by a kernel distance (1 - cosine) "
        f"of {mv.kernel_distance:.3g}"
    )
    parts.append(
        f"the group that moved most is {top.group} ({top_val:.3g}, {top.trace_share_trained:.0%} of the "
        "trained kernel's trace)"
    )
    if mv.cka_init is not None and mv.cka_trained is not None:
        change = "rose" if mv.cka_trained > mv.cka_init else "fell"
        parts.append(f"its alignment with the labels {change} from {mv.cka_init:.3f} to {mv.cka_trained:.3f}")
    if lin.applicable:
        assert lin.dynamics is not None  # every applicable prediction says how it was trained
        parts.append(
            f"the network is {lin.distance_rel:.1%} (relative RMS) away from its linearized model on "
            f"{lin.n_test} held-out rows ({lin.dynamics.split(' (')[0]})"
        )
    else:
        parts.append(f"no linearized prediction ({lin.reason})")
    return "; ".join(parts) + "."


def analyse_checkpoint(
    task_trained: "Task | nn.Module",
    task_init: "Task | nn.Module",
    X_kernel: torch.Tensor,
    y_kernel: torch.Tensor | None,
    config: CheckpointKernelConfig = CheckpointKernelConfig(),
    *,
    label: str = "model",
    recipe=None,
    train: tuple[torch.Tensor, torch.Tensor] | None = None,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    steps: int | None = None,
    train_dtype: torch.dtype | None = None,
    reference: dict | None = None,
    rows: dict | None = None,
    no_linearized: str | None = None,
    device=None,
) -> CheckpointKernelResult:
    """Kernel movement of a trained model against its initialization, and its linearized distance.

    ``train``/``test``: the model's own training rows and held-out rows (needed with
    ``recipe`` for the linearized prediction); ``no_linearized``: why it cannot be made
    (shown instead). ``reference``/``rows``: descriptions for the report.
    """
    t0 = time.perf_counter()
    warnings: list[str] = []
    # what the linearized comparison can be is settled before the expensive kernel pass
    skip = None
    if config.linearized == "off":
        skip = LinearizedResult(method="off", applicable=False, reason="switched off (--linearized off)")
    else:
        reason = no_linearized
        if reason is None and recipe is None:
            reason = "the checkpoint records no training recipe"
        elif reason is None and (train is None or test is None):
            reason = "its training rows are unknown"
        if reason is not None:
            if config.linearized != "auto":
                raise AuditError(f"--linearized {config.linearized}: {reason}")
            skip = LinearizedResult(method="none", applicable=False, reason=reason)
        elif config.linearized == "kernel-gd":
            assert train is not None  # else reason is set
            blocker = _kernel_gd_blocker(
                recipe, int(train[0].shape[0]), int(_as_task(task_trained, X_kernel).n_classes)
            )
            if blocker:
                raise AuditError(f"--linearized kernel-gd: {blocker}; use --linearized train")
    mv = kernel_movement(
        task_init, task_trained, X_kernel, y_kernel, form=config.form, memory_bytes=config.memory_bytes, device=device
    )
    if skip is not None:
        lin = skip
    else:
        assert train is not None and test is not None  # else skip is set
        lin = linearized_prediction(
            task_init,
            task_trained,
            recipe,
            train[0],
            train[1],
            test[0],
            test[1],
            method=config.linearized,
            steps=steps,
            train_dtype=train_dtype,
            memory_bytes=config.memory_bytes,
            device=device,
        )
        if lin.unstable:
            warnings.append(
                f"{label}: the linearized model's training was unstable (loss {lin.lin_initial_loss:.4g} -> "
                f"{lin.lin_train_loss:.4g}): the learning rate is too large for the initial eNTK, so the distance "
                "mostly measures that instability"
            )
    if mv.jacobian_passes > 1.5:
        warnings.append(
            f"{label}: the Jacobians of the {mv.n_points} kernel rows did not fit the {config.memory_bytes / 2**30:.3g} "
            f"GiB budget at once and were recomputed ({mv.jacobian_passes:.1f} passes per row)"
        )
    return CheckpointKernelResult(
        label=label,
        reference=dict(reference or {}),
        rows=dict(rows or {}),
        movement=mv,
        linearized=lin,
        recipe=recipe.to_dict() if recipe is not None else None,
        verdict=checkpoint_verdict(label, mv, lin),
        warnings=warnings,
        seconds=time.perf_counter() - t0,
    )


def initial_model(loaded) -> tuple[nn.Module, dict] | None:
    """A fresh float64 copy of an attnaudit checkpoint's architecture at its initialization.

    The seed: the side-car's recorded ``init_seed`` (with or without a recipe), else the
    spec's ``seed`` (a built-in model is initialised deterministically from it). MLP-Attn
    keeps the checkpoint's attention context (a fixed buffer, not trained). None for other
    sources (Hugging Face, ``--factory``): give the reference checkpoint.
    """

    if (loaded.source or {}).get("kind") != "attnaudit":
        return None
    module = loaded.module
    spec = getattr(module, "spec", None)
    if not isinstance(spec, (ModelSpec, ViTSpec)):
        return None
    rebuild = rebuild_of(loaded)  # validates a recorded recipe and init_seed
    if rebuild is not None:
        seed, where = rebuild.init_seed, "the side-car's init_seed"
    elif "init_seed" in loaded.metadata:
        seed = loaded.metadata["init_seed"]
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise AuditError(f"checkpoint {loaded.label}: side-car init_seed must be an integer, got {seed!r}")
        where = "the side-car's init_seed"
    else:
        seed, where = spec.seed, "the spec's seed (the side-car records no init_seed)"
    init: nn.Module
    if isinstance(spec, ViTSpec):
        init = ViT(dataclasses.replace(spec, seed=seed), dtype=F64)
    else:
        context = getattr(module, "context", None)
        init = TwoLayerNet(
            dataclasses.replace(spec, seed=seed), context=None if context is None else context.detach().cpu(), dtype=F64
        )
    init.eval()
    return init, {
        "kind": "rebuilt",
        "init_seed": int(seed),
        "seed_from": where,
        "arch": spec.arch,
        "detail": f"fresh init, seed {seed}",
        "description": f"a fresh {spec.arch} of the same spec, float64, initialised from {where} ({seed})",
    }


# --------------------------------------------------------------------------- transformer width sweep


def default_transformer_recipe():
    """The ViT defaults of ``attnaudit train``: Adam, lr 1e-3, batch 64, 5 epochs, cross-entropy."""

    return Recipe(optimizer="adam", lr=1e-3, batch_size=64, epochs=5, loss="ce")


@dataclass(frozen=True)
class TransformerSweepConfig:
    """Width sweep of the built-in transformers. ``widths``: embedding dims; ``heads`` fixed
    (head dim = width / heads grows with width); ``recipe``: how every network is trained (its
    ``seed``, the mini-batch order, is set to each cell's seed); ``train_dtype``: float32 (as
    ``attnaudit train``) or float64; kernels and metrics are float64."""

    archs: tuple[str, ...] = ("vit", "vit-linear")
    widths: tuple[int, ...] = (16, 32, 64, 128)
    seeds: tuple[int, ...] = (0, 1)
    recipe: Recipe = field(default_factory=default_transformer_recipe)
    heads: int = 4
    depth: int = 2
    mlp_ratio: int = 2
    patch: int | None = None
    kernel_points: int = 128
    form: str = "full"
    linearized: str = "auto"
    train_dtype: str = "float32"
    memory_bytes: int = DEFAULT_MEMORY_BYTES

    def __post_init__(self) -> None:

        if not self.archs:
            raise AuditError("no architectures given; use --arch vit,vit-linear")
        bad = [a for a in self.archs if a not in VIT_ARCHITECTURES]
        if bad:
            raise AuditError(
                f"unknown --arch {','.join(bad)}; the transformer sweep takes {','.join(VIT_ARCHITECTURES)} "
                "(the 2-layer nets are swept with --models relu,attn)"
            )
        if len(set(self.archs)) != len(self.archs):
            raise AuditError("an architecture is listed twice in --arch; list each once")
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise AuditError(f"--widths must be positive integers (embedding dims), got {list(self.widths)}")
        if len(set(self.widths)) != len(self.widths):
            raise AuditError("a width is listed twice in --widths; list each once")
        if not isinstance(self.heads, int) or self.heads < 1:
            raise AuditError(f"heads must be a positive integer, got {self.heads!r}")
        odd = [w for w in self.widths if w % self.heads]
        if odd:
            raise AuditError(
                f"--widths {odd} are not multiples of the {self.heads} attention heads; use multiples of {self.heads}"
            )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise AuditError("give at least one seed, each once (--seeds)")
        if not isinstance(self.recipe, Recipe):
            raise AuditError("the sweep needs a training recipe (attnaudit.core.fit.Recipe)")
        _check_kernel_points(self.kernel_points)
        _check_kernel_form(self.form, self.linearized)
        if self.train_dtype not in ("float32", "float64"):
            raise AuditError(f"--dtype {self.train_dtype!r} is not supported here; use float32 or float64")

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["recipe"] = self.recipe.to_dict()
        for key in ("archs", "widths", "seeds"):
            out[key] = list(out[key])
        out["heads_rule"] = f"fixed at {self.heads} (head dim = width / {self.heads})"
        return out


@dataclass
class TransformerCell:
    """One trained transformer (arch x width x seed)."""

    arch: str
    width: int
    heads: int
    seed: int
    n_params: int
    steps_run: int
    diverged: bool
    train_loss: float
    train_acc: float
    test_acc: float
    movement: float | None
    movement_trace: float
    norm_ratio: float
    kernel_distance: float
    cka_init: float | None
    cka_trained: float | None
    group_movement: dict
    linearized: dict
    distance_rms: float
    distance_rel: float
    seconds: float

    @property
    def headline(self) -> float:
        return self.movement if self.movement is not None else self.movement_trace

    def to_dict(self) -> dict:
        return _clean(asdict(self))


@dataclass
class WidthTrend:
    """One measure against width: log-log least-squares slope per seed, mean ± sd (ddof 1), the
    seed-mean curve, whether it decreases at every width step, and the trend word of the
    2-layer sweep (falls / falls-non-monotone / rises / mixed / undetermined)."""

    measure: str
    slope_per_seed: list
    slope_mean: float
    slope_std: float
    mean_by_width: list
    monotone_decreasing: bool
    trend: str

    def to_dict(self) -> dict:
        return _clean(asdict(self))


@dataclass
class ArchSummary:
    """Width trend of one architecture and its verdict.

    ``movement``: the kernel movement (full kernel, output-averaged with form=trace);
    ``kernel_distance``: 1 - cos(Theta_0, Theta_T), the change of the kernel's shape;
    ``distance``: the *relative* distance to the linearized model (the networks' output
    scale changes with width, so the absolute distance is scale-laden; its slope is
    ``distance_rms_slope``). ``approaches_kernel_regime``: all measured trends ``falls``.
    """

    arch: str
    movement: WidthTrend
    kernel_distance: WidthTrend
    distance: WidthTrend | None
    distance_rms_slope: float
    approaches_kernel_regime: bool
    verdict: str

    def to_dict(self) -> dict:
        return _clean(
            {
                "arch": self.arch,
                "movement": self.movement.to_dict(),
                "kernel_distance": self.kernel_distance.to_dict(),
                "distance": None if self.distance is None else self.distance.to_dict(),
                "distance_rms_slope": self.distance_rms_slope,
                "approaches_kernel_regime": self.approaches_kernel_regime,
                "verdict": self.verdict,
            }
        )


@dataclass
class TransformerSweepResult:
    config: TransformerSweepConfig
    n_train: int
    n_test: int
    n_classes: int
    image_shape: tuple
    patch: int
    cells: list[TransformerCell]
    archs: dict[str, ArchSummary]
    warnings: list[str]
    seconds: float
    failed_cells: list = field(default_factory=list)
    execution: dict = field(default_factory=dict)  # executor, cells, resumed (how it ran; not a result)

    def summary_rows(self) -> list[dict]:
        def head(group: list[TransformerCell]) -> dict:
            return {"diverged": sum(c.diverged for c in group), "n_params": group[0].n_params if group else 0}

        keys = (
            "movement",
            "movement_trace",
            "norm_ratio",
            "kernel_distance",
            "cka_init",
            "cka_trained",
            "distance_rms",
            "distance_rel",
            "train_acc",
            "test_acc",
            "train_loss",
        )
        return _summary_rows(self.cells, "arch", self.config.archs, self.config.widths, head, keys)

    def verdicts(self) -> list[str]:
        return _verdicts(self.archs, self.config.archs)

    def to_dict(self) -> dict:
        return _clean(
            {
                "config": self.config.to_dict(),
                "n_train": self.n_train,
                "n_test": self.n_test,
                "n_classes": self.n_classes,
                "image_shape": list(self.image_shape),
                "patch": self.patch,
                "movement_definition": MOVEMENT_DEFINITION,
                "cka_definition": CKA_DEFINITION,
                "distance_definition": DISTANCE_DEFINITION,
                "cells": [c.to_dict() for c in self.cells],
                "summary": self.summary_rows(),
                "archs": {k: v.to_dict() for k, v in self.archs.items()},
                "seconds": self.seconds,
                "failed_cells": list(self.failed_cells),
            }
        )


def _width_trend(
    measure: str,
    cells: list[TransformerCell],
    key: Callable[[TransformerCell], float],
    widths: Sequence[int],
    seeds: Sequence[int],
) -> WidthTrend:
    ws = sorted(widths)
    slopes = []
    for sd in seeds:
        vals = [
            next((key(c) for c in cells if c.width == w and c.seed == sd and not c.diverged), float("nan")) for w in ws
        ]
        slopes.append(_loglog_slope(ws, vals))
    by_width = [_stats([key(c) for c in cells if c.width == w and not c.diverged]) for w in ws]
    curve = [b["mean"] for b in by_width]
    sds = [b["std"] for b in by_width]
    mono = all(math.isfinite(x) and math.isfinite(y) and y < x for x, y in zip(curve, curve[1:]))
    st = _stats(slopes)
    # non-monotone only for a rise beyond the seed spread; a slope interval containing 0 is no trend
    return WidthTrend(
        measure, slopes, st["mean"], st["std"], curve, mono, _trend(slopes, mono, widths=ws, means=curve, sds=sds)
    )


_TREND_WORDS = {
    "falls": "falls (no rise between neighbouring widths beyond the seed spread)",
    "falls-non-monotone": "falls overall but rises between neighbouring widths by more than the seed spread",
    "rises": "rises",
    "mixed": "has no consistent trend (seed slopes differ in sign)",
    "no-clear-trend": "shows no clear trend (the slope interval includes 0)",
    "undetermined": "is undetermined (too few finite values)",
}


def _arch_summary(
    arch: str, cells: list[TransformerCell], widths: Sequence[int], seeds: Sequence[int], measured_distance: bool
) -> ArchSummary:
    ws = sorted(widths)
    k = len(seeds)
    movement = _width_trend("kernel movement", cells, lambda c: c.headline, ws, seeds)
    shape = _width_trend("kernel distance (1 - cos)", cells, lambda c: c.kernel_distance, ws, seeds)
    distance = (
        _width_trend("relative distance to the linearized model", cells, lambda c: c.distance_rel, ws, seeds)
        if measured_distance
        else None
    )
    rms_slope = (
        _stats(_width_trend("", cells, lambda c: c.distance_rms, ws, seeds).slope_per_seed)["mean"]
        if measured_distance
        else float("nan")
    )
    trends = [t for t in (movement, shape, distance) if t is not None]
    # one seed gives no interval: no kernel-regime claim from it
    approaches = k > 1 and all(t.trend == "falls" for t in trends)

    def spread(t: WidthTrend) -> str:
        if k <= 1:
            return f"{t.slope_mean:+.2f}, 1 seed (no interval)"
        _, lo, hi, _n = slope_interval(t.slope_per_seed)
        return f"{t.slope_mean:+.2f} ± {t.slope_std:.2f} over {k} seeds, interval [{lo:+.2f}, {hi:+.2f}]"

    def describe(t: WidthTrend, fmt: str = "{:.3g}") -> str:
        return (
            f"{t.measure} {_TREND_WORDS.get(t.trend, t.trend)} (slope {spread(t)}; {fmt.format(t.mean_by_width[0])} at "
            f"width {ws[0]} -> {fmt.format(t.mean_by_width[-1])} at width {ws[-1]})"
        )

    parts = [describe(movement), describe(shape)]
    if distance is not None:
        parts.append(describe(distance, "{:.1%}"))
    text = f"{arch}: " + "; ".join(parts)
    if approaches:
        slowest = max(trends, key=lambda t: t.slope_mean)
        text += " — approaching the kernel regime as it widens"
        if slowest.slope_mean > KERNEL_RATE / 2:
            text += (
                f", but slowly: {slowest.measure} falls at less than half the m^{KERNEL_RATE} rate "
                f"(slope {slowest.slope_mean:+.2f}), and at width {ws[-1]} it is still {slowest.mean_by_width[-1]:.3g}"
            )
        text += "."
    elif k > 1 and any(t.trend == "rises" for t in trends):
        rising = ", ".join(t.measure for t in trends if t.trend == "rises")
        text += f" — moving away from the kernel regime as it widens ({rising} rises)."
    elif k <= 1:
        text += " — one seed gives no interval, so no claim about the kernel regime; rerun with more seeds."
    else:
        text += " — not clearly approaching the kernel regime at these widths."
    return ArchSummary(
        arch=arch,
        movement=movement,
        kernel_distance=shape,
        distance=distance,
        distance_rms_slope=rms_slope,
        approaches_kernel_regime=approaches,
        verdict=text,
    )


def run_transformer_sweep(
    X_train: torch.Tensor,
    y_train: torch.Tensor,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    n_classes: int,
    feature_shape,
    config: TransformerSweepConfig = TransformerSweepConfig(),
    *,
    device=None,
    progress: Callable[[], None] | None = None,
    executor: "ExecutorConfig | None" = None,
    data: "HoldoutRecipe | None" = None,
) -> TransformerSweepResult:
    """Train every arch x width x seed with the recipe and measure its kernel regime.

    Per cell: the ViT (``attnaudit.models.builtin.build_builtin``, dim = width, heads fixed, depth,
    MLP ratio and patch as configured; patch default: the largest leaving >= 16 tokens) is
    trained by :func:`attnaudit.core.fit.fit`; :func:`kernel_movement` against its initialization
    on ``kernel_points`` training rows (a fixed random subset, seed 0); and
    :func:`linearized_prediction` on the held-out rows. Per arch: log-log slopes against width
    per seed, mean ± sd, and the verdict. Each arch x width x seed is one cell
    (:func:`transformer_cell`) run by ``executor`` (:mod:`attnaudit.runtime.sweep`); executors other
    than the in-process one need ``data``, the recipe the tensors came from.
    """

    t_start = time.perf_counter()
    if X_train.ndim != 2 or X_test.ndim != 2 or X_train.shape[1] != X_test.shape[1]:
        raise AuditError("training and test inputs must be (n, d) matrices with the same d")
    n = int(X_train.shape[0])
    if n < 2 or X_test.shape[0] < 1:
        raise AuditError(f"need at least 2 training and 1 held-out rows, got {n} and {X_test.shape[0]}")
    image = image_shape_of(feature_shape, config.archs[0])
    patch = config.patch if config.patch is not None else default_patch(image)
    c = max(int(n_classes), int(y_train.max()) + 1, int(y_test.max()) + 1)
    ex = executor or ExecutorConfig()
    remote = ex.kind != "local" or ex.jobs > 1
    if remote and data is None:
        raise AuditError(
            "cells on worker processes or Ray rebuild their data from a recipe; pass data=HoldoutRecipe(...) "
            "(the CLI does), or run with the local executor"
        )
    memory_key = data.key if data is not None else f"memory:{id(X_train)}"
    cached(f"vit-sweep:{memory_key}", lambda: (X_train, y_train, X_test, y_test))
    base = {
        "data": None if data is None else data.to_dict(),
        "memory_key": memory_key,
        "n_classes": c,
        "feature_shape": list(feature_shape),
        "patch": patch,
        "device": None if device is None else str(device),
        "config": config,
    }
    tasks = _cell_grid(
        "attnaudit.analyses.ntk_distance.movement:transformer_cell",
        base,
        ("arch", config.archs, config.widths, config.seeds),
        lambda a, w, s: f"{a} width {w} seed {s}",
        lambda w: float(w) ** 2,
    )
    try:
        outcomes = run_cells(tasks, ex, on_done=(lambda o: progress()) if progress is not None else None)
    finally:
        clear_cache()
    cells = [TransformerCell(**o.result["cell"]) for o in outcomes if o.ok]
    warnings = [w for o in outcomes if o.ok for w in o.result["warnings"]]
    failed = [o.failure() for o in outcomes if not o.ok]
    if failed:
        warnings.append(
            f"{len(failed)} of {len(tasks)} cells failed (listed in failed_cells): "
            + "; ".join(f"{f['cell']}: {f['error']}" for f in failed[:3])
        )
    shaky = [f"{c.arch} width {c.width} seed {c.seed}" for c in cells if c.linearized.get("unstable")]
    if shaky:
        warnings.append(
            "the linearized model's training loss ended above its initial value (or diverged) for "
            + ", ".join(shaky)
            + ": the learning rate is too large for its initial eNTK there; at a fixed initial std the eNTK grows with "
            "width, so a fixed lr is a larger step for a wider network, and the distance at those widths mostly "
            "measures that instability"
        )
    measured = config.linearized != "off"
    summaries = {
        a: _arch_summary(a, [cl for cl in cells if cl.arch == a], config.widths, config.seeds, measured)
        for a in config.archs
        if any(cl.arch == a for cl in cells)
    }
    if config.recipe.optimizer == "adam":
        warnings.append(
            "the networks are trained with Adam: its per-parameter normalisation moves every weight by about lr per "
            "step whatever the width, so the kernel-regime argument (made for gradient descent) does not predict "
            "lazy training here; the distance is to the linearized model trained with Adam, not to kernel gradient "
            "descent (--optimizer gd --lr ... --steps ... measures the gradient-descent case)"
        )
    return TransformerSweepResult(
        config=config,
        n_train=n,
        n_test=int(X_test.shape[0]),
        n_classes=c,
        image_shape=tuple(image),
        patch=patch,
        cells=cells,
        archs=summaries,
        warnings=warnings,
        seconds=time.perf_counter() - t_start,
        failed_cells=failed,
        execution={**ex.to_dict(), "cells": len(tasks), "resumed": sum(o.resumed for o in outcomes)},
    )


def transformer_cell(payload: dict) -> dict:
    """One arch x width x seed cell of the transformer sweep (a pure function of ``payload``):
    build the ViT from the seed, train it with the recipe, measure its kernel movement and its
    distance to the linearized model. Returns {"cell": TransformerCell fields, "warnings": [...]}."""

    def rows():
        train_ds, test_ds = HoldoutRecipe(**payload["data"]).load()
        dev = torch.device(payload["device"]) if payload["device"] else None
        return tuple(t.to(dev) if dev is not None else t for t in (train_ds.X, train_ds.y, test_ds.X, test_ds.y))

    X_train, y_train, X_test, y_test = cached(f"vit-sweep:{payload['memory_key']}", rows)
    config: TransformerSweepConfig = payload["config"]
    arch, width, seed = payload["arch"], int(payload["width"]), int(payload["seed"])
    c, patch = int(payload["n_classes"]), int(payload["patch"])
    device = torch.device(payload["device"]) if payload["device"] else None
    n = int(X_train.shape[0])
    dtype = getattr(torch, config.train_dtype)
    kp = min(n, config.kernel_points)
    kidx = (
        torch.arange(n) if kp == n else torch.randperm(n, generator=torch.Generator().manual_seed(0))[:kp].sort().values
    )
    Xk, yk = X_train[kidx.to(X_train.device)], y_train[kidx.to(y_train.device)]
    warnings: list[str] = []
    t_cell = time.perf_counter()
    model = build_builtin(
        arch,
        n_out=c,
        feature_shape=tuple(payload["feature_shape"]),
        seed=seed,
        dim=width,
        heads=config.heads,
        depth=config.depth,
        patch=patch,
        mlp_ratio=config.mlp_ratio,
        dtype=dtype,
        device=device,
    )
    assert isinstance(model, ViT)  # the sweep's archs are ViTs (checked with the config)
    init = copy.deepcopy(model)
    recipe = dataclasses.replace(config.recipe, seed=seed)
    fr = fit(model, X_train, y_train, recipe, X_val=X_test, y_val=y_test)
    inputs = model.audit_inputs()
    t_init, t_trained = Task(init, c, inputs=inputs), Task(model, c, inputs=inputs)
    if fr.diverged:
        warnings.append(f"{arch} width {width} seed {seed}: training diverged at step {fr.steps_run + 1}")
        mv = None
        lin = LinearizedResult(method="none", applicable=False, reason="training diverged")
    else:
        mv = kernel_movement(
            t_init, t_trained, Xk, yk, form=config.form, memory_bytes=config.memory_bytes, device=device
        )
        lin = (
            LinearizedResult(method="off", applicable=False, reason="switched off (--linearized off)")
            if config.linearized == "off"
            else linearized_prediction(
                t_init,
                t_trained,
                recipe,
                X_train,
                y_train,
                X_test,
                y_test,
                method=config.linearized,
                steps=fr.steps_run,
                train_dtype=dtype,
                memory_bytes=config.memory_bytes,
                device=device,
            )
        )
    nan = float("nan")
    cell = TransformerCell(
        arch=arch,
        width=width,
        heads=config.heads,
        seed=seed,
        n_params=n_parameters(model),
        steps_run=fr.steps_run,
        diverged=fr.diverged,
        train_loss=fr.final_train_loss,
        train_acc=fr.train_accuracy,
        test_acc=fr.val_accuracy if fr.val_accuracy is not None else nan,
        movement=None if mv is None else mv.movement,
        movement_trace=nan if mv is None else mv.movement_trace,
        norm_ratio=nan if mv is None else mv.norm_ratio,
        kernel_distance=nan if mv is None else mv.kernel_distance,
        cka_init=None if mv is None else mv.cka_init,
        cka_trained=None if mv is None else mv.cka_trained,
        group_movement={}
        if mv is None
        else {g.group: (g.movement if g.movement is not None else g.movement_trace) for g in mv.groups},
        linearized={k: v for k, v in lin.to_dict().items() if k not in ("definition",)},
        distance_rms=lin.distance_rms,
        distance_rel=lin.distance_rel,
        seconds=time.perf_counter() - t_cell,
    )
    return {"cell": asdict(cell), "warnings": warnings}


# --------------------------------------------------------------------------- rendering


def _num(x, fmt: str = "{:.3g}") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def _pm(stat: dict, fmt: str = "{:.3g}") -> str:
    mean, std = stat["mean"], stat["std"]
    if mean is None or not math.isfinite(mean):
        return "—"
    return fmt.format(mean) + ("" if not std or not math.isfinite(std) else " ± " + fmt.format(std))


# the kernel-movement columns of the checkpoint table and of the transformer sweep's
MOVEMENT_COLUMNS = ("params", "ΔΘ/Θ₀ full", "ΔΘ/Θ₀ avg", "‖Θ_T‖/‖Θ₀‖", "1 − cos", "CKA init → trained")


def build_checkpoint_tables(results: list[CheckpointKernelResult], warnings: Sequence[str] = ()) -> list:
    """Rich renderables: one summary row per model, a per-group table per model, verdicts."""
    from rich.table import Table
    from rich.text import Text

    summary = Table(title="Kernel movement: trained model vs its initialization (empirical NTK, engine, float64)")
    for col in (
        "model",
        "reference",
        "rows",
        *MOVEMENT_COLUMNS,
        "‖f − f_lin‖ rel",
        "linearized",
        "seconds",
    ):
        summary.add_column(col, justify="left" if col in ("model", "reference", "linearized") else "right")
    out: list = [summary]
    for r in results:
        mv, lin = r.movement, r.linearized
        cka = "—" if mv.cka_init is None else f"{mv.cka_init:.3f} → {mv.cka_trained:.3f}"
        summary.add_row(
            r.label,
            str(r.reference.get("detail", r.reference.get("kind", "")))[:40],
            str(mv.n_points),
            f"{mv.n_params:,}",
            _num(mv.movement),
            _num(mv.movement_trace),
            _num(mv.norm_ratio),
            _num(mv.kernel_distance),
            cka,
            _num(lin.distance_rel, "{:.1%}") if lin.applicable else "—",
            lin.method if lin.applicable else "n/a",
            f"{r.seconds:.1f}",
        )
        groups = Table(title=f"{r.label}: per parameter group")
        for col in (
            "group",
            "params",
            "ΔΘ/Θ₀ full",
            "ΔΘ/Θ₀ avg",
            "‖Θ_T‖/‖Θ₀‖",
            "1 − cos",
            "trace share init → trained",
            "CKA init → trained",
        ):
            groups.add_column(col, justify="left" if col == "group" else "right")
        for g in mv.groups:
            groups.add_row(
                g.group,
                f"{g.n_params:,}",
                _num(g.movement),
                _num(g.movement_trace),
                _num(g.norm_ratio),
                _num(g.kernel_distance),
                f"{g.trace_share_init:.1%} → {g.trace_share_trained:.1%}",
                "—" if g.cka_init is None else f"{g.cka_init:.3f} → {g.cka_trained:.3f}",
            )
        out.append(groups)
    for r in results:
        out.append(Text(r.verdict))
        if r.linearized.applicable:
            out.append(Text(f"  linearized model of {r.label}: {r.linearized.dynamics}"))
    for w in [*warnings, *(w for r in results for w in r.warnings)]:
        out.append(Text("warning: " + w, style="yellow"))
    return out


def plot_checkpoints(results: list[CheckpointKernelResult], path) -> None:
    """PNG: per-group kernel movement (bars) and centred alignment before/after, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(results)
    fig, axes = plt.subplots(k, 2, figsize=(11, 3.8 * k), squeeze=False)
    try:
        for row, r in enumerate(results):
            mv = r.movement
            names = [g.group for g in mv.groups] + ["all"]
            full = [g.movement for g in mv.groups] + [mv.movement]
            avg = [g.movement_trace for g in mv.groups] + [mv.movement_trace]
            x = list(range(len(names)))
            ax = axes[row][0]
            if mv.movement is not None:
                ax.bar([i - 0.2 for i in x], [v or 0 for v in full], width=0.4, label="full (n c)² kernel")
                ax.bar([i + 0.2 for i in x], avg, width=0.4, label="output-averaged")
            else:
                ax.bar(x, avg, width=0.6, label="output-averaged")
            ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel("‖Θ_T − Θ_0‖_F / ‖Θ_0‖_F")
            ax.set_title(f"{r.label}: kernel movement per group")
            ax.legend(fontsize=8)
            ax = axes[row][1]
            if mv.cka_init is not None:
                c0 = [g.cka_init for g in mv.groups] + [mv.cka_init]
                cT = [g.cka_trained for g in mv.groups] + [mv.cka_trained]
                ax.bar([i - 0.2 for i in x], c0, width=0.4, label="at initialization")
                ax.bar([i + 0.2 for i in x], cT, width=0.4, label="trained")
                ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
                ax.set_ylabel("centred alignment with labels")
                ax.legend(fontsize=8)
            ax.set_title(f"{r.label}: kernel-label alignment (CKA)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def build_sweep_tables(result: TransformerSweepResult) -> list:
    from rich.table import Table
    from rich.text import Text

    k = len(result.config.seeds)
    table = Table(
        title=f"Transformer width sweep (heads fixed at {result.config.heads}; mean ± sd over {k} seed(s); "
        f"kernel on {min(result.n_train, result.config.kernel_points)} training rows)"
    )
    for col in (
        "arch",
        "width",
        *MOVEMENT_COLUMNS,
        "‖f − f_lin‖ rms",
        "relative",
        "acc tr/te",
    ):
        table.add_column(col, justify="left" if col == "arch" else "right")
    for row in result.summary_rows():
        table.add_row(
            row["arch"],
            str(row["width"]) + (" ⚠" if row["diverged"] else ""),
            f"{row['n_params']:,}",
            _pm(row["movement"]),
            _pm(row["movement_trace"]),
            _pm(row["norm_ratio"]),
            _pm(row["kernel_distance"]),
            f"{_num(row['cka_init']['mean'], '{:.3f}')} → {_num(row['cka_trained']['mean'], '{:.3f}')}",
            _pm(row["distance_rms"]),
            _pm(row["distance_rel"], "{:.1%}"),
            f"{_num(row['train_acc']['mean'], '{:.1%}')}/{_num(row['test_acc']['mean'], '{:.1%}')}",
        )
    trend = Table(title="Width trend (log-log slope per seed, mean ± sd; trend word as in the 2-layer sweep)")
    for col in ("arch", "ΔΘ/Θ₀", "1 − cos", "‖f − f_lin‖ relative", "kernel regime"):
        trend.add_column(col, justify="left" if col in ("arch", "kernel regime") else "right")

    def cell(t: WidthTrend | None) -> str:
        if t is None:
            return "not measured"
        return f"{_num(t.slope_mean, '{:+.2f}')} ± {_num(t.slope_std, '{:.2f}')} ({t.trend})"

    for name in result.config.archs:
        s = result.archs[name]
        trend.add_row(
            name,
            cell(s.movement),
            cell(s.kernel_distance),
            cell(s.distance),
            "approaching" if s.approaches_kernel_regime else "not shown",
        )
    out: list = [table, trend]
    lin = next((c.linearized for c in result.cells if c.linearized.get("applicable")), None)
    if lin:
        out.append(Text(f"linearized model: {lin['dynamics']}"))
    out.extend(Text(v) for v in result.verdicts())
    out.extend(Text("warning: " + w, style="yellow") for w in result.warnings)
    return out


def plot_sweep(result: TransformerSweepResult, path) -> None:
    """PNG: kernel movement and distance to the linearized model vs width (log-log, sd bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.summary_rows()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        for idx, arch in enumerate(result.config.archs):
            sel = sorted((r for r in rows if r["arch"] == arch), key=lambda r: r["width"])
            w = [r["width"] for r in sel]
            key = "movement" if result.config.form == "full" else "movement_trace"
            for ax, k, style, label in (
                (axes[0], key, "o-", arch),
                (axes[0], "kernel_distance", "s--", f"{arch} 1 − cos"),
                (axes[1], "distance_rel", "o-", arch),
            ):
                mean = [r[k]["mean"] for r in sel]
                std = [r[k]["std"] for r in sel]
                if any(math.isfinite(m) for m in mean):
                    ax.errorbar(w, mean, yerr=std, fmt=style, color=f"C{idx}", capsize=3, label=label)
        ws = sorted(result.config.widths)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("embedding dim (width)")
            ax.grid(True, which="both", alpha=0.3)
            lines = [ln for ln in ax.get_lines() if len(ln.get_ydata())]
            if lines and len(ws) > 1:
                y0 = max(float(ln.get_ydata()[0]) for ln in lines)
                if math.isfinite(y0) and y0 > 0:
                    ax.plot(ws, [y0 * (v / ws[0]) ** KERNEL_RATE for v in ws], "k:", label="∝ m^-1/2")
            ax.legend(fontsize=8)
        axes[0].set_ylabel("‖Θ_T − Θ_0‖_F / ‖Θ_0‖_F  (dashed: 1 − cos(Θ_0, Θ_T))")
        axes[0].set_title("Kernel movement and change of shape")
        axes[1].set_ylabel("RMS ‖f − f_lin‖ / RMS ‖f_lin‖ (held-out)")
        axes[1].set_title("Distance to the linearized model")
        r = result.config.recipe
        fig.suptitle(
            f"{r.optimizer} lr {r.lr:g}, {r.loss}, n_train={result.n_train}, heads {result.config.heads}", fontsize=10
        )
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
