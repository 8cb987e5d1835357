"""Default training recipes of the built-in model families (no torch import: read at start-up).

``attnaudit train`` uses them for a family's fields left unset, and the ntk-distance
transformer sweep trains its ViTs with the ViT recipe; docs/train.md explains each choice.
"""

from __future__ import annotations

VIT_DEFAULTS = dict(
    optimizer="adam", lr=1e-3, epochs=5, loss="ce", dtype="float32", depth=2, dim=64, heads=4, mlp_ratio=2
)
TWO_LAYER_DEFAULTS = dict(optimizer="gd", lr=4.0, steps=300, loss="mse", dtype="float64", width=64)
MINI_BATCH = 64  # default batch_size for sgd and adam
