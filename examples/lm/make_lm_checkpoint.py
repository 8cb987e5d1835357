"""Write a small causal language model with its own tokenizer, a JSON-lines file of documents, and audit it.

    python examples/lm/make_lm_checkpoint.py [FOLDER] [--arch gpt2|llama]

FOLDER (default: a temporary one) receives lm/ (a GPT-2-shaped Hugging Face folder, or a
Llama-shaped one with grouped-query attention and rotary positions: config.json,
model.safetensors, tokenizer.json), base-lm/ (the same model before its short training: the
reference of ntk-distance), documents.jsonl (generated sentences from a small grammar: a
documented synthetic set, no licence needed) and the audit file, then the audit runs through
the library (attnaudit.audit.request). Needs attnaudit[hf].
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch

SUBJECTS = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a child"]
VERBS = ["sees", "likes", "finds", "follows", "helps", "calls"]
OBJECTS = ["the ball", "a tree", "the house", "a river", "the garden", "a book"]
ENDINGS = ["today", "again", "slowly", "at night", "in the park", "with care"]
WORDS = sorted({w for phrase in SUBJECTS + VERBS + OBJECTS + ENDINGS for w in phrase.split()} | {"and", "."})
SPECIALS = ["<|pad|>", "<|unk|>", "<|endoftext|>"]


def write_documents(path: Path, n: int = 120, seed: int = 0, sentences: tuple[int, int] = (1, 3)) -> None:
    """``n`` documents of ``sentences`` (low, high) sentences each (subject verb object [ending] .)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(n):
            parts = []
            for _ in range(rng.randint(*sentences)):
                sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
                if rng.random() < 0.5:
                    sentence += " " + rng.choice(ENDINGS)
                parts.append(sentence + " .")
            fh.write(json.dumps({"text": " ".join(parts)}) + "\n")


def write_tokenizer(folder: Path) -> int:
    """tokenizer.json (a word-level vocabulary of the grammar's words); returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    return len(vocab)


def build_model(vocab: int, arch: str = "gpt2", positions: int = 64, seed: int = 0):
    """A 2-layer causal LM of width 32 (GPT-2, or Llama with 4 query and 2 key/value heads)."""
    import transformers

    torch.manual_seed(seed)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=positions,
            n_embd=32,
            n_layer=2,
            n_head=2,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=2,
        )
        return transformers.GPT2LMHeadModel(config).eval()
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=positions,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=2,
        )
        return transformers.LlamaForCausalLM(config).eval()
    raise SystemExit(f"--arch must be gpt2 or llama, got {arch}")


def train_briefly(model, documents: Path, tokenizer: Path, steps: int = 60, lr: float = 3e-3) -> None:
    """A few Adam steps of next-token training on the documents (the checkpoint of the audit)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    texts = [json.loads(line)["text"] for line in documents.read_text(encoding="utf-8").splitlines()]
    encoded = [tok.encode(t).ids + [2] for t in texts]
    length = max(len(e) for e in encoded)
    ids = torch.tensor([e + [0] * (length - len(e)) for e in encoded])
    mask = (torch.arange(length) < torch.tensor([len(e) for e in encoded])[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = torch.randperm(len(ids), generator=generator)[:32]
        loss = model(input_ids=ids[batch], attention_mask=mask[batch], labels=labels[batch]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def write_checkpoints(folder: Path, arch: str = "gpt2", n_documents: int = 120) -> None:
    """base-lm/ (random initialisation), lm/ (base-lm trained briefly on documents.jsonl) and the documents."""
    folder.mkdir(parents=True, exist_ok=True)
    write_documents(folder / "documents.jsonl", n=n_documents)
    for name in ("base-lm", "lm"):
        (folder / name).mkdir(exist_ok=True)
        vocab = write_tokenizer(folder / name)
    model = build_model(vocab, arch)
    model.save_pretrained(folder / "base-lm")
    train_briefly(model, folder / "documents.jsonl", folder / "lm")
    model.save_pretrained(folder / "lm")


def main() -> int:
    parser = argparse.ArgumentParser(description="Write a small causal LM, its tokenizer and documents, and audit it.")
    parser.add_argument("folder", nargs="?", type=Path, help="where to write (default: a new temporary folder)")
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2", help="the model's shape (default gpt2)")
    options = parser.parse_args()
    arch = options.arch
    folder = options.folder or Path(tempfile.mkdtemp(prefix="attnaudit-lm-"))
    write_checkpoints(folder, arch)
    shutil.copy(Path(__file__).with_name("audit_lm_checkpoint.yaml"), folder / "audit_lm_checkpoint.yaml")
    import os

    from attnaudit.audit.request import AuditRequest, run

    os.chdir(folder)  # the audit file's paths are relative to where it runs
    result = run(AuditRequest(file="audit_lm_checkpoint.yaml"))
    for line in result.verdicts:
        print(line)
    print(f"files in {folder}")
    return int(result.results["summary"]["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
