"""Group kernels summed layer by layer: the kernel-movement plan when even two rows' Jacobians
over all parameters do not fit the memory budget (transformers of millions of parameters).

A linear layer (``nn.Linear``, ``nn.Conv2d``, self-attention projections: the layers K-FAC
covers, :func:`attnaudit.analyses.influence.kfac.linear_modules`) with inputs a_t and output
gradients s_at = d f_a / d y_t has the per-sample Jacobian J_a = sum_t s_at a_t^T (bias: sum_t
s_at). Memory plan (``memory_bytes`` for this model, the group kernels included): the layers
are taken in consecutive runs whose inputs and c output gradients for all rows fit half of
what the kernels leave; one forward and c backward passes (to the run's outputs only) per
:data:`LAYER_ROWS` rows capture them, then each layer's Jacobians are formed for panels of
rows (two panels in a quarter) and contracted, K_g += J_l J_l^T (one matrix product per panel
pair, the upper triangle only). Inputs, output gradients and Jacobian panels are held in the
engine's dtype (the precision policy: float32 for a large model under ``auto``) and summed into
the float64 kernels by :func:`~attnaudit.core.contraction.contract`; held in float64 whatever the
engine's dtype, a DeiT-tiny-size model's capture and contraction ran at float64's speed and in
twice the memory. An embedding table E (``nn.Embedding``, not tied to another layer) has the
per-sample Jacobian J_a = sum_t e_{id_t} s_at^T, nonzero only in the rows of the ids it reads: its
ids and output gradients are captured the same way and its Jacobians formed on the union U of
the ids the kernel rows read (|U| rows instead of the table's V, every other row of J is zero);
a row at the table's ``padding_idx`` gets no gradient, as in ``nn.Embedding``'s backward. Formed
over the whole table, a BERT-mini's 30,522-word table took most of its kernel movement's time.
The remaining parameters (norms, tied weights, tables with ``max_norm`` or
``scale_grad_by_freq``) get their Jacobians from :meth:`Engine.jacobian` restricted to them, in
panels of rows the same way. Cost: one capture pass per run of layers and one for the tables (a
forward and c partial backward passes over all rows) instead of one Jacobian pass, and the same
contraction work as the Jacobian plan of
:func:`~attnaudit.analyses.ntk_distance.movement.kernel_movement`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnaudit.analyses.influence.kfac import (
    LinearBlock,
    capture_activations,
    linear_modules,
    output_token_rows,
    shared_weights,
    token_rows,
)
from attnaudit.analyses.influence.projection import embedding_modules
from attnaudit.core.contraction import contract
from attnaudit.core.engine import JACOBIAN_TRANSIENT, Engine, ranges
from attnaudit.errors import AuditError

F64 = torch.float64
#: rows per forward pass when the layers' inputs and output gradients are captured
LAYER_ROWS = 16


class _GroupKernels:
    """One model's group kernels on n rows, {group: (n c, n c) flat full form or (n, n) output-averaged},
    and the contraction K_g += J J^T of Jacobian panels into them."""

    def __init__(self, engine: Engine, n: int, slices: dict[str, tuple[int, int]], c: int, form: str) -> None:
        self.n, self.c, self.form, self.slices = n, c, form, slices
        self.itemsize = engine.theta.element_size()  # of the Jacobian panels; the kernels are float64
        self.k_out = c if form == "full" else 1
        self.K = {g: torch.zeros(n * self.k_out, n * self.k_out, dtype=F64, device=engine.device) for g in slices}
        self.offsets: dict[str, int] = {}
        start = 0
        for name, numel in zip(engine.names, engine.numels):
            self.offsets[name] = start
            start += numel

    @property
    def fixed_bytes(self) -> int:
        """The memory of the group kernels."""
        return len(self.slices) * (self.n * self.k_out) ** 2 * 8

    def group_at(self, name: str) -> str:
        """The group of parameter ``name``."""
        o = self.offsets[name]
        return next(g for g, (s, e) in self.slices.items() if s <= o < e)

    def add(self, g: str, R: torch.Tensor, C: torch.Tensor, a1: int, a2: int) -> None:
        """K_g[rows a1.., cols a2..] += R C^T for flat (rows, c, p) Jacobian panels (mirrored)."""
        r, m, c = R.shape[0], C.shape[0], self.c
        # summed in float64 whatever the Jacobians' precision (attnaudit.core.contraction)
        if self.form == "trace":
            B = contract(R.reshape(r, -1), C.reshape(m, -1)) / c
        else:
            B = contract(R.reshape(r * c, -1), C.reshape(m * c, -1))
        i, j = a1 * self.k_out, a2 * self.k_out
        K = self.K[g]
        K[i : i + B.shape[0], j : j + B.shape[1]] += B
        if a1 != a2:
            K[j : j + B.shape[1], i : i + B.shape[0]] += B.T

    def contract(
        self,
        splits: Sequence[tuple[str, int, int]],
        make: Callable[[int, int], torch.Tensor],
        width: int,
        share: int,
        transient: int = 0,
    ) -> None:
        """K_g += J[..., s:e] J[..., s:e]^T over all rows for each (g, s, e) of ``splits``, J
        (rows, c, width) made by ``make(a, b)`` in panels of rows, two of which (and ``transient``
        bytes per row, at most :data:`JACOBIAN_ROWS` rows) fit ``share``; the panels after the
        first row panel are made again for every row panel."""
        n = self.n
        per_row = max(1, self.c * width * self.itemsize)
        panel = max(1, min(n, share // (2 * per_row + transient)))
        spans = list(ranges(n, panel))
        for i, (a1, b1) in enumerate(spans):
            R = make(a1, b1)
            for g, s, e in splits:
                self.add(g, R[..., s:e], R[..., s:e], a1, a1)
            for a2, b2 in spans[i + 1 :]:
                C = make(a2, b2)
                for g, s, e in splits:
                    self.add(g, R[..., s:e], C[..., s:e], a1, a2)
                del C
            del R


def layer_kernels(
    engine: Engine, rows: torch.Tensor, slices: dict[str, tuple[int, int]], c: int, form: str, memory_bytes: int
) -> dict[str, torch.Tensor]:
    """Each group's eNTK on ``rows`` for one model, {group: (n c, n c) flat full form (row i c + a)
    or (n, n) output-averaged}, summed parameter tensor by parameter tensor, never holding a row's
    Jacobian over all parameters (the module docstring states the plan)."""
    n = rows.shape[0]
    kernels = _GroupKernels(engine, n, slices, c, form)
    blocks, _excluded = linear_modules(engine.module, engine.names)
    tables = embedding_modules(engine.module, engine.names)
    tied = set(shared_weights(engine.module, [*blocks, *tables]))
    if tied:  # a tied weight's Jacobian is not its layer's outer product alone
        blocks = [b for b in blocks if b.weight not in tied and (b.bias or "") not in tied]
        tables = [t for t in tables if t.weight not in tied]
    budget = int(memory_bytes)
    fixed = kernels.fixed_bytes
    avail = budget - fixed
    if avail <= 0:
        raise AuditError(
            f"the {len(slices)} group kernels of {n} kernel rows take {fixed / 2**20:,.1f} MiB per model, above the "
            f"{budget / 2**20:,.3g} MiB budget; raise the memory budget or use fewer kernel points"
        )
    # half of what the kernels leave holds a run of layers' inputs and output gradients for all
    # rows, a quarter the Jacobian panels, a quarter the activations of the forward passes
    share = max(1, avail // 4)
    tables = _tables_that_fit(engine, rows, tables, c, share)
    covered = {b.weight for b in blocks} | {b.bias for b in blocks if b.bias} | {t.weight for t in tables}
    others = [nm for nm in engine.names if nm not in covered]
    if tables:
        _contract_tables(engine, rows, tables, kernels, share)
    if others:
        _contract_others(engine, rows, others, kernels, share, budget)
    if blocks:
        for run in _layer_runs(engine, rows, blocks, c, share, budget, fixed):
            _contract_run(engine, rows, run, kernels, share)
    return kernels.K


def _contract_others(
    engine: Engine, rows: torch.Tensor, others: list[str], kernels: _GroupKernels, share: int, budget: int
) -> None:
    """The parameters outside the linear layers: Jacobians of panels of rows by Engine.jacobian."""
    sub = Engine(engine.task, dtype=engine.dtype, device=engine.device, names=others)
    sub.theta = torch.cat(
        [
            engine.theta[kernels.offsets[nm] : kernels.offsets[nm] + engine.numels[engine.names.index(nm)]]
            for nm in others
        ]
    )
    splits, start = [], 0
    for nm, numel in zip(sub.names, sub.numels):
        splits.append((kernels.group_at(nm), start, start + numel))
        start += numel
    per_row = kernels.c * sub.n_params * sub.theta.element_size()
    if 2 * per_row + JACOBIAN_TRANSIENT * per_row > 2 * share:
        raise AuditError(
            f"one row's Jacobians over the {len(others)} parameter tensor(s) outside linear layers "
            f"({sub.n_params:,} parameters) take {per_row / 2**20:,.1f} MiB; with the kernels they need a budget "
            f"of at least {(kernels.fixed_bytes + 2 * (2 + JACOBIAN_TRANSIENT) * per_row) / 2**20:,.3g} MiB, above "
            f"{budget / 2**20:,.3g} MiB; raise the memory budget or use fewer kernel points"
        )
    kernels.contract(
        splits, lambda a, b: sub.jacobian(rows[a:b]), sub.n_params, 2 * share, JACOBIAN_TRANSIENT * per_row
    )


def _layer_runs(
    engine: Engine, rows: torch.Tensor, blocks: list, c: int, share: int, budget: int, fixed: int
) -> list[list[tuple[Any, int, int]]]:
    """The linear layers in consecutive runs whose inputs and output gradients for all rows fit
    ``2 * share``: [(layer, input tokens, output tokens), ...] per run."""
    n, itemsize = rows.shape[0], engine.theta.element_size()
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
        return n * (t_in * b.width_in + c * t_out * b.d_out) * itemsize

    runs: list[list] = []
    for b in blocks:
        if stored(b) > 2 * share:
            raise AuditError(
                f"the inputs and output gradients of layer {b.path} for {n} kernel rows take "
                f"{stored(b) / 2**20:,.0f} MiB, above half of what the {budget / 2**20:,.0f} MiB budget leaves "
                f"after the kernels ({fixed / 2**20:,.0f} MiB); raise the memory budget to at least "
                f"{(fixed + 2 * stored(b)) / 2**20:,.0f} MiB or use fewer kernel points"
            )
        if runs and sum(stored(x) for x, _, _ in runs[-1]) + stored(b) <= 2 * share:
            runs[-1].append((b, *sizes[b.path]))
        else:
            runs.append([(b, *sizes[b.path])])
    return runs


def _contract_run(
    engine: Engine, rows: torch.Tensor, run: list[tuple[Any, int, int]], kernels: _GroupKernels, share: int
) -> None:
    """One run of layers: capture their inputs and output gradients for all rows (one forward and
    c backward passes per :data:`LAYER_ROWS` rows), then contract each layer's Jacobians."""
    n, c, dev = rows.shape[0], kernels.c, engine.device
    layers = [b for b, _, _ in run]
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for b, t_in, t_out in run:
        acts[b.path] = torch.zeros(n, t_in, b.width_in, dtype=engine.dtype, device=dev)
        grads[b.path] = torch.zeros(n, c, t_out, b.d_out, dtype=engine.dtype, device=dev)
    with engine.context(), torch.enable_grad():
        for a0, b0 in ranges(n, LAYER_ROWS):
            logits, ins, outs = capture_activations(engine, layers, rows[a0:b0])
            B = b0 - a0
            for b in layers:
                a = token_rows(ins[b.path].detach(), B)
                if b.bias:
                    a = torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=a.dtype, device=a.device)], 2)
                acts[b.path][a0:b0, : a.shape[1]] = a
            targets = [outs[b.path] for b in layers]
            for k in range(c):
                gs = torch.autograd.grad(logits[:, k].sum(), targets, retain_graph=k + 1 < c)
                for b, g in zip(layers, gs):
                    s_k = output_token_rows(b, g.detach(), B)
                    grads[b.path][a0:b0, k, : s_k.shape[1]] = s_k
            del logits, ins, outs, targets
    for b in layers:
        a_all, s_all = acts.pop(b.path), grads.pop(b.path)

        def make(a1: int, b1: int, a_all=a_all, s_all=s_all) -> torch.Tensor:
            # (rows, c, d_out, w): sum over tokens of s a^T, for every output
            J = torch.matmul(s_all[a1:b1].transpose(-1, -2), a_all[a1:b1, None])
            return J.reshape(b1 - a1, c, -1)

        group = kernels.group_at(b.weight)
        if group != (kernels.group_at(b.bias) if b.bias else group):
            raise AuditError(f"layer {b.path}: weight and bias in different parameter groups")  # pragma: no cover
        kernels.contract([(group, 0, b.d_out * b.width_in)], make, b.d_out * b.width_in, share)
        del a_all, s_all


def _tables_that_fit(
    engine: Engine, rows: torch.Tensor, tables: list[LinearBlock], c: int, share: int
) -> list[LinearBlock]:
    """The embedding tables whose ids and c output gradients for all rows fit ``2 * share``
    together, measured on the longest row; the others (and a table that row does not read) are
    left to :meth:`Engine.jacobian`."""
    if not tables:
        return []
    n, itemsize = rows.shape[0], engine.theta.element_size()
    with engine.context(), torch.no_grad():
        _, ins, _ = capture_activations(engine, tables, rows[engine.longest_first(rows)[:1]])
    kept, total = [], 0
    for t in tables:
        size = n * ins[t.path].numel() * (c * t.d_out * itemsize + 8) if t.path in ins else None
        if size is not None and total + size <= 2 * share:
            kept.append(t)
            total += size
    return kept


def _capture_tables(
    engine: Engine, rows: torch.Tensor, tables: list[LinearBlock], c: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{table: (ids (n, T) int64, output gradients (n, c, T, d))} over all rows, one forward and c
    backward passes per :data:`LAYER_ROWS` rows for all tables together; a position that adds
    nothing to a table's Jacobian (the ``padding_idx`` row, the tail of a shorter chunk, a chunk
    that does not read the table) has id -1 and a zero gradient."""
    n = rows.shape[0]
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {t.path: [] for t in tables}
    with engine.context(), torch.enable_grad():
        for a0, b0 in ranges(n, LAYER_ROWS):
            logits, ins, outs = capture_activations(engine, tables, rows[a0:b0])
            B = b0 - a0
            read = [t for t in tables if t.path in ins]
            ids = {t.path: ins[t.path].reshape(B, -1).long() for t in read}
            G = {
                t.path: torch.zeros(B, c, ids[t.path].shape[1], t.d_out, dtype=engine.dtype, device=engine.device)
                for t in read
            }
            for k in range(c):
                gs = torch.autograd.grad(
                    logits[:, k].sum(), [outs[t.path] for t in read], retain_graph=k + 1 < c, allow_unused=True
                )
                for t, g in zip(read, gs):
                    if g is not None:  # None: the table does not reach the outputs
                        G[t.path][:, k] = token_rows(g.detach(), B)
            for t in tables:
                if t.path not in ids:
                    parts[t.path].append(
                        (
                            torch.full((B, 1), -1, dtype=torch.long, device=engine.device),
                            torch.zeros(B, c, 1, t.d_out, dtype=engine.dtype, device=engine.device),
                        )
                    )
                    continue
                i = ids[t.path]
                if t.padding_idx is not None:
                    i = i.masked_fill(i == t.padding_idx, -1)
                parts[t.path].append((i, G[t.path].masked_fill_((i < 0)[:, None, :, None], 0.0)))
            del logits, ins, outs
    out = {}
    for t in tables:
        T = max(i.shape[1] for i, _ in parts[t.path])
        ids_all = torch.full((n, T), -1, dtype=torch.long, device=engine.device)
        s_all = torch.zeros(n, c, T, t.d_out, dtype=engine.dtype, device=engine.device)
        a0 = 0
        for i, g in parts.pop(t.path):
            ids_all[a0 : a0 + i.shape[0], : i.shape[1]] = i
            s_all[a0 : a0 + i.shape[0], :, : i.shape[1]] = g
            a0 += i.shape[0]
        out[t.path] = (ids_all, s_all)
    return out


def _contract_tables(
    engine: Engine, rows: torch.Tensor, tables: list[LinearBlock], kernels: _GroupKernels, share: int
) -> None:
    """Embedding tables: K_g += J J^T with each row's Jacobian (c, |U| d) on the union U of the ids
    the rows read, J[a, u] = sum over positions t with id_t = U[u] of s_at."""
    c = kernels.c
    captured = _capture_tables(engine, rows, tables, c)
    for t in tables:
        ids_all, s_all = captured.pop(t.path)
        used = torch.unique(ids_all[ids_all >= 0])  # sorted
        if used.numel() == 0:
            continue
        U, d = int(used.numel()), t.d_out
        # positions with id -1 carry a zero gradient: adding it to any column changes nothing
        where = torch.searchsorted(used, ids_all.clamp_min(0)).clamp_max(U - 1)

        def make(a1: int, b1: int, where=where, s_all=s_all, U=U, d=d) -> torch.Tensor:
            r = b1 - a1
            J = torch.zeros(r * c * U, d, dtype=s_all.dtype, device=s_all.device)
            base = (torch.arange(r * c, device=s_all.device) * U).view(r, c, 1)
            J.index_add_(0, (base + where[a1:b1, None, :]).reshape(-1), s_all[a1:b1].reshape(-1, d))
            return J.view(r, c, U * d)

        kernels.contract([(kernels.group_at(t.weight), 0, U * d)], make, U * d, share)
