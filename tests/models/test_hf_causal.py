"""Hugging Face causal language models (attnaudit.models.hf_causal): loading offline, logits against
transformers' own, the causal mask, padding, and the loader's refusals.

Tiny GPT-2 and Llama (grouped-query attention, rotary positions) models and a word-level
tokenizer are written into tmp folders; the truths are transformers' own logits and its own
next-token loss (``labels=``) on each document alone, unpadded.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from safetensors.torch import load_file  # noqa: E402

from attnaudit.core.lm_rows import pack_rows, targets_for  # noqa: E402
from attnaudit.core.task import NextTokenLoss, Task  # noqa: E402
from attnaudit.errors import AuditError  # noqa: E402
from attnaudit.models.hf import load_hf_directory  # noqa: E402
from attnaudit.models.hf_causal import HFCausalLM, load_hf_causal_lm  # noqa: E402

WORDS = (
    "the cat dog sat ran on a mat log big small red blue and then it was here there bird "
    "fish swam sang tree under over green old new by with from far near sun moon star"
).split()
SPECIAL = ["[PAD]", "[UNK]", "</s>"]
VOCAB = {token: i for i, token in enumerate(SPECIAL + WORDS)}
V = len(VOCAB)  # 40: the tokenizer's and the models' vocabulary
PAD, EOS = VOCAB["[PAD]"], VOCAB["</s>"]
# 6, 3 and 9 tokens: right-padded to 10 or 16, each batch keeps 9 columns and pads two documents
DOCS = ["the cat sat on the mat", "a dog ran", "then it was here and there it was big"]


def _config(arch: str):
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=V,
            n_positions=32,
            bos_token_id=EOS,
            eos_token_id=EOS,
            initializer_range=0.2,
        )
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=EOS,
        eos_token_id=EOS,
        initializer_range=0.2,
    )


def _write_tokenizer(folder) -> None:
    """A word-level tokenizer over VOCAB (whitespace pre-tokenizer), saved as tokenizer.json."""
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>"
    )
    fast.save_pretrained(folder)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lm(request, tmp_path_factory):
    """(folder, the in-memory transformers model that was saved there) for a tiny seeded model."""
    folder = tmp_path_factory.mktemp("causal") / request.param
    config = _config(request.param)
    cls = transformers.GPT2LMHeadModel if request.param == "gpt2" else transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):  # the caller's RNG untouched
        torch.manual_seed(0)
        model = cls(config).eval()
    model.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    _write_tokenizer(folder)
    return folder, model


def _tokens(folder, docs: list[str], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention) of ``docs`` by the folder's tokenizer, right-padded to ``length`` (None: unpadded)."""
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), pad_token="[PAD]")
    padding = {"padding": "max_length", "max_length": length} if length is not None else {}
    enc = tok(docs, return_tensors="pt", **padding)
    return enc["input_ids"], enc["attention_mask"]


def _copy(folder, tmp_path):
    target = tmp_path / folder.name
    shutil.copytree(folder, target)
    return target


def _edit_config(folder, edit) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


# --------------------------------------------------------------------------- logits


def test_logits_equal_the_transformers_models_own(lm):
    folder, model = lm
    loaded = load_hf_causal_lm(folder)
    reread = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert isinstance(loaded.module, HFCausalLM) and not loaded.module.training
    for doc in DOCS:
        ids, attention = _tokens(folder, [doc])
        assert bool(attention.all())
        with torch.no_grad():
            got = loaded.module(pack_rows(ids, attention))
            ref = model(input_ids=ids).logits
            ref_read = reread(input_ids=ids).logits
        assert got.shape == (1, ids.shape[1], V) and got.dtype == torch.float32
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
        assert torch.allclose(got, ref_read, atol=1e-5, rtol=0), (got - ref_read).abs().max()


def test_the_causal_mask_is_honoured(lm):
    """Changing token k leaves the logits before k unchanged and changes every later one."""
    folder, _ = lm
    module = load_hf_causal_lm(folder).module
    ids, attention = _tokens(folder, [DOCS[2]])
    k = 5
    changed = ids.clone()
    changed[0, k] = VOCAB["moon"] if int(ids[0, k]) != VOCAB["moon"] else VOCAB["sun"]
    with torch.no_grad():
        before = module(pack_rows(ids, attention))
        after = module(pack_rows(changed, attention))
    assert torch.allclose(before[:, :k], after[:, :k], atol=1e-6, rtol=0)
    assert bool(((before[:, k:] - after[:, k:]).abs().amax(-1) > 1e-4).all())


def _loss_and_grads(module: HFCausalLM, rows: torch.Tensor, targets: torch.Tensor):
    params = [p for _, p in module.model.named_parameters()]
    losses = NextTokenLoss().per_sample(module(rows), targets)
    grads = torch.autograd.grad(losses.sum(), params)
    return losses.detach(), torch.cat([g.reshape(-1) for g in grads])


def test_padding_changes_nothing(lm):
    """The documents right-padded to 10 and to 16 columns (padding ids [PAD] or any other id) give
    transformers' own next-token loss of each document alone, and its summed parameter gradient."""
    folder, model = lm
    module = load_hf_causal_lm(folder).module
    results = []
    for length, pad_id in ((10, None), (16, None), (16, VOCAB["star"])):
        ids, attention = _tokens(folder, DOCS, length)
        assert ids.shape == (3, length) and not bool(attention.all())
        if pad_id is not None:  # the attention block, never the id, says what is padding
            ids = ids.masked_fill(attention == 0, pad_id)
        rows, targets = pack_rows(ids, attention), targets_for(ids, attention)
        with torch.no_grad():
            logits = module(rows)
        assert logits.shape == (3, length, V)
        assert bool((logits[:, 9:] == 0).all())  # columns past the longest document: zeros
        results.append(_loss_and_grads(module, rows, targets))

    truth_losses, truth_grad = [], None
    params = [p for _, p in model.named_parameters()]
    for doc in DOCS:
        ids, _ = _tokens(folder, [doc])
        loss = model(input_ids=ids, labels=ids).loss  # transformers' mean next-token cross-entropy
        grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
        truth_losses.append(loss.detach())
        truth_grad = grad if truth_grad is None else truth_grad + grad
    assert truth_grad is not None
    truth = torch.stack(truth_losses)

    (loss10, grad10), *others = results
    assert torch.allclose(loss10, truth, atol=1e-5, rtol=0), (loss10 - truth).abs().max()
    assert (grad10 - truth_grad).norm() <= 1e-4 * truth_grad.norm()
    for losses, grads in others:
        assert torch.allclose(losses, loss10, atol=1e-6, rtol=0), (losses - loss10).abs().max()
        assert (grads - grad10).norm() <= 1e-5 * grad10.norm()


def test_the_loaded_model_is_a_next_token_task(lm):
    folder, model = lm
    loaded = load_hf_causal_lm(folder)
    task = loaded.task()
    assert isinstance(task, Task) and isinstance(task.loss, NextTokenLoss) and task.n_classes == V
    ids, attention = _tokens(folder, DOCS, 12)
    rows = pack_rows(ids, attention)
    logits = task.logits(rows)
    assert logits.shape == (3, 12, V)
    targets = task.targets(targets_for(ids, attention), torch.float64)
    assert targets.shape == (3, 24) and targets.dtype == torch.float64


# --------------------------------------------------------------------------- what the loader reports


def test_source_names_the_task_and_the_loss(lm):
    folder, model = lm
    loaded = load_hf_causal_lm(folder)
    src = loaded.source
    assert isinstance(loaded.loss, NextTokenLoss)
    assert loaded.n_classes == V and loaded.inputs.kind == "flat" and loaded.n_features is None
    assert src["kind"] == "huggingface" and src["task"] == "causal-lm"
    assert src["loss"] == "next-token cross-entropy"
    assert src["architecture"] == type(model).__name__ and src["model_type"] == model.config.model_type
    assert src["vocab_size"] == V
    assert src["parameters"] == sum(p.numel() for p in model.parameters())
    assert src["weights"] == ["model.safetensors"] and src["weights_format"] == "safetensors"
    assert src["transformers_version"] == transformers.__version__ and src["tokenizer_json"] is True
    if model.config.model_type == "gpt2":  # no pad id in the config: its end-of-text id
        assert src["max_length"] == 32 and src["pad_token_id"] == EOS and src["pad_token_from"] == "config eos_token_id"
    else:
        assert src["max_length"] == 64 and src["pad_token_id"] == PAD and src["pad_token_from"] == "config pad_token_id"
    assert loaded.module.pad_token_id == src["pad_token_id"] and loaded.module.max_length == src["max_length"]


def test_llama_loads_with_grouped_query_attention_and_rotary_positions(lm):
    folder, model = lm
    if model.config.model_type != "llama":
        pytest.skip("Llama only")
    inner = load_hf_causal_lm(folder).module.model
    attention = inner.model.layers[0].self_attn
    # 4 query heads share 2 key/value heads of size 8
    assert attention.q_proj.out_features == 32 and attention.k_proj.out_features == 16
    assert attention.v_proj.out_features == 16 and inner.config.num_key_value_heads == 2
    assert hasattr(inner.model, "rotary_emb")


# --------------------------------------------------------------------------- refusals


def test_custom_code_is_refused_and_never_imported(lm, tmp_path):
    folder = _copy(lm[0], tmp_path)
    marker = tmp_path / "imported"
    (folder / "evil_modeling.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('imported')\n")
    _edit_config(
        folder,
        lambda c: {
            **c,
            "architectures": ["EvilForCausalLM"],
            "auto_map": {"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"},
        },
    )
    for load in (load_hf_causal_lm, lambda f: load_hf_causal_lm(f, trust_pickle=True), load_hf_directory):
        with pytest.raises(AuditError, match="custom modelling code.*does not run code from a checkpoint"):
            load(folder)
    assert not marker.exists() and "evil_modeling" not in sys.modules


def test_pickle_weights_need_trust(lm, tmp_path):
    folder, model = lm
    folder = _copy(folder, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(AuditError, match="pickle-based file.*--trust-pickle"):
        load_hf_causal_lm(folder)
    loaded = load_hf_causal_lm(folder, trust_pickle=True)
    assert loaded.source["weights_format"] == "pickle" and loaded.source["weights"] == ["pytorch_model.bin"]
    ids, attention = _tokens(folder, [DOCS[0]])
    with torch.no_grad():
        assert torch.allclose(loaded.module(pack_rows(ids, attention)), model(input_ids=ids).logits, atol=1e-5)


def test_the_two_loaders_point_at_each_other(lm, tmp_path):
    with pytest.raises(AuditError, match="causal language model.*load_hf_causal_lm"):
        load_hf_directory(lm[0])
    folder = _copy(lm[0], tmp_path)
    name = "GPT2ForSequenceClassification" if lm[1].config.model_type == "gpt2" else "LlamaForSequenceClassification"
    _edit_config(folder, lambda c: {**c, "architectures": [name]})
    with pytest.raises(AuditError, match=f"holds {name}, not a causal language model.*load_hf_directory"):
        load_hf_causal_lm(folder)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: {**c, "n_layer": 10**12, "num_hidden_layers": 10**12}, r"must be an integer in 1\.\.1024"),
        (lambda c: {**c, "vocab_size": -1}, "vocab_size must be an integer"),
        (lambda c: {**c, "architectures": ["NoSuchForCausalLM"]}, "no model class NoSuchForCausalLM"),
        (lambda c: {**c, "architectures": ["GPT2Model"]}, "ForCausalLM or LMHeadModel"),
        (lambda c: {**c, "quantization_config": {"quant_method": "bitsandbytes"}}, "quantized checkpoints"),
    ],
)
def test_hostile_configs_are_refused(lm, tmp_path, edit, message):
    folder = _copy(lm[0], tmp_path)
    _edit_config(folder, edit)
    with pytest.raises(AuditError, match=message):
        load_hf_causal_lm(folder)


def test_rows_the_model_cannot_read_are_refused(lm):
    folder, model = lm
    module = load_hf_causal_lm(folder).module
    limit = module.max_length
    assert limit is not None
    long = torch.full((1, limit + 1), VOCAB["cat"])
    with pytest.raises(AuditError, match=f"longer than the model's {limit} positions"):
        module(pack_rows(long, torch.ones_like(long)))
    bad = torch.tensor([[VOCAB["cat"], V + 3]])
    with pytest.raises(AuditError, match=f"token ids must be integers in 0..{V - 1}"):
        module(pack_rows(bad, torch.ones_like(bad)))
