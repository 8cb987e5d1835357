"""The projected estimator reads embedding tables as linear layers on one-hot rows.

A row's gradient of a table E (V, d) is sum_t e_{id_t} g_t^T (zero at ``padding_idx``), so its
projection needs the ids and the output gradients only. Truths: at k >= P (identity
projections) the projected influence is exact Gauss-Newton influence, computed by the
``exact`` estimator from dense autograd Hessian columns; at k < P, the same projection R
applied to full per-sample gradients from ``vmap(jacrev)`` (``fast_path=False``), which never
looks at ids. A table read twice per forward cannot be captured once: verification sends it to
the Jacobian route, and the numbers stay exact."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from attnaudit.analyses.influence.estimators import projected as pj
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.core.engine import Engine
from attnaudit.core.task import Inputs, Task
from attnaudit.errors import AuditError
from hf_models import tiny_bert
from test_projected_logra import _fresh_cache, _rel  # noqa: F401 - the autouse fixture clears the row cache here too

F64 = torch.float64
DAMPING = 0.01
V, L = 9, 7


class _BagOfTokens(nn.Module):
    """Word table with a padding row, a position table read with one row of ids for the whole
    batch (broadcast, as BERT reads its position embeddings), a mean over positions, a linear head."""

    def __init__(self, twice: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.words = nn.Embedding(V, 4, padding_idx=0, dtype=F64)
        self.positions = nn.Embedding(L, 4, dtype=F64)
        self.head = nn.Linear(4, 3, dtype=F64)
        self.twice = twice
        with torch.no_grad():
            self.words.weight.copy_(torch.randn(V, 4, generator=g, dtype=F64))
            self.words.weight[0].zero_()

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)[None, :]
        h = self.words(ids) + self.positions(pos)
        if self.twice:  # the table read a second time: one capture cannot hold both reads
            h = h + 0.5 * self.words(ids.flip(1))
        # the mean over every position reads the padding too: its output gradient is not zero,
        # and only padding_idx keeps the padding row's gradient at 0
        return self.head(torch.tanh(h).mean(1))


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (n, L), generator=g)
    lengths = torch.randint(2, L + 1, (n,), generator=g)
    for i, k in enumerate(lengths.tolist()):
        ids[i, k:] = 0  # trailing padding
    return ids.to(F64), torch.randint(0, 3, (n,), generator=g)


def _influence(model, X, y, Xt, yt, estimator, inputs, **kw):
    task = Task(model, 3, "ce", inputs, "all")
    cfg = InfluenceConfig(estimator=estimator, damping=DAMPING, per_test=True, params="all", curvature="ggn", **kw)
    return compute_influence(task, X, y, Xt, yt, cfg)


@pytest.mark.parametrize("twice", [False, True])
def test_tables_at_full_dimension_give_exact_ggn_influence(twice):
    model = _BagOfTokens(twice)
    X, y = _tokens(24, 0)
    Xt, yt = _tokens(5, 1)
    inputs = Inputs(kind="tokens")
    exact = _influence(model, X, y, Xt, yt, "exact", inputs)
    P = sum(p.numel() for p in model.parameters())
    res = _influence(model, X, y, Xt, yt, "projected", inputs, proj_dim=P + 5)
    assert _rel(res.per_test, exact.per_test) < 1e-10
    d = res.diagnostics
    if twice:  # verification caught the second read: the word table takes the Jacobian route
        assert d["embeddings_by_jacobian"] == ["words"] and d["embeddings_from_ids"] == ["positions"]
    else:
        assert d["embeddings_from_ids"] == ["words", "positions"] and d["embeddings_by_jacobian"] == []
    assert d["other_parameters_by_jacobian"] == []


def test_routes_are_verified_once_per_module_and_again_for_another_module(monkeypatch):
    """Several influence runs on one module (a malleability run's clean, perturbed and check runs)
    verify its routes once; another module object -- here one whose forward reads the word table
    twice, with the same submodules and parameters -- is verified on its own, and takes its own route."""
    calls = []
    real = pj.verify_embeddings

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pj, "verify_embeddings", counted)
    model = _BagOfTokens()
    X, y = _tokens(24, 0)
    Xt, yt = _tokens(5, 1)
    inputs = Inputs(kind="tokens")
    first = _influence(model, X, y, Xt, yt, "projected", inputs, proj_dim=24)
    X2 = X.clone()
    X2[:3] = _tokens(3, 9)[0]  # another training set: its rows are computed, the routes reused
    second = _influence(model, X2, y, Xt, yt, "projected", inputs, proj_dim=24)
    assert len(calls) == 1 and second.diagnostics["projected_rows_computed"] == 3
    assert (
        first.diagnostics["embeddings_from_ids"] == second.diagnostics["embeddings_from_ids"] == ["words", "positions"]
    )
    twice = _BagOfTokens(twice=True)
    other = _influence(twice, X, y, Xt, yt, "projected", inputs, proj_dim=24)
    assert len(calls) == 2 and other.diagnostics["embeddings_by_jacobian"] == ["words"]
    full = _influence(twice, X, y, Xt, yt, "projected", inputs, proj_dim=24, fast_path=False)
    assert _rel(other.per_test, full.per_test) < 1e-10


def test_compressed_tables_equal_the_projection_of_full_per_sample_gradients():
    model = _BagOfTokens()
    X, y = _tokens(30, 2)
    Xt, yt = _tokens(4, 3)
    inputs = Inputs(kind="tokens")
    fast = _influence(model, X, y, Xt, yt, "projected", inputs, proj_dim=24)
    layout = fast.diagnostics["projection_layout"]
    assert layout["embeddings"] == ["words", "positions"]
    assert layout["layers"]["words"][1] < V  # the table's rows are compressed: P_in is not the identity
    full = _influence(model, X, y, Xt, yt, "projected", inputs, proj_dim=24, fast_path=False)
    assert _rel(fast.per_test, full.per_test) < 1e-10


def test_projected_rows_of_a_table_are_the_dense_projection_by_hand():
    """Row by row: R^T of the per-sample gradient autograd gives (the table's rows, padding row zero)."""
    model = _BagOfTokens()
    X, y = _tokens(6, 5)
    task = Task(model, 3, "ce", Inputs(kind="tokens"), "all")
    eng = Engine(task, dtype=F64)
    proj = pj.projection_for(eng, 40, seed=1)
    R = proj.dense()
    T = torch.nn.functional.one_hot(y, 3).to(F64)
    Psi, r, _ = pj.projected_rows(eng, proj, eng.rows(X), T, "empirical")
    for i in range(X.shape[0]):
        model.zero_grad()
        out = model(X[i : i + 1].long())
        nn.functional.cross_entropy(out, y[i : i + 1], reduction="sum").backward()
        assert float(model.words.weight.grad[0].abs().max()) == 0.0  # the padding row
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert torch.allclose(r[i], g @ R, rtol=1e-10, atol=1e-12)


def test_a_hugging_face_bert_projects_its_three_tables_from_ids():
    pytest.importorskip("transformers")
    from attnaudit.models.hf import HFSequenceClassifier

    bert = tiny_bert(11, layers=1, max_positions=L, pad_token_id=0).double()
    wrapper = HFSequenceClassifier(bert, pad_token_id=0, trim_padding=True)
    inputs = Inputs(kind="tokens", keyword="input_ids")
    ids, y = _tokens(20, 6)
    ids = ids.clamp(max=10)
    Xt, yt = _tokens(4, 7)
    res = _influence(wrapper, ids, y, Xt, yt, "projected", inputs, proj_dim=64)
    tables = {"word_embeddings", "position_embeddings", "token_type_embeddings"}
    got = {path.rsplit(".", 1)[-1] for path in res.diagnostics["embeddings_from_ids"]}
    assert got == tables and res.diagnostics["embeddings_by_jacobian"] == []
    full = _influence(wrapper, ids, y, Xt, yt, "projected", inputs, proj_dim=64, fast_path=False)
    assert _rel(res.per_test, full.per_test) < 1e-9


class _BigTable(nn.Module):
    """A 20,000-row word table and a linear head: 160,000 of 160,027 parameters in the table."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(20_000, 8, dtype=F64)
        self.head = nn.Linear(8, 3, dtype=F64)

    def forward(self, ids):
        return self.head(torch.tanh(self.words(ids)).mean(1))


def _table_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows of 6 token ids into the 20,000-row table, and their labels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20_000, (n, 6), generator=g).to(F64), torch.randint(0, 3, (n,), generator=g)


def test_the_planner_counts_the_projection_it_builds_not_galerkins_blocks():
    """Sized before: 2 x 64 P numbers (galerkin's blocks of R, 164 MB here) for every curvature;
    now the factors the projection holds (and a sign block for other parameters, none here)."""
    model = _BigTable()
    X, y = _table_rows(24, 8)
    inputs = Inputs(kind="tokens")
    res = _influence(model, X[:20], y[:20], X[20:], y[20:], "projected", inputs, proj_dim=64, memory_budget_mb=32)
    layout = res.diagnostics["projection_layout"]
    sizes = {"words": (20_000, 8), "head": (9, 3)}  # (w_in, d_out): the table's rows; the head's inputs and bias
    by_hand = 0
    for path, (k_out, k_in) in layout["layers"].items():
        w_in, d_out = sizes[path]
        by_hand += (w_in * k_in if k_in < w_in else 0) + (d_out * k_out if k_out < d_out else 0)
    task = Task(model, 3, "ce", inputs, "all")
    est = pj.Projected()
    cfg = InfluenceConfig(estimator="projected", proj_dim=64, params="all", curvature="ggn")
    assert est.factor_bytes(Engine(task, dtype=F64), cfg) == by_hand * 8 < 32 * 2**20
    P = sum(p.numel() for p in model.parameters())
    galerkin = InfluenceConfig(estimator="projected", proj_dim=64, params="all", curvature="galerkin")
    assert est.factor_bytes(Engine(task, dtype=F64), galerkin) == 2 * 64 * P * 8  # 164 MB: refused at 32 MB
    with pytest.raises(AuditError, match="memory budget"):
        compute_influence(task, X[:20], y[:20], X[20:], y[20:], replace(galerkin, memory_budget_mb=32))


def test_the_planner_sizes_a_row_by_what_the_projection_holds_not_p():
    """A chunk holds c' x (k + other parameters) numbers per row, not the P-wide gradient: at a
    7 MB budget (about 5.5 MB taken before any chunk, most of it P-wide test gradients) the
    160,027-parameter model (2.6 MB per row for two P-wide gradient blocks) was refused; now it
    runs in one chunk, with the numbers of one row at a time."""
    model = _BigTable()
    X, y = _table_rows(24, 9)
    inputs = Inputs(kind="tokens")
    small = _influence(model, X[:20], y[:20], X[20:], y[20:], "projected", inputs, proj_dim=64, memory_budget_mb=7)
    assert small.diagnostics["chunk_size"] >= 20  # every training row in one chunk
    one = _influence(model, X[:20], y[:20], X[20:], y[20:], "projected", inputs, proj_dim=64, chunk_size=1)
    assert one.diagnostics["chunk_size"] == 1
    assert _rel(small.per_test, one.per_test) < 1e-12


def test_per_test_influence_holds_k_wide_test_columns_not_p_wide():
    """40 test columns of P numbers would be 51 MB; the projected test side holds k each."""
    model = _BigTable()
    X, y = _table_rows(60, 10)
    res = _influence(
        model, X[:20], y[:20], X[20:], y[20:], "projected", Inputs(kind="tokens"), proj_dim=64, memory_budget_mb=8
    )
    assert res.per_test.shape == (20, 40)
    assert res.diagnostics["memory_estimate_bytes"]["total"] < 8 * 2**20


@pytest.mark.parametrize("ggn", [True, False])
def test_the_jacobian_route_over_some_tensors_is_plain_autograd_row_by_row(ggn):
    """The generic route (``vmap(jacrev)`` over a slice of theta) against the verification's
    truth, autograd one row and one output at a time: logit Jacobians and loss gradients."""
    model = _BagOfTokens(twice=True)
    X, y = _tokens(5, 11)
    task = Task(model, 3, "ce", Inputs(kind="tokens"), "all")
    eng = Engine(task, dtype=F64)
    names = ["words.weight", "head.bias"]
    rows, T = eng.rows(X), eng.targets(y)
    offsets = dict(zip(eng.names, torch.cumsum(torch.tensor([0, *eng.numels[:-1]]), 0).tolist()))
    index = torch.cat([torch.arange(offsets[n], offsets[n] + eng.numels[eng.names.index(n)]) for n in names])
    with eng.context(), torch.enable_grad():
        got = pj._other_rows(eng, index, rows, T, ggn)
        truth = pj._rows_by_autograd(eng, index, rows, T, ggn)
    assert got.shape == truth.shape == (5, 3 if ggn else 1, V * 4 + 3)
    assert torch.allclose(got, truth, rtol=1e-11, atol=1e-13)
