"""A random sign projection R (P x k) that is never stored whole: its columns are drawn in
blocks from a seeded generator, one block at a time, each time it is needed.

R has independent entries +-1/sqrt(k). ``apply(G)`` gives G R for rows of per-sample
gradients G (m, P) block by block; ``columns(j0, j1)`` gives R[:, j0:j1]. The same seed and
block size give the same R everywhere (the blocks are drawn from their own generators, so a
block does not depend on which other blocks were drawn before it).

:class:`KroneckerProjection` is the projection of ``--estimator projected`` (LoGra / TRAK):
per linear layer the Kronecker product of two orthonormal seeded factors, one on the
layer's inputs and one on its output gradients, so a per-sample gradient is projected
without being formed; the tracked parameters outside linear layers go through a
:class:`SignProjection`. A weight W (V x H) shared by an ``nn.Embedding`` and a linear output head
(GPT-2's tied ``wte`` / ``lm_head``) is one layer in the head's layout (out = V, in = H): its
gradient is the sum of the head's and the table's, and P_out^T (G_head + G_table) P_in is the sum
of their projections (:attr:`LayerProjection.tied`). :func:`projection_for` lays the projection
out over an engine's tracked parameters: the linear layers K-FAC covers, the embedding tables as
linear layers on one-hot rows (:func:`embedding_modules`), tied heads (:func:`tied_heads`), the
rest by signs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from attnaudit.analyses.influence.kfac import LinearBlock, linear_modules, shared_weights
from attnaudit.analyses.request import FieldError, literal


class SignProjection:
    """R in R^{P x k}, entries +-1/sqrt(k), drawn in column blocks of ``block``."""

    def __init__(
        self,
        P: int,
        k: int,
        seed: int = 0,
        block: int = 64,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ):
        if k < 1:
            raise FieldError("proj_dim", "{name} must be >= 1, got " + literal(k))
        self.P, self.k, self.seed, self.block = int(P), int(k), int(seed), max(1, int(block))
        self.dtype, self.device = dtype, torch.device(device)

    def blocks(self) -> Iterator[tuple[int, int]]:
        for j0 in range(0, self.k, self.block):
            yield j0, min(self.k, j0 + self.block)

    def columns(self, j0: int, j1: int) -> torch.Tensor:
        """R[:, j0:j1] (P, j1 - j0); ``j0`` must start a block."""
        if j0 % self.block:
            raise ValueError("a column range must start at a block boundary")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + j0 // self.block)
        signs = torch.randint(0, 2, (self.P, j1 - j0), generator=gen, dtype=torch.int8)
        return (signs.to(self.dtype) * 2 - 1).div_(math.sqrt(self.k)).to(self.device)

    def apply(self, G: torch.Tensor) -> torch.Tensor:
        """G R for G (m, P) -> (m, k)."""
        out = torch.empty(G.shape[0], self.k, dtype=G.dtype, device=G.device)
        for j0, j1 in self.blocks():
            out[:, j0:j1] = G @ self.columns(j0, j1).to(G.dtype)
        return out


# --------------------------------------------------------------------------- LoGra / TRAK layout
def orthonormal_basis(d: int, k: int, seed: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """Q (d, k) with orthonormal columns, from the QR factorisation of a seeded Gaussian matrix
    (float64 on the CPU, then cast), or None for the identity when k >= d (no compression)."""
    if k >= d:
        return None
    gen = torch.Generator().manual_seed(int(seed))
    G = torch.randn(d, k, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)
    Q = Q * torch.sign(torch.diagonal(R))[None, :]  # a unique factor (positive diagonal of R)
    return Q.to(device=device, dtype=dtype)


@dataclass
class LayerProjection:
    """One linear layer's projection: its per-sample weight gradient G (d_out, w_in), the bias
    appended as a last input column (w_in = d_in + 1), maps to P_out^T G P_in (k_out, k_in),
    flattened row-major. ``P_in`` / ``P_out``: orthonormal columns, None for the identity."""

    block: Any  # kfac.LinearBlock (structure only)
    w_offset: int
    b_offset: int | None
    k_in: int
    k_out: int
    P_in: torch.Tensor | None
    P_out: torch.Tensor | None
    col: int  # first column of this layer in the projected vector
    # the nn.Embedding whose table is this (bias-free) head's weight (kfac.LinearBlock, source
    # "embedding"), or None: its gradient sum_t e_{id_t} g_t^T (V x H) is in the head's layout
    # already, so it adds sum_t P_out[id_t]^T (P_in^T g_t)^T to the same columns
    tied: Any = None

    @property
    def dim(self) -> int:
        return self.k_in * self.k_out


#: how ``--proj-dim`` is split between layers: ``layer`` (LoGra's: an equal share per layer,
#: square factors k_in ~ k_out) or ``params`` (in proportion to parameter counts)
PROJ_SPLITS = ("layer", "params")


def allocate(
    k: int, sizes: list[tuple[int, int]], n_other: int, split: str = "layer"
) -> tuple[list[tuple[int, int]], int]:
    """Split a total projected dimension ``k`` between linear layers (``sizes``: (w_in, d_out)
    each) and ``n_other`` remaining parameters; per layer k_in x k_out with k_in <= w_in,
    k_out <= d_out. With k >= the parameter count nothing is compressed.

    * ``layer`` (default, LoGra's layout): every layer gets the same share, as square factors
      k_out = min(d_out, floor(sqrt(share))), k_in = min(w_in, share // k_out); what a small
      layer cannot use goes to the others (water-filling). A layer's influence signal does not
      grow with its parameter count: measured on an MLP 785 -> 32 -> 10 on MNIST, k = 128,
      the proportional split gave the 330-parameter head one dimension and agreed with exact
      empirical-Fisher influence at Pearson 0.36-0.42, the equal split at 0.xx.
    * ``params``: in proportion to parameter counts, k_in / k_out close to w_in / d_out (the
      same compression on both sides).

    The other parameters get a share like a layer's (``layer``) or in proportion (``params``),
    at least 1 and at most ``n_other``, plus what the layers leave unused.
    Returns ([(k_in, k_out)], k_other); the total never exceeds max(k, len(sizes) + 1)."""
    if split not in PROJ_SPLITS:
        raise ValueError(f"unknown projection split {split!r}; use {' or '.join(PROJ_SPLITS)}")
    P = sum(w * d for w, d in sizes) + n_other
    if k >= P:
        return [(w, d) for w, d in sizes], n_other
    if split == "params":
        k_other = max(1, (k * n_other) // P) if n_other else 0
        left = max(0, k - k_other)
        P_lin = P - n_other
        out = []
        for w, d in sizes:
            kb = max(1, (left * w * d) // max(P_lin, 1))
            k_in = min(w, max(1, round(math.sqrt(kb * w / d))))
            k_out = min(d, max(1, kb // k_in))
            k_in = min(w, max(1, kb // k_out))
            out.append((k_in, k_out))
    else:
        parts = len(sizes) + (1 if n_other else 0)
        k_other = min(n_other, max(1, k // parts)) if n_other else 0
        left = max(0, k - k_other)
        out = [(0, 0)] * len(sizes)
        # water-filling: the smallest layers first, each taking at most an equal share of what is left
        order = sorted(range(len(sizes)), key=lambda i: sizes[i][0] * sizes[i][1])
        for rank, i in enumerate(order):
            w, d = sizes[i]
            share = max(1, left // (len(order) - rank))
            k_out = min(d, max(1, math.isqrt(share)))
            k_in = min(w, max(1, share // k_out))
            out[i] = (k_in, k_out)
            left = max(0, left - k_in * k_out)
    used = sum(a * b for a, b in out)
    if n_other:
        k_other = min(n_other, max(k_other, k - used))
    return out, k_other


class KroneckerProjection:
    """The projection R (P x k) of LoGra / TRAK over an engine's tracked parameters, never
    formed whole: per covered linear layer P_out (x) P_in (orthonormal, seeded per layer; an
    embedding table is a linear layer on one-hot rows, its gradient the transpose of the table's),
    the other tracked parameters through a :class:`SignProjection` (entries +-1/sqrt(k_other)).
    The projected vector is [layer 1 | layer 2 | ... | other]. ``gram()`` is R^T R
    (the identity on the layers' columns). ``tied`` maps a head block's path to the embedding
    block sharing its weight: one layer, one P_out (x) P_in, both uses' gradients summed."""

    def __init__(
        self,
        engine: Any,
        blocks: list,
        other: list[str],
        k: int,
        seed: int = 0,
        split: str = "layer",
        tied: dict[str, Any] | None = None,
    ):
        tied = tied or {}
        offsets, start = {}, 0
        for name, numel in zip(engine.names, engine.numels):
            offsets[name] = (start, numel)
            start += numel
        self.P = start
        dtype, device = engine.dtype, engine.device
        sizes = [(b.width_in, b.d_out) for b in blocks]
        self.other_names = list(other)
        other_index = [torch.arange(offsets[n][0], offsets[n][0] + offsets[n][1]) for n in other]
        self.other_index = torch.cat(other_index) if other_index else torch.zeros(0, dtype=torch.long)
        n_other = int(self.other_index.numel())
        dims, k_other = allocate(int(k), sizes, n_other, split)
        self.split = split
        self.layers: list[LayerProjection] = []
        col = 0
        for i, (b, (k_in, k_out)) in enumerate(zip(blocks, dims)):
            self.layers.append(
                LayerProjection(
                    b,
                    offsets[b.weight][0],
                    offsets[b.bias][0] if b.bias else None,
                    k_in,
                    k_out,
                    orthonormal_basis(b.width_in, k_in, seed * 1_000_003 + 2 * i + 1, dtype, device),
                    orthonormal_basis(b.d_out, k_out, seed * 1_000_003 + 2 * i + 2, dtype, device),
                    col,
                    tied.get(b.path),
                )
            )
            col += k_in * k_out
        self.other_col, self.k_other = col, k_other
        self.other: SignProjection | None = None
        if k_other and k_other < n_other:
            self.other = SignProjection(n_other, k_other, seed=seed, dtype=dtype, device=device)
        self.k = col + k_other
        self.other_index = self.other_index.to(device)
        # how the other parameters' per-sample gradients are taken (other_grads.OtherPlan), set
        # and verified by the projected estimator on the first rows it projects
        self.other_plan: Any = None
        # the embedding tables whose columns come from per-sample Jacobians (verified likewise)
        self.embedding_fallback: frozenset[str] | None = None

    def describe(self) -> dict:
        """The layout (also part of the gradient store's key): layers' [k_out, k_in], embedding
        tables, ``tied`` (head path -> the embedding sharing its weight, one layer in the head's
        layout (V, H); only when there is one, so the keys of untied models' stores stay as they were),
        the other parameters and their dimension."""
        out = {
            "layers": {p.block.path: [p.k_out, p.k_in] for p in self.layers},
            "embeddings": [p.block.path for p in self.layers if p.block.source == "embedding"],
            "other_parameters": self.other_names,
            "other_dim": self.k_other,
            "split": self.split,
        }
        tied = {p.block.path: p.tied.path for p in self.layers if p.tied is not None}
        if tied:
            out["tied"] = tied
        return out

    def project_other(self, G: torch.Tensor) -> torch.Tensor:
        """(..., n_other) -> (..., k_other)."""
        if self.other is None:
            return G
        shape = G.shape
        return self.other.apply(G.reshape(-1, shape[-1])).reshape(*shape[:-1], self.k_other)

    def project_layer(self, p: LayerProjection, G: torch.Tensor) -> torch.Tensor:
        """(..., d_out, w_in) per-sample layer gradients -> (..., k_out k_in)."""
        if p.P_in is not None:
            G = G @ p.P_in.to(G.dtype)
        if p.P_out is not None:
            G = p.P_out.to(G.dtype).T @ G
        return G.reshape(*G.shape[:-2], -1)

    def project_table(self, p: LayerProjection, G: torch.Tensor) -> torch.Tensor:
        """(..., rows x width) per-sample gradients of an embedding table in its stored layout ->
        (..., k_out k_in): transposed to the linear layout (width, rows), then projected."""
        W = G.reshape(*G.shape[:-1], p.block.d_in, p.block.d_out).transpose(-1, -2)
        return self.project_layer(p, W)

    def project_weight(self, p: LayerProjection, G: torch.Tensor) -> torch.Tensor:
        """(..., numel) per-sample gradients of layer ``p``'s weight in its stored layout (no bias)
        -> (..., k_out k_in): an embedding table's through :meth:`project_table`, a linear weight's
        (a tied head's: the shared table, (V, H) = (out, in)) reshaped to (d_out, d_in) first."""
        b = p.block
        if b.source == "embedding":
            return self.project_table(p, G)
        if b.transposed:
            return self.project_layer(p, G.reshape(*G.shape[:-1], b.d_in, b.d_out).transpose(-1, -2))
        return self.project_layer(p, G.reshape(*G.shape[:-1], b.d_out, b.d_in))

    def apply(self, G: torch.Tensor) -> torch.Tensor:
        """R^T g for every row of full gradients G (m, P) -> (m, k)."""
        m = G.shape[0]
        out = torch.empty(m, self.k, dtype=G.dtype, device=G.device)
        for p in self.layers:
            b = p.block
            if b.source == "embedding":  # stored (rows, width): the transpose of a linear weight
                out[:, p.col : p.col + p.dim] = self.project_table(p, G[:, p.w_offset : p.w_offset + b.d_out * b.d_in])
                continue
            W = G[:, p.w_offset : p.w_offset + b.d_out * b.d_in]
            # transformers' Conv1D stores (d_in, d_out), the transpose of nn.Linear's weight
            W = W.reshape(m, b.d_in, b.d_out).transpose(1, 2) if b.transposed else W.reshape(m, b.d_out, b.d_in)
            if p.b_offset is not None:
                W = torch.cat([W, G[:, p.b_offset : p.b_offset + b.d_out, None]], 2)
            out[:, p.col : p.col + p.dim] = self.project_layer(p, W)
        if self.k_other:
            out[:, self.other_col :] = self.project_other(G[:, self.other_index.to(G.device)])
        return out

    def gram(self) -> torch.Tensor:
        """R^T R (k, k), float64: the identity on the layers' columns (orthonormal factors),
        the sign projection's own Gram matrix on the other parameters' columns."""
        M = torch.eye(self.k, dtype=torch.float64)
        if self.other is not None:
            o = self.other
            Mo = torch.empty(o.k, o.k, dtype=torch.float64)
            for j0, j1 in o.blocks():
                Mo[:, j0:j1] = o.apply(o.columns(j0, j1).T.to(torch.float64)).T.cpu()
            M[self.other_col :, self.other_col :] = 0.5 * (Mo + Mo.T)
        return M

    def dense(self) -> torch.Tensor:
        """R (P, k) formed whole (tests, small P only)."""
        return self.apply(torch.eye(self.P, dtype=torch.float64))


def embedding_modules(module: torch.nn.Module, names: list[str]) -> list[LinearBlock]:
    """The ``nn.Embedding`` tables of ``module`` whose weight is tracked, as linear layers on
    one-hot rows (``source="embedding"``): a row's gradient is sum_t e_{id_t} g_t^T, so its
    projection sum_t (P_out^T g_t)(P_in[id_t])^T needs the ids and the output gradients
    only, never the (rows x width) table gradient. Left out (to the other parameters): tables
    with ``max_norm`` (the forward rewrites rows) or ``scale_grad_by_freq`` (a row's gradient
    then depends on the batch)."""
    tracked = set(names)
    out = []
    for path, sub in module.named_modules():
        if type(sub) is not torch.nn.Embedding or sub.max_norm is not None or sub.scale_grad_by_freq:
            continue
        weight = f"{path}.weight" if path else "weight"
        if weight in tracked:
            out.append(
                LinearBlock(
                    path,
                    weight,
                    None,
                    sub.num_embeddings,
                    sub.embedding_dim,
                    source="embedding",
                    padding_idx=sub.padding_idx,
                )
            )
    return out


def tied_heads(module: torch.nn.Module, names: list[str]) -> list[tuple[LinearBlock, LinearBlock]]:
    """The (head, table) pairs of ``module`` that share one tracked weight W (V x H) and nothing
    else: W is registered exactly twice, as the weight of an ``nn.Embedding`` (no ``max_norm``,
    no ``scale_grad_by_freq``) and of a bias-free ``nn.Linear`` with in = H, out = V (GPT-2's
    ``wte`` / ``lm_head``, any tied word embedding). A document's gradient of W is then
    sum_t delta_t h_t^T (head: delta_t = dl/dlogits_t, h_t its input) + sum_t e_{id_t} g_t^T (table:
    g_t = dl/d its output): both are layer gradients in the head's layout (out = V, in = H). The
    head block carries the tracked name of W (whichever of the two it is); any other sharing is
    left to :func:`~attnaudit.analyses.influence.kfac.shared_weights` (the other parameters)."""
    tracked = set(names)
    modules = dict(module.named_modules(remove_duplicate=False))
    users: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        users.setdefault(id(p), []).append(name)
    pairs: list[tuple[LinearBlock, LinearBlock]] = []
    for pnames in users.values():
        if len(pnames) != 2 or not all(n.endswith("weight") for n in pnames):
            continue
        weight = [n for n in pnames if n in tracked]
        parts = [
            (n.rpartition(".")[0], modules.get(n.rpartition(".")[0]))
            for n in pnames
            if n.rpartition(".")[2] == "weight"
        ]
        tables = [(path, m) for path, m in parts if type(m) is torch.nn.Embedding]
        heads = [(path, m) for path, m in parts if type(m) is torch.nn.Linear]
        if len(weight) != 1 or len(tables) != 1 or len(heads) != 1:
            continue
        (t_path, table), (h_path, head) = tables[0], heads[0]
        assert isinstance(table, torch.nn.Embedding) and isinstance(head, torch.nn.Linear)  # by type above
        if table.max_norm is not None or table.scale_grad_by_freq or head.bias is not None:
            continue
        V, H = table.num_embeddings, table.embedding_dim
        if (head.out_features, head.in_features) != (V, H):
            continue
        pairs.append(
            (
                LinearBlock(h_path, weight[0], None, H, V),
                LinearBlock(t_path, weight[0], None, V, H, source="embedding", padding_idx=table.padding_idx),
            )
        )
    return pairs


def projection_for(engine: Any, k: int, seed: int = 0, split: str = "layer") -> KroneckerProjection:
    """The projection of ``engine``'s tracked parameters: the linear layers K-FAC covers and the
    embedding tables (:func:`embedding_modules`), the rest signs; ``split`` shares k between layers
    (:func:`~attnaudit.analyses.influence.projection.allocate`). A table tied to a linear output
    head (:func:`tied_heads`) is one layer in the head's layout whose columns sum both uses; a
    weight shared any other way goes with the other parameters."""
    pairs = tied_heads(engine.module, engine.names)
    paired = {head.weight for head, _ in pairs}
    blocks, _ = linear_modules(engine.module, engine.names)
    blocks += embedding_modules(engine.module, engine.names)
    blocks = [b for b in blocks if b.weight not in paired]
    tied = set(shared_weights(engine.module, blocks)) - paired
    blocks = [b for b in blocks if b.weight not in tied and (b.bias is None or b.bias not in tied)]
    blocks += [head for head, _ in pairs]
    covered = {b.weight for b in blocks} | {b.bias for b in blocks if b.bias}
    other = [n for n in engine.names if n not in covered]
    tables = {head.path: table for head, table in pairs}
    return KroneckerProjection(engine, blocks, other, k, seed=seed, split=split, tied=tables)
