"""Benchmark: the influence stage of ``malleability`` on the MNIST ViT over all 71,946
parameters, ``--estimator projected`` (LoGra / TRAK-style, Gauss-Newton in the projected
space) against ``--estimator ekfac``, in one process.

Workload: the checkpoint of ``attnaudit train --arch vit --dataset mnist --split test``
(trained here into a temporary folder unless ``--checkpoint`` is given), ``--n-train`` (300)
training and ``--n-test`` (100) held-out rows of the MNIST test split in ../shared/data,
cross-entropy (the checkpoint's training loss), damping 1e-3, float64 (the influence
default). The stage is what ``malleability --checkpoint vit.safetensors --params all
--n-train 300 --n-test 100 --seeds 1 --attacks pgd`` (``--protocol static``, the default for a
checkpoint) runs per seed: influence on the clean training set, then on the PGD-perturbed one
(eps 0.3, 10 steps, against the same model), each through ``influence_sweep`` with the
config ``MalleabilityConfig.influence`` holds. The PGD rows are computed once,
outside the timings. Projected starts with an empty row cache (``clear_row_cache``), so its
time includes computing every projected row of both training sets (PGD moves every row).

Prints the time of each side, their Spearman correlation with each other and (``--truth``,
the default) each side's Spearman and Pearson correlation with exact GGN influence on the
clean set (dense Jacobians over all parameters, a Woodbury solve; about a minute), and
``RATIO projected_vs_ekfac=<projected time / ekfac time>`` (goal <= 1). ``--proj-dim``
(default 512, the CLI's default). Skipped (exit 0) without MNIST.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_projected.py [--checkpoint vit.safetensors]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from attnaudit.analyses.influence.estimators.projected import clear_row_cache
from attnaudit.analyses.influence.influence import InfluenceConfig, influence_sweep
from attnaudit.analyses.malleability.attacks import AttackConfig, perturb
from attnaudit.core import Task
from attnaudit.data import DataSpec, load_dataset
from attnaudit.models.checkpoints import load_model_source

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().to(torch.float64)
    rb = b.argsort().argsort().to(torch.float64)
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


def exact_ggn_scores(task: Task, Xtr, ytr, Xte, yte, damping: float, rows_per_chunk: int = 10) -> torch.Tensor:
    """The ground truth: -g_i^T (GGN + damping I)^-1 sum_j g_test_j over all parameters, with
    GGN = (1/n) sum_i J_i^T H_i J_i (J_i the (c, P) Jacobian of sample i's logits, H_i the
    cross-entropy Hessian diag(p) - p p^T), from dense Jacobians by torch.func on a float64
    copy of the module and a Woodbury solve through the (n c) x (n c) Gram: no projection, no
    Kronecker factor, nothing of the estimators' code. (n c) x P floats: 1.7 GB at 300 rows."""
    import copy

    from torch.func import functional_call, grad, jacrev, vmap

    module = copy.deepcopy(task.module).to(torch.float64).eval()
    params = {k: v.detach() for k, v in module.named_parameters()}
    shape = task.inputs.shape

    def logits_one(p, x):
        return functional_call(module, p, (x.reshape(1, *shape),))[0]

    def loss_one(p, x, t):
        return torch.nn.functional.cross_entropy(logits_one(p, x)[None], t[None])

    def flat(tree, rows):
        return torch.cat([v.reshape(rows, -1) for v in tree.values()], 1)

    n = Xtr.shape[0]
    A_parts, G_parts = [], []
    for a in range(0, n, rows_per_chunk):
        x, t = Xtr[a : a + rows_per_chunk], ytr[a : a + rows_per_chunk]
        J = vmap(jacrev(logits_one), in_dims=(None, 0))(params, x)  # {name: (b, c, *shape)}
        b = x.shape[0]
        Jf = torch.cat([v.reshape(b, v.shape[1], -1) for v in J.values()], 2)  # (b, c, P)
        with torch.no_grad():
            prob = torch.softmax(vmap(logits_one, in_dims=(None, 0))(params, x), -1)
            H = torch.diag_embed(prob) - prob[:, :, None] * prob[:, None, :]
            e, V = torch.linalg.eigh(H)
            L = V * e.clamp_min(0).sqrt()[:, None, :]  # H = L L^T
        A_parts.append((L.transpose(1, 2) @ Jf).reshape(-1, Jf.shape[2]))  # rows of L_i^T J_i
        G_parts.append(flat(vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, t), b))
    A = torch.cat(A_parts) / n**0.5  # GGN = A^T A
    G = torch.cat(G_parts)  # (n, P) training gradients
    g_test = flat(vmap(grad(loss_one), in_dims=(None, 0, 0))(params, Xte, yte), Xte.shape[0]).sum(0)
    K = A @ A.T
    v = (g_test - A.T @ torch.linalg.solve(K + damping * torch.eye(K.shape[0], dtype=K.dtype), A @ g_test)) / damping
    return -(G @ v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--n-train", type=int, default=300)
    ap.add_argument("--n-test", type=int, default=100)
    ap.add_argument("--proj-dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--also-k", default="", help="more projected dimensions to compare with the truth, e.g. 2048,8192")
    ap.add_argument(
        "--truth", action=argparse.BooleanOptionalAction, default=True, help="exact GGN influence on the clean set"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not (SHARED / "MNIST").exists():
        print(f"SKIP: no MNIST under {SHARED}")
        return
    ckpt = args.checkpoint
    if ckpt is None:
        from attnaudit.cli import main as cli

        ckpt = str(Path(tempfile.mkdtemp(prefix="bench-projected-")) / "vit.safetensors")
        data = ["--dataset", "mnist", "--split", "test", "--data-dir", str(SHARED)]
        try:
            cli(["--threads", "1", "train", "--arch", "vit", *data, "--out", ckpt, "-q"])
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
    loaded = load_model_source(ckpt)
    task = Task(loaded.module.eval(), loaded.n_classes, "ce", loaded.inputs)
    n, m = args.n_train, args.n_test
    ds = load_dataset(DataSpec(dataset="mnist", split="test", data_dir=str(SHARED), n=n + m, seed=1))
    X, y = ds.X.to(torch.float64), ds.y
    Xtr, ytr, Xte, yte = X[:n], y[:n], X[n:], y[n:]
    adv = perturb(task, Xtr, ytr, AttackConfig(method="pgd", eps=0.3, clip_min=0.0, clip_max=1.0), "ce").X_adv
    P = sum(p.numel() for p in task.module.parameters())
    print(f"MNIST ViT: P={P}, {n} train x {m} test, static protocol (clean + pgd), threads={torch.get_num_threads()}")

    def stage(estimator: str):
        cfg = InfluenceConfig(params="all", estimator=estimator, damping=1e-3, proj_dim=args.proj_dim)
        clear_row_cache()
        t0 = time.perf_counter()
        clean = influence_sweep(task, Xtr, ytr, Xte, yte, cfg, loss="ce")[0]
        pert = influence_sweep(task, adv, ytr, Xte, yte, cfg, loss="ce")[0]
        return time.perf_counter() - t0, clean, pert

    best: dict[str, float] = {}
    out = {}
    for _ in range(args.repeats):
        for est in ("ekfac", "projected"):
            seconds, clean, pert = stage(est)
            best[est] = min(best.get(est, float("inf")), seconds)
            out[est] = (clean, pert)
    for est in ("ekfac", "projected"):
        clean, pert = out[est]
        mem = clean.diagnostics["memory_estimate_bytes"]["total"] / 2**20
        print(f"  {est:9s} {best[est]:7.2f} s (clean + pgd)   memory estimate {mem:,.0f} MB")
    d = out["projected"][0].diagnostics
    print(
        f"  projected: k used {d['proj_dim_used']}, curvature {d['curvature']}, "
        f"rows computed {d['projected_rows_computed']} + {out['projected'][1].diagnostics['projected_rows_computed']}"
    )
    for role, j in (("clean", 0), ("pgd", 1)):
        r = spearman(out["projected"][j].total, out["ekfac"][j].total)
        print(f"  Spearman projected vs ekfac ({role} scores): {r:.3f}")
    if args.truth:
        t0 = time.perf_counter()
        truth = exact_ggn_scores(task, Xtr, ytr, Xte, yte, 1e-3)
        print(f"  exact GGN influence (dense Jacobians, Woodbury): {time.perf_counter() - t0:.1f} s")
        for est in ("ekfac", "projected"):
            mine = out[est][0].total
            print(
                f"  {est:9s} vs exact GGN (clean): Spearman {spearman(mine, truth):.3f}, Pearson {pearson(mine, truth):.3f}"
            )
        for k in [int(v) for v in args.also_k.split(",") if v.strip()]:
            cfg = InfluenceConfig(params="all", estimator="projected", damping=1e-3, proj_dim=k)
            clear_row_cache()
            t0 = time.perf_counter()
            mine = influence_sweep(task, Xtr, ytr, Xte, yte, cfg, loss="ce")[0].total
            print(
                f"  projected k={k} (clean only, {time.perf_counter() - t0:.1f} s) vs exact GGN: "
                f"Spearman {spearman(mine, truth):.3f}, Pearson {pearson(mine, truth):.3f}"
            )
    print(f"RATIO projected_vs_ekfac={best['projected'] / best['ekfac']:.3f}")


if __name__ == "__main__":
    main()
