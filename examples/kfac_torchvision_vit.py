"""EK-FAC influence on torchvision's VisionTransformer, judged against exact influence.

torchvision's ViT embeds patches with an ``nn.Conv2d`` and attends with
``nn.MultiheadAttention``, whose packed projections torch applies without calling a
module. attnaudit's K-FAC covers both (a convolution as a linear layer on its unfolded
patches; the attention projections recomputed in a checked temporary hook), and leaves the
class token, position embedding and LayerNorms out with a warning.

K-FAC approximates the Gauss-Newton matrix, not the Hessian, so the fair reference for its
approximation error is exact influence with the Gauss-Newton matrix
(``InfluenceConfig(estimator="exact", curvature="ggn")``); exact Hessian influence differs
from both wherever the trained network's Hessian is indefinite. This script prints, per
layer type, the Pearson correlation of EK-FAC and K-FAC with exact Gauss-Newton influence,
and of exact Hessian influence with it.

Run: python examples/kfac_torchvision_vit.py                        (digits, about 20 s on 2 cores)
     python examples/kfac_torchvision_vit.py --data-dir ../shared/data (real MNIST test split, about 1 min)
"""

from __future__ import annotations

import argparse
import warnings

import torch
from scipy.stats import pearsonr
from torchvision.models import VisionTransformer

from attnaudit.core.task import Inputs, Task
from attnaudit.data import DataSpec, load_dataset
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence


def build(side: int, patch: int, classes: int) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=side, patch_size=patch, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=classes
    )
    model.conv_proj = torch.nn.Conv2d(1, 16, patch, stride=patch)  # grey images: one input channel
    return model.double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="folder holding MNIST/ (else the embedded digits)")
    parser.add_argument("--n-train", type=int, default=300, help="training rows scored")
    parser.add_argument("--n-test", type=int, default=20, help="test rows")
    args = parser.parse_args()
    if args.data_dir:
        data = load_dataset(DataSpec(dataset="mnist", data_dir=args.data_dir, split="test", n=2500))
        side, patch = 28, 7
    else:
        data = load_dataset(DataSpec(dataset="digits", split="train"))
        side, patch = 8, 4
    X, y = data.X.double(), data.y
    n_fit = min(2000, X.shape[0] - args.n_test)
    X_fit, y_fit, X_test, y_test = X[:n_fit], y[:n_fit], X[n_fit : n_fit + args.n_test], y[n_fit : n_fit + args.n_test]

    model = build(side, patch, 10)
    optimiser = torch.optim.Adam(model.parameters(), 3e-3)
    for _ in range(10):  # a short, ordinary training run
        for batch in torch.randperm(n_fit).split(100):
            loss = torch.nn.functional.cross_entropy(model(X_fit[batch].view(-1, 1, side, side)), y_fit[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(X_test.view(-1, 1, side, side)).argmax(1) == y_test).double().mean().item()
    print(
        f"torchvision ViT, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"accuracy {accuracy:.1%} on {len(y_test)} held-out rows"
    )

    task = Task(model, 10, "ce", Inputs("images", (1, side, side)))
    prefix = "encoder.layers.encoder_layer_0."
    groups = {
        "patch embedding (Conv2d)": ("conv_proj.weight", "conv_proj.bias"),
        "attention (MultiheadAttention)": tuple(
            prefix + "self_attention." + n
            for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
        ),
        "MLP (Linear)": tuple(prefix + n for n in ("mlp.0.weight", "mlp.0.bias", "mlp.3.weight", "mlp.3.bias")),
        "head (Linear)": ("heads.head.weight", "heads.head.bias"),
    }
    rows = (X_fit[: args.n_train], y_fit[: args.n_train], X_test, y_test)
    print(f"{'parameters':32s} {'damping':>8s} {'EK-FAC':>7s} {'K-FAC':>7s} {'Hessian':>8s}   (Pearson with exact GGN)")
    for name, params in groups.items():
        for damping in (0.1, 1.0):
            scores = {}
            for label, extra in (
                ("ggn", dict(estimator="exact", curvature="ggn")),
                ("ekfac", dict(estimator="ekfac")),
                ("kfac", dict(estimator="kfac")),
                ("hessian", dict(estimator="exact")),
            ):
                config = InfluenceConfig(damping=damping, per_test=True, params=params, **extra)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    scores[label] = compute_influence(task, *rows, config).per_test.flatten()
            r = {k: pearsonr(scores[k], scores["ggn"])[0] for k in ("ekfac", "kfac", "hessian")}
            print(f"{name:32s} {damping:8g} {r['ekfac']:7.3f} {r['kfac']:7.3f} {r['hessian']:8.3f}")


if __name__ == "__main__":
    main()
