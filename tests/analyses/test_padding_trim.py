"""Text models that drop trailing padding, and analyses that sort rows by length.

A Hugging Face classifier whose real tokens never read padding gives the same logits when the
columns that are padding in every row are cut off; attnaudit's wrapper then runs each batch
at its longest sequence and the analyses chunk rows in order of length. Truths: the same
model run without trimming (the plain wrapper: every position computed, padding masked) and
each sequence run alone, unpadded; for K-FAC's input factor, the layer's inputs over the real
tokens read by a forward hook on those unpadded runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnaudit.core.engine import TEXT_PADDING_SHARE, Engine, length_spans
from attnaudit.core.task import Inputs, Task
from hf_models import tiny_bert

transformers = pytest.importorskip("transformers")

from attnaudit.models.hf import HFSequenceClassifier, _padding_trim_exact  # noqa: E402

PAD, CLS, SEP, L, N = 0, 1, 2, 40, 44


@pytest.fixture(scope="module")
def bert():
    return tiny_bert(12, layers=2, max_positions=L, pad_token_id=PAD).double()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, L - 4, (N,), generator=g)  # no row uses the last 5 columns: they are cut
    ids = torch.full((N, L), PAD)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(3, 12, (n,), generator=g)
        ids[i, 0], ids[i, n - 1] = CLS, SEP
    y = torch.randint(0, 3, (N,), generator=g)
    return ids, y, lengths


def _engine(model, trim: bool) -> Engine:
    wrapper = HFSequenceClassifier(model, pad_token_id=PAD, trim_padding=trim)
    task = Task(wrapper, 3, "ce", Inputs(kind="tokens", keyword="input_ids"), "all")
    return Engine(task, dtype=torch.float64)


class _MeanOverPositions(torch.nn.Module):
    """Reads padded positions: the mean embedding over every position, mask or not."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(12, 3)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.embed(input_ids).mean(1))


def test_the_check_accepts_a_masking_model_and_refuses_one_that_reads_padding(bert):
    assert _padding_trim_exact(bert, PAD, "4d", 12, L)
    assert not _padding_trim_exact(_MeanOverPositions(), PAD, "4d", 12, L)
    assert not _padding_trim_exact(bert, PAD, "none", 12, L)


def test_trimmed_logits_are_each_sequence_run_alone(bert, data):
    ids, _, lengths = data
    trim = HFSequenceClassifier(bert, pad_token_id=PAD, trim_padding=True)
    assert trim.kept_length(ids) == int(lengths.max()) < L
    with torch.no_grad():
        got = trim(ids)
        for i in range(N):
            alone = bert(input_ids=ids[i : i + 1, : lengths[i]]).logits[0]
            assert torch.allclose(got[i], alone, rtol=1e-12, atol=1e-12)


def test_rows_sorted_by_length_give_the_padded_models_numbers(bert, data):
    ids, y, lengths = data
    fast, plain = _engine(bert, True), _engine(bert, False)
    assert plain.length_order(ids.double()) is None
    order = fast.length_order(ids.double())
    assert order is not None and lengths[order].diff().min() >= 0
    for size in (4, 1000):
        chunks = fast.row_chunks(ids.double(), size)
        assert sorted(torch.cat(list(chunks)).tolist()) == list(range(N))
        for c in chunks:  # within `size` longest rows' tokens, little padding
            longest = int(lengths[c].max())
            assert len(c) * longest <= size * int(lengths.max())
            assert len(c) == 1 or len(c) * longest - int(lengths[c].sum()) <= TEXT_PADDING_SHARE * len(c) * longest

    X = ids.double()
    T = torch.nn.functional.one_hot(y, 3).double()
    assert torch.allclose(fast.logits(X), plain.logits(X), rtol=1e-12, atol=1e-12)  # back in the rows' order
    assert torch.allclose(fast.summed_grad(X, T), plain.summed_grad(X, T), rtol=1e-10, atol=1e-12)
    v = torch.randn(plain.n_params, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    hv_fast = fast.hvp_operator(X, T, chunk=N).matvec(v)
    hv_plain = plain.hvp_operator(X, T, chunk=N).matvec(v)
    assert float((hv_fast - hv_plain).norm() / hv_plain.norm()) < 1e-10
    # per-sample gradients: vmap cannot cut inside, so each chunk of neighbours is cut before it;
    # a chunk holds a P-wide gradient per row however short, so never more than `chunk` rows
    assert max(len(c) for c in fast.row_chunks(X, 8, max_rows=8)) <= 8 < max(len(c) for c in fast.row_chunks(X, 8))
    got = fast.per_sample_grads(X, T, chunk=8)
    want = plain.per_sample_grads(X, T, chunk=8)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    short = int(lengths.argmin())
    assert fast.cut_padding(X[short : short + 1]).shape[1] == lengths[short]


def test_landscape_losses_are_the_same_sorted(bert, data):
    from attnaudit.analyses.landscape.evaluate import SurfaceEvaluator, loss_and_accuracy

    ids, y, _ = data
    X = ids.double()
    fast, plain = _engine(bert, True), _engine(bert, False)
    assert loss_and_accuracy(fast, X, y, chunk=N) == pytest.approx(loss_and_accuracy(plain, X, y, chunk=N), rel=1e-12)
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(plain.n_params, dtype=torch.float64, generator=g)
    named = {k: t.reshape(-1) for k, t in plain.unflatten(direction).items()}
    coeffs = torch.tensor([[0.0], [0.01], [-0.02]], dtype=torch.float64)
    got = SurfaceEvaluator(fast, X, y)([named], coeffs)
    want = SurfaceEvaluator(plain, X, y)([named], coeffs)
    assert torch.allclose(got.loss, want.loss, rtol=1e-12)
    assert torch.equal(got.accuracy, want.accuracy)


def test_kfac_input_factors_average_over_real_tokens_only(bert, data):
    from attnaudit.analyses.influence.kfac import fit_factors

    ids, _, lengths = data
    X = ids.double()
    fast = fit_factors(_engine(bert, True), X, "ekfac")
    plain = fit_factors(_engine(bert, False), X, "ekfac")
    for a, b in zip(fast.blocks, plain.blocks):
        assert a.path == b.path
        assert torch.allclose(a.A, b.A, rtol=1e-10, atol=1e-14)
        assert torch.allclose(a.S, b.S, rtol=1e-10, atol=1e-14)
        assert torch.allclose(a.corrected, b.corrected, rtol=1e-8, atol=1e-14)

    # the truth for one layer: its inputs over each sequence's real tokens, read on the
    # sequence alone (unpadded), with the bias column
    path = "model.bert.encoder.layer.0.attention.self.query"
    block = next(b for b in fast.blocks if b.path == path)
    seen = []
    hook = bert.bert.encoder.layer[0].attention.self.query.register_forward_hook(
        lambda mod, args, out: seen.append(args[0][0])
    )
    try:
        with torch.no_grad():
            for i in range(N):
                bert(input_ids=ids[i : i + 1, : lengths[i]])
    finally:
        hook.remove()
    tokens = torch.cat(seen)
    tokens = torch.cat([tokens, torch.ones(tokens.shape[0], 1, dtype=tokens.dtype)], 1)
    assert tokens.shape[0] == int(lengths.sum())
    assert torch.allclose(block.A, tokens.T @ tokens / tokens.shape[0], rtol=1e-10, atol=1e-14)


def test_hotflip_in_chunks_of_neighbours_in_length_is_the_same_attack(bert, data):
    from attnaudit.analyses.malleability.token_attacks import TokenAttackConfig, hf_embedding_model, hotflip

    ids, y, lengths = data
    config = TokenAttackConfig(budget=2, candidates=4, protected=(PAD, CLS, SEP))
    logits_plain, E = hf_embedding_model(bert, PAD)
    logits_trim, _ = hf_embedding_model(bert, PAD, trim_padding=True)
    want = hotflip(logits_plain, E, ids, y, config)
    got = hotflip(logits_trim, E, ids, y, config, rows_per_chunk=8, order=torch.argsort(lengths, stable=True))
    assert torch.equal(got.ids, want.ids)
    assert got.swaps == want.swaps
    assert torch.allclose(got.loss_after, want.loss_after, rtol=1e-10)
    assert torch.allclose(got.loss_before, want.loss_before, rtol=1e-10)


def test_the_loader_turns_trimming_on_for_a_checked_checkpoint(tmp_path, bert):
    from attnaudit.models.hf import load_hf_directory

    model = transformers.BertForSequenceClassification(bert.config)
    model.save_pretrained(tmp_path / "bert")
    loaded = load_hf_directory(tmp_path / "bert")
    assert loaded.module.trim_padding
    assert loaded.source["trailing_padding"].startswith("dropped per batch")


def test_kernel_movement_by_layer_is_the_same_trimmed(bert, data):
    """Per-layer kernels stack each chunk's token captures: a chunk cut shorter fills the
    leading positions (zeros after them add nothing)."""
    import copy

    from attnaudit.analyses.ntk_distance.movement import _jacobian_plan_fits, _engines, kernel_movement

    ids, y, lengths = data
    moved = copy.deepcopy(bert)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def tasks(trim):
        return [
            Task(
                HFSequenceClassifier(m, pad_token_id=PAD, trim_padding=trim),
                3,
                "ce",
                Inputs("tokens", keyword="input_ids"),
            )
            for m in (bert, moved)
        ]

    X = ids.double()
    # fewer rows than are sorted, the shortest first: the token slots are sized on the longest
    few = torch.argsort(lengths)[:: N // 10][:10]
    assert not _jacobian_plan_fits(_engines(tasks(True), X[few], None, None)[0], 10, 3, 1 * 2**20)
    fast_few = kernel_movement(*tasks(True), X[few], y[few], memory_bytes=1 * 2**20)
    slow_few = kernel_movement(*tasks(False), X[few], y[few], memory_bytes=1 * 2**20)
    assert fast_few.headline == pytest.approx(slow_few.headline, rel=1e-9)
    budget = 6 * 2**20  # below the whole Jacobians: the per-layer path
    engines = _engines(tasks(True), X, None, None)[0]
    assert not _jacobian_plan_fits(engines, N, 3, budget)
    got = kernel_movement(*tasks(True), X, y, memory_bytes=budget)
    want = kernel_movement(*tasks(False), X, y, memory_bytes=budget)
    assert got.headline == pytest.approx(want.headline, rel=1e-9)
    for name in [g.group for g in want.groups]:
        assert got.group(name).movement == pytest.approx(want.group(name).movement, rel=1e-9)
        assert got.group(name).kernel_distance == pytest.approx(want.group(name).kernel_distance, rel=1e-9)


def test_embedding_shift_rows_are_cut_and_trimmed_alike(bert, data):
    """The continuous attacks' rows (ids and an embedding shift per token): the same logits
    and per-sample gradients cut or not."""
    from attnaudit.models.hf import HFEmbeddingShiftClassifier, embedding_shift_rows

    ids, y, lengths = data
    delta = 0.1 * torch.randn(N, L, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rows = embedding_shift_rows(ids, 16, delta)

    def engine(trim):
        shift = HFEmbeddingShiftClassifier(HFSequenceClassifier(bert, pad_token_id=PAD, trim_padding=trim))
        return Engine(Task(shift, 3, "ce", Inputs(), "all"), dtype=torch.float64)

    fast, plain = engine(True), engine(False)
    assert fast.cut_padding(rows[:1]).shape[1] == int(lengths[0]) * 17
    T = torch.nn.functional.one_hot(y, 3).double()
    assert torch.allclose(fast.logits(rows), plain.logits(rows), rtol=1e-12, atol=1e-12)
    got, want = fast.per_sample_grads(rows, T, chunk=8), plain.per_sample_grads(rows, T, chunk=8)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_length_spans_by_hand():
    """Sorted lengths cut where a span would hold more than `chunk` longest rows' tokens or
    more than a quarter padding."""
    assert length_spans([], 4) == []
    assert length_spans([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]  # 2 rows of the longest (10) each
    assert length_spans([1, 1, 1, 10], 4) == [(0, 3), (3, 4)]  # 1,1,1,10 would be 36 of 40 padding
    assert length_spans([2, 2, 2, 8], 1) == [(0, 3), (3, 4)]  # three rows of 2 fit one row of 8
    assert length_spans([6, 7, 8], 3) == [(0, 3)]  # 24 tokens, 3 padding: one span
    assert length_spans([6, 7, 8], 3, max_rows=2) == [(0, 2), (2, 3)]  # at most 2 rows a span
