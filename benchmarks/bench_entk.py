"""Benchmark: closed-form empirical NTK vs torch.func Jacobian contraction.

1. ``RATIO entk_closed_vs_jacobian``: the full (n, n, c, c) empirical NTK of a 2-layer
   ReLU net at n = 512, d = 784, m = 4096, c = 10, by
   * the closed form (``attnaudit.core.ntk.entk_two_layer``: matrix products only), and
   * the Jacobian contraction of PyTorch's NTK tutorial (``attnaudit.core.ntk.entk_jacobian``,
     the generic engine path ``Engine.entk``: ``vmap(jacrev)`` per-sample Jacobians,
     ``einsum('iap,jbp->ijab')`` over parameters).
   ``attnaudit.core.ntk.empirical_ntk`` picks the closed form for this model (its declared fast
   path); the line printed first says which path it chose.
   Both run in float32: one sample's Jacobian is c * P = 10 * 3.25e6 numbers, 260 MB in
   float64, so the 512 Jacobians (133 GB in float64, 66 GB in float32) cannot be held at
   once and the Jacobian method works in chunks (X2's Jacobians are recomputed for every
   X1 chunk). Its cost is linear in the rows of X1 (every row block contracts with all
   512 columns), so by default it is timed on one chunk of rows of X1 against all 512
   columns and scaled by the number of chunks; ``--jac-rows 512`` times it in full (hours
   on 2 CPU cores). The two methods' values on the timed rows are
   compared, and the printed line says which was done. Goal: ratio >= 10.
2. ``--paper-preset``: runs the ``paper`` preset of ``ntk-distance`` on real MNIST (test
   split, ../shared/data) through the library and prints its wall time.

Run: ``python benchmarks/bench_entk.py [--jac-rows 8] [--paper-preset] [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.ntk import empirical_ntk, entk_jacobian, entk_two_layer

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def mnist_or_noise(n: int) -> tuple[torch.Tensor, str]:
    try:
        from attnaudit.data import DataSpec, load_dataset

        X = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=n, seed=0)).X
        return X, "real MNIST test split"
    except Exception:  # noqa: BLE001 - the benchmark falls back to noise of the same shape
        return torch.rand(n, 784, generator=torch.Generator().manual_seed(0), dtype=torch.float64), "uniform noise"


def bench_entk(jac_rows: int, memory_mb: int) -> None:
    n, d, m, c = 512, 784, 4096, 10
    X64, source = mnist_or_noise(n)
    print(f"data: {source}, n={n}, d={d}; model m={m}, c={c}; threads={torch.get_num_threads()}", file=sys.stderr)
    model = build_model(ModelSpec("relu", d, m, c, seed=0), dtype=torch.float32)
    X = X64.to(torch.float32)

    chosen = empirical_ntk(model, X[:8])  # warm-up, and the path the library picks for this model
    print(f"empirical_ntk path for this model: {chosen.path}", file=sys.stderr)
    t = time.perf_counter()
    K_closed = entk_two_layer(model, X)
    t_closed = time.perf_counter() - t
    print(f"closed form, full (n, n, c, c), float32: {t_closed:.2f} s", file=sys.stderr)

    model64 = build_model(ModelSpec("relu", d, m, c, seed=0), dtype=torch.float64)
    t = time.perf_counter()
    entk_two_layer(model64, X64)
    print(f"closed form, float64 for the record: {time.perf_counter() - t:.2f} s", file=sys.stderr)

    budget = memory_mb * 2**20
    n_params = sum(p.numel() for p in model.parameters())
    chunk = max(1, budget // (2 * c * n_params * 4))  # entk_jacobian's chunk rule (float32)
    rows = n if jac_rows >= n else min(n, chunk * max(1, -(-jac_rows // chunk)))  # whole chunks only
    entk_jacobian(model, X[:1], X[:2], memory_bytes=budget)  # warm-up (torch.func tracing)
    t = time.perf_counter()
    K_jac = entk_jacobian(model, X[:rows], X, memory_bytes=budget)
    t_rows = time.perf_counter() - t
    # Each X1 chunk costs the same (its Jacobians, all of X2's recomputed, the contraction),
    # so the full time is the measured time times the number of X1 chunks.
    scale = -(-n // chunk) / -(-rows // chunk)
    t_jac = t_rows * scale
    err = ((K_jac - K_closed[:rows]).abs().max() / K_closed[:rows].abs().max()).item()
    how = (
        "measured in full"
        if rows == n
        else (
            f"measured on {rows}/{n} rows x {n} columns ({-(-rows // chunk)} chunk(s) of {chunk} rows), scaled x{scale:g}"
        )
    )
    print(
        f"jacobian contraction, float32, chunk {chunk} rows ({memory_mb} MB budget): {t_rows:.2f} s for {rows} rows "
        f"-> {t_jac:.1f} s ({how})",
        file=sys.stderr,
    )
    print(f"max relative difference between the two on the timed rows: {err:.2e}", file=sys.stderr)
    if rows < n:
        print(
            f"no extrapolation: the Jacobian method on {rows}/{n} of the rows took {t_rows / t_closed:.1f} x the "
            "closed form's time for the whole kernel",
            file=sys.stderr,
        )
    print(f"RATIO entk_closed_vs_jacobian={t_jac / t_closed:.1f}  ({how}; float32 both; n={n} d={d} m={m} c={c})")


def bench_paper_preset() -> None:
    from attnaudit.data import DataSpec, holdout_split, load_dataset
    from attnaudit.analyses.ntk_distance.run import PRESETS
    from attnaudit.analyses.ntk_distance.config import NTKDistanceConfig
    from attnaudit.analyses.ntk_distance.widths import run_ntk_distance

    preset = PRESETS["paper"]
    t0 = time.perf_counter()
    ds = load_dataset(
        DataSpec(
            dataset="mnist",
            split="test",
            data_dir=str(SHARED),
            n=preset["n_train"] + preset["n_test"],
            seed=0,
            stratify=True,
        )
    )
    train, test = holdout_split(ds, preset["n_train"], preset["n_test"], seed=0)
    cfg = NTKDistanceConfig(
        widths=preset["widths"],
        seeds=tuple(range(preset["seeds"])),
        steps=preset["steps"],
        float32_from_width=preset["float32_from_width"],
    )
    res = run_ntk_distance(train.X, train.y, test.X, test.y, ds.n_classes, cfg)
    wall = time.perf_counter() - t0
    for row in res.summary_rows():
        print(
            f"{row['model']:5s} m={row['width']:5d} distance={row['distance_rms']['mean']:.4g}"
            f" rel={row['distance_rel']['mean']:.3%} movement={row['kernel_movement']['mean']:.3g}",
            file=sys.stderr,
        )
    for v in res.verdicts():
        print(v, file=sys.stderr)
    print(f"WALL paper_preset_mnist_s={wall:.1f}  (threads={torch.get_num_threads()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jac-rows",
        type=int,
        default=1,
        help="rows of X1 timed for the Jacobian method, rounded up to whole chunks (512 = all)",
    )
    parser.add_argument("--memory-mb", type=int, default=2048, help="memory budget of the Jacobian chunks (MB)")
    parser.add_argument("--paper-preset", action="store_true", help="also time the paper preset on real MNIST")
    parser.add_argument("--skip-entk", action="store_true", help="skip item 1")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_entk:
        bench_entk(args.jac_rows, args.memory_mb)
    if args.paper_preset:
        bench_paper_preset()


if __name__ == "__main__":
    main()
