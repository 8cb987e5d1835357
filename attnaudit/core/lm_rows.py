"""The rows and targets of a causal language model's documents.

One row per document, padded on the right to a common length L:

* rows ``X`` (n, 2L) = [ids | attention]: the token ids (small integers, exact in float32 and
  float64) and 1.0 for a real token, 0.0 for padding. The attention block, never the id, says
  what is padding (GPT-2 pads with its end-of-text id, which is also a real token).
* targets ``Y`` (n, 2L) = [next ids | weights]: ``next[t] = ids[t + 1]`` (0 past the end) and
  ``weight[t] = 1.0`` when the token at t + 1 is real and counts in the loss (with a
  prompt/completion split only completion tokens count), else 0.0. Position t's logits
  predict ``next[t]``.

Both are float tensors so that they travel through every row-wise operation of the analyses
(subsets, chunks, per-sample maps) like the rows and one-hot targets of a classifier.
"""

from __future__ import annotations

import torch

from attnaudit.errors import AuditError


def _halves(T: torch.Tensor, what: str) -> int:
    if T.ndim < 1 or T.shape[-1] % 2:
        raise AuditError(f"{what} of a language model have an even number of columns (2L), got shape {tuple(T.shape)}")
    return int(T.shape[-1] // 2)


def pack_rows(ids: torch.Tensor, attention: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """X (n, 2L) from token ids (n, L) and the attention mask (n, L; nonzero: a real token)."""
    if ids.shape != attention.shape or ids.ndim != 2:
        raise AuditError(f"ids and attention must both be (n, L), got {tuple(ids.shape)} and {tuple(attention.shape)}")
    return torch.cat([ids.to(dtype), (attention != 0).to(dtype)], dim=1)


def split_rows(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids long (..., L), attention bool (..., L)) of rows X (..., 2L)."""
    L = _halves(X, "rows")
    return X[..., :L].round().long(), X[..., L:] > 0.5


def pack_targets(next_ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Y (n, 2L) from the next-token ids (n, L) and the loss weights (n, L)."""
    if next_ids.shape != weights.shape or next_ids.ndim != 2:
        raise AuditError(
            f"next ids and weights must both be (n, L), got {tuple(next_ids.shape)} and {tuple(weights.shape)}"
        )
    return torch.cat([next_ids.to(dtype), weights.to(dtype)], dim=1)


def split_targets(Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next ids long (..., L), weights (..., L) in Y's dtype) of targets Y (..., 2L)."""
    L = _halves(Y, "targets")
    return Y[..., :L].round().long(), Y[..., L:]


def targets_for(ids: torch.Tensor, attention: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """Y (n, 2L) for documents ``ids`` (n, L) with ``attention`` (n, L): every real token after the
    first is a target, or only those where ``counted`` (n, L, bool) is True (a completion)."""
    real = attention != 0
    if counted is not None:
        if counted.shape != ids.shape:
            raise AuditError(f"counted must be (n, L) like the ids, got {tuple(counted.shape)}")
        real = real & counted.bool()
    next_ids = torch.zeros_like(ids, dtype=torch.long)
    next_ids[:, :-1] = ids[:, 1:].long()
    weights = torch.zeros(ids.shape, dtype=torch.float64)
    weights[:, :-1] = real[:, 1:].to(torch.float64)
    return pack_targets(next_ids, weights)


def widen(T: torch.Tensor, L: int) -> torch.Tensor:
    """Rows or targets (n, 2L0) of documents padded on the right to (n, 2L), L >= L0: both halves get
    zero columns (padding ids, attention 0; next ids 0, weight 0), so nothing real changes."""
    L0 = _halves(T, "rows")
    if L < L0:
        raise AuditError(f"cannot narrow documents of {L0} positions to {L}")
    if L == L0:
        return T
    pad = T.new_zeros(*T.shape[:-1], L - L0)
    return torch.cat([T[..., :L0], pad, T[..., L0:], pad], dim=-1)
