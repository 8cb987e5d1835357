"""The projected estimator reads a table tied to the output head (GPT-2's ``wte`` / ``lm_head``) as
ONE layer with one Kronecker projection, the two uses' gradients summed.

A document's gradient of the tied W (V x H) is G = sum_t delta_t h_t^T (head) + sum_t e_{id_t} g_t^T
(table); its projection is P_out^T G P_in. Truths: G by plain autograd on each document alone,
unpadded, through transformers' own forward (``functional_call``, no mask, no wrapper) with the
next-token loss written out position by position, then P_out^T G P_in with P_out, P_in read from
the projection; every other column against the projection applied to that whole gradient
(``KroneckerProjection.apply``, which never sees activations or ids); at k >= P the ``exact``
estimator's influence. An untied model (Llama) keeps its table and head as separate layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call

transformers = pytest.importorskip("transformers")

from attnaudit.analyses.influence.estimators import projected as pj  # noqa: E402
from attnaudit.analyses.influence.influence import InfluenceConfig, influence_sweep  # noqa: E402
from attnaudit.analyses.influence.projection import tied_heads  # noqa: E402
from attnaudit.core.engine import Engine  # noqa: E402
from attnaudit.core.lm_rows import pack_rows, targets_for  # noqa: E402
from attnaudit.core.task import NextTokenLoss, Task  # noqa: E402
from attnaudit.models.hf_causal import HFCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "lm"))
from make_lm_checkpoint import build_model  # noqa: E402

F64 = torch.float64
V = 12  # vocabulary
WIDTH = 9  # padded row width
# (tokens, first counted target position)
DOCS = [
    ([3, 5, 7, 4, 6, 3, 5], 0),
    ([4, 11, 6], 0),
    ([7, 3, 5, 6, 4], 2),
    ([5, 6], 0),
    ([6, 7, 3, 10, 5, 7, 8, 9, 4], 0),
    ([3, 3, 4, 7], 1),
    ([9, 5, 6, 3, 4, 4, 6], 0),
    ([4, 7, 5], 0),
]
N_TRAIN = 6


@pytest.fixture(autouse=True)
def _fresh_cache():
    pj.clear_row_cache()
    yield
    pj.clear_row_cache()


def _model(arch: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        return build_model(V, arch, positions=16).to(F64).eval()


def _task(model: nn.Module, params: str = "all") -> Task:
    return Task(
        HFCausalLM(model, pad_token_id=0, vocab_size=V, max_length=16).eval(), V, NextTokenLoss(), params=params
    )


def _rows(docs) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(docs), WIDTH, dtype=torch.long)
    attention = torch.zeros(len(docs), WIDTH, dtype=torch.long)
    counted = torch.zeros(len(docs), WIDTH, dtype=torch.bool)
    for i, (doc, start) in enumerate(docs):
        ids[i, : len(doc)] = torch.tensor(doc)
        attention[i, : len(doc)] = 1
        counted[i, start + 1 : len(doc)] = True
    return pack_rows(ids, attention), targets_for(ids, attention, counted)


def _gradients(model: nn.Module, docs) -> tuple[list[str], torch.Tensor]:
    """(names, (n, P)): each document's loss gradient over the model's parameters (a tied weight
    once, under its first name) by autograd on the unpadded document through transformers' forward."""
    params = dict(model.named_parameters())
    names = list(params)
    out = []
    for doc, start in docs:
        state = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
        f = functional_call(model, state, (torch.tensor([doc]),), {"use_cache": False}).logits[0]
        w = [1.0 if start <= t < len(doc) - 1 else 0.0 for t in range(len(doc))]
        loss = sum(-w[t] * torch.log_softmax(f[t], -1)[doc[t + 1]] for t in range(len(doc) - 1)) / max(1.0, sum(w))
        grads = torch.autograd.grad(loss, [state[n] for n in names], allow_unused=True)
        out.append(
            torch.cat([(torch.zeros_like(state[n]) if g is None else g).reshape(-1) for n, g in zip(names, grads)])
        )
    return names, torch.stack(out)


def _projected_rows(model: nn.Module, k: int) -> tuple[Engine, pj.KroneckerProjection, torch.Tensor]:
    task = _task(model)
    eng = Engine(task, dtype=F64, names=[f"model.{n}" for n, _ in model.named_parameters()])
    proj = pj.projection_for(eng, k, seed=3)
    X, Y = _rows(DOCS)
    _, r, _ = pj.projected_rows(eng, proj, eng.rows(X), Y.to(F64), "empirical")
    return eng, proj, r


def test_tied_head_and_table_are_one_layer_whose_columns_are_the_projected_summed_gradient():
    """P_out^T G P_in of the tied W from each document's autograd gradient, to 1e-10 (relative to the
    largest entry); both factors really compress; the other columns match the projection of the
    whole gradient."""
    model = _model("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight  # tied by build_model
    eng, proj, r = _projected_rows(model, k=120)
    tied = [p for p in proj.layers if p.tied is not None]
    assert len(tied) == 1
    p = tied[0]
    assert (p.block.path, p.tied.path, p.block.weight) == (
        "model.lm_head",
        "model.transformer.wte",
        "model.transformer.wte.weight",
    )
    layout = proj.describe()
    assert layout["tied"] == {"model.lm_head": "model.transformer.wte"}
    assert "model.transformer.wte.weight" not in layout["other_parameters"]
    assert "model.transformer.wte" not in layout["embeddings"]
    assert p.P_out is not None and p.P_in is not None  # V x k_out, H x k_in: a real compression on both sides
    assert p.P_out.shape == (V, p.k_out) and p.P_in.shape == (32, p.k_in)

    names, grads = _gradients(model, DOCS)
    at = 0
    for n in names:
        if n == "transformer.wte.weight":
            break
        at += dict(model.named_parameters())[n].numel()
    for i in range(len(DOCS)):
        G = grads[i, at : at + V * 32].reshape(V, 32)  # (out = V, in = H): the head's layout
        truth = (p.P_out.T @ G @ p.P_in).reshape(-1)
        got = r[i, p.col : p.col + p.dim]
        assert float((got - truth).abs().max()) <= 1e-10 * float(truth.abs().max())
    # the whole row (every layer, the other parameters' signs) against R applied to the gradient
    dense = proj.apply(grads.to(F64))
    assert float((r - dense).abs().max()) <= 1e-10 * float(dense.abs().max())
    assert proj.embedding_fallback == frozenset()  # verified: the tied pair's fast path ran


def test_tied_table_at_full_dimension_gives_exact_influence():
    """With k >= P the projections are identities: projected Gauss-Newton influence (one backward
    pass per position and word) equals the exact estimator's (dense Jacobians), with the tied table
    among the tracked parameters."""
    model = _model("gpt2")
    params = "*.wte.*,*.ln_f.*,*.h.1.attn.c_proj.*"
    X, Y = _rows(DOCS)

    def run(estimator: str, **kw):
        cfg = InfluenceConfig(
            estimator=estimator, per_test=True, max_exact_params=5000, solver="eigh", curvature="ggn", **kw
        )
        return influence_sweep(
            _task(model, params), X[:N_TRAIN], Y[:N_TRAIN], X[N_TRAIN:], Y[N_TRAIN:], cfg, dampings=[0.05]
        )[0]

    exact = run("exact")
    assert "model.transformer.wte.weight" in exact.tracked
    full = run("projected", proj_dim=exact.n_params + 10)
    assert full.diagnostics["tied_heads_from_ids"] == {"model.lm_head": "model.transformer.wte"}
    assert "tied" in full.diagnostics["projection"]
    assert full.per_test is not None and exact.per_test is not None
    gap = float((full.per_test - exact.per_test).abs().max())
    assert gap <= 1e-9 * float(exact.per_test.abs().max())


def test_an_untied_model_keeps_its_table_and_head_as_separate_layers():
    """Llama's table and head are separate weights: no tied pair; the table is an embedding layer,
    the head a linear layer, and the rows are still the projected autograd gradients."""
    model = _model("llama")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    _, proj, r = _projected_rows(model, k=200)
    layout = proj.describe()
    assert "tied" not in layout
    assert "model.model.embed_tokens" in layout["embeddings"] and "model.lm_head" in layout["layers"]
    assert all(p.tied is None for p in proj.layers)
    _, grads = _gradients(model, DOCS)
    dense = proj.apply(grads.to(F64))
    assert float((r - dense).abs().max()) <= 1e-10 * float(dense.abs().max())


class _TiedWithBias(nn.Module):
    """A table tied to a head that has a bias: not the fast path's pair (the general rule)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(5, 3, dtype=F64)
        self.head = nn.Linear(3, 5, dtype=F64)
        self.head.weight = self.table.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.table(ids.long())).mean(1))


def test_other_sharing_goes_with_the_other_parameters():
    model = _TiedWithBias()
    assert tied_heads(model, [n for n, _ in model.named_parameters()]) == []
    eng = Engine(Task(model, 5, "ce"), dtype=F64, names=[n for n, _ in model.named_parameters()])
    layout = pj.projection_for(eng, 8).describe()
    assert "tied" not in layout and "table.weight" in layout["other_parameters"]


def test_a_store_backed_run_keeps_the_tied_layout_and_the_in_memory_scores(tmp_path):
    """The gradient store rebuilds nothing differently: the same scores as the in-memory path, the
    tied pair in the stored layout, and a second run reads every row back."""
    model = _model("gpt2")
    X, Y = _rows(DOCS)

    def run(**kw):
        cfg = InfluenceConfig(estimator="projected", per_test=True, curvature="empirical", proj_dim=96, **kw)
        return influence_sweep(_task(model), X[:N_TRAIN], Y[:N_TRAIN], X[N_TRAIN:], Y[N_TRAIN:], cfg, dampings=[0.05])[
            0
        ]

    memory = run()
    pj.clear_row_cache()
    stored = run(store=str(tmp_path))
    assert stored.diagnostics["store_rows_computed"] == N_TRAIN
    assert stored.diagnostics["projection_layout"]["tied"] == {"model.lm_head": "model.transformer.wte"}
    assert memory.per_test is not None and stored.per_test is not None
    torch.testing.assert_close(stored.per_test, memory.per_test, rtol=1e-10, atol=1e-14)
    again = run(store=str(tmp_path))
    assert again.diagnostics["store_rows_reused"] == N_TRAIN and again.diagnostics["store_rows_computed"] == 0
