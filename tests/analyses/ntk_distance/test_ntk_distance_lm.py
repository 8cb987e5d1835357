"""ntk-distance between a base and a fine-tuned causal language model (GPT-2 and Llama style).

Truth: the gradients of each document's log-likelihood of its own counted targets, sum_t w_t log
p(next_t | prefix), computed by hand with torch.autograd on transformers' model fed the unpadded
document alone (a log-softmax loop over its positions, float64); their Gram matrix is the kernel,
and the movement ||K_T - K_0||_F / ||K_0||_F is read from the two Grams.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attnaudit.analyses.ntk_distance.checkpoint import analyse_checkpoint  # noqa: E402
from attnaudit.analyses.ntk_distance.config import CheckpointKernelConfig  # noqa: E402
from attnaudit.analyses.ntk_distance import movement  # noqa: E402
from attnaudit.analyses.ntk_distance.layerwise import layer_kernels  # noqa: E402
from attnaudit.analyses.ntk_distance.language import KERNEL_LM, likelihood_task  # noqa: E402
from attnaudit.core.engine import Engine  # noqa: E402
from attnaudit.core.lm_rows import pack_rows, targets_for  # noqa: E402
from attnaudit.core.task import NextTokenLoss, Task  # noqa: E402
from attnaudit.errors import AuditError  # noqa: E402
from attnaudit.models.hf_causal import HFCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "lm"))
from conftest import run_cli  # noqa: E402

import make_lm_checkpoint as example  # noqa: E402

F64 = torch.float64
VOCAB = 24
# 6, 9, 5 and 7 tokens; the last document counts only its last three tokens (a completion)
DOCS = [[3, 9, 4, 12, 7, 2], [5, 6, 8, 10, 11, 4, 13, 14, 2], [7, 3, 3, 9, 2], [4, 4, 15, 16, 17, 18, 2]]
COUNTED_FROM = {3: 4}  # document 3: tokens from position 4 on are targets
CONFIG = CheckpointKernelConfig(kernel_points=4, n_test=1, linearized="auto")


def _documents(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows X and targets Y (n, 2 length) of DOCS, right-padded with id 0."""
    ids = torch.zeros(len(DOCS), length, dtype=torch.long)
    attention = torch.zeros(len(DOCS), length, dtype=torch.long)
    counted = torch.zeros(len(DOCS), length, dtype=torch.bool)
    for i, doc in enumerate(DOCS):
        ids[i, : len(doc)] = torch.tensor(doc)
        attention[i, : len(doc)] = 1
        counted[i, COUNTED_FROM.get(i, 0) : len(doc)] = True
    return pack_rows(ids, attention), targets_for(ids, attention, counted)


def _pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(base, tuned): a tiny seeded model and a copy whose parameters were moved by seeded noise."""
    base = example.build_model(VOCAB, arch)
    tuned = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return base, tuned


def _task(model: torch.nn.Module) -> Task:
    module = HFCausalLM(model, pad_token_id=0, vocab_size=VOCAB, max_length=64).eval()
    return Task(module, VOCAB, NextTokenLoss())


def _hand_gradients(model: torch.nn.Module, prefix: str = "") -> torch.Tensor:
    """(n, P): grad of each document's log-likelihood of its counted targets, the model fed the unpadded
    document alone (float64 copy; P over the parameters whose names start with ``prefix``)."""
    m = copy.deepcopy(model).double().eval()
    params = [p for name, p in m.named_parameters() if name.startswith(prefix)]
    rows = []
    for i, doc in enumerate(DOCS):
        logits = m(input_ids=torch.tensor([doc])).logits[0]
        ll = torch.zeros((), dtype=F64)
        for t in range(len(doc) - 1):
            if t + 1 >= COUNTED_FROM.get(i, 0):
                ll = ll + torch.log_softmax(logits[t], -1)[doc[t + 1]]
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(ll, params)]))
    return torch.stack(rows)


def _movement(K0: torch.Tensor, KT: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(KT - K0) / torch.linalg.matrix_norm(K0))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_kernels_and_movement_equal_the_gram_of_hand_log_likelihood_gradients(arch):
    base, tuned = _pair(arch)
    X, Y = _documents(12)
    result = analyse_checkpoint(_task(tuned), _task(base), X, Y, CONFIG, label=arch)
    mv = result.movement
    G0, GT = _hand_gradients(base), _hand_gradients(tuned)
    K0, KT = G0 @ G0.T, GT @ GT.T
    assert mv.n_points == len(DOCS) and mv.n_classes == 1 and mv.n_params == G0.shape[1]
    assert mv.kernel_init is not None and mv.kernel_trained is not None
    torch.testing.assert_close(mv.kernel_init, K0, rtol=1e-9, atol=1e-9 * float(K0.abs().max()))
    torch.testing.assert_close(mv.kernel_trained, KT, rtol=1e-9, atol=1e-9 * float(KT.abs().max()))
    assert mv.movement == pytest.approx(_movement(K0, KT), rel=1e-9)
    assert mv.movement_trace == pytest.approx(_movement(K0, KT), rel=1e-9)
    cos = float((K0 * KT).sum() / (torch.linalg.matrix_norm(K0) * torch.linalg.matrix_norm(KT)))
    assert mv.kernel_distance == pytest.approx(1 - cos, rel=1e-7, abs=1e-12)
    # per layer: the first block's kernel from its own parameters' gradients
    block = "transformer.h.0." if arch == "gpt2" else "model.layers.0."
    g0, gT = _hand_gradients(base, block), _hand_gradients(tuned, block)
    group = mv.group("model." + block.rstrip("."))
    assert group.movement == pytest.approx(_movement(g0 @ g0.T, gT @ gT.T), rel=1e-9)
    assert group.n_params == g0.shape[1]
    assert sum(g.n_params for g in mv.groups) == mv.n_params
    # no labels, no accuracy: no alignment and no linearized comparator
    assert mv.cka_init is None and mv.cka_trained is None
    assert not result.linearized.applicable and "not applicable to language models" in str(result.linearized.reason)
    out = result.to_dict()
    assert out["kernel"] == KERNEL_LM and out["loss"] == "next-token cross-entropy"
    assert "log-likelihood" in result.verdict


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_layer_by_layer_plan_gives_the_same_kernels(arch, monkeypatch):
    """A 1 MiB budget cannot hold two documents' Jacobians of both models: the kernels are summed layer by
    layer (linear layers, embeddings, and GPT-2's tied embedding through its own Jacobians)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return layer_kernels(*args, **kwargs)

    monkeypatch.setattr(movement, "layer_kernels", spy)
    base, tuned = _pair(arch)
    X, Y = _documents(12)
    config = CheckpointKernelConfig(kernel_points=4, linearized="off", memory_bytes=1 << 20)
    mv = analyse_checkpoint(_task(tuned), _task(base), X, Y, config).movement
    assert len(calls) == 2  # one per model
    G0, GT = _hand_gradients(base), _hand_gradients(tuned)
    assert mv.kernel_init is not None and mv.kernel_trained is not None
    torch.testing.assert_close(mv.kernel_init, G0 @ G0.T, rtol=1e-9, atol=1e-9 * float((G0 @ G0.T).abs().max()))
    torch.testing.assert_close(mv.kernel_trained, GT @ GT.T, rtol=1e-9, atol=1e-9 * float((GT @ GT.T).abs().max()))
    assert mv.movement == pytest.approx(_movement(G0 @ G0.T, GT @ GT.T), rel=1e-9)


def test_identical_checkpoints_do_not_move_and_padding_changes_nothing():
    base, tuned = _pair("gpt2")
    X, Y = _documents(9)
    same = analyse_checkpoint(_task(base), _task(copy.deepcopy(base)), X, Y, CONFIG).movement
    assert same.movement == 0.0 and same.kernel_distance == 0.0 and same.norm_ratio == 1.0
    assert all(g.movement == 0.0 for g in same.groups)
    short = analyse_checkpoint(_task(tuned), _task(base), X, Y, CONFIG).movement
    X2, Y2 = _documents(20)
    long = analyse_checkpoint(_task(tuned), _task(base), X2, Y2, CONFIG).movement
    assert long.movement == pytest.approx(short.movement, rel=1e-12)
    assert long.kernel_init is not None and short.kernel_init is not None
    torch.testing.assert_close(long.kernel_init, short.kernel_init, rtol=1e-12, atol=0.0)
    # the padded columns themselves (not cut) leave the log-likelihood's kernel as it is
    wrapped = Engine(likelihood_task(_task(base)), dtype=F64)
    K_padded = wrapped.entk(torch.cat([X2, Y2], 1).to(F64))[:, :, 0, 0]
    torch.testing.assert_close(K_padded, short.kernel_init, rtol=1e-9, atol=1e-9 * float(K_padded.abs().max()))


def test_a_linearized_comparator_is_refused_for_a_language_model():
    base, tuned = _pair("gpt2")
    X, Y = _documents(9)
    for method in ("train", "kernel-gd"):
        with pytest.raises(AuditError, match="not applicable to language models"):
            analyse_checkpoint(
                _task(tuned), _task(base), X, Y, CheckpointKernelConfig(kernel_points=4, linearized=method)
            )
    off = analyse_checkpoint(_task(tuned), _task(base), X, Y, CheckpointKernelConfig(kernel_points=4, linearized="off"))
    assert off.linearized.method == "off"


def test_cli_and_audit_on_a_llama_pair(tmp_path, monkeypatch):
    example.write_checkpoints(tmp_path, arch="llama", n_documents=16)
    report = tmp_path / "ntk.json"
    args = ["--checkpoint", tmp_path / "lm", "--reference-checkpoint", tmp_path / "base-lm"]
    args += ["--data", tmp_path / "documents.jsonl", "--kernel-points", 6, "--n-test", 2]
    assert run_cli("ntk-distance", *args, "--json", report) == 0
    model = json.loads(report.read_text())["results"]["models"]["lm"]
    assert model["kernel"] == KERNEL_LM and model["loss"] == "next-token cross-entropy"
    assert model["movement"]["n_points"] == 6 and model["movement"]["movement"] > 0
    assert {g["group"] for g in model["movement"]["groups"]} >= {"model.model.layers.0", "model.model.layers.1"}
    assert "not applicable to language models" in model["linearized"]["reason"]
    assert run_cli("ntk-distance", *args, "--linearized", "train") == 2
    (tmp_path / "audit.yaml").write_text(
        "version: 1\nname: lm-ntk\nseed: 0\ndata:\n  data: documents.jsonl\nmodel:\n  checkpoint: lm\nchecks:\n"
        "  - name: kernel-movement\n    analysis: ntk-distance\n    options:\n      reference-checkpoint: base-lm\n"
        "      kernel-points: 6\n      n-test: 2\n    metric: kernel_movement\n    max: 1000\n"
    )
    monkeypatch.chdir(tmp_path)
    assert run_cli("audit", "audit.yaml", "--json", tmp_path / "audit.json") == 0
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert "kernel_movement" in json.dumps(audit)


def test_the_memory_budget_reaches_the_kernels_and_a_budget_too_small_is_refused(tmp_path, capsys):
    """--memory-budget (MiB) is the Jacobians' budget: a tiny one is refused in one line that says what
    it would need; a sufficient one runs and is recorded in the report's inputs."""
    from attnaudit.cli import main

    example.write_checkpoints(tmp_path, n_documents=12)
    args = ["ntk-distance", "--checkpoint", str(tmp_path / "lm"), "--reference-checkpoint", str(tmp_path / "base-lm")]
    args += ["--data", str(tmp_path / "documents.jsonl"), "--kernel-points", "4", "-q"]
    with pytest.raises(SystemExit) as stop:
        main([*args, "--memory-budget", "0.01"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "budget" in err and "0.01 MiB" in err and "Traceback" not in err
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as stop:
        main([*args, "--memory-budget", "64", "--json", str(report)])
    assert stop.value.code == 0
    assert json.loads(report.read_text())["inputs"]["memory_bytes"] == 64 * 2**20
