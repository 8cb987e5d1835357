"""Train the small text classifier of make_text_checkpoint.py, keeping its initialization.

    python examples/text/train_text_checkpoint.py FOLDER [STEPS]

FOLDER is what make_text_checkpoint.py wrote (text-model/, reviews.jsonl). The untrained
text-model/ is copied to text-init/ (the reference ``ntk-distance --checkpoint`` compares
with: a Hugging Face folder records no initialization), then text-model/ is trained for
STEPS (default 100) Adam steps (lr 1e-3, batches of 32 texts, cross-entropy) and saved in
place with its tokenizer. Needs attnaudit[hf]. A few seconds on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


def main() -> int:
    import transformers
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(
        description="Fine-tune the text example's model briefly, keeping its start as text-init/."
    )
    parser.add_argument("folder", type=Path, help="the folder make_text_checkpoint.py wrote")
    parser.add_argument("steps", nargs="?", type=int, default=100, help="Adam steps (default 100)")
    options = parser.parse_args()
    folder, steps = options.folder, options.steps
    model_dir, init_dir = folder / "text-model", folder / "text-init"
    shutil.rmtree(init_dir, ignore_errors=True)
    shutil.copytree(model_dir, init_dir)

    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    limit = model.config.max_position_embeddings
    tok.enable_truncation(limit)
    tok.enable_padding(pad_id=model.config.pad_token_id or 0)
    records = [json.loads(line) for line in (folder / "reviews.jsonl").read_text(encoding="utf-8").splitlines()]
    enc = tok.encode_batch([r["text"] for r in records])
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    labels = torch.tensor([model.config.label2id[r["label"]] for r in records])

    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        batch = torch.randint(0, len(records), (32,))
        out = model(input_ids=ids[batch], attention_mask=mask[batch], labels=labels[batch])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(input_ids=ids, attention_mask=mask).logits.argmax(-1) == labels).float().mean().item()
    model.save_pretrained(model_dir)
    print(f"trained {steps} steps: training accuracy {accuracy:.1%}; initialization kept in {init_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
