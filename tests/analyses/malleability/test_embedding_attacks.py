"""Continuous attacks on text embeddings (FGSM, PGD, MIM) and their random controls.

Truths: the transformers model called directly with ``input_ids`` or ``inputs_embeds`` and a
0/1 padding mask (not attnaudit's wrapper), autograd on that call, and the balls' definition."""

from __future__ import annotations

import math

import pytest
import torch

from attnaudit.analyses.malleability import embedding_attacks
from attnaudit.analyses.malleability.attacks import AttackConfig, perturb
from attnaudit.analyses.malleability.embedding_attacks import perturb_embeddings, token_radii
from attnaudit.core.task import Inputs, Task
from attnaudit.errors import AuditError
from hf_models import tiny_bert
from attnaudit.models.hf import HFEmbeddingShiftClassifier, HFSequenceClassifier, embedding_shift_rows

transformers = pytest.importorskip("transformers")

PAD, CLS, SEP = 0, 1, 2
PROTECTED = (PAD, CLS, SEP)


@pytest.fixture(scope="module")
def bert():
    return tiny_bert(14, pad_token_id=PAD).double()


def _data(n=6, L=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 14, (n, L), generator=g)
    ids[:, 0], ids[:, -1] = CLS, SEP
    ids[0, -3:] = PAD  # a padded row: [CLS] ... [SEP] [PAD] [PAD]
    ids[0, -4] = SEP
    y = torch.randint(0, 3, (n,), generator=g)
    return ids, y


def _task(bert, loss="ce"):
    base = HFSequenceClassifier(bert, pad_token_id=PAD)
    return Task(HFEmbeddingShiftClassifier(base), n_classes=3, loss=loss, inputs=Inputs())


def _direct_logits(bert, ids, delta):
    E = bert.get_input_embeddings().weight
    return bert(inputs_embeds=E[ids] + delta, attention_mask=(ids != PAD).long()).logits


def _direct_loss(bert, ids, delta, y):
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(_direct_logits(bert, ids, delta), y, reduction="none")


def test_zero_shift_rows_give_the_token_models_logits_and_parameter_gradients(bert):
    ids, y = _data()
    rows = embedding_shift_rows(ids, 16)
    shift = _task(bert).module
    got = shift(rows)
    ref = bert(input_ids=ids, attention_mask=(ids != PAD).long()).logits
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    names = [n for n, _ in shift.named_parameters()]
    g_got = torch.autograd.grad(torch.nn.functional.cross_entropy(got, y), list(shift.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad(torch.nn.functional.cross_entropy(ref, y), list(bert.parameters()), allow_unused=True)
    assert names == ["model." + n for n, _ in bert.named_parameters()]  # same names as the token wrapper
    for a, b in zip(g_got, g_ref):
        if b is None:
            assert a is None or float(a.abs().max()) == 0.0
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)  # the word embeddings' gradient included


def test_shifted_rows_feed_the_model_its_embeddings_plus_the_shift(bert):
    ids, _ = _data(seed=3)
    delta = torch.randn(*ids.shape, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = _task(bert).module(embedding_shift_rows(ids, 16, delta))
    torch.testing.assert_close(got, _direct_logits(bert, ids, delta), rtol=1e-12, atol=1e-12)


def _split(rows, L, h=16):
    r = rows.reshape(rows.shape[0], L, h + 1)
    return r[..., 0].round().long(), r[..., 1:]


@pytest.mark.parametrize("method", ["fgsm", "pgd", "mim", "sign", "random"])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_every_attack_stays_inside_each_tokens_ball_and_leaves_ids_and_special_tokens(bert, method, norm):
    ids, y = _data(n=5, L=7, seed=2)
    eps = 0.2
    out = perturb_embeddings(
        _task(bert), embedding_shift_rows(ids, 16), y, method=method, eps=eps, norm=norm, steps=4, seed=5
    )
    new_ids, delta = _split(out.rows, 7)
    assert torch.equal(new_ids, ids)
    E = bert.get_input_embeddings().weight.detach()
    e_norm = E.norm(dim=1)[ids]
    size = delta.norm(dim=-1) if norm == "l2" else delta.abs().amax(-1) * math.sqrt(16)
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    assert float(delta[special].abs().max()) == 0.0
    assert bool((size <= eps * e_norm * (1 + 1e-12) + 1e-15).all())
    assert float(out.relative_radius.max()) <= eps * (1 + 1e-12)
    if method in ("fgsm", "sign"):  # on the boundary of every editable token's ball
        torch.testing.assert_close(size[~special], eps * e_norm[~special], rtol=1e-10, atol=0)
    if method == "random" and norm == "l2":  # uniform on each sphere
        torch.testing.assert_close(size[~special], eps * e_norm[~special], rtol=1e-10, atol=0)


def test_fgsm_matches_the_first_order_gain_and_beats_random_directions(bert):
    """For a small radius the loss gain of l2 FGSM is sum_p rho_p ||g_p|| (g from autograd on the
    direct model call), and no random direction of the same radii gains more."""
    ids, y = _data(n=4, L=7, seed=4)
    eps = 1e-4
    out = perturb_embeddings(_task(bert), embedding_shift_rows(ids, 16), y, method="fgsm", eps=eps, norm="l2")
    _, delta = _split(out.rows, 7)
    E = bert.get_input_embeddings().weight.detach()
    base = E[ids].clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(
        bert(inputs_embeds=base, attention_mask=(ids != PAD).long()).logits, y, reduction="sum"
    )
    (g,) = torch.autograd.grad(loss, base)
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    rho = torch.where(special, torch.zeros(()), eps * E.norm(dim=1)[ids])
    predicted = (rho * g.norm(dim=-1)).sum(1)
    zero = torch.zeros_like(delta)
    gained = _direct_loss(bert, ids, delta, y) - _direct_loss(bert, ids, zero, y)
    torch.testing.assert_close(gained, predicted, rtol=1e-3, atol=1e-12)
    rand = perturb_embeddings(
        _task(bert), embedding_shift_rows(ids, 16), y, method="random", eps=eps, norm="l2", seed=1
    )
    rand_gain = _direct_loss(bert, ids, _split(rand.rows, 7)[1], y) - _direct_loss(bert, ids, zero, y)
    assert bool((gained >= rand_gain - 1e-15).all())


def test_pgd_and_mim_raise_the_loss_more_than_the_random_controls(bert):
    ids, y = _data(n=8, L=7, seed=6)
    rows = embedding_shift_rows(ids, 16)
    zero = torch.zeros(*ids.shape, 16, dtype=torch.float64)
    clean = _direct_loss(bert, ids, zero, y).mean()
    loss = {}
    for method in ("pgd", "mim", "sign", "random"):
        out = perturb_embeddings(_task(bert), rows, y, method=method, eps=0.5, norm="linf", steps=8, seed=3)
        loss[method] = _direct_loss(bert, ids, _split(out.rows, 7)[1], y).mean()
    assert loss["pgd"] > clean and loss["mim"] > clean
    assert loss["pgd"] > max(loss["sign"], loss["random"])
    assert loss["mim"] > max(loss["sign"], loss["random"])


def test_results_do_not_depend_on_the_chunk_size_and_repeat_with_the_seed(bert, monkeypatch):
    ids, y = _data(n=6, L=7, seed=7)
    rows = embedding_shift_rows(ids, 16)
    a = perturb_embeddings(_task(bert), rows, y, method="pgd", eps=0.3, norm="l2", steps=3, seed=11)
    monkeypatch.setattr(embedding_attacks, "TEXT_CHUNK", 2)
    b = perturb_embeddings(_task(bert), rows, y, method="pgd", eps=0.3, norm="l2", steps=3, seed=11)
    torch.testing.assert_close(a.rows, b.rows, rtol=1e-12, atol=1e-14)
    c = perturb_embeddings(_task(bert), rows, y, method="pgd", eps=0.3, norm="l2", steps=3, seed=12)
    assert not torch.equal(a.rows, c.rows)


def test_the_attacked_model_is_left_as_it_was(bert):
    bert.train()
    before = {k: v.clone() for k, v in bert.state_dict().items()}
    ids, y = _data()
    perturb_embeddings(_task(bert), embedding_shift_rows(ids, 16), y, method="mim", eps=0.2, steps=2)
    assert bert.training
    bert.eval()
    for k, v in bert.state_dict().items():
        assert torch.equal(v, before[k])


def test_perturb_routes_text_models_and_reports_relative_and_absolute_sizes(bert):
    ids, y = _data(n=6, L=7, seed=8)
    rows = embedding_shift_rows(ids, 16)
    res = perturb(_task(bert), rows, y, AttackConfig(method="pgd", eps=0.1, norm="l2", steps=3))
    assert res.loss_after > res.loss_before
    assert 0 < res.radius_mean <= res.radius_max <= 0.1 * (1 + 1e-12)
    _, delta = _split(res.X_adv, 7)
    assert res.l2_max == pytest.approx(float(delta.reshape(6, -1).norm(dim=1).max()), rel=1e-12)
    hot = perturb(_task(bert), rows, y, AttackConfig(method="hotflip", eps=1))
    new_ids, shift = _split(hot.X_adv, 7)
    assert float(shift.abs().max()) == 0.0 and int((new_ids != ids).sum(1).max()) <= 1
    with pytest.raises(AuditError, match="no valid value range"):
        perturb(_task(bert), rows, y, AttackConfig(method="fgsm", eps=0.1, clip_min=0.0, clip_max=1.0))


def test_token_radii_are_relative_to_each_embedding_and_zero_for_protected_ids():
    E = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]], dtype=torch.float64)
    ids = torch.tensor([[0, 1, 2]])
    torch.testing.assert_close(
        token_radii(E, ids, (0,), 0.5, "l2"), torch.tensor([[0.0, 0.5, 5.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        token_radii(E, ids, (), 0.5, "linf"), torch.tensor([[2.5, 0.5, 5.0]], dtype=torch.float64) / math.sqrt(2)
    )


def _fixed(bert, loss="ce"):
    return {"bert": Task(HFSequenceClassifier(bert, pad_token_id=PAD), n_classes=3, loss=loss, inputs=Inputs("tokens"))}


@pytest.mark.parametrize("estimator", ["exact", "ekfac"])
def test_clean_influences_through_embedding_rows_equal_the_token_path(bert, estimator):
    """run_malleability feeds a text model embedding-shift rows when its embeddings are attacked:
    the clean influence scores must be those of the plain token-id path."""
    from attnaudit.analyses.malleability.config import MalleabilityConfig
    from attnaudit.analyses.malleability.malleability import run_malleability

    ids, y = _data(n=12, L=7, seed=9)
    y[:6], y[6:] = 0, 1
    X = ids.double()
    common = dict(
        eps=(1.0,),
        seeds=(0,),
        protocol="static",
        controls=False,
        top_k=4,
        estimator=estimator,
        loss="ce",
        max_exact_params=100_000,
        saved_models=True,
        models=("bert",),
        # the word embeddings (their gradient comes from the lookup inside the wrapper, the path
        # that differs) and the head, at a size the exact estimator inverts in a second
        params="model.bert.embeddings.word_embeddings.*,model.classifier.*",
    )
    tokens = run_malleability(
        X[:8], y[:8], X[8:], y[8:], 3, MalleabilityConfig(attacks=("hotflip",), **common), fixed_models=_fixed(bert)
    )
    embeds = run_malleability(
        X[:8], y[:8], X[8:], y[8:], 3, MalleabilityConfig(attacks=("pgd",), **common), fixed_models=_fixed(bert)
    )
    clean_tokens = tokens.examples["bert"]["hotflip"][0]
    clean_embeds, attacked = embeds.examples["bert"]["pgd"]
    assert abs(clean_tokens).max() > 0
    assert clean_embeds == pytest.approx(clean_tokens, rel=1e-9, abs=1e-12 * abs(clean_tokens).max())
    assert not attacked == pytest.approx(clean_embeds)  # the attack moved the scores
    row = next(a for a in embeds.attacks if a["method"] == "pgd")
    assert 0 < row["perturbation_norm_mean"] <= 1.0 + 1e-12


def test_embedding_attacks_on_text_refuse_the_retrain_protocol(bert):
    from attnaudit.analyses.malleability.config import MalleabilityConfig
    from attnaudit.analyses.malleability.malleability import run_malleability

    ids, y = _data(n=12, L=7, seed=9)
    cfg = MalleabilityConfig(attacks=("fgsm",), eps=(0.1,), seeds=(0,), protocol="retrain", controls=False, top_k=2)
    with pytest.raises(AuditError, match="retrain"):
        run_malleability(
            ids[:8].double(),
            y[:8],
            ids[8:].double(),
            y[8:],
            3,
            cfg,
            fixed_models=_fixed(bert),
            rebuild={"bert": object()},
        )
