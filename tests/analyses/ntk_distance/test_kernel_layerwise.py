"""Kernel movement with the kernels summed layer by layer
(attnaudit.analyses.ntk_distance.layerwise.layer_kernels), the plan taken when even two rows'
Jacobians over all parameters do not fit the memory budget, against the Jacobian-contraction
plan (:func:`_upper_blocks`) and against explicit per-group Jacobian products."""

from __future__ import annotations

import copy

import pytest
import torch

from attnaudit.analyses.ntk_distance import movement
from attnaudit.analyses.ntk_distance.layerwise import layer_kernels
from attnaudit.analyses.ntk_distance.movement import entk_by_group, kernel_movement, parameter_groups
from attnaudit.core import Engine
from attnaudit.core.task import Inputs, Task
from attnaudit.models.vit import ViT, ViTSpec

from layer_models import AttentionNet, ConvNet

F64 = torch.float64


def _vit(seed):
    return ViT(ViTSpec("vit", (1, 8, 8), 3, depth=2, dim=8, heads=2, patch=4, mlp_ratio=2, seed=seed), dtype=F64)


def _pair(case):
    """Two models of one architecture (different weights), their Tasks, and rows."""
    gen = torch.Generator().manual_seed(2)
    if case == "vit":
        a, b = _vit(0), _vit(1)
        d = 64
    else:
        torch.manual_seed(0)
        a = (AttentionNet if case == "attention" else ConvNet)()
        b = copy.deepcopy(a)
        with torch.no_grad():
            for p in b.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
        d = 16 if case == "attention" else 64
    X = torch.randn(11, d, generator=gen, dtype=F64)
    y = torch.randint(0, 3, (11,), generator=gen)
    tasks = []
    for m in (a, b):
        m.eval()
        tasks.append(Task(m, 3, inputs=m.audit_inputs()) if hasattr(m, "audit_inputs") else Task(m, 3))
    return tasks, X, y


@pytest.mark.parametrize("form", ["full", "trace"])
@pytest.mark.parametrize("case", ["vit", "attention", "conv"])
def test_layer_by_layer_movement_equals_the_jacobian_contraction(case, form, monkeypatch):
    tasks, X, y = _pair(case)
    ref = kernel_movement(tasks[0], tasks[1], X, y, form=form)
    monkeypatch.setattr(movement, "_jacobian_plan_fits", lambda *a: False)
    # small budget: the layers in several runs and the Jacobian panels recomputed
    ours = kernel_movement(tasks[0], tasks[1], X, y, form=form, memory_bytes=150_000)
    assert ref.movement_trace > 1e-3  # the two models differ
    for key in (
        "movement",
        "movement_trace",
        "norm_init",
        "norm_trained",
        "kernel_distance",
        "cka_init",
        "cka_trained",
    ):
        a, b = getattr(ours, key), getattr(ref, key)
        assert (a is None and b is None) or a == pytest.approx(b, rel=1e-9, abs=1e-12), key
    for g0, g1 in zip(ours.groups, ref.groups):
        assert g0.group == g1.group
        assert g0.movement_trace == pytest.approx(g1.movement_trace, rel=1e-9)
        assert g0.trace_share_trained == pytest.approx(g1.trace_share_trained, rel=1e-9, abs=1e-15)
        if form == "full":
            assert g0.movement == pytest.approx(g1.movement, rel=1e-9)
    torch.testing.assert_close(ours.kernel_trained, ref.kernel_trained, rtol=1e-10, atol=1e-13)


def _engine_and_slices(task, dtype):
    """An engine over the parameter groups' members in group order, and each group's (start, stop)."""
    names = [n for m in parameter_groups(Engine(task, dtype=F64).names).values() for n in m]
    eng = Engine(task, dtype=dtype, names=names)
    slices, start = {}, 0
    for g, members in parameter_groups(eng.names).items():
        size = sum(eng.numels[eng.names.index(m)] for m in members)
        slices[g] = (start, start + size)
        start += size
    return eng, slices


def test_layer_kernels_equal_the_group_kernels_of_full_jacobians():
    tasks, X, _ = _pair("vit")
    eng, slices = _engine_and_slices(tasks[1], F64)
    ours = layer_kernels(eng, eng.rows(X), slices, 3, "full", 400_000)
    ref = entk_by_group(tasks[1], X)
    n = X.shape[0]
    for g in slices:
        torch.testing.assert_close(ours[g].view(n, 3, n, 3).permute(0, 2, 1, 3), ref[g], rtol=1e-10, atol=1e-13)


def test_a_budget_too_small_for_one_layer_is_refused_with_the_budget_that_works(monkeypatch):
    from attnaudit.errors import AuditError

    tasks, X, y = _pair("conv")
    monkeypatch.setattr(movement, "_jacobian_plan_fits", lambda *a: False)
    with pytest.raises(AuditError, match="budget"):
        kernel_movement(tasks[0], tasks[1], X, y, memory_bytes=20_000)


def test_float32_layer_kernels_are_float64_ones_to_float32_rounding_and_are_planned_at_4_bytes(monkeypatch):
    """The precision policy's float32 engine: captures and panels at 4 bytes a number (the plan
    counts them so), the kernels still float64 sums; the truth is the float64 Jacobian products."""
    from attnaudit.analyses.ntk_distance import layerwise

    tasks, X, _ = _pair("vit")
    ref = entk_by_group(tasks[1], X)  # explicit float64 per-group Jacobian products
    eng32, slices = _engine_and_slices(tasks[1], torch.float32)
    held: list[torch.dtype] = []
    real_contract = layerwise.contract
    monkeypatch.setattr(layerwise, "contract", lambda A, B: held.append(A.dtype) or real_contract(A, B))
    ours = layer_kernels(eng32, eng32.rows(X.float()), slices, 3, "full", 400_000)
    assert held and set(held) == {torch.float32}  # the Jacobian panels are not promoted to float64
    n = X.shape[0]
    for g, K in ours.items():
        assert K.dtype == F64
        torch.testing.assert_close(K.view(n, 3, n, 3).permute(0, 2, 1, 3), ref[g], rtol=2e-5, atol=2e-6)
    # a float32 run of layers holds half the bytes of a float64 one: the same budget takes fewer runs
    eng64, _ = _engine_and_slices(tasks[1], F64)
    blocks = layerwise.linear_modules(eng64.module, eng64.names)[0]
    share = 1_000
    while True:  # the smallest share that holds float64's largest layer alone
        try:
            runs64 = layerwise._layer_runs(eng64, eng64.rows(X), blocks, 3, share, 10**9, 0)
            break
        except layerwise.AuditError:
            share = int(share * 1.2)
    runs32 = layerwise._layer_runs(eng32, eng32.rows(X.float()), blocks, 3, share, 10**9, 0)
    assert len(runs32) < len(runs64)
    assert sum(len(r) for r in runs32) == sum(len(r) for r in runs64) == len(blocks)


class _TokenNet(torch.nn.Module):
    """Token ids -> a word table (padding_idx 0) plus a position table read with one (1, L) row
    of ids for the whole batch, a token-mixing layer and a head: tables the layer-by-layer plan
    forms from their ids, a table that the forward pass never reads (``unused``) and one tied to
    the head (left to the Jacobian of the other parameters)."""

    def __init__(self, seed: int, vocab: int = 17, length: int = 6, d: int = 5):
        super().__init__()
        torch.manual_seed(seed)
        self.words = torch.nn.Embedding(vocab, d, padding_idx=0, dtype=F64)
        self.positions = torch.nn.Embedding(length, d, dtype=F64)
        self.unused = torch.nn.Embedding(3, d, dtype=F64)
        self.tied = torch.nn.Embedding(3, d, dtype=F64)
        self.mix = torch.nn.Linear(d, d, dtype=F64)
        self.head = torch.nn.Linear(d, 3, dtype=F64)
        self.head.weight = self.tied.weight

    def forward(self, x):
        ids = x.round().long()
        h = self.words(ids) + self.positions(torch.arange(ids.shape[1])[None]) + 0.5 * self.tied(ids % 3)
        h = torch.tanh(self.mix(h))
        h = torch.softmax(h @ h.transpose(1, 2), -1) @ h  # tokens read each other
        return self.head(h.mean(1))


def _token_rows(n: int, vocab: int = 17, length: int = 6) -> torch.Tensor:
    """n rows of ids with trailing padding (id 0), repeated ids within and across rows."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, vocab, (n, length), generator=g)
    for i, k in enumerate(torch.randint(2, length + 1, (n,), generator=g).tolist()):
        ids[i, k:] = 0
    ids[1] = ids[0]  # a whole row read twice
    return ids.to(F64)


def _names_by_jacobian(monkeypatch) -> list[str]:
    """The parameter names the layer-by-layer plan leaves to per-row Jacobians, recorded as it runs."""
    from attnaudit.analyses.ntk_distance import layerwise

    names: list[str] = []
    real = layerwise._contract_others
    monkeypatch.setattr(
        layerwise, "_contract_others", lambda e, r, others, *a: names.extend(others) or real(e, r, others, *a)
    )
    return names


@pytest.mark.parametrize("form", ["full", "trace"])
def test_embedding_tables_are_formed_from_their_ids_and_give_the_full_jacobians_kernels(form, monkeypatch):
    """The word and position tables (padding row, broadcast position ids) from their ids against
    explicit per-group products of full float64 Jacobians; a budget that splits the rows into
    several panels; a tied table left to the Jacobian path."""
    net = _TokenNet(0)
    X = _token_rows(9)
    task = Task(net, 3)
    eng, slices = _engine_and_slices(task, F64)
    by_jacobian = _names_by_jacobian(monkeypatch)
    ours = layer_kernels(eng, eng.rows(X), slices, 3, form, 100_000)
    assert "tied.weight" in by_jacobian and "unused.weight" in by_jacobian  # tied; never read
    assert not {"words.weight", "positions.weight"} & set(by_jacobian)
    ref = entk_by_group(task, X, form=form)
    n = X.shape[0]
    for g, K in ours.items():
        got = K.view(n, 3, n, 3).permute(0, 2, 1, 3) if form == "full" else K
        torch.testing.assert_close(got, ref[g], rtol=1e-10, atol=1e-13)


def test_a_hugging_face_berts_tables_are_formed_from_their_ids_with_padding_trimmed(monkeypatch):
    pytest.importorskip("transformers")
    from attnaudit.models.hf import HFSequenceClassifier

    from hf_models import tiny_bert

    bert = tiny_bert(23, layers=1, max_positions=8, pad_token_id=0).double()
    wrapper = HFSequenceClassifier(bert, pad_token_id=0, trim_padding=True)
    task = Task(wrapper, 3, inputs=Inputs(kind="tokens", keyword="input_ids"))
    X = _token_rows(7, vocab=23, length=8)
    X[:, 5:] = 0  # every row's last three columns are padding: trimmed per chunk
    eng, slices = _engine_and_slices(task, F64)
    by_jacobian = _names_by_jacobian(monkeypatch)
    ours = layer_kernels(eng, eng.rows(X), slices, 3, "full", 2_000_000)
    assert not any(nm.endswith("_embeddings.weight") for nm in by_jacobian)
    ref = entk_by_group(task, X)
    n = X.shape[0]
    for g, K in ours.items():
        torch.testing.assert_close(K.view(n, 3, n, 3).permute(0, 2, 1, 3), ref[g], rtol=1e-9, atol=1e-12)
