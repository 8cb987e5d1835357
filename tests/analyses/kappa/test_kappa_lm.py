"""Per-layer kappa of a causal language model: token Grams over each document's real tokens.

Truth: the attention layers' inputs computed by hand from transformers' own hidden states of the
unpadded document (ln_1 of the residual stream), their Gram's extreme eigenvalues by eigvalsh.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attnaudit.analyses.kappa.layers import LayerKappaConfig, analyse_layers  # noqa: E402
from attnaudit.core.lm_rows import pack_rows  # noqa: E402
from attnaudit.models.checkpoints import load_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "lm"))
import make_lm_checkpoint as example  # noqa: E402

DOCS = [[3, 9, 4, 12, 7, 2], [5, 6, 8, 10, 11, 4, 13, 14, 2], [7, 3, 3, 9, 2]]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm") / "lm"
    folder.mkdir()
    vocab = example.write_tokenizer(folder)
    example.build_model(vocab, "gpt2").save_pretrained(folder)
    return load_checkpoint(folder)


def _rows(docs, length):
    ids = torch.zeros(len(docs), length, dtype=torch.long)
    attention = torch.zeros(len(docs), length, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)] = torch.tensor(d)
        attention[i, : len(d)] = 1
    return pack_rows(ids, attention)


def _hand_input_kappas(lm, layer: int) -> np.ndarray:
    """kappa of the Gram of layer ``layer``'s attention input (ln_1 of the residual stream) per unpadded document."""
    gpt = lm.module.model.double()
    out = []
    try:
        with torch.no_grad():
            for d in DOCS:
                hidden = gpt(input_ids=torch.tensor([d]), output_hidden_states=True).hidden_states[layer]
                x = gpt.transformer.h[layer].ln_1(hidden)[0]
                lam = torch.linalg.eigvalsh(x @ x.T)
                out.append(float(lam[-1] / lam[0]))
    finally:
        gpt.float()
    return np.array(out)


@pytest.mark.parametrize("length", [9, 16])
def test_token_grams_are_those_of_each_documents_real_tokens(lm, length):
    result = analyse_layers(lm, _rows(DOCS, length), LayerKappaConfig(n=8))
    assert [r.name for r in result.layers] == ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]
    for depth in (0, 1):
        got = np.asarray(result.layers[depth].input.kappa_full)
        np.testing.assert_allclose(got, _hand_input_kappas(lm, depth), rtol=1e-8)
    # the maps are causal: lower triangular over the real tokens, so the last real row is never all zero and
    # rank equals the document's length
    heads = result.layers[0].heads
    assert heads is not None
    for head in heads:
        np.testing.assert_array_equal(head.rank, [len(d) for d in DOCS])


def test_the_cli_runs_on_documents_and_names_the_model_a_language_model(tmp_path):
    from typer.testing import CliRunner

    from attnaudit.cli import app

    example.write_checkpoints(tmp_path, n_documents=24)
    report = tmp_path / "kappa.json"
    res = CliRunner().invoke(
        app,
        [
            "kappa",
            "--checkpoint",
            str(tmp_path / "lm"),
            "--data",
            str(tmp_path / "documents.jsonl"),
            "--json",
            str(report),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(report.read_text())
    text = json.dumps(data)
    assert "next-token cross-entropy" in text and "causal-lm" in text
