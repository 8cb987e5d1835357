"""Attacks on a causal language model's training documents: token swaps and embedding shifts.

A document is a row [ids | attention] (:mod:`attnaudit.core.lm_rows`, or
[ids | attention | delta] for :class:`~attnaudit.models.hf_causal.HFCausalLMShift`) with
targets [next ids | weights]. Every attack maximises the document's own next-token loss
l(ids) = sum_t w_t CE(f_t(ids), ids_{t+1}) / max(1, sum_t w_t); padding (the attention block
says where) and the config's BOS/EOS/pad ids are never changed and never inserted.

* ``hotflip``: greedy, verified token swaps (Ebrahimi et al. 2018). A swap at position p to
  token v changes the input embedding at p *and* the target of position p - 1 (the next id
  is the token itself). Its estimated gain is the first-order input term
  (E[v] - E[ids_p]) . dl/de_p plus the exact target term
  w_{p-1} / W (log p_{p-1}(ids_p) - log p_{p-1}(v)) (position p - 1's logits read tokens
  before p only, so the swap does not change them). The ``candidates`` best estimates are
  verified by forward passes on the perturbed document with its targets rebuilt, and the
  swap raising the true loss most is applied (none when none raises it); ``budget`` times,
  never at the same position twice.
* ``swap``: the control, ``budget`` random editable positions set to random allowed tokens.
* ``fgsm``/``pgd``/``mim``/``sign``/``random``/``none``: shifts of the input embeddings with a
  radius relative to each token's embedding norm (:mod:`.embedding_attacks`); the targets
  do not change.

After a swap the targets are rebuilt from the perturbed ids with the same counted mask
(:func:`attnaudit.core.lm_rows.targets_for`): which positions count is unchanged, the next
ids are the new tokens. The model is evaluated in eval mode, never trained or changed;
randomness comes from a CPU generator seeded with the attack's seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attnaudit.analyses.malleability.token_attacks import keep_best_swaps, swap_at_random
from attnaudit.core.lm_rows import pack_rows, split_rows, split_targets, targets_for
from attnaudit.core.task import NextTokenLoss, Task, eval_mode
from attnaudit.analyses.malleability.attack_config import TOKEN_ATTACKS, AttackConfig, AttackResult
from attnaudit.errors import AuditError
from attnaudit.models.hf_causal import HFCausalLM, HFCausalLMShift, causal_shift_rows


#: bytes a hotflip step may hold per chunk for its (rows, L, V) gains and log-probabilities
#: when the attack has no memory budget
HOTFLIP_BYTES = 256 * 2**20


def is_language_model(model) -> bool:
    """Whether ``model`` (a Task or module) is a causal language model fed document rows."""
    return isinstance(model.module if isinstance(model, Task) else model, HFCausalLM)


@dataclass
class Documents:
    """Training documents split into their parts: ids (n, L), attention (n, L, bool), counted
    (n, L, bool: the token at t is a target), the embedding shifts rows hold (None for plain rows)."""

    ids: torch.Tensor
    attention: torch.Tensor
    counted: torch.Tensor
    shift: torch.Tensor | None

    @classmethod
    def of(cls, module: HFCausalLM, X: torch.Tensor, y: torch.Tensor) -> Documents:
        if isinstance(module, HFCausalLMShift):
            ids, attention, shift = module.split_shift(X)
        else:
            (ids, attention), shift = split_rows(X), None
        weights = split_targets(y)[1]
        counted = torch.zeros_like(attention)
        counted[:, 1:] = weights[:, :-1] > 0.5  # weight[t] > 0: the token at t + 1 counts
        return cls(ids, attention, counted, shift)

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        """Targets (n, 2L) of the documents with tokens ``ids``: same counted mask, next ids rebuilt."""
        return targets_for(ids.cpu(), self.attention.cpu(), self.counted.cpu()).to(ids.device)

    def rows(self, module: HFCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """The model's rows for tokens ``ids`` (the shifts, if any, kept)."""
        if isinstance(module, HFCausalLMShift):
            return causal_shift_rows(ids, self.attention, module.hidden, self.shift)
        return pack_rows(ids, self.attention)


def editable(docs: Documents, protected: tuple[int, ...]) -> torch.Tensor:
    """(n, L) bool: the real tokens an attack may change (not padding, not a protected id)."""
    keep = docs.attention.clone()
    for t in protected:
        keep &= docs.ids != t
    return keep


def document_losses(module: HFCausalLM, ids, attention, targets, shift=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-document next-token losses (n,), logits (n, L, V)) in eval mode."""
    with eval_mode(module):
        logits = module.run(ids, attention, shift)
    return NextTokenLoss().per_sample(logits, targets.to(logits.dtype)), logits


def lm_hotflip(
    module: HFCausalLM,
    docs: Documents,
    budget: int,
    *,
    candidates: int = 8,
    rows_per_chunk: int | None = None,
) -> tuple[torch.Tensor, list[list[tuple[int, int, int]]]]:
    """(perturbed ids (n, L), each document's swaps (position, old id, new id)): greedy verified
    swaps raising each document's next-token loss (module docstring), ``rows_per_chunk``
    documents at a time (default: as many as :data:`HOTFLIP_BYTES` holds)."""
    E = module.model.get_input_embeddings().weight.detach()  # type: ignore[operator]  # transformers' method
    n, L = docs.ids.shape
    V = int(E.shape[0])
    protected = module.special_ids()
    size = rows_per_chunk or max(1, HOTFLIP_BYTES // max(1, 3 * L * V * E.element_size()))
    out = docs.ids.clone()
    swaps: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    allowed = torch.ones(V, dtype=torch.bool, device=E.device)
    allowed[list(protected)] = False
    editable_all = editable(docs, protected)
    for a in range(0, n, size):
        b = min(n, a + size)
        part = Documents(
            docs.ids[a:b], docs.attention[a:b], docs.counted[a:b], None if docs.shift is None else docs.shift[a:b]
        )
        ids, done = _hotflip_chunk(module, E, part, editable_all[a:b].clone(), allowed, budget, candidates)
        out[a:b] = ids
        for i, row in enumerate(done):
            swaps[a + i] = row
    return out, swaps


def _hotflip_chunk(
    module: HFCausalLM,
    E: torch.Tensor,
    docs: Documents,
    can_edit: torch.Tensor,
    allowed: torch.Tensor,
    budget: int,
    candidates: int,
) -> tuple[torch.Tensor, list[list[tuple[int, int, int]]]]:
    ids, att = docs.ids.clone(), docs.attention
    n, L = ids.shape
    V = int(E.shape[0])
    base = torch.zeros(n, L, E.shape[1], dtype=E.dtype, device=E.device) if docs.shift is None else docs.shift
    weights = split_targets(docs.targets(ids))[1].to(E.dtype)
    share = weights / weights.sum(-1, keepdim=True).clamp(min=1.0)  # w_t / W: a position's part of the loss
    with torch.no_grad():
        current = document_losses(module, ids, att, docs.targets(ids), base)[0]
    swaps: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    rows = torch.arange(n, device=ids.device)
    for _ in range(budget):
        shift = base.detach().clone().requires_grad_(True)
        loss, logits = document_losses(module, ids, att, docs.targets(ids), shift)
        (g,) = torch.autograd.grad(loss.sum(), shift)  # documents are independent in eval mode
        with torch.no_grad():
            gain = g @ E.T - (g * E[ids]).sum(-1, keepdim=True)  # (n, L, V): first-order input term
            log_p = torch.log_softmax(logits.detach(), dim=-1)[:, :-1]  # position p - 1 predicts token p
            now = log_p.gather(-1, ids[:, 1:].unsqueeze(-1))
            gain[:, 1:] += share[:, :-1].unsqueeze(-1) * (now - log_p)  # exact target term
            del log_p
            gain[~can_edit] = -torch.inf
            gain[:, :, ~allowed] = -torch.inf
            gain.scatter_(2, ids.unsqueeze(-1), -torch.inf)  # v == the current token
            best = gain.reshape(n, -1).topk(min(candidates, L * V), dim=1)
            del gain
            trial_loss = torch.full(best.values.shape, -torch.inf, dtype=current.dtype, device=current.device)
            for j in range(best.values.shape[1]):
                pos, tok = best.indices[:, j] // V, best.indices[:, j] % V
                trial = ids.clone()
                trial[rows, pos] = tok
                losses = document_losses(module, trial, att, docs.targets(trial), base)[0]
                trial_loss[:, j] = torch.where(torch.isfinite(best.values[:, j]), losses, -torch.inf)
            if not keep_best_swaps(best.indices, trial_loss, current, ids, can_edit, swaps, V):
                break
    return ids, swaps


def lm_random_swaps(
    module: HFCausalLM, docs: Documents, budget: int, generator: torch.Generator
) -> tuple[torch.Tensor, list[list[tuple[int, int, int]]]]:
    """The control: ``budget`` random editable positions per document, each set to a random
    allowed token other than the current one (the same budget as :func:`lm_hotflip`)."""
    protected = set(module.special_ids())
    allowed = torch.tensor([t for t in range(module.vocab_size) if t not in protected], dtype=torch.long)
    if allowed.numel() < 2:
        raise AuditError("random token swaps need at least two tokens outside the special ids in the vocabulary")
    ids = docs.ids.clone()
    swaps = swap_at_random(ids, editable(docs, tuple(protected)).cpu(), allowed, budget, generator)
    return ids, swaps


#: bytes of logits and their exponentials' copy (sized as float64) one evaluation chunk may hold: GPT-2's
#: 50,257 words over 256 positions take 103 MB a document, so the chunk is a few documents, never all
EVAL_LOGIT_BYTES = 512 * 2**20


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next-token negative log-likelihood of every position (n, L), float64; the loss weights (n, L))
    of logits (n, L, V) against targets (n, 2L): nll_t = logsumexp(f_t) - f_t[next_t].

    Float64 logits are reduced in float64. Lower-precision logits are not copied to float64 (over
    GPT-2's 50,257 words that copy and its exponentials cost as much as a third of a forward pass):
    exp(f - max f) and its sum over the vocabulary are taken in float32 (terms in [0, 1], summed
    blockwise), the logarithm, the max and the picked logit added in float64. The error this adds,
    about 2e-7 on values near 10, is below the rounding of the float32 logits themselves (6e-8
    relative each)."""
    L = logits.shape[-2]
    next_ids, weights = targets[..., :L].round().long(), targets[..., L:].to(torch.float64)
    if logits.dtype != torch.float64:
        logits = logits.float()  # bfloat16 exponentials would lose 3 digits
    picked = logits.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1).to(torch.float64)
    if logits.dtype == torch.float64:
        return torch.logsumexp(logits, -1) - picked, weights
    top = logits.amax(-1, keepdim=True)
    mass = torch.exp(logits - top).sum(-1)  # in [1, V]: the largest term is exp(0)
    return top.squeeze(-1).to(torch.float64) + mass.to(torch.float64).log() - picked, weights


def corpus_perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(sum_i sum_t w_it CE_it / sum_i sum_t w_it): the perplexity of the counted tokens of all
    documents together (token-weighted, unlike the mean of the per-document losses)."""
    nll, weights = token_nll(logits, targets)
    total = float(weights.sum())
    return math.exp(float((weights * nll).sum()) / total) if total > 0 else float("nan")


def evaluate_documents(task: Task, X: torch.Tensor, y: torch.Tensor, chunk: int = 64) -> tuple[float, float]:
    """(mean per-document next-token loss, corpus perplexity) of ``task`` on documents (X, y), at most
    ``chunk`` documents per forward pass and fewer when their logits would pass :data:`EVAL_LOGIT_BYTES`
    (only the sums are kept, never the logits of every document)."""
    L = X.shape[-1] // 2
    rows = max(1, min(chunk, EVAL_LOGIT_BYTES // max(1, 2 * 8 * L * task.n_classes)))
    losses, nll_sum, weight_sum = [], 0.0, 0.0
    with torch.no_grad():
        for a in range(0, X.shape[0], rows):
            logits = task.logits(X[a : a + rows])
            nll, weights = token_nll(logits, y[a : a + rows].to(device=logits.device, dtype=torch.float64))
            losses.append((weights * nll).sum(-1) / weights.sum(-1).clamp(min=1.0))
            nll_sum += float((weights * nll).sum())
            weight_sum += float(weights.sum())
    mean_loss = float(torch.cat(losses).mean()) if losses else float("nan")
    return mean_loss, math.exp(nll_sum / weight_sum) if weight_sum > 0 else float("nan")


def documents_summary(losses: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean per-document loss, corpus perplexity) from each document's loss l_i (the mean over its
    counted tokens, :class:`~attnaudit.core.task.NextTokenLoss`) and its targets y (n, 2L): a
    document's summed token loss is l_i max(1, W_i) with W_i its summed token weights (l_i = 0 when
    W_i = 0), so the perplexity exp(sum_i l_i max(1, W_i) / sum_i W_i) is :func:`evaluate_documents`'
    from losses a forward pass already gave (the static protocol's influence runs)."""
    L = y.shape[-1] // 2
    weights = y[:, L:].to(device="cpu", dtype=torch.float64).sum(-1)
    per_doc = losses.to(device="cpu", dtype=torch.float64)
    if per_doc.shape != weights.shape:
        raise AuditError(f"{per_doc.numel()} document losses for {weights.numel()} documents")
    total = float(weights.sum())
    perplexity = math.exp(float((per_doc * weights.clamp(min=1.0)).sum()) / total) if total > 0 else float("nan")
    return (float(per_doc.mean()) if per_doc.numel() else float("nan")), perplexity


def perturb_documents(
    task: Task,
    X: torch.Tensor,
    y: torch.Tensor,
    config: AttackConfig,
    evaluate: bool,
    before: tuple[float, float] | None = None,
    after: bool = True,
) -> AttackResult:
    """Perturb every training document of a causal language model (module docstring): the rows,
    and for token swaps the rebuilt targets (``y_adv``); loss and perplexity before and after
    when ``evaluate`` (before: ``before`` when given, the caller's measurement of the same model
    on (X, y): a forward pass over every document saved per attack; after: None without
    ``after``, for a caller that takes them from its own pass over the perturbed documents);
    accuracies stay None (a language model has none)."""
    from attnaudit.analyses.malleability.embedding_attacks import EMBEDDING_ATTACKS, perturb_embeddings
    from attnaudit.analyses.request import FieldError

    module = task.module
    assert isinstance(module, HFCausalLM)
    y_adv = None
    sizes: dict[str, Any] = {}
    if config.method in TOKEN_ATTACKS:
        if config.eps != round(config.eps) or config.eps < 1:
            raise FieldError(
                "eps",
                f"with the {config.method} attack, " + "{name} is the number of tokens swapped per document: give an "
                f"integer >= 1, got {config.eps:g}",
            )
        docs = Documents.of(module, X, y)
        budget = int(round(config.eps))
        if config.method == "hotflip":
            ids, _ = lm_hotflip(module, docs, budget)
        else:
            ids, _ = lm_random_swaps(module, docs, budget, torch.Generator().manual_seed(int(config.seed)))
        X_adv = docs.rows(module, ids).to(device=X.device, dtype=X.dtype)
        y_adv = docs.targets(ids).to(device=y.device, dtype=y.dtype)
        changed = (ids != docs.ids).sum(1).double()
        sizes = {"radius_mean": float(changed.mean()), "radius_max": float(changed.max())}
    else:
        if config.method not in EMBEDDING_ATTACKS:
            raise AuditError(
                f"the {config.method} attack does not apply to a language model; use fgsm, pgd, mim, sign, random, "
                "hotflip, swap or none"
            )
        if not isinstance(module, HFCausalLMShift):
            raise AuditError(f"the {config.method} attack shifts embeddings; feed the model HFCausalLMShift rows")
        if config.clip_min is not None:
            raise AuditError("embeddings have no valid value range; give no clip_min/clip_max for a language model")
        outcome = perturb_embeddings(task, X, y, **config.embedding_settings())
        X_adv = outcome.rows
        with torch.no_grad():
            delta = (module.split_shift(X_adv)[2] - module.split_shift(X)[2]).reshape(X.shape[0], -1)
            linf, l2 = delta.abs().amax(1), delta.norm(dim=1)
        rel = outcome.relative_radius
        sizes = {
            "radius_mean": float(rel.mean()),
            "radius_max": float(rel.max()),
            "linf_mean": float(linf.mean()),
            "linf_max": float(linf.max()),
            "l2_mean": float(l2.mean()),
            "l2_max": float(l2.max()),
        }
    none = dict.fromkeys(("loss_before", "loss_after", "accuracy_before", "accuracy_after"))
    if not evaluate:
        return AttackResult(X_adv=X_adv, config=config, **none, y_adv=y_adv)
    loss_before, ppl_before = evaluate_documents(task, X, y) if before is None else before
    loss_after, ppl_after = evaluate_documents(task, X_adv, y if y_adv is None else y_adv) if after else (None, None)
    return AttackResult(
        X_adv=X_adv,
        config=config,
        loss_before=loss_before,
        loss_after=loss_after,
        accuracy_before=None,
        accuracy_after=None,
        y_adv=y_adv,
        perplexity_before=ppl_before,
        perplexity_after=ppl_after,
        **sizes,
    )
