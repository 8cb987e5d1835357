"""Malleability on causal language models: the embedding-shift model against transformers' own
inputs_embeds, the relative radius per real token, token swaps with their rebuilt targets, and the
static CLI run on GPT-2- and Llama-style models (losses and perplexities, never an accuracy)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from typer.testing import CliRunner  # noqa: E402

from attnaudit.analyses.malleability.attacks import AttackConfig, perturb  # noqa: E402
from attnaudit.analyses.malleability.lm_attacks import Documents, documents_summary, token_nll  # noqa: E402
from attnaudit.cli import app  # noqa: E402
from attnaudit.core.lm_rows import pack_rows, split_rows, split_targets, targets_for  # noqa: E402
from attnaudit.core.task import NextTokenLoss, Task  # noqa: E402
from attnaudit.errors import AuditError  # noqa: E402
from attnaudit.models.hf_causal import HFCausalLM, HFCausalLMShift, causal_shift_rows  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lm"
runner = CliRunner()


def _example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import make_lm_checkpoint
    finally:
        sys.path.remove(str(EXAMPLE))
    return make_lm_checkpoint


def _lm(arch: str) -> HFCausalLM:
    model = _example().build_model(40, arch).double()
    return HFCausalLM(model, pad_token_id=0, vocab_size=40, max_length=64)


def _documents() -> tuple[torch.Tensor, torch.Tensor]:
    """Three documents of 9, 6 and 4 tokens (BOS/EOS id 2, padding id 0), right-padded to 9."""
    lengths = [9, 6, 4]
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(3, 9, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 40, (n,), generator=gen)
        ids[i, n - 1] = 2
    attention = (torch.arange(9) < torch.tensor(lengths)[:, None]).long()
    return ids, attention


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_shift_model_is_the_plain_model_at_zero_and_transformers_inputs_embeds_with_a_shift(arch):
    lm = _lm(arch)
    shift = HFCausalLMShift(lm)
    ids, attention = _documents()
    plain = lm(pack_rows(ids, attention))
    zero = shift(causal_shift_rows(ids, attention, shift.hidden))
    assert torch.equal(plain, zero)
    delta = 0.05 * torch.randn(3, 9, shift.hidden, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = shift(causal_shift_rows(ids, attention, shift.hidden, delta))
    E = lm.model.get_input_embeddings().weight
    for i, n in enumerate(attention.sum(1).tolist()):  # each unpadded document, fed by hand
        embeds = (E[ids[i, :n]] + delta[i, :n]).unsqueeze(0)
        ref = lm.model(inputs_embeds=embeds, use_cache=False).logits[0]
        torch.testing.assert_close(got[i, :n], ref, rtol=1e-9, atol=1e-9)
    ref_grad = torch.autograd.grad(got[:, :4].sum(), lm.model.get_input_embeddings().weight)[0]
    assert ref_grad.abs().sum() > 0  # the lookup is inside the graph: the embedding table gets gradients


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_embedding_attacks_keep_each_real_tokens_relative_radius_and_leave_padding(norm):
    lm = _lm("gpt2")
    shift = HFCausalLMShift(lm)
    ids, attention = _documents()
    X = causal_shift_rows(ids, attention, shift.hidden)
    Y = targets_for(ids, attention)
    task = Task(shift, 40, NextTokenLoss())
    eps = 0.2
    E = lm.model.get_input_embeddings().weight.detach()
    for method in ("pgd", "sign", "fgsm"):
        res = perturb(task, X, Y, AttackConfig(method=method, eps=eps, norm=norm, steps=3, seed=4))
        got_ids, got_att, delta = shift.split_shift(res.X_adv)
        assert torch.equal(got_ids, ids) and torch.equal(got_att, attention.bool())
        assert res.y_adv is None  # an embedding shift leaves the targets
        size = delta.norm(dim=-1) if norm == "l2" else delta.abs().amax(-1) * E.shape[1] ** 0.5
        bound = eps * E[ids].norm(dim=-1)
        real = attention.bool() & (ids != 2) & (ids != 0)
        assert bool((size[real] <= bound[real] * (1 + 1e-9)).all())
        assert bool((delta[~real] == 0).all())  # padding and BOS/EOS never move
        assert res.loss_after > res.loss_before if method == "pgd" else True
        assert res.accuracy_before is None and res.accuracy_after is None


def test_a_memory_budget_splits_the_attack_into_smaller_chunks_and_changes_no_shift(monkeypatch):
    """A budget smaller than one document's graph attacks one document per chunk; documents are
    independent in eval mode, so the shifts equal those of one chunk of all documents."""
    from attnaudit.analyses.malleability import embedding_attacks

    lm = _lm("gpt2")
    shift = HFCausalLMShift(lm)
    ids, attention = _documents()
    X = causal_shift_rows(ids, attention, shift.hidden)
    Y = targets_for(ids, attention)
    task = Task(shift, 40, NextTokenLoss())
    chunks = []
    real_chunk = embedding_attacks._attack_chunk

    def counted(task, rows_of, y, *args, **kwargs):
        chunks.append(int(y.shape[0]))
        return real_chunk(task, rows_of, y, *args, **kwargs)

    monkeypatch.setattr(embedding_attacks, "_attack_chunk", counted)
    whole = perturb(task, X, Y, AttackConfig(method="pgd", eps=0.2, norm="l2", steps=3, seed=4))
    assert chunks == [3]
    chunks.clear()
    small = perturb(task, X, Y, AttackConfig(method="pgd", eps=0.2, norm="l2", steps=3, seed=4, memory_mb=1e-3))
    assert chunks == [1, 1, 1]
    torch.testing.assert_close(small.X_adv, whole.X_adv, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["hotflip", "swap"])
def test_token_swaps_spend_the_budget_and_rebuild_the_targets(method):
    lm = _lm("llama")
    ids, attention = _documents()
    X = pack_rows(ids, attention)
    Y = targets_for(ids, attention)
    task = Task(lm, 40, NextTokenLoss())
    res = perturb(task, X, Y, AttackConfig(method=method, eps=2, seed=5))
    new_ids, new_att = split_rows(res.X_adv)
    assert torch.equal(new_att, attention.bool())
    changed = new_ids != ids
    assert changed.sum(1).tolist() == [2, 2, 2]
    assert not bool(changed[~attention.bool()].any())  # padding untouched
    assert not bool(torch.isin(new_ids[changed], torch.tensor([0, 2])).any())  # no special id inserted
    assert not bool(changed[ids == 2].any())  # BOS/EOS never swapped
    assert res.y_adv is not None
    next_ids, weights = split_targets(res.y_adv)
    _, old_weights = split_targets(Y)
    assert torch.equal(weights, old_weights)  # the same counted positions
    real_next = old_weights > 0
    assert torch.equal(next_ids[:, :-1][real_next[:, :-1]], new_ids[:, 1:][real_next[:, :-1]])
    # the loss after, from transformers' logits on each unpadded perturbed document (its own next ids;
    # transformers' labels= loss runs in float32, so the cross-entropy is taken here in float64)
    losses = []
    for i, n in enumerate(attention.sum(1).tolist()):
        doc = new_ids[i, :n]
        with torch.no_grad():
            log_p = torch.log_softmax(lm.model(input_ids=doc.unsqueeze(0), use_cache=False).logits[0], -1)
        losses.append(float(-log_p[:-1].gather(1, doc[1:, None]).mean()))
    assert res.loss_after == pytest.approx(sum(losses) / len(losses), rel=1e-9)
    assert res.perplexity_after is not None and res.perplexity_after > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_token_nll_is_float64_cross_entropy_of_the_logits_as_given(dtype):
    # logits up to +-400: exp overflows float32 above 88, so a sum without the max taken out gives inf
    g = torch.Generator().manual_seed(3)
    n, L, V = 3, 7, 1000
    logits = (torch.randn(n, L, V, generator=g, dtype=torch.float64) * 100).clamp(-400, 400).to(dtype)
    ids = torch.randint(0, V, (n, L), generator=g)
    weights = (torch.rand(n, L, generator=g) > 0.3).double()
    nll, w = token_nll(logits, torch.cat([ids.double(), weights], 1))
    # the reference: torch's cross-entropy in float64 on the same (rounded) logits
    want = torch.nn.functional.cross_entropy(logits.double().reshape(-1, V), ids.reshape(-1), reduction="none").reshape(
        n, L
    )
    assert nll.dtype == torch.float64 and torch.equal(w, weights)
    assert torch.allclose(nll, want, rtol=0, atol=1e-9 if dtype == torch.float64 else 5e-6)
    assert bool(torch.isfinite(nll).all())


def test_documents_summary_is_the_token_weighted_perplexity_of_per_document_losses():
    """Mean loss and corpus perplexity from NextTokenLoss's per-document means equal the ones summed
    token by token (torch's cross-entropy), with a document of no counted token and one whose
    weights sum below 1 (the loss divides by max(1, W))."""
    g = torch.Generator().manual_seed(5)
    n, L, V = 5, 6, 40
    logits = torch.randn(n, L, V, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (n, L), generator=g)
    weights = (torch.rand(n, L, generator=g) > 0.4).double()
    weights[1] = 0.0  # nothing counted
    weights[3] = 0.0
    weights[3, 2] = 0.5  # a fractional weight: W = 0.5 < 1
    y = torch.cat([ids.double(), weights], 1)
    per_doc = NextTokenLoss().per_sample(logits, y)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids.reshape(-1), reduction="none").reshape(n, L)
    mean_loss, ppl = documents_summary(per_doc, y)
    W = weights.sum(1)
    assert mean_loss == pytest.approx(float(((weights * nll).sum(1) / W.clamp(min=1.0)).mean()), rel=1e-12)
    assert ppl == pytest.approx(float(torch.exp((weights * nll).sum() / weights.sum())), rel=1e-12)
    with pytest.raises(AuditError, match="document losses"):
        documents_summary(per_doc[:4], y)


def test_documents_of_rows_read_the_counted_mask_back():
    ids, attention = _documents()
    counted = attention.bool().clone()
    counted[:, :3] = False  # a prompt of 3 tokens: only the completion counts
    Y = targets_for(ids, attention, counted)
    docs = Documents.of(_lm("gpt2"), pack_rows(ids, attention), Y)
    assert torch.equal(docs.targets(ids), Y)


@pytest.fixture(scope="module")
def lm_folders(tmp_path_factory):
    """A randomly initialised GPT-2 and Llama folder (lm/, with the example's tokenizer) and 30 documents each."""
    example = _example()
    root = tmp_path_factory.mktemp("lm-malleability")
    for arch in ("gpt2", "llama"):
        (root / arch / "lm").mkdir(parents=True)
        example.write_documents(root / arch / "documents.jsonl", n=30)
        vocab = example.write_tokenizer(root / arch / "lm")
        example.build_model(vocab, arch).save_pretrained(root / arch / "lm")
    return root


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_static_cli_run_on_a_language_model_reports_losses_not_accuracies(lm_folders, arch):
    folder = lm_folders / arch
    common = ["malleability", "--checkpoint", str(folder / "lm"), "--data", str(folder / "documents.jsonl")]
    # no --estimator: a language model's default is projected (its tied output layer leaves last-layer nothing)
    sizes = ["--n-train", "10", "--n-test", "4", "--seeds", "2", "--top-k", "4"]
    out = runner.invoke(
        app, [*common, *sizes, "--proj-dim", "64", "--attacks", "pgd,sign,hotflip,swap", "--eps", "1", "--json", "-"]
    )
    assert out.exit_code == 0, out.output[-3000:]
    report = json.loads(out.output[out.output.index("{") :])
    res = report["results"]
    assert res["loss"] == "next-token cross-entropy" and res["config"]["loss"] == "next-token"
    assert report["inputs"]["estimator"] == "projected"
    attacks = {row["attack"] for row in res["summary"]}
    assert {"pgd", "sign", "hotflip", "swap"} <= attacks  # the adversarial attacks and their controls
    for row in res["summary"]:
        assert 0.0 <= row["flip_rate"]["mean"] <= 1.0
        assert row["perturbed_test_loss"]["mean"] > 0
    assert {row["floors"]["random"]["attack"] for row in res["summary"] if row["attack"] in ("pgd", "hotflip")} == {
        "sign",
        "swap",
    }

    def numbers(o, key=""):
        if isinstance(o, dict):
            for k, v in o.items():
                yield from numbers(v, k)
        elif isinstance(o, list):
            for v in o:
                yield from numbers(v, key)
        elif "accuracy" in key and isinstance(o, (int, float)) and not isinstance(o, bool):
            yield key

    assert list(numbers(report)) == []  # no accuracy field with a number
    training = res["training"][0]
    assert training["train_perplexity"] > 1 and training["test_loss"] > 0
    refused = runner.invoke(app, [*common, *sizes, "--attacks", "pgd,sign", "--protocol", "finetune"])
    assert refused.exit_code != 0 and "audit a language model as saved" in refused.output


def test_queries_file_is_what_the_influence_and_the_held_out_loss_are_measured_on(lm_folders, tmp_path):
    """--queries: the held-out set is that file's documents (read with the checkpoint's tokenizer),
    padded with the training documents to one length; the report's held-out loss is their mean
    next-token loss, computed here by hand with transformers on each unpadded document."""
    import transformers
    from tokenizers import Tokenizer

    folder = lm_folders / "gpt2"
    example = _example()
    queries = tmp_path / "queries.jsonl"
    # longer documents than the training ones (3 to 5 sentences): the two sets are widened to one length
    example.write_documents(queries, n=5, seed=7, sentences=(3, 5))
    common = ["malleability", "--checkpoint", str(folder / "lm"), "--data", str(folder / "documents.jsonl")]
    sizes = ["--n-train", "10", "--seeds", "2", "--top-k", "4", "--proj-dim", "64", "--attacks", "pgd,sign"]
    out = runner.invoke(app, [*common, *sizes, "--queries", str(queries), "--json", "-"])
    assert out.exit_code == 0, out.output[-3000:]
    report = json.loads(out.output[out.output.index("{") :])
    assert report["inputs"]["queries"] == str(queries) and report["inputs"]["n_test"] == 5
    assert report["results"]["audit_rows"]["queries"]["documents"] == 5

    tok = Tokenizer.from_file(str(folder / "lm" / "tokenizer.json"))
    model = transformers.GPT2LMHeadModel.from_pretrained(folder / "lm").double().eval()
    losses = []
    with torch.no_grad():
        for line in queries.read_text().splitlines():
            ids = tok.encode(json.loads(line)["text"]).ids + [2]  # the tokenizer's EOS appended
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
            losses.append(float(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))
    assert report["results"]["training"][0]["test_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)

    refused = runner.invoke(app, ["malleability", "--queries", str(queries), "--n-train", "20"])
    assert refused.exit_code == 2 and "queries" in refused.output and "language models" in refused.output


def test_static_losses_on_the_training_documents_come_from_the_influence_runs(lm_folders, monkeypatch):
    """Under the static protocol the saved model's loss on the clean training documents and each
    attack's loss on its perturbed documents come from the projected influence runs' own forward
    passes: no separate pass over the training documents (only the held-out ones are evaluated),
    and the same numbers as the forward passes an estimator without its own (EK-FAC) needs."""
    from attnaudit.analyses.malleability import cells, lm_attacks

    calls: list[int] = []
    original = lm_attacks.evaluate_documents

    def counted(task, X, y, *args, **kwargs):
        calls.append(int(X.shape[0]))
        return original(task, X, y, *args, **kwargs)

    monkeypatch.setattr(lm_attacks, "evaluate_documents", counted)
    monkeypatch.setattr(cells, "evaluate_documents", counted)
    folder = lm_folders / "gpt2"
    common = ["malleability", "--checkpoint", str(folder / "lm"), "--data", str(folder / "documents.jsonl")]
    sizes = ["--n-train", "10", "--n-test", "4", "--seeds", "1", "--top-k", "4", "--proj-dim", "32"]
    results = {}
    for estimator in ("projected", "ekfac"):
        calls.clear()
        args = [*common, *sizes, "--attacks", "fgsm,sign", "--eps", "0.1", "--estimator", estimator, "--json", "-"]
        out = runner.invoke(app, args)
        assert out.exit_code == 0, out.output[-3000:]
        results[estimator] = json.loads(out.output[out.output.index("{") :])["results"]
        if estimator == "projected":
            assert calls.count(10) == 0 and calls.count(4) == 1  # training documents: none; held out: once
        else:  # training: the saved model once, then one pass per attack over its perturbed documents
            assert calls.count(10) == 1 + 2 and calls.count(4) == 1
    fused, measured = results["projected"], results["ekfac"]
    assert fused["training"][0]["train_loss_from"] == "the clean influence run's forward passes"
    assert measured["training"][0]["train_loss_from"] == "a forward pass over the training documents"
    for key in ("final_loss", "train_perplexity"):
        assert fused["training"][0][key] == pytest.approx(measured["training"][0][key], rel=1e-9)
    saved_loss = fused["training"][0]["final_loss"]
    for attack in ("fgsm", "sign"):
        (row,) = [r for r in fused["runs"] if r["attack"] == attack]
        (truth,) = [r for r in measured["runs"] if r["attack"] == attack]
        assert row["clean_model_loss_on_clean_train"] == saved_loss
        assert row["clean_model_loss_on_perturbed_train"] != saved_loss  # measured on the perturbed documents
        for key in ("clean_model_loss_on_perturbed_train", "clean_model_perplexity_on_perturbed_train"):
            assert row[key] == pytest.approx(truth[key], rel=1e-9)
    (fgsm,) = [a for a in fused["attacks"] if a["method"] == "fgsm"]
    assert fgsm["model_loss_after"] > fgsm["model_loss_before"]  # the attack raised the loss it maximises
