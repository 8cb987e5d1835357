"""Benchmark: influence on the built-in ViT, against textbook baselines, in one process.

Data: ``--n-train`` training and ``--n-test`` held-out MNIST test images from
``../shared/data`` (random images in [0, 1] with random labels when it is absent).
Model: ``attnaudit.models.vit.ViT`` (softmax attention), float64, cross-entropy loss, damping
``--damping``. Influence = -g_test^T (H + lambda I)^-1 g_i (attnaudit's sign convention).

1. ``RATIO vit_influence_cg_vs_dense`` -- every parameter tracked, on a ViT small enough
   for a dense Hessian (``--small-dim``, depth 1: a few thousand parameters):
   * attnaudit: ``compute_influence(..., InfluenceConfig(estimator="cg", params="all"))``
     (one batched CG solve with forward-over-reverse Hessian-vector products, then streamed
     per-sample gradients);
   * dense baseline: the textbook route -- the full Hessian row by row by double backward
     (P backward passes through ``torch.autograd.grad``), ``torch.linalg.solve``, and
     per-sample gradients in a Python loop;
   value = baseline time / attnaudit time (a speed-up; > 1 means attnaudit is faster).
2. ``RATIO vit_head_influence_vs_loop`` -- the head only, on the MNIST-sized ViT
   (``--dim``, ``--depth``): attnaudit's ``last-layer`` estimator (the ``nn.Linear`` head
   fast path: features cached once) against per-sample head gradients in a loop plus the
   head's dense Hessian by double backward; value = baseline time / attnaudit time.
3. An informational line: CG influence over all parameters of the MNIST-sized ViT (no
   baseline fits: its dense Hessian would need P^2 floats), with its time and iterations.

Both sides of each ratio must agree (max |difference| relative to the largest influence)
or the run fails. Best of ``--repeats`` after one warm-up.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vit_influence.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from attnaudit.core.engine import Engine, math_attention
from attnaudit.core.linalg import lanczos_top_eigen
from attnaudit.core.task import Task
from attnaudit.analyses.influence.influence import InfluenceConfig, compute_influence
from attnaudit.models.vit import ViT, ViTSpec

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def load_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(n, 784) float64 rows in [0, 1] and labels: real MNIST when present, else random."""
    try:
        from attnaudit.data import DataSpec, load_dataset

        ds = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(DATA), n=n, seed=seed, stratify=True))
        return ds.X, ds.y, "MNIST test split"
    except Exception:  # noqa: BLE001 - no data here: random images keep the benchmark runnable
        g = torch.Generator().manual_seed(seed)
        return (
            torch.rand(n, 784, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (n,), generator=g),
            "random images",
        )


def best_of(fn, repeats: int, warm_up: bool = True):
    if warm_up:
        fn()  # the first torch.func call in a process pays a one-off start-up cost
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _loss(model, rows, labels):
    logits = model(rows.reshape(-1, 1, 28, 28))
    return torch.nn.functional.cross_entropy(logits, labels, reduction="mean")


def dense_influence(model, params, X, y, Xt, yt, damping):
    """Textbook: Hessian rows by double backward, a dense solve, per-sample gradients in a loop."""
    with math_attention():
        g = torch.autograd.grad(_loss(model, X, y), params, create_graph=True)
        g = torch.cat([t.reshape(-1) for t in g])
        P = g.numel()
        H = torch.empty(P, P, dtype=g.dtype)
        for i in range(P):
            row = torch.autograd.grad(g[i], params, retain_graph=True)
            H[i] = torch.cat([t.reshape(-1) for t in row])
        g_test = torch.autograd.grad(_loss(model, Xt, yt) * len(yt), params)  # summed test loss
        g_test = torch.cat([t.reshape(-1) for t in g_test])
        s = torch.linalg.solve(H + damping * torch.eye(P, dtype=H.dtype), g_test)
        out = torch.empty(len(y), dtype=g.dtype)
        for i in range(len(y)):
            gi = torch.autograd.grad(_loss(model, X[i : i + 1], y[i : i + 1]), params)
            out[i] = -(torch.cat([t.reshape(-1) for t in gi]) @ s)
    return out


def agree(a: torch.Tensor, b: torch.Tensor, what: str, tol: float) -> float:
    err = float((a - b).abs().max() / b.abs().max())
    print(f"  {what}: max |difference| / max |influence| = {err:.2e}")
    if not err < tol:
        sys.exit(f"FAIL: {what} disagree ({err:.2e} >= {tol:g})")
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=256)
    ap.add_argument("--n-test", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--small-dim", type=int, default=12)
    ap.add_argument("--damping", type=float, default=1e-2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    X_all, y_all, source = load_rows(args.n_train + args.n_test, seed=0)
    X, y, Xt, yt = X_all[: args.n_train], y_all[: args.n_train], X_all[args.n_train :], y_all[args.n_train :]
    print(f"data: {source}, {len(y)} train / {len(yt)} test rows; threads {args.threads}")

    # 1. all parameters of a small ViT: CG vs dense
    small = ViT(
        ViTSpec("vit", (1, 28, 28), 10, depth=1, dim=args.small_dim, heads=2, patch=7, seed=0), dtype=torch.float64
    ).eval()
    params = [p for p in small.parameters()]
    P = sum(p.numel() for p in params)
    # A network's Hessian is indefinite (at this initialisation lambda_min is about -10); CG
    # needs a positive definite system, so the damping is raised above |lambda_min| (untimed
    # set-up: the dense Hessian from the engine's batched Hessian-vector products).
    engine = Engine(Task(small, 10, "ce", small.audit_inputs()), dtype=torch.float64)
    lam_min = float(torch.linalg.eigvalsh(engine.hvp_operator(engine.rows(X), engine.targets(y)).dense())[0])
    damping = max(args.damping, 1.5 * abs(lam_min)) if lam_min < 0 else args.damping
    print(f"small ViT: lambda_min(H) = {lam_min:.3g}, damping {damping:.3g}")
    cfg = InfluenceConfig(estimator="cg", params="all", damping=damping, cg_tol=1e-10)
    t_ours, ours = best_of(
        lambda: compute_influence(small, X, y, Xt, yt, cfg, loss="ce", n_classes=10, inputs=small.audit_inputs()),
        args.repeats,
    )
    t_dense, dense = best_of(lambda: dense_influence(small, params, X, y, Xt, yt, damping), 1, warm_up=False)
    print(
        f"all {P:,} parameters of a depth-1 dim-{args.small_dim} ViT: attnaudit cg {t_ours:.2f} s "
        f"({ours.diagnostics.get('iterations')} iterations), dense baseline {t_dense:.2f} s"
    )
    agree(ours.total, dense, "cg vs dense", 1e-6)
    print(f"RATIO vit_influence_cg_vs_dense={t_dense / t_ours:.2f}")

    # 2. the head of the MNIST-sized ViT: last-layer (fast path) vs per-sample loop + dense head Hessian
    vit = ViT(
        ViTSpec("vit", (1, 28, 28), 10, depth=args.depth, dim=args.dim, heads=4, patch=7, seed=0), dtype=torch.float64
    ).eval()
    head = [dict(vit.named_parameters())[n] for n in vit.head_parameter_names()]
    hcfg = InfluenceConfig(estimator="last-layer", damping=args.damping)
    t_head, res = best_of(
        lambda: compute_influence(vit, X, y, Xt, yt, hcfg, loss="ce", n_classes=10, inputs=vit.audit_inputs()),
        args.repeats,
    )
    t_loop, loop = best_of(lambda: dense_influence(vit, head, X, y, Xt, yt, args.damping), 1, warm_up=False)
    n_all = sum(p.numel() for p in vit.parameters())
    print(
        f"head ({res.n_params:,} of {n_all:,} parameters) of a depth-{args.depth} dim-{args.dim} ViT: attnaudit "
        f"last-layer {t_head:.3f} s ({res.path}), loop baseline {t_loop:.2f} s"
    )
    agree(res.total, loop, "last-layer vs loop", 1e-8)
    print(f"RATIO vit_head_influence_vs_loop={t_loop / t_head:.2f}")

    # 3. CG over every parameter of the MNIST-sized ViT (no baseline fits in memory); the
    # damping is raised above |lambda_min|, found by Lanczos on -H (untimed), as in part 1.
    big = Engine(Task(vit, 10, "ce", vit.audit_inputs()), dtype=torch.float64)
    op = big.hvp_operator(big.rows(X), big.targets(y))
    lam_min = -float(lanczos_top_eigen(lambda v: -op.matvec(v), big.n_params, 1, max_steps=60).eigenvalues[0])
    damping = max(args.damping, 1.5 * abs(lam_min)) if lam_min < 0 else args.damping
    t0 = time.perf_counter()
    full = compute_influence(
        vit,
        X,
        y,
        Xt,
        yt,
        InfluenceConfig(estimator="cg", params="all", damping=damping),
        loss="ce",
        n_classes=10,
        inputs=vit.audit_inputs(),
    )
    print(
        f"cg over all {n_all:,} parameters (lambda_min(H) ~ {lam_min:.3g}, damping {damping:.3g}): "
        f"{time.perf_counter() - t0:.1f} s, {full.diagnostics.get('iterations')} "
        f"iterations, converged {full.diagnostics.get('converged')} (a dense Hessian would need "
        f"{8 * n_all**2 / 2**30:.0f} GiB)"
    )


if __name__ == "__main__":
    main()
