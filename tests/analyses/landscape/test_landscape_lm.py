"""The loss landscape of causal language models (GPT-2- and Llama-style): the Hessian of the mean
next-token loss over documents, its top eigenvalues and trace, padding invariance, and the command.

The truth is the dense Hessian of the training loss written out by hand -- each document unpadded,
its own next-token cross-entropy averaged over its predicted tokens, the mean over documents --
from ``torch.autograd.functional.hessian`` on the transformers model itself (no attnaudit code).
Models are tiny float64 ones (a few hundred parameters), so a dense Hessian takes well under a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attnaudit.analyses.landscape import LandscapeConfig, analyse_landscape  # noqa: E402
from attnaudit.analyses.landscape.run import LandscapeRequest  # noqa: E402
from attnaudit.analyses.landscape.setup import landscape_engine, landscape_task  # noqa: E402
from attnaudit.analyses.request import FieldError  # noqa: E402
from attnaudit.core.lm_rows import pack_rows, targets_for  # noqa: E402
from attnaudit.core.task import NextTokenLoss, Task  # noqa: E402
from attnaudit.errors import AuditError  # noqa: E402
from attnaudit.models.hf_causal import HFCausalLM  # noqa: E402

V = 12  # vocabulary
PAD = 0
# 18 documents (more than the engine's 16, so rows are sorted by length and chunked as neighbours)
LENGTHS = [5, 2, 8, 3, 5, 8, 2, 3, 5, 3, 8, 2, 5, 3, 8, 5, 2, 3]
# relative agreement with the hand Hessian: Llama's RMSNorm runs in float32 whatever the model's
# dtype, so rows batched differently (padded here, grouped by length by hand) round differently
RTOL = {"gpt2": 1e-10, "llama": 1e-5}


def _model(arch: str) -> torch.nn.Module:
    """A tiny seeded float64 causal LM: GPT-2 (tied embeddings) or Llama (2 query / 1 key-value head, rotary)."""
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=V,
            n_positions=16,
            n_embd=4,
            n_layer=1,
            n_head=2,
            n_inner=4,
            initializer_range=0.5,
            bos_token_id=1,
            eos_token_id=1,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=4,
            intermediate_size=4,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            initializer_range=0.5,
            pad_token_id=PAD,
            bos_token_id=1,
            eos_token_id=1,
        )
        cls = transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config).double().eval()


def _documents(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g) for n in LENGTHS]


def _rows(docs: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, Y) of the documents right-padded to ``length`` with PAD."""
    ids = torch.full((len(docs), length), PAD, dtype=torch.long)
    attention = torch.zeros(len(docs), length, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)], attention[i, : len(d)] = d, 1
    return pack_rows(ids, attention), targets_for(ids, attention)


def _task(model: torch.nn.Module) -> Task:
    module = HFCausalLM(model, pad_token_id=PAD, vocab_size=V, max_length=16).eval()
    return Task(module, V, NextTokenLoss())


def _hand_hessian(model: torch.nn.Module, docs: list[torch.Tensor]) -> torch.Tensor:
    """Dense Hessian of (1/n) sum_docs (1/(len-1)) sum_t -log softmax(logits_t)[ids_{t+1}] over every
    parameter (tied ones once), each document run alone and unpadded (equal lengths batched together)."""
    names = [k for k, _ in model.named_parameters()]  # tied weights appear once
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
    groups: dict[int, list[torch.Tensor]] = {}
    for d in docs:
        groups.setdefault(len(d), []).append(d)

    def loss(flat: torch.Tensor) -> torch.Tensor:
        params = dict(zip(names, [p.view(s) for p, s in zip(flat.split([s.numel() for s in shapes]), shapes)]))
        total = flat.new_zeros(())
        for members in groups.values():
            ids = torch.stack(members)
            logits = torch.func.functional_call(model, params, (), {"input_ids": ids}).logits
            log_p = torch.log_softmax(logits[:, :-1], -1)
            nll = -log_p.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (docs, length - 1)
            total = total + nll.mean(1).sum()
        return total / len(docs)

    # torch's math kernel of scaled dot-product attention: the fused ones have no second derivative
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return torch.autograd.functional.hessian(loss, theta, vectorize=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small run fastest on one thread (a second one only adds contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lm(request):
    """(architecture, model, documents, dense Hessian by hand)."""
    model, docs = _model(request.param), _documents()
    return request.param, model, docs, _hand_hessian(model, docs)


def test_engine_hessian_equals_the_hand_hessian(lm):
    """The landscape's Hessian-vector products, assembled densely, are the by-hand Hessian (hence its trace)."""
    arch, model, docs, H = lm
    X, Y = _rows(docs, 10)
    engine = landscape_engine(landscape_task(_task(model), X), X)
    assert engine.n_params == H.shape[0]
    hvp = engine.hvp_operator(engine.rows(X), engine.targets(Y), chunk=len(docs))  # rows sorted by length
    dense = hvp.dense()
    assert torch.allclose(dense, H, atol=RTOL[arch] * H.abs().max(), rtol=0), (dense - H).abs().max()


def test_top_eigenvalues_and_trace_match_the_hand_hessian(lm):
    arch, model, docs, H = lm
    X, Y = _rows(docs, 10)
    exact = torch.linalg.eigvalsh(H).flip(0)
    config = LandscapeConfig(top_k=3, hutchinson_samples=160, points=0, grid=0, basin_directions=1, lanczos_tol=1e-8)
    res = analyse_landscape(_task(model), X, Y, config)
    assert res.n_params == H.shape[0] and res.loss_function == NextTokenLoss.name
    torch.testing.assert_close(
        torch.tensor(res.eigen.eigenvalues, dtype=torch.float64), exact[:3], rtol=max(1e-7, RTOL[arch]), atol=0
    )
    tr = float(torch.trace(H))
    # Hutchinson: unbiased, with its own standard error; the top-3 part is deflated out exactly
    assert 0 < res.trace.stderr < 0.15 * abs(tr)
    assert abs(res.trace.estimate - tr) < 4 * res.trace.stderr, (res.trace.estimate, tr, res.trace.stderr)
    # the training loss is the hand-written mean of per-document means
    want = 0.0
    with torch.no_grad():
        for d in docs:
            log_p = torch.log_softmax(model(input_ids=d[None]).logits[0, :-1], -1)
            want += float(-log_p.gather(-1, d[1:, None]).mean()) / len(docs)
    assert res.loss == pytest.approx(want, rel=max(1e-12, RTOL[arch]))
    assert res.accuracy is None and "no class labels" in (res.accuracy_note or "")
    assert res.to_dict()["accuracy"] is None


def test_padding_leaves_the_landscape_unchanged():
    """The same documents padded to 10 and 15 columns (and cut in chunks of 3 rows) give the same numbers."""
    model, docs = _model("gpt2"), _documents(1)
    config = LandscapeConfig(top_k=2, hutchinson_samples=3, points=3, grid=3, basin_directions=1, basin_points=4)
    results = []
    for length, chunk in ((10, None), (15, 3)):
        X, Y = _rows(docs, length)
        cfg = LandscapeConfig(**{**config.__dict__, "samples_per_batch": chunk})
        results.append(analyse_landscape(_task(model), X, Y, cfg))
    a, b = results
    torch.testing.assert_close(torch.tensor(a.eigen.eigenvalues), torch.tensor(b.eigen.eigenvalues), rtol=1e-9, atol=0)
    assert b.trace.estimate == pytest.approx(a.trace.estimate, rel=1e-9)
    assert b.loss == pytest.approx(a.loss, rel=1e-12)
    assert a.surface_1d is not None and b.surface_1d is not None and a.surface_2d is not None
    torch.testing.assert_close(torch.tensor(a.surface_1d.loss), torch.tensor(b.surface_1d.loss), rtol=1e-10, atol=0)
    assert a.surface_1d.accuracy is None and a.surface_2d.accuracy is None
    assert b.basin.width == pytest.approx(a.basin.width, rel=1e-9)


def test_a_language_model_keeps_its_own_loss():
    """A classification loss cannot replace the next-token loss, nor the reverse."""
    X, _ = _rows(_documents(), 10)
    with pytest.raises(AuditError, match="causal language model measured on its next-token"):
        landscape_task(_task(_model("gpt2")), X, loss="ce")
    with pytest.raises(FieldError, match="causal language model's loss; the built-in models"):
        LandscapeRequest(loss="next-token", preset="quick").validate()


# --------------------------------------------------------------------------- the command


def _write_llama_folder(root: Path) -> Path:
    """A Llama-shaped checkpoint (grouped-query attention, rotary) with the example's tokenizer and documents."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "lm"))
    try:
        from make_lm_checkpoint import write_documents, write_tokenizer
    finally:
        sys.path.pop(0)
    folder = root / "lm"
    folder.mkdir()
    vocab = write_tokenizer(folder)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    write_documents(root / "documents.jsonl", n=12)
    return folder


def test_landscape_command_on_a_llama_checkpoint(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from attnaudit.cli import app

    _write_llama_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    common = ["landscape", "--checkpoint", "lm", "--data", "documents.jsonl", "--n-train", "8"]
    small = ["--eigenvalues", "2", "--hutchinson-samples", "2", "--points", "3", "--grid", "0"]
    result = runner.invoke(app, [*common, *small, "--basin-directions", "1", "--json", "out.json"])
    assert result.exit_code == 0, result.output
    assert "loss: next-token cross-entropy" in " ".join(result.output.split())  # wherever the console wrapped
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["results"]["loss"] == "next-token cross-entropy"
    assert report["inputs"]["landscape"]["loss"] == "next-token"
    model = report["results"]["models"]["lm"]
    assert model["loss_function"] == "next-token" and model["n_samples"] == 8
    assert model["accuracy"] is None and model["accuracy_note"] and model["untrained"] is None
    assert model["surface_1d"]["accuracy"] is None and len(model["top_eigenvalues"]["eigenvalues"]) == 2
    # a classification loss is refused for a language model, in one line naming the option
    refused = runner.invoke(app, [*common, *small, "--loss", "ce"])
    assert refused.exit_code != 0 and "--loss" in refused.output and "next-token" in refused.output
