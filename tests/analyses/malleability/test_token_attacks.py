"""Gradient-guided token swaps (HotFlip-style) and the random control.

Truths: forward passes over every single-token swap (exhaustive), the ids as given."""

from __future__ import annotations

import pytest
import torch

from attnaudit.analyses.malleability.token_attacks import (
    TokenAttackConfig,
    hf_embedding_model,
    hotflip,
    hotflip_bytes_per_row,
    random_swaps,
)
from attnaudit.errors import AuditError
from hf_models import tiny_bert

transformers = pytest.importorskip("transformers")

PAD, CLS, SEP = 0, 1, 2


@pytest.fixture(scope="module")
def bert():
    return tiny_bert(12, pad_token_id=PAD).double().train()  # train(): the attack must not care


def _data(n=6, L=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 12, (n, L), generator=g)
    ids[:, 0], ids[:, -1] = CLS, SEP
    ids[0, -3:-1] = PAD  # a padded row
    ids[0, -1] = SEP
    y = torch.randint(0, 3, (n,), generator=g)
    return ids, y


def _loss(logits_of, E, ids, y):
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(logits_of(E[ids], ids), y, reduction="none")


def test_exhaustive_verification_finds_the_best_single_swap(bert):
    logits_of, E = hf_embedding_model(bert, PAD)
    ids, y = _data()
    protected = (PAD, CLS, SEP)
    res = hotflip(logits_of, E, ids, y, TokenAttackConfig(budget=1, candidates=10_000, protected=protected))
    for i in range(ids.shape[0]):  # brute force: every editable position, every allowed token
        best = _loss(logits_of, E, ids[i : i + 1], y[i : i + 1]).item()
        for p in range(ids.shape[1]):
            if int(ids[i, p]) in protected:
                continue
            for v in range(E.shape[0]):
                if v in protected or v == int(ids[i, p]):
                    continue
                trial = ids[i : i + 1].clone()
                trial[0, p] = v
                best = max(best, _loss(logits_of, E, trial, y[i : i + 1]).item())
        assert res.loss_after[i].item() == pytest.approx(best, rel=1e-12)
    assert bert.training  # evaluated in eval mode, the caller's flags restored


def test_the_first_order_best_swap_really_raises_the_loss_and_verification_only_helps(bert):
    logits_of, E = hf_embedding_model(bert, PAD)
    ids, y = _data(n=8, seed=1)
    one = hotflip(logits_of, E, ids, y, TokenAttackConfig(budget=1, candidates=1, protected=(PAD, CLS, SEP)))
    many = hotflip(logits_of, E, ids, y, TokenAttackConfig(budget=1, candidates=20, protected=(PAD, CLS, SEP)))
    after_one = _loss(logits_of, E, one.ids, y)
    assert torch.allclose(after_one, one.loss_after) and torch.all(after_one >= one.loss_before)
    assert sum(len(s) for s in one.swaps) >= 6  # the top first-order estimate raises the loss for most rows
    assert torch.all(many.loss_after >= one.loss_after - 1e-12)


def test_budget_protected_tokens_and_padding(bert):
    logits_of, E = hf_embedding_model(bert, PAD)
    ids, y = _data(n=6, seed=2)
    cfg = TokenAttackConfig(budget=3, candidates=8, protected=(PAD, CLS, SEP))
    res = hotflip(logits_of, E, ids, y, cfg)
    changed = res.ids != ids
    assert (changed.sum(1) <= 3).all() and torch.equal(changed.sum(1), torch.tensor([len(s) for s in res.swaps]))
    assert not changed[:, 0].any() and not changed[:, -1].any() and not changed[0, -3:].any()  # CLS, SEP, PAD kept
    assert not torch.isin(res.ids[changed], torch.tensor([PAD, CLS, SEP])).any()  # never inserted
    for i, row in enumerate(res.swaps):
        assert len({p for p, _, _ in row}) == len(row)  # a position at most once
        for p, old, new in row:
            assert ids[i, p] == old and res.ids[i, p] == new
    # greedy and verified: the loss never falls, and each extra step only adds
    assert torch.all(res.loss_after >= res.loss_before)
    two = hotflip(logits_of, E, ids, y, TokenAttackConfig(budget=2, candidates=8, protected=(PAD, CLS, SEP)))
    assert torch.all(res.loss_after >= two.loss_after - 1e-12)


def test_hotflip_in_chunks_of_texts_is_the_same_attack(bert):
    """Texts are independent in eval mode: chunks of 2 or 5 give the ids, swaps and losses of one
    pass over all; the memory per text counts its (L, V) gains and its graph."""
    logits_of, E = hf_embedding_model(bert, PAD)
    ids, y = _data(n=11, seed=5)
    cfg = TokenAttackConfig(budget=2, candidates=4, protected=(PAD, CLS, SEP))
    whole = hotflip(logits_of, E, ids, y, cfg)
    for chunk in (2, 5):
        part = hotflip(logits_of, E, ids, y, cfg, rows_per_chunk=chunk)
        assert torch.equal(part.ids, whole.ids) and part.swaps == whole.swaps
        torch.testing.assert_close(part.loss_after, whole.loss_after, rtol=1e-12, atol=0)
        torch.testing.assert_close(part.loss_before, whole.loss_before, rtol=1e-12, atol=0)
    per_row = hotflip_bytes_per_row(logits_of, E, ids, y)
    gains = 2 * ids.shape[1] * E.shape[0] * 8  # float64 (L, V) gains, twice
    assert per_row > gains  # and the graph of its embedding gradient on top


def test_the_random_control_spends_the_same_budget(bert):
    ids, _ = _data(n=20, seed=3)
    cfg = TokenAttackConfig(budget=2, protected=(PAD, CLS, SEP))
    a = random_swaps(ids, 12, cfg, torch.Generator().manual_seed(0))
    b = random_swaps(ids, 12, cfg, torch.Generator().manual_seed(0))
    assert torch.equal(a.ids, b.ids)  # seeded
    changed = a.ids != ids
    assert torch.equal(changed.sum(1), torch.full((20,), 2))
    assert not torch.isin(a.ids[changed], torch.tensor([PAD, CLS, SEP])).any() and not changed[:, [0, -1]].any()


def test_a_gradient_attack_beats_random_swaps_of_the_same_budget(bert):
    logits_of, E = hf_embedding_model(bert, PAD)
    ids, y = _data(n=24, seed=4)
    cfg = TokenAttackConfig(budget=2, candidates=8, protected=(PAD, CLS, SEP))
    flip = hotflip(logits_of, E, ids, y, cfg)
    rand = random_swaps(ids, 12, cfg, torch.Generator().manual_seed(1))
    gain_flip = (flip.loss_after - flip.loss_before).mean()
    gain_rand = (_loss(logits_of, E, rand.ids, y) - flip.loss_before).mean()
    assert gain_flip > gain_rand


def test_bad_configurations_are_refused():
    with pytest.raises(AuditError, match="token budget must be a positive integer"):
        TokenAttackConfig(budget=0)
    with pytest.raises(AuditError, match="candidates must be a positive integer"):
        TokenAttackConfig(candidates=0)
