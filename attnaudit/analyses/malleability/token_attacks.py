"""Discrete attacks on text: gradient-guided token swaps (HotFlip-style) and the random control.

A training text is a row of token ids; its perturbation swaps at most ``budget`` tokens.
For a model that maps input embeddings e (L, h) to logits, the loss change of replacing the
token at position p by token v is, to first order (Ebrahimi et al. 2018),

    Delta L(p, v) ~ (E[v] - E[ids[p]]) . dL/de_p ,

computed for every position and vocabulary entry at once from one backward pass. The
``candidates`` best estimates are then *verified* by forward passes and the swap that raises
the true loss most is applied (none when no candidate raises it); repeated ``budget``
times, never at the same position twice. Protected ids (special tokens, padding) are never
changed and never inserted. The random control spends the same budget on random positions
and random allowed tokens.

The model is given as ``logits_of(embeds, ids)`` (embeds (n, L, h), the ids they came from,
for the attention mask) and its input embedding matrix ``E`` (V, h); it is evaluated, never
trained or changed. :func:`hf_embedding_model` builds both for a Hugging Face sequence
classifier loaded by attnaudit (``inputs_embeds`` with the padding mask).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from attnaudit.core.engine import saved_tensor_bytes
from attnaudit.core.task import eval_mode
from attnaudit.errors import AuditError

LogitsOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TokenAttackConfig:
    """``budget``: tokens swapped per text; ``candidates``: first-order best swaps verified by a
    forward pass at each step; ``protected``: ids never changed or inserted."""

    budget: int = 1
    candidates: int = 8
    protected: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise AuditError(f"the token budget must be a positive integer, got {self.budget!r}")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 1:
            raise AuditError(f"candidates must be a positive integer, got {self.candidates!r}")


@dataclass
class TokenAttackResult:
    """The perturbed ids, each row's swaps (position, old id, new id) and its loss before/after."""

    ids: torch.Tensor
    swaps: list[list[tuple[int, int, int]]]
    loss_before: torch.Tensor
    loss_after: torch.Tensor
    notes: list[str] = field(default_factory=list)


def _per_sample_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, y, reduction="none")


def _editable(ids: torch.Tensor, protected: Sequence[int]) -> torch.Tensor:
    mask = torch.ones_like(ids, dtype=torch.bool)
    for t in protected:
        mask &= ids != t
    return mask


def protected_ids(ids: torch.Tensor, pad: int | None) -> tuple[int, ...]:
    """The ids no text attack changes or inserts: padding, and the special token every row
    starts with ([CLS] / <s>) and the one every row's last real token is ([SEP] / </s>),
    when all rows agree on it."""
    ids = ids.long()
    protected: set[int] = {pad} if pad is not None else set()
    first = torch.unique(ids[:, 0])
    if first.numel() == 1:
        protected.add(int(first))
    lengths = (ids != pad).sum(1) if pad is not None else torch.full((ids.shape[0],), int(ids.shape[1]))
    last = torch.unique(ids[torch.arange(ids.shape[0]), (lengths - 1).clamp(min=0)])
    if last.numel() == 1:
        protected.add(int(last))
    return tuple(sorted(protected))


def hotflip_bytes_per_row(
    logits_of: LogitsOf, E: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, weights: Iterable[torch.Tensor] = ()
) -> int:
    """Bytes one text takes in a hotflip step: the (L, V) first-order gains (and the same again
    for the masking and top-k over them) plus autograd's saved tensors for its embedding
    gradient, measured on two texts (``E`` and the model's ``weights``, saved once, not counted)."""
    probe = ids[:2].long()
    embeds = E.detach()[probe].clone().requires_grad_(True)
    saved = saved_tensor_bytes(lambda: _per_sample_ce(logits_of(embeds, probe), y[:2].long()).sum(), (E, *weights))
    gains = 2 * ids.shape[1] * E.shape[0] * E.element_size()
    return int(gains + saved / probe.shape[0])


def hotflip(
    logits_of: LogitsOf,
    E: torch.Tensor,
    ids: torch.Tensor,
    y: torch.Tensor,
    config: TokenAttackConfig,
    rows_per_chunk: int | None = None,
    order: torch.Tensor | None = None,
) -> TokenAttackResult:
    """Greedy, verified first-order token swaps raising each row's cross-entropy (see the module docstring).

    ``rows_per_chunk``: texts attacked at once (default all); ``order``: a permutation of the
    rows that chunks follow (neighbours in length, so a model that drops trailing padding
    runs each chunk at its own longest text). The texts are independent (eval mode), so the
    result depends on neither, and memory is one chunk's graph and its (rows, L, V) gains."""
    if ids.ndim != 2 or y.shape[0] != ids.shape[0]:
        raise AuditError(f"hotflip takes ids (n, L) and labels (n,), got {tuple(ids.shape)} and {tuple(y.shape)}")
    n = ids.shape[0]
    size = rows_per_chunk if rows_per_chunk is not None and 0 < rows_per_chunk < n else n
    if size == n and order is None:
        return _hotflip_rows(logits_of, E, ids, y, config)
    index = torch.arange(n, device=ids.device) if order is None else order.to(ids.device)
    out_ids = ids.clone().long()
    swaps: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    before = after = None
    for a in range(0, n, size):
        rows = index[a : a + size]
        part = _hotflip_rows(logits_of, E, ids[rows], y[rows], config)
        if before is None or after is None:
            before = torch.empty(n, dtype=part.loss_before.dtype, device=part.loss_before.device)
            after = torch.empty_like(before)
        out_ids[rows], before[rows], after[rows] = part.ids, part.loss_before, part.loss_after
        for i, row_swaps in zip(rows.tolist(), part.swaps):
            swaps[i] = row_swaps
    assert before is not None and after is not None  # n >= 1 rows were attacked
    return TokenAttackResult(ids=out_ids, swaps=swaps, loss_before=before, loss_after=after)


def _hotflip_rows(
    logits_of: LogitsOf, E: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, config: TokenAttackConfig
) -> TokenAttackResult:
    E = E.detach()
    V = E.shape[0]
    ids = ids.clone().long()
    y = y.long()
    allowed = torch.ones(V, dtype=torch.bool, device=E.device)
    for t in config.protected:
        if 0 <= t < V:
            allowed[t] = False
    editable = _editable(ids, config.protected)
    with torch.no_grad():
        before = _per_sample_ce(logits_of(E[ids], ids), y)
    current = before.clone()
    swaps: list[list[tuple[int, int, int]]] = [[] for _ in range(ids.shape[0])]
    n, L = ids.shape
    for _ in range(config.budget):
        embeds = E[ids].clone().requires_grad_(True)
        loss = _per_sample_ce(logits_of(embeds, ids), y).sum()
        (g,) = torch.autograd.grad(loss, embeds)  # rows are independent in eval mode: row i's own gradient
        with torch.no_grad():
            gain = g @ E.T - (g * embeds).sum(-1, keepdim=True)  # (n, L, V) first-order loss change
            gain[~editable] = -torch.inf
            gain[:, :, ~allowed] = -torch.inf
            gain.scatter_(2, ids.unsqueeze(-1), -torch.inf)  # v == the current token
            k = min(config.candidates, L * V)
            best = gain.reshape(n, -1).topk(k, dim=1)
            trial_loss = torch.full((n, k), -torch.inf, dtype=before.dtype, device=before.device)
            for j in range(k):
                flat = best.indices[:, j]
                pos, tok = flat // V, flat % V
                valid = torch.isfinite(best.values[:, j])
                trial = ids.clone()
                trial[torch.arange(n), pos] = tok
                losses = _per_sample_ce(logits_of(E[trial], trial), y)
                trial_loss[:, j] = torch.where(valid, losses, torch.full_like(losses, -torch.inf))
            if not keep_best_swaps(best.indices, trial_loss, current, ids, editable, swaps, V):
                break
    return TokenAttackResult(ids=ids, swaps=swaps, loss_before=before, loss_after=current)


def swap_at_random(
    ids: torch.Tensor, editable: torch.Tensor, allowed: torch.Tensor, budget: int, generator: torch.Generator
) -> list[list[tuple[int, int, int]]]:
    """Set ``budget`` random ``editable`` positions of each row of ``ids`` (in place) to a random
    ``allowed`` token other than the current one; the swaps (position, old, new) per row. The
    generator draws the positions of a row, then one token per position, row after row."""
    swaps: list[list[tuple[int, int, int]]] = []
    for i in range(ids.shape[0]):
        positions = torch.nonzero(editable[i]).flatten()
        order = positions[torch.randperm(positions.numel(), generator=generator)][:budget]
        row: list[tuple[int, int, int]] = []
        for pos in order.tolist():
            old = int(ids[i, pos])
            choices = allowed[allowed != old]
            new = int(choices[torch.randint(choices.numel(), (1,), generator=generator)])
            ids[i, pos] = new
            row.append((pos, old, new))
        swaps.append(row)
    return swaps


def random_swaps(
    ids: torch.Tensor, vocab_size: int, config: TokenAttackConfig, generator: torch.Generator
) -> TokenAttackResult:
    """The control: ``budget`` random editable positions per row, each set to a random allowed
    token other than the current one (same budget as :func:`hotflip`, no gradient)."""
    ids = ids.clone().long()
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(config.protected)], dtype=torch.long)
    if allowed.numel() < 2:
        raise AuditError("random token swaps need at least two unprotected tokens in the vocabulary")
    swaps = swap_at_random(ids, _editable(ids, config.protected), allowed, config.budget, generator)
    nan = torch.full((ids.shape[0],), float("nan"))
    return TokenAttackResult(ids=ids, swaps=swaps, loss_before=nan, loss_after=nan)


def hf_embedding_model(
    module: nn.Module, pad_token_id: int | None, trim_padding: bool = False
) -> tuple[LogitsOf, torch.Tensor]:
    """``(logits_of, E)`` for a Hugging Face sequence classifier (the transformers model, or
    attnaudit's wrapper holding it as ``.model``): fed ``inputs_embeds`` with the padding
    mask ``ids != pad``, evaluated in eval mode. ``trim_padding``: columns that are padding in
    every row are dropped first (only for a model checked not to read padding, see
    :class:`attnaudit.models.hf.HFSequenceClassifier`): the embedding gradient there is zero,
    as it is through the mask."""
    from attnaudit.models.hf import kept_columns

    model = getattr(module, "model", module)
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        raise AuditError(f"{type(model).__name__} has no input embeddings (get_input_embeddings)")
    E = get().weight.detach()

    def logits_of(embeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kept = kept_columns(ids, pad_token_id) if trim_padding else None
        if kept is not None:
            embeds, ids = embeds[:, :kept], ids[:, :kept]
        mask = None if pad_token_id is None else (ids != pad_token_id).long()
        with eval_mode(model):  # no dropout; the caller's training flags are restored
            return model(inputs_embeds=embeds, attention_mask=mask).logits

    return logits_of, E


def keep_best_swaps(
    candidates: torch.Tensor,
    trial_loss: torch.Tensor,
    current: torch.Tensor,
    ids: torch.Tensor,
    editable: torch.Tensor,
    swaps: list[list[tuple[int, int, int]]],
    vocabulary: int,
) -> bool:
    """One greedy step of HotFlip: each row takes its verified candidate of highest loss when that
    raises its loss (``candidates`` (n, k): flat indices position * V + token; ``trial_loss`` (n, k):
    the loss each would give). Updates ``ids``, ``editable`` (a swapped position is not swapped
    again), ``swaps`` (position, old, new) and ``current`` in place; False when no row gained."""
    rows = torch.arange(ids.shape[0], device=trial_loss.device)
    pick = trial_loss.argmax(dim=1)
    gained = trial_loss[rows, pick] > current
    if not bool(gained.any()):
        return False
    for i in torch.nonzero(gained).flatten().tolist():
        chosen = int(candidates[i, pick[i]])
        at, new = chosen // vocabulary, chosen % vocabulary
        swaps[i].append((at, int(ids[i, at]), new))
        ids[i, at] = new
        editable[i, at] = False
        current[i] = trial_loss[i, pick[i]]
    return True
