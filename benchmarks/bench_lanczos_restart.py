"""Benchmark: Lanczos with a memory-capped basis (thick restarts) against a full basis.

A large model's Lanczos basis is capped by ``--memory-mb`` (landscape keeps it within 4 x the
budget: 4 vectors of GPT-2-small in float32 at the default 512 MiB); the capped basis restarts
thick. This checks, on the Hessian of a trained MLP-Attn net (digits, cross-entropy), that the
capped runs reach the full basis's top eigenvalues at the same tolerance (they must agree to
the tolerance before any cost is reported) and prints what the cap costs in Hessian-vector
products, the unit of time of every Lanczos run:

    RATIO lanczos_restart_products=<products with a basis of 8 / products with a full basis>

plus, per basis size, the products, restarts, the largest relative eigenvalue difference and
the seconds.

Run:  python benchmarks/bench_lanczos_restart.py [--width 128] [--top-k 5] [--tol 1e-8] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from attnaudit.core import Engine, as_task, lanczos_top_eigen
from attnaudit.core.training import TrainConfig, train
from attnaudit.data import DataSpec, load_dataset
from attnaudit.models.builtin import ModelSpec, build_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--tol", type=float, default=1e-8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bases", default="8,12,24", help="capped basis sizes (comma-separated)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ds = load_dataset(DataSpec(dataset="digits", n=500, seed=0))
    X, y = ds.X, ds.y
    model = build_model(ModelSpec("attn", X.shape[1], args.width, ds.n_classes, seed=0), X)
    train(model, X, y, TrainConfig(loss="ce", lr=0.5, steps=200))
    engine = Engine(as_task(model, loss="ce", n_classes=ds.n_classes))
    op = engine.hvp_operator(X, engine.targets(y))
    P = engine.n_params
    print(f"MLP-Attn width {args.width} on digits (n=500): {P:,} parameters, top {args.top_k}, tol {args.tol:g}")

    def solve(basis: int | None):
        t0 = time.perf_counter()
        res = lanczos_top_eigen(op, P, args.top_k, max_steps=2000, tol=args.tol, seed=0, basis=basis)
        return res, time.perf_counter() - t0

    full, t_full = solve(None)
    if not full.converged:
        raise SystemExit("the full-basis run did not converge; raise the step limit")
    print(f"  full basis: {full.steps} products, {t_full:.2f} s, top {['%.8g' % e for e in full.eigenvalues]}")
    ref = torch.tensor(full.eigenvalues, dtype=torch.float64)
    ratios = {}
    for basis in (int(b) for b in args.bases.split(",")):
        res, t = solve(basis)
        diff = float(((torch.tensor(res.eigenvalues, dtype=torch.float64) - ref).abs() / ref.abs().max()).max())
        # agreement first: Ritz values that pass the tolerance are within about tol of the scale
        if not res.converged or diff > 10 * args.tol:
            raise SystemExit(f"basis {basis}: converged={res.converged}, eigenvalues {diff:.1e} off the full basis's")
        ratios[basis] = res.steps / full.steps
        print(
            f"  basis {basis:>3}: {res.steps} products ({res.restarts} restarts), {t:.2f} s, "
            f"max relative eigenvalue difference {diff:.1e}, products x{ratios[basis]:.2f}"
        )
    if 8 in ratios:
        print(f"RATIO lanczos_restart_products={ratios[8]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
