"""Influence estimators on a causal language model (issue 42, items 3 and 6).

A tiny GPT-2 (transformers' own, float64; its linear layers are transformers' ``Conv1D``, its head
tied to the token embedding) wrapped in :class:`~attnaudit.models.hf_causal.HFCausalLM`, trained
on nothing: influence(q, i) = -g_q^T (G + lambda I)^-1 g_i for the per-document loss
l_i = sum_t w_t CE_t / max(1, sum_t w_t).

Truths: per-document gradients and logit Jacobians taken by plain autograd on each document
alone, unpadded, through transformers' own forward (``functional_call`` on the HF model, no
attention mask, no wrapper), with the loss written out position by position; the Gauss-Newton
matrix assembled from those Jacobians and each position's softmax Hessian; the damped solve by
``torch.linalg.solve``. K-FAC's input covariance is checked against the layer inputs hooked on
each unpadded document.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import spearmanr
from torch.func import functional_call

transformers = pytest.importorskip("transformers")

from attnaudit.analyses.influence import kfac  # noqa: E402
from attnaudit.analyses.influence.influence import InfluenceConfig, influence_sweep  # noqa: E402
from attnaudit.analyses.influence.kfac import dense_gauss_newton, fit_factors  # noqa: E402
from attnaudit.core.engine import Engine  # noqa: E402
from attnaudit.core.lm_rows import pack_rows, targets_for  # noqa: E402
from attnaudit.core.task import NextTokenLoss, Task  # noqa: E402
from attnaudit.errors import AuditError  # noqa: E402
from attnaudit.models.hf_causal import HFCausalLM  # noqa: E402

F64 = torch.float64
V = 8  # vocabulary
LAYERS = "*.c_attn.*,*.c_proj.*,*.c_fc.*"  # GPT-2's Conv1D layers: what K-FAC covers
# (tokens, first counted target position): targets t >= start count (a prompt/completion split when start > 0)
DOCS = [
    ([3, 5, 7, 4, 6, 3, 5], 0),
    ([4, 4, 6], 0),
    ([7, 3, 5, 6, 4], 2),
    ([5, 6], 0),
    ([6, 7, 3, 4, 5, 7], 0),
    ([3, 3, 4, 7], 1),
    ([7, 5, 6, 3, 4, 4, 6], 0),
    ([4, 7, 5], 0),
    ([6, 3, 7, 5, 4], 0),
    ([5, 4, 3, 6, 7, 3], 3),
]
N_TRAIN = 7


@pytest.fixture(scope="module")
def gpt2():
    config = transformers.GPT2Config(
        vocab_size=V,
        n_positions=16,
        n_embd=4,
        n_layer=1,
        n_head=2,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=2,
        initializer_range=0.3,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).to(F64).eval()
    return model


def _task(model, params="all") -> Task:
    return Task(
        HFCausalLM(model, pad_token_id=0, vocab_size=V, max_length=16).eval(), V, NextTokenLoss(), params=params
    )


def _rows(docs, width: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, Y) of ``docs`` right-padded to ``width`` with ``pad`` (a real token id elsewhere)."""
    ids = torch.full((len(docs), width), pad, dtype=torch.long)
    attention = torch.zeros(len(docs), width, dtype=torch.long)
    counted = torch.zeros(len(docs), width, dtype=torch.bool)
    for i, (doc, start) in enumerate(docs):
        ids[i, : len(doc)] = torch.tensor(doc)
        attention[i, : len(doc)] = 1
        counted[i, start + 1 : len(doc)] = True  # token t + 1 counted: target position t >= start
    return pack_rows(ids, attention), targets_for(ids, attention, counted)


def _config(estimator: str, **kw) -> InfluenceConfig:
    return InfluenceConfig(estimator=estimator, per_test=True, max_exact_params=5000, solver="eigh", **kw)


def _scores(model, docs, estimator, width=8, params="all", damping=0.05, **kw) -> torch.Tensor:
    X, Y = _rows(docs, width)
    res = influence_sweep(
        _task(model, params),
        X[:N_TRAIN],
        Y[:N_TRAIN],
        X[N_TRAIN:],
        Y[N_TRAIN:],
        _config(estimator, **kw),
        dampings=[damping],
    )[0]
    assert res.per_test is not None
    return res.per_test


# ----------------------------------------------------------------------------- the truth by hand
def _by_hand(model, docs, damping: float) -> torch.Tensor:
    """(n_train, n_test) influence from autograd on each unpadded document through transformers' forward."""
    names = [n for n, _ in model.named_parameters()]  # tied head: listed once, as the embedding
    shapes = [p.shape for _, p in model.named_parameters()]
    theta0 = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def logits_of(theta: torch.Tensor, doc: list[int]) -> torch.Tensor:
        state, at = {}, 0
        for name, shape in zip(names, shapes):
            state[name] = theta[at : at + shape.numel()].view(shape)
            at += shape.numel()
        return functional_call(model, state, (torch.tensor([doc]),), {"use_cache": False}).logits[0]  # (T, V)

    def weights(doc, start) -> list[float]:
        return [1.0 if start <= t < len(doc) - 1 else 0.0 for t in range(len(doc))]

    def loss(theta, doc, start) -> torch.Tensor:
        f, w = logits_of(theta, doc), weights(doc, start)
        total = sum(-w[t] * torch.log_softmax(f[t], -1)[doc[t + 1]] for t in range(len(doc) - 1))
        return total / max(1.0, sum(w))

    grads = []
    for doc, start in docs:
        theta = theta0.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss(theta, doc, start), theta)
        grads.append(g)
    P = theta0.numel()
    G = torch.zeros(P, P, dtype=F64)
    for doc, start in docs[:N_TRAIN]:
        J = torch.autograd.functional.jacobian(
            lambda th, doc=doc: logits_of(th, doc).reshape(-1), theta0, vectorize=True
        )
        w = weights(doc, start)
        with torch.no_grad():
            p = torch.softmax(logits_of(theta0, doc), -1)
        H = torch.block_diag(
            *[w[t] / max(1.0, sum(w)) * (torch.diag(p[t]) - torch.outer(p[t], p[t])) for t in range(len(doc))]
        )
        G += J.T @ H @ J
    G /= N_TRAIN
    train, test = torch.stack(grads[:N_TRAIN]), torch.stack(grads[N_TRAIN:])
    return -(test @ torch.linalg.solve(G + damping * torch.eye(P, dtype=F64), train.T)).T


def test_exact_gauss_newton_influence_equals_autograd_on_each_unpadded_document(gpt2):
    got = _scores(gpt2, DOCS, "exact", width=9, curvature="ggn", damping=0.05)
    truth = _by_hand(gpt2, DOCS, 0.05)
    assert got.shape == (N_TRAIN, len(DOCS) - N_TRAIN)
    torch.testing.assert_close(got, truth, rtol=1e-6, atol=1e-9 * float(truth.abs().max()))


def test_projected_at_full_dimension_is_exact_gauss_newton_influence(gpt2):
    """With k >= P the projections are identities: the projected Gauss-Newton curvature (one backward
    pass per position and vocabulary entry) is the exact one."""
    exact = _scores(gpt2, DOCS, "exact", curvature="ggn")
    full = _scores(gpt2, DOCS, "projected", curvature="ggn", proj_dim=100_000)
    torch.testing.assert_close(full, exact, rtol=1e-8, atol=1e-10 * float(exact.abs().max()))


# ----------------------------------------------------------------------------- causal mask, padding
@pytest.mark.parametrize(
    ("estimator", "kw", "changed"),
    [
        ("exact", {"curvature": "ggn"}, 0),
        ("exact", {"curvature": "ggn"}, N_TRAIN),
        ("projected", {"proj_dim": 64}, 0),
        ("projected", {"proj_dim": 64}, N_TRAIN),
        # a training document only as a query: K-FAC's A averages the inputs of every real token,
        # the last one's too (whose output gradient is zero), so changing it moves the curvature
        ("ekfac", {"params": LAYERS}, N_TRAIN),
    ],
)
def test_a_later_uncounted_token_changes_no_score(gpt2, estimator, kw, changed):
    """A document's last token changed (a training document, or a query): with that target
    uncounted no earlier position can see it (causal mask), so no score moves; counted, the
    document's scores move (the control)."""
    doc = DOCS[changed][0]

    def scores(token: int, counted_last: bool) -> torch.Tensor:
        docs = list(DOCS)
        docs[changed] = (doc[:-1] + [token], 0)
        X, Y = _rows(docs, 8)
        if not counted_last:  # the weight of position T - 2, whose target is the last token
            Y[changed, 8 + len(doc) - 2] = 0.0
        res = influence_sweep(
            _task(gpt2, kw.get("params", "all")),
            X[:N_TRAIN],
            Y[:N_TRAIN],
            X[N_TRAIN:],
            Y[N_TRAIN:],
            _config(estimator, **{k: v for k, v in kw.items() if k != "params"}),
            dampings=[0.05],
        )[0]
        assert res.per_test is not None
        return res.per_test

    a, b = scores(5, False), scores(7, False)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * float(a.abs().max()))
    c, d = scores(5, True), scores(7, True)
    moved = (c - d)[changed] if changed < N_TRAIN else (c - d)[:, changed - N_TRAIN]
    assert float(moved.abs().max()) > 1e-3 * float(c.abs().max())


@pytest.mark.parametrize(
    ("estimator", "kw"),
    [("exact", {"curvature": "ggn"}), ("ekfac", {"params": LAYERS}), ("projected", {"proj_dim": 64})],
)
def test_padding_changes_no_score(gpt2, estimator, kw):
    """The same documents padded to 7 and to 13 columns (pad id 0) give the same scores."""
    short = _scores(gpt2, DOCS, estimator, width=7, **kw)
    long = _scores(gpt2, DOCS, estimator, width=13, **kw)
    torch.testing.assert_close(long, short, rtol=0, atol=1e-8 * float(short.abs().max()))


# ----------------------------------------------------------------------------- approximations
def test_ekfac_and_projected_rank_training_documents_like_exact(gpt2):
    """Spearman correlation of all query x train scores with exact Gauss-Newton influence over the
    Conv1D layers, at dampings 0.1 and 1 (lambda_max of the Gauss-Newton matrix is about 3; this
    untrained model's curvature has a large near-null space, where the approximations differ most
    at small damping). Measured at 0.1 / 1: ekfac (sampled Fisher, the default) 0.72 / 0.98, kfac
    0.43 / 0.97 (ekfac with the exact columns: 0.78 / 0.99), projected (empirical Fisher, k = 64) 0.61 / 0.93,
    projected ggn 0.86 / 0.94; the floors leave room for other BLAS and thread counts."""
    X, Y = _rows(DOCS, 8)
    task = _task(gpt2, LAYERS)

    def run(estimator: str, **kw) -> list[torch.Tensor]:
        results = influence_sweep(
            task, X[:N_TRAIN], Y[:N_TRAIN], X[N_TRAIN:], Y[N_TRAIN:], _config(estimator, **kw), dampings=[0.1, 1.0]
        )
        return [r.per_test.flatten() for r in results if r.per_test is not None]

    exact = run("exact", curvature="ggn")
    floors = {  # (at 0.1, at 1)
        ("ekfac", "auto"): (0.5, 0.9),
        ("kfac", "auto"): (0.2, 0.9),
        ("projected", "auto"): (0.4, 0.8),
        ("projected", "ggn"): (0.7, 0.8),
    }
    for (estimator, curvature), floor in floors.items():
        got = run(estimator, curvature=curvature, proj_dim=64)
        rho = [spearmanr(g.numpy(), e.numpy())[0] for g, e in zip(got, exact)]
        assert rho[0] > floor[0] and rho[1] > floor[1], (estimator, curvature, rho)


def test_sampled_fisher_factors_converge_to_the_gauss_newton_factors(gpt2):
    """One label drawn per counted position: S averages to the exact-column S (the draws are
    independent and zero-mean per position, so E[v v^T] is the block-diagonal output Hessian).
    The documents repeated 60 times, 4 seeds: 2,400 documents' draws. Measured relative errors of
    the mean: 0.024-0.061 by layer (one seed's: up to 0.16; 64 seeds of 300 documents: 0.005-0.02,
    falling as 1/sqrt(draws): no bias). A does not depend on the labels."""
    eng = Engine(_task(gpt2, LAYERS), dtype=F64)
    X, Y = _rows(DOCS, 8)
    exact = fit_factors(eng, X, "kfac", curvature="ggn", targets=Y)
    reps = 60
    draws = [
        fit_factors(eng, X.repeat(reps, 1), "kfac", curvature="fisher", targets=Y.repeat(reps, 1), chunk=200, seed=s)
        for s in range(4)
    ]
    assert exact.diagnostics["curvature"] == "ggn" and draws[0].diagnostics["curvature"] == "fisher"
    for i, e in enumerate(exact.blocks):
        torch.testing.assert_close(draws[0].blocks[i].A, e.A, rtol=1e-10, atol=1e-12)
        mean = torch.stack([d.blocks[i].S for d in draws]).mean(0)
        err = float((mean - e.S).norm() / e.S.norm())
        assert err < 0.1, (e.path, err)


def test_kfac_input_covariance_sums_over_real_tokens_only(gpt2):
    """A of the attention's input projection equals the mean of a a^T (bias column appended) over
    every real token of the documents run alone: padding columns never enter."""
    eng = Engine(_task(gpt2, LAYERS), dtype=F64)
    X, Y = _rows(DOCS, 11)
    factors = fit_factors(eng, X, "kfac", curvature="empirical", targets=Y)
    block = next(b for b in factors.blocks if b.path.endswith("attn.c_attn"))
    assert block.path == "model.transformer.h.0.attn.c_attn"
    seen = []
    hook = gpt2.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, a, o: seen.append(a[0][0]))
    try:
        with torch.no_grad():
            for doc, _ in DOCS:
                gpt2(torch.tensor([doc]))
    finally:
        hook.remove()
    a = torch.cat([torch.cat([s, torch.ones(s.shape[0], 1, dtype=F64)], 1) for s in seen])
    torch.testing.assert_close(block.A, a.T @ a / a.shape[0], rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- refusals and records
def test_curvatures_are_recorded_and_refusals_name_the_way_out(gpt2, monkeypatch):
    X, Y = _rows(DOCS, 8)
    task = _task(gpt2, LAYERS)
    runs = {
        est: influence_sweep(task, X[:N_TRAIN], Y[:N_TRAIN], X[N_TRAIN:], Y[N_TRAIN:], _config(est), dampings=[0.1])[0]
        for est in ("ekfac", "projected")
    }
    assert runs["ekfac"].diagnostics["curvature"] == "fisher"  # a language model's default: sampled
    assert runs["projected"].diagnostics["curvature"] == "empirical"
    eng = Engine(task, dtype=F64)
    with pytest.raises(AuditError, match="projected or ekfac"):
        dense_gauss_newton(eng, X, budget_bytes=10_000, targets=Y)
    monkeypatch.setattr(kfac, "EXACT_LM_COLUMNS", 20)
    with pytest.raises(AuditError, match="curvature fisher"):
        fit_factors(eng, X, "ekfac", curvature="ggn", targets=Y)
    with pytest.raises(AuditError, match="targets"):
        fit_factors(eng, X, "ekfac", curvature="fisher")


def _as_linear(model):
    """A copy of ``model`` with every transformers ``Conv1D`` (y = x W + b, W (d_in, d_out)) replaced by
    the ``nn.Linear`` with weight W^T: the same function, in the layout K-FAC knew before."""
    import copy

    from transformers.pytorch_utils import Conv1D

    out = copy.deepcopy(model)
    for path, sub in list(out.named_modules()):
        if isinstance(sub, Conv1D):
            d_in, d_out = sub.weight.shape
            lin = torch.nn.Linear(d_in, d_out).to(F64)
            with torch.no_grad():
                lin.weight.copy_(sub.weight.T)
                lin.bias.copy_(sub.bias)
            parent, name = out.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
            setattr(parent, name, lin)
    return out


@pytest.mark.parametrize(("estimator", "kw"), [("ekfac", {}), ("kfac", {"fast_path": False}), ("projected", {})])
def test_conv1d_layers_score_as_the_equivalent_linear_layers(gpt2, estimator, kw):
    """GPT-2's Conv1D layers (weights stored transposed) give the scores of the same model built
    from nn.Linear layers: the factors, the preconditioning, the per-layer training scores (and,
    with fast_path=False, per-sample gradients over all parameters) and the projection."""
    linear = _as_linear(gpt2)
    conv = _scores(gpt2, DOCS, estimator, params=LAYERS, damping=0.1, proj_dim=48, **kw)
    lin = _scores(linear, DOCS, estimator, params=LAYERS, damping=0.1, proj_dim=48, **kw)
    torch.testing.assert_close(conv, lin, rtol=1e-8, atol=1e-10 * float(lin.abs().max()))


def test_last_layer_of_a_tied_head_tracks_the_shared_table(gpt2):
    """GPT-2's head is its token embedding: last-layer tracks that one matrix under its registered name."""
    X, Y = _rows(DOCS, 8)
    res = influence_sweep(
        _task(gpt2), X[:N_TRAIN], Y[:N_TRAIN], X[N_TRAIN:], Y[N_TRAIN:], _config("last-layer"), dampings=[0.1]
    )[0]
    assert res.tracked == ["model.transformer.wte.weight"] and res.n_params == V * 4
