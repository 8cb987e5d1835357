"""Write a small text classifier with its own tokenizer, a JSON-lines data file, and audit it.

    python examples/text/make_text_checkpoint.py [FOLDER]

FOLDER (default: a temporary one) receives text-model/ (a BERT-shaped Hugging Face folder:
config.json, model.safetensors, tokenizer.json), reviews.jsonl (generated review-like texts
with a sentiment label: a documented synthetic set, no licence needed) and the audit file,
then the audit runs through the library (attnaudit.audit.request). Needs attnaudit[hf].
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch

POSITIVE = ["good", "great", "fine", "moving", "sharp", "warm", "clever", "lovely"]
NEGATIVE = ["bad", "dull", "weak", "thin", "slow", "cold", "clumsy", "boring"]
NOUNS = ["film", "movie", "plot", "acting", "script", "score", "ending", "cast"]
FILLER = ["the", "a", "very", "quite", "really", "and", "but", "was", "is", "not"]


def write_data(path: Path, n: int = 200, seed: int = 0, phrases: tuple[int, int] = (1, 4)) -> None:
    """``n`` reviews of ``phrases`` (low, high) three-word phrases each (a phrase: filler,
    sentiment word, noun), labelled by the sentiment words drawn."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(n):
            label = rng.choice(["negative", "positive"])
            words = POSITIVE if label == "positive" else NEGATIVE
            text = " ".join(
                rng.choice(FILLER) + " " + rng.choice(words) + " " + rng.choice(NOUNS)
                for _ in range(rng.randint(*phrases))
            )
            fh.write(json.dumps({"text": text, "label": label}) + "\n")


def write_model(folder: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *POSITIVE, *NEGATIVE, *NOUNS, *FILLER])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        pad_token_id=0,
        label2id={"negative": 0, "positive": 1},
        id2label={0: "negative", 1: "positive"},
    )
    transformers.BertForSequenceClassification(config).eval().save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Write a small BERT-shaped classifier, its tokenizer and reviews, and audit it."
    )
    parser.add_argument("folder", nargs="?", type=Path, help="where to write (default: a new temporary folder)")
    folder = parser.parse_args().folder or Path(tempfile.mkdtemp(prefix="attnaudit-text-"))
    folder.mkdir(parents=True, exist_ok=True)
    write_model(folder / "text-model")
    write_data(folder / "reviews.jsonl")
    shutil.copy(Path(__file__).with_name("audit_text_checkpoint.yaml"), folder / "audit_text_checkpoint.yaml")
    from attnaudit.audit.request import AuditRequest, run

    import os

    os.chdir(folder)  # the audit file's paths are relative to where it runs
    result = run(AuditRequest(file="audit_text_checkpoint.yaml"))
    for line in result.verdicts:
        print(line)
    print(f"files in {folder}")
    return int(result.results["summary"]["exit_code"])


if __name__ == "__main__":
    raise SystemExit(main())
