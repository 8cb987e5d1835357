"""Audit a user-written vision transformer with the Python API: influence, landscape, eNTK.

The model below is ordinary PyTorch (patch embedding, softmax attention through
``scaled_dot_product_attention``, LayerNorm, dropout, a linear head). attnaudit needs no
special case for it: a ``Task`` says how flat data rows become images and which
parameters to track, and every analysis runs through the same engine.

Run: python examples/transformer_api.py   (digits, CPU, about half a minute)
"""

from __future__ import annotations

import torch
from torch import nn

import attnaudit as aa


class TinyViT(nn.Module):
    """8x8 grey images -> 4 patches of 4x4 -> one attention block -> 10 logits."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 10):
        super().__init__()
        self.heads = heads
        self.embed = nn.Linear(16, dim)
        self.pos = nn.Parameter(torch.zeros(4, dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        patches = images.reshape(b, 1, 2, 4, 2, 4).permute(0, 2, 4, 1, 3, 5).reshape(b, 4, 16)
        tokens = self.embed(patches) + self.pos
        q, k, v = self.qkv(self.norm(tokens)).chunk(3, dim=-1)
        split = lambda t: t.reshape(b, 4, self.heads, -1).transpose(1, 2)  # noqa: E731
        attended = nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
        tokens = tokens + self.drop(attended.transpose(1, 2).reshape(b, 4, -1))
        return self.head(tokens.mean(1))


def main() -> None:
    ds = aa.load_dataset(aa.DataSpec(dataset="digits", n=300, seed=0, stratify=True))
    train, test = aa.holdout_split(ds, 200, 100, seed=0)
    gen = torch.Generator().manual_seed(0)
    model = TinyViT()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    images = train.X.float().reshape(-1, 1, 8, 8)
    for _ in range(150):  # a quick full-batch fit; the audit does not care how the model was trained
        opt.zero_grad()
        nn.functional.cross_entropy(model(images), train.y).backward()
        opt.step()

    task = aa.Task(model, n_classes=10, loss="ce", inputs=aa.Inputs("images", ds.feature_shape), params="head")
    print("tracked by 'head':", task.parameter_names(probe=train.X.float()))

    influence = aa.compute_influence(
        task, train.X, train.y, test.X, test.y, aa.InfluenceConfig(estimator="exact", damping=1e-2)
    )
    order = influence.total.argsort()
    print(
        f"influence ({influence.path}): most helpful training rows {order[:5].tolist()}, most harmful {order[-5:].tolist()}"
    )

    all_params = aa.Task(model, 10, "ce", aa.Inputs("images", ds.feature_shape), params="all")
    land = aa.analyse_landscape(
        all_params,
        train.X,
        train.y,
        aa.LandscapeConfig(points=11, grid=0, top_k=3, hutchinson_samples=10, basin_directions=2),
    )
    print(
        f"landscape: loss {land.loss:.4f}, top Hessian eigenvalues {[round(v, 4) for v in land.eigen.eigenvalues]}, "
        f"trace {land.trace.estimate:.3f} +- {land.trace.stderr:.3f}"
    )

    ntk = aa.empirical_ntk(all_params, test.X[:16])
    trace = torch.einsum("iicc->", ntk.kernel).item()
    print(f"empirical NTK ({ntk.path}): shape {tuple(ntk.kernel.shape)}, trace {trace:.4g}")
    print("model untouched:", model.training, next(model.parameters()).dtype)


if __name__ == "__main__":
    main()
