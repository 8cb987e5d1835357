"""A causal language model's documents and loss: the rows/targets layout, the mean next-token
cross-entropy per document, and per-document gradients through the functional engine.

Truths: torch's own ``F.cross_entropy`` over each document's target tokens sliced out by hand
(no padding, no weights), and gradients of that loss taken by plain autograd on each document
alone, unpadded, against the engine's ``vmap(grad)`` over padded rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnaudit.core.engine import Engine
from attnaudit.core.lm_rows import pack_rows, split_rows, split_targets, targets_for
from attnaudit.core.task import Inputs, NextTokenLoss, Task
from attnaudit.errors import AuditError

DOCS = [[5, 3, 7, 2, 9], [4, 4, 1], [8, 2, 6, 6, 3, 1, 7], [2, 9]]
VOCAB = 11


def _padded(docs: list[list[int]], width: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(docs), width), pad, dtype=torch.long)
    attention = torch.zeros(len(docs), width, dtype=torch.long)
    for i, doc in enumerate(docs):
        ids[i, : len(doc)] = torch.tensor(doc)
        attention[i, : len(doc)] = 1
    return ids, attention


class TinyCausalLM(nn.Module):
    """Embedding + one causal softmax-attention layer + a linear head over rows [ids | attention]:
    position t attends to real positions s <= t only."""

    def __init__(self, vocab: int = VOCAB, width: int = 6, length: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.3 * torch.randn(length, width))
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        ids, attention = split_rows(rows)
        L = ids.shape[-1]
        h = self.embed(ids) + self.pos[:L]
        scores = self.q(h) @ self.k(h).transpose(-1, -2) / h.shape[-1] ** 0.5
        causal = torch.ones(L, L, dtype=torch.bool, device=rows.device).tril()
        allowed = causal & attention.unsqueeze(-2)
        scores = scores.masked_fill(~allowed, float("-inf"))
        return self.head(h + torch.softmax(scores, -1) @ self.v(h))


def test_targets_shift_the_ids_and_weigh_real_tokens_after_the_first():
    ids, attention = _padded([[5, 3, 7], [4, 1]], 4)
    next_ids, weights = split_targets(targets_for(ids, attention))
    assert next_ids.tolist() == [[3, 7, 0, 0], [1, 0, 0, 0]]
    assert weights.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    counted = torch.tensor([[False, False, True, False], [False, True, False, False]])  # completions
    assert split_targets(targets_for(ids, attention, counted))[1].tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    back_ids, back_att = split_rows(pack_rows(ids, attention))
    assert torch.equal(back_ids, ids) and torch.equal(back_att, attention.bool())


def test_the_loss_is_the_mean_cross_entropy_over_each_documents_targets():
    torch.manual_seed(1)
    ids, attention = _padded(DOCS, 9)
    logits = torch.randn(len(DOCS), 9, VOCAB, dtype=torch.float64)
    ours = NextTokenLoss().per_sample(logits, targets_for(ids, attention))
    for i, doc in enumerate(DOCS):
        n = len(doc)
        by_hand = F.cross_entropy(logits[i, : n - 1], torch.tensor(doc[1:]))
        assert float(ours[i]) == pytest.approx(float(by_hand), rel=1e-12)


def test_a_document_with_no_targets_has_zero_loss_and_bad_targets_are_refused():
    ids, attention = _padded([[5]], 3)
    logits = torch.randn(1, 3, VOCAB, dtype=torch.float64)
    assert float(NextTokenLoss().per_sample(logits, targets_for(ids, attention))) == 0.0
    with pytest.raises(AuditError, match="2L"):
        NextTokenLoss().per_sample(logits, torch.zeros(1, 5))
    with pytest.raises(AuditError, match="targets_for"):
        NextTokenLoss().targets(torch.zeros(3, dtype=torch.long), VOCAB, torch.float64)


@pytest.mark.parametrize("width", [7, 12])
def test_engine_per_document_gradients_equal_autograd_on_each_unpadded_document(width):
    model = TinyCausalLM().double()
    ids, attention = _padded(DOCS, width, pad=3)  # a pad id that is also a real token elsewhere
    X, Y = pack_rows(ids, attention), targets_for(ids, attention)
    task = Task(model, VOCAB, loss=NextTokenLoss(), inputs=Inputs())
    engine = Engine(task, dtype=torch.float64)
    assert torch.equal(engine.targets(Y), Y)  # the targets pass through whole
    G = engine.per_sample_grads(X, engine.targets(Y))
    names = [n for n, _ in model.named_parameters()]
    for i, doc in enumerate(DOCS):
        model.zero_grad()
        alone = pack_rows(torch.tensor([doc]), torch.ones(1, len(doc), dtype=torch.long))
        logits = model(alone)[0]
        F.cross_entropy(logits[:-1], torch.tensor(doc[1:])).backward()
        by_hand = torch.cat([dict(model.named_parameters())[n].grad.reshape(-1) for n in names])
        torch.testing.assert_close(G[i], by_hand, rtol=1e-10, atol=1e-12)


def test_a_later_token_does_not_move_an_earlier_positions_loss_term():
    model = TinyCausalLM().double()
    ids, attention = _padded([[5, 3, 7, 2, 9]], 5)
    changed = ids.clone()
    changed[0, 4] = 1
    with torch.no_grad():
        a, b = model(pack_rows(ids, attention)), model(pack_rows(changed, attention))
    torch.testing.assert_close(a[0, :4], b[0, :4], rtol=0, atol=0)
    assert not torch.allclose(a[0, 4], b[0, 4])
