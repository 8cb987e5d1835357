"""Sharpness at the trained minimum: top Hessian eigenvalues, Hutchinson trace, basin width.

Part 1: the two built-in reference nets (the structured fast path evaluates their surfaces).
Part 2: the same analysis on a user-written attention module that takes images, described
by a Task (generic engine path: eval mode, math attention kernel; the module is not modified).

Run: python examples/landscape_api.py   (digits, embedded; about 10 s on one core)
"""

import torch
from torch import nn

from attnaudit.core.task import Inputs, Task
from attnaudit.data import DataSpec, load_dataset
from attnaudit.analyses.landscape import LandscapeConfig, analyse_landscape, train_reference_model
from attnaudit.core.training import TrainConfig

digits = load_dataset(DataSpec(dataset="digits", n=300, seed=0))
for arch in ("relu", "attn"):
    model, trained = train_reference_model(
        arch,
        digits.X,
        digits.y,
        n_classes=digits.n_classes,
        width=128,
        seed=0,
        train_config=TrainConfig(loss="mse", lr=4.0, steps=500),
    )
    res = analyse_landscape(model, digits.X, digits.y, LandscapeConfig(top_k=3, grid=0, points=0))
    print(
        f"{arch}: training loss {trained.final_loss:.4f}, top eigenvalues {[round(v, 4) for v in res.eigen.eigenvalues]}, "
        f"trace {res.trace.estimate:.3f} +- {res.trace.stderr:.3f}, basin width {res.basin.width:.3f} [{res.path}]"
    )


class RowAttention(nn.Module):
    """Each image row is a token: trainable Q/K/V, torch's scaled_dot_product_attention, a linear head."""

    def __init__(self, side: int = 8, dim: int = 16, classes: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(side, dim, bias=False) for _ in range(3))
        self.drop = nn.Dropout(0.1)  # inactive during the analysis (eval mode)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = images.flatten(1, 2)  # (B, 1, 8, 8) -> (B, 8 rows, 8 pixels)
        att = nn.functional.scaled_dot_product_attention(self.q(tokens), self.k(tokens), self.v(tokens))
        return self.head(self.drop(att.mean(1)))


net = RowAttention()
task = Task(net, n_classes=digits.n_classes, loss="ce", inputs=Inputs("images", (1, *digits.feature_shape)))
res = analyse_landscape(task, digits.X, digits.y, LandscapeConfig(top_k=2, grid=0, points=11, basin_directions=2))
print(
    f"RowAttention ({res.n_params} parameters, untrained): loss {res.loss:.4f}, top eigenvalues "
    f"{[round(v, 4) for v in res.eigen.eigenvalues]}, trace {res.trace.estimate:.3f} [{res.path}, HVP {res.hvp_mode}]"
)
head = analyse_landscape(
    task, digits.X, digits.y, LandscapeConfig(params=("head",), top_k=2, grid=0, points=0, basin_directions=2)
)
print(f"  head only ({', '.join(head.param_names)}): top eigenvalues {[round(v, 4) for v in head.eigen.eigenvalues]}")
