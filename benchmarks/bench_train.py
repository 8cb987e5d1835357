"""Benchmark: ``attnaudit.core.fit.fit`` (the code path of ``attnaudit train``) against a plain
PyTorch training loop, on the built-in MNIST ViT recipe.

Both sides train the same model (``ViT(ViTSpec('vit', (1, 28, 28), 10))``: patch 7, 16
tokens, dim 64, depth 2, 4 heads, 71,946 parameters, float32; each side gets its own
copy of the same initialisation) with the recipe ``attnaudit train`` uses for ViTs: Adam,
lr 1e-3, batch 64, cross-entropy, ``--epochs`` passes over ``--n`` rows of the MNIST test
split in ``../shared/data`` (the embedded 8x8 digits, patch 2, when MNIST is absent).

* fit: ``fit(model, X, y, Recipe('adam', 1e-3, batch_size=64, epochs=E, loss='ce', seed=0))``,
  which also measures the loss and accuracy of the whole training set at the end;
* plain loop: ``torch.optim.Adam``, the same batches in the same order (per epoch
  ``torch.randperm(n, generator)`` from a generator seeded 0, consecutive slices of 64),
  ``F.cross_entropy`` on ``model(x.reshape(B, 1, 28, 28))``, ``zero_grad``, ``backward``,
  ``step``, with the model in eval mode (as fit runs it) and, at the end, the same
  full-training-set loss and accuracy under ``no_grad`` (so both sides do the same work).

The two runs must end with the same model (checked on the logits of the training rows:
float32 round-off only, since the losses are written differently; the weights themselves are
not compared because the key biases of softmax attention get an exactly zero gradient,
whose round-off Adam turns into arbitrary, harmless steps). Each side is warmed up once, then timed as the best of
``--repeats`` runs with ``time.perf_counter``. ``RATIO train_vs_plain_loop`` = fit time /
plain-loop time (goal <= 1.2); a second line compares the training loops alone (fit's
``seconds``, which excludes the final evaluation).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train.py [--n 2000 --epochs 2 --repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnaudit.data import DataSpec, load_dataset, subset
from attnaudit.core.fit import Recipe, fit
from attnaudit.models.vit import ViT, ViTSpec, default_patch

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def load(n: int):
    if (SHARED / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists():
        ds = load_dataset(DataSpec("mnist", data_dir=str(SHARED), split="test"))
        shape = (1, 28, 28)
    else:
        ds = load_dataset(DataSpec("digits", split="train"))
        shape = (1, 8, 8)
    ds = subset(ds, min(n, ds.n), seed=0)
    return ds.name, ds.X.float(), ds.y, shape


def plain_loop(model: ViT, X: torch.Tensor, y: torch.Tensor, shape, epochs: int, batch: int) -> tuple[float, float]:
    """The textbook loop; returns (seconds of the loop alone, seconds in all)."""
    t0 = time.perf_counter()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    n = X.shape[0]
    model.eval()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for a in range(0, n, batch):
            idx = perm[a : a + batch]
            loss = F.cross_entropy(model(X[idx].reshape(-1, *shape)), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    t_loop = time.perf_counter() - t0
    with torch.no_grad():
        logits = model(X.reshape(-1, *shape))
        F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()
    return t_loop, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="training rows")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name, X, y, shape = load(args.n)
    spec = ViTSpec("vit", shape, 10, patch=default_patch(shape))
    recipe = Recipe("adam", 1e-3, batch_size=args.batch, epochs=args.epochs, loss="ce", seed=0)
    print(
        f"{name}: {X.shape[0]} rows {shape}, ViT patch {spec.patch} ({spec.tokens} tokens), "
        f"{sum(p.numel() for p in ViT(spec).parameters()):,} parameters; adam, batch {args.batch}, "
        f"{args.epochs} epoch(s) = {recipe.total_steps(X.shape[0])} steps; torch {torch.__version__}, "
        f"threads={torch.get_num_threads()}",
        file=sys.stderr,
    )

    def run_fit():
        model = ViT(spec)
        t0 = time.perf_counter()
        result = fit(model, X, y, recipe)
        return time.perf_counter() - t0, result.seconds, model

    def run_plain():
        model = ViT(spec)
        t_loop, t_all = plain_loop(model, X, y, shape, args.epochs, args.batch)
        return t_all, t_loop, model

    run_fit(), run_plain()  # warm-up
    fit_runs, plain_runs = [], []
    for _ in range(args.repeats):  # interleaved, so a busy neighbour slows both sides alike
        fit_runs.append(run_fit())
        plain_runs.append(run_plain())
    t_fit, t_fit_loop = min(r[0] for r in fit_runs), min(r[1] for r in fit_runs)
    t_plain, t_plain_loop = min(r[0] for r in plain_runs), min(r[1] for r in plain_runs)
    with torch.no_grad():
        images = X.reshape(-1, *shape)
        a, b = fit_runs[0][2](images), plain_runs[0][2](images)
    worst = float((a - b).abs().max() / b.abs().max())
    print(
        f"fit {t_fit:.3f}s (loop {t_fit_loop:.3f}s), plain loop {t_plain:.3f}s (loop {t_plain_loop:.3f}s); "
        f"trained logits differ by {worst:.1e} (relative)"
    )
    assert worst < 1e-3, f"fit and the plain loop trained different models: {worst:.2e}"
    print(f"RATIO train_loop_only_vs_plain_loop={t_fit_loop / t_plain_loop:.3f}")
    print(f"RATIO train_vs_plain_loop={t_fit / t_plain:.3f}")


if __name__ == "__main__":
    main()
