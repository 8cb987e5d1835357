"""Sharpness at the trained minimum: top Hessian eigenvalues, Hutchinson trace, basin width.

Run: python examples/landscape_api.py   (digits, embedded; about 10 s on 2 cores)
"""

from attnaudit.data import DataSpec, load_dataset
from attnaudit.landscape import LandscapeConfig, analyze_landscape, train_reference_model
from attnaudit.training import TrainConfig

digits = load_dataset(DataSpec(dataset="digits", n=300, seed=0))
for arch in ("relu", "attn"):
    model, trained = train_reference_model(
        arch, digits.X, digits.y, n_classes=digits.n_classes, width=128, seed=0,
        train_config=TrainConfig(loss="mse", lr=4.0, steps=500),
    )
    res = analyze_landscape(model, digits.X, digits.y, LandscapeConfig(top_k=3, grid=0, points=0))
    print(f"{arch}: training loss {trained.final_loss:.4f}, top eigenvalues {[round(v, 4) for v in res.eigen.eigenvalues]}, "
          f"trace {res.trace.estimate:.3f} +- {res.trace.stderr:.3f}, basin width {res.basin.width:.3f}")
