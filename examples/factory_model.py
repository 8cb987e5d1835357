"""A user's own transformer, audited with ``--factory``.

attnaudit never unpickles a model class from a file: for your own ``torch.nn.Module`` you
give the function that builds it (``--factory module:function``, called without
arguments) and the weights as safetensors (``--weights``). The weights are checked against
the built module key by key and shape by shape before anything runs.

Train it on the embedded digits (8x8 images) and save the weights::

    cd examples && python factory_model.py digits_tiny.safetensors

then audit it (from the same folder, so that ``factory_model`` imports)::

    attnaudit malleability --factory factory_model:build --weights digits_tiny.safetensors \\
        --loss ce --protocol static --no-controls --attacks pgd,random --seeds 2
    attnaudit landscape --factory factory_model:build --weights digits_tiny.safetensors --loss ce

The model takes images (B, 1, 8, 8), so attnaudit feeds the data set's images (``--inputs
auto`` picks images for image data; ``audit_inputs()`` below would override that), and it
returns a dict with ``logits``, which attnaudit reads like a Hugging Face output.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


class TinyTransformer(nn.Module):
    """Rows of an 8x8 image as 8 tokens, one softmax-attention block, mean pool, linear head."""

    def __init__(self, side: int = 8, dim: int = 16, n_classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(side, dim)
        self.pos = nn.Parameter(torch.zeros(side, dim))
        self.attn = nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, n_classes)

    def forward(self, images: torch.Tensor) -> dict:
        tokens = self.embed(images[:, 0]) + self.pos  # (B, 8, dim): one token per image row
        mixed, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        return {"logits": self.classifier(self.norm(tokens + mixed).mean(1))}


def build() -> nn.Module:
    """The factory attnaudit calls: same architecture every time (weights come from --weights)."""
    torch.manual_seed(0)
    return TinyTransformer()


def main(out: str) -> None:
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    digits = load_digits()
    X = torch.tensor(digits.images / 16.0, dtype=torch.float32)[
        :, None
    ]  # (n, 1, 8, 8) in [0, 1], as attnaudit loads them
    y = torch.tensor(digits.target)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        for idx in torch.randperm(len(X), generator=gen).split(64):
            loss = nn.functional.cross_entropy(model(X[idx])["logits"], y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = (model(X)["logits"].argmax(1) == y).float().mean().item()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    print(f"saved {out} (train accuracy {100 * acc:.1f}%)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "digits_tiny.safetensors")
