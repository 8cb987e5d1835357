"""Benchmark: batched 2-D loss-surface evaluation vs a loop that loads a state dict per point.

Same trained model, same filter-normalized directions, same grid; the evaluators must agree
to round-off before any time is reported. Two workloads, the sizes of the command's presets:

* ``paper``: MNIST (test split, n=2000, width 256, d=784), when the data are present;
* ``quick``: digits (n=500, width 256, d=64), always available.

Prints, per workload, the default evaluator (the declared fast path for TwoLayerNet:
structured evaluation) and the generic engine path (``vmap`` over ``Engine.apply``,
``fast_path=False``) against the loop, then

    RATIO landscape_batched_vs_loop=<x>

for the paper workload (the quick one when MNIST is absent), plus the other ratios under
their own names. The structured path forms X W^T once per direction, so its advantage grows
with the input dimension d: large on MNIST, small on digits (d = 64), where the per-point
output layer (n m c) is a sizeable share of the loop's cost n m (d + c).

Run:  python benchmarks/bench_landscape.py [--workload both|quick|paper] [--grid 31]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from attnaudit.analyses import landscape as L
from attnaudit.data import DataSpec, load_dataset
from attnaudit.models.builtin import ModelSpec, build_model
from attnaudit.core.training import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(name: str, spec: DataSpec, width: int, grid: int, repeats: int, vmap_too: bool) -> dict:
    ds = load_dataset(spec)
    X, y = ds.X, ds.y
    model = build_model(ModelSpec("relu", X.shape[1], width, ds.n_classes, seed=0), X)
    train(model, X, y, TrainConfig(loss="mse", lr=1.0, steps=50))
    params = {k: p.detach() for k, p in model.named_parameters()}
    d1, d2 = L.random_direction(params, 0), L.random_direction(params, 1)
    ax = L.symmetric_grid(grid, 1.0)
    A, B = torch.meshgrid(ax, ax, indexing="ij")
    coeffs = torch.stack([A.reshape(-1), B.reshape(-1)], 1)
    n_points = coeffs.shape[0]

    t_loop, ref = best_of(lambda: L.state_dict_loop(model, X, y, "mse", [d1, d2], coeffs), 1)
    t_fast, fast = best_of(lambda: L.evaluate_points(model, X, y, "mse", [d1, d2], coeffs), repeats)
    scale = float(ref.abs().max())
    err = float((fast.loss - ref).abs().max())
    assert err <= 1e-10 * scale, f"batched and loop disagree: {err}"
    print(
        f"[{name}] {ds.name}: n={X.shape[0]} d={X.shape[1]} width={width} grid={grid}x{grid} ({n_points} points), "
        f"torch threads={torch.get_num_threads()}"
    )
    print(f"  loop (load_state_dict per point): {t_loop:8.3f} s  ({1e3 * t_loop / n_points:.2f} ms/point)")
    print(f"  batched, {fast.path} ({fast.backend})")
    print(
        f"  {'':<32s} {t_fast:8.3f} s  ({fast.points_per_batch} points x "
        f"{fast.samples_per_batch} samples per call, max |diff| {err:.1e})"
    )
    out = {"batched": t_loop / t_fast}
    if vmap_too:
        t_vmap, gen = best_of(lambda: L.evaluate_points(model, X, y, "mse", [d1, d2], coeffs, fast_path=False), repeats)
        err_v = float((gen.loss - ref).abs().max())
        assert err_v <= 1e-10 * scale, f"vmap and loop disagree: {err_v}"
        print(
            f"  batched, {gen.path} ({gen.backend}) {t_vmap:8.3f} s  ({gen.points_per_batch} points x "
            f"{gen.samples_per_batch} samples per call, max |diff| {err_v:.1e})"
        )
        out["vmap"] = t_loop / t_vmap
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="both", choices=["both", "quick", "paper"])
    ap.add_argument("--data-dir", default=os.environ.get("ATTNAUDIT_DATA_DIR", str(SHARED)))
    ap.add_argument("--grid", type=int, default=31)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-vmap", action="store_true", help="skip the generic vmap path")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    have_mnist = (Path(args.data_dir) / "MNIST" / "raw").is_dir()
    ratios: dict[str, dict] = {}
    if args.workload in ("both", "paper"):
        if have_mnist:
            spec = DataSpec(dataset="mnist", data_dir=args.data_dir, split="test", n=2000, seed=0)
            ratios["paper"] = run("paper", spec, 256, args.grid, args.repeats, not args.no_vmap)
        else:
            print(f"[paper] skipped: no MNIST under {args.data_dir}")
    if args.workload in ("both", "quick"):
        ratios["quick"] = run(
            "quick", DataSpec(dataset="digits", n=500, seed=0), 256, args.grid, args.repeats, not args.no_vmap
        )
    main_key = "paper" if "paper" in ratios else "quick"
    print(f"RATIO landscape_batched_vs_loop={ratios[main_key]['batched']:.2f}")
    for key, r in ratios.items():
        if key != main_key:
            print(f"RATIO landscape_batched_vs_loop_{key}={r['batched']:.2f}")
        if "vmap" in r:
            print(f"RATIO landscape_vmap_generic_vs_loop_{key}={r['vmap']:.2f}")


if __name__ == "__main__":
    main()
